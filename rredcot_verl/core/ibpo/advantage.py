"""The IBPO advantage: shape the outcome with φ, normalise per group as GRPO does, then apply the token mask.

:func:`shaped_advantages` returns an :class:`IBPOResult` with the advantages, the shaped rewards and their metrics.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from rredcot_verl.core.ibpo.settings import IBPOSettings
from rredcot_verl.core.outcomes import (
    check_outcome_batch,
    check_reward_range,
    correct_outcomes,
    group_outcome_advantage,
)

__all__ = ["IBPOResult", "shaped_advantages"]


@dataclass(frozen=True)
class IBPOResult:
    """Output of :func:`shaped_advantages`.

    Attributes:
        advantages: (bs, T) per-token advantages (zero outside ``response_mask``).
        shaped_rewards: (bs,) ``R' = R + λφ`` before normalisation.
        metrics: finite float statistics, keys prefixed ``ibpo/``.
    """

    advantages: torch.Tensor
    shaped_rewards: torch.Tensor
    metrics: dict[str, float]


def shaped_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    phi: torch.Tensor,
    edited_masks: Optional[torch.Tensor],
    cfg: IBPOSettings,
    reward_range: tuple[float, float] = (0.0, 1.0),
) -> IBPOResult:
    """IBPO advantages: shape the outcome, normalise per group as GRPO does, then apply the token mask.

    ``R' = R + λφ·(high − R)`` on the scale ``reward_range = (low, high)``: the bonus closes a share ``λφ`` of the
    gap to a correct outcome. On a 0/1 reward this is the paper's ``R + λφ``; on any scale an incorrect trace
    (``R < high``) stays strictly below ``high`` because ``λφ ≤ λρ < 1``, and a higher ``R`` stays ahead for the same
    φ, so a repaired failure never outranks a correct trace nor a better partial one with the same φ (a bonus
    ``λφ·(high − low)`` would lift partial credit above ``high`` once ``R > high − λρ·(high − low)``).
    ``Â' = (R' − mean_group R') / (std_group R' + ε)`` (unbiased std; a group of one has mean 0
    and std 1, exactly verl's GRPO). With ``cfg.use_mask`` the mask variant follows, row by row:

    - correct traces, and incorrect traces without a localised successful repair (mask row all False):
      ``Â'`` on every response token (the GRPO broadcast);
    - incorrect traces with a localised repair: if ``Â' < 0``, ``Â'`` only on the edited tokens; if ``Â' > 0``
      (a repaired failure in a group of mostly hopeless ones), ``Â'`` only on the unchanged tokens, so the tokens
      the repair had to change are never reinforced. Zero elsewhere.

    The sign rule keeps the point of the mask: the tokens a repair had to change are never reinforced, and the
    tokens it kept are never blamed. The normalisation is ``outcomes.group_outcome_advantage`` (verl's
    arithmetic), so ``λ = 0`` with no mask (or ``use_mask=False``) returns exactly ``compute_grpo_outcome_advantage``'s
    output, and any λ without a mask equals verl's GRPO run on the shaped rewards.

    Args:
        scores: (bs,) outcome rewards R (``token_level_rewards.sum(-1)`` in verl). Must be finite.
        response_mask: (bs, T) 1 on response tokens.
        index: (bs,) group ids (verl's ``uid``).
        phi: (bs,) repair signals φ ≥ 0, from :func:`repair_signal`; must be 0 on correct traces.
        edited_masks: (bs, T) bool edited-token masks (:func:`stack_edited_masks`), or None for no localisation.
            Ignored when ``cfg.use_mask`` is False.
        cfg: settings; uses ``shaping_weight``, ``epsilon``, ``norm_adv_by_std``, ``use_mask``.
        reward_range: (low, high), the outcome scale (``algorithm.rredcot.reward_range``); high = correct.
    """
    bs = check_outcome_batch(scores, response_mask, index)
    if phi.shape != (bs,):
        raise ValueError(f"phi must have shape ({bs},), got {tuple(phi.shape)}")
    if not torch.isfinite(scores).all():
        bad = torch.nonzero(~torch.isfinite(scores)).flatten().tolist()
        raise ValueError(f"scores must be finite; non-finite outcome rewards at batch rows {bad}")
    bad_phi = ~torch.isfinite(phi) | (phi < 0)
    if bad_phi.any():
        rows = torch.nonzero(bad_phi).flatten().tolist()
        raise ValueError(f"phi must be finite and >= 0; bad repair signals at batch rows {rows}")
    low, high = check_reward_range(reward_range)
    correct = correct_outcomes(scores, (low, high))
    if (correct & (phi > 0)).any():
        # Repairs are only generated for incorrect traces: a signal on a correct row means misaligned rows or a
        # reward_range that disagrees with the one the repairs were planned with.
        rows = torch.nonzero(correct & (phi > 0)).flatten().tolist()
        raise ValueError(
            f"phi > 0 on correct traces (outcome reaches {high}, the top of reward_range) at batch rows {rows}"
        )
    use_mask = cfg.use_mask and edited_masks is not None
    if use_mask:
        if edited_masks.shape != response_mask.shape or edited_masks.dtype != torch.bool:
            raise ValueError(
                f"edited_masks must be a bool tensor of shape {tuple(response_mask.shape)}, "
                f"got {edited_masks.dtype} {tuple(edited_masks.shape)}"
            )
        if (edited_masks & ~response_mask.bool()).any():
            raise ValueError(
                "edited_masks marks tokens outside response_mask; align repairs against the valid response tokens"
            )

    with torch.no_grad():
        shaped = scores + cfg.shaping_weight * phi.to(scores.dtype) * (high - scores)
        normalised, _ = group_outcome_advantage(shaped, index, cfg.epsilon, cfg.norm_adv_by_std)
        advantages = normalised.unsqueeze(-1) * response_mask

        localised = (
            edited_masks.any(dim=-1) & ~correct if use_mask else torch.zeros(bs, dtype=torch.bool)
        )
        negative = localised & (normalised < 0)
        positive = localised & (normalised > 0)
        if localised.any():
            keep = torch.ones_like(response_mask, dtype=torch.bool)
            keep[negative] = edited_masks[negative]
            keep[positive] = ~edited_masks[positive]
            advantages = advantages.masked_fill(~keep, 0.0)

    return IBPOResult(
        advantages=advantages,
        shaped_rewards=shaped,
        metrics=_advantage_metrics(scores, response_mask, index, phi, advantages, localised, positive, correct),
    )


def _advantage_metrics(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    phi: torch.Tensor,
    advantages: torch.Tensor,
    localised: torch.Tensor,
    positive: torch.Tensor,
    correct: torch.Tensor,
) -> dict[str, float]:
    groups: dict = defaultdict(list)
    for i, group_id in enumerate(index):
        groups[group_id].append(i)
    all_wrong = [rows for rows in groups.values() if not correct[rows].any()]
    all_wrong_with_signal = sum(bool(advantages[rows].ne(0).any()) for rows in all_wrong)
    incorrect = ~correct
    n_incorrect = int(incorrect.sum())
    repaired = incorrect & (phi > 0)
    tokens_localised = response_mask[localised].bool()
    return {
        "ibpo/incorrect_repaired_frac": float(repaired.sum()) / n_incorrect if n_incorrect else 0.0,
        "ibpo/phi_mean_incorrect": float(phi[incorrect].mean()) if n_incorrect else 0.0,
        "ibpo/all_wrong_groups": float(len(all_wrong)),
        "ibpo/all_wrong_groups_with_signal_frac": all_wrong_with_signal / len(all_wrong) if all_wrong else 0.0,
        "ibpo/singleton_groups": float(sum(len(rows) == 1 for rows in groups.values())),
        "ibpo/masked_traces": float(localised.sum()),
        "ibpo/masked_positive_traces": float(positive.sum()),
        "ibpo/broadcast_repaired_traces": float((repaired & ~localised).sum()),
        "ibpo/masked_token_frac": (
            float((advantages[localised].ne(0) & tokens_localised).sum()) / float(tokens_localised.sum())
            if bool(tokens_localised.any())
            else 0.0
        ),
    }
