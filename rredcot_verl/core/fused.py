"""``rredcot_ibpo``: IBPO's shaped outcome, redistributed over segments by values from a bank its repairs fill.

For trace i of a group, IBPO shapes the verified outcome, R'_i = R_i + λφ_i(high − R_i) (``core.ibpo``), and GRPO
normalises R' within the group (Â'_i). The redistribution (``core.redistribution``, with ``shaped_scores``) spreads
Â'_i over the trace's segments in proportion to the differences of its boundary values, anchored at the group mean of
R' and ending at the verified ζ_i, so the trace's token mean stays Â'_i. The values come from a reference bank that
needs no reference solutions: the group's correct traces and, for a group without one, the verified repairs IBPO
generated anyway (``candidates.source: group_and_repairs``). So a group whose traces all failed still gets a gradient
(IBPO's shaping) that lands on the step where each trace went wrong (the values).

Where the values decide nothing for a trace, it takes IBPO's own row (mask variant): its values are missing or not
finite, its group's anchor equals its outcome, its values were interpolated, they sum against Â' (a repaired
failure above its group's mean), or the value gate is closed for the batch. ``wrong_trace_credit`` says what
happens on an incorrect trace with a localised repair (docs/choices.md, "Fused estimator").

Imports only torch and the core.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rredcot_verl.core.concordance import ConcordanceCounts
from rredcot_verl.core.ibpo import IBPOResult, IBPOSettings, shaped_advantages
from rredcot_verl.core.outcomes import correct_outcomes
from rredcot_verl.core.redistribution import AdvantageResult, RedistributionSettings, redistribute

WRONG_TRACE_CREDIT = ("values", "edit_mask")


@dataclass(frozen=True)
class FusedSettings:
    """``rredcot_ibpo``: how IBPO's edit mask and the segment values share an incorrect trace.

    Attributes:
        wrong_trace_credit: where the advantage of an incorrect trace with a localised verified repair lands.
            ``"values"`` (default): by its segment values, like every other trace (they single out the step that
            went wrong; the edit mask also covers every later step that changed with it); IBPO's mask only where
            the values decide nothing. ``"edit_mask"``: IBPO's sign rule on the tokens that repair changed, the
            values only for correct traces and incorrect ones without such a repair. How the default was chosen:
            docs/choices.md, "Fused estimator".
    """

    wrong_trace_credit: str = "values"

    def __post_init__(self) -> None:
        if self.wrong_trace_credit not in WRONG_TRACE_CREDIT:
            raise ValueError(f"wrong_trace_credit must be one of {WRONG_TRACE_CREDIT}, got {self.wrong_trace_credit!r}")


@dataclass
class FusedResult:
    """Output of ``fused_advantages``.

    Attributes:
        advantages: (bs, T) token advantages, zero on padding.
        from_values: (bs,) bool, traces whose advantage was redistributed by their values (the others: IBPO's row).
        ibpo: IBPO's result on the same batch (shaped rewards, its rows, ``ibpo/`` metrics).
        redistribution: the redistribution of the shaped outcome (values, segment rewards, fallbacks, concordance).
        metrics: the redistribution's metrics plus ``credit_from_values_frac`` (unprefixed, like ``redistribute``'s).
    """

    advantages: torch.Tensor
    from_values: torch.Tensor
    ibpo: IBPOResult
    redistribution: AdvantageResult
    metrics: dict[str, float]


def fused_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    segment_ends: torch.Tensor,
    raw_values: torch.Tensor,
    phi: torch.Tensor,
    edited_masks: torch.Tensor | None,
    ibpo_cfg: IBPOSettings,
    redistribution_cfg: RedistributionSettings,
    cfg: FusedSettings,
    reward_range: tuple[float, float] = (0.0, 1.0),
    prior_concordance: ConcordanceCounts = ConcordanceCounts(),
) -> FusedResult:
    """Token advantages of ``rredcot_ibpo``.

    With λ = 0 (``redistribution_cfg.mix``) every row is IBPO's; with φ = 0 everywhere and no mask, every row is
    ``redistribute``'s on the verified outcomes.

    Args:
        scores: (bs,) verified outcomes ζ on ``reward_range``; response_mask: (bs, T); index: (bs,) group ids.
        segment_ends: (bs, Kmax) int64, -1 padded; raw_values: (bs, Kmax + 1) probe values (``redistribute``).
        phi: (bs,) IBPO repair signals; edited_masks: (bs, T) bool edited-token masks or None (``shaped_advantages``).
        ibpo_cfg, redistribution_cfg, cfg: the ``ibpo``, ``redistribution`` and ``rredcot_ibpo`` settings.
        reward_range: (low, high), high = correct. prior_concordance: the value gate's window (``redistribute``).
    """
    ibpo = shaped_advantages(scores, response_mask, index, phi, edited_masks, ibpo_cfg, reward_range)
    result = redistribute(
        scores, response_mask, index, segment_ends, raw_values, redistribution_cfg, reward_range=reward_range,
        prior_concordance=prior_concordance, shaped_scores=ibpo.shaped_rewards,
    )  # fmt: skip
    from_values = ~result.fallback & ~result.interpolated & (redistribution_cfg.mix > 0)
    if cfg.wrong_trace_credit == "edit_mask" and ibpo_cfg.use_mask and edited_masks is not None:
        from_values &= ~(edited_masks.any(dim=-1) & ~correct_outcomes(scores, reward_range))
    advantages = torch.where(from_values.unsqueeze(1), result.advantages, ibpo.advantages)
    metrics = dict(result.metrics)
    metrics["credit_from_values_frac"] = float(from_values.double().mean()) if from_values.numel() else 0.0
    return FusedResult(advantages, from_values, ibpo, result, metrics)
