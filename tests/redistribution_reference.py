"""The redistribution for one trace, written to be read in one sitting: plain Python floats, one step per block.

``rredcot_verl.core.redistribution.redistribute`` does the same for a whole batch with tensors, fallbacks and
metrics; a property test (``tests/test_redistribution_on_cpu.py``) holds it to this function on random traces.
Covered: a trace with segment data in a group of two or more with mixed outcomes, the value gate open, multi-turn
responses (a mask with holes) included. Not covered (the batched version keeps the GRPO advantage there and counts
why): empty responses, groups of one, outcomes outside the reward range, all-equal groups (``degenerate_groups``),
missing or non-finite values. Imports nothing but the standard library."""

from __future__ import annotations

import math
from collections.abc import Sequence


def grpo_advantage(outcome: float, group_outcomes: Sequence[float], epsilon: float, norm_adv_by_std: bool) -> float:
    """Â = (ζ − mean) / (std + ε) over the trace's group (unbiased std, as verl), or ζ − mean without the std."""
    n = len(group_outcomes)
    mean = sum(group_outcomes) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in group_outcomes) / (n - 1))
    return (outcome - mean) / (std + epsilon) if norm_adv_by_std else outcome - mean


def _project(x: Sequence[float], weights: Sequence[float], limit: float, target: float) -> list[float]:
    """clamp(x − τ, −limit, limit) with the one τ that makes Σ w · clamp(...) = target: the weighted Euclidean
    projection onto {|x| <= limit, Σ w·x = target}. g(τ) = Σ w · clamp(x − τ) falls piecewise linearly in τ, with
    kinks at x ± limit, so τ is found exactly between two kinks."""
    g = lambda tau: sum(w * min(max(v - tau, -limit), limit) for v, w in zip(x, weights))  # noqa: E731
    kinks = sorted({v - limit for v in x} | {v + limit for v in x})
    if target >= g(kinks[0]):
        tau = kinks[0]
    elif target <= g(kinks[-1]):
        tau = kinks[-1]
    else:
        for left, right in zip(kinks, kinks[1:]):
            if g(left) >= target >= g(right):
                g_left, g_right = g(left), g(right)
                tau = left if g_left == g_right else left + (g_left - target) * (right - left) / (g_left - g_right)
                break
    return [min(max(v - tau, -limit), limit) for v in x]


