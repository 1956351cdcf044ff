"""Probes and the value sources built on them: what is scored at each segment boundary, and how scores become values.

A *probe* is a token sequence appended after the prefix ``prompt + response[:b]``; its ``scored_ids`` are
scored by the model's log-probability and its ``forced_ids`` (e.g. the exit text ``"\\n</think>\\n\\\\boxed"``) only
condition them. Probes feed three value sources (``ProbeSettings.value_source``):

* ``exit_probe``: probability of the correct answer(s) after a forced exit from thinking at the boundary;
* ``reference_continuation``: probability of a bank of known continuations (reference solution remainder,
  group's correct traces) from the boundary;
* ``own_continuation``: ζ times the probability of the trace's own remainder, read from the trace log-probs
  (no probes; a baseline).

The probes are scored by ``core.scoring`` (one packed forward per micro-batch of traces). Position convention:
``P`` = prompt length (≥ 1), ``L`` = response length (≥ 0), a probe at boundary ``b`` (0 ≤ b ≤ L) continues the
prefix of length ``P + b``.

This module imports neither verl nor ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rredcot_verl.core.profiles import AUTO, AUTO_FAMILIES, PROFILE_KEYS, ProbeProfile, resolve_profile

VALUE_SOURCES = ("exit_probe", "reference_continuation", "own_continuation")
# How a reference continuation finds where a trace's prefix stands in a bank entry (core/planning.py,
# ``resume_index``): by the count of steps written, by the same fraction of each, or by the entry step the last
# written step reads most like.
REFERENCE_ALIGNMENTS = ("steps", "proportional", "content")
NORMALIZATIONS = ("raw", "self_normalized")
KIND_CORRECT = "correct"
KIND_INCORRECT = "incorrect"  # scored only for the self-normalising denominator
PROBE_KINDS = (KIND_CORRECT, KIND_INCORRECT)


@dataclass(frozen=True)
class ProbeSettings:
    """How segment-boundary values are estimated, and the probe text of the model family.

    Attributes:
        value_source: one of ``VALUE_SOURCES``, or ``"auto"``, a config's default: chosen at launch from the
            training data (``core.settings.AUTO_RULES``). The dataclass's own default, for code that builds settings
            itself, is ``"exit_probe"`` (the paper's answer-forcing probe). On small models and tasks with steps,
            ``"reference_continuation"`` was measured to be far more informative (docs/choices.md, "Value source").
        normalization: ``"self_normalized"`` (default; probability of the correct answers divided by the mass of all
            answers the group produced, a calibrated value in [0, 1]) or ``"raw"`` (the plain sum, a lower bound).
        profile: the model family's probe text: ``"auto"`` (default: read from the tokenizer's vocabulary and chat
            template where the tokenizer is loaded, ``profiles.detect_family``: ``qwen3``, ``r1_distill`` or
            ``plain``) or a preset of ``profiles.PROFILE_PRESETS``: ``"qwen3"``, ``"r1_distill"``, ``"plain"`` (a
            model without thinking markers: Qwen2.5-Instruct, Llama, Mistral), ``"embedded"`` (the tiny task). The
            answer text (exit text, prefix, closings) follows the task's answer style (``boxed`` or ``gsm8k``).
        reference_alignment: where a reference continuation resumes a bank entry after a trace's prefix, one of
            ``REFERENCE_ALIGNMENTS``: ``"steps"`` (default: after as many entry steps as the prefix has completed),
            ``"proportional"`` (after the same fraction of the entry's steps as the prefix has of its trace's: a long
            trace against a short reference solution) or ``"content"`` (after the entry step most like the prefix's
            last completed step, rapidfuzz ratio: a trace that skipped, merged or repeated steps). Measured in
            docs/choices.md, "Reference values at length".
        think_start, think_end, think_opener, exit_text, answer_prefix, answer_closings, answer_eos: null (default)
            takes the preset's value, anything else overrides it (meanings in ``core/profiles.py``). ``think_end``
            is also the marker the segmentation cuts the answer segment at.
    """

    value_source: str = "exit_probe"
    normalization: str = "self_normalized"
    profile: str = AUTO
    reference_alignment: str = "steps"
    think_start: str | None = None
    think_end: str | None = None
    think_opener: str | None = None
    exit_text: str | None = None
    answer_prefix: str | None = None
    answer_closings: tuple[str, ...] | None = None
    answer_eos: bool | None = None

    def __post_init__(self) -> None:
        if self.value_source not in VALUE_SOURCES:
            raise ValueError(f"value_source must be one of {VALUE_SOURCES}, got {self.value_source!r}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")
        if self.reference_alignment not in REFERENCE_ALIGNMENTS:
            raise ValueError(f"reference_alignment must be one of {REFERENCE_ALIGNMENTS}, got "
                             f"{self.reference_alignment!r}")
        if isinstance(self.answer_closings, list):
            object.__setattr__(self, "answer_closings", tuple(self.answer_closings))
        # Validates the preset name and the overrides now, not at the first training step; ``auto`` is resolved
        # from the tokenizer later, so here the overrides must suit at least one of the families it may pick.
        names = AUTO_FAMILIES if self.profile == AUTO else (self.profile,)
        errors = []
        for name in names:
            try:
                resolve_profile(name, self._overrides())
                break
            except ValueError as error:
                errors.append(error)
        else:
            raise errors[0]

    def _overrides(self) -> dict:
        return {name: getattr(self, name) for name in PROFILE_KEYS}

    @property
    def profile_values(self) -> ProbeProfile:
        """The named preset (``boxed`` answers) with this section's explicit keys applied; ``auto`` needs
        ``profile_for(tokenizer)``."""
        return self.profile_for()

    def profile_for(self, tokenizer=None, answer_style: str = "boxed") -> ProbeProfile:
        """The profile for this tokenizer (``auto``) and the task's answer style, with the explicit keys applied."""
        return resolve_profile(self.profile, self._overrides(), answer_style, tokenizer)


