"""The arithmetic chain solved with a calculator tool: a multi-turn task for verl's tool agent loop.

A problem is the arithmetic task's chain (``tasks/arithmetic.py``, here short: 3 operands of 1..9). The model
chooses the operands of every step and calls the ``calculator`` tool once per step; the tool computes. With Qwen2.5's
tool template and verl's hermes format a solved trace is::

    user       Compute 3+4-2
    assistant  <tool_call>\\n{"name": "calculator", "arguments": {"expression": "3+4"}}\\n</tool_call>
    tool       7
    assistant  <tool_call>\\n{"name": "calculator", "arguments": {"expression": "7-2"}}\\n</tool_call>
    tool       5
    assistant  **Final Answer**\\n\\boxed{5}

The reward is on the final answer only (``tasks/reward.py``: the last ``\\boxed{}`` equals the chain's value); the
tool's own output is never boxed, so a trace that stops calling without answering scores 0. Rows are verl's agent-loop
rows (``agent_name: tool_agent``); the tool is offered through the tool config ``assets/calculator_tools.yaml``
(class ``tasks/calculator_tool.py``). ``calculator_wrong_step`` locates a trace's first wrong call for the credit
report. The miniature model that solves it is built by ``tasks/calculator_miniature.py``.
"""

from __future__ import annotations

import json
import operator
import os
import re

from rredcot_verl.tasks.arithmetic import ABILITY, ArithmeticProblem, ArithmeticTaskConfig

DATA_SOURCE = "rredcot_calculator"
AGENT_NAME = "tool_agent"  # verl's ToolAgentLoop
TOOL_NAME = "calculator"
TOOL_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "calculator_tools.yaml")
# Two steps, so every prompt has the same length and a call's operands sit at fixed offsets from it. Measured warm
# starts (calculator_miniature, two cores): with 3..4 operands the loss stayed at 0.26-0.29 for 500 steps (no copying
# learned); with 3 the loss falls from 0.26 to 0.027 by step 1,400 of 4,000 and sampled accuracy plateaus at 16-22%.
TASK_CONFIG = ArithmeticTaskConfig(min_operand=1, max_operand=9, min_operands=3, max_operands=3)
FINAL_ANSWER = "**Final Answer**\n\\boxed{{{}}}"  # the plain probe profile's exit text, then the answer

# Integers of at most 12 digits, so a call cannot ask the tool for an enormous product.
_EXPRESSION = re.compile(r"\s*(-?\d{1,12})\s*([-+*])\s*(-?\d{1,12})\s*", re.ASCII)
_OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def calculate(expression) -> int:
    """The value of ``"a op b"`` (integers, ``+``, ``-`` or ``*``, spaces allowed); ValueError on anything else."""
    match = _EXPRESSION.fullmatch(expression) if isinstance(expression, str) else None
    if match is None:
        raise ValueError(f"expected 'a+b', 'a-b' or 'a*b' with integers, got {expression!r}")
    return _OPERATORS[match[2]](int(match[1]), int(match[3]))


def step_expressions(problem: ArithmeticProblem) -> list[str]:
    """The call of each step: the previous result (the first operand at first), the step's operator and operand."""
    lefts = [problem.operands[0], *problem.running_totals()[:-1]]
    return [f"{left}{op}{b}" for left, op, b in zip(lefts, problem.ops, problem.operands[1:])]


def tool_call_text(expression: str) -> str:
    """An assistant turn calling the calculator, as Qwen2.5's template renders a tool call (hermes format)."""
    return "<tool_call>\n" + json.dumps({"name": TOOL_NAME, "arguments": {"expression": expression}}) + "\n</tool_call>"


def tool_call_message(expression: str) -> dict:
    """The assistant message of a call, as verl's tool agent loop appends it to the conversation."""
    call = {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"expression": expression}}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def reference_turns(problem: ArithmeticProblem) -> list[tuple[str, dict, str | None]]:
    """The solved trace, one entry per assistant turn: (the turn's text, its message, the tool's answer or None
    for the final turn)."""
    turns = [(tool_call_text(e), tool_call_message(e), str(calculate(e))) for e in step_expressions(problem)]
    final = FINAL_ANSWER.format(problem.answer)
    return [*turns, (final, {"role": "assistant", "content": final}, None)]


def agent_row(problem: ArithmeticProblem, split: str, index: int) -> dict:
    """One row for verl's agent loop: the user message, the ground truth, the chain and its reference calls."""
    return {
        "data_source": DATA_SOURCE,
        "agent_name": AGENT_NAME,
        "prompt": [{"role": "user", "content": problem.prompt}],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {"split": split, "index": index, "operands": list(problem.operands), "ops": list(problem.ops),
                       "expressions": step_expressions(problem)},
    }


def _called_expression(call_body: str) -> str | None:
    try:
        call = json.loads(call_body)
        expression = call["arguments"]["expression"]
    except (ValueError, TypeError, KeyError):
        return None
    return "".join(expression.split()) if isinstance(expression, str) and call.get("name") == TOOL_NAME else None


def calculator_wrong_step(extra_info, response_text: str):
    """First wrong call of a trace (1-based) and its character span, or None when every call is the reference's.

    Call k is wrong when it is missing (empty span at the end of the text), does not parse, or asks another
    expression than step k's; a call beyond the chain's steps is wrong. A wrong final answer after right calls gives
    None (the reward sees it). None too when ``extra_info`` lacks ``expressions``.
    """
    expected = extra_info.get("expressions") if isinstance(extra_info, dict) else None
    if expected is None:
        return None
    calls = list(_TOOL_CALL.finditer(response_text))
    for k, expression in enumerate(expected, start=1):
        if k > len(calls):
            return k, (len(response_text), len(response_text))
        if _called_expression(calls[k - 1][1]) != expression:
            return k, calls[k - 1].span()
    if len(calls) > len(expected):
        return len(expected) + 1, calls[len(expected)].span()
    return None
