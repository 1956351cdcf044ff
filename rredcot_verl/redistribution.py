"""Segment values -> segment rewards -> token advantages (RREDCoT §4.2), on top of verl's GRPO advantage.

For trace i with outcome ζ_i ∈ [0, 1], GRPO advantage Â_i, L_i response tokens and segments k = 1..K of n_k tokens:

1. values V_0..V_K from the probe values v̂_0..v̂_K (``anchor_values``). Anchored: V_0 = group mean of ζ, V_K = ζ_i,
   so the redistribution sums to what GRPO's baseline already credits.
2. segment rewards R_k = V_k − V_{k−1} (``segment_rewards``); they telescope: Σ_k R_k = V_K − V_0.
3. coefficients σ_k = R_k / Σ_k' R_k' (Σ σ = 1), with K·σ_k kept in [−c, c] (see ``_clip_coefficients``).
4. token advantage A_t = Â_i · ((1 − λ) + λ · L_i · σ_k / n_k) for t in segment k. Uniform σ_k = n_k / L_i, or λ = 0,
   gives GRPO; for any σ the trace's token mean of A is Â_i.

Traces where this is undefined keep their GRPO advantage and are counted (``RedistributionResult.metrics``).
Imports only torch; ``group_outcome_advantage`` mirrors verl's ``compute_grpo_outcome_advantage`` bit for bit.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

__all__ = [
    "RedistributionConfig",
    "RedistributionResult",
    "group_outcome_advantage",
    "anchor_values",
    "segment_rewards",
    "redistribute",
]

VALUE_MAPPINGS = ("affine", "log_affine", "raw")
# Slack for probabilities that should lie in [0, 1] but come out of float sums of probabilities.
_PROBABILITY_SLACK = 1e-4
# Bisection steps for the clipping shift; float64 intervals shrink to rounding level well before this.
_BISECTION_STEPS = 100
# Segment positions whose mean |R_k| is logged, plus the last segment.
_LOGGED_POSITIONS = 4


@dataclass(frozen=True)
class RedistributionConfig:
    """Settings of the redistribution.

    Attributes:
        mix: λ ∈ [0, 1], weight of the redistributed token advantage against GRPO's uniform one. 0 returns verl's
            GRPO advantage tensor unchanged. Default 1.0.
        anchored: pin V_0 to the group mean outcome and V_K to the trace's outcome (default True). False uses the
            probe values as they are, with V_K = ζ (RUDDER's literal reading).
        value_mapping: how anchored runs treat intermediate probe values. ``"affine"`` (default) maps v̂ by the
            affine map sending v̂_0 to V_0 and ζ to ζ, then clamps into [0, 1]; if |ζ − v̂_0| < epsilon that map is
            undefined and the values are interpolated linearly in k from V_0 to ζ. ``"log_affine"`` maps log v̂
            affinely, log v̂_0 to V_0 and log 1 to 1, then clamps (for values that are products over many tokens,
            such as reference continuations; the same linear fallback when v̂_0 is 0 or 1). ``"raw"`` keeps them
            as they are. Ignored when ``anchored`` is False.
        clip: c, bound on |K·σ_k| (σ_k = 1/K is a uniform share). Default 5.0. At least 1, or no coefficients in
            [−c/K, c/K] could sum to 1.
        epsilon: added to the group std as in verl, and the threshold below which an outcome gap counts as zero.
            Default 1e-6.
        norm_adv_by_std: divide the GRPO advantage by the group std (GRPO) or not (Dr.GRPO). Default True.
    """

    mix: float = 1.0
    anchored: bool = True
    value_mapping: str = "affine"
    clip: float = 5.0
    epsilon: float = 1e-6
    norm_adv_by_std: bool = True

    def __post_init__(self):
        if not 0.0 <= self.mix <= 1.0:
            raise ValueError(f"mix (lambda) must lie in [0, 1], got {self.mix}")
        if self.value_mapping not in VALUE_MAPPINGS:
            raise ValueError(f"value_mapping must be one of {VALUE_MAPPINGS}, got {self.value_mapping!r}")
        if not self.clip >= 1.0:
            raise ValueError(
                f"clip must be >= 1 (K coefficients bounded by clip/K must be able to sum to 1), got {self.clip}"
            )
        if not self.epsilon > 0.0:
            raise ValueError(f"epsilon must be > 0, got {self.epsilon}")
        for name in ("anchored", "norm_adv_by_std"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


@dataclass
class RedistributionResult:
    """Output of ``redistribute``.

    Attributes:
        advantages: (bs, T) token advantages, zero on padding.
        returns: (bs, T) the same tensor, as verl's GRPO returns it.
        values: (bs, Kmax + 1) V_0..V_K per trace, NaN beyond K and on traces that fell back.
        segment_rewards: (bs, Kmax) R_1..R_K per trace, NaN beyond K and on traces that fell back.
        fallback: (bs,) bool, the redistribution was not applicable and the trace kept its GRPO advantage.
        metrics: scalar diagnostics, see ``redistribute``.
    """

    advantages: torch.Tensor
    returns: torch.Tensor
    values: torch.Tensor
    segment_rewards: torch.Tensor
    fallback: torch.Tensor
    metrics: dict[str, float]


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


def anchor_values(
    raw_values: torch.Tensor, outcome: float, group_mean: float, cfg: RedistributionConfig
) -> torch.Tensor:
    """Values V_0..V_K of one trace from its probe values (see ``RedistributionConfig``).

    Args:
        raw_values: (K+1,) probe values v̂_0..v̂_K, probabilities in [0, 1]. v̂_K is replaced by the outcome and
            not read.
        outcome: ζ ∈ [0, 1], the trace's terminal outcome.
        group_mean: mean outcome of the trace's group, V_0 when anchored.
        cfg: settings (``anchored``, ``value_mapping``, ``epsilon``).

    Returns:
        (K+1,) values, V_K = ζ; V_0 = group_mean when anchored, v̂_0 otherwise.
    """
    if raw_values.dim() != 1 or raw_values.numel() < 2 or not raw_values.is_floating_point():
        raise ValueError(
            f"raw_values must be a 1-D float tensor of K+1 >= 2 values, got shape {tuple(raw_values.shape)}"
        )
    used = raw_values[:-1].double()
    if not torch.isfinite(used).all():
        raise ValueError(f"raw_values contain NaN or inf: {raw_values.tolist()}")
    _check_probabilities("raw_values", used)
    _check_probabilities("outcome and group_mean", torch.tensor([float(outcome), float(group_mean)]))
    values, _ = _map_values(
        raw_values.double().unsqueeze(0),
        torch.tensor([raw_values.numel() - 1]),
        torch.tensor([float(outcome)], dtype=torch.float64),
        torch.tensor([float(group_mean)], dtype=torch.float64),
        cfg,
    )
    return values[0].to(raw_values.dtype)


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
    cfg: RedistributionConfig,
) -> RedistributionResult:
    """Token advantages from outcome scores and per-segment probe values.

    Args:
        scores: (bs,) float outcome ζ per trace, in [0, 1].
        response_mask: (bs, T) 0/1, right-padded (responses start at column 0, verl's layout).
        index: (bs,) hashables, group (prompt) id of each trace.
        segment_ends: (bs, Kmax) int64 exclusive segment ends, strictly increasing, padded with -1 at the end.
            A trace has segment data when its last end equals its response length.
        raw_values: (bs, Kmax + 1) float probe values v̂_0..v̂_K in [0, 1] (column K is replaced by ζ and not read),
            NaN-padded.
        cfg: settings.

    Returns:
        ``RedistributionResult``. With ``cfg.mix == 0`` its advantages are verl's GRPO tensor unchanged; the
        diagnostics are computed all the same, so a λ = 0 run logs what the redistribution would have done.

    A trace keeps its GRPO advantage (``fallback``) when its response is empty, its group has one trace, its
    outcome equals the anchor (|Σ R| < epsilon; all-correct and all-wrong groups, where Â = 0 anyway), it has no
    segment data, or its values or result hold NaN/inf. Metrics (floats): ``redistributed_frac``;
    ``fallback/{empty,singleton_group,zero_return,missing_segments,nonfinite}`` (trace counts, each trace counted
    under its first reason in that order); ``degenerate_groups`` (groups of two or more where every outcome equals
    the mean); ``affine_flat_traces`` (redistributed traces that used the linear-interpolation fallback of
    ``value_mapping="affine"``); over redistributed traces, when there are any: ``segments_per_trace``,
    ``negative_coef_frac`` (share of σ_k < 0), ``clipped_trace_frac`` and ``abs_segment_reward/pos_{k}``
    (mean |R_{k+1}|, for k < 4 where some trace has that segment) and ``abs_segment_reward/last``.

    Raises:
        ValueError: on shape or dtype mismatches, masks that are not right-padded 0/1, segment ends that are not
            strictly increasing and positive, that exceed the response length or have padding before data, and
            scores or finite probe values outside [0, 1].
    """
    lengths, num_segments = _check_batch(scores, response_mask, index, segment_ends, raw_values)
    bsz, max_segments = segment_ends.shape
    adv, group_mean = group_outcome_advantage(scores, index, cfg.epsilon, cfg.norm_adv_by_std)
    grpo = adv.unsqueeze(-1) * response_mask

    outcome, mean_outcome = scores.double(), group_mean.double()
    last_end = torch.cat([torch.full((bsz, 1), -1), segment_ends], dim=1).amax(1)  # ends increase; -1 if none
    has_segments = (num_segments > 0) & (last_end == lengths)
    read = torch.arange(max_segments + 1) < num_segments.unsqueeze(1)  # entries v̂_0..v̂_{K-1}
    finite_raw = ~(read & ~torch.isfinite(raw_values)).any(1)
    _check_probabilities("raw_values", raw_values.double()[read & torch.isfinite(raw_values)])

    values, flat = _map_values(raw_values.double(), num_segments, outcome, mean_outcome, cfg)
    rewards = segment_rewards(values)
    in_segment = torch.arange(max_segments) < num_segments.unsqueeze(1)
    total_reward = rewards.where(in_segment, 0.0).sum(1)

    groups = defaultdict(list)
    for i in range(bsz):
        groups[index[i]].append(i)
    singleton = torch.tensor([len(groups[index[i]]) == 1 for i in range(bsz)], dtype=torch.bool)
    outcome_at_mean = (outcome - mean_outcome).abs() < cfg.epsilon
    fallback, counts = _first_reasons(
        [
            ("empty", lengths == 0),
            ("singleton_group", singleton),
            ("zero_return", outcome_at_mean),
            ("missing_segments", ~has_segments),
            ("nonfinite", ~finite_raw),
            ("zero_return", total_reward.abs() < cfg.epsilon),  # unanchored: ζ == v̂_0
        ]
    )

    sigma = rewards / total_reward.unsqueeze(1)
    sigma, clipped = _clip_coefficients(sigma, in_segment & ~fallback.unsqueeze(1), num_segments, cfg.clip)
    segment_starts = torch.cat([torch.zeros(bsz, 1, dtype=torch.int64), segment_ends[:, :-1]], dim=1)
    tokens_per_segment = segment_ends - segment_starts
    segment_factor = (1.0 - cfg.mix) + cfg.mix * lengths.double().unsqueeze(1) * sigma / tokens_per_segment

    advantages = grpo  # λ = 0: verl's tensor itself
    if cfg.mix > 0:
        advantages = grpo.clone()
        for i in torch.nonzero(~fallback).flatten().tolist():
            k = int(num_segments[i])
            token_factor = segment_factor[i, :k].repeat_interleave(tokens_per_segment[i, :k])
            row = (adv[i].double() * token_factor).to(grpo.dtype)
            if torch.isfinite(row).all():
                advantages[i, : row.numel()] = row  # padding keeps GRPO's Â · 0
            else:
                counts["nonfinite"] += 1.0
                fallback[i] = True

    kept = ~fallback.unsqueeze(1)
    values = values.where(kept, float("nan")).to(raw_values.dtype)
    rewards = rewards.where(kept, float("nan")).to(raw_values.dtype)
    metrics = _metrics(counts, fallback, outcome_at_mean, groups, num_segments, sigma, clipped, flat, rewards)
    return RedistributionResult(advantages, advantages, values, rewards, fallback, metrics)


def _check_probabilities(name: str, values: torch.Tensor):
    outside = (values < -_PROBABILITY_SLACK) | (values > 1.0 + _PROBABILITY_SLACK)
    if outside.any():
        raise ValueError(f"{name} must be probabilities in [0, 1]; found {values[outside][:5].tolist()}")


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


def _check_batch(scores, response_mask, index, segment_ends, raw_values) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a batch; returns response lengths (bs,) and segment counts (bs,), both int64."""
    bsz = check_outcome_batch(scores, response_mask, index)
    if segment_ends.dim() != 2 or segment_ends.shape[0] != bsz or segment_ends.dtype != torch.int64:
        raise ValueError(
            f"segment_ends must be int64 of shape (bs={bsz}, Kmax), "
            f"got {tuple(segment_ends.shape)} {segment_ends.dtype}"
        )
    expected = (bsz, segment_ends.shape[1] + 1)
    if tuple(raw_values.shape) != expected or not raw_values.is_floating_point():
        raise ValueError(
            f"raw_values must be float of shape (bs, Kmax + 1) = {expected}, got {tuple(raw_values.shape)} "
            f"{raw_values.dtype}"
        )
    _check_probabilities("scores", scores.double())

    token_present = response_mask != 0
    if not ((response_mask == 0) | (response_mask == 1)).all():
        raise ValueError("response_mask must hold only 0 and 1")
    lengths = token_present.sum(1)
    if not torch.equal(token_present, torch.arange(response_mask.shape[1]) < lengths.unsqueeze(1)):
        bad = _first_row(token_present != (torch.arange(response_mask.shape[1]) < lengths.unsqueeze(1)))
        raise ValueError(f"response_mask must be right-padded (tokens from column 0, then zeros); row {bad} is not")

    present = segment_ends != -1
    if (segment_ends < -1).any():
        raise ValueError(f"segment_ends: use -1 for padding; row {_first_row(segment_ends < -1)} has other negatives")
    data_after_padding = present[:, 1:] & ~present[:, :-1]
    if data_after_padding.any():
        raise ValueError(f"segment_ends: -1 padding must come after all ends; row {_first_row(data_after_padding)}")
    previous_end = torch.cat([torch.zeros(bsz, 1, dtype=torch.int64), segment_ends[:, :-1]], dim=1)
    not_increasing = present & (segment_ends <= previous_end)
    if not_increasing.any():
        row = _first_row(not_increasing)
        raise ValueError(
            f"segment_ends must be positive and strictly increasing; row {row}: {segment_ends[row].tolist()}"
        )
    beyond = present & (segment_ends > lengths.unsqueeze(1))
    if beyond.any():
        row = _first_row(beyond)
        raise ValueError(
            f"segment end beyond response length in row {row}: ends {segment_ends[row].tolist()}, "
            f"length {int(lengths[row])}"
        )
    return lengths, present.sum(1)


def _first_row(mask: torch.Tensor) -> int:
    return int(mask.any(1).nonzero()[0, 0])


def _map_values(raw, num_segments, outcome, mean_outcome, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """Values from padded probe values, in float64.

    Args:
        raw: (n, M+1) probe values; entries from column K on are not read.
        num_segments: (n,) K. outcome: (n,) ζ. mean_outcome: (n,) group mean, V_0 when anchored.

    Returns:
        values (n, M+1), NaN beyond K; flat (n,) bool, rows that took the linear-interpolation fallback.
    """
    position = torch.arange(raw.shape[1], dtype=torch.float64).expand_as(raw)
    k = num_segments.unsqueeze(1)
    zeta = outcome.unsqueeze(1)
    flat = torch.zeros_like(outcome, dtype=torch.bool)
    values = raw.clone()
    if cfg.anchored and cfg.value_mapping == "affine":
        gap = outcome - raw[:, 0]
        flat = gap.abs() < cfg.epsilon
        scale = (outcome - mean_outcome) / gap.where(~flat, 1.0)
        affine = (zeta + (raw - zeta) * scale.unsqueeze(1)).clamp(0.0, 1.0)
        linear = mean_outcome.unsqueeze(1) + (zeta - mean_outcome.unsqueeze(1)) * position / k.clamp(min=1)
        values = torch.where(flat.unsqueeze(1), linear, affine)
    elif cfg.anchored and cfg.value_mapping == "log_affine":
        # Log-probabilities of long continuations span orders of magnitude: map log v̂ affinely, v̂_0 -> V_0 and
        # certainty (log 1 = 0) -> 1; states less likely than the start fall towards 0.
        log_raw = raw.clamp(min=1e-30).log()
        log_start = log_raw[:, :1]
        flat = (log_start[:, 0].abs() < cfg.epsilon) | (raw[:, 0] <= 0.0)
        progress = (log_raw - log_start) / (-log_start).where(~flat.unsqueeze(1), 1.0)
        mapped = (mean_outcome.unsqueeze(1) + (1.0 - mean_outcome.unsqueeze(1)) * progress).clamp(0.0, 1.0)
        linear = mean_outcome.unsqueeze(1) + (zeta - mean_outcome.unsqueeze(1)) * position / k.clamp(min=1)
        values = torch.where(flat.unsqueeze(1), linear, mapped)
    if cfg.anchored:
        values[:, 0] = mean_outcome
    values = torch.where(position == k, zeta, values)
    return values.where(position <= k, float("nan")), flat


def _first_reasons(reasons) -> tuple[torch.Tensor, dict[str, float]]:
    """OR of the reason masks, and per reason the number of traces for which it is the first that holds."""
    fallback = torch.zeros_like(reasons[0][1])
    counts = {}
    for name, mask in reasons:
        counts[name] = counts.get(name, 0.0) + float((mask & ~fallback).sum())
        fallback = fallback | mask
    return fallback, counts


def _clip_coefficients(sigma, active, num_segments, clip) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep K·σ_k within [−clip, clip] while Σ_k σ_k stays 1.

    Rows within the bound are returned unchanged. For the others, σ_k ← clamp(σ_k − τ, −clip/K, clip/K) with the
    shift τ found by bisection so the sum is 1 (the Euclidean projection onto the allowed set). Clamping and then
    dividing by the sum instead could divide by a sum near zero or flip every sign.

    Args:
        sigma: (n, M) coefficients summing to 1 over active entries. active: (n, M) bool.
        num_segments: (n,) K. clip: c >= 1.

    Returns:
        sigma (n, M), and clipped (n,) bool: rows that were changed.
    """
    bound = (clip / num_segments.clamp(min=1).double()).unsqueeze(1)
    clipped = (active & (sigma.abs() > bound)).any(1)
    if not clipped.any():
        return sigma, clipped
    rows, limit, mask = sigma[clipped], bound[clipped], active[clipped]
    # At τ = min σ − c/K every entry sits at +c/K (sum c >= 1); at τ = max σ + c/K at −c/K (sum −c <= 1).
    low = rows.where(mask, float("inf")).amin(1) - limit.squeeze(1)
    high = rows.where(mask, float("-inf")).amax(1) + limit.squeeze(1)
    for _ in range(_BISECTION_STEPS):
        middle = (low + high) / 2
        total = (rows - middle.unsqueeze(1)).clamp(-limit, limit).where(mask, 0.0).sum(1)
        low, high = middle.where(total > 1.0, low), high.where(total > 1.0, middle)
    projected = (rows - ((low + high) / 2).unsqueeze(1)).clamp(-limit, limit)
    sigma = sigma.clone()
    sigma[clipped] = projected.where(mask, rows)
    return sigma, clipped


def _metrics(counts, fallback, outcome_at_mean, groups, num_segments, sigma, clipped, flat, rewards) -> dict:
    bsz = fallback.numel()
    metrics = {f"fallback/{name}": count for name, count in counts.items()}
    metrics["redistributed_frac"] = float((~fallback).sum()) / bsz if bsz else 0.0
    metrics["degenerate_groups"] = float(
        sum(len(rows) > 1 and bool(outcome_at_mean[rows].all()) for rows in groups.values())
    )
    live = ~fallback
    metrics["affine_flat_traces"] = float((flat & live).sum())  # all False unless anchored affine
    if not live.any():
        return metrics
    in_segment = torch.arange(sigma.shape[1]) < num_segments.unsqueeze(1)
    live_segments = in_segment & live.unsqueeze(1)
    metrics["segments_per_trace"] = float(num_segments[live].double().mean())
    metrics["negative_coef_frac"] = float((sigma[live_segments] < 0).double().mean())
    metrics["clipped_trace_frac"] = float(clipped[live].double().mean())
    magnitude = rewards.double().abs()
    for k in range(min(_LOGGED_POSITIONS, sigma.shape[1])):
        has_k = live & (num_segments > k)
        if has_k.any():
            metrics[f"abs_segment_reward/pos_{k}"] = float(magnitude[has_k, k].mean())
    last = magnitude.gather(1, (num_segments - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    metrics["abs_segment_reward/last"] = float(last[live].mean())
    return metrics
