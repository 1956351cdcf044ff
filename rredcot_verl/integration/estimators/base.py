"""What every estimator module shares: the batch an advantage function reads and what it returns, the step context
its stages get, and its spec.

An estimator is a function of one batch: ``advantage(batch: AdvantageBatch, settings: RRedCoTSettings) ->
AdvantageResult``. The trainer runs verl's own advantage step (``SegmentCreditTrainer._compute_advantage``), and the
benchmarks and the tests call the same function on batches of their own. verl's ``compute_advantage`` passes a
registered estimator only ``token_level_rewards``, ``response_mask``, ``index`` and ``config``, too little for these
estimators, so what is registered with verl under each name is one generic function (``register``) that calls the
trainer's step while the trainer lends it (``advantage_step``: it adds the step's inputs and keeps the result), and
refuses to run anywhere else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Callable, Hashable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from verl import DataProto
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, register_adv_est
from verl.utils.tokenizer import normalize_token_ids
from verl.utils.tokenizer.chat_template import apply_chat_template

from rredcot_verl.core.concordance import ConcordanceCounts
from rredcot_verl.core.redistribution import AdvantageResult
from rredcot_verl.core.settings import RRedCoTSettings
from rredcot_verl.core.traces import TraceRecord
from rredcot_verl.integration.rollouts import GenerateFn


@dataclass(frozen=True, eq=False)
class AdvantageBatch:
    """One training batch as an advantage function reads it: bs traces, T the padded response width, Kmax segment
    columns. The per-trace inputs are present when the estimator's stages produced them (``EstimatorSpec.inputs``).

    Attributes:
        scores: (bs,) float, each trace's outcome ζ on ``algorithm.rredcot.reward_range`` (the sum of verl's
            ``token_level_rewards``, i.e. of ``rm_scores``).
        response_mask: (bs, T) 0/1, verl's ``response_mask`` (0 on padding and on a multi-turn response's tool output).
        index: (bs,) object array, each trace's prompt group (verl's ``uid``).
        segment_ends: (bs, Kmax) int64, exclusive segment ends in positions of the full response, -1 padded
            (``rredcot``, ``segment_mc``, ``rredcot_ibpo``).
        raw_values: (bs, Kmax + 1) float32, the values v̂_0..v̂_K of the states S_0..S_K (column K = ζ), NaN padded.
        phi: (bs,) float32, each trace's repair signal φ (``core.ibpo.repair_signal``; ``ibpo``, ``rredcot_ibpo``).
        edited_mask: (bs, T) bool, the trace tokens its verified repairs changed (where blame lands).
        prior_concordance: the value gate's window of the previous batches (``ConcordanceWindow.pooled``); empty for
            a batch on its own.
    """

    scores: torch.Tensor
    response_mask: torch.Tensor
    index: np.ndarray
    segment_ends: torch.Tensor | None = None
    raw_values: torch.Tensor | None = None
    phi: torch.Tensor | None = None
    edited_mask: torch.Tensor | None = None
    prior_concordance: ConcordanceCounts = ConcordanceCounts()

    # Each per-trace input's key in verl's batch (TransferQueue), where the stages leave it for the advantage step,
    # and in the credit report's snapshot rows (``report.py`` reads them).
    BATCH_KEYS: ClassVar[dict[str, str]] = {
        "segment_ends": "seg_ends", "raw_values": "seg_raw_values", "phi": "ibpo_phi",
        "edited_mask": "ibpo_edited_mask",
    }  # fmt: skip

    def require(self, estimator: str, *names: str) -> tuple[torch.Tensor, ...]:
        """The per-trace inputs ``names``, refused by name when one is missing."""
        missing = [name for name in names if getattr(self, name) is None]
        if missing:
            raise ValueError(f"adv_estimator={estimator!r} needs the batch's {missing}, which its stages produce")
        return tuple(getattr(self, name) for name in names)


# (AdvantageBatch, algorithm.rredcot settings) -> AdvantageResult.
AdvantageFn = Callable[[AdvantageBatch, RRedCoTSettings], AdvantageResult]
_INPUTS = tuple(AdvantageBatch.BATCH_KEYS)


class EngineUse(enum.Enum):
    """When a stage runs relative to verl's old-log-prob pass, and whether it generates with the rollout engine.

    The engine's weights and KV cache must not sit beside the actor's log-prob micro-batches (on a GPU they hold
    ``rollout.gpu_memory_utilization`` of its memory), so a stage generates while the engine is still awake from
    the rollouts (``BEFORE_LOG_PROB_PASS``), or wakes it after the pass (``AFTER_LOG_PROB_PASS``, for a stage that
    reads the pass's outputs); the engine sleeps again before the next actor forward. ``NONE``: after the pass,
    without generating (it may run the actor's value pass).
    """

    NONE = "none"
    BEFORE_LOG_PROB_PASS = "before"
    AFTER_LOG_PROB_PASS = "after"


@dataclass
class StepTraces:
    """A training step's traces as every stage takes them, built once from verl's ragged tensors.

    Attributes:
        records: per trace, in batch order (``core.traces.TraceRecord``: tokens without padding, a multi-turn
            response whole with its ``response_mask``, outcome, prompt group, dataset fields; entropies when built
            after the log-prob pass).
        response_width: R, the batch's padded response width, the width of per-token inputs a stage writes.
    """

    records: list[TraceRecord]
    response_width: int

    def __len__(self) -> int:
        return len(self.records)

    @property
    def outcomes(self) -> torch.Tensor:
        """(bs,) float32 verified rewards ζ."""
        return torch.tensor([record.outcome for record in self.records], dtype=torch.float32)


@dataclass
class StepContext:
    """What a stage gets from the training step (rather than the trainer): for every stage the settings and the
    tokenizer; for the value pass the task, the boundary tables and the actor workers; for a stage that generates
    the rollout engine, the rollouts' reward and the length budgets (``integration.rollouts`` builds them).

    Attributes:
        settings: ``algorithm.rredcot``; tokenizer: the policy's.
        step: the training step (it seeds IBPO's choice of references).
        temperature: ``actor_rollout_ref.rollout.temperature``, the sampling distribution probes score under.
        task: ``settings.task`` resolved (``tasks.resolve_task``); boundary_vocab: the segmentation's token tables
            for this tokenizer (``RRedCoTSettings.boundary_vocab``).
        value_pass: the actor workers' ``value_pass`` (``workers.py``), for a stage that scores probes.
        generate: runs every (prompt ids, sampling params) request on the rollout engine; returns outputs with
            ``token_ids`` (the trainer's runs over verl's ``LLMServerClient``, ``rollouts.server_generate``).
        score: the rollouts' reward ``score(data_source, solution_str, ground_truth, extra_info) -> float``
            (``rollouts.reward_function``).
        max_prompt_length / max_response_length: ``data.max_prompt_length`` / ``data.max_response_length``.
        max_model_length: the rollout engine's context (prompt + generation) in tokens
            (``rollouts.engine_max_model_length``). It bounds IBPO's revision prompts, which hold a whole trace and a
            reference and so cannot live within ``data.max_prompt_length``. None: ``max_prompt_length +
            max_response_length``, a context every engine serving the step's rollouts provides (verl's vLLM server
            may provide more), so nothing is sent that the server would have to cut short.
        chat_template_kwargs: ``data.apply_chat_template_kwargs``, which verl renders the rollouts' prompts with (e.g.
            Qwen3's ``enable_thinking``); revision prompts get them too.
        verified_repairs: per prompt group, the token ids of the step's verified IBPO repairs, left by the repair
            stage (``ibpo.ibpo_repairs``) for the value stage's bank (``candidates.source: group_and_repairs``); None
            until the repair stage ran this step.
    """

    settings: RRedCoTSettings
    tokenizer: Any
    step: int
    temperature: float = 1.0
    task: Any = None
    boundary_vocab: Any = None
    value_pass: Callable[[DataProto], DataProto] | None = None
    generate: GenerateFn | None = None
    score: Callable[..., float] | None = None
    max_prompt_length: int | None = None
    max_response_length: int | None = None
    max_model_length: int | None = None
    chat_template_kwargs: dict = dataclasses.field(default_factory=dict)
    verified_repairs: dict[Hashable, list[list[int]]] | None = None

    def engine_length(self) -> int:
        """The context a request (prompt + generated tokens) may fill."""
        if self.max_model_length is None:
            return self.max_prompt_length + self.max_response_length
        return self.max_model_length

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat prompt as verl's agent loop renders a rollout's (``ContinuousTokenBuilder.
        render_prompt``: verl's ``apply_chat_template`` with the dataset's kwargs, then ``normalize_token_ids``)."""
        return normalize_token_ids(
            apply_chat_template(
                self.tokenizer, messages, tokenize=True, add_generation_prompt=True, **self.chat_template_kwargs
            )
        )


# A stage returns per-trace inputs of the advantage (``AdvantageBatch`` fields by name; the trainer keeps those among
# the spec's ``inputs``) and step metrics.
Producer = Callable[[StepContext, StepTraces], tuple[dict[str, torch.Tensor], dict[str, float]]]


@dataclass(frozen=True)
class Stage:
    """One producer of a training step, and where it runs (``EngineUse``)."""

    produce: Producer
    engine_use: EngineUse


def generates(stages: tuple[Stage, ...]) -> bool:
    """Some stage generates with the rollout engine: the step needs the engine, the rollouts' reward to judge what it
    generates, and the engine's context."""
    return any(stage.engine_use is not EngineUse.NONE for stage in stages)


@dataclass(frozen=True)
class EstimatorSpec:
    """One estimator, everything the trainer, launcher and workers need to know of it.

    Attributes:
        name: ``algorithm.adv_estimator``.
        inputs: the per-trace ``AdvantageBatch`` fields its stages write and its advantage function reads.
        stages: its producers for given ``algorithm.rredcot`` settings, in the order they run (each on the step's
            ``StepTraces`` with the step's ``StepContext``). Stages before verl's old-log-prob pass come first; a
            stage after the pass may read the pass's ``entropy`` (the trace batch carries it then).
        advantage: the advantage function, called by the trainer on the step's ``AdvantageBatch``.
        uses_value_pass: a stage scores probes on the actor workers (``StepContext.value_pass``).
        whole_traces_per_rank: its inputs are computed on whole traces (segment boundaries, the actor's value pass),
            so Ulysses sequence parallelism is refused at launch.
        fallback_advantage: what a trace gets where its values decide nothing (a closed value gate, in the log).
    """

    name: str
    inputs: tuple[str, ...]
    stages: Callable[[RRedCoTSettings], tuple[Stage, ...]]
    advantage: AdvantageFn
    uses_value_pass: bool
    whole_traces_per_rank: bool
    fallback_advantage: str = "GRPO's advantage"

    def __post_init__(self) -> None:
        unknown = [name for name in self.inputs if name not in _INPUTS]
        if unknown:
            raise ValueError(f"estimator {self.name!r}: inputs {unknown} are not AdvantageBatch inputs {_INPUTS}")

    @property
    def batch_keys(self) -> tuple[str, ...]:
        """The keys of its ``inputs`` in verl's batch."""
        return tuple(AdvantageBatch.BATCH_KEYS[name] for name in self.inputs)


# The step's advantages from what verl's compute_advantage passes a registered estimator (rewards, mask, uids), lent
# by the rredcot trainer for the time of verl's advantage step (``advantage_step``).
StepAdvantage = Callable[[torch.Tensor, torch.Tensor, np.ndarray], AdvantageResult]
_STEP_ADVANTAGE: ContextVar[StepAdvantage | None] = ContextVar("rredcot_step_advantage", default=None)


@contextlib.contextmanager
def advantage_step(advantage: StepAdvantage) -> Iterator[None]:
    """Within it, verl's ``compute_advantage`` of any of these estimators returns ``advantage(token_level_rewards,
    response_mask, index)``'s advantages and returns."""
    token = _STEP_ADVANTAGE.set(advantage)
    try:
        yield
    finally:
        _STEP_ADVANTAGE.reset(token)


def register(spec: EstimatorSpec) -> None:
    """Register the estimator's name with verl (``algorithm.adv_estimator`` must name a registered estimator): one
    generic function per name, which gives the rredcot trainer's advantages inside its ``advantage_step`` and refuses
    to run anywhere else, since verl's ``compute_advantage`` alone cannot give it the batch's inputs. Importing twice
    (the plugin hook and a user import) must not trip verl's duplicate-name check."""

    def in_the_rredcot_trainer(token_level_rewards, response_mask, index=None, config=None, **kwargs):
        advantage = _STEP_ADVANTAGE.get()
        if advantage is None:
            raise RuntimeError(
                f"adv_estimator={spec.name!r} reads inputs that only the rredcot trainer produces "
                f"({list(spec.inputs)}): launch through `python -m rredcot_verl.main` (it sets "
                "trainer.v1.trainer_mode=rredcot)"
            )
        result = advantage(token_level_rewards, response_mask, index)
        return result.advantages, result.returns

    if ADV_ESTIMATOR_REGISTRY.get(spec.name) is None:
        register_adv_est(spec.name)(in_the_rredcot_trainer)


def object_array(values: list) -> np.ndarray:
    """A 1-D object array, even when the elements are lists (chat messages) that numpy would broadcast."""
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        array[i] = value
    return array
