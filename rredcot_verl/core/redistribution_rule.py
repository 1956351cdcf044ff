"""The redistribution's rule, pure: probe values -> values (``map_values``), values -> token advantages
(``token_advantages``), and the projection that keeps both of its bounds. No input checks, fallbacks or metrics:
``core.redistribution.redistribute`` runs them around these functions, on batches it has checked."""

from __future__ import annotations

from typing import NamedTuple

import torch

from rredcot_verl.core.redistribution_settings import RedistributionSettings

__all__ = ["Credit", "map_values", "token_advantages"]

# Bisection steps for the clipping shifts; float64 intervals shrink to rounding level well before this.
_BISECTION_STEPS = 100


class Credit(NamedTuple):
    """What ``token_advantages`` returns: the token advantages, and what the projections did (for the metrics)."""

    advantages: torch.Tensor  # (bs, T) float64, A_t on the policy's tokens of credited traces, 0 elsewhere
    sigma: torch.Tensor  # (bs, M) float64 σ_k after the clip (R_k / Σ R where it did not apply)
    clipped: torch.Tensor  # (bs,) bool, σ was projected onto |K·σ_k| <= c
    bounded: torch.Tensor  # (bs,) bool, the token factors were projected onto |f_k| <= B


def token_advantages(
    values: torch.Tensor,
    advantage: torch.Tensor,
    outcome_gap: torch.Tensor,
    segment_ends: torch.Tensor,
    in_response: torch.Tensor,
    credited: torch.Tensor,
    differences: torch.Tensor,
    interpolated: torch.Tensor,
    cfg: RedistributionSettings,
    width: float,
) -> Credit:
    """The rule: token advantages from segment values (steps 2-4 of ``core.redistribution``'s docstring).

    Trace i has values V_0..V_K on the outcome scale, GRPO advantage Â, L policy tokens and segments k = 1..K of n_k
    of them; R_k = V_k − V_{k−1}, λ = ``mix``, c = ``clip``, B = ``max_token_advantage_ratio``, h = (high − low)/2.
    ``advantage_form="sigma"``:
        mixed groups: σ_k = R_k / Σ_k' R_k' projected onto |K·σ_k| <= c at Σ σ = 1, f_k = (1 − λ) + λ·L·σ_k / n_k
        (f_k = 1, GRPO exactly, where the values were interpolated) projected onto |f_k| <= B at Σ_k n_k·f_k = L,
        A_k = Â·f_k;
        all-equal groups learning from value differences: f_k = λ·(R_k / h)·L / n_k projected onto |f_k| <= B at
        Σ_k n_k·f_k = λ·L·Σ R / h, A_k = u·f_k, with u = 1 under ``norm_adv_by_std`` and h without it.
    ``advantage_form="signed"``: A_k = (1 − λ)·Â + λ·R_k / s with s = (ζ' − mean) / Â, the group std + ε (1 without
        ``norm_adv_by_std``); all-equal groups: A_k = u·λ·R_k / h. σ_k is computed as above, for the metrics.
    Each policy token of segment k gets A_k; other positions, and traces not ``credited``, get 0.

    Args:
        values: (bs, M+1) float64 V_0..V_K, NaN beyond K. advantage: (bs,) Â. outcome_gap: (bs,) float64 ζ' − mean,
            the outcome GRPO normalised (the shaped one when given) minus its group mean.
        segment_ends: (bs, M) int64 b_1..b_K counted in policy tokens, -1 padded. in_response: (bs, T) bool, the
            policy's tokens (a multi-turn response's holes count in no segment).
        credited: (bs,) bool, the traces to credit; only they enter the projections.
        differences: (bs,) bool, traces of all-equal groups that learn from value differences.
        interpolated: (bs,) bool, traces of mixed groups whose values were interpolated in token position.
        cfg: ``mix``, ``clip``, ``max_token_advantage_ratio``, ``advantage_form`` and ``norm_adv_by_std``.
        width: high − low, the reward range's width.
    """
    num_segments = (segment_ends >= 0).sum(1)
    in_segment = torch.arange(segment_ends.shape[1]) < num_segments.unsqueeze(1)
    tokens = segment_ends - torch.cat([torch.zeros_like(segment_ends[:, :1]), segment_ends[:, :-1]], dim=1)
    lengths = in_response.sum(1).double()
    rewards = values[:, 1:] - values[:, :-1]
    total = rewards.where(in_segment, 0.0).sum(1)
    mixed, all_equal = credited & ~differences, credited & differences
    mixed_segments, all_equal_segments = in_segment & mixed.unsqueeze(1), in_segment & all_equal.unsqueeze(1)
    half_range = width / 2.0
    unit = 1.0 if cfg.norm_adv_by_std else half_range
    sigma = rewards / total.unsqueeze(1)
    sigma, clipped = _project(  # |K·σ_k| <= c, Σ σ = 1
        sigma, torch.ones_like(sigma), mixed_segments & ~interpolated.unsqueeze(1),
        (cfg.clip / num_segments.clamp(min=1).double()).unsqueeze(1), torch.ones(len(sigma), dtype=torch.float64),
    )  # fmt: skip
    weights = tokens.double()  # the token factors are projected per token: |f_k| <= B, Σ_k n_k·f_k kept
    bound = torch.full((len(sigma), 1), float(cfg.max_token_advantage_ratio), dtype=torch.float64)
    if cfg.advantage_form == "signed":  # |R_k| is at most the reward range: no bound needed
        scale = (outcome_gap / advantage.double()).where(mixed & (advantage != 0), 1.0)
        from_mixed = (1.0 - cfg.mix) * advantage.double().unsqueeze(1) + cfg.mix * rewards / scale.unsqueeze(1)
        from_mixed = from_mixed.where(mixed_segments, 0.0)
        from_differences = unit * (cfg.mix * rewards / half_range).where(all_equal_segments, 0.0)
        bounded = torch.zeros_like(credited)
    else:
        factor = (1.0 - cfg.mix) + cfg.mix * lengths.unsqueeze(1) * sigma / tokens
        factor = factor.where(~interpolated.unsqueeze(1), 1.0)
        factor, bounded = _project(factor, weights, mixed_segments, bound, lengths)
        from_mixed = advantage.double().unsqueeze(1) * factor
        factor = cfg.mix * (rewards / half_range) * (lengths.unsqueeze(1) / tokens)
        target = cfg.mix * lengths * total / half_range
        factor, all_equal_bounded = _project(factor, weights, all_equal_segments, bound, target)
        from_differences, bounded = unit * factor, bounded | all_equal_bounded
    segment_advantages = torch.where(differences.unsqueeze(1), from_differences, from_mixed)
    on_tokens = _spread_over_tokens(segment_advantages, segment_ends, in_response)
    return Credit(on_tokens.where(credited.unsqueeze(1), 0.0), sigma, clipped, bounded)


