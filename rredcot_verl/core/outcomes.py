"""Outcomes: the reward scale, what counts as correct, GRPO's group baseline and the checks every outcome-based
estimator makes. One place for what ``redistribution``, ``ibpo``, ``planning`` and the settings all need.

Outcomes ζ lie on a declared scale [low, high] (``algorithm.rredcot.reward_range``, high = correct). Imports only torch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch

CORRECT_TOLERANCE = 1e-6
"""Relative tolerance (times ``high − low``) under which an outcome still counts as reaching ``high``: a reward
summed from float token rewards may land a rounding error below the top of its scale."""


def check_reward_range(reward_range) -> tuple[float, float]:
    """``(low, high)`` as floats; two finite numbers with low < high, else ValueError."""
    try:
        low, high = (float(x) for x in reward_range)
    except (TypeError, ValueError) as error:
        raise ValueError(f"reward_range must be two numbers (low, high), got {reward_range!r}") from error
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"reward_range must be (low, high) with low < high, both finite, got {reward_range!r}")
    return low, high


def correct_outcomes(
    scores: torch.Tensor | Sequence[float], reward_range: tuple[float, float] = (0.0, 1.0)
) -> torch.Tensor:
    """(bs,) bool: which outcomes count as correct, i.e. reach ``high`` of ``reward_range`` (within tolerance).

    ``> low`` would call partial credit correct and never shape it; ``>= high`` is the verifier's "solved".

    Args:
        scores: (bs,) outcome rewards.
        reward_range: (low, high), high = correct.
    """
    low, high = check_reward_range(reward_range)
    values = scores if isinstance(scores, torch.Tensor) else torch.tensor(list(scores), dtype=torch.float64)
    return values.double() >= high - CORRECT_TOLERANCE * (high - low)


def is_correct(outcome: float, reward_range: tuple[float, float]) -> bool:
    """``correct_outcomes`` for one outcome."""
    return bool(correct_outcomes([float(outcome)], reward_range)[0])


def success_probability(outcome: float, reward_range: tuple[float, float]) -> float:
    """An outcome on the probability scale of the value sources: 0 at ``low``, 1 at ``high``, clamped."""
    low, high = check_reward_range(reward_range)
    return min(max((float(outcome) - low) / (high - low), 0.0), 1.0)


FIRST_BATCH_OUTSIDE_SHARE = 0.5
"""A first batch with more than this share of its outcomes outside ``reward_range`` stops the run: a reward on
another scale (verl's ``math_dapo`` scores a wrong answer −1) would make every such trace a GRPO fallback, with the
extra work paid. Later batches count their outliers (``fallback/outside_reward_range``) and train on."""


def first_batch_scale_refusal(
    scores: torch.Tensor | Sequence[float], reward_range: tuple[float, float]
) -> str | None:
    """The one-line reason to stop a run whose first batch of outcomes lies mostly outside ``reward_range``, or None.

    Args:
        scores: (bs,) the first batch's outcomes (verl's ``rm_scores`` summed per trace); non-finite ones count as
            outside.
        reward_range: (low, high), ``algorithm.rredcot.reward_range``.
    """
    low, high = check_reward_range(reward_range)
    values = scores if isinstance(scores, torch.Tensor) else torch.tensor(list(scores), dtype=torch.float64)
    values = values.double().reshape(-1)
    if values.numel() == 0:
        return None
    slack = CORRECT_TOLERANCE * (high - low)
    outside = ~((values >= low - slack) & (values <= high + slack))  # NaN compares False: outside
    if int(outside.sum()) <= FIRST_BATCH_OUTSIDE_SHARE * values.numel():
        return None
    finite = values[values.isfinite()]
    seen = f"they lie in [{finite.min().item():g}, {finite.max().item():g}]" if finite.numel() else "none is finite"
    return (
        f"{int(outside.sum())} of {values.numel()} outcomes of the first batch lie outside "
        f"algorithm.rredcot.reward_range=[{low:g}, {high:g}] ({seen}): set algorithm.rredcot.reward_range to the "
        "reward's scale (verl's math_dapo scores -1 / +1)"
    )


def group_outcome_advantage(
    scores: torch.Tensor, index, epsilon: float = 1e-6, norm_adv_by_std: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's group-normalised outcome advantage, with the arithmetic of verl 0.9.1's
    ``compute_grpo_outcome_advantage`` (so ``adv[:, None] * response_mask`` equals verl's output bit for bit).

    Args:
        scores: (bs,) float, outcome per trace (verl: ``token_level_rewards.sum(-1)``).
        index: (bs,) hashables, the prompt (group) id of each trace.
        epsilon: added to the group std.
        norm_adv_by_std: divide by the group std (GRPO) or not (Dr.GRPO).

    Returns:
        adv: (bs,) advantage. As in verl, a group of one has mean 0 and std 1, so its advantage is its score.
        group_mean: (bs,) true mean score of each trace's group (for a group of one, its own score).
    """
    if scores.dim() != 1 or not scores.is_floating_point():
        raise ValueError(f"scores must be a 1-D float tensor, got shape {tuple(scores.shape)} dtype {scores.dtype}")
    bsz = scores.shape[0]
    if len(index) != bsz:
        raise ValueError(f"index has {len(index)} entries but scores has {bsz}")
    if bsz == 0:
        return scores.clone(), scores.clone()
    adv = scores.clone()  # verl overwrites its scores in place
    id2score = defaultdict(list)
    id2mean, id2std, true_mean = {}, {}, {}
    with torch.no_grad():
        for i in range(bsz):
            id2score[index[i]].append(adv[i])
        for idx, group in id2score.items():
            if len(group) == 1:
                id2mean[idx] = torch.tensor(0.0)
                id2std[idx] = torch.tensor(1.0)
                true_mean[idx] = group[0].clone()
            else:
                scores_tensor = torch.stack(group)
                id2mean[idx] = torch.mean(scores_tensor)
                id2std[idx] = torch.std(scores_tensor)
                true_mean[idx] = id2mean[idx]
        group_mean = torch.stack([true_mean[index[i]] for i in range(bsz)])
        for i in range(bsz):
            if norm_adv_by_std:
                adv[i] = (adv[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
            else:
                adv[i] = adv[i] - id2mean[index[i]]
    return adv, group_mean


def check_outcome_batch(scores: torch.Tensor, response_mask: torch.Tensor, index) -> int:
    """Shape checks shared by the outcome-based estimators; returns the batch size.

    Args:
        scores: (bs,) float outcomes; response_mask: (bs, T); index: (bs,) group ids.
    """
    if scores.dim() != 1 or not scores.is_floating_point():
        raise ValueError(f"scores must be a 1-D float tensor, got shape {tuple(scores.shape)} dtype {scores.dtype}")
    bsz = scores.shape[0]
    if response_mask.dim() != 2 or response_mask.shape[0] != bsz:
        raise ValueError(f"response_mask must have shape (bs={bsz}, T), got {tuple(response_mask.shape)}")
    if len(index) != bsz:
        raise ValueError(f"index has {len(index)} entries but scores has {bsz}")
    return bsz
