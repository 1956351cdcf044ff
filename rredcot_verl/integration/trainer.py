"""The one place that hooks segment data and extra rollouts into verl's V1 sync trainer (thin).

Registered as ``trainer.v1.trainer_mode=rredcot`` (the launcher selects it); to verl's base class it is a sync trainer
(sync replay buffer, the configured ``data.gen_batch_size``, sync checkpoints and resume). Compared with verl's
``PPOTrainerSync``:
- the actor worker class gains ``value_pass`` (``workers.py``); before the workers are built, a model the value
  pass cannot score is refused by the launch's own check (``run_shapes.value_pass_model``), which the launch
  skips for a hub model not yet on its machine;
- the estimator's stages (its ``SPEC`` in ``estimators/``) write its per-trace inputs, given the step's
  ``StepContext``: ``rredcot`` plans probes from the whole batch after verl's old-log-prob pass and scores them on the
  actor; ``ibpo`` generates repairs through the rollout engine before that pass; ``rredcot_ibpo`` (and ``rredcot``
  with a repair-filled bank) does both, in that order; ``segment_mc`` needs the pass's entropies for its boundaries,
  so it wakes the engine after the pass (``update_weights``, verl's wake-and-sync, with the unchanged weights) to
  sample continuations. Either way the engine sleeps through the actor's forward passes, as in ``PPOTrainerSync``
  (``EngineUse``);
- every step counts the groups that verl's agent loop lost to an exception and stops the run past
  ``algorithm.rredcot.max_failed_group_share`` (``failures.py``);
- the advantage step builds the step's ``AdvantageBatch`` (outcomes, mask, uids, the stages' inputs and the value
  gate's window of recent batches, ``core.concordance.ConcordanceWindow``) and calls the estimator's advantage
  function on it; the window is saved with verl's checkpoints (``value_gate.json`` in each ``global_step_*`` folder)
  and restored on resume.
For ``grpo`` and every other estimator (no entry in ``ESTIMATORS``) it behaves exactly like ``PPOTrainerSync``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time

import numpy as np
import ray
import torch
import transfer_queue as tq
from tensordict import TensorDict
from transformers import AutoConfig
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.debug import marked_timer
from verl.utils.fs import copy_to_local

from rredcot_verl.compat import REPLAY_POLL_INTERVAL_S, cpu_mode_requested
from rredcot_verl.core.concordance import ConcordanceWindow
from rredcot_verl.core.outcomes import first_batch_scale_refusal
from rredcot_verl.core.settings import settings_from_config
from rredcot_verl.core.traces import records_from_arrays
from rredcot_verl.integration import failures, rollouts
from rredcot_verl.integration.estimators import (
    ESTIMATORS, AdvantageBatch, AdvantageResult, EngineUse, Stage, StepContext, StepTraces, advantage_step, generates,
)
from rredcot_verl.integration.run_shapes import value_pass_model
from rredcot_verl.integration.workers import SegmentActorRolloutRefWorker
from rredcot_verl.tasks import resolve_task

logger = logging.getLogger(__name__)


def _padded(value, padding=0):
    return value.to_padded_tensor(padding=padding) if getattr(value, "is_nested", False) else value


def _rows(value) -> list[torch.Tensor]:
    """The rows of a ragged (nested) or padded tensor."""
    return list(value.unbind(0))


def _response_lengths(masks: list[torch.Tensor], ragged: bool) -> list[int]:
    """Each response's length without padding: a ragged row is its own length (trailing tool output included); a
    padded (dense) row ends one past its last 1, since its padding and a trailing hole are both 0."""
    if ragged:
        return [mask.numel() for mask in masks]
    return [int(mask.nonzero()[-1, 0]) + 1 if mask.any() else 0 for mask in masks]


def _non_tensor(data: TensorDict, key: str):
    if key not in data.keys():
        return None
    value = data[key]
    return list(value.tolist() if hasattr(value, "tolist") and not isinstance(value, list) else value)


def step_traces(data, with_entropy: bool) -> StepTraces:
    """The step's traces (``StepTraces``) from the fields TransferQueue holds for them (ragged tensors, read without
    padding them; non-tensor lists), with the log-prob pass's ``entropy`` when ``with_entropy``."""
    masks = [mask.bool() for mask in _rows(data["response_mask"])]
    lengths = _response_lengths(masks, ragged=bool(getattr(data["response_mask"], "is_nested", False)))
    # Rows stay whole: a multi-turn response keeps its tool output and template tokens (mask 0), the context the
    # policy saw, and carries its mask; a response without holes carries none and reads as before.
    # Each trace owns its tensors: a row of a batch tensor is a view of the whole batch's storage, and a view
    # pickles that whole storage, so the value pass's request (every plan's tensors) grew as the batch squared.
    masks = [mask[:length].clone() for mask, length in zip(masks, lengths)]
    cut = lambda rows: [row[:length].clone() for row, length in zip(rows, lengths)]  # noqa: E731
    records = records_from_arrays(
        prompts=[row.clone() for row in _rows(data["prompts"])],
        responses=cut(_rows(data["responses"])),
        entropies=[row.float() for row in cut(_rows(data["entropy"]))] if with_entropy else None,
        response_masks=[None if mask.all() else mask for mask in masks],
        outcomes=[float(row.float().sum()) for row in _rows(data["rm_scores"])],
        groups=_non_tensor(data, "uid"),
        reward_models=_non_tensor(data, "reward_model"),
        extra_infos=_non_tensor(data, "extra_info"),
        raw_prompts=_non_tensor(data, "raw_prompt"),
        data_sources=_non_tensor(data, "data_source"),
    )
    responses = data["responses"]
    width = max((row.numel() for row in _rows(responses)), default=0) if responses.is_nested else responses.size(1)
    return StepTraces(records, response_width=width)


