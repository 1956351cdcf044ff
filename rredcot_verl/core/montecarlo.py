"""Monte-Carlo segment values: K sampled continuations from each boundary prefix, scored by the outcome reward.

The unbiased (and expensive) reference for the values ``rredcot`` estimates without generation. Generation and scoring
are passed in as functions, so the same code runs on the trainer's rollout engine, on HF ``generate`` in a benchmark,
or on a fake generator in a test. Imports neither verl nor ray.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MonteCarloSettings:
    """``segment_mc``: values from K continuations per boundary prefix through the rollout engine.

    Attributes:
        num_continuations: K per boundary (default 9, VinePPO's choice).
        max_tokens: length cap of a continuation; a truncated continuation counts as a failure.
        temperature: sampling temperature of the continuations.
    """

    num_continuations: int = 9
    max_tokens: int = 128
    temperature: float = 1.0

    def __post_init__(self):
        if self.num_continuations < 1:
            raise ValueError(f"segment_mc.num_continuations must be >= 1, got {self.num_continuations}")
        if self.max_tokens < 1:
            raise ValueError(f"segment_mc.max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class ContinuationRequest:
    """One continuation to sample: ``prompt + response[:start]`` continued for at most ``max_tokens``."""

    trace: int
    state: int
    start: int
    prefix_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Continuation:
    """A sampled continuation: its token ids and whether it hit ``max_tokens`` without finishing."""

    token_ids: tuple[int, ...]
    truncated: bool


def plan_continuations(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    segment_ends: Sequence[Sequence[int]],
    cfg: MonteCarloSettings,
    max_total_length: int,
) -> list[ContinuationRequest]:
    """K requests per valued state S_0..S_{K-1} of every trace (states whose prefix leaves no room get none).

    Args:
        prompts, responses: token ids per trace, no padding.
        segment_ends: per trace, exclusive segment ends b_1..b_K (empty for an empty response).
        cfg: K, length cap.
        max_total_length: the engine's prompt + response budget.
    """
    requests = []
    for i, (prompt, response, ends) in enumerate(zip(prompts, responses, segment_ends)):
        for k, start in enumerate([0, *list(ends)[:-1]] if ends else []):
            room = min(cfg.max_tokens, max_total_length - len(prompt) - start)
            if room < 1:
                continue
            prefix = tuple(prompt) + tuple(response[:start])
            requests.extend(ContinuationRequest(i, k, start, prefix, room) for _ in range(cfg.num_continuations))
    return requests


def monte_carlo_values(
    responses: Sequence[Sequence[int]],
    segment_ends: Sequence[Sequence[int]],
    outcomes: Sequence[float],
    requests: Sequence[ContinuationRequest],
    continuations: Sequence[Continuation],
    judge: Callable[[int, list[int]], float],
    max_segments: int,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Mean outcome of the continuations of each state.

    Args:
        responses, segment_ends, outcomes: per trace.
        requests: from ``plan_continuations``; continuations: one per request, same order.
        judge: ``judge(trace, full_response_ids) -> reward`` of ``response[:start] + continuation``.
        max_segments: output width Kmax (at least the largest K).

    Returns:
        seg_ends (bs, Kmax) int64, -1 padded; raw_values (bs, Kmax + 1) float32, v̂_0..v̂_{K-1} and ζ in column K, NaN
        padded and NaN for a state that had no room to continue (the redistribution then falls back to GRPO);
        metrics (continuations, truncated, generated tokens). A truncated continuation counts as outcome 0.
    """
    if len(requests) != len(continuations):
        raise ValueError(f"{len(continuations)} continuations for {len(requests)} requests")
    k_max = max([max_segments, *(len(e) for e in segment_ends)])
    sums = torch.zeros(len(responses), k_max + 1, dtype=torch.float64)
    counts = torch.zeros(len(responses), k_max + 1, dtype=torch.float64)
    truncated = generated = 0
    for request, continuation in zip(requests, continuations):
        generated += len(continuation.token_ids)
        counts[request.trace, request.state] += 1
        if continuation.truncated:
            truncated += 1
            continue
        full = list(responses[request.trace][: request.start]) + list(continuation.token_ids)
        sums[request.trace, request.state] += float(judge(request.trace, full))
    seg_ends = torch.full((len(responses), k_max), -1, dtype=torch.int64)
    raw_values = torch.full((len(responses), k_max + 1), float("nan"), dtype=torch.float32)
    for i, ends in enumerate(segment_ends):
        k = len(ends)
        if k == 0:
            continue
        seg_ends[i, :k] = torch.tensor(list(ends), dtype=torch.int64)
        raw_values[i, :k] = (sums[i, :k] / counts[i, :k]).float()  # 0/0 = NaN: no room at that prefix
        raw_values[i, k] = float(outcomes[i])
    metrics = {
        "segment_mc/continuations": float(len(requests)),
        "segment_mc/truncated_continuations": float(truncated),
        "segment_mc/extra_generated_tokens": float(generated),
    }
    return seg_ends, raw_values, metrics
