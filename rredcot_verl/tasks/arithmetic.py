"""Chained arithmetic: the embedded default reasoning task.

A problem is a chain of 3..6 operands joined by ``+``/``-`` (2..5 steps). The prompt (the user message of a chat)
is ``Compute 23+45-17+8`` and the reference response, which starts with ``<think>``, writes one step per line::

    <think>
    23+45=68
    68-17=51
    51+8=59
    </think>
    \\boxed{59}

Intermediate results and the answer may be negative. ``first_wrong_step`` checks a sampled response line by line
against the prompt, which gives every trace a ground-truth location of its first error.

The ``items`` family (``ArithmeticTaskConfig.independent_items``, ``ItemsProblem``) asks for several independent
items at once, ``Compute each 23+45, 67-12, 31+8``, one line an item, the answer their two-digit results written one
after another (``\\boxed{685539}``): every line is a decision of its own, and from any state the answer is the lines
written so far plus the items left, each one step of work (docs/choices.md, "Items setting").
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import asdict, dataclass, replace
from typing import Callable

DATA_SOURCE = "rredcot_arithmetic"
ABILITY = "math"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
PROMPT_PREFIX = "Compute "
ITEMS_PROMPT_PREFIX = "Compute each "


def item_results(digits: int) -> tuple[int, int]:
    """The results an item may have when all have ``digits`` digits: one width, so the answer's digits say which
    item they belong to."""
    return 10 ** (digits - 1), 10 ** digits - 1


_STEP_LINE = re.compile(r"(-?\d+)([+-])(\d+)=(-?\d+)(?: ((?:[+-]\d+)+))?", re.ASCII)
_PROMPT = re.compile(r"Compute (\d+(?:[+-]\d+)+)", re.ASCII)
_TERM = re.compile(r"([+-]?)(\d+)", re.ASCII)
_ITEMS_PROMPT = re.compile(r"Compute each (\d+[+-]\d+(?:, \d+[+-]\d+)+)", re.ASCII)
_ITEM = re.compile(r"(\d+)([+-])(\d+)", re.ASCII)


@dataclass(frozen=True)
class ArithmeticTaskConfig:
    """Distribution of problems.

    Attributes:
        min_operand: smallest operand (inclusive), default 1.
        max_operand: largest operand (inclusive), default 99. The measured warm start (about 17 core-minutes of SFT
            for 30% greedy accuracy) is for 1..99; 1..9 saturates near 99%.
        min_operands: fewest operands in a chain, default 3 (2 steps).
        max_operands: most operands in a chain, default 6 (5 steps).
        restate_remaining_terms: reference step lines end with the terms still to add (``27-1=26 +8+3``), so the
            next operand is always the first term of the line above instead of the k-th term of the prompt: the
            long setting's format, which a tiny model learns by copying locally (``docs/choices.md``).
        independent_items: 0 for a chain (the default); n >= 2 for the items family (``ItemsProblem``): n items
            ``a±b`` of operands min_operand..max_operand whose results have ``item_digits`` digits; the chain
            fields ``min_operands``, ``max_operands`` and ``restate_remaining_terms`` do not apply.
        item_digits: the items family's result width, default 2; 3 makes every line a three-digit
            sum or difference, which a model trained until it answers after a forced exit still gets wrong often
            enough for a reasoning task (docs/choices.md, "Items setting").
    """

    min_operand: int = 1
    max_operand: int = 99
    min_operands: int = 3
    max_operands: int = 6
    restate_remaining_terms: bool = False
    independent_items: int = 0
    item_digits: int = 2

    def __post_init__(self) -> None:
        if self.independent_items == 1 or self.independent_items < 0:
            raise ValueError(f"independent_items must be 0 (a chain) or >= 2, got {self.independent_items}")
        if self.item_digits < 2:
            raise ValueError(f"item_digits must be >= 2, got {self.item_digits}")
        low, high = item_results(self.item_digits)
        if self.independent_items and (self.max_operand < low // 2 or self.min_operand > high):
            raise ValueError(f"independent_items needs operands that can make results in {(low, high)}, got "
                             f"min_operand={self.min_operand}, max_operand={self.max_operand}")
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError(
                f"need 0 <= min_operand <= max_operand, got min_operand={self.min_operand}, "
                f"max_operand={self.max_operand}"
            )
        if not 2 <= self.min_operands <= self.max_operands:
            raise ValueError(
                f"need 2 <= min_operands <= max_operands, got min_operands={self.min_operands}, "
                f"max_operands={self.max_operands}"
            )

    def as_dict(self) -> dict:
        """The fields, ``independent_items`` only when set and ``item_digits`` only when not 2: the committed
        artefacts' fingerprints predate them."""
        return {key: value for key, value in asdict(self).items()
                if (key != "independent_items" or value) and (key != "item_digits" or value != 2)}


