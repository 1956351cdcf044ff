"""Monte-Carlo segment values: K sampled continuations from each boundary prefix, scored by the outcome reward.

The unbiased (and expensive) reference for the values ``rredcot`` estimates without generation. Generation and scoring
are passed in as functions, so the same code runs on the trainer's rollout engine, on HF ``generate`` in a benchmark,
or on a fake generator in a test. Imports neither verl nor ray.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class MonteCarloSettings:
    """``segment_mc``: values from K continuations per boundary prefix through the rollout engine.

    Attributes:
        num_continuations: K per boundary (default 9, VinePPO's choice).
        max_tokens: length cap of a continuation, or None (default): the room a training rollout would have had
            from that prefix (``data.max_prompt_length + data.max_response_length`` minus the prefix), so that a
            continuation from mid-thinking can reach its answer as the rollout could. A truncated continuation counts
            as a failure, so a cap below the typical distance to the answer makes every early value ~0.
        temperature: sampling temperature of the continuations.
        max_prefix_tokens_per_call: the continuations are requested and judged in chunks of traces whose distinct
            prefixes hold at most this many token ids (a trace larger than that is a chunk of its own), so the driver
            never holds every state's prefix and continuations of a paper-scale batch at once.
    """

    num_continuations: int = 9
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    max_prefix_tokens_per_call: int = 1 << 22

    def __post_init__(self):
        if self.num_continuations < 1:
            raise ValueError(f"segment_mc.num_continuations must be >= 1, got {self.num_continuations}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"segment_mc.max_tokens must be >= 1 or null, got {self.max_tokens}")
        if self.max_prefix_tokens_per_call < 1:
            raise ValueError(f"segment_mc.max_prefix_tokens_per_call must be >= 1, got {self.max_prefix_tokens_per_call}")


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
    return [request for chunk in continuation_chunks(prompts, responses, segment_ends, cfg, max_total_length)
            for request in chunk]  # fmt: skip


def continuation_chunks(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    segment_ends: Sequence[Sequence[int]],
    cfg: MonteCarloSettings,
    max_total_length: int,
) -> Iterator[list[ContinuationRequest]]:
    """``plan_continuations``' requests, planned trace by trace and yielded in chunks of whole traces whose distinct
    prefixes hold at most ``cfg.max_prefix_tokens_per_call`` token ids (the K requests of a state share one prefix)."""
    chunk: list[ContinuationRequest] = []
    chunk_tokens = 0
    for i, (prompt, response, ends) in enumerate(zip(prompts, responses, segment_ends)):
        trace_requests, trace_tokens = [], 0
        for k, start in enumerate([0, *list(ends)[:-1]] if ends else []):
            room = max_total_length - len(prompt) - start
            if cfg.max_tokens is not None:
                room = min(cfg.max_tokens, room)
            if room < 1:
                continue
            prefix = tuple(prompt) + tuple(response[:start])
            trace_tokens += len(prefix)
            trace_requests.extend(ContinuationRequest(i, k, start, prefix, room) for _ in range(cfg.num_continuations))
        if chunk and chunk_tokens + trace_tokens > cfg.max_prefix_tokens_per_call:
            yield chunk
            chunk, chunk_tokens = [], 0
        chunk.extend(trace_requests)
        chunk_tokens += trace_tokens
    if chunk:
        yield chunk


class ContinuationTally:
    """Running sums of judged continuations per state, so continuations can be dropped once judged.

    Args:
        num_traces: bs; k_max: the output width Kmax.
    """

    def __init__(self, num_traces: int, k_max: int) -> None:
        self.k_max = k_max
        self.sums = torch.zeros(num_traces, k_max + 1, dtype=torch.float64)
        self.counts = torch.zeros(num_traces, k_max + 1, dtype=torch.float64)
        self.requests = self.truncated = self.generated = 0

    def add(
        self,
        responses: Sequence[Sequence[int]],
        requests: Sequence[ContinuationRequest],
        continuations: Sequence[Continuation],
        judge: Callable[[int, list[int]], float],
    ) -> None:
        """Judge ``continuations`` (one per request, same order); a truncated one counts as outcome 0."""
        if len(requests) != len(continuations):
            raise ValueError(f"{len(continuations)} continuations for {len(requests)} requests")
        self.requests += len(requests)
        for request, continuation in zip(requests, continuations):
            self.generated += len(continuation.token_ids)
            self.counts[request.trace, request.state] += 1
            if continuation.truncated:
                self.truncated += 1
                continue
            full = list(responses[request.trace][: request.start]) + list(continuation.token_ids)
            self.sums[request.trace, request.state] += float(judge(request.trace, full))

    def values(
        self, segment_ends: Sequence[Sequence[int]], outcomes: Sequence[float]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """``values_from_continuations``' outputs from the tallied continuations."""
        seg_ends = torch.full((len(segment_ends), self.k_max), -1, dtype=torch.int64)
        raw_values = torch.full((len(segment_ends), self.k_max + 1), float("nan"), dtype=torch.float32)
        for i, ends in enumerate(segment_ends):
            k = len(ends)
            if k == 0:
                continue
            seg_ends[i, :k] = torch.tensor(list(ends), dtype=torch.int64)
            raw_values[i, :k] = (self.sums[i, :k] / self.counts[i, :k]).float()  # 0/0 = NaN: no room at that prefix
            raw_values[i, k] = float(outcomes[i])
        metrics = {
            "segment_mc/continuations": float(self.requests),
            "segment_mc/truncated_continuations": float(self.truncated),
            "segment_mc/extra_generated_tokens": float(self.generated),
        }
        return seg_ends, raw_values, metrics


def values_from_continuations(
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
    tally = ContinuationTally(len(responses), max_k(segment_ends, max_segments))
    tally.add(responses, requests, continuations, judge)
    return tally.values(segment_ends, outcomes)


def max_k(segment_ends: Sequence[Sequence[int]], max_segments: int) -> int:
    """The output width Kmax: ``max_segments``, or more when a trace has more segments."""
    return max([max_segments, *(len(e) for e in segment_ends)])