def redistribute_trace(
    outcome: float,
    group_outcomes: Sequence[float],
    segment_ends: Sequence[int],
    raw_values: Sequence[float],
    *,
    mix: float,
    anchored: bool,
    value_mapping: str,
    clip: float,
    max_token_advantage_ratio: float,
    max_affine_gain: float,
    epsilon: float,
    norm_adv_by_std: bool,
    reward_range: tuple[float, float] = (0.0, 1.0),
    shaped_outcome: float | None = None,
    shaped_group_outcomes: Sequence[float] | None = None,
    response_mask: Sequence[int] | None = None,
    credit_traces: str = "all",
) -> list[float]:
    """Token advantages of one trace.

    Args:
        outcome: ζ. group_outcomes: the outcomes of its group, itself included.
        segment_ends: b_1 < ... < b_K, exclusive segment ends in positions of the response; b_K is one past its
            last model token. raw_values: v̂_0..v̂_{K-1}, probabilities.
        The keyword arguments are ``RedistributionSettings``' fields; reward_range: (low, high).
        shaped_outcome, shaped_group_outcomes: the same after reward shaping (IBPO's R'), or None: the advantage
            and the anchor V_0 come from them, the values still end at ζ.
        response_mask: 1 on the model's tokens, 0 on the tool output and template tokens between its turns (and
            after them); None: b_K ones. Everything below counts the model's tokens only; the holes get 0.
        credit_traces: ``"all"``, ``"incorrect"`` or ``"correct"``: a trace of the other kind (correct: ζ reaches
            ``high``) keeps its GRPO row.

    Returns:
        A token advantage per position of ``response_mask`` (b_K of them without one).
    """
    low, high = reward_range
    width = high - low
    mask = [1] * segment_ends[-1] if response_mask is None else list(response_mask)
    policy_ends = [sum(mask[:end]) for end in segment_ends]  # segment ends counted in the model's tokens
    length, k_segments = policy_ends[-1], len(policy_ends)
    boundaries = [0, *policy_ends]
    baseline, baseline_group = (
        (outcome, group_outcomes) if shaped_outcome is None else (shaped_outcome, shaped_group_outcomes)
    )
    advantage = grpo_advantage(baseline, baseline_group, epsilon, norm_adv_by_std)
    grpo = [advantage if trained else 0.0 for trained in mask]
    correct = outcome >= high - 1e-6 * width  # outcomes.CORRECT_TOLERANCE
    if credit_traces != "all" and correct != (credit_traces == "correct"):
        return grpo

    # 1. Values V_0..V_K on the probability scale [0, 1], where the probes live.
    zeta = (outcome - low) / width
    mean = (sum(baseline_group) / len(baseline_group) - low) / width
    probe = [*raw_values, zeta]  # v̂_K = ζ
    linear = [mean + (zeta - mean) * b / length for b in boundaries]  # gives exactly GRPO (step 3)
    interpolated = False
    if not anchored or value_mapping == "raw":
        values = list(probe)
    elif value_mapping == "affine":
        gap = zeta - probe[0]
        gain = (zeta - mean) / gap if abs(gap) >= epsilon else None
        interpolated = gain is None or not 0.0 <= gain <= max_affine_gain
        values = linear if interpolated else [min(max(zeta + (v - zeta) * gain, 0.0), 1.0) for v in probe]
    else:  # log_affine: log v̂ mapped affinely, log v̂_0 -> V_0 and log 1 = 0 -> 1
        log_start = math.log(max(probe[0], 1e-30))
        interpolated = abs(log_start) < epsilon or probe[0] <= 0.0
        values = linear if interpolated else [
            min(max(mean + (1.0 - mean) * (math.log(max(v, 1e-30)) - log_start) / -log_start, 0.0), 1.0) for v in probe
        ]  # fmt: skip
    # Back on the outcome scale, with exact ends: V_K = ζ, and V_0 = the group mean when anchored.
    values = [low + width * v for v in values]
    values[-1] = outcome
    if anchored:
        values[0] = sum(baseline_group) / len(baseline_group)

    # 2. Segment rewards R_k = V_k − V_{k−1}; they telescope to V_K − V_0.
    rewards = [values[k] - values[k - 1] for k in range(1, k_segments + 1)]
    total = sum(rewards)
    if interpolated or abs((baseline - low) / width - mean) < epsilon or abs(total) < epsilon * width:
        return grpo  # the values say nothing this trace's GRPO advantage does not (or nothing at all)
    if total * advantage < 0:
        return grpo  # shaped: the values sum against the advantage

    # 3. Coefficients σ_k = R_k / Σ R, with K·σ_k kept within [−c, c] at Σ σ = 1.
    sigma = [r / total for r in rewards]
    if any(abs(s) > clip / k_segments for s in sigma):
        sigma = _project(sigma, [1.0] * k_segments, clip / k_segments, 1.0)

    # 4. Token factors f_k = (1 − λ) + λ · L · σ_k / n_k, every |f_t| within B at Σ_t f_t = L.
    tokens = [boundaries[k + 1] - boundaries[k] for k in range(k_segments)]
    factors = [(1.0 - mix) + mix * length * s / n for s, n in zip(sigma, tokens)]
    if any(abs(f) > max_token_advantage_ratio for f in factors):
        factors = _project(factors, tokens, max_token_advantage_ratio, float(length))

    # 5. A_t = Â · f_k for every token t of segment k, 0 on the holes.
    policy_advantages = iter([advantage * factors[k] for k in range(k_segments) for _ in range(tokens[k])])
    return [next(policy_advantages) if trained else 0.0 for trained in mask]
