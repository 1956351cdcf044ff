"""Probe planning for a whole batch: segmentation, group banks and the probes of every trace (driver side).

Everything that reads across a group (candidate answers, the self-normalising answer set, reference banks) is built
here from the *whole* batch, before the batch is split across data-parallel ranks, and travels with each trace as the
plan of its ``TraceRecord`` (``core.traces``). The workers only score plans (``values.score_plans``), so a trace's
values do not depend on how verl shards or reorders the batch.

States are S_0 (empty response) and S_k at each segment end b_1..b_{K-1}; the terminal state's value is the trace's
outcome, so a plan carries K values to estimate. The probe text comes from the probe profile (``core/profiles.py``:
thinking opener, exit text, answer closings, joining to the prefix), resolved here from the tokenizer (``auto``) and
the task's answer style; how answers are read and solutions cut into steps comes from the task (``TaskAdapter``),
which the caller passes in. Imports neither verl, ray nor the tasks.

A model without thinking markers (profile ``plain``): the whole response is the reasoning, open from its first
token. Its answer region starts at the last answer marker it writes (``profiles.answer_region_start``); the steps of a
correct trace end there, and a state whose boundary falls inside the region is probed from the region's start (a
probe that forced the exit text after ``#### 4`` would score a text no model writes), so every state has a value.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Protocol, Sequence

import numpy as np
from rapidfuzz import fuzz

from rredcot_verl.core import outcomes, processes
from rredcot_verl.core.probes import Probe, build_exit_probes, build_reference_probes
from rredcot_verl.core.profiles import ProbeProfile, ProbeTokenizer, answer_region_start
from rredcot_verl.core.segmentation import BoundaryVocab, segment_response
from rredcot_verl.core.settings import RRedCoTSettings
from rredcot_verl.core.traces import TraceRecord, state_starts

logger = logging.getLogger(__name__)

# How a plan's probe log-probs become values (``values.score_plans``).
VALUE_RULES = ("raw", "self_normalized", "own_continuation")


class TaskAdapter(Protocol):
    """What planning needs from a task (implementations and the registry: ``rredcot_verl/tasks/base.py``).

    ``extract_answer(text)``: the answer inside the response's last ``\\boxed{}`` (None without one);
    ``answer_text(ground_truth)``: the dataset answer as the text to score; ``equivalent(a, b)``: same answer;
    ``split_steps(thinking_text)``: the stripped, non-empty steps; ``step_separator``: the whitespace ending a step.
    ``answer_style`` (optional, default ``"boxed"``): the answer format, one of ``profiles.ANSWER_STYLES``; it picks
    the profile's exit text and answer closings. ``dataset_steps(extra_info)`` (optional): reference steps read from
    a row's own fields where it has no ``extra_info.reference_steps`` (verl's GSM8K rows keep the rationale in
    ``extra_info.answer``), or None.
    """

    step_separator: str

    def extract_answer(self, text: str) -> str | None: ...

    def answer_text(self, ground_truth: str) -> str: ...

    def equivalent(self, a: str, b: str) -> bool: ...

    def split_steps(self, thinking_text: str) -> list[str]: ...


# Where a group's bank of correct answers and continuations came from (``TraceRecord.bank_sources``).
BANK_FROM_TRACES, BANK_FROM_DATASET, BANK_FROM_REPAIRS = "traces", "dataset", "repairs"


@dataclass
class _GroupBank:
    correct_answers: list[str] = field(default_factory=list)
    all_answers: list[str] = field(default_factory=list)
    correct_steps: list[tuple[list[str], str]] = field(default_factory=list)
    sources: set[str] = field(default_factory=set)

    def add_answer(self, answer: str, source: str) -> None:
        """A correct answer from ``source`` (scored by exit probes)."""
        if answer not in self.correct_answers:
            self.correct_answers.append(answer)
        if answer not in self.all_answers:
            self.all_answers.append(answer)
        self.sources.add(source)

    def add_correct(self, steps: list[str], answer: str, source: str) -> None:
        """A correct solution from ``source``: its answer and its thinking steps (a reference continuation)."""
        self.add_answer(answer, source)
        if (steps, answer) not in self.correct_steps:
            self.correct_steps.append((steps, answer))


def _thinking_text(text: str, profile: ProbeProfile, opened_by_prompt: bool) -> str:
    """The thinking part of a response text: after ``think_start`` (or from the start when the prompt opened
    thinking), before ``think_end``; without thinking markers, the text before its answer region."""
    if not profile.thinks:
        return text[: answer_region_start(text, profile)]
    if profile.think_start in text:
        text = text.split(profile.think_start, 1)[1]
    elif not opened_by_prompt:
        text = ""
    return text.split(profile.think_end, 1)[0]


def _group_banks(traces, texts, opened, settings: RRedCoTSettings, task: TaskAdapter, repairs,
                 profile: ProbeProfile, decode_batch) -> dict:
    """Per group, its bank. ``repairs``: per group, the token ids of its verified repairs, decoded (``decode_batch``)
    only for the groups that bank them. A correct solution's steps are split only for reference continuations, the
    one value source that reads them."""
    cand = settings.candidates
    with_steps = settings.probe.value_source == "reference_continuation"

    def add_solution(bank: _GroupBank, text: str, answer: str, by_prompt: bool, source: str) -> None:
        if with_steps:
            bank.add_correct(task.split_steps(_thinking_text(text, profile, by_prompt)), answer, source)
        else:
            bank.add_answer(answer, source)

    banks: dict[Hashable, _GroupBank] = defaultdict(_GroupBank)
    opened_in_group: dict[Hashable, bool] = {}
    correct = outcomes.correct_outcomes([float(trace.outcome) for trace in traces], settings.reward_range).tolist()
    for trace, text, by_prompt, is_correct in zip(traces, texts, opened, correct):
        bank = banks[trace.group]
        opened_in_group.setdefault(trace.group, by_prompt)
        answer = task.extract_answer(text)
        if answer is not None and answer not in bank.all_answers:
            bank.all_answers.append(answer)
        if is_correct and answer is not None and cand.uses_group:
            add_solution(bank, text, answer, by_prompt, BANK_FROM_TRACES)
    if cand.uses_repairs:
        # A verified repair is a correct solution of the prompt, written by the policy under the same chat template
        # as the group's traces: it enters the bank as a correct trace would, in groups that have none.
        for group, ids_of_group in repairs.items():
            bank = banks[group]
            if BANK_FROM_TRACES in bank.sources or group not in opened_in_group:
                continue
            for text in decode_batch(ids_of_group):
                answer = task.extract_answer(text)
                if answer is not None:
                    add_solution(bank, text, answer, opened_in_group[group], BANK_FROM_REPAIRS)
    for trace in traces:
        bank = banks[trace.group]
        if cand.uses_dataset and trace.ground_truth is not None:
            truth = task.answer_text(str(trace.ground_truth))
            steps = trace.reference_steps
            if steps is None and getattr(task, "dataset_steps", None) is not None:
                steps = task.dataset_steps(trace.extra_info)
            if steps is not None:
                bank.add_correct(list(steps), truth, BANK_FROM_DATASET)
            else:  # an answer to score (exit probes), no continuation
                bank.add_answer(truth, BANK_FROM_DATASET)
    for bank in banks.values():
        # An answer written differently from a correct one but equal to it (0.5 and 1/2) is rewarded like it: it
        # is a correct candidate, not a competitor in the self-normalising denominator.
        correct = list(bank.correct_answers)
        for answer in bank.all_answers:
            if answer not in correct and correct and any(task.equivalent(answer, c) for c in correct):
                bank.correct_answers.append(answer)
    return banks


def resume_index(written: Sequence[str], completed: int, steps: Sequence[str], alignment: str,
                 trace_steps: int) -> int:
    """How many of a bank entry's ``steps`` a prefix's ``completed`` steps (of ``written``) stand for.

    ``steps``: as many as the prefix completed. ``proportional``: the same fraction of the entry as the prefix has of
    its whole trace (``trace_steps`` steps), so a trace of dozens of paragraphs walks a four-line solution at its own
    pace. ``content``: up to the entry step the last completed step reads most like (rapidfuzz ratio; the earliest
    of equals), so a trace that skipped, merged or repeated steps resumes where its text says it is.
    """
    if alignment == "steps" or completed == 0:
        return completed
    if alignment == "proportional":
        return min(len(steps), round(completed * len(steps) / max(trace_steps, completed)))
    if alignment == "content":
        last = written[completed - 1]
        scores = [fuzz.ratio(last, step) for step in steps]
        return 1 + max(range(len(steps)), key=lambda j: (scores[j], -j)) if steps else 0
    raise ValueError(f"unknown reference alignment {alignment!r}")


def continuation_text(body: str, steps: Sequence[str], task: TaskAdapter, alignment: str = "steps",
                      trace_steps: int = 0) -> str:
    """Text that continues the thinking ``body`` written so far along a bank entry's ``steps``, up to its last step.

    The prefix has completed the steps of ``task.split_steps(body)`` that its text has closed with the separator; the
    continuation resumes the entry after the steps those stand for (``resume_index``: ``alignment``, with the whole
    trace's ``trace_steps``). A step the prefix has started: when the entry's next step starts with the text written
    so far, the continuation finishes it; otherwise the prefix's version stands for that step (the separator is
    completed and the entry resumes at the one after), as a completed wrong step does.
    """
    sep = task.step_separator
    written = task.split_steps(body)
    if not written:  # thinking just opened: the first step starts on a new line
        return ("" if body.endswith("\n") else "\n") + sep.join(steps)
    if body.rstrip(" \t").endswith(sep):
        return sep.join(steps[resume_index(written, len(written), steps, alignment, trace_steps):])
    done = resume_index(written, len(written) - 1, steps, alignment, trace_steps)  # the last step is being written
    current = body[body.rfind(sep) + len(sep):] if sep in body else body
    current = current.lstrip()
    rest = list(steps[done + 1:])
    if done < len(steps) and steps[done].startswith(current):
        return steps[done][len(current):] + "".join(sep + step for step in rest)
    if not rest:
        return ""
    missing = next(sep[i:] for i in range(len(sep), -1, -1) if body.endswith(sep[:i]))
    return missing + sep.join(rest)


class _Planner:
    """Per-call state of ``plan_traces``: the profile, the probe tokenizer (with its caches) and answer sequences."""

    def __init__(self, settings: RRedCoTSettings, tokenizer, task: TaskAdapter):
        self.settings, self.task = settings, task
        self.profile = settings.probe.profile_for(tokenizer, getattr(task, "answer_style", "boxed"))
        self.probe_tokenizer = ProbeTokenizer(tokenizer)
        self.eos = [] if not self.profile.answer_eos else [tokenizer.eos_token_id]
        # Without thinking markers there is no marker token: thinking is open from the first response token.
        thinks = self.profile.thinks
        self.think_start_id = self._single_token(self.profile.think_start, "think_start") if thinks else None
        self.think_end_id = self._single_token(self.profile.think_end, "think_end") if thinks else None
        self.exit_ids = self.probe_tokenizer.encode(self.profile.exit_text)
        self._answers: dict[str, list[tuple[int, ...]]] = {}

    def _single_token(self, marker: str, key: str) -> int:
        ids = self.probe_tokenizer.encode(marker)
        if len(ids) != 1:
            raise ValueError(f"probe.{key} {marker!r} must be one token of the tokenizer, got {len(ids)} tokens {ids}")
        return ids[0]

    def opened_by_prompt(self, prompt: list[int]) -> bool:
        """The prompt ends with ``think_start`` and whitespace (R1-distill's template): thinking is already open.
        Always true without thinking markers (the response is the reasoning from its first token)."""
        if self.think_start_id is None:
            return True
        if self.think_start_id not in prompt:
            return False
        last = len(prompt) - 1 - prompt[::-1].index(self.think_start_id)
        return not self.probe_tokenizer.decode(prompt[last + 1:]).strip()

    def closed_sequences(self, context: Sequence[int], stem: str, exit_line: bool = False) -> list[tuple[int, ...]]:
        """Tokens of ``stem`` + each answer closing after ``context`` (+ EOS), prefix-free (module ``profiles``)."""
        sequences = [self.probe_tokenizer.continuation(context, stem + closing, exit_line=exit_line) + tuple(self.eos)
                     for closing in self.profile.answer_closings]
        unique = list(dict.fromkeys(sequences))
        return [s for s in unique if not any(o != s and s[: len(o)] == o for o in unique)]

    def answer_sequences(self, answer: str) -> list[tuple[int, ...]]:
        """An answer's scored alternatives after the exit text; the same at every boundary (the exit text ends with
        its own pre-token, e.g. ``\\boxed``, whatever the boundary it was joined to)."""
        if answer not in self._answers:
            self._answers[answer] = self.closed_sequences(self.exit_ids, self.profile.answer_prefix + answer)
        return self._answers[answer]

    def answer_start(self, response: list[int], text: str) -> int:
        """Response tokens before the answer region of a trace without thinking markers (``len(response)`` when it
        writes none): the most tokens whose text ends at or before the region's first character."""
        offset = answer_region_start(text, self.profile)
        if offset >= len(text):
            return len(response)
        return self.tokens_before(response, offset)

    def tokens_before(self, response: list[int], offset: int) -> int:
        """The most tokens of ``response`` whose decoded text is at most ``offset`` characters long (decoded prefix
        lengths grow with the token count): every prefix's length at once where the tokenizer allows
        (``ProbeTokenizer.prefix_lengths``), else a binary search over decoded prefixes."""
        lengths = self.probe_tokenizer.prefix_lengths(response)
        if lengths is not None:
            return int(np.searchsorted(lengths, offset, side="right")) - 1
        low, high = 0, len(response)
        while low < high:
            middle = (low + high + 1) // 2
            if len(self.probe_tokenizer.decode(response[:middle])) <= offset:
                low = middle
            else:
                high = middle - 1
        return low

    def at_response_start(self, start: int) -> bool:
        """A state of a model without thinking markers before any response text: the exit text (or a continuation)
        is the first text of the response, which starts on the line the chat template opened, so its leading
        whitespace goes (joined to ``assistant\\n`` it would merge into a newline token the model never writes)."""
        return start == 0 and not self.profile.thinks

    def exit_probes(self, trace, response: list[int], starts, bank, opened) -> list[Probe]:
        prompt = trace.prompt_ids.tolist()
        turns = trace.turns()
        correct = [s for a in bank.correct_answers for s in self.answer_sequences(a)]
        every = [s for a in bank.all_answers for s in self.answer_sequences(a)]
        thinking_ends: dict[tuple[int, int], int] = {}  # per turn: one scan of the response, not one per state
        probes = []
        for k, start in enumerate(starts):
            text = self.profile.exit_text if opened[k] else self.profile.think_opener + self.profile.exit_text
            if self.at_response_start(start):
                text = text.lstrip()
            forced = self.probe_tokenizer.continuation(self.context(prompt, response, start), text,
                                                       exit_line=opened[k])
            span = next(((a, b) for a, b in turns if a <= start < b), (start, len(response)))
            if span not in thinking_ends:
                thinking_ends[span] = self.thinking_end(response, span)
            probes += build_exit_probes([start], forced, correct, thinking_length=thinking_ends[span],
                                        all_answers=every, first_value_index=k)
        return probes

    def context(self, prompt: list[int], response: list[int], start: int) -> list[int]:
        """The end of ``prompt + response[:start]`` that a probe's tokens depend on (``ProbeTokenizer.context_needed``
        tokens): building the whole context at every state of a 25k-token trace costs more than the probes."""
        needed = self.probe_tokenizer.context_needed
        if not needed:
            return []
        return (prompt[-needed:] + response[max(start - needed, 0) : start])[-needed:]

    def thinking_end(self, response: list[int], span: tuple[int, int]) -> int:
        """Where the thinking of the turn ``span`` (start, stop) ends: its first ``think_end`` (each turn of a
        thinking model thinks anew), else the response's end."""
        if self.think_end_id is not None:
            try:
                return response.index(self.think_end_id, *span)
            except ValueError:
                pass
        return len(response)

    def reference_probes(self, trace, response: list[int], starts, bank, opened, bodies,
                         trace_steps: int) -> list[Probe]:
        alignment = self.settings.probe.reference_alignment
        prompt = trace.prompt_ids.tolist()
        banks = []
        for k, start in enumerate(starts):
            opening = "" if opened[k] else self.profile.think_opener
            body = bodies[k] if opened[k] else opening[len(self.profile.think_start):]
            context = self.context(prompt, response, start)
            entries = []
            for steps, answer in bank.correct_steps:
                steps_text = opening + continuation_text(body, steps, self.task, alignment, trace_steps)
                stem = steps_text + self.profile.exit_text + self.profile.answer_prefix + answer
                if self.at_response_start(start):
                    stem = stem.lstrip()
                entries += self.closed_sequences(context, stem, exit_line=not steps_text)
            banks.append(entries)
        return build_reference_probes(starts, banks)


