"""What ``core.redistribution.redistribute`` requires of a batch: shapes, dtypes, 0/1 masks, segment ends, probe
values that are probabilities. Each check raises ValueError naming the first offending row."""

from __future__ import annotations

import torch

from rredcot_verl.core.outcomes import check_outcome_batch

__all__ = ["PROBABILITY_SLACK", "check_batch", "check_probabilities", "check_shaped"]

# Slack for probabilities that should lie in [0, 1] but come out of float sums of probabilities (and for outcomes,
# as a share of the reward range).
PROBABILITY_SLACK = 1e-4


def check_probabilities(name: str, values: torch.Tensor):
    """Raise unless every entry of ``values`` (finite) lies in [0, 1], up to ``PROBABILITY_SLACK``."""
    outside = (values < -PROBABILITY_SLACK) | (values > 1.0 + PROBABILITY_SLACK)
    if outside.any():
        raise ValueError(f"{name} must be probabilities in [0, 1]; found {values[outside][:5].tolist()}")


def check_shaped(shaped_scores: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """The shaped scores, checked (finite floats, one per score) and in the scores' dtype."""
    if shaped_scores.shape != scores.shape or not shaped_scores.is_floating_point():
        raise ValueError(
            f"shaped_scores must be float of shape {tuple(scores.shape)}, got {tuple(shaped_scores.shape)}"
        )
    if not torch.isfinite(shaped_scores).all():
        raise ValueError(f"shaped_scores must be finite, got {shaped_scores.tolist()}")
    return shaped_scores.to(scores.dtype)


def check_batch(scores, response_mask, index, segment_ends, raw_values) -> tuple[torch.Tensor, ...]:
    """Validate a batch; returns the policy tokens per response (bs,), the segment counts (bs,) and the segment ends
    counted in policy tokens (bs, Kmax), -1 padded, all int64."""
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

    trained = response_mask != 0
    if not ((response_mask == 0) | (response_mask == 1)).all():
        raise ValueError("response_mask must hold only 0 and 1")
    lengths = trained.sum(1)
    late_start = (lengths > 0) & ~trained[:, :1].any(1)
    if late_start.any():
        raise ValueError(
            "response_mask must be right-padded, holes between turns allowed (the model's tokens from column 0); "
            f"row {_first_row(late_start.unsqueeze(1))} starts with a 0"
        )
    no_token = torch.zeros(bsz, 1, dtype=torch.int64)
    # Policy tokens before each position: position b of the full response is position rank[b] of the policy's
    # tokens alone, where the redistribution is computed.
    rank = torch.cat([no_token, trained.long().cumsum(1)], dim=1)
    # One past the last policy token: where the last segment ends.
    extent = torch.cat([no_token, torch.where(trained, torch.arange(1, trained.shape[1] + 1), 0)], dim=1).amax(1)

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
    beyond = present & (segment_ends > extent.unsqueeze(1))
    if beyond.any():
        row = _first_row(beyond)
        raise ValueError(
            f"segment end beyond response length in row {row}: ends {segment_ends[row].tolist()}, "
            f"length {int(extent[row])}"
        )
    # A segment starts on a policy token (b_0 = 0 is one, checked above), so it holds at least one.
    inner_end = present & torch.cat([present[:, 1:], torch.zeros(bsz, 1, dtype=torch.bool)], dim=1)
    trained_or_end = torch.cat([trained, torch.zeros(bsz, 1, dtype=torch.bool)], dim=1)  # ends <= T index it
    starts_on_hole = inner_end & ~trained_or_end.gather(1, segment_ends.clamp(min=0))
    if starts_on_hole.any():
        row = _first_row(starts_on_hole)
        raise ValueError(
            f"segment start on a 0 of response_mask (tool output or template) in row {row}: "
            f"ends {segment_ends[row].tolist()}"
        )
    policy_ends = torch.where(present, rank.gather(1, segment_ends.clamp(min=0)), segment_ends)
    return lengths, present.sum(1), policy_ends


def _first_row(mask: torch.Tensor) -> int:
    return int(mask.any(1).nonzero()[0, 0])
