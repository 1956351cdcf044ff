"""Which revisions to ask for, how long they may be and what prompt asks for them.

Reference selection (:func:`select_references`) and the batch plan (:func:`plan_revisions`, :class:`RevisionPlan`);
where a resumed repair starts (:func:`divergence_point`); the token budget of a rewrite (:func:`revision_budget`),
whether a request fits the engine (:func:`fits_engine`) and the engine context each operator needs at the longest
response (:func:`engine_context_need`); the rewrite operator's prompt templates (:func:`build_revision_prompt`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from rredcot_verl.core.ibpo.settings import IBPOSettings

__all__ = [
    "select_references",
    "RevisionPlan",
    "plan_revisions",
    "divergence_point",
    "revision_budget",
    "fits_engine",
    "engine_context_need",
    "largest_response_length",
    "DEFAULT_REVISION_TEMPLATE",
    "EMBEDDED_TASK_TEMPLATE",
    "build_revision_prompt",
]


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


def divergence_point(trace_ids: Sequence[int], reference_ids: Sequence[int]) -> int:
    """Leading tokens a trace shares with its reference: where a resumed repair (``repair_operator: resume``) starts.

    The repair keeps ``trace[:k]`` and the policy continues from there, so the first token it may change is the one
    where the trace left the reference. On tasks whose correct steps are deterministic a correct reference shares
    every correct step of the trace, and ``k`` is the first wrong token; two free-form samples share only their
    opening, and the resumed repair is then close to a fresh solve, which the rewrite guard judges as such.
    """
    limit = min(len(trace_ids), len(reference_ids))
    for k in range(limit):
        if trace_ids[k] != reference_ids[k]:
            return k
    return limit


def revision_budget(trace_length: int, cfg: IBPOSettings) -> int:
    """Most tokens a rewrite of a ``trace_length``-token trace may have: ``ceil(factor · L) + slack``.

    The rewrite restates the whole trace with its fix, so its budget must grow with the trace: a fixed cap turns every
    repair of a long trace into a truncated (failed) one or, if it stops early, a rewrite.
    """
    if trace_length < 0:
        raise ValueError(f"trace_length must be >= 0, got {trace_length}")
    return math.ceil(cfg.revision_length_factor * trace_length) + cfg.revision_slack_tokens


def fits_engine(prompt_tokens: int, max_new_tokens: int, max_model_length: int) -> bool:
    """Whether a request of ``prompt_tokens`` leaves the engine room for ``max_new_tokens`` generated tokens.

    The bound is the engine's context (``max_model_len``), not ``data.max_prompt_length``: a rewrite's prompt holds
    the question, the trace and a reference, and a resumed repair's holds the rollout's prompt and the kept prefix.
    Requests that do not fit are skipped, not truncated: a truncated trace cannot be repaired and aligned. The caller
    counts the skips; a trace whose revisions are all skipped keeps φ = 0.
    """
    if max_model_length < 1:
        raise ValueError(f"max_model_length must be >= 1, got {max_model_length}")
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
    return max_new_tokens >= 1 and prompt_tokens + max_new_tokens <= max_model_length


def engine_context_need(max_prompt_length: int, max_response_length: int, cfg: IBPOSettings) -> int:
    """Engine context (prompt + generated tokens) that repairing a failure of the full response budget takes.

    ``resume``: the rollout's prompt, the kept prefix ``k`` and a budget of ``max_response_length − k``, so
    ``max_prompt_length + max_response_length`` whatever ``k``: the rollouts' own need. ``rewrite``: the question
    (at most ``max_prompt_length``), the trace and a reference (``max_response_length`` each) and the rewrite's
    :func:`revision_budget`; the template's own words come on top, so for ``rewrite`` this is a lower bound.
    """
    if cfg.repair_operator == "resume":
        return max_prompt_length + max_response_length
    return max_prompt_length + 2 * max_response_length + revision_budget(max_response_length, cfg)


def largest_response_length(max_prompt_length: int, max_model_length: int, cfg: IBPOSettings) -> int:
    """The longest ``max_response_length`` whose repairs :func:`engine_context_need` fits in ``max_model_length``
    tokens of engine context (0 where none does: the prompt alone leaves no room)."""
    low, high = 0, max(0, max_model_length - max_prompt_length)  # the need grows with the response length
    while low < high:
        middle = (low + high + 1) // 2
        if engine_context_need(max_prompt_length, middle, cfg) <= max_model_length:
            low = middle
        else:
            high = middle - 1
    return low


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