def _opened_and_bodies(planner: _Planner, trace, response: list[int], starts, by_prompt: bool, need_bodies: bool):
    """Per state: whether thinking is open at its boundary, and (reference continuation) the thinking text so far,
    both within the assistant turn holding it (a later turn opens its thinking anew, after the tool output)."""
    start_id = planner.think_start_id
    turns = trace.turns() or [(0, 0)]
    open_at = []  # per turn: where its thinking opens, or None
    for j, (turn_start, turn_stop) in enumerate(turns):
        if j == 0 and by_prompt or j > 0 and planner.opened_by_prompt(trace.prompt_ids.tolist() + response[:turn_start]):
            open_at.append(turn_start)
        elif start_id is not None and start_id in response[turn_start:turn_stop]:
            open_at.append(response.index(start_id, turn_start, turn_stop) + 1)
        else:
            open_at.append(None)
    # The turn of a state: the last one starting at or before it (a state past the last turn's end is in it).
    turn_of = [max([j for j, (turn_start, _) in enumerate(turns) if turn_start <= start], default=0) for start in starts]
    opened = [open_at[j] is not None and start >= open_at[j] for start, j in zip(starts, turn_of)]
    bodies = []
    if need_bodies:
        # Segment by segment, so the thinking text costs one decode of the response rather than one per state.
        body, last, body_turn = "", open_at[0] or 0, 0
        for start, is_open, j in zip(starts, opened, turn_of):
            if j != body_turn:
                body, last, body_turn = "", open_at[j] or turns[j][0], j
            if is_open and start > last:
                body += planner.probe_tokenizer.decode(response[last:start])
                last = start
            bodies.append(body if is_open else "")
    return opened, bodies


