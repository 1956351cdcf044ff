"""The one place that hooks segment data and extra rollouts into verl's V1 sync trainer (thin).

Registered as ``trainer.v1.trainer_mode=rredcot`` (``main.py`` selects it). Compared with verl's ``PPOTrainerSync``:
- the actor worker class gains ``compute_segment_data`` (``workers.py``);
- after verl's old-log-prob pass, ``rredcot`` computes segment values on the actor, ``segment_mc`` samples
  continuations from each boundary prefix and ``ibpo`` generates repairs, both through the running rollout engine;
- the advantage step passes those per-trace tensors to the registered estimator (``estimators.estimator_inputs``).
For ``grpo`` and every other estimator it behaves exactly like ``PPOTrainerSync``.
"""

from __future__ import annotations

import time

import numpy as np
import ray
import torch
import transfer_queue as tq
from tensordict import TensorDict
from verl import DataProto
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.debug import marked_timer
from verl.utils.metric import reduce_metrics

from rredcot_verl import rollouts
from rredcot_verl.config import settings_from_config
from rredcot_verl.estimators import estimator_inputs
from rredcot_verl.workers import SegmentActorRolloutRefWorker

EXTRA_FIELDS = {
    "rredcot": ("seg_ends", "seg_raw_values"),
    "segment_mc": ("seg_ends", "seg_raw_values"),
    "ibpo": ("ibpo_phi", "ibpo_edited_mask"),
}


def _padded(value, padding=0):
    return value.to_padded_tensor(padding=padding) if getattr(value, "is_nested", False) else value


def _object_array(values: list) -> np.ndarray:
    """A 1-D object array, even when the elements are lists (chat messages) that numpy would broadcast."""
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        array[i] = value
    return array


def _non_tensor(data: TensorDict, key: str):
    if key not in data.keys():
        return None
    value = data[key]
    return list(value.tolist() if hasattr(value, "tolist") and not isinstance(value, list) else value)