@dataclass(frozen=True)
class Probe:
    """One scored continuation of the prefix ``prompt + response[:boundary]``.

    Attributes:
        boundary: number of response tokens in the prefix, 0 ≤ boundary ≤ L.
        forced_ids: conditioning tokens placed after the prefix, not scored (may be empty).
        scored_ids: tokens whose log-probability is summed (non-empty).
        value_index: index of the value this probe contributes to (the boundary index k).
        kind: ``"correct"`` (counted in the value) or ``"incorrect"`` (only in the self-normalising denominator).
    """

    boundary: int
    forced_ids: tuple[int, ...]
    scored_ids: tuple[int, ...]
    value_index: int
    kind: str = KIND_CORRECT

    def __post_init__(self) -> None:
        object.__setattr__(self, "forced_ids", tuple(map(int, self.forced_ids)))
        object.__setattr__(self, "scored_ids", tuple(map(int, self.scored_ids)))
        if not self.scored_ids:
            raise ValueError(f"Probe.scored_ids must be non-empty (boundary={self.boundary}, value_index={self.value_index})")
        if self.boundary < 0:
            raise ValueError(f"Probe.boundary must be >= 0, got {self.boundary}")
        if self.value_index < 0:
            raise ValueError(f"Probe.value_index must be >= 0, got {self.value_index}")
        if self.kind not in PROBE_KINDS:
            raise ValueError(f"Probe.kind must be one of {PROBE_KINDS}, got {self.kind!r}")

    @property
    def tokens(self) -> tuple[int, ...]:
        """forced + scored, the text appended after the prefix."""
        return self.forced_ids + self.scored_ids


# ----------------------------------------------------------------------------------------------------------------
# Value sources