def _spread_over_tokens(segment_advantages, segment_ends, in_response) -> torch.Tensor:
    """(bs, T) float64: each policy token's advantage is its segment's (``segment_advantages``, (bs, M)), 0 off the
    policy's tokens (``in_response``)."""
    max_segments = segment_ends.shape[1]
    if max_segments == 0:  # no trace has segment data
        return torch.zeros(in_response.shape, dtype=torch.float64)
    # Each policy token's place among the policy's tokens (t itself on a right-padded row).
    policy_position = (in_response.long().cumsum(1) - 1).clamp(min=0).contiguous()
    # Segment of each token: the number of ends at or before it (padding ends sort last).
    sorted_ends = segment_ends.where(segment_ends >= 0, in_response.shape[1] + 1).contiguous()
    token_segment = torch.searchsorted(sorted_ends, policy_position, right=True).clamp(max=max_segments - 1)
    return segment_advantages.gather(1, token_segment).where(in_response, 0.0)


def map_values(raw, fraction, outcome, mean_outcome, cfg) -> tuple[torch.Tensor, ...]:
    """Values from padded probe values, on the probability scale, in float64.

    Args:
        raw: (n, M+1) probe values. fraction: (n, M+1) b_k / L, the share of the response read at boundary k (0 at
            k = 0, 1 at k = K). outcome: (n,) ζ. mean_outcome: (n,) group mean, V_0 when anchored. Both on the
            probability scale.

    Returns:
        values (n, M+1), every column mapped (the caller sets V_K = ζ); flat (n,) bool, rows interpolated because the
        map is undefined; steep (n,) bool, rows interpolated because the affine gain is out of [0, max_affine_gain].
    """
    zeta, start = outcome.unsqueeze(1), mean_outcome.unsqueeze(1)
    flat = torch.zeros_like(outcome, dtype=torch.bool)
    steep = torch.zeros_like(flat)
    values = raw.clone()
    # Values proportional to the tokens read: σ_k = n_k / L, the GRPO advantage (see the module docstring).
    linear = start + (zeta - start) * fraction
    if cfg.anchored and cfg.value_mapping == "affine":
        gap = outcome - raw[:, 0]
        flat = gap.abs() < cfg.epsilon
        gain = (outcome - mean_outcome) / gap.where(~flat, 1.0)
        steep = ~flat & ((gain < 0) | (gain > cfg.max_affine_gain))
        affine = (zeta + (raw - zeta) * gain.unsqueeze(1)).clamp(0.0, 1.0)
        values = torch.where((flat | steep).unsqueeze(1), linear, affine)
    elif cfg.anchored and cfg.value_mapping == "log_affine":
        # Log-probabilities of long continuations span orders of magnitude: map log v̂ affinely, v̂_0 -> V_0 and
        # certainty (log 1 = 0) -> 1; states less likely than the start fall towards 0.
        log_raw = raw.clamp(min=1e-30).log()
        log_start = log_raw[:, :1]
        flat = (log_start[:, 0].abs() < cfg.epsilon) | (raw[:, 0] <= 0.0)
        progress = (log_raw - log_start) / (-log_start).where(~flat.unsqueeze(1), 1.0)
        mapped = (start + (1.0 - start) * progress).clamp(0.0, 1.0)
        values = torch.where(flat.unsqueeze(1), linear, mapped)
    if cfg.anchored:
        values[:, 0] = mean_outcome
    return values, flat, steep


