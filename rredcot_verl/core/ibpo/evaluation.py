"""Judging repairs and turning them into what the advantage needs.

:func:`evaluate_repair` decides whether a repair counts (failures, the rewrite guard) and aligns it with its trace;
:func:`repair_signal` aggregates a trace's judged repairs into φ, :func:`localisation_mask` picks its edited-token
mask and :func:`stack_edited_masks` lays the masks out as a batch; :func:`repair_metrics` logs the repairs of a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from rredcot_verl.core.ibpo.alignment import AlignmentResult, as_id_list, align_tokens
from rredcot_verl.core.ibpo.revisions import revision_budget
from rredcot_verl.core.ibpo.settings import IBPOSettings

__all__ = [
    "RepairEvaluation",
    "evaluate_repair",
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
        alignment: the trace-vs-repair alignment of a correct repair; None for the others, which nothing reads (only
            correct repairs earn Δ, localise, or enter the ratios of :func:`repair_metrics`). Aligning two 25k-token
            sequences that part early takes ~0.1–0.2 s, and most repairs of a step fail.
    """

    correct: bool
    rewrite: bool
    failure: Optional[str]
    alignment: Optional[AlignmentResult]


def _is_rewrite(alignment: AlignmentResult, trace_length: int, cfg: IBPOSettings) -> bool:
    # A kept prefix of zero tokens is never "kept", so an empty trace or a repair that changes the first token can
    # only be local through a small edit ratio.
    kept = alignment.kept_prefix > 0 and alignment.kept_prefix >= cfg.min_kept_prefix * trace_length
    return alignment.edit_ratio > cfg.max_edit_ratio and not kept


def evaluate_repair(
    trace_ids: Sequence[int] | torch.Tensor,
    repair_ids: Sequence[int] | torch.Tensor,
    verified_correct: bool,
    truncated: bool,
    cfg: IBPOSettings,
    max_repair_tokens: Optional[int] = None,
) -> RepairEvaluation:
    """Judge one repair: decide whether it may count and, if it does, align it with the trace.

    An empty repair, one the engine truncated (``truncated``: stopped at its token budget without an end of
    sequence) or one longer than ``max_repair_tokens`` is a failure whatever the verifier said: an answer the
    repair did not finish, or finished past its budget, is not evidence that the trace was close to right.

    A resumed repair is judged whole, kept prefix included: it equals the trace on its first ``k`` tokens, so the
    alignment edits nothing before ``k`` (rapidfuzz drops the common prefix before aligning) and its kept prefix is
    at least ``k``.

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
    trace = as_id_list(trace_ids, "trace_ids")
    repair = as_id_list(repair_ids, "repair_ids")
    limit = revision_budget(len(trace), cfg) if max_repair_tokens is None else max_repair_tokens
    if not repair:
        failure = "empty"
    elif truncated:
        failure = "truncated"
    elif len(repair) > limit:
        failure = "too_long"
    else:
        failure = None
    correct = bool(verified_correct) and failure is None
    alignment = align_tokens(trace, repair) if correct else None
    return RepairEvaluation(
        correct=correct,
        rewrite=correct and _is_rewrite(alignment, len(trace), cfg),
        failure=failure,
        alignment=alignment,
    )


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
    rewrite / revisions; ``rewrite_frac``, ``edit_ratio_mean`` and ``kept_prefix_frac_mean`` are over the verified
    repairs (a local-repair check: many rewrites, or a kept prefix near 0, mean the model copies the reference or
    solves afresh instead of repairing).
    """
    n = len(evaluations)
    verified = [e for e in evaluations if e.correct]

    def kept_frac(e: RepairEvaluation) -> float:
        return e.alignment.kept_prefix / max(e.alignment.edited_mask.numel(), 1)

    return {
        "ibpo/revisions": float(n),
        "ibpo/repair_success_rate": len(verified) / n if n else 0.0,
        "ibpo/local_repair_rate": sum(not e.rewrite for e in verified) / n if n else 0.0,
        "ibpo/rewrite_frac": sum(e.rewrite for e in verified) / len(verified) if verified else 0.0,
        "ibpo/edit_ratio_mean": sum(e.alignment.edit_ratio for e in verified) / len(verified) if verified else 0.0,
        "ibpo/kept_prefix_frac_mean": sum(map(kept_frac, verified)) / len(verified) if verified else 0.0,
        "ibpo/failed_empty": float(sum(e.failure == "empty" for e in evaluations)),
        "ibpo/failed_truncated": float(sum(e.failure == "truncated" for e in evaluations)),
        "ibpo/failed_too_long": float(sum(e.failure == "too_long" for e in evaluations)),
    }
