"""IBPO: counterfactual repairs turned into a shaped reward and a token mask.

Method (Ding et al., arXiv 2605.16302). For every incorrect trace ``y_i`` of a group, the rollout policy is asked to
repair it given a sibling trace ``y_ref`` of the same prompt. A repair that the verifier accepts earns ``Δ = ρ``;
``φ_i`` aggregates ``Δ`` over the trace's references (0 for correct traces). The outcome is shaped *before* group
normalisation, ``R'_i = R_i + λ φ_i (high − R_i)``, so repairable failures are punished less than hopeless ones and
all-wrong groups still give a gradient. In the mask variant, a token-level Levenshtein alignment of ``y_i`` against its
most local successful repair says which tokens had to change, and the advantage of an incorrect trace lands on those
tokens only (sign rule in :func:`shaped_advantages`).

One training step, as the rollout side drives it (this module does no generation and imports neither verl nor ray)::

    correct = correct_outcomes(scores, reward_range)
    plan = plan_revisions(correct, index, cfg, rng, responses=response_ids, usable=prompt_fits_engine)
    prompts = [build_revision_prompt(q[i], text[i], text[j]) for i, j in plan.pairs]   # texts without special tokens
    ... generate one repair per prompt (max_tokens = revision_budget(len(response_ids[i]), cfg)), verify it ...
    evals_i = [evaluate_repair(response_ids[i], repair_ids, verified, truncated, cfg) for each repair of i]
    phi[i] = repair_signal(correct[i], evals_i, cfg)
    masks[i] = localisation_mask(evals_i, len(response_ids[i]))
    result = shaped_advantages(scores, response_mask, index, phi, stack_edited_masks(masks, T), cfg, reward_range)

Conventions: outcomes lie on a declared scale ``reward_range = (low, high)`` (``algorithm.rredcot.reward_range``); a
trace is *correct* when its outcome reaches ``high`` (:func:`correct_outcomes`), so partial credit is not correct.
Token ids of a trace are its valid response tokens (``response_mask == 1``), right-padded to ``T`` in batches.

Length. Reasoning traces run to 2k–25k tokens, and nothing here may assume short ones: a repair's token budget grows
with the trace it repairs (:func:`revision_budget`), a revision prompt is bounded by the engine's context minus that
budget (:func:`fits_engine`), and the rewrite guard looks at the verbatim prefix a repair keeps as well as at its edit
ratio (:func:`evaluate_repair`), because a faithful repair of a long trace rewrites everything after the first wrong
step.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
from rapidfuzz.distance import Levenshtein

from rredcot_verl.core.outcomes import (
    check_outcome_batch,
    check_reward_range,
    correct_outcomes,
    group_outcome_advantage,
)

__all__ = [
    "IBPOSettings",
    "correct_outcomes",
    "select_references",
    "RevisionPlan",
    "plan_revisions",
    "revision_budget",
    "fits_engine",
    "DEFAULT_REVISION_TEMPLATE",
    "EMBEDDED_TASK_TEMPLATE",
    "build_revision_prompt",
    "AlignmentResult",
    "align_tokens",
    "RepairEvaluation",
    "evaluate_repair",
    "repair_signal",
    "localisation_mask",
    "stack_edited_masks",
    "repair_metrics",
    "IBPOResult",
    "shaped_advantages",
]

AGGREGATES = ("mean", "max")


@dataclass(frozen=True)
class IBPOSettings:
    """IBPO settings.

    Attributes:
        shaping_weight: λ in ``R' = R + λφ(high − R)`` (0.6, transcribed from the paper). 0 turns shaping off.
        repair_bonus: ρ, the comparison signal Δ of one successful repair (0.5, transcribed). ``λ·ρ < 1`` is
            required so that a repaired incorrect trace always stays below a correct one.
        num_references: K−1, sibling references (hence revisions) per incorrect trace (3).
        max_edit_ratio: δ, bound on ``edit distance / |trace|``. A verified repair is a *rewrite*, not a local
            repair, when its edit ratio exceeds δ **and** it did not keep the trace's prefix (``min_kept_prefix``).
            0.5; ``math.inf`` disables the guard. The guard is this project's addition: a repair that copies the
            reference says nothing about how close the trace was.
        min_kept_prefix: π. A repair that reproduces at least ``π·|trace|`` leading tokens of the trace verbatim
            (before its first edit) kept the trace's prefix and is a local repair whatever its edit ratio (0.25).
            Why both: at length a faithful repair keeps the trace up to its first wrong step and rewrites the rest,
            so its edit ratio says where the error was (an error at 30% of a 10k-token trace gives a ratio near
            0.7), not whether it is a repair; what a copy of the reference or a fresh solve cannot do is reproduce
            a long verbatim prefix (two samples of one prompt share only their opening, a few dozen tokens), so a
            kept prefix of a quarter of the trace tells them apart from 2k tokens on. A value above 1 leaves only
            the edit-ratio test.
        rewrite_counts_as_repair: False (default): a verified rewrite earns no Δ and gives no localisation,
            because copying the reference says nothing about how close the trace was. True: a verified rewrite
            earns Δ for φ; it still never provides a token mask (a rewrite's mask covers nearly everything).
        use_mask: True: mask variant (credit on edited tokens). False: shaping only, advantages broadcast.
        aggregate: how Δ is aggregated over a trace's references: "mean" (φ ∈ [0, ρ] graded) or "max".
        max_revisions: cap on revision generations per training step, or None (default) for none: every incorrect
            trace gets ``num_references`` revisions. A cap is shared round-robin (:func:`plan_revisions`): every
            incorrect trace gets one revision before any gets a second, and what the cap dropped is counted.
        revision_length_factor, revision_slack_tokens: a repair of an ``L``-token trace may have
            ``ceil(factor·L) + slack`` tokens (1.2 and 128: a repair restates the trace with a fix, so it is about as
            long; 20% room for an added step, and a slack for short or cut-off traces).
            Longer or truncated repairs are failures.
        epsilon: added to the group std, as in verl's GRPO (1e-6).
        norm_adv_by_std: divide by the group std (GRPO) or only centre (Dr.GRPO), as verl's
            ``norm_adv_by_std_in_grpo``.
        revision_template: the compare-and-correct prompt with ``{question}``, ``{trace}`` and ``{reference}``
            fields; None uses ``DEFAULT_REVISION_TEMPLATE`` (chat models); the embedded task's recipe uses
            ``EMBEDDED_TASK_TEMPLATE``.
        revision_temperature: sampling temperature of the repairs (1.0).
    """

    shaping_weight: float = 0.6
    repair_bonus: float = 0.5
    num_references: int = 3
    max_edit_ratio: float = 0.5
    min_kept_prefix: float = 0.25
    rewrite_counts_as_repair: bool = False
    use_mask: bool = True
    aggregate: str = "mean"
    max_revisions: Optional[int] = None
    revision_length_factor: float = 1.2
    revision_slack_tokens: int = 128
    epsilon: float = 1e-6
    norm_adv_by_std: bool = True
    revision_template: Optional[str] = None
    revision_temperature: float = 1.0

    def __post_init__(self) -> None:
        for name in ("shaping_weight", "repair_bonus"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"IBPOSettings.{name} must be a finite number >= 0, got {value!r}")
        if self.shaping_weight * self.repair_bonus >= 1:
            raise ValueError(
                f"IBPOSettings needs shaping_weight * repair_bonus < 1 (got {self.shaping_weight} * "
                f"{self.repair_bonus}); otherwise a repaired incorrect trace can match or outrank a correct one"
            )
        for name in ("num_references", "revision_slack_tokens"):
            _check_positive_int(name, getattr(self, name))
        if self.max_revisions is not None:
            _check_positive_int("max_revisions", self.max_revisions)
        if math.isnan(self.max_edit_ratio) or self.max_edit_ratio <= 0:
            raise ValueError(
                f"IBPOSettings.max_edit_ratio must be > 0 (math.inf disables the rewrite guard), got {self.max_edit_ratio!r}"
            )
        if math.isnan(self.min_kept_prefix) or self.min_kept_prefix < 0:
            raise ValueError(f"IBPOSettings.min_kept_prefix must be >= 0, got {self.min_kept_prefix!r}")
        if not (math.isfinite(self.revision_length_factor) and self.revision_length_factor >= 1):
            raise ValueError(
                "IBPOSettings.revision_length_factor must be a finite number >= 1 (a repair restates the whole trace), "
                f"got {self.revision_length_factor!r}"
            )
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"IBPOSettings.aggregate must be one of {AGGREGATES}, got {self.aggregate!r}")
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError(f"IBPOSettings.epsilon must be a finite number > 0, got {self.epsilon!r}")


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"IBPOSettings.{name} must be an integer >= 1, got {value!r}")


# ----------------------------------------------------------------------------------------------------------------
# Correctness on a declared reward scale
# ----------------------------------------------------------------------------------------------------------------

def _ordered_siblings(
    flags: list[bool], i: int, rng: np.random.Generator, responses: Optional[Sequence[Sequence[int]]]
) -> list[int]:
    siblings = [j for j in range(len(flags)) if j != i]
    if responses is not None:
        target = list(responses[i])
        siblings = [j for j in siblings if list(responses[j]) != target]
    correct = [j for j in siblings if flags[j]]
    incorrect = [j for j in siblings if not flags[j]]
    return [correct[k] for k in rng.permutation(len(correct))] + [incorrect[k] for k in rng.permutation(len(incorrect))]


def select_references(
    outcomes: Sequence[bool] | torch.Tensor,
    i: int,
    num_references: int,
    rng: np.random.Generator,
    responses: Optional[Sequence[Sequence[int]]] = None,
) -> list[int]:
    """Pick the siblings that serve as references for trace ``i`` of one group.

    Args:
        outcomes: (G,) correctness of each trace of the group (bool or 0/1).
        i: position of the target trace inside the group.
        num_references: K−1, the most references to return.
        rng: source of the random order among equally good siblings.
        responses: optional (G,) token-id sequences; a sibling identical to trace ``i`` is skipped, because
            comparing a trace with itself carries no counterfactual information.

    Returns:
        Up to ``num_references`` group positions, never ``i``: correct siblings first (random order), then incorrect
        ones (random order). ``[]`` for a group of one.
    """
    flags = [bool(x) for x in (outcomes.tolist() if isinstance(outcomes, torch.Tensor) else outcomes)]
    if not 0 <= i < len(flags):
        raise ValueError(f"trace position {i} is outside the group of size {len(flags)}")
    if num_references < 1:
        raise ValueError(f"num_references must be >= 1, got {num_references}")
    if responses is not None and len(responses) != len(flags):
        raise ValueError(f"responses has {len(responses)} entries for a group of {len(flags)} outcomes")
    return _ordered_siblings(flags, i, rng, responses)[:num_references]


@dataclass(frozen=True)
class RevisionPlan:
    """Which revisions to generate this step, and what was left out (every incorrect trace is accounted for).

    Attributes:
        pairs: (trace, reference) batch positions, one revision each, in generation order.
        incorrect_traces: incorrect traces in the batch.
        traces_without_reference: incorrect traces with no distinct sibling (group of one, or only identical
            siblings); they keep φ = 0, i.e. plain GRPO treatment.
        rejected_pairs: (trace, sibling) pairs that ``usable`` turned down (their revision does not fit the engine).
        traces_without_usable_reference: incorrect traces that had siblings, all turned down by ``usable``.
        skipped_by_cap: usable revisions dropped because ``max_revisions`` was reached.
        traces_skipped_by_cap: incorrect traces with usable references that got no revision because of the cap.
    """

    pairs: list[tuple[int, int]]
    incorrect_traces: int
    traces_without_reference: int
    rejected_pairs: int
    traces_without_usable_reference: int
    skipped_by_cap: int
    traces_skipped_by_cap: int


def plan_revisions(
    correct: Sequence[bool] | torch.Tensor,
    index: np.ndarray,
    cfg: IBPOSettings,
    rng: np.random.Generator,
    responses: Optional[Sequence[Sequence[int]]] = None,
    usable: Optional[Callable[[int, int], bool]] = None,
) -> RevisionPlan:
    """Choose the (trace, reference) pairs of a batch.

    Every incorrect trace gets up to ``cfg.num_references`` references in :func:`select_references` order (correct
    siblings first). A sibling that ``usable(trace, sibling)`` turns down is replaced by the next one, so one long
    reference does not cost a trace its revision. Under ``cfg.max_revisions`` revisions are taken by reference rank
    (every trace's first reference, then every second one, ...), in random trace order within a rank, so every
    incorrect trace gets one repair attempt before any gets a second and no group is favoured by its batch position.

    Args:
        correct: (bs,) correctness flags of the batch (:func:`correct_outcomes`).
        index: (bs,) group ids (verl's ``uid``).
        cfg: settings; uses ``num_references`` and ``max_revisions``.
        rng: source of the random reference and trace order.
        responses: optional (bs,) token-id sequences, to skip references identical to the trace.
        usable: optional ``usable(trace, reference) -> bool`` (batch positions), called only on candidates in
            preference order until a trace has its references; e.g. whether the revision prompt fits the engine.
    """
    flags = [bool(x) for x in (correct.tolist() if isinstance(correct, torch.Tensor) else correct)]
    if len(index) != len(flags):
        raise ValueError(f"index has {len(index)} entries for {len(flags)} traces")
    if responses is not None and len(responses) != len(flags):
        raise ValueError(f"responses has {len(responses)} entries for {len(flags)} traces")
    groups: dict = defaultdict(list)
    for position, group_id in enumerate(index):
        groups[group_id].append(position)

    per_rank: list[list[tuple[int, int]]] = [[] for _ in range(cfg.num_references)]
    without_reference = without_usable = rejected = 0
    for members in groups.values():
        group_flags = [flags[p] for p in members]
        group_responses = None if responses is None else [responses[p] for p in members]
        for local, trace in enumerate(members):
            if group_flags[local]:
                continue
            candidates = [members[j] for j in _ordered_siblings(group_flags, local, rng, group_responses)]
            if not candidates:
                without_reference += 1
                continue
            refs = []
            for reference in candidates:
                if usable is None or usable(trace, reference):
                    refs.append(reference)
                    if len(refs) == cfg.num_references:
                        break
                else:
                    rejected += 1
            if not refs:
                without_usable += 1
            for rank, reference in enumerate(refs):
                per_rank[rank].append((trace, reference))
    ordered = [rank_pairs[k] for rank_pairs in per_rank for k in rng.permutation(len(rank_pairs))]
    cap = len(ordered) if cfg.max_revisions is None else cfg.max_revisions
    kept = ordered[:cap]
    revised = {trace for trace, _ in kept}
    return RevisionPlan(
        pairs=kept,
        incorrect_traces=sum(not f for f in flags),
        traces_without_reference=without_reference,
        rejected_pairs=rejected,
        traces_without_usable_reference=without_usable,
        skipped_by_cap=len(ordered) - len(kept),
        traces_skipped_by_cap=len({trace for trace, _ in ordered} - revised),
    )


def revision_budget(trace_length: int, cfg: IBPOSettings) -> int:
    """Most tokens a repair of a ``trace_length``-token trace may have: ``ceil(factor · L) + slack``.

    The repair restates the whole trace with its fix, so its budget must grow with the trace: a fixed cap turns every
    repair of a long trace into a truncated (failed) one or, if it stops early, a rewrite.
    """
    if trace_length < 0:
        raise ValueError(f"trace_length must be >= 0, got {trace_length}")
    return math.ceil(cfg.revision_length_factor * trace_length) + cfg.revision_slack_tokens


def fits_engine(prompt_tokens: int, trace_length: int, max_model_length: int, cfg: IBPOSettings) -> bool:
    """Whether a revision prompt of ``prompt_tokens`` tokens leaves the engine room for the repair's budget.

    The revision prompt budget is ``max_model_length − revision_budget(trace_length)`` (the engine's context, not
    ``data.max_prompt_length``: a revision prompt holds the question, the trace and a reference, so it is far longer
    than a dataset prompt). Over-long prompts are skipped, not truncated: a truncated trace cannot be repaired and
    aligned. The caller counts the skips; a trace whose revisions are all skipped keeps φ = 0.
    """
    if max_model_length < 1:
        raise ValueError(f"max_model_length must be >= 1, got {max_model_length}")
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
    return prompt_tokens <= max_model_length - revision_budget(trace_length, cfg)


# ----------------------------------------------------------------------------------------------------------------
# Revision prompts
# ----------------------------------------------------------------------------------------------------------------

DEFAULT_REVISION_TEMPLATE = (
    "Here is a problem, your solution A and another solution B to the same problem. Solution A may contain a "
    "mistake; solution B may be right or wrong, use it only as a hint.\n"
    "Find where A goes wrong and output A again with only the minimal local fixes needed: keep every correct "
    "step of A verbatim, change only the wrong step and what follows from it, and end with the final answer in "
    "the same format as A. Output only the corrected solution A, no commentary.\n\n"
    "### Problem\n{question}\n\n"
    "### Solution A\n{trace}\n\n"
    "### Solution B\n{reference}\n\n"
    "### Corrected solution A\n"
)
"""User-message text for chat models (wrap it with the tokenizer's chat template). It asks for the *whole* corrected
solution so that it can be aligned token by token with A: a fix alone could not say which of A's tokens it replaces."""

EMBEDDED_TASK_TEMPLATE = "{question}"
"""Revision prompt for the embedded chained-arithmetic task: the bare problem, so the model re-solves it.

The tiny task model was trained only on ``Compute a+b-c\\n`` → ``<think>`` steps ``</think>\\boxed{..}``; it cannot read
a compare-and-correct instruction. A fresh solve still acts as a counterfactual repair here: the steps are
deterministic, so a correct re-solve repeats every correct line of the failed trace verbatim, and the Levenshtein
alignment marks exactly the first wrong result and what follows from it. What is lost is the sibling's guidance
(the reference only sets how many re-solves a trace gets), so this is the "K references, no comparison" reading."""


def build_revision_prompt(question: str, trace: str, reference: str, template: Optional[str] = None) -> str:
    """Fill a revision template with the problem, the trace to repair (A) and the sibling reference (B).

    ``template`` uses the placeholders ``{question}``, ``{trace}`` and ``{reference}`` (``str.format``; literal braces in
    the template must be doubled, braces inside the filled-in texts are safe). It must contain ``{question}``;
    the other two may be left out (see :data:`EMBEDDED_TASK_TEMPLATE`). Default: :data:`DEFAULT_REVISION_TEMPLATE`.
    """
    template = DEFAULT_REVISION_TEMPLATE if template is None else template
    if "{question}" not in template:
        raise ValueError("revision template must contain the {question} placeholder")
    try:
        return template.format(question=question, trace=trace, reference=reference)
    except (KeyError, IndexError) as err:
        raise ValueError(
            f"revision template has an unknown placeholder {err}; allowed: {{question}}, {{trace}}, {{reference}} "
            "(write literal braces as {{ and }})"
        ) from err


# ----------------------------------------------------------------------------------------------------------------
# Alignment and repair evaluation
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AlignmentResult:
    """Token alignment of a trace against its repair.

    Attributes:
        edited_mask: (L,) bool over the trace's tokens, True where the repair changed the trace.
        edit_ratio: ``distance / max(L, 1)``; can exceed 1 when the repair is longer than the trace.
        distance: token Levenshtein distance (insertions, deletions, substitutions, each cost 1).
        kept_prefix: leading trace tokens the repair reproduces verbatim before its first edit (the position of the
            first edited token; ``L`` when nothing was edited).
    """

    edited_mask: torch.Tensor
    edit_ratio: float
    distance: int
    kept_prefix: int


def _as_id_list(ids: Sequence[int] | torch.Tensor, name: str) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise ValueError(f"{name} must be a 1-D sequence of token ids, got shape {tuple(ids.shape)}")
        return ids.tolist()
    return list(ids)


def align_tokens(trace_ids: Sequence[int] | torch.Tensor, repair_ids: Sequence[int] | torch.Tensor) -> AlignmentResult:
    """Levenshtein-align a trace with its repair on token ids (rapidfuzz, bit-parallel, no Python DP).

    Edited trace tokens are those the alignment replaces or deletes. A pure insertion between ``y_t`` and ``y_{t+1}``
    marks ``y_{t+1}`` (``y_t`` when it is appended at the end): the repair had to add something before ``y_{t+1}``, so
    the decision to emit ``y_{t+1}`` there was the one that changed and should carry the blame. Identical sequences
    give no edits and ratio 0. An empty trace gives an empty mask and ratio ``len(repair)``: with nothing to keep,
    any non-empty repair is a complete rewrite. rapidfuzz works in O(L·M/64) time, a few milliseconds for two
    25k-token sequences.

    Args:
        trace_ids: (L,) token ids of the trace.
        repair_ids: (M,) token ids of the repair.
    """
    trace = _as_id_list(trace_ids, "trace_ids")
    repair = _as_id_list(repair_ids, "repair_ids")
    edited = torch.zeros(len(trace), dtype=torch.bool)
    editops = Levenshtein.editops(trace, repair)
    for op in editops.as_opcodes():
        if op.tag in ("replace", "delete"):
            edited[op.src_start : op.src_end] = True
        elif op.tag == "insert" and trace:
            edited[min(op.src_start, len(trace) - 1)] = True
    distance = len(editops)
    first_edit = torch.nonzero(edited).flatten()
    return AlignmentResult(
        edited_mask=edited,
        edit_ratio=distance / max(len(trace), 1),
        distance=distance,
        kept_prefix=int(first_edit[0]) if first_edit.numel() else len(trace),
    )


@dataclass(frozen=True)
class RepairEvaluation:
    """One revision of one incorrect trace, judged.

    Attributes:
        correct: the verifier accepted the repair and it is usable (not empty, not truncated, not too long).
        rewrite: a rewrite rather than a local repair: edit ratio above ``max_edit_ratio`` and less than
            ``min_kept_prefix`` of the trace kept verbatim as its prefix (see :class:`IBPOSettings`).
        failure: why an unusable repair failed ("empty", "truncated", "too_long"), else None.
        alignment: the trace-vs-repair alignment.
    """

    correct: bool
    rewrite: bool
    failure: Optional[str]
    alignment: AlignmentResult


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
) -> RepairEvaluation:
    """Judge one repair: align it with the trace and decide whether it may count.

    An empty repair, one the engine truncated (``truncated``: stopped at its token budget without an end of
    sequence) or one longer than :func:`revision_budget` is a failure whatever the verifier said: an answer the
    repair did not finish, or finished past its budget, is not evidence that the trace was close to right.

    Args:
        trace_ids: (L,) token ids of the incorrect trace.
        repair_ids: (M,) token ids of the generated repair.
        verified_correct: the task verifier's verdict on the repair (its outcome reaches the top of the scale).
        truncated: the generation stopped at its length limit.
        cfg: settings; uses the revision budget and the rewrite guard (``max_edit_ratio``, ``min_kept_prefix``).
    """
    trace = _as_id_list(trace_ids, "trace_ids")
    repair = _as_id_list(repair_ids, "repair_ids")
    alignment = align_tokens(trace, repair)
    if not repair:
        failure = "empty"
    elif truncated:
        failure = "truncated"
    elif len(repair) > revision_budget(len(trace), cfg):
        failure = "too_long"
    else:
        failure = None
    return RepairEvaluation(
        correct=bool(verified_correct) and failure is None,
        rewrite=_is_rewrite(alignment, len(trace), cfg),
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


# ----------------------------------------------------------------------------------------------------------------
# Shaped advantages
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IBPOResult:
    """Output of :func:`shaped_advantages`.

    Attributes:
        advantages: (bs, T) per-token advantages (zero outside ``response_mask``).
        shaped_rewards: (bs,) ``R' = R + λφ`` before normalisation.
        metrics: finite float statistics, keys prefixed ``ibpo/``.
    """

    advantages: torch.Tensor
    shaped_rewards: torch.Tensor
    metrics: dict[str, float]


def shaped_advantages(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    phi: torch.Tensor,
    edited_masks: Optional[torch.Tensor],
    cfg: IBPOSettings,
    reward_range: tuple[float, float] = (0.0, 1.0),
) -> IBPOResult:
    """IBPO advantages: shape the outcome, normalise per group as GRPO does, then apply the token mask.

    ``R' = R + λφ·(high − R)`` on the scale ``reward_range = (low, high)``: the bonus closes a share ``λφ`` of the
    gap to a correct outcome. On a 0/1 reward this is the paper's ``R + λφ``; on any scale an incorrect trace
    (``R < high``) stays strictly below ``high`` because ``λφ ≤ λρ < 1``, and a higher ``R`` stays ahead for the same
    φ, so a repaired failure never outranks a correct trace nor a better partial one with the same φ (a bonus
    ``λφ·(high − low)`` would lift partial credit above ``high`` once ``R > high − λρ·(high − low)``).
    ``Â' = (R' − mean_group R') / (std_group R' + ε)`` (unbiased std; a group of one has mean 0
    and std 1, exactly verl's GRPO). With ``cfg.use_mask`` the mask variant follows, row by row:

    - correct traces, and incorrect traces without a localised successful repair (mask row all False):
      ``Â'`` on every response token (the GRPO broadcast);
    - incorrect traces with a localised repair: if ``Â' < 0``, ``Â'`` only on the edited tokens; if ``Â' > 0``
      (a repaired failure in a group of mostly hopeless ones), ``Â'`` only on the unchanged tokens, so the tokens
      the repair had to change are never reinforced. Zero elsewhere.

    The sign rule keeps the point of the mask: the tokens a repair had to change are never reinforced, and the
    tokens it kept are never blamed. The normalisation is ``outcomes.group_outcome_advantage`` (verl's
    arithmetic), so ``λ = 0`` with no mask (or ``use_mask=False``) returns exactly ``compute_grpo_outcome_advantage``'s
    output, and any λ without a mask equals verl's GRPO run on the shaped rewards.

    Args:
        scores: (bs,) outcome rewards R (``token_level_rewards.sum(-1)`` in verl). Must be finite.
        response_mask: (bs, T) 1 on response tokens.
        index: (bs,) group ids (verl's ``uid``).
        phi: (bs,) repair signals φ ≥ 0, from :func:`repair_signal`; must be 0 on correct traces.
        edited_masks: (bs, T) bool edited-token masks (:func:`stack_edited_masks`), or None for no localisation.
            Ignored when ``cfg.use_mask`` is False.
        cfg: settings; uses ``shaping_weight``, ``epsilon``, ``norm_adv_by_std``, ``use_mask``.
        reward_range: (low, high), the outcome scale (``algorithm.rredcot.reward_range``); high = correct.
    """
    bs = check_outcome_batch(scores, response_mask, index)
    if phi.shape != (bs,):
        raise ValueError(f"phi must have shape ({bs},), got {tuple(phi.shape)}")
    if not torch.isfinite(scores).all():
        bad = torch.nonzero(~torch.isfinite(scores)).flatten().tolist()
        raise ValueError(f"scores must be finite; non-finite outcome rewards at batch rows {bad}")
    bad_phi = ~torch.isfinite(phi) | (phi < 0)
    if bad_phi.any():
        rows = torch.nonzero(bad_phi).flatten().tolist()
        raise ValueError(f"phi must be finite and >= 0; bad repair signals at batch rows {rows}")
    low, high = check_reward_range(reward_range)
    correct = correct_outcomes(scores, (low, high))
    if (correct & (phi > 0)).any():
        # Repairs are only generated for incorrect traces: a signal on a correct row means misaligned rows or a
        # reward_range that disagrees with the one the repairs were planned with.
        rows = torch.nonzero(correct & (phi > 0)).flatten().tolist()
        raise ValueError(
            f"phi > 0 on correct traces (outcome reaches {high}, the top of reward_range) at batch rows {rows}"
        )
    use_mask = cfg.use_mask and edited_masks is not None
    if use_mask:
        if edited_masks.shape != response_mask.shape or edited_masks.dtype != torch.bool:
            raise ValueError(
                f"edited_masks must be a bool tensor of shape {tuple(response_mask.shape)}, "
                f"got {edited_masks.dtype} {tuple(edited_masks.shape)}"
            )
        if (edited_masks & ~response_mask.bool()).any():
            raise ValueError(
                "edited_masks marks tokens outside response_mask; align repairs against the valid response tokens"
            )

    with torch.no_grad():
        shaped = scores + cfg.shaping_weight * phi.to(scores.dtype) * (high - scores)
        normalised, _ = group_outcome_advantage(shaped, index, cfg.epsilon, cfg.norm_adv_by_std)
        advantages = normalised.unsqueeze(-1) * response_mask

        localised = (
            edited_masks.any(dim=-1) & ~correct if use_mask else torch.zeros(bs, dtype=torch.bool)
        )
        negative = localised & (normalised < 0)
        positive = localised & (normalised > 0)
        if localised.any():
            keep = torch.ones_like(response_mask, dtype=torch.bool)
            keep[negative] = edited_masks[negative]
            keep[positive] = ~edited_masks[positive]
            advantages = advantages.masked_fill(~keep, 0.0)

    return IBPOResult(
        advantages=advantages,
        shaped_rewards=shaped,
        metrics=_advantage_metrics(scores, response_mask, index, phi, advantages, localised, positive, correct),
    )


def _advantage_metrics(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    phi: torch.Tensor,
    advantages: torch.Tensor,
    localised: torch.Tensor,
    positive: torch.Tensor,
    correct: torch.Tensor,
) -> dict[str, float]:
    groups: dict = defaultdict(list)
    for i, group_id in enumerate(index):
        groups[group_id].append(i)
    all_wrong = [rows for rows in groups.values() if not correct[rows].any()]
    all_wrong_with_signal = sum(bool(advantages[rows].ne(0).any()) for rows in all_wrong)
    incorrect = ~correct
    n_incorrect = int(incorrect.sum())
    repaired = incorrect & (phi > 0)
    tokens_localised = response_mask[localised].bool()
    return {
        "ibpo/incorrect_repaired_frac": float(repaired.sum()) / n_incorrect if n_incorrect else 0.0,
        "ibpo/phi_mean_incorrect": float(phi[incorrect].mean()) if n_incorrect else 0.0,
        "ibpo/all_wrong_groups": float(len(all_wrong)),
        "ibpo/all_wrong_groups_with_signal_frac": all_wrong_with_signal / len(all_wrong) if all_wrong else 0.0,
        "ibpo/singleton_groups": float(sum(len(rows) == 1 for rows in groups.values())),
        "ibpo/masked_traces": float(localised.sum()),
        "ibpo/masked_positive_traces": float(positive.sum()),
        "ibpo/broadcast_repaired_traces": float((repaired & ~localised).sum()),
        "ibpo/masked_token_frac": (
            float((advantages[localised].ne(0) & tokens_localised).sum()) / float(tokens_localised.sum())
            if bool(tokens_localised.any())
            else 0.0
        ),
    }
