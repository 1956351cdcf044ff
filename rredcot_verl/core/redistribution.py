"""Segment values -> segment rewards -> token advantages (RREDCoT §4.2), on top of verl's GRPO advantage.

Outcomes ζ lie on a declared scale [low, high] (``reward_range``, high = correct; (0, 1) by default). Probe values
v̂ ∈ [0, 1] are probabilities of success; on the outcome scale a probe value stands for the expectation
low + (high − low)·v̂. For trace i with outcome ζ_i, GRPO advantage Â_i, L_i response tokens and segments
k = 1..K of n_k tokens (boundary b_k = end of segment k, b_0 = 0, b_K = L_i):

1. values V_0..V_K from the probe values v̂_0..v̂_K (``anchor_values``). Anchored: V_0 = group mean of ζ, V_K = ζ_i,
   so the redistribution sums to what GRPO's baseline already credits.
2. segment rewards R_k = V_k − V_{k−1} (``segment_rewards``); they telescope: Σ_k R_k = V_K − V_0.
3. coefficients σ_k = R_k / Σ_k' R_k' (Σ σ = 1), with K·σ_k kept in [−c, c].
4. token advantage A_t = Â_i · f_t, f_t = (1 − λ) + λ · L_i · σ_k / n_k for t in segment k, then |f_t| kept within
   ``max_token_advantage_ratio`` at constant Σ_t f_t = L_i. Uniform σ_k = n_k / L_i, or λ = 0, gives GRPO; for any
   σ the trace's token mean of A is Â_i.
   ``advantage_form="signed"`` replaces steps 3-4 by A_t = (1 − λ)·Â_i + λ·R_k / s_i, s_i the group's std + ε
   (VinePPO's and SPO's signed step advantage; see ``RedistributionSettings``).

Where the values carry no usable information about the trace (the affine map is undefined, or its gain is out of
bounds) they are interpolated in token position, V(b) = V_0 + (ζ_i − V_0)·b / L_i; then σ_k = n_k / L_i and the trace
gets exactly its GRPO advantage. Traces where the redistribution is undefined keep their GRPO advantage and are
counted (``AdvantageResult.metrics``); all-correct and all-wrong groups can optionally learn from unanchored
value differences instead (``degenerate_groups``). A whole batch keeps GRPO's advantage while its values (pooled with
recent batches') do not order the traces of a prompt by their outcomes (``min_value_concordance``,
``core.concordance``).
The rule itself, steps 2-4 with its projections, is ``redistribution_rule.token_advantages``, a pure function;
``redistribute`` is the guard around it: input checks (``redistribution_checks``), the values, each fallback with its
reason, the value gate and the metrics. Imports only torch; GRPO's advantage is ``outcomes.group_outcome_advantage``,
verl's arithmetic bit for bit.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from rredcot_verl.core.concordance import ConcordanceCounts, gate_is_open, value_outcome_concordance
from rredcot_verl.core.outcomes import check_reward_range, correct_outcomes, group_outcome_advantage
from rredcot_verl.core.redistribution_checks import PROBABILITY_SLACK, check_batch, check_probabilities, check_shaped
from rredcot_verl.core.redistribution_rule import Credit, map_values, token_advantages
from rredcot_verl.core.redistribution_settings import (  # noqa: F401 (imported from here elsewhere)
    ADVANTAGE_FORMS,
    CREDIT_TRACES,
    DEGENERATE_GROUPS,
    VALUE_MAPPINGS,
    RedistributionSettings,
)

__all__ = [
    "RedistributionSettings",
    "AdvantageResult",
    "group_outcome_advantage",
    "anchor_values",
    "segment_rewards",
    "redistribute",
]

# Segment positions whose mean |R_k| is logged, plus the last segment.
_LOGGED_POSITIONS = 4


@dataclass(frozen=True, eq=False)
class AdvantageResult:
    """What an advantage function returns for one batch: ``redistribute``'s output, and every estimator's (the
    integration's advantage functions return it with their metrics prefixed; IBPO fills only the first three).

    Attributes:
        advantages: (bs, T) token advantages, zero on padding.
        returns: (bs, T) the same tensor, as verl's GRPO returns it.
        metrics: scalar diagnostics, see ``redistribute``.
        values: (bs, Kmax + 1) V_0..V_K per trace on the outcome scale, NaN beyond K and on traces that fell back;
            None for an estimator without segment values.
        segment_rewards: (bs, Kmax) R_1..R_K per trace, NaN likewise; None likewise.
        fallback: (bs,) bool, the redistribution was not applicable and the trace kept its fallback (GRPO's, or
            IBPO's for ``rredcot_ibpo``) advantage; None likewise.
        interpolated: (bs,) bool, redistributed traces whose values were interpolated in token position (the map
            was undefined or its gain out of bounds): they too got exactly their GRPO advantage; None likewise.
        concordance: this batch's value-outcome comparisons, for the caller's ``ConcordanceWindow``; None likewise.
    """

    advantages: torch.Tensor
    returns: torch.Tensor
    metrics: dict[str, float]
    values: torch.Tensor | None = None
    segment_rewards: torch.Tensor | None = None
    fallback: torch.Tensor | None = None
    interpolated: torch.Tensor | None = None
    concordance: ConcordanceCounts | None = None


def anchor_values(
    raw_values: torch.Tensor,
    outcome: float,
    group_mean: float,
    cfg: RedistributionSettings,
    segment_ends: torch.Tensor | None = None,
    reward_range: tuple[float, float] = (0.0, 1.0),
) -> torch.Tensor:
    """Values V_0..V_K of one trace from its probe values (see ``RedistributionSettings``).

    Args:
        raw_values: (K+1,) probe values v̂_0..v̂_K, probabilities in [0, 1]. v̂_K is replaced by the outcome and
            not read.
        outcome: ζ in ``reward_range``, the trace's terminal outcome.
        group_mean: mean outcome of the trace's group, V_0 when anchored.
        cfg: settings (``anchored``, ``value_mapping``, ``max_affine_gain``, ``epsilon``).
        segment_ends: (K,) int exclusive segment ends (the last is the response length), where the token-position
            interpolation puts the values; None treats the segments as equally long.
        reward_range: (low, high), the outcome scale; v̂ stands for low + (high − low)·v̂.

    Returns:
        (K+1,) values on the outcome scale, V_K = ζ; V_0 = group_mean when anchored, the expectation of v̂_0
        otherwise.
    """
    low, high = check_reward_range(reward_range)
    if raw_values.dim() != 1 or raw_values.numel() < 2 or not raw_values.is_floating_point():
        raise ValueError(
            f"raw_values must be a 1-D float tensor of K+1 >= 2 values, got shape {tuple(raw_values.shape)}"
        )
    num_segments = raw_values.numel() - 1
    used = raw_values[:-1].double()
    if not torch.isfinite(used).all():
        raise ValueError(f"raw_values contain NaN or inf: {raw_values.tolist()}")
    check_probabilities("raw_values", used)
    ends = torch.tensor([float(outcome), float(group_mean)], dtype=torch.float64)
    if not ((ends >= low) & (ends <= high)).all():
        raise ValueError(f"outcome and group_mean must lie in reward_range {reward_range}; got {ends.tolist()}")
    if segment_ends is None:
        fraction = torch.arange(num_segments + 1, dtype=torch.float64) / num_segments
    else:
        bounds = torch.cat([torch.zeros(1, dtype=torch.int64), segment_ends.long()])
        if bounds.shape != (num_segments + 1,) or not (bounds[1:] > bounds[:-1]).all():
            raise ValueError(
                f"segment_ends must hold K = {num_segments} positive, strictly increasing ends, "
                f"got {segment_ends.tolist()}"
            )
        fraction = bounds.double() / float(bounds[-1])
    width = high - low
    values, _, _ = map_values(
        raw_values.double().unsqueeze(0),
        fraction.unsqueeze(0),
        torch.tensor([(float(outcome) - low) / width], dtype=torch.float64),
        torch.tensor([(float(group_mean) - low) / width], dtype=torch.float64),
        cfg,
    )
    values = low + width * values[0]
    values[-1] = float(outcome)  # exact endpoints: the rewards telescope to ζ − V_0 without a rescaling error
    if cfg.anchored:
        values[0] = float(group_mean)
    return values.to(raw_values.dtype)


def segment_rewards(values: torch.Tensor) -> torch.Tensor:
    """R_k = V_k − V_{k−1}.

    Args:
        values: (..., K+1) values; NaN padding stays NaN.

    Returns:
        (..., K) segment rewards.
    """
    return values[..., 1:] - values[..., :-1]


def redistribute(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    segment_ends: torch.Tensor,
    raw_values: torch.Tensor,
    cfg: RedistributionSettings,
    reward_range: tuple[float, float] = (0.0, 1.0),
    prior_concordance: ConcordanceCounts = ConcordanceCounts(),
    shaped_scores: torch.Tensor | None = None,
) -> AdvantageResult:
    """Token advantages from outcome scores and per-segment probe values.

    The guard around the rule, ``redistribution_rule.token_advantages`` (steps 2-4 of the module docstring;
    ``tests/redistribution_reference.py`` does the same for one trace in plain Python): it checks the batch, computes
    GRPO's advantage, the all-equal groups and the values V_0..V_K (``_segment_values``), names each trace's reasons
    to keep GRPO's row (where the redistribution is undefined, then shaped scores against the values, the value
    gate, a non-finite result), and writes the rule's row where no reason holds and the trace is of the kind
    ``credit_traces`` names, GRPO's elsewhere.

    Args:
        scores: (bs,) float outcome ζ per trace, on ``reward_range``.
        response_mask: (bs, T) 0/1, 1 on the model's tokens from column 0; 0 on right padding and, in multi-turn
            responses (verl's tool agent loop), on the tool output and template tokens between turns. Those holes
            get advantage 0 and count in no segment: L and n_k below count the model's tokens only, so the
            per-trace telescoping Σ_k R_k = V_K − V_0 holds whatever the number of turns.
        index: (bs,) hashables, group (prompt) id of each trace.
        segment_ends: (bs, Kmax) int64 exclusive segment ends in positions of the full response, strictly
            increasing, padded with -1 at the end; every segment starts on a 1 of ``response_mask``. A trace has
            segment data when its last end is one past its last 1.
        raw_values: (bs, Kmax + 1) float probe values v̂_0..v̂_K in [0, 1] (column K is replaced by ζ and not read),
            NaN-padded.
        cfg: settings.
        reward_range: (low, high) with low < high, the scale of the outcomes (high = correct). Default (0, 1).
        prior_concordance: the value-outcome comparisons of the previous ``cfg.concordance_window − 1`` batches
            (``ConcordanceWindow.pooled``); the gate decides on them plus this batch's.
        shaped_scores: (bs,) outcomes after reward shaping (IBPO's R', on ``reward_range``), or None. When given,
            GRPO's advantage, the anchor V_0 and the degenerate-group test come from them, while the values still
            end at the verified outcome V_K = ζ (a state's value is the chance of a correct answer from it; the
            shaping bonus judges the whole trace): the trace's token mean stays its shaped advantage Â' and the
            values decide where it lands. A trace whose values sum against Â' (Σ R = ζ − V_0 of the other sign: a
            repaired failure above its group's mean) keeps GRPO's row, counted under
            ``fallback/against_shaped_advantage``.

    Returns:
        ``AdvantageResult``. With ``cfg.mix == 0`` its advantages are verl's GRPO tensor unchanged; the
        diagnostics are computed all the same, so a λ = 0 run logs what the redistribution would have done.

    A trace keeps its GRPO advantage (``fallback``) when its response is empty, its group has one trace, its outcome
    lies outside ``reward_range`` (a reward function that breaks its declared scale mid-run must not stop training),
    its outcome equals the anchor (|Σ R| < epsilon; this includes all-correct and all-wrong groups, where Â = 0,
    unless ``degenerate_groups="value_differences"``), it has no segment data, its values or result hold NaN/inf,
    or the value gate is closed for the batch (``min_value_concordance``; closed too when neither this batch nor the
    window has a comparison).
    Metrics (floats): ``redistributed_frac`` (traces that got the redistributed row); ``uncredited_traces``
    (traces outside ``credit_traces`` that kept GRPO's row by that choice); ``fallback/{empty,singleton_group,
    outside_reward_range,zero_return,missing_segments,nonfinite,against_shaped_advantage,low_value_concordance}``
    (trace counts, each trace counted under its first reason in that order, except that a non-finite result counts
    under ``nonfinite`` only when no other reason holds; ``against_shaped_advantage`` only with ``shaped_scores``);
    ``value_gate_open`` (1 or 0), ``value_concordance_comparisons`` (this batch's) and, when there are comparisons,
    ``value_concordance`` (this batch) and ``value_concordance_pooled`` (the window's);
    ``degenerate_groups`` (groups of two or more where every outcome equals the mean);
    ``degenerate_groups_with_signal`` (of those, groups where some trace got a nonzero advantage from value
    differences); ``affine_flat_traces`` / ``affine_gain_traces`` (redistributed traces whose values were
    interpolated in token position because ζ ≈ v̂_0 / the affine gain was out of bounds); over traces with
    redistributed advantages, when there are any: ``token_bound_trace_frac`` (share where
    ``max_token_advantage_ratio`` bound); over redistributed traces of mixed groups, when there are any:
    ``segments_per_trace``, ``negative_coef_frac`` (share of σ_k < 0), ``clipped_trace_frac`` and
    ``abs_segment_reward/pos_{k}`` (mean |R_{k+1}|, for k < 4 where some trace has that segment) and
    ``abs_segment_reward/last``.

    Raises:
        ValueError: on shape or dtype mismatches, masks that are not 0/1 or start with a 0, segment ends that are not
            strictly increasing and positive, that exceed the response, start a segment on a 0 of the mask or have
            padding before data, finite probe values outside [0, 1], and a reward range that is not two finite
            numbers low < high.
    """
    low, high = check_reward_range(reward_range)
    width = high - low
    lengths, num_segments, policy_ends = check_batch(scores, response_mask, index, segment_ends, raw_values)
    baseline = scores if shaped_scores is None else check_shaped(shaped_scores, scores)
    read = torch.arange(raw_values.shape[1]) < num_segments.unsqueeze(1)  # v̂_0..v̂_{K-1}; v̂_K is replaced by ζ
    check_probabilities("raw_values", raw_values.double()[read & torch.isfinite(raw_values)])
    advantage, group_mean = group_outcome_advantage(baseline, index, cfg.epsilon, cfg.norm_adv_by_std)
    grpo, in_response = advantage.unsqueeze(-1) * response_mask, response_mask != 0
    outcome, mean = scores.double(), group_mean.double()
    groups = _group_rows(index)

    # All-equal groups (of the shaped scores when given: their Â' is 0), and those that learn from value differences.
    at_mean = ((baseline.double() - low) / width - (mean - low) / width).abs() < cfg.epsilon
    in_equal_group = [len(groups[g]) > 1 and bool(at_mean[groups[g]].all()) for g in index]
    degenerate = torch.tensor(in_equal_group, dtype=torch.bool)
    differences = degenerate & (cfg.degenerate_groups == "value_differences")
    values, flat, steep = _segment_values(raw_values, policy_ends, lengths, outcome, mean, differences, cfg, low, width)
    rewards = segment_rewards(values)
    in_segment = read[:, :-1]
    total = rewards.where(in_segment, 0.0).sum(1)

    # Where the redistribution is undefined, in the order in which fallback/{reason} counts a trace's first reason.
    probability = (outcome - low) / width
    in_range = (probability >= -PROBABILITY_SLACK) & (probability <= 1.0 + PROBABILITY_SLACK)  # False for NaN
    last_end = torch.cat([torch.full((len(lengths), 1), -1), policy_ends], dim=1).amax(1)  # -1 without segments
    has_segments = (num_segments > 0) & (last_end == lengths)
    finite_raw = ~(read & ~torch.isfinite(raw_values)).any(1)
    # The outcome equals the anchor: at the group mean, or values that sum to nothing (unanchored: ζ == v̂_0).
    empty_sum = has_segments & finite_raw & (total.abs() < cfg.epsilon * width)
    reasons = [
        ("empty", lengths == 0),
        ("singleton_group", torch.tensor([len(groups[g]) == 1 for g in index], dtype=torch.bool)),
        ("outside_reward_range", ~in_range),
        ("zero_return", (at_mean | empty_sum) & ~differences),
        ("missing_segments", ~has_segments),
        ("nonfinite", ~finite_raw),
    ]
    defined = ~_first_reasons(reasons)[0]

    interpolated = flat | steep  # f_t = 1: GRPO's row, which they keep bit for bit
    credit = token_advantages(values, advantage, baseline.double() - mean, policy_ends, in_response, defined,
                              differences, interpolated, cfg, width)  # fmt: skip
    rows = credit.advantages.to(grpo.dtype)
    if shaped_scores is not None:  # not undefined: these values are fine in themselves, the gate compares them
        reasons.append(("against_shaped_advantage", (total * advantage.double() < 0) & ~differences))
    concordance = value_outcome_concordance(raw_values, policy_ends, lengths, outcome, index, defined,
                                            tie=cfg.epsilon * width)  # fmt: skip
    gate_open = gate_is_open(prior_concordance + concordance, cfg.min_value_concordance)
    reasons.append(("low_value_concordance", torch.full(lengths.shape, not gate_open)))
    reasons.append(("nonfinite", ~(torch.isfinite(rows) | ~in_response).all(1)))  # rows that overflowed
    fallback, counts = _first_reasons(reasons)
    # Outside credit_traces: GRPO's row by choice, not a fallback.
    uncredited = ~fallback & ~_credited(outcome, (low, high), cfg.credit_traces)
    write = (~fallback & ~interpolated & ~uncredited).unsqueeze(1) & in_response  # padding keeps GRPO's Â · 0
    advantages = torch.where(write, rows, grpo) if cfg.mix > 0 else grpo  # λ = 0: verl's tensor

    kept = ~fallback.unsqueeze(1)
    values = values.where(kept, float("nan")).to(raw_values.dtype)
    rewards = rewards.where(kept, float("nan")).to(raw_values.dtype)
    live = ~(fallback | uncredited)
    metrics = {
        **_metrics(live, counts, credit, rows, rewards, in_segment, groups, degenerate, differences, flat, steep),
        **_gate_metrics(concordance, prior_concordance + concordance, gate_open),
        "uncredited_traces": float(uncredited.sum()),
    }
    interpolated = interpolated & ~fallback
    return AdvantageResult(advantages, advantages, metrics, values, rewards, fallback, interpolated, concordance)


def _group_rows(index: Sequence[Hashable]) -> dict[Hashable, list[int]]:
    """The rows of each group id, in batch order."""
    groups: dict[Hashable, list[int]] = {}
    for row, group in enumerate(index):
        groups.setdefault(group, []).append(row)
    return groups


def _segment_values(raw_values, segment_ends, lengths, outcome, mean, differences, cfg, low, width):
    """Values V_0..V_K on the outcome scale, (bs, M+1) float64, NaN beyond K: mapped from the probe values
    (``map_values``) with the exact ends V_K = ζ and, anchored, V_0 = the group mean; the probe values as they are
    (as expectations) for traces of all-equal groups that learn from value differences.

    Args:
        segment_ends: (bs, M) b_k in policy tokens, -1 padded; lengths: (bs,) L. outcome, mean: (bs,) float64 ζ and
            the group mean of the outcomes GRPO normalises. differences: (bs,) bool. low, width: the reward range.

    Returns:
        values; flat, steep (bs,) bool: traces of mixed groups interpolated in token position because the map is
        undefined / its gain is out of bounds.
    """
    bsz, max_segments = segment_ends.shape
    boundaries = torch.cat([torch.zeros(bsz, 1, dtype=torch.int64), segment_ends], dim=1)  # b_0 = 0, b_k
    fraction = boundaries.double() / lengths.clamp(min=1).double().unsqueeze(1)
    raw = raw_values.double()
    mapped, flat, steep = map_values(raw, fraction, (outcome - low) / width, (mean - low) / width, cfg)
    values = low + width * torch.where(differences.unsqueeze(1), raw, mapped)
    # V_K = ζ exactly, so that Σ_k R_k = ζ − V_0 holds up to the summation's own rounding on any scale.
    position, last = torch.arange(max_segments + 1), (segment_ends >= 0).sum(1, keepdim=True)
    values = torch.where(position == last, outcome.unsqueeze(1), values).where(position <= last, float("nan"))
    if cfg.anchored:
        values[:, 0] = mean.where(~differences, values[:, 0])
    return values, flat & ~differences, steep & ~differences


def _first_reasons(reasons) -> tuple[torch.Tensor, dict[str, float]]:
    """OR of the reason masks, and per reason the number of traces for which it is the first that holds."""
    fallback = torch.zeros_like(reasons[0][1])
    counts = {}
    for name, mask in reasons:
        counts[name] = counts.get(name, 0.0) + float((mask & ~fallback).sum())
        fallback = fallback | mask
    return fallback, counts


def _credited(outcome: torch.Tensor, reward_range: tuple[float, float], credit_traces: str) -> torch.Tensor:
    """(bs,) bool, the traces of the kind ``credit_traces`` names (correct: the outcome reaches the top of the
    reward range, as ``outcomes.correct_outcomes`` judges it)."""
    if credit_traces == "all":
        return torch.ones_like(outcome, dtype=torch.bool)
    correct = correct_outcomes(outcome, reward_range)
    return correct if credit_traces == "correct" else ~correct


def _gate_metrics(concordance: ConcordanceCounts, pooled: ConcordanceCounts, gate_open: bool) -> dict[str, float]:
    """The value gate's metrics: open or not, this batch's comparisons, this batch's and the window's concordance."""
    metrics = {"value_gate_open": float(gate_open), "value_concordance_comparisons": float(concordance.comparisons)}
    if concordance.concordance is not None:
        metrics["value_concordance"] = concordance.concordance
    if pooled.concordance is not None:
        metrics["value_concordance_pooled"] = pooled.concordance
    return metrics


def _metrics(live, counts, credit: Credit, rows, rewards, in_segment, groups, degenerate, differences, flat, steep):
    """Scalar diagnostics (see ``redistribute``) of the fallbacks (``counts`` per reason) and of the ``live`` (bs,)
    traces that got the redistributed row: from the rule's ``credit`` and token ``rows`` (bs, T), the reported
    ``rewards`` (bs, M), the ``groups``' rows and the per-trace masks."""
    bsz = live.numel()
    metrics = {f"fallback/{name}": count for name, count in counts.items()}
    metrics["redistributed_frac"] = float(live.sum()) / bsz if bsz else 0.0
    signal = differences & live & (rows != 0).any(1)  # degenerate-group traces that got a nonzero advantage
    metrics["degenerate_groups"] = float(sum(bool(degenerate[members[0]]) for members in groups.values()))
    metrics["degenerate_groups_with_signal"] = float(sum(bool(signal[members].any()) for members in groups.values()))
    metrics["affine_flat_traces"] = float((flat & live).sum())  # all False unless anchored affine / log_affine
    metrics["affine_gain_traces"] = float((steep & live).sum())
    if live.any():
        metrics["token_bound_trace_frac"] = float(credit.bounded[live].double().mean())
    mixed = live & ~differences
    if not mixed.any():
        return metrics
    num_segments = in_segment.sum(1)
    metrics["segments_per_trace"] = float(num_segments[mixed].double().mean())
    metrics["negative_coef_frac"] = float((credit.sigma[in_segment & mixed.unsqueeze(1)] < 0).double().mean())
    metrics["clipped_trace_frac"] = float(credit.clipped[mixed].double().mean())
    magnitude = rewards.double().abs()
    for k in range(min(_LOGGED_POSITIONS, rewards.shape[1])):
        has_k = mixed & (num_segments > k)
        if has_k.any():
            metrics[f"abs_segment_reward/pos_{k}"] = float(magnitude[has_k, k].mean())
    last = magnitude.gather(1, (num_segments - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    metrics["abs_segment_reward/last"] = float(last[mixed].mean())
    return metrics
