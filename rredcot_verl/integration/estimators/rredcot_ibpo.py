"""``rredcot_ibpo``: IBPO's repair-shaped outcome, redistributed over segments by values from a bank its verified
repairs fill (``core.fused``). Two stages: IBPO's repairs through the rollout engine before the log-prob pass, then
the actor's value pass on the bank (``candidates.source``; ``group_and_repairs`` needs no reference solutions)."""

from __future__ import annotations

from typing import Any

import torch

from rredcot_verl.core.fused import fused_advantages
from rredcot_verl.integration.estimators.base import EstimatorSpec, step_inputs
from rredcot_verl.integration.estimators.ibpo import REPAIR_STAGE, IBPOInputs, ibpo_settings
from rredcot_verl.integration.estimators.rredcot import VALUE_STAGE, SegmentInputs, record_redistribution

NAME = "rredcot_ibpo"
INPUTS = (IBPOInputs, SegmentInputs)


def compute_rredcot_ibpo_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index=None, config: Any = None, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """IBPO's shaped advantage per trace, placed on its segments by the values (IBPO's row where they decide nothing).

    Args:
        token_level_rewards: (bs, T); response_mask: (bs, T); index: (bs,) uids; config: verl's ``algorithm``.
    Returns:
        advantages (bs, T), returns (bs, T).
    """
    record = step_inputs(NAME, INPUTS, index)
    repairs, segments = IBPOInputs.from_batch(record.tensors), SegmentInputs.from_batch(record.tensors)
    settings, redistribution, ibpo_cfg = ibpo_settings(config)
    result = fused_advantages(
        token_level_rewards.sum(dim=-1),
        response_mask,
        index,
        segments.ends,
        segments.raw_values,
        repairs.phi,
        repairs.edited_mask.bool() if ibpo_cfg.use_mask else None,
        ibpo_cfg,
        redistribution,
        settings.rredcot_ibpo,
        reward_range=settings.reward_range,
        prior_concordance=record.prior_concordance,
    )
    record.metrics.update(result.ibpo.metrics)
    record_redistribution(NAME, record, result.redistribution, result.metrics)
    return result.advantages, result.advantages


SPEC = EstimatorSpec(
    name=NAME,
    inputs=INPUTS,
    stages=lambda settings: (REPAIR_STAGE, VALUE_STAGE),
    advantage=compute_rredcot_ibpo_advantage,
    uses_value_pass=True,
    whole_traces_per_rank=True,
    fallback_advantage="IBPO's advantage",
)
