"""``ibpo``: repairs of incorrect traces, generated through the rollout engine and aligned token by token
(``rollouts.ibpo_repairs``), shape the reward and decide where blame lands (``core.ibpo.shaped_advantages``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rredcot_verl.core.ibpo import IBPOSettings, shaped_advantages
from rredcot_verl.integration import rollouts
from rredcot_verl.integration.estimators.base import (
    EngineUse,
    EstimatorSpec,
    Stage,
    StepContext,
    StepTraces,
    settings_for,
    step_inputs,
)

IBPO_FIELDS = ("ibpo_phi", "ibpo_edited_mask")
# StepContext.carry key: per prompt group, the token ids of its verified repairs (for a repair-filled value bank).
VERIFIED_REPAIRS = "verified_repairs"


def repairs(ctx: StepContext, traces: StepTraces) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Repairs need only the traces and their outcomes: generated while the engine is still awake from the rollouts.
    The verified ones are left in ``ctx.carry`` for a later stage's reference bank."""
    tensors, metrics, verified = rollouts.ibpo_repairs(ctx.rollout(), traces)
    ctx.carry[VERIFIED_REPAIRS] = verified
    return tensors, metrics


REPAIR_STAGE = Stage(repairs, EngineUse.BEFORE_LOG_PROB_PASS)


def ibpo_settings(config) -> tuple[Any, Any, IBPOSettings]:
    """``algorithm.rredcot``, its redistribution and IBPO sections, both with verl's ``norm_adv_by_std_in_grpo``."""
    settings, redistribution = settings_for(config)
    return settings, redistribution, dataclasses.replace(settings.ibpo, norm_adv_by_std=redistribution.norm_adv_by_std)


def compute_ibpo_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index=None, config: Any = None, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """IBPO: repair-shaped reward R + λφ(high − R) before group normalisation, advantage masked to the edited tokens.

    ``high`` and the correctness threshold come from ``algorithm.rredcot.reward_range``, the scale the repairs were
    judged on.

    Args:
        token_level_rewards: (bs, T); response_mask: (bs, T); index: (bs,) uids; config: verl's ``algorithm``.
    Returns:
        advantages (bs, T), returns (bs, T).
    """
    record = step_inputs("ibpo", IBPO_FIELDS, index)
    settings, _, cfg = ibpo_settings(config)
    result = shaped_advantages(
        token_level_rewards.sum(dim=-1),
        response_mask,
        index,
        record["tensors"]["ibpo_phi"],
        record["tensors"]["ibpo_edited_mask"].bool() if cfg.use_mask else None,
        cfg,
        reward_range=settings.reward_range,
    )
    record["metrics"].update(result.metrics)
    return result.advantages, result.advantages


SPEC = EstimatorSpec(
    name="ibpo",
    fields=IBPO_FIELDS,
    stages=lambda settings: (REPAIR_STAGE,),
    advantage=compute_ibpo_advantage,
    uses_value_pass=False,
    whole_traces_per_rank=False,
)
