"""Task adapters: how a task's answers are read and its solutions cut into steps (``algorithm.rredcot.task``).

The planner (``core/planning.py``) and the credit report receive a ``Task``; they never import a task module. A task
gives:

- ``extract_answer(text)``: the answer string a response commits to (the text inside its last ``\\boxed{}``), or
  None. This string is what exit probes score, so it is kept as the model wrote it.
- ``answer_text(ground_truth)``: the dataset's ground truth as the text to score inside the box.
- ``equivalent(a, b)``: whether two answer strings are the same answer (an answer of an incorrect trace that is
  equivalent to a correct one is a correct candidate, not a competitor in the self-normalisation).
- ``split_steps(thinking_text)`` / ``step_separator``: the steps of a thinking text (stripped, non-empty) and the
  text that ends each step. A prefix has completed the steps followed by their separator; the reference
  continuation resumes a bank entry at that step (``planning.continuation_text``).
- ``first_wrong_step(extra_info, response_text)`` (optional, for the credit report and benchmarks): the 1-based first
  wrong step and the character span of its text, or None.

Registered names (``TASKS``): ``arithmetic`` (the embedded task, one step per line, integer answers), ``boxed_math``
(competition maths: math-verify equivalence, blank-line separated paragraphs), ``paragraphs`` (exact answers,
paragraphs), ``code`` (Python programs judged by tests: ``tasks/code.py``, which also says which value sources it
refuses). ``resolve_task`` also accepts ``module:attr``.
"""

from __future__ import annotations

import importlib
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

from rredcot_verl.tasks.arithmetic import THINK_CLOSE, THINK_OPEN, ArithmeticProblem
from rredcot_verl.tasks.arithmetic import first_wrong_step as arithmetic_first_wrong_step
from rredcot_verl.tasks.code import equivalent_programs, extract_program
from rredcot_verl.tasks.reward import extract_boxed_answer

StepSpan = tuple[int, tuple[int, int]]


@dataclass(frozen=True)
class Task:
    """One task's answer and step functions (module docstring)."""

    name: str
    extract_answer: Callable[[str], str | None]
    answer_text: Callable[[str], str]
    equivalent: Callable[[str, str], bool]
    split_steps: Callable[[str], list[str]]
    step_separator: str
    first_wrong_step: Callable[[Any, str], StepSpan | None] | None = None

    def __post_init__(self) -> None:
        if not self.step_separator or self.step_separator.strip():
            raise ValueError(f"task {self.name!r}: step_separator must be non-empty whitespace, got {self.step_separator!r}")


# ----------------------------------------------------------------------------------------------------- splitters

_BLANK_LINE = re.compile(r"\n[ \t]*\n")


def split_lines(text: str) -> list[str]:
    """Non-empty lines, stripped."""
    return [line.strip() for line in text.split("\n") if line.strip()]


def split_paragraphs(text: str) -> list[str]:
    """Paragraphs separated by blank lines (a step may span several lines), stripped, empty ones dropped."""
    return [part.strip() for part in _BLANK_LINE.split(text) if part.strip()]


# -------------------------------------------------------------------------------------------------------- answers


def _strip_math(text: str) -> str:
    text = str(text).strip()
    if "\\boxed" in text:
        text = extract_boxed_answer(text) or text
    return text.strip().strip("$").strip()


def _exact(a: str, b: str) -> bool:
    return " ".join(a.split()) == " ".join(b.split())


def _integer_equal(a: str, b: str) -> bool:
    try:
        return int(a.strip()) == int(b.strip())
    except ValueError:
        return _exact(a, b)


def math_equivalent(a: str, b: str) -> bool:
    """math-verify equivalence of two boxed contents (``1/2`` = ``0.5`` = ``\\frac{1}{2}``); exact text first."""
    if _exact(a, b):
        return True
    from math_verify import parse, verify

    # math-verify's timeouts are SIGALRM based, which only the main thread may install.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{a}}}", parsing_timeout=limit)
    answer = parse(f"\\boxed{{{b}}}", parsing_timeout=limit)
    return bool(gold and answer and verify(gold, answer, timeout_seconds=limit))


# ---------------------------------------------------------------------------------------------- arithmetic report


def _step_line_span(text: str, step: int) -> tuple[int, int]:
    """Characters [start, stop) of step line ``step`` (1-based) of the think block, without its indentation.

    A missing line gives an empty span where it would start (the ``</think>`` or the end of the text).
    """
    start = text.find(THINK_OPEN)
    if start < 0:  # no think block: first_wrong_step blames step 1, i.e. the first line
        newline = text.find("\n")
        return 0, len(text) if newline < 0 else newline
    offset = start + len(THINK_OPEN)
    close = text.find(THINK_CLOSE, offset)
    body_end = close if close >= 0 else len(text)
    seen = 0
    for line in text[offset:body_end].split("\n"):
        if line.strip():
            seen += 1
            if seen == step:
                return offset + len(line) - len(line.lstrip()), offset + len(line.rstrip())
        offset += len(line) + 1
    return body_end, body_end


def arithmetic_wrong_step(extra_info: Any, response_text: str) -> StepSpan | None:
    """First wrong step line of an arithmetic response and its character span; None when all steps are right or
    ``extra_info`` lacks ``operands``/``ops``."""
    if not isinstance(extra_info, dict) or "operands" not in extra_info or "ops" not in extra_info:
        return None
    try:
        problem = ArithmeticProblem(tuple(int(x) for x in extra_info["operands"]), tuple(extra_info["ops"]))
    except (TypeError, ValueError):
        return None
    step = arithmetic_first_wrong_step(problem, response_text)
    return None if step is None else (step, _step_line_span(response_text, step))


# -------------------------------------------------------------------------------------------------------- registry

ARITHMETIC = Task(
    name="arithmetic",
    extract_answer=extract_boxed_answer,
    answer_text=lambda truth: str(truth).strip(),
    equivalent=_integer_equal,
    split_steps=split_lines,
    step_separator="\n",
    first_wrong_step=arithmetic_wrong_step,
)
BOXED_MATH = Task(
    name="boxed_math",
    extract_answer=extract_boxed_answer,
    answer_text=_strip_math,
    equivalent=math_equivalent,
    split_steps=split_paragraphs,
    step_separator="\n\n",
)
PARAGRAPHS = Task(
    name="paragraphs",
    extract_answer=extract_boxed_answer,
    answer_text=_strip_math,
    equivalent=_exact,
    split_steps=split_paragraphs,
    step_separator="\n\n",
)
CODE = Task(
    name="code",
    extract_answer=extract_program,
    answer_text=lambda truth: str(truth),  # tests, not a program: read by no value source this task accepts
    equivalent=equivalent_programs,
    split_steps=split_paragraphs,
    step_separator="\n\n",
)
TASKS: dict[str, Task] = {task.name: task for task in (ARITHMETIC, BOXED_MATH, PARAGRAPHS, CODE)}


def resolve_task(spec: str) -> Task:
    """A registered task name, or ``module:attr`` naming an object with ``Task``'s attributes."""
    if spec in TASKS:
        return TASKS[spec]
    if ":" not in spec:
        raise ValueError(f"unknown task {spec!r}: use one of {sorted(TASKS)} or 'module:attr'")
    module_name, _, attr = spec.partition(":")
    try:
        task = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"task {spec!r} cannot be loaded: {error}") from error
    missing = [name for name in ("extract_answer", "answer_text", "equivalent", "split_steps", "step_separator")
               if not hasattr(task, name)]
    if missing:
        raise ValueError(f"task {spec!r} lacks {missing}")
    return task
