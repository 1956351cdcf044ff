"""``segment_mc``: Monte-Carlo values of the same boundaries (K continuations per prefix through the rollout engine,
``rollouts.monte_carlo_values``), then ``rredcot``'s redistribution: the expensive reference the others are measured
against."""

from __future__ import annotations

from typing import Any

import torch

from rredcot_verl.integration import rollouts
from rredcot_verl.integration.estimators.base import EngineUse, EstimatorSpec, Stage, StepContext, StepTraces
from rredcot_verl.integration.estimators.rredcot import SEGMENT_FIELDS, redistributed_advantage


def continuation_values(ctx: StepContext, traces: StepTraces) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Boundaries from the log-prob pass's entropies, values from sampled continuations."""
    return rollouts.monte_carlo_values(ctx.rollout(), traces)


def compute_segment_mc_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index=None, config: Any = None, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Monte-Carlo segment values (K continuations per boundary) through the same redistribution as ``rredcot``."""
    return redistributed_advantage("segment_mc", token_level_rewards, response_mask, index, config)


# Its boundaries need the pass's entropies: the engine is woken after the pass.
CONTINUATION_STAGE = Stage(continuation_values, EngineUse.AFTER_LOG_PROB_PASS)

SPEC = EstimatorSpec(
    name="segment_mc",
    fields=SEGMENT_FIELDS,
    stages=lambda settings: (CONTINUATION_STAGE,),
    advantage=compute_segment_mc_advantage,
    uses_value_pass=False,
    whole_traces_per_rank=True,
)