@dataclass(frozen=True)
class ArithmeticProblem:
    """``operands[0] ops[0] operands[1] ops[1] ...``; ``len(ops) == len(operands) - 1``, each op is ``+`` or ``-``.

    ``restate_remaining_terms`` is the reference's line format (``ArithmeticTaskConfig``); judging accepts both.
    """

    operands: tuple[int, ...]
    ops: tuple[str, ...]
    restate_remaining_terms: bool = False

    def __post_init__(self) -> None:
        if len(self.operands) < 2 or len(self.ops) != len(self.operands) - 1:
            raise ValueError(
                f"need >= 2 operands and one op fewer, got {len(self.operands)} operands and {len(self.ops)} ops"
            )
        if any(op not in "+-" or len(op) != 1 for op in self.ops):
            raise ValueError(f"ops must each be '+' or '-', got {self.ops}")
        if any(operand < 0 for operand in self.operands):
            raise ValueError(f"operands must be non-negative, got {self.operands}")

    @property
    def num_steps(self) -> int:
        return len(self.ops)

    @property
    def expression(self) -> str:
        return str(self.operands[0]) + "".join(f"{op}{b}" for op, b in zip(self.ops, self.operands[1:]))

    @property
    def prompt(self) -> str:
        return PROMPT_PREFIX + self.expression

    def running_totals(self) -> list[int]:
        """Result after each step (``num_steps`` values; the last is the answer)."""
        totals, total = [], self.operands[0]
        for op, b in zip(self.ops, self.operands[1:]):
            total = total + b if op == "+" else total - b
            totals.append(total)
        return totals

    @property
    def answer(self) -> int:
        return self.running_totals()[-1]

    def slipped_answer(self, step: int, delta: int) -> int:
        """The answer of lines that slip by ``delta`` at ``step`` and go on from there (``slipped_steps``)."""
        return self.answer + delta


@dataclass(frozen=True)
class ItemsProblem:
    """Independent items ``operands[2i] ops[i] operands[2i+1]``, every result of one width of at least two digits
    (``ArithmeticTaskConfig.item_digits``).

    The answer is the results written one after another as one integer (items 68, 55, 39 give 685539), so the
    task's integer reward reads it and a wrong item changes exactly its own digits.
    """

    operands: tuple[int, ...]
    ops: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.ops) < 2 or len(self.operands) != 2 * len(self.ops):
            raise ValueError(f"need >= 2 items (two operands and one op each), got {len(self.operands)} operands "
                             f"and {len(self.ops)} ops")
        if any(op not in "+-" or len(op) != 1 for op in self.ops):
            raise ValueError(f"ops must each be '+' or '-', got {self.ops}")
        results = self.running_totals()
        low, high = item_results(max(len(str(results[0])), 2))
        if not all(low <= result <= high for result in results):
            raise ValueError(f"every item's result must have one width of at least two digits, got {results}")

    @property
    def num_steps(self) -> int:
        return len(self.ops)

    @property
    def items(self) -> list[str]:
        return [f"{a}{op}{b}" for a, op, b in zip(self.operands[::2], self.ops, self.operands[1::2])]

    @property
    def prompt(self) -> str:
        return ITEMS_PROMPT_PREFIX + ", ".join(self.items)

    def running_totals(self) -> list[int]:
        """Each item's result (the name the chain's shared code reads)."""
        return [a + b if op == "+" else a - b for a, op, b in zip(self.operands[::2], self.ops, self.operands[1::2])]

    @property
    def answer(self) -> int:
        return self.slipped_answer(1, 0)

    def slipped_answer(self, step: int, delta: int) -> int:
        """The answer of lines whose item ``step`` (1-based) is ``delta`` off and the rest right."""
        return int("".join(str(result + (delta if k == step else 0))
                           for k, result in enumerate(self.running_totals(), start=1)))