# The registered name selects this class (``trainer.v1.trainer_mode=rredcot``, set by the launcher); once built, the
# trainer's config names verl's "sync" mode (``SYNC_MODE``), which is what it is to verl.
TRAINER_NAME = "rredcot"
SYNC_MODE = "sync"
VALUE_GATE_FILE = "value_gate.json"


class RewardScaleError(ValueError):
    """The first batch's outcomes are on another scale than ``algorithm.rredcot.reward_range``."""


@register_trainer(TRAINER_NAME)
class SegmentCreditTrainer(PPOTrainerSync):
    def __init__(self, config):
        # The registered name selected this class (verl's TaskRunner reads trainer.v1.trainer_mode before building
        # it); from here on the mode is "sync" for verl: its base class takes its async paths (ReplayBufferAsync,
        # data.gen_batch_size forced to 1, prompts persisted in TransferQueue and TransferQueue checkpoints) for any
        # other name, and reads trainer.v1.<mode> sections by it. tests/test_trainer_mode_on_cpu.py checks that verl
        # reads the mode nowhere else.
        mode = str(config.trainer.v1.trainer_mode)
        if mode != TRAINER_NAME:
            raise ValueError(
                f"SegmentCreditTrainer is selected by trainer.v1.trainer_mode={TRAINER_NAME}, got {mode!r}"
            )
        config.trainer.v1.trainer_mode = SYNC_MODE
        self.estimator = str(config.algorithm.adv_estimator)
        self.spec = ESTIMATORS.get(self.estimator)
        self.settings = settings_from_config(config.algorithm)
        self.stages = () if self.spec is None else self.spec.stages(self.settings)
        self.task = resolve_task(self.settings.task)
        self.value_window = ConcordanceWindow(self.settings.redistribution.concordance_window)
        self.value_gate_open = True
        self.outcome_scale_checked = False
        super().__init__(config)

    # Overrides of verl's PPOTrainer / PPOTrainerSync members, each with why it must be there; everything else is
    # verl's own.

    def _build_replay_buffer(self):
        """verl's ``PPOTrainer._build_replay_buffer``; in CPU mode it polls for finished rollouts every
        ``REPLAY_POLL_INTERVAL_S`` (steps of seconds on CPU: verl's 2 s poll would round them up, compat/cpu.py)."""
        replay_buffer = super()._build_replay_buffer()
        if cpu_mode_requested():
            replay_buffer.poll_interval = REPLAY_POLL_INTERVAL_S
        return replay_buffer

    @functools.cached_property
    def boundary_vocab(self):
        """The segmentation's token tables for the policy's tokenizer (verl loads it in ``init()``)."""
        return self.settings.boundary_vocab(self.tokenizer)

    @functools.cached_property
    def engine_max_model_length(self) -> int:
        # Once per run: without rollout.max_model_len it reads the model's config, which for a hub id is a download
        # (or a cache lookup) that must not repeat every step.
        return rollouts.engine_max_model_length(self.config)

    @functools.cached_property
    def reward_score(self):
        """The rollouts' reward, for the extra generations (``rollouts.reward_function``)."""
        return rollouts.reward_function(self.config)

    def step_context(self) -> StepContext:
        """What the estimator's stages get from this step (one context per step: it carries between them). The rollout
        engine, the reward and the engine's context only where a stage generates: the reward needs
        ``reward.custom_reward_function``, which the launcher asks for only then (the same ``generates``)."""
        context = StepContext(
            settings=self.settings,
            tokenizer=self.tokenizer,
            step=int(self.global_steps),
            temperature=float(self.config.actor_rollout_ref.rollout.temperature),
            task=self.task,
            boundary_vocab=self.boundary_vocab,
            value_pass=self.actor_rollout_wg.value_pass,
            max_prompt_length=int(self.config.data.max_prompt_length),
            max_response_length=int(self.config.data.max_response_length),
            chat_template_kwargs=dict(self.config.data.get("apply_chat_template_kwargs", None) or {}),
        )
        if generates(self.stages):
            context.generate = rollouts.server_generate(self.get_llm_client())
            context.score = self.reward_score
            context.max_model_length = self.engine_max_model_length
        return context

    def _init_resource_pool_mgr(self):
        """verl's ``PPOTrainer._init_resource_pool_mgr``, with the actor worker class that has the value pass (verl
        builds the workers from ``role_worker_mapping``, which only this hook sees before they start). First the
        launch's model check (``run_shapes.value_pass_model``) on the model's config, which verl's ``_init_tokenizer``
        has fetched by now: the launch skips it for a hub model not yet on its machine, and the value pass's own guard
        would stop such a run only after its first rollouts."""
        if self.spec is not None:
            model = self.config.actor_rollout_ref.model
            hf_config = AutoConfig.from_pretrained(
                copy_to_local(str(model.path)), trust_remote_code=bool(model.get("trust_remote_code", False))
            )
            refusal = value_pass_model(self.config, self.spec, hf_config)
            if refusal:
                raise ValueError(refusal)
        super()._init_resource_pool_mgr()
        for role in (Role.Actor, Role.ActorRollout, Role.ActorRolloutRef):
            if role in self.role_worker_mapping:
                self.role_worker_mapping[role] = ray.remote(SegmentActorRolloutRefWorker)

    # ------------------------------------------------------------------------------------------------------------
    def _stages(self, engine_uses: tuple[EngineUse, ...]) -> list[Stage]:
        return [stage for stage in self.stages if stage.engine_use in engine_uses]

    def on_sample_end(self):
        """``PPOTrainerSync.on_sample_end`` (the replicas sleep), deferred when a stage generates before the log-prob
        pass (verl's step calls it right after sampling, before any hook of ours)."""
        # A stage that generates before the log-prob pass needs the replicas awake until it is done; they are put
        # to sleep in _compute_old_log_prob, before the actor's first forward.
        if not self._stages((EngineUse.BEFORE_LOG_PROB_PASS,)):
            super().on_sample_end()

    def _fetch(self, batch, fields) -> TensorDict:
        return tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=list(fields))

    def _put(self, batch, tensors: dict[str, torch.Tensor]):
        """Write ``tensors`` to the batch's rows; returns TransferQueue's batch metadata with them."""
        return tq.kv_batch_put(
            keys=batch.keys, partition_id=batch.partition_id, fields=TensorDict(tensors, batch_size=len(batch))
        )

    def _trace_batch(self, batch, with_entropy: bool) -> StepTraces:
        """The step's traces, read once from TransferQueue (``step_traces``); with the log-prob pass's entropies when
        ``with_entropy``."""
        fields = ["prompts", "responses", "response_mask", "rm_scores", "uid", "reward_model", "extra_info",
                  "data_source", "raw_prompt"]  # fmt: skip
        return step_traces(self._fetch(batch, [*fields, "entropy"] if with_entropy else fields), with_entropy)

    def _produce(self, stage: Stage, context: StepContext, batch, metrics: dict, with_entropy: bool) -> None:
        """Run one stage on the step's traces and write its inputs of the estimator to the batch, under their batch
        keys (``AdvantageBatch.BATCH_KEYS``)."""
        with marked_timer(f"{self.estimator}_inputs", self.timing_raw, color="purple"):
            started = time.perf_counter()
            inputs, extra_metrics = stage.produce(context, self._trace_batch(batch, with_entropy))
            keys = AdvantageBatch.BATCH_KEYS
            self._put(batch, {keys[name]: inputs[name] for name in self.spec.inputs if name in inputs})
            key = f"{self.estimator}/inputs_time_s"
            extra_metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - started
            metrics.update(extra_metrics)

    def _check_rollout_failures(self, batch, metrics: dict) -> None:
        """Log the groups verl's agent loop lost in the sampled batch; stop the run when they pass the configured
        share. The batch holds the traces the replay buffer sampled (verl's ``_balance_batch`` adds padding rows,
        tagged ``is_padding``) for ``train_batch_size // parameter_sync_step`` prompts, as verl's ``step`` asks."""
        keys = [key for key, tag in zip(batch.keys, batch.tags) if not tag.get("is_padding", False)]
        requested = int(self.config.data.train_batch_size) // self.parameter_sync_step
        count = failures.count_groups(keys, requested, int(self.config.actor_rollout_ref.rollout.n))
        metrics["rollout/failed_groups"] = float(count.failed)
        metrics["rollout/failed_group_share"] = count.share
        metrics["rollout/missing_traces"] = float(count.missing_traces)
        if count.failed and count.share > self.settings.max_failed_group_share:
            raise failures.RolloutFailure(
                f"step {self.global_steps}: {count.failed} of {count.requested} prompt groups lost "
                f"{count.missing_traces} traces to exceptions in verl's agent loop (reward function or generation), "
                f"more than algorithm.rredcot.max_failed_group_share={self.settings.max_failed_group_share}. "
                f"First error:\n{failures.first_error() or '(not recorded; see Error in _run_prompt in the log)'}"
            )

    def _check_first_outcome_scale(self, batch) -> None:
        """Stop the run at its first batch when the outcomes lie mostly outside ``algorithm.rredcot.reward_range``
        (a reward on another scale), before any extra generation or value pass is paid for; later outliers are the
        estimators' counted fallbacks."""
        if self.outcome_scale_checked:
            return
        self.outcome_scale_checked = True
        outcomes = [float(row.float().sum()) for row in _rows(self._fetch(batch, ["rm_scores"])["rm_scores"])]
        refusal = first_batch_scale_refusal(outcomes, self.settings.reward_range)
        if refusal:
            raise RewardScaleError(f"step {self.global_steps}: {refusal}")

    def _compute_old_log_prob(self, batch, metrics: dict):
        """verl's ``PPOTrainer._compute_old_log_prob`` (step 4, old log-probs), with the estimator's stages before and
        after it (``EngineUse``): the stages write the estimator's inputs, and only this step sees the engine awake
        and the pass's entropies (verl has no hook between sampling and the actor's first forward)."""
        # 1. the groups verl's agent loop lost this step: logged, and the run stopped past the configured share
        self._check_rollout_failures(batch, metrics)
        if self.spec is None:
            return super()._compute_old_log_prob(batch, metrics)
        self._check_first_outcome_scale(batch)
        context = self.step_context()
        # 2. stages that need only outcomes generate while the engine is still awake, then the engine sleeps
        before = self._stages((EngineUse.BEFORE_LOG_PROB_PASS,))
        for stage in before:
            self._produce(stage, context, batch, metrics, with_entropy=False)
        if before:
            super().on_sample_end()
        # 3. verl's log-prob pass (old log-probs, entropies) with the engine asleep
        batch = super()._compute_old_log_prob(batch, metrics)
        # 4. stages that read the pass: the value pass on the actor, or continuations with the engine woken by
        #    verl's own wake-and-sync (the actor's weights are unchanged yet) and put to sleep again after
        for stage in self._stages((EngineUse.NONE, EngineUse.AFTER_LOG_PROB_PASS)):
            if stage.engine_use is EngineUse.AFTER_LOG_PROB_PASS:
                self.checkpoint_manager.update_weights(self.global_steps)
                self._produce(stage, context, batch, metrics, with_entropy=True)
                super().on_sample_end()
            else:
                self._produce(stage, context, batch, metrics, with_entropy=True)
        return batch

    def _compute_advantage(self, batch, metrics: dict):
        """verl's ``PPOTrainer._compute_advantage`` (its KL penalty, rollout correction, ``compute_advantage`` and
        ragged write-back), for every estimator. For this package's, verl's ``compute_advantage`` calls the registered
        name, which within ``advantage_step`` builds the step's ``AdvantageBatch`` from what verl passes it (rewards,
        the corrected mask, uids) and calls the estimator's advantage function; its metrics, the value gate's window
        and the snapshot are taken from its result."""
        if self.spec is None:
            batch = super()._compute_advantage(batch, metrics)
            if self.settings.snapshot_due(self.global_steps):
                self._write_snapshot(batch)
            return batch
        computed: dict = {}

        def advantage(token_level_rewards, response_mask, uid) -> AdvantageResult:
            computed["inputs"] = self._advantage_batch(batch, token_level_rewards, response_mask, uid)
            computed["result"] = self.spec.advantage(computed["inputs"], self.settings)
            return computed["result"]

        with advantage_step(advantage):
            batch = super()._compute_advantage(batch, metrics)
        result = computed["result"]
        metrics.update(result.metrics)
        if result.concordance is not None:
            self.value_window.push(result.concordance)
            self._report_value_gate(result.metrics)
        if self.settings.snapshot_due(self.global_steps):
            self._write_snapshot(batch, computed["inputs"], result)
        return batch

    def _advantage_batch(self, batch, token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                         uid: np.ndarray) -> AdvantageBatch:
        """The step's ``AdvantageBatch``: outcomes, mask and uids as verl's ``compute_advantage`` passes them (padded;
        the mask after rollout correction), the estimator's inputs read back from their batch keys (rows checked
        against the uids), the value gate's window."""
        keys = self.spec.batch_keys
        data = self._fetch(batch, ["uid", *keys])
        if not np.array_equal(np.array(_non_tensor(data, "uid"), dtype=object), uid):
            raise ValueError(f"adv_estimator={self.estimator!r}: its inputs' rows do not match the batch's uid order")
        return AdvantageBatch(
            scores=token_level_rewards.sum(dim=-1),
            response_mask=response_mask,
            index=uid,
            prior_concordance=self.value_window.pooled(),
            **{name: _padded(data[key]) for name, key in zip(self.spec.inputs, keys)},
        )

    def _report_value_gate(self, step_metrics: dict) -> None:
        """Say in the log when the value gate closes or opens again (the metrics carry it every step)."""
        is_open = bool(step_metrics.get(f"{self.estimator}/value_gate_open", 1.0))
        if is_open != self.value_gate_open:
            pooled = step_metrics.get(f"{self.estimator}/value_concordance_pooled")
            logger.warning(
                "%s step %d: value gate %s (pooled value-outcome concordance %s, threshold %s)%s",
                self.estimator, self.global_steps, "opened" if is_open else "closed",
                "n/a" if pooled is None else f"{pooled:.3f}", self.settings.redistribution.min_value_concordance,
                "" if is_open else f": this batch trains with {self.spec.fallback_advantage}; see docs/choices.md, "
                "'Value gate'",
            )  # fmt: skip
        self.value_gate_open = is_open

    def _save_checkpoint(self):
        """verl's ``PPOTrainer._save_checkpoint``, plus the value gate's window (state verl does not know of)."""
        # Written first: verl's save ends by writing latest_checkpointed_iteration.txt and calling the checkpoint
        # callback (remote upload), after which the checkpoint counts as complete.
        folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, VALUE_GATE_FILE), "w") as handle:
            json.dump({"previous_batches": self.value_window.state_dict()}, handle)
        super()._save_checkpoint()

    def _load_checkpoint(self):
        """verl's ``PPOTrainer._load_checkpoint``, plus the value gate's window saved beside it."""
        super()._load_checkpoint()
        if self.global_steps == 0:
            return
        if self.config.trainer.resume_mode == "resume_path":
            folder = self.config.trainer.resume_from_path
        else:
            folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
        path = os.path.join(folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder), VALUE_GATE_FILE)
        if os.path.exists(path):
            with open(path) as handle:
                self.value_window.load_state_dict(json.load(handle)["previous_batches"])
        else:
            logger.warning("no %s in %s: the value gate's window starts empty", VALUE_GATE_FILE, folder)

    def _write_snapshot(
        self, batch, inputs: AdvantageBatch | None = None, result: AdvantageResult | None = None
    ) -> None:
        """The step's traces with the estimator's inputs (under their batch keys), its per-trace details and the token
        advantages, for the credit report (at most ``snapshot_max_traces``: whole prompt groups, the same rows as the
        step's ``_plans.pt``)."""
        data = self._fetch(batch, ["prompts", "responses", "advantages", "rm_scores", "uid", "extra_info"])
        decode = self.tokenizer.decode
        prompts, responses = list(data["prompts"].unbind(0)), list(data["responses"].unbind(0))
        advantages, scores = list(data["advantages"].unbind(0)), list(data["rm_scores"].unbind(0))
        extra = _non_tensor(data, "extra_info") or [None] * len(batch)
        uids = _non_tensor(data, "uid")
        per_trace = {}
        if inputs is not None:
            per_trace.update({AdvantageBatch.BATCH_KEYS[name]: getattr(inputs, name) for name in self.spec.inputs})
        for key in ("values", "segment_rewards"):
            if result is not None and getattr(result, key) is not None:
                per_trace[key] = getattr(result, key)
        rows = []
        for i in self.settings.snapshot_rows(uids):
            response = responses[i].tolist()
            row = {
                "uid": str(uids[i]),
                "prompt": decode(prompts[i].tolist(), skip_special_tokens=True),
                "response": decode(response, skip_special_tokens=False),
                "response_tokens": [decode([t], skip_special_tokens=False) for t in response],
                "outcome": float(scores[i].float().sum()),
                "token_advantages": advantages[i].float().tolist()[: len(response)],
                "extra_info": extra[i] if isinstance(extra[i], dict) else None,
            }
            row.update({key: tensor[i].tolist() for key, tensor in per_trace.items()})
            rows.append(row)
        from rredcot_verl.report import write_snapshot  # lazy: `python -m rredcot_verl.report` imports this package

        write_snapshot(self.settings.snapshot_dir, self.global_steps, self.estimator, rows, task=self.settings.task)
