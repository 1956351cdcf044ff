"""Outcome reward for competition maths (Numina-CoT, open-rs) with math-verify, in verl's custom reward signature.

Use with ``reward.custom_reward_function.path=<this file>``. The answer is the last ``\\boxed{}`` of the response;
it is compared with the ground truth by ``math_verify`` (symbolic equivalence: 1/2 = 0.5, \\frac{1}{2}, ...).
A response without a boxed answer, or one math-verify cannot parse, scores 0.
"""

from __future__ import annotations

from math_verify import parse, verify


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 1, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start : i + 1]
    return None


def compute_score(data_source, solution_str: str, ground_truth, extra_info=None, **kwargs) -> float:
    """1.0 iff the last ``\\boxed{}`` of ``solution_str`` is mathematically equal to ``ground_truth``."""
    boxed = _last_boxed(solution_str)
    if boxed is None:
        return 0.0
    truth = str(ground_truth)
    gold = parse(truth if "\\boxed" in truth else f"\\boxed{{{truth}}}")
    answer = parse(boxed)
    if not gold or not answer:
        return 0.0
    return 1.0 if verify(gold, answer) else 0.0