def _distinct(sequences: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Exact-duplicate removal keeping order: each distinct sequence is counted once in a sum of probabilities."""
    return list(dict.fromkeys(tuple(int(t) for t in sequence) for sequence in sequences))


def build_exit_probes(
    boundaries: Sequence[int],
    exit_ids: Sequence[int],
    correct_answers: Sequence[Sequence[int]],
    *,
    thinking_length: int,
    all_answers: Sequence[Sequence[int]] = (),
    first_value_index: int = 0,
) -> list[Probe]:
    """Exit probes: at each boundary inside the thinking part, force the exit text and score each answer.

    Value k is Σ_{y ∈ correct} p(y | prefix_k, exit) (``"raw"``, a lower bound on the exit accuracy) or that sum
    divided by the mass of all distinct answers (``"self_normalized"``); see ``values_from_probe_logp``.

    Args:
        boundaries: (K,) response-token counts b_k; probes of value k belong to boundaries[k].
        exit_ids: tokenization of the exit text (e.g. "\\n</think>\\n\\\\boxed"), non-empty.
        correct_answers: token lists of the distinct correct answers (e.g. "{59}" + EOS), at least one.
        thinking_length: number of response tokens before the exit; boundaries beyond it get no probes
            (their value is NaN: the caller anchors or falls back there).
        all_answers: token lists of every distinct answer the group produced, for self-normalisation; answers not
            in ``correct_answers`` become ``"incorrect"`` probes (the denominator is correct ∪ all).
        first_value_index: the value index of ``boundaries[0]`` (a caller building one state at a time passes k).

    Returns:
        Probes grouped by boundary index.
    """
    if not exit_ids:
        raise ValueError("exit_ids must be non-empty")
    correct = _distinct(correct_answers)
    if not correct:
        raise ValueError("correct_answers must hold at least one answer")
    incorrect = [answer for answer in _distinct(all_answers) if answer not in set(correct)]
    labelled = [(answer, KIND_CORRECT) for answer in correct] + [(answer, KIND_INCORRECT) for answer in incorrect]
    return [
        Probe(boundary=int(b), forced_ids=tuple(exit_ids), scored_ids=answer, value_index=k, kind=kind)
        for k, b in enumerate(boundaries, start=first_value_index)
        if b <= thinking_length
        for answer, kind in labelled
    ]


def build_reference_probes(
    boundaries: Sequence[int],
    continuations: Sequence[Sequence[Sequence[int]]],
    *,
    forced_ids: Sequence[int] = (),
) -> list[Probe]:
    """Reference-continuation probes: score the bank of known continuations from each boundary.

    Value k is Σ over the distinct bank entries of p(continuation | prefix_k, forced): a lower bound on the
    probability of reaching a correct answer, since the bank holds only some of the correct continuations.

    Args:
        boundaries: (K,) response-token counts b_k.
        continuations: per boundary k, the token lists of its bank (e.g. the reference solution's remaining steps
            and answer aligned to the step prefix k reached, and/or remainders of the group's correct traces).
            An empty bank gives that value NaN.
        forced_ids: optional conditioning text before every continuation (e.g. an exit text).

    Returns:
        Probes grouped by boundary index.
    """
    if len(continuations) != len(boundaries):
        raise ValueError(f"got {len(continuations)} continuation banks for {len(boundaries)} boundaries")
    return [
        Probe(boundary=int(b), forced_ids=tuple(forced_ids), scored_ids=continuation, value_index=k)
        for k, (b, bank) in enumerate(zip(boundaries, continuations))
        for continuation in _distinct(bank)
    ]


def values_from_probe_logp(
    probe_logp: torch.Tensor, probes: Sequence[Probe], num_values: int, normalization: str
) -> torch.Tensor:
    """Aggregate probe log-probs into values, in probability space via logsumexp.

    ``"raw"``: v_g = Σ_{correct probes of g} p.
    ``"self_normalized"``: v_g = Σ_correct p / Σ_{correct ∪ incorrect} p.
    Sums of distinct, prefix-free sequences stay ≤ 1; overlapping bank entries could exceed it, so values are clamped.

    Args:
        probe_logp: (n_probes,) from a scorer; NaN marks a skipped probe.
        probes: the n_probes probes.
        num_values: number of groups (values) V.
        normalization: ``"raw"`` or ``"self_normalized"``.

    Returns:
        (V,) fp32 in [0, 1]. NaN where a group has no correct probe or any of its probes was skipped: there is no
        estimate and the caller must fall back (e.g. to the anchored endpoint values).
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    if probe_logp.shape != (len(probes),):
        raise ValueError(f"probe_logp has shape {tuple(probe_logp.shape)}, expected ({len(probes)},)")
    if any(probe.value_index >= num_values for probe in probes):
        raise ValueError(f"a probe's value_index is >= num_values={num_values}")
    logp = probe_logp.float().cpu()
    groups = torch.tensor([probe.value_index for probe in probes], dtype=torch.long)
    is_correct = torch.tensor([probe.kind == KIND_CORRECT for probe in probes], dtype=torch.bool)
    in_denominator = is_correct if normalization == "raw" else torch.ones_like(is_correct)

    def group_logsumexp(selected: torch.Tensor) -> torch.Tensor:
        per_group = torch.full((num_values, max(len(probes), 1)), float("-inf"))
        index = torch.nonzero(selected)[:, 0]
        per_group[groups[index], index] = logp[index].nan_to_num(nan=float("-inf"))
        return per_group.logsumexp(-1)

    log_values = group_logsumexp(is_correct)
    if normalization == "self_normalized":
        log_values = log_values - group_logsumexp(in_denominator)
    values = log_values.exp().clamp(max=1.0)
    has_correct = torch.zeros(num_values, dtype=torch.bool)
    has_correct[groups[is_correct]] = True
    skipped = torch.zeros(num_values, dtype=torch.bool)
    skipped[groups[logp.isnan() & in_denominator]] = True
    return values.masked_fill(~has_correct | skipped, float("nan"))


def own_continuation_values(
    trace_log_probs: torch.Tensor,
    boundaries: Sequence[int],
    outcome: float,
    response_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Own-continuation baseline: v_k = ζ · Π_{n ≥ b_k} π(o_n | o_<n), from the trace log-probs alone.

    A one-sample lower bound; ~0 for long traces and 0 for every incorrect trace, so it pushes credit to the last segments.

    Args:
        trace_log_probs: (L,) log π(response[n] | prompt, response[:n]).
        boundaries: (K,) response-token counts, 0 ≤ b_k ≤ L.
        outcome: ζ ∈ [0, 1], the trace's verified reward.
        response_mask: (L,) 0/1 or None: the product runs over the 1s only (a multi-turn response's tool output is
            the environment's, not a choice of the policy).

    Returns:
        (K,) fp32 in [0, 1].
    """
    if trace_log_probs.dim() != 1:
        raise ValueError(f"trace_log_probs must be 1D (L,), got shape {tuple(trace_log_probs.shape)}")
    if not 0.0 <= outcome <= 1.0:
        raise ValueError(f"outcome must be in [0, 1], got {outcome}")
    response_len = trace_log_probs.numel()
    bounds = torch.as_tensor(list(boundaries), dtype=torch.long)
    if bounds.numel() and (bounds.min() < 0 or bounds.max() > response_len):
        raise ValueError(f"boundaries must lie in [0, {response_len}], got {bounds.tolist()}")
    log_probs = trace_log_probs.float()
    if response_mask is not None:
        log_probs = log_probs.where(response_mask.bool(), 0.0)
    # suffix[n] = Σ_{m ≥ n} log p_m, with suffix[L] = 0.
    suffix = torch.cat([log_probs.flip(0).cumsum(0).flip(0), torch.zeros(1)])
    return outcome * suffix[bounds].exp()
