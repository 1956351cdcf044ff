"""verl parquet rows for maths problems whose solution ends in a ``\\boxed{}`` answer.

One function shared by ``recipes/paper/prepare_math_data.py`` (Hugging Face datasets on the cluster) and
``tasks/miniature.py`` (the problems shipped with the package), so both write exactly the same columns.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

import pandas as pd

from rredcot_verl.tasks.base import split_lines, split_paragraphs
from rredcot_verl.tasks.reward import extract_boxed_answer

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# GSM8K's rationale ends with "#### <answer>" and marks calculator calls as <<48/2=24>>.
_GSM8K_ANSWER = "####"
_CALCULATOR = re.compile(r"<<[^>]*>>")


def reference_steps(solution: str) -> list[str]:
    """The solution's steps as the ``boxed_math`` task cuts a trace (blank-line paragraphs), or its lines when it has
    no blank line (GSM8K writes one step per line); the reference continuation resumes the solution at a step."""
    paragraphs = split_paragraphs(solution)
    return paragraphs if len(paragraphs) > 1 else split_lines(solution)


def convert(rows: Iterable[Mapping], source: str, split: str) -> pd.DataFrame:
    """One verl row per usable input row: columns data_source, prompt, ability, reward_model, extra_info.

    ``rows`` hold ``problem`` (or ``question``), ``solution`` and optionally ``answer``; the answer defaults to the
    last boxed expression of the solution, and a GSM8K ``answer`` (rationale, then ``#### 72``) is split into the
    solution and the answer. Rows without a problem or an answer are dropped (the reward and the exit probe both need
    one). The solution is kept in ``extra_info.reference_solution`` and its steps in ``extra_info.reference_steps``
    (what the reference-continuation value source reads); ``extra_info.index`` is the row's position in ``rows``.
    """
    records = []
    for index, row in enumerate(rows):
        problem = row.get("problem") or row.get("question")
        solution = row.get("solution") or ""
        answer = row.get("answer") or extract_boxed_answer(solution)
        if answer and _GSM8K_ANSWER in str(answer):
            rationale, _, answer = str(answer).rpartition(_GSM8K_ANSWER)
            solution, answer = _CALCULATOR.sub("", rationale).strip(), answer.strip().replace(",", "")
        if not problem or not answer:
            continue
        records.append(
            {
                "data_source": source,
                "prompt": [{"role": "user", "content": f"{problem}\n{INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "reference_solution": solution,
                    "reference_steps": reference_steps(solution),
                },
            }
        )
    return pd.DataFrame(records)
