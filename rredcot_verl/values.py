"""Segment-boundary values for a batch of traces: segmentation → probes → packed scoring → raw values.

This is the algorithm side of the actor worker's extra pass (``workers.py`` only unpacks the verl batch and calls
``compute_segment_values``); it imports neither verl nor ray. States are S_0 (empty response) and S_k at each segment
end b_1..b_{K-1}; the terminal state's value is the trace's outcome ζ, so ``raw_values[:, K] = ζ``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import torch

from rredcot_verl.config import RRedCoTSettings
from rredcot_verl.probes import (
    Probe,
    build_exit_probes,
    build_reference_probes,
    own_continuation_values,
    score_probes_packed,
    values_from_probe_logp,
)
from rredcot_verl.segmentation import BoundaryVocab, segment_response
from rredcot_verl.tasks.reward import extract_boxed_answer


@dataclass
class TraceRecord:
    """One rollout as the value pass needs it.

    Attributes:
        prompt_ids: (P,) int64, no padding.
        response_ids: (L,) int64, no padding (L may be 0).
        entropy: (L,) float, the old policy's per-token entropy (from verl's log-prob pass).
        outcome: ζ, the verified reward.
        group: prompt id (verl's ``uid``).
        ground_truth: the dataset answer string, if any.
        reference_steps: the dataset's reference step lines, if any (``extra_info.reference_steps``).
    """

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    entropy: torch.Tensor
    outcome: float
    group: Hashable
    ground_truth: str | None = None
    reference_steps: Sequence[str] | None = None


@dataclass
class SegmentValues:
    """Output of ``compute_segment_values``.

    Attributes:
        segment_ends: (bs, Kmax) int64 exclusive segment ends into each response, -1 padded.
        raw_values: (bs, Kmax + 1) float32 v̂_0..v̂_K (column K = ζ), NaN padded; NaN inside a row means "no estimate".
        metrics: scalar diagnostics (``rredcot/...`` keys).
    """

    segment_ends: torch.Tensor
    raw_values: torch.Tensor
    metrics: dict[str, float]


@dataclass
class _GroupBank:
    correct_answers: list[str]
    all_answers: list[str]
    correct_steps: list[tuple[list[str], str]]


def _thinking_lines(text: str, think_start: str, think_end: str) -> list[str]:
    body = text.split(think_start, 1)[1] if think_start in text else text
    body = body.split(think_end, 1)[0]
    return [line for line in body.split("\n") if line.strip()]


def _group_banks(traces: Sequence[TraceRecord], texts: Sequence[str], settings: RRedCoTSettings) -> dict:
    cand = settings.candidates
    banks: dict[Hashable, _GroupBank] = defaultdict(lambda: _GroupBank([], [], []))
    for trace, text in zip(traces, texts):
        bank = banks[trace.group]
        answer = extract_boxed_answer(text)
        if answer is not None and answer not in bank.all_answers:
            bank.all_answers.append(answer)
        if trace.outcome > 0 and answer is not None and cand.source in ("both", "group"):
            if answer not in bank.correct_answers:
                bank.correct_answers.append(answer)
            bank.correct_steps.append((_thinking_lines(text, cand.think_start, cand.think_end), answer))
    for trace in traces:
        bank = banks[trace.group]
        if cand.source in ("both", "ground_truth") and trace.ground_truth is not None:
            truth = str(trace.ground_truth)
            if truth not in bank.correct_answers:
                bank.correct_answers.append(truth)
            if truth not in bank.all_answers:
                bank.all_answers.append(truth)
            if trace.reference_steps is not None:
                entry = (list(trace.reference_steps), truth)
                if entry not in bank.correct_steps:
                    bank.correct_steps.append(entry)
    return banks


def _steps_done(prefix_text: str, think_start: str) -> tuple[int, bool]:
    """Completed thinking lines in a prefix, and whether the prefix already opened thinking."""
    if think_start not in prefix_text:
        return 0, False
    body = prefix_text.split(think_start, 1)[1]
    return body.count("\n") - (1 if body.startswith("\n") else 0), True


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _trace_probes(trace, boundaries, bank, tokenizer, settings) -> tuple[list[Probe], int]:
    """Probes for states S_0..S_{K-1} (probe boundaries 0, b_1..b_{K-1}); returns (probes, number of values)."""
    probe_cfg, cand = settings.probe, settings.candidates
    starts = [0, *boundaries[:-1]]
    eos = [tokenizer.eos_token_id]
    answer_ids = lambda answer: _encode(tokenizer, cand.answer_prefix + answer + cand.answer_suffix) + eos  # noqa: E731
    if not bank.correct_answers:
        return [], len(starts)
    response = trace.response_ids.tolist()
    if probe_cfg.value_source == "exit_probe":
        think_end_id = tokenizer.convert_tokens_to_ids(cand.think_end)
        thinking_length = response.index(think_end_id) if think_end_id in response else len(response)
        probes = build_exit_probes(
            starts,
            _encode(tokenizer, probe_cfg.exit_text),
            [answer_ids(a) for a in bank.correct_answers],
            thinking_length=thinking_length,
            all_answers=[answer_ids(a) for a in bank.all_answers],
        )
        return probes, len(starts)
    # reference_continuation: the bank's remaining steps from the step the prefix reached, then the closing text.
    banks = []
    for start in starts:
        done, opened = _steps_done(tokenizer.decode(response[:start], skip_special_tokens=False), cand.think_start)
        opening = "" if opened else cand.think_start + "\n"
        entries = []
        for steps, answer in bank.correct_steps:
            remainder = "".join(step + "\n" for step in steps[done:])
            closing = probe_cfg.exit_text.lstrip("\n") + cand.answer_prefix + answer + cand.answer_suffix
            entries.append(_encode(tokenizer, opening + remainder + closing) + eos)
        banks.append(entries)
    return build_reference_probes(starts, banks), len(starts)


@torch.no_grad()
def compute_segment_values(
    model,
    tokenizer,
    traces: Sequence[TraceRecord],
    settings: RRedCoTSettings,
    *,
    vocab: BoundaryVocab | None = None,
    max_positions: int | None = None,
) -> SegmentValues:
    """Segment every trace and estimate its boundary values with the (old) policy ``model``, no grad.

    Traces that cannot be valued (empty response, no candidate answer in the group and no ground truth, probes that
    do not fit ``max_positions``) get NaN values; the redistribution then keeps their GRPO advantage and counts them.
    """
    started = time.perf_counter()
    vocab = vocab or BoundaryVocab.from_tokenizer(tokenizer, settings.segmentation)
    texts = [tokenizer.decode(t.response_ids.tolist(), skip_special_tokens=False) for t in traces]
    banks = _group_banks(traces, texts, settings)
    all_ends: list[list[int]] = []
    all_values: list[torch.Tensor] = []
    num_probes = num_skipped = no_candidates = 0
    for trace in traces:
        length = trace.response_ids.numel()
        if length == 0:
            all_ends.append([])
            all_values.append(torch.empty(0))
            continue
        ends = segment_response(trace.response_ids, trace.entropy, vocab, settings.segmentation)
        values, probes, skipped = _values_for_trace(model, tokenizer, trace, ends, banks[trace.group], settings, max_positions)
        num_probes += probes
        num_skipped += skipped
        no_candidates += int(probes == 0 and settings.probe.value_source != "own_continuation")
        all_ends.append(ends)
        all_values.append(torch.cat([values, torch.tensor([float(trace.outcome)])]))
    # A fixed width (max_segments) so that batches computed on different data-parallel ranks concatenate.
    k_max = max([settings.segmentation.max_segments, *(len(e) for e in all_ends)])
    segment_ends = torch.full((len(traces), k_max), -1, dtype=torch.int64)
    raw_values = torch.full((len(traces), k_max + 1), float("nan"), dtype=torch.float32)
    for i, (ends, values) in enumerate(zip(all_ends, all_values)):
        segment_ends[i, : len(ends)] = torch.tensor(ends, dtype=torch.int64)
        raw_values[i, : values.numel()] = values
    n = max(len(traces), 1)
    metrics = {
        "rredcot/value_time_s": time.perf_counter() - started,
        "rredcot/probes_per_trace": num_probes / n,
        "rredcot/probes_skipped_too_long": float(num_skipped),
        "rredcot/traces_without_candidates": float(no_candidates),
    }
    return SegmentValues(segment_ends, raw_values, metrics)


def _values_for_trace(model, tokenizer, trace, ends, bank, settings, max_positions) -> tuple[torch.Tensor, int, int]:
    """(values (K,) for S_0..S_{K-1}, probes scored, probes skipped)."""
    starts = [0, *ends[:-1]]
    if settings.probe.value_source == "own_continuation":
        scores = score_probes_packed(model, trace.prompt_ids, trace.response_ids, [], max_positions=max_positions)
        return own_continuation_values(scores.trace_log_probs, starts, trace.outcome), 0, 0
    probes, num_values = _trace_probes(trace, ends, bank, tokenizer, settings)
    if not probes:
        return torch.full((num_values,), float("nan")), 0, 0
    scores = score_probes_packed(
        model, trace.prompt_ids, trace.response_ids, probes, return_trace_stats=False, max_positions=max_positions
    )
    # Self-normalisation divides by the mass of all the group's answers: it exists for exit probes only; a reference
    # bank holds correct continuations alone, so its values are the raw (lower-bound) sums.
    exit_probe = settings.probe.value_source == "exit_probe"
    normalization = settings.probe.normalization if exit_probe else "raw"
    values = values_from_probe_logp(scores.probe_logp, probes, num_values, normalization)
    return values, len(probes), scores.num_skipped


def records_from_arrays(
    prompts: Sequence[torch.Tensor],
    responses: Sequence[torch.Tensor],
    entropies: Sequence[torch.Tensor],
    outcomes: Sequence[float],
    groups: Sequence[Hashable],
    reward_models: Sequence[Any] | None = None,
    extra_infos: Sequence[Any] | None = None,
) -> list[TraceRecord]:
    """Build records from per-trace arrays; ``reward_models[i]['ground_truth']`` and
    ``extra_infos[i]['reference_steps']`` are read when present."""
    records = []
    for i in range(len(prompts)):
        reward_model = reward_models[i] if reward_models is not None else None
        extra = extra_infos[i] if extra_infos is not None else None
        truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        steps = extra.get("reference_steps") if isinstance(extra, dict) else None
        records.append(
            TraceRecord(
                prompt_ids=prompts[i],
                response_ids=responses[i],
                entropy=entropies[i],
                outcome=float(outcomes[i]),
                group=groups[i],
                ground_truth=None if truth is None else str(truth),
                reference_steps=None if steps is None else [str(s) for s in steps],
            )
        )
    return records
