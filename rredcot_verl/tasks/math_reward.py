"""Outcome reward for competition maths (Numina-CoT, open-rs) with math-verify, in verl's custom reward signature.

Name it by module, ``reward.custom_reward_function.path=pkg://rredcot_verl.tasks.math_reward``, so that reward workers
on every node import it from the installed package. The answer is the last ``\\boxed{}`` of the response; it is
compared with the ground truth by the ``boxed_math`` task's equivalence (math-verify: 1/2 = 0.5 = \\frac{1}{2}, ...),
which is safe in verl's reward workers: they call it outside the main thread, where math-verify's default SIGALRM
timeout raises. A response without a boxed answer, or one math-verify cannot parse, scores 0.
"""

from __future__ import annotations

from rredcot_verl.tasks.base import BOXED_MATH


def compute_score(data_source, solution_str: str, ground_truth, extra_info=None, **kwargs) -> float:
    """1.0 iff the last ``\\boxed{}`` of ``solution_str`` is mathematically equal to ``ground_truth``.

    ``ground_truth`` may be the bare answer or a text with a ``\\boxed{}``; the other arguments are verl's signature.
    """
    answer = BOXED_MATH.extract_answer(solution_str)
    if answer is None:
        return 0.0
    return 1.0 if BOXED_MATH.equivalent(BOXED_MATH.answer_text(ground_truth), answer) else 0.0
