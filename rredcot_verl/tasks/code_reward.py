"""Outcome reward for Python code tasks, in verl's custom reward signature; the program runs in ``tasks/sandbox.py``.

Name it by module, ``reward.custom_reward_function.path=pkg://rredcot_verl.tasks.code_reward``. The program is the
last ```` ```python ```` block of the response; it is executed only in the sandbox (a separate, resource-limited
process per run), never in the trainer's process. This is the CPU default that needs no service; on a cluster, verl's
sandbox-fusion reward (``verl.utils.reward_score.sandbox_fusion``) reads the same ground truth.

Ground truth (a JSON string or a dict), the conventions of verl's ``prime_code`` and sandbox-fusion rewards:

- ``{"inputs": [...], "outputs": [...]}``: standard input / expected standard output per case (compared line by
  line, surrounding whitespace ignored);
- ``{"inputs": [...], "outputs": [...], "fn_name": "f"}``: a call per case, ``f(*args)`` (or ``Solution().f`` when the
  program defines no ``f``), where ``inputs[i]`` is a list of arguments or, as in prime_code, a string of one JSON
  value per line, and ``outputs[i]`` the expected value or its JSON text (a value wrapped in a one-element list also
  matches, the APPS convention);
- ``{"assert_case": ["assert f(1) == 2", ...]}``: each assert statement, run after the program, is a case.

Score: all or nothing, 1.0 iff every case passes (prime_code's default). The package counts a trace as correct only at
the top of ``reward_range`` (IBPO's verified repairs, the value bank), so partial credit would make a program that
fails a test neither correct nor a plain failure; and a fraction rewards programs that special-case the easy tests.
A response without a python block, or one that fails, times out or exhausts a limit, scores 0.0. A ground truth
without cases raises ValueError: a broken dataset should not train silently on zeros.
"""

from __future__ import annotations

import json

from rredcot_verl.tasks.code import extract_program
from rredcot_verl.tasks.sandbox import CodeTests, SandboxLimits, run_tests

LIMITS = SandboxLimits()


def _json_value(value):
    return json.loads(value) if isinstance(value, str) else value


def parse_tests(ground_truth) -> CodeTests:
    """``CodeTests`` from a ground truth in one of the module docstring's forms."""
    spec = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if not isinstance(spec, dict):
        raise ValueError(f"code ground truth must be a JSON object, got {type(spec).__name__}")
    if spec.get("assert_case"):
        return CodeTests("assert", tuple(str(case) for case in spec["assert_case"]))
    inputs, outputs = spec.get("inputs") or [], spec.get("outputs") or []
    if len(inputs) != len(outputs) or not inputs:
        raise ValueError(f"code ground truth needs as many inputs as outputs, at least one ({len(inputs)}, {len(outputs)})")
    if spec.get("fn_name"):
        cases = []
        for args, expected in zip(inputs, outputs):
            if isinstance(args, str):
                args = [json.loads(line) for line in args.split("\n") if line.strip()]
            cases.append((list(args), _json_value(expected)))
        return CodeTests("call", tuple(cases), str(spec["fn_name"]))
    return CodeTests("stdin", tuple((str(i), str(o)) for i, o in zip(inputs, outputs)))


def compute_score(data_source, solution_str: str, ground_truth, extra_info=None, **kwargs) -> float:
    """1.0 iff the response's last python block passes every test case of ``ground_truth`` in the sandbox, else 0.0.

    ``data_source``, ``extra_info`` and any further keyword arguments are accepted for verl's signature and unused.
    """
    tests = parse_tests(ground_truth)
    if not tests.cases:
        raise ValueError(f"code ground truth has no test cases (data_source={data_source!r})")
    program = extract_program(solution_str)
    if program is None:
        return 0.0
    return 1.0 if run_tests(program, tests, LIMITS, stop_at_first_failure=True).all_passed else 0.0