def make_problem(rng: random.Random, config: ArithmeticTaskConfig = ArithmeticTaskConfig()):
    """Draw one problem: operand count uniform in [min_operands, max_operands], operands and ops uniform; for the
    items family (``config.independent_items``), each item drawn uniformly until its result has
    ``config.item_digits`` digits."""
    if config.independent_items:
        low, high = item_results(config.item_digits)
        operands, ops = [], []
        while len(ops) < config.independent_items:
            a, b = rng.randint(config.min_operand, config.max_operand), rng.randint(config.min_operand,
                                                                                      config.max_operand)
            op = rng.choice("+-")
            if low <= (a + b if op == "+" else a - b) <= high:
                operands += [a, b]
                ops.append(op)
        return ItemsProblem(tuple(operands), tuple(ops))
    n = rng.randint(config.min_operands, config.max_operands)
    operands = tuple(rng.randint(config.min_operand, config.max_operand) for _ in range(n))
    ops = tuple(rng.choice("+-") for _ in range(n - 1))
    return ArithmeticProblem(operands, ops, config.restate_remaining_terms)


def parse_prompt(prompt: str):
    """Inverse of ``ArithmeticProblem.prompt`` and ``ItemsProblem.prompt``; raises ValueError on any other text."""
    items = _ITEMS_PROMPT.fullmatch(prompt.strip())
    if items is not None:
        parsed = _ITEM.findall(items.group(1))
        return ItemsProblem(tuple(int(x) for a, _, b in parsed for x in (a, b)), tuple(op for _, op, _ in parsed))
    match = _PROMPT.fullmatch(prompt.strip())
    if match is None:
        raise ValueError(f"not an arithmetic prompt of the form 'Compute 23+45-17': {prompt!r}")
    terms = _TERM.findall(match.group(1))
    return ArithmeticProblem(tuple(int(digits) for _, digits in terms), tuple(sign for sign, _ in terms[1:]))


def problem_from_reference(prompt: str, reference_steps: list[str]):
    """The problem of a dataset row: the prompt does not say whether chain lines restate the terms left; the
    reference's first line does (a space before the terms), and the problem keeps it, so that text written from it
    (``reference_steps``, exit examples) is the build's format."""
    problem = parse_prompt(prompt)
    if isinstance(problem, ItemsProblem):
        return problem
    return replace(problem, restate_remaining_terms=len(reference_steps) > 1 and " " in reference_steps[0])


def problem_from_extra_info(extra_info: dict):
    """The problem of a row's ``extra_info`` (``operands``, ``ops``; ``independent_items`` for the items family)."""
    operands, ops = tuple(int(x) for x in extra_info["operands"]), tuple(extra_info["ops"])
    return ItemsProblem(operands, ops) if extra_info.get("independent_items") else ArithmeticProblem(operands, ops)


def remaining_terms(problem: ArithmeticProblem, step: int) -> str:
    """The terms after 1-based ``step``, signs included (``-1+8+3``); empty after the last step."""
    return "".join(f"{op}{b}" for op, b in zip(problem.ops[step:], problem.operands[step + 1:]))


def reference_steps(problem: ArithmeticProblem) -> list[str]:
    """One line per step, e.g. ``['23+45=68', '68-17=51', '51+8=59']``; with ``restate_remaining_terms`` each line
    but the last ends with the terms still to add: ``['23+45=68 -17+8', '68-17=51 +8', '51+8=59']``."""
    return slipped_steps(problem, 1, 0)


def slipped_steps(problem: ArithmeticProblem, step: int, delta: int) -> list[str]:
    """The reference lines with one slip: line ``step`` (1-based) writes its result ``delta`` off, and every later
    line goes on from the wrong total, as a sampled trace does after a slip (``['23+45=78', '78-17=61', '61+8=69']``
    for step 1, delta 10). Every line after ``step`` is right given the line above; the answer they reach is
    ``problem.answer + delta``. ``delta`` 0 gives the reference."""
    if not 1 <= step <= problem.num_steps:
        raise ValueError(f"step must be in 1..{problem.num_steps}, got {step}")
    if isinstance(problem, ItemsProblem):
        return [f"{item}={result + (delta if k == step else 0)}"
                for k, (item, result) in enumerate(zip(problem.items, problem.running_totals()), start=1)]
    lines, left = [], problem.operands[0]
    for k, (op, b, total) in enumerate(zip(problem.ops, problem.operands[1:], problem.running_totals()), start=1):
        total += delta if k >= step else 0
        tail = remaining_terms(problem, k) if problem.restate_remaining_terms else ""
        lines.append(f"{left}{op}{b}={total}" + (f" {tail}" if tail else ""))
        left = total
    return lines


def format_response(steps: list[str], answer: int | str) -> str:
    """The response layout shared by references and cut traces: think block, then the boxed answer."""
    return THINK_OPEN + "\n" + "".join(line + "\n" for line in steps) + THINK_CLOSE + "\n\\boxed{" + f"{answer}" + "}"