def _project(rows, weights, active, limit, target) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep every active |x| within ``limit`` while Σ weights · x over the active entries stays ``target``.

    Rows within the limit are returned unchanged. For the others, x ← clamp(x − τ, −limit, limit) with the shift τ
    found by bisection: the (weighted) Euclidean projection onto {|x| <= limit, Σ w·x = target}, which keeps the
    order of the entries. Clamping and then rescaling instead could divide by a sum near zero or flip every sign.
    When |target| > limit · Σ w no shift reaches it and every entry ends at ±limit. Used twice: σ_k with unit weights,
    limit c/K and target 1 (Σ σ = 1 kept); the token factors f_k weighted by their segment's tokens n_k, limit B and
    target the token sum.

    Args:
        rows: (n, M) float64. weights: (n, M) positive. active: (n, M) bool. limit: (n, 1). target: (n,).

    Returns:
        rows (n, M), and changed (n,) bool: rows that were projected.
    """
    changed = (active & (rows.abs() > limit)).any(1)
    if not changed.any():
        return rows, changed
    x, mask, weights, limit, target = rows[changed], active[changed], weights[changed], limit[changed], target[changed]
    # At τ = min x − limit every entry sits at +limit (the largest total); at τ = max x + limit at −limit.
    low = x.where(mask, float("inf")).amin(1) - limit.squeeze(1)
    high = x.where(mask, float("-inf")).amax(1) + limit.squeeze(1)
    for _ in range(_BISECTION_STEPS):
        middle = (low + high) / 2
        total = (weights * (x - middle.unsqueeze(1)).clamp(-limit, limit)).where(mask, 0.0).sum(1)
        above = total > target
        low, high = middle.where(above, low), high.where(above, middle)
    projected = (x - ((low + high) / 2).unsqueeze(1)).clamp(-limit, limit)
    rows = rows.clone()
    rows[changed] = projected.where(mask, x)
    return rows, changed