@register_trainer("rredcot")
class SegmentCreditTrainer(PPOTrainerSync):
    def __init__(self, config):
        self.estimator = str(config.algorithm.adv_estimator)
        self.settings = settings_from_config(config.algorithm)
        super().__init__(config)

    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        for role in (Role.Actor, Role.ActorRollout, Role.ActorRolloutRef):
            if role in self.role_worker_mapping:
                self.role_worker_mapping[role] = ray.remote(SegmentActorRolloutRefWorker)

    # ------------------------------------------------------------------------------------------------------------
    def on_sample_end(self):
        # Extra generation (repairs, continuations) happens after the old-log-prob pass: keep the replicas awake
        # until then; they are put to sleep in _compute_old_log_prob.
        if self.estimator not in ("ibpo", "segment_mc"):
            super().on_sample_end()

    def _fetch(self, batch, fields) -> TensorDict:
        return tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=list(fields))

    def _put(self, batch, tensors: dict[str, torch.Tensor]) -> None:
        tq.kv_batch_put(
            keys=batch.keys, partition_id=batch.partition_id, fields=TensorDict(tensors, batch_size=len(batch))
        )

    def _trace_batch(self, batch) -> DataProto:
        """Prompts, responses, masks, entropies, outcomes and dataset fields of the step, as one DataProto."""
        data = self._fetch(
            batch,
            [
                "prompts", "responses", "response_mask", "entropy", "rm_scores", "uid",
                "reward_model", "extra_info", "data_source", "raw_prompt",
            ],
        )
        pad = self.tokenizer.pad_token_id
        prompt_lengths = data["prompts"].offsets().diff()
        prompts = data["prompts"].to_padded_tensor(padding=pad)
        responses = _padded(data["responses"], pad)
        response_mask = _padded(data["response_mask"])
        entropy = _padded(data["entropy"])
        width = responses.size(1)
        response_mask, entropy = response_mask[:, :width], entropy[:, :width]
        tensors = {
            "prompts": prompts,
            "responses": responses,
            "prompt_mask": self._lengths_to_mask(prompt_lengths, prompts.size(1)),
            "response_mask": response_mask,
            "entropy": entropy,
            "outcome": _padded(data["rm_scores"]).float().sum(-1),
        }
        non_tensors = {"uid": _object_array(_non_tensor(data, "uid"))}
        for key in ("reward_model", "extra_info", "data_source", "raw_prompt"):
            values = _non_tensor(data, key)
            if values is not None:
                non_tensors[key] = _object_array(values)
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)

    def _compute_old_log_prob(self, batch, metrics: dict):
        batch = super()._compute_old_log_prob(batch, metrics)
        if self.estimator == "rredcot":
            with marked_timer("segment_values", self.timing_raw, color="purple"):
                traces = self._trace_batch(batch)
                traces.meta_info["settings"] = self.settings
                output = self.actor_rollout_wg.compute_segment_data(traces)
                self._put(batch, {key: output.batch[key] for key in EXTRA_FIELDS["rredcot"]})
                # verl's concat turns each rank's metrics dict into a dict of lists; average over ranks.
                metrics.update(reduce_metrics(output.meta_info.get("metrics", {})))
        elif self.estimator in ("ibpo", "segment_mc"):
            with marked_timer(f"{self.estimator}_rollouts", self.timing_raw, color="purple"):
                started = time.perf_counter()
                traces = self._trace_batch(batch)
                if self.estimator == "ibpo":
                    tensors, extra_metrics = rollouts.ibpo_repairs(self, traces)
                else:
                    tensors, extra_metrics = rollouts.monte_carlo_values(self, traces)
                self._put(batch, tensors)
                extra_metrics[f"{self.estimator}/extra_rollout_time_s"] = time.perf_counter() - started
                metrics.update(extra_metrics)
            super().on_sample_end()
        return batch

    def _compute_advantage(self, batch, metrics: dict):
        fields = EXTRA_FIELDS.get(self.estimator, ())
        data = self._fetch(batch, ["uid", *fields])
        uid = np.array(_non_tensor(data, "uid"), dtype=object)
        tensors = {key: _padded(data[key]) for key in fields}
        with estimator_inputs(uid, tensors) as record:
            batch = super()._compute_advantage(batch, metrics)
        metrics.update(record["metrics"])
        if self.settings.snapshot_dir:
            self._write_snapshot(batch, tensors, record["details"])
        return batch

    def _write_snapshot(self, batch, tensors: dict, details: dict) -> None:
        """The step's traces with segment data and token advantages, for the credit report."""
        data = self._fetch(batch, ["prompts", "responses", "advantages", "rm_scores", "uid", "extra_info"])
        decode = self.tokenizer.decode
        prompts, responses = list(data["prompts"].unbind(0)), list(data["responses"].unbind(0))
        advantages, scores = list(data["advantages"].unbind(0)), list(data["rm_scores"].unbind(0))
        extra = _non_tensor(data, "extra_info") or [None] * len(batch)
        rows = []
        for i in range(len(batch)):
            response = responses[i].tolist()
            row = {
                "uid": str(_non_tensor(data, "uid")[i]),
                "prompt": decode(prompts[i].tolist(), skip_special_tokens=True),
                "response": decode(response, skip_special_tokens=False),
                "response_tokens": [decode([t], skip_special_tokens=False) for t in response],
                "outcome": float(scores[i].float().sum()),
                "token_advantages": advantages[i].float().tolist()[: len(response)],
                "extra_info": extra[i] if isinstance(extra[i], dict) else None,
            }
            for key in ("seg_ends", "seg_raw_values", "ibpo_edited_mask", "ibpo_phi"):
                if key in tensors:
                    row[key] = tensors[key][i].tolist()
            for key in ("values", "segment_rewards"):
                if key in details:
                    row[key] = details[key][i].tolist()
            rows.append(row)
        from rredcot_verl.report import write_snapshot  # lazy: `python -m rredcot_verl.report` imports this package

        write_snapshot(self.settings.snapshot_dir, self.global_steps, self.estimator, rows)
