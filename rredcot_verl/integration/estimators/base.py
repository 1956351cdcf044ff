"""What every estimator module shares: its spec, the step context its producer gets, and the channel to verl.

verl's ``compute_advantage`` passes a registered estimator only ``token_level_rewards``, ``response_mask``, ``index``
and ``config``; the per-trace segment or repair data that these estimators need travels beside that call in
``estimator_inputs`` (a context manager the trainer opens around verl's own ``_compute_advantage``). Rows are checked
against ``index`` so a reordering inside verl cannot silently misalign them. State that outlives a step (the value
gate's window of recent batches) stays with the trainer: it goes in as ``prior_concordance`` and this batch's counts
come back in the record's ``details`` (``StepRecord``).
"""

from __future__ import annotations

import contextvars
import dataclasses
import enum
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch
from verl import DataProto
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, register_adv_est

from rredcot_verl.core.concordance import ConcordanceCounts
from rredcot_verl.core.planning import TraceRecord
from rredcot_verl.core.settings import RRedCoTSettings, settings_from_config


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
    """A training step's traces as every producer takes them, built once from verl's ragged tensors.

    Attributes:
        records: per trace, in batch order (``core.planning.TraceRecord``: tokens without padding, a multi-turn
            response whole with its ``response_mask``, outcome, prompt group, dataset fields; entropies when built
            after the log-prob pass).
        response_width: R, the batch's padded response width, the width of per-token fields a producer writes.
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
    """What a producer gets from the training step (rather than the trainer).

    Attributes:
        settings: ``algorithm.rredcot``; tokenizer: the policy's; task: ``settings.task`` resolved.
        boundary_vocab: the segmentation's token tables for this tokenizer.
        step: the training step (seeds IBPO's choice of references).
        temperature: ``actor_rollout_ref.rollout.temperature``, the sampling distribution probes score under.
        rollout: builds the generation context (``rollouts.RolloutContext``: the engine's client, the rule reward,
            length budgets) for producers that generate.
        value_pass: the actor workers' ``compute_segment_data`` (``workers.py``), for producers that score probes.
        carry: what one stage of this step leaves for a later one (e.g. ``VERIFIED_REPAIRS``), empty at the start
            of every step.
    """

    settings: RRedCoTSettings
    tokenizer: Any
    task: Any
    boundary_vocab: Any
    step: int
    temperature: float
    rollout: Callable[[], Any]
    value_pass: Callable[[DataProto], DataProto]
    carry: dict[str, Any] = dataclasses.field(default_factory=dict)


_Inputs = TypeVar("_Inputs", bound="StepInputs")


@dataclass(frozen=True)
class StepInputs:
    """Per-trace tensors (rows in batch order) a producer hands to an advantage function: a subclass per estimator
    input, whose batch keys are ``PREFIX`` + its field names, so the names are written once.

    They travel through verl's batch (``to_batch``, written by the trainer) and come back in the advantage step
    (``from_batch``).
    """

    PREFIX: ClassVar[str]

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(cls.PREFIX + field.name for field in dataclasses.fields(cls))

    def to_batch(self) -> dict[str, torch.Tensor]:
        return {self.PREFIX + field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    @classmethod
    def from_batch(cls: type[_Inputs], tensors: Mapping[str, torch.Tensor]) -> _Inputs:
        return cls(**{field.name: tensors[cls.PREFIX + field.name] for field in dataclasses.fields(cls)})


# A producer returns its ``StepInputs`` as batch tensors (``to_batch``; the trainer keeps those among the spec's
# ``fields``) and step metrics.
Producer = Callable[[StepContext, StepTraces], tuple[dict[str, torch.Tensor], dict[str, float]]]


@dataclass(frozen=True)
class Stage:
    """One producer of a training step, and where it runs (``EngineUse``)."""

    produce: Producer
    engine_use: EngineUse


# verl's advantage-function signature: (token_level_rewards, response_mask, index, config) -> (advantages, returns).
AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class EstimatorSpec:
    """One estimator, everything the trainer, launcher and workers need to know of it.

    Attributes:
        name: ``algorithm.adv_estimator``.
        inputs: the kinds of per-trace inputs its stages write and its advantage function reads.
        stages: its producers for given ``algorithm.rredcot`` settings, in the order they run (each on the step's
            ``StepTraces`` with the step's ``StepContext``). Stages before verl's old-log-prob pass come first; a
            stage after the pass may read the pass's ``entropy`` (the trace batch carries it then).
        advantage: registered with verl under ``name``.
        uses_value_pass: a stage scores probes on the actor workers (``StepContext.value_pass``).
        whole_traces_per_rank: its inputs are computed on whole traces (segment boundaries, the actor's value pass),
            so Ulysses sequence parallelism is refused at launch.
        fallback_advantage: what a trace gets where its values decide nothing (a closed value gate, in the log).
    """

    name: str
    inputs: tuple[type[StepInputs], ...]
    stages: Callable[[RRedCoTSettings], tuple[Stage, ...]]
    advantage: AdvantageFn
    uses_value_pass: bool
    whole_traces_per_rank: bool
    fallback_advantage: str = "GRPO's advantage"

    @property
    def fields(self) -> tuple[str, ...]:
        """The batch keys of its ``inputs``."""
        return tuple(key for kind in self.inputs for key in kind.keys())


def register(spec: EstimatorSpec) -> None:
    """Register the spec's advantage function with verl; importing twice (the plugin hook and a user import) must
    not trip verl's duplicate-name check."""
    if ADV_ESTIMATOR_REGISTRY.get(spec.name) is None:
        register_adv_est(spec.name)(spec.advantage)


@dataclass
class StepRecord:
    """What ``estimator_inputs`` makes visible to the advantage step, and what the estimators leave in it.

    Attributes:
        uid: (bs,) the batch's prompt-group ids, the row order of ``tensors``.
        tensors: the estimator's batch keys (``StepInputs.keys``) to their padded tensors.
        prior_concordance: the value gate's window of recent batches.
        metrics: step metrics the estimators add.
        details: per-trace outputs for the trainer (``values``, ``segment_rewards``, ``fallback``) and this batch's
            ``concordance`` for the value gate's window.
    """

    uid: np.ndarray
    tensors: dict[str, torch.Tensor]
    prior_concordance: ConcordanceCounts
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


_INPUTS: contextvars.ContextVar[StepRecord | None] = contextvars.ContextVar("rredcot_estimator_inputs", default=None)


@contextmanager
def estimator_inputs(
    uid: np.ndarray, tensors: dict[str, torch.Tensor], prior_concordance: ConcordanceCounts = ConcordanceCounts()
):
    """Make per-trace inputs (rows aligned with ``uid``) and the value gate's window (``prior_concordance``)
    visible to the estimators; collects their metrics and details."""
    record = StepRecord(np.asarray(uid, dtype=object), tensors, prior_concordance)
    token = _INPUTS.set(record)
    try:
        yield record
    finally:
        _INPUTS.reset(token)


def step_inputs(name: str, kinds: tuple[type[StepInputs], ...], index) -> StepRecord:
    """The record ``estimator_inputs`` opened for this step, checked to hold the batch keys of ``kinds`` in
    ``index``'s row order."""
    keys = [key for kind in kinds for key in kind.keys()]
    record = _INPUTS.get()
    missing = keys if record is None else [k for k in keys if k not in record.tensors]
    if missing:
        raise KeyError(
            f"adv_estimator={name!r} needs batch keys {missing}, which only the rredcot trainer provides: launch "
            "through `python -m rredcot_verl.main` (it sets trainer.v1.trainer_mode=rredcot)"
        )
    if index is not None and not np.array_equal(np.asarray(index, dtype=object), record.uid):
        raise ValueError(f"adv_estimator={name!r}: segment data rows do not match the batch's uid order")
    return record


def settings_for(config) -> tuple[RRedCoTSettings, Any]:
    """``algorithm.rredcot`` and its redistribution section with verl's ``norm_adv_by_std_in_grpo``."""
    settings = settings_from_config(config)
    norm = config.get("norm_adv_by_std_in_grpo", True) if config is not None else True
    return settings, dataclasses.replace(settings.redistribution, norm_adv_by_std=bool(norm))


def object_array(values: list) -> np.ndarray:
    """A 1-D object array, even when the elements are lists (chat messages) that numpy would broadcast."""
    array = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        array[i] = value
    return array