def reference_response(problem: ArithmeticProblem) -> str:
    return format_response(reference_steps(problem), problem.answer)


def response_step_lines(response_text: str) -> list[str] | None:
    """Non-empty, stripped lines of the think block; None when there is no ``<think>``.

    A response cut off before ``</think>`` (truncated by the length limit) yields the lines written so far,
    so its last, partial line is judged like any other.
    """
    start = response_text.find(THINK_OPEN)
    if start < 0:
        return None
    body = response_text[start + len(THINK_OPEN):]
    end = body.find(THINK_CLOSE)
    if end >= 0:
        body = body[:end]
    return [line.strip() for line in body.split("\n") if line.strip()]


def first_wrong_step(problem: ArithmeticProblem, response_text: str) -> int | None:
    """1-based index of the first step line that is wrong; None when every step is right.

    Step line k (k-th non-empty line of the think block) is wrong when it does not parse as ``a±b=c``, when
    ``c != a±b``, when ``a`` is not the previous result (the first operand for k=1), when ``±b`` is not the
    prompt's k-th term, or when the line restates the remaining terms (``a±b=c ±d±e``) and gets them wrong: a dropped
    term is the error of the line that dropped it, not of the next. Lines without the restatement are judged by
    their step alone, so both formats are judged alike. A trace that writes fewer lines than the problem has steps is wrong at the first missing
    step; one that writes more is wrong at the first extra line. A response without ``<think>`` is wrong at step 1.
    Only the think block is judged: a wrong ``\\boxed{}`` after all-correct steps gives None (the reward sees it).
    """
    lines = response_step_lines(response_text)
    if lines is None:
        return 1
    if isinstance(problem, ItemsProblem):
        return _first_wrong_item(problem, lines)
    expected_left = problem.operands[0]
    for k, (op, b) in enumerate(zip(problem.ops, problem.operands[1:]), start=1):
        if k > len(lines):
            return k
        match = _STEP_LINE.fullmatch(lines[k - 1])
        if match is None:
            return k
        left, line_op, right, result = int(match[1]), match[2], int(match[3]), int(match[4])
        true_result = left + right if line_op == "+" else left - right
        if left != expected_left or line_op != op or right != b or result != true_result:
            return k
        if match[5] is not None and match[5] != remaining_terms(problem, k):
            return k
        expected_left = result
    if len(lines) > problem.num_steps:
        return problem.num_steps + 1
    return None


def _first_wrong_item(problem: ItemsProblem, lines: list[str]) -> int | None:
    """Line k must be item k with its result: ``a±b=c``."""
    for k, (item, result) in enumerate(zip(problem.items, problem.running_totals()), start=1):
        if k > len(lines) or lines[k - 1] != f"{item}={result}":
            return k
    return problem.num_steps + 1 if len(lines) > problem.num_steps else None


def _row(problem: ArithmeticProblem, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem.prompt}],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {
            "split": split,
            "index": index,
            "operands": list(problem.operands),
            "ops": list(problem.ops),
            **({"independent_items": True} if isinstance(problem, ItemsProblem) else {}),
            "reference_steps": reference_steps(problem),
            "reference_response": reference_response(problem),
        },
    }


def write_parquet(
    out_dir: str,
    n_train: int,
    n_val: int,
    seed: int,
    config: ArithmeticTaskConfig = ArithmeticTaskConfig(),
    row: Callable[[ArithmeticProblem, str, int], dict] | None = None,
) -> tuple[str, str]:
    """Write ``out_dir/train.parquet`` and ``out_dir/val.parquet`` in verl's RL dataset format.

    Each split draws from its own stream (``random.Random(f"{split}:{seed}")``), so validation problems are
    independent of the training ones for every seed. ``row(problem, split, index)`` writes one row (default: this
    task's single-turn rows). Returns the two paths.
    """
    import pandas as pd

    if n_train < 1 or n_val < 1:
        raise ValueError(f"n_train and n_val must be >= 1, got n_train={n_train}, n_val={n_val}")
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for split, n in (("train", n_train), ("val", n_val)):
        rng = random.Random(f"{split}:{seed}")
        rows = [(row or _row)(make_problem(rng, config), split, i) for i in range(n)]
        path = os.path.join(out_dir, f"{split}.parquet")
        pd.DataFrame(rows).to_parquet(path, index=False)
        paths.append(path)
    return paths[0], paths[1]
