"""Judging repairs and turning them into what the advantage needs.

:func:`evaluate_repair` decides whether a repair counts (failures, the rewrite guard) and aligns a local one with its
trace; :func:`repair_signal` aggregates a trace's judged repairs into φ, :func:`localisation_mask` picks its
edited-token mask and :func:`stack_edited_masks` lays the masks out as a batch; :func:`repair_metrics` logs the repairs
of a step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from rapidfuzz import process
from rapidfuzz.distance import Levenshtein

from rredcot_verl.core.ibpo.alignment import (
    AlignmentResult,
    align_tokens,
    as_id_list,
    kept_prefix_length,
)
from rredcot_verl.core.ibpo.revisions import revision_budget
from rredcot_verl.core.ibpo.settings import IBPOSettings

__all__ = [
    "RepairEvaluation",
    "evaluate_repair",
    "evaluate_repairs",
    "repair_failure",
    "repair_signal",
    "localisation_mask",
    "stack_edited_masks",
    "repair_metrics",
]


@dataclass(frozen=True)
class RepairEvaluation:
    """One revision of one incorrect trace, judged.

    Attributes:
        correct: the verifier accepted the repair and it is usable (not empty, not truncated, not too long).
        rewrite: a correct repair that is a rewrite rather than a local repair: edit ratio above ``max_edit_ratio``
            and less than ``min_kept_prefix`` of the trace kept verbatim as its prefix (see :class:`IBPOSettings`).
            False for a repair that is not correct.
        failure: why an unusable repair failed ("empty", "truncated", "too_long"), else None.
        alignment: the trace-vs-repair alignment of a correct local repair, the only kind whose mask and distance
            anything reads (it localises, :func:`localisation_mask`); None for the others. A rewrite's distance is
            computed only as far as the guard's bound (``max_edit_ratio · L``), ~7 ms for two 25k-token sequences
            that part early where their alignment takes ~70 ms, and most verified repairs of long traces are
            rewrites.
        kept_prefix: leading trace tokens a correct repair reproduces before its first edit (``alignment.kept_prefix``
            where there is an alignment); None for the others.
        trace_length: L, the trace's tokens.
    """

    correct: bool
    rewrite: bool
    failure: Optional[str]
    alignment: Optional[AlignmentResult]
    kept_prefix: Optional[int] = None
    trace_length: int = 0


def _rewrite_bound(trace_length: int, cfg: IBPOSettings) -> Optional[int]:
    """The largest distance whose edit ratio ``distance / max(L, 1)`` is not above ``max_edit_ratio`` (in the float
    arithmetic of :class:`AlignmentResult`'s ratio); None when no distance a repair can have is (``math.inf``)."""
    length = max(trace_length, 1)
    if not math.isfinite(cfg.max_edit_ratio):
        return None
    bound = math.floor(cfg.max_edit_ratio * length)
    while (bound + 1) / length <= cfg.max_edit_ratio:
        bound += 1
    while bound / length > cfg.max_edit_ratio:
        bound -= 1
    return bound


def _keeps_prefix(kept_prefix: int, trace_length: int, cfg: IBPOSettings) -> bool:
    # A kept prefix of zero tokens is never "kept", so an empty trace or a repair that changes the first token can
    # only be local through a small edit ratio.
    return kept_prefix > 0 and kept_prefix >= cfg.min_kept_prefix * trace_length


def evaluate_repair(
    trace_ids: Sequence[int] | torch.Tensor,
    repair_ids: Sequence[int] | torch.Tensor,
    verified_correct: bool,
    truncated: bool,
    cfg: IBPOSettings,
    max_repair_tokens: Optional[int] = None,
) -> RepairEvaluation:
    """Judge one repair: decide whether it may count and, if it is a local repair, align it with the trace.

    An empty repair, one the engine truncated (``truncated``: stopped at its token budget without an end of
    sequence) or one longer than ``max_repair_tokens`` is a failure whatever the verifier said: an answer the
    repair did not finish, or finished past its budget, is not evidence that the trace was close to right.

    A correct repair is a rewrite when it keeps less than ``min_kept_prefix`` of the trace (its kept prefix, the
    first edit of the alignment, follows from the common prefix alone: :func:`kept_prefix_length`) and its distance
    exceeds ``max_edit_ratio · L`` (computed no further than that: :func:`distance_exceeds`); only the others, local
    repairs, are aligned in full, since only their masks are read. A resumed repair is judged whole, kept prefix
    included: it equals the trace on its first ``k`` tokens, so the alignment edits nothing before ``k`` (rapidfuzz
    drops the common prefix before aligning) and its kept prefix is at least ``k``.

    Args:
        trace_ids: (L,) token ids of the incorrect trace.
        repair_ids: (M,) token ids of the repair (a resumed one: the kept prefix followed by the continuation).
        verified_correct: the task verifier's verdict on the repair (its outcome reaches the top of the scale).
        truncated: the generation stopped at its length limit.
        cfg: settings; uses the rewrite guard (``max_edit_ratio``, ``min_kept_prefix``), and the rewrite budget
            when ``max_repair_tokens`` is None.
        max_repair_tokens: most tokens the whole repair may have; None: :func:`revision_budget` of the trace (the
            rewrite operator's). A resumed repair may have ``max_response_length``, as any rollout.
    """
    return evaluate_repairs([trace_ids], [repair_ids], [verified_correct], [truncated], cfg, [max_repair_tokens],
                            workers=1)[0]


def evaluate_repairs(
    traces: Sequence[Sequence[int]],
    repairs: Sequence[Sequence[int]],
    verified_correct: Sequence[bool],
    truncated: Sequence[bool],
    cfg: IBPOSettings,
    max_repair_tokens: Sequence[Optional[int]],
    workers: int = -1,
) -> list[RepairEvaluation]:
    """:func:`evaluate_repair` of each (trace, repair) (the one implementation of both: a repair's judgement does not
    depend on the others'), the rewrite guard's distances computed together on ``workers`` threads (rapidfuzz's
    ``cpdist``; -1: every core), as a step's verified repairs are.

    The distances are cut off at the largest bound among the repairs the guard reads: a distance above it is above
    every bound, one at or below it is exact, so each repair's comparison with its own bound is
    :func:`distance_exceeds`'s (``tests/test_driver_equivalence_on_cpu.py`` checks a batch against its repairs
    judged alone and against the full alignment).
    """
    if not len(traces) == len(repairs) == len(verified_correct) == len(truncated) == len(max_repair_tokens):
        raise ValueError("traces, repairs, verified_correct, truncated and max_repair_tokens must have one entry per "
                         "repair")
    traces = [as_id_list(t, "trace_ids") for t in traces]
    repairs = [as_id_list(r, "repair_ids") for r in repairs]
    failures = [repair_failure(len(t), len(r), cut, cfg, limit)
                for t, r, cut, limit in zip(traces, repairs, truncated, max_repair_tokens)]
    usable = [bool(ok) and failure is None for ok, failure in zip(verified_correct, failures)]
    kept = [kept_prefix_length(t, r) if ok else None for t, r, ok in zip(traces, repairs, usable)]
    bounds = [_rewrite_bound(len(t), cfg) for t in traces]
    # The guard reads a distance where the prefix kept is short and a distance can exceed the bound at all.
    guarded = [j for j, (t, r, ok, k, bound) in enumerate(zip(traces, repairs, usable, kept, bounds))
               if ok and not _keeps_prefix(k, len(t), cfg) and bound is not None and bound < max(len(t), len(r))]
    rewrite = [False] * len(traces)
    if guarded:
        cutoff = max(bounds[j] for j in guarded)
        distances = process.cpdist([traces[j] for j in guarded], [repairs[j] for j in guarded],
                                   scorer=Levenshtein.distance, score_cutoff=cutoff, workers=workers)
        for j, distance in zip(guarded, distances.tolist()):
            rewrite[j] = distance > bounds[j]
    evaluations = []
    for j, (trace, repair, ok, failure) in enumerate(zip(traces, repairs, usable, failures)):
        if not ok:
            evaluations.append(RepairEvaluation(correct=False, rewrite=False, failure=failure, alignment=None,
                                                trace_length=len(trace)))
            continue
        evaluations.append(RepairEvaluation(correct=True, rewrite=rewrite[j], failure=None,
                                            alignment=None if rewrite[j] else align_tokens(trace, repair),
                                            kept_prefix=kept[j], trace_length=len(trace)))
    return evaluations


def repair_failure(trace_length: int, repair_length: int, truncated: bool, cfg: IBPOSettings,
                   max_repair_tokens: Optional[int] = None) -> Optional[str]:
    """Why a repair is unusable whatever the verifier says (:func:`evaluate_repair`'s failures), or None: a repair
    that fails need not be decoded nor judged."""
    limit = revision_budget(trace_length, cfg) if max_repair_tokens is None else max_repair_tokens
    if not repair_length:
        return "empty"
    if truncated:
        return "truncated"
    if repair_length > limit:
        return "too_long"
    return None


def repair_signal(trace_correct: bool, evaluations: Sequence[RepairEvaluation], cfg: IBPOSettings) -> float:
    """φ_i, the counterfactual comparison signal of one trace.

    ``Δ_k = ρ · 1[repair k correct]`` per revision, where a rewrite counts only if ``cfg.rewrite_counts_as_repair``;
    φ is the mean (or max) of Δ over the revisions actually generated, so a trace that most references help repair
    is closer to right than one only a lucky reference repairs. 0 for a correct trace and for a trace without
    revisions (group of one, all prompts over the engine budget, dropped by the cap).

    Args:
        trace_correct: the trace's own verdict.
        evaluations: (n,) the trace's judged repairs (:func:`evaluate_repair`).
        cfg: settings; uses ``repair_bonus``, ``rewrite_counts_as_repair``, ``aggregate``.
    """
    if trace_correct or not evaluations:
        return 0.0
    deltas = [
        cfg.repair_bonus if e.correct and (cfg.rewrite_counts_as_repair or not e.rewrite) else 0.0 for e in evaluations
    ]
    return max(deltas) if cfg.aggregate == "max" else sum(deltas) / len(deltas)


def localisation_mask(evaluations: Sequence[RepairEvaluation], trace_length: int) -> torch.Tensor:
    """(L,) edited-token mask of the trace's most local successful repair; all False when there is none.

    Only correct, non-rewrite repairs localise (whatever ``rewrite_counts_as_repair`` says: a rewrite marks nearly
    every token). Among them the one with the fewest edits wins, ties to the first.
    """
    local = [e for e in evaluations if e.correct and not e.rewrite]
    for e in local:
        if e.alignment.edited_mask.shape != (trace_length,):
            raise ValueError(
                f"repair was aligned against a trace of {e.alignment.edited_mask.numel()} tokens, expected {trace_length}"
            )
    if not local:
        return torch.zeros(trace_length, dtype=torch.bool)
    return min(local, key=lambda e: e.alignment.distance).alignment.edited_mask.clone()


def stack_edited_masks(masks: Sequence[torch.Tensor], response_length: int) -> torch.Tensor:
    """Right-pad per-trace (L_i,) bool masks into the batch layout (bs, T) of verl's right-padded responses."""
    stacked = torch.zeros(len(masks), response_length, dtype=torch.bool)
    for row, mask in enumerate(masks):
        if mask.dim() != 1 or mask.numel() > response_length:
            raise ValueError(
                f"edited mask {row} has shape {tuple(mask.shape)}; expected 1-D with at most {response_length} tokens"
            )
        stacked[row, : mask.numel()] = mask.to(torch.bool)
    return stacked


def repair_metrics(evaluations: Sequence[RepairEvaluation]) -> dict[str, float]:
    """Step-level repair statistics for logging; finite floats, 0 when undefined.

    ``repair_success_rate``: verified and usable repairs / revisions; ``local_repair_rate``: those that are also no
    rewrite / revisions; ``rewrite_frac`` and ``kept_prefix_frac_mean`` are over the verified repairs (a local-repair
    check: many rewrites, or a kept prefix near 0, mean the model copies the reference or solves afresh instead of
    repairing); ``local_edit_ratio_mean`` is over the local ones (a rewrite's distance is known only to exceed
    ``max_edit_ratio · L``).
    """
    n = len(evaluations)
    verified = [e for e in evaluations if e.correct]
    local = [e for e in verified if not e.rewrite]
    return {
        "ibpo/revisions": float(n),
        "ibpo/repair_success_rate": len(verified) / n if n else 0.0,
        "ibpo/local_repair_rate": len(local) / n if n else 0.0,
        "ibpo/rewrite_frac": sum(e.rewrite for e in verified) / len(verified) if verified else 0.0,
        "ibpo/local_edit_ratio_mean": sum(e.alignment.edit_ratio for e in local) / len(local) if local else 0.0,
        "ibpo/kept_prefix_frac_mean": (sum(e.kept_prefix / max(e.trace_length, 1) for e in verified) / len(verified)
                                       if verified else 0.0),
        "ibpo/failed_empty": float(sum(e.failure == "empty" for e in evaluations)),
        "ibpo/failed_truncated": float(sum(e.failure == "truncated" for e in evaluations)),
        "ibpo/failed_too_long": float(sum(e.failure == "too_long" for e in evaluations)),
    }
