"""Outcome reward for the arithmetic task, in verl's custom reward signature.

Use it with ``reward.custom_reward_function.path=<this file>`` (``name`` defaults to ``compute_score``). verl loads
the file by path, so it imports nothing from this package.

An exact integer comparison rather than ``math_verify``: math_verify turns several boxed answers into a set
(``\\boxed{3} ... \\boxed{5}`` parses as ``{3, 5}``), whereas this task scores the last one, and an exact parse is
fast and deterministic.
"""

from __future__ import annotations

import re

_BOXED = "\\boxed{"
_INTEGER = re.compile(r"[+-]?\d+", re.ASCII)


def extract_boxed_answer(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (braces matched, so ``\\boxed{{1}}`` gives ``{1}``), stripped.

    None when there is no boxed expression or the last one is never closed.
    """
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, content_start = 1, start + len(_BOXED)
    for i in range(content_start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[content_start:i].strip()
    return None


def _as_integer(text: str | None) -> int | None:
    if text is None or _INTEGER.fullmatch(text.strip()) is None:
        return None
    return int(text.strip())


def compute_score(data_source, solution_str: str, ground_truth, extra_info=None, **kwargs) -> float:
    """1.0 iff the last ``\\boxed{}`` in ``solution_str`` holds the same integer as ``ground_truth``, else 0.0.

    ``data_source``, ``extra_info`` and any further keyword arguments are accepted for verl's signature and unused.
    A ground truth that is not an integer raises ValueError (a broken dataset should not train silently on zeros).
    """
    truth = _as_integer(str(ground_truth))
    if truth is None:
        raise ValueError(f"ground_truth must be an integer, got {ground_truth!r} (data_source={data_source!r})")
    answer = _as_integer(extract_boxed_answer(solution_str))
    return 1.0 if answer == truth else 0.0
