"""Segment-boundary values from probe plans: the scoring half of the value pass (worker side).

``planning.plan_traces`` builds every trace's boundaries and probes from the whole batch; ``score_plans`` scores them
with the (old) policy model, no grad, in token-budgeted micro-batches (one forward each, the same number on every
data-parallel rank), and turns the probe log-probs into raw values v̂_0..v̂_K (column K = ζ).
Imports neither verl nor ray.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from rredcot_verl.core.planning import plan_traces
from rredcot_verl.core.probes import own_continuation_values, values_from_probe_logp
from rredcot_verl.core.scoring import ValuePassSettings, score_batch_packed_with_stats
from rredcot_verl.core.traces import TraceRecord


@torch.no_grad()
def score_plans(
    model,
    plans: Sequence[TraceRecord],
    *,
    max_segments: int,
    max_positions: int | None = None,
    max_token_len: int = ValuePassSettings.max_token_len,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Score every plan's probes with ``model``: ``(segment_ends, raw_values, metrics)``, the first two being
    ``AdvantageBatch``'s segment inputs as they are (no container of their own, so the two cannot drift apart).

    All plans are scored together (``score_batch_packed``): micro-batches of at most ``max_token_len`` padded tokens,
    one forward each, and under torch.distributed as many forwards as the busiest rank (FSDP2 gathers parameters in
    every forward, so a rank with an empty shard still joins them). Traces without an estimate (empty response, no
    candidate answer, probes that do not fit ``max_positions``) get NaN values; the redistribution then keeps their
    GRPO advantage and counts them.

    Args:
        model: the policy (a transformers causal LM), in eval mode.
        plans: planned records, from ``planning.plan_traces`` (any subset of a batch: values depend only on the
            plan).
        max_segments: the output width Kmax (``segmentation.max_segments``), fixed so that shards concatenate.
        max_positions: the model's position budget.
        max_token_len: ``value_pass.max_token_len``.

    Returns:
        segment_ends: (bs, Kmax) int64 exclusive segment ends into each response, -1 padded.
        raw_values: (bs, Kmax + 1) float32 v̂_0..v̂_K (column K = ζ), NaN padded; NaN inside a row means "no estimate".
        metrics: scalar diagnostics (``rredcot/...`` keys).
    """
    started = time.perf_counter()
    k_max = max([max_segments, *(p.num_values for p in plans)])
    segment_ends = torch.full((len(plans), k_max), -1, dtype=torch.int64)
    raw_values = torch.full((len(plans), k_max + 1), float("nan"), dtype=torch.float32)
    # own_continuation reads the trace log-probs; the other rules read probes only. A plan with no values (empty
    # response) or no probes contributes no row to any forward.
    own = [p.value_rule == "own_continuation" and p.num_values > 0 for p in plans]
    temperatures = {p.temperature for p in plans}
    if len(temperatures) > 1:
        raise ValueError(f"plans of one value pass must share the rollout temperature, got {sorted(temperatures)}")
    scores, stats = score_batch_packed_with_stats(
        model,
        [p.prompt_ids for p in plans],
        [p.response_ids for p in plans],
        [p.probes if p.num_values > 0 and not is_own else [] for p, is_own in zip(plans, own)],
        return_trace_stats=own,
        max_positions=max_positions,
        max_token_len=max_token_len,
        synchronize=True,
        temperature=temperatures.pop() if temperatures else 1.0,
    )
    num_probes = num_skipped = 0
    for i, (plan, score, is_own) in enumerate(zip(plans, scores, own)):
        if plan.num_values == 0:
            continue
        if is_own:
            values = own_continuation_values(score.trace_log_probs, plan.starts, plan.success, plan.response_mask)
        elif plan.probes:
            values = values_from_probe_logp(score.probe_logp, plan.probes, plan.num_values, plan.value_rule)
        else:
            values = torch.full((plan.num_values,), float("nan"))
        num_probes += len(plan.probes)
        num_skipped += score.num_skipped
        segment_ends[i, : plan.num_values] = torch.tensor(plan.segment_ends, dtype=torch.int64)
        raw_values[i, : plan.num_values] = values
        raw_values[i, plan.num_values] = plan.outcome
    n = max(len(plans), 1)
    metrics = {
        "rredcot/value_time_s": time.perf_counter() - started,
        "rredcot/value_micro_batches": float(stats.micro_batches),
        "rredcot/value_dummy_forwards": float(stats.dummy_forwards),
        "rredcot/probes_per_trace": num_probes / n,
        "rredcot/probes_skipped_too_long": float(num_skipped),
        "rredcot/traces_without_candidates": float(sum(p.no_candidates for p in plans)),
    }
    return segment_ends, raw_values, metrics


@torch.no_grad()
def compute_segment_values(
    model, tokenizer, traces, settings, *, task, vocab=None, max_positions=None, repairs=None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Plan and score in one process (analysis and benchmarks): ``plan_traces`` then ``score_plans``.
    ``task``: the task adapter (``rredcot_verl.tasks.resolve_task``); ``repairs``: verified repairs per group
    (``candidates.source: group_and_repairs``)."""
    plans = plan_traces(traces, settings, tokenizer, task, vocab=vocab, repairs=repairs)
    return score_plans(
        model,
        plans,
        max_segments=settings.segmentation.max_segments,
        max_positions=max_positions,
        max_token_len=settings.value_pass.max_token_len,
    )