def _value_rule(settings: RRedCoTSettings) -> str:
    source = settings.probe.value_source
    if source == "own_continuation":
        return "own_continuation"
    # Self-normalisation divides by the mass of all the group's answers: it exists for exit probes only; a reference
    # bank holds correct continuations alone, so its values are the raw (lower-bound) sums.
    return settings.probe.normalization if source == "exit_probe" else "raw"


# Probe planning goes to worker processes from this many response tokens per worker (``processes.worker_count``):
# about 0.1 s of planning on one core, against a chunk's dispatch of a few milliseconds.
PLANNING_TOKENS_PER_WORKER = 500_000


def planning_workers(traces: Sequence[TraceRecord], cores: int | None = None) -> int:
    """Worker processes for ``plan_traces`` of ``traces``: one per ``PLANNING_TOKENS_PER_WORKER`` response tokens, at
    most one per core of the driver (``cores``: ``processes.available_cores()``)."""
    tokens = sum(int(trace.response_ids.numel()) for trace in traces)
    return processes.worker_count(tokens, PLANNING_TOKENS_PER_WORKER, cores)


def plan_traces(
    traces: Sequence[TraceRecord],
    settings: RRedCoTSettings,
    tokenizer,
    task: TaskAdapter,
    *,
    vocab: BoundaryVocab | None = None,
    temperature: float = 1.0,
    repairs: Mapping[Hashable, Sequence[Sequence[int]]] | None = None,
    workers: int = 1,
) -> list[TraceRecord]:
    """Segment every trace and build its probes from the whole batch's group banks.

    Args:
        traces: the whole step's rollouts (every member of every group).
        settings: ``algorithm.rredcot``.
        tokenizer: the policy's tokenizer.
        task: the task adapter (``rredcot_verl.tasks.resolve_task(settings.task)``).
        vocab: boundary tokens (``settings.boundary_vocab(tokenizer)`` when None).
        temperature: the rollout's sampling temperature (``actor_rollout_ref.rollout.temperature``), copied into
            every plan so that probes are scored under the distribution the traces were sampled from.
        repairs: per group, the token ids of its verified repairs (required by ``candidates.source:
            group_and_repairs``, which banks them in the groups without a correct trace; ignored otherwise).
        workers: processes that segment the traces and build their probes once the banks are built, each a
            contiguous share of the traces (``processes.map_chunks``; ``planning_workers`` sizes it from the driver's
            cores); 1: in this process. The plans are the same whatever the number.

    Returns:
        Each trace's record with its plan (``TraceRecord``'s plan fields; its entropy, which only the segmentation
        reads, dropped), in order.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if settings.candidates.uses_repairs and repairs is None:
        raise ValueError("candidates.source=group_and_repairs needs the step's verified repairs (repairs=...)")
    vocab = vocab or settings.boundary_vocab(tokenizer)
    planner = _Planner(settings, tokenizer, task)
    texts = planner.probe_tokenizer.decode_batch([t.response_ids for t in traces])
    # Answers and reference steps are the model's own: a tool's output (mask 0) is neither.
    own_texts = [text if t.response_mask is None else planner.probe_tokenizer.decode(
        t.response_ids[t.response_mask.bool()].tolist()) for t, text in zip(traces, texts)]
    by_prompt = [planner.opened_by_prompt(t.prompt_ids.tolist()) for t in traces]
    banks = _group_banks(traces, own_texts, by_prompt, settings, task, repairs or {}, planner.profile,
                         planner.probe_tokenizer.decode_batch)
    rule = _value_rule(settings)
    # A trace's text is read past its banks only to find the answer region (no thinking markers) or to count its
    # steps (reference continuations); the workers are not sent it otherwise.
    reads_text = not planner.profile.thinks or settings.probe.value_source == "reference_continuation"
    jobs = [(trace, text if reads_text else None, prompt_opened, banks[trace.group])
            for trace, text, prompt_opened in zip(traces, texts, by_prompt)]
    planned = processes.map_chunks(_plan_chunk, (settings, tokenizer, task, vocab), jobs, workers)
    plans = []
    split_joins = 0
    for trace, (segment_ends, probes, no_candidates, joins) in zip(traces, planned):
        bank = banks[trace.group]
        plans.append(dataclasses.replace(
            trace, entropy=None, outcome=float(trace.outcome), segment_ends=segment_ends, probes=probes,
            success=settings.success_probability(trace.outcome), value_rule=rule, no_candidates=no_candidates,
            temperature=float(temperature), bank_sources=frozenset(bank.sources),
        ))  # fmt: skip
        split_joins += joins
    if split_joins:
        logger.warning("%d probe texts could not be joined to their prefix as the tokenizer writes them in one piece; "
                       "they were tokenized on their own (core/profiles.py)", split_joins)
    return plans


def _plan_chunk(context, jobs) -> list[tuple[list[int], list[Probe], bool, int]]:
    """Per job (trace, its text or None, thinking opened by its prompt, its group's bank): its segment ends, its
    probes, whether its group had no candidate, and the probe texts tokenized on their own
    (``ProbeTokenizer.split_joins``). Runs in ``plan_traces``'s process or in a worker (``processes.map_chunks``)."""
    settings, tokenizer, task, vocab = context
    planner = _Planner(settings, tokenizer, task)
    rule = _value_rule(settings)
    source = settings.probe.value_source
    results = []
    for trace, text, prompt_opened, bank in jobs:
        joins_before = planner.probe_tokenizer.split_joins
        segment_ends, probes, no_candidates = [], [], False
        if trace.response_ids.numel() > 0:
            segment_ends = segment_response(trace.response_ids, trace.entropy, vocab, settings.segmentation,
                                            response_mask=trace.response_mask)
            if segment_ends and rule != "own_continuation":
                if bank.correct_answers:
                    response = trace.response_ids.tolist()  # once: 25k ids are a millisecond a copy
                    reference = source == "reference_continuation"
                    starts = state_starts(segment_ends)
                    if not planner.profile.thinks:  # states inside the answer region: probed from its start
                        answer_start = planner.answer_start(response, text)
                        starts = [min(start, answer_start) for start in starts]
                    opened, bodies = _opened_and_bodies(planner, trace, response, starts, prompt_opened, reference)
                    if reference:
                        trace_steps = len(task.split_steps(_thinking_text(text, planner.profile, prompt_opened)))
                        probes = planner.reference_probes(trace, response, starts, bank, opened, bodies, trace_steps)
                    else:
                        probes = planner.exit_probes(trace, response, starts, bank, opened)
                else:
                    no_candidates = True
        results.append((segment_ends, probes, no_candidates, planner.probe_tokenizer.split_joins - joins_before))
    return results


def bank_metrics(plans: Sequence[TraceRecord], groups: Sequence[Hashable]) -> dict[str, float]:
    """Per step, the prompt groups whose bank holds entries from each source (``rredcot/bank_groups_from_traces``,
    ``..._from_dataset``, ``..._from_repairs``; a group may count under two) and those with an empty bank
    (``rredcot/bank_groups_empty``: their traces get no values)."""
    sources: dict[Hashable, frozenset[str]] = {}
    for plan, group in zip(plans, groups):
        sources.setdefault(group, plan.bank_sources)
    metrics = {
        f"rredcot/bank_groups_from_{source}": float(sum(source in found for found in sources.values()))
        for source in (BANK_FROM_TRACES, BANK_FROM_DATASET, BANK_FROM_REPAIRS)
    }
    metrics["rredcot/bank_groups_empty"] = float(sum(not found for found in sources.values()))
    return metrics
