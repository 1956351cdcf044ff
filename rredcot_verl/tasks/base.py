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
- ``answer_style``: how the answer is written, ``boxed`` (``\\boxed{42}``) or ``gsm8k`` (a last line ``#### 42``);
  the probe profile's exit text and answer closings follow it (``core/profiles.py``).
- ``dataset_steps(extra_info)`` (optional): reference steps from a row's own fields where it has no
  ``extra_info.reference_steps`` (``gsm8k``: the rationale verl's rows keep in ``extra_info.answer``).

Registered names (``TASKS``): ``arithmetic`` (the embedded task, one step per line, integer answers), ``boxed_math``
(competition maths: math-verify equivalence, blank-line separated paragraphs), ``paragraphs`` (exact answers,
paragraphs), ``gsm8k`` (verl's GSM8K format: the answer after ``####`` read as verl's rule reward reads it, one step
per line), ``code`` (Python programs judged by tests: ``tasks/code.py``, which also says which value sources it
refuses), ``calculator`` (the arithmetic chain solved with a calculator tool over several turns:
``tasks/calculator.py``). ``resolve_task`` also accepts ``module:attr``.

``check_task_reads_answers`` / ``check_dataset_rows``: whether a task can read the answers of a dataset at all (its
ground truths, its reference solutions, the answer format its prompts ask for), for the launcher to refuse a task
that would read nothing (``boxed_math`` on verl's GSM8K rows finds no ``\\boxed`` in any response).
"""

from __future__ import annotations

import importlib
import re
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

from rredcot_verl.tasks.arithmetic import THINK_CLOSE, THINK_OPEN, problem_from_extra_info
from rredcot_verl.tasks.arithmetic import first_wrong_step as arithmetic_first_wrong_step
from rredcot_verl.tasks.calculator import calculator_wrong_step
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
    answer_style: str = "boxed"
    dataset_steps: Callable[[Any], list[str] | None] | None = None

    def __post_init__(self) -> None:
        if not self.step_separator or self.step_separator.strip():
            raise ValueError(f"task {self.name!r}: step_separator must be non-empty whitespace, got {self.step_separator!r}")
        if self.answer_style not in ANSWER_FORMATS:
            raise ValueError(f"task {self.name!r}: answer_style must be one of {sorted(ANSWER_FORMATS)}, "
                             f"got {self.answer_style!r}")


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


# ------------------------------------------------------------------------------------------------------- gsm8k

# verl's utils/reward_score/gsm8k.py (strict method), restated because the tasks import without verl: the last
# "#### <number>" of the response's last 300 characters; the reward compares it, commas and "$" removed, with the
# ground truth as strings. tests/test_nonthinking_on_cpu.py checks the two agree.
_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
_GSM8K_CLIP_CHARS = 300
_CALCULATOR = re.compile(r"<<[^>]*>>")


def extract_gsm8k_answer(text: str) -> str | None:
    """The number after the last ``#### `` as the response wrote it (commas kept: the probe scores the written
    text), or None; read from the last 300 characters, as verl's reward reads it."""
    found = _GSM8K_ANSWER.findall(str(text)[-_GSM8K_CLIP_CHARS:])
    return found[-1] if found else None


def _gsm8k_normal(answer: str) -> str:
    return str(answer).strip().replace(",", "").replace("$", "")


def gsm8k_equivalent(a: str, b: str) -> bool:
    """Equal as verl's GSM8K reward compares them (strings, commas and ``$`` removed): ``42.0`` and ``42`` are not,
    because that reward scores one of them 0 (an answer is a correct candidate only if it is rewarded as one)."""
    return _gsm8k_normal(a) == _gsm8k_normal(b)


def _gsm8k_truth(ground_truth: str) -> str:
    text = str(ground_truth).strip()
    return extract_gsm8k_answer(text) or text


def gsm8k_solution_steps(answer: str) -> list[str]:
    """The steps of a GSM8K reference answer (``extra_info.answer`` in verl's rows): its rationale lines, calculator
    annotations ``<<48/2=24>>`` and the ``#### 72`` line removed."""
    rationale = str(answer).rpartition("####")[0] if "####" in str(answer) else str(answer)
    return split_lines(_CALCULATOR.sub("", rationale))


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
        problem = problem_from_extra_info(extra_info)
    except (TypeError, ValueError):
        return None
    return arithmetic_wrong_span(problem, response_text)


def arithmetic_wrong_span(problem, response_text: str) -> StepSpan | None:
    """First wrong step line of a response to ``problem`` (an arithmetic or items problem) and its character span;
    None when all steps are right."""
    step = arithmetic_first_wrong_step(problem, response_text)
    return None if step is None else (step, _step_line_span(response_text, step))


# ------------------------------------------------------------------------------------------------ answer formats

# How each answer style writes an answer, and the text a prompt names when it asks for that style.
ANSWER_FORMATS = {"boxed": "\\boxed{{{}}}", "gsm8k": "#### {}"}
_PROMPT_MARKERS = {"boxed": "boxed", "gsm8k": "####"}

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
def _gsm8k_rationale_steps(extra_info: Any) -> list[str] | None:
    """verl's GSM8K rows keep the worked rationale (``... #### 72``) in ``extra_info.answer``."""
    answer = extra_info.get("answer") if isinstance(extra_info, dict) else None
    return gsm8k_solution_steps(answer) or None if isinstance(answer, str) else None


GSM8K = Task(
    name="gsm8k",
    extract_answer=extract_gsm8k_answer,
    answer_text=_gsm8k_truth,
    equivalent=gsm8k_equivalent,
    split_steps=split_lines,
    step_separator="\n",
    answer_style="gsm8k",
    dataset_steps=_gsm8k_rationale_steps,
)
CODE = Task(
    name="code",
    extract_answer=extract_program,
    answer_text=lambda truth: str(truth),  # tests, not a program: read by no value source this task accepts
    equivalent=equivalent_programs,
    split_steps=split_paragraphs,
    step_separator="\n\n",
)
# The arithmetic chain solved with a calculator tool (tasks/calculator.py): its answers read as the arithmetic task's
# (a boxed integer); its steps are the tool calls, one per assistant turn, not the lines of a thinking block.
CALCULATOR = replace(ARITHMETIC, name="calculator", first_wrong_step=calculator_wrong_step)
TASKS: dict[str, Task] = {task.name: task for task in (ARITHMETIC, BOXED_MATH, PARAGRAPHS, GSM8K, CODE, CALCULATOR)}


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


# ------------------------------------------------------------------------------------------------- dataset check


def _reads_any(task, solutions: Sequence[str]) -> bool:
    return any(_safe(task.extract_answer, solution) is not None for solution in solutions)


def _safe(function, *args):
    try:
        return function(*args)
    except Exception:  # noqa: BLE001 - a parser that fails on a row reads nothing from it
        return None


def _short(text: str, width: int = 80) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else "..." + text[-width:]


def check_task_reads_answers(
    task: Task | str,
    ground_truths: Sequence[Any],
    solutions: Sequence[str | None] = (),
    prompts: Sequence[str | None] = (),
    key: str = "algorithm.rredcot.task",
) -> str | None:
    """A one-line problem when ``task`` can read no answer of a dataset sample, else None.

    Refused when, over the sampled rows: (1) among the reference solutions that hold an answer in some known format
    (a solution stripped of its answer, as ``math_data.convert`` writes GSM8K's, is not counted), the task reads none;
    (2) every prompt that names an answer format (``####``, ``boxed``) names another style than the task's, so the
    model is asked to answer in a form the task does not read; (3) no ground truth, written in the task's own answer
    format, reads back as an equivalent answer. Each check is skipped where its inputs are missing or the task (a
    ``module:attr`` object) declares no ``answer_style``.

    Args:
        task: a ``Task``, a registered name or ``module:attr``.
        ground_truths: ``reward_model.ground_truth`` of the sampled rows.
        solutions: reference solutions carrying the final answer: ``extra_info.answer`` (verl's GSM8K rows) or
            ``extra_info.reference_solution`` (``tasks/math_data.convert``); None or empty where a row has none.
        prompts: the text of each row's last user message (``prompt[-1]["content"]``).
        key: the setting named in the message.
    """
    task = resolve_task(task) if isinstance(task, str) else task
    name = getattr(task, "name", None) or "the task"
    style = getattr(task, "answer_style", None)
    others = {n: t for n, t in TASKS.items() if t is not task}
    with_answer = [s for s in solutions if s and any(_reads_any(t, [s]) for t in TASKS.values())]
    if with_answer and not _reads_any(task, with_answer):
        readers = sorted(n for n, t in others.items() if _reads_any(t, with_answer))
        return (f"{key}={name} reads no answer from any of the {len(with_answer)} sampled reference solutions "
                f"(e.g. {_short(with_answer[0])!r}); "
                + (f"task {' or '.join(readers)} reads them" if readers else "choose a task that reads them"))
    if style in _PROMPT_MARKERS:
        named = [{s for s, marker in _PROMPT_MARKERS.items() if marker in p} for p in prompts if p]
        named = [styles for styles in named if styles]
        if named and all(style not in styles for styles in named):
            wanted = sorted(set().union(*named))
            readers = sorted(n for n, t in TASKS.items() if getattr(t, "answer_style", None) in wanted)
            return (f"{key}={name} reads {style} answers but the sampled prompts ask for {' / '.join(wanted)} "
                    f"answers (e.g. {_short(next(p for p in prompts if p))!r}); use task {' or '.join(readers)}")
    truths = [t for t in ground_truths if t is not None and str(t).strip()]
    if style in ANSWER_FORMATS and truths:
        def reads_back(truth) -> bool:
            answer = _safe(task.answer_text, str(truth))
            read = _safe(task.extract_answer, ANSWER_FORMATS[style].format(answer)) if answer else None
            return read is not None and bool(_safe(task.equivalent, read, answer))

        if not any(reads_back(t) for t in truths):
            return (f"{key}={name} cannot read any of the {len(truths)} sampled ground truths written as its "
                    f"{style} answers (e.g. {_short(truths[0])!r})")
    return None


def _get(mapping: Any, name: str) -> Any:
    try:
        return mapping.get(name) if mapping is not None else None
    except AttributeError:
        return None


def worked_solution(task: Task | str, extra_info: Any) -> list[str] | None:
    """The worked solution the reference continuation reads for a dataset row, as steps: ``extra_info.reference_steps``,
    else the task's ``dataset_steps`` (verl's GSM8K rationale in ``extra_info.answer``); None (or empty: None) when
    the row has none."""
    task = resolve_task(task) if isinstance(task, str) else task
    steps = _get(extra_info, "reference_steps")
    if steps is None and getattr(task, "dataset_steps", None) is not None:
        steps = _safe(task.dataset_steps, extra_info)
    steps = [str(step) for step in steps if str(step).strip()] if steps is not None else []
    return steps or None


def check_dataset_rows(task: Task | str, rows: Iterable[Mapping], key: str = "algorithm.rredcot.task") -> str | None:
    """``check_task_reads_answers`` on verl dataset rows (dicts with ``prompt``, ``reward_model.ground_truth`` and
    ``extra_info.answer`` or ``extra_info.reference_solution``, as a parquet row reads back)."""
    truths, solutions, prompts = [], [], []
    for row in rows:
        truths.append(_get(_get(row, "reward_model"), "ground_truth"))
        extra = _get(row, "extra_info")
        solutions.append(_get(extra, "answer") or _get(extra, "reference_solution"))
        messages = _get(row, "prompt")
        contents = [_get(m, "content") for m in (list(messages) if messages is not None else [])
                    if _get(m, "role") == "user"]
        prompts.append(contents[-1] if contents else None)
    return check_task_reads_answers(task, truths, solutions, prompts, key)
