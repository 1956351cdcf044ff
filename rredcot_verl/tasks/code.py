"""The ``code`` task: answers are Python programs judged by tests (``tasks/code_reward.py``), not answer strings.

- Answer: the program in the response's last ```` ```python ```` fenced block (stripped), as verl's ``prime_code``
  reward reads it.
- Steps: blank-line separated blocks of the text (reasoning paragraphs, and in a program its functions and
  statement groups), separator ``"\\n\\n"``: a line of code is too small a step, and blocks are where a program
  reads as stages.
- Equivalence: the same program after normalisation, i.e. the same syntax tree (``ast.unparse(ast.parse(...))``:
  comments, blank lines, spacing and quote style ignored); a text that does not parse is compared with its
  whitespace collapsed. Two different programs that pass the same tests are not equivalent: whether they behave the
  same is undecidable, and only the tests judge a program.
- The dataset's ground truth is tests, not a program: ``answer_text`` returns it unchanged, and no value source this
  task accepts reads it.

Value sources (``code_task_refusal``): the exit probe scores the probability of one answer string after a forced
exit from thinking; a program judged by tests has no such string (two programs that pass are rarely the same text),
so for ``task: code`` the exit probe is refused, and the reference continuation with it (its probe text ends in the
profile's boxed answer, and it resumes a bank entry at the prefix's step index, which does not align two programs).
``segment_mc`` (Monte-Carlo continuations judged by the same reward), ``ibpo`` (repairs judged by the same reward)
and the ``own_continuation`` baseline apply.

This module imports nothing from the package, so that ``base.py`` and ``code_reward.py`` can both use it.
"""

from __future__ import annotations

import ast
import re

_FENCE = re.compile(r"```python[^\n]*\n(.*?)```", re.DOTALL)
# Estimators that run the value pass and read algorithm.rredcot.probe.value_source.
VALUE_PASS_ESTIMATORS = ("rredcot", "rredcot_ibpo")
REFUSED_VALUE_SOURCES = ("exit_probe", "reference_continuation")


def extract_program(text: str) -> str | None:
    """The content of the last ```` ```python ```` block closed by ```` ``` ````, stripped; None without one."""
    blocks = _FENCE.findall(text)
    return blocks[-1].strip() if blocks else None


def normalise_program(text: str) -> str:
    """The program as its syntax tree prints it; a text that does not parse, with its whitespace collapsed. Parsing
    only: nothing is executed."""
    try:
        return ast.unparse(ast.parse(text))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return " ".join(text.split())


def equivalent_programs(a: str, b: str) -> bool:
    return normalise_program(a) == normalise_program(b)


def code_task_refusal(settings, estimator: str | None = None) -> str | None:
    """The one-line launch refusal for ``algorithm.rredcot.task=code`` with a value source that has no meaning for
    programs, else None.

    ``settings``: ``algorithm.rredcot`` (``core.settings.RRedCoTSettings``); ``estimator``: ``algorithm.adv_estimator``.
    Only ``rredcot`` and ``rredcot_ibpo`` read ``probe.value_source``; without ``estimator`` the check assumes one of
    them, so a caller that knows the estimator should pass it (``ibpo`` and ``segment_mc`` are never refused).
    """
    if settings.task != "code" or (estimator is not None and estimator not in VALUE_PASS_ESTIMATORS):
        return None
    source = settings.probe.value_source
    if source not in REFUSED_VALUE_SOURCES:
        return None
    return (
        f"algorithm.rredcot.probe.value_source={source} has no meaning for algorithm.rredcot.task=code (a program is "
        "judged by tests, not by the probability of one answer text): use algorithm.adv_estimator=segment_mc or ibpo, "
        "or probe.value_source=own_continuation"
    )
