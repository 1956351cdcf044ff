"""The calculator tool for verl's tool agent loop (``assets/calculator_tools.yaml`` names this class).

Kept apart from ``tasks/calculator.py`` because it subclasses verl's ``BaseTool``: the task's problems, rows and reward
import without verl."""

from __future__ import annotations

from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

from rredcot_verl.tasks.calculator import calculate


class CalculatorTool(BaseTool):
    """Evaluates ``{"expression": "a op b"}`` (integers, ``+ - *``); a malformed call gets an error text back, as a
    tool answers a wrong call, and no reward (the task is judged on the final answer only)."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        try:
            return ToolResponse(text=str(calculate(parameters.get("expression")))), 0.0, {"valid_call": 1.0}
        except ValueError as error:
            return ToolResponse(text=f"error: {error}"), 0.0, {"valid_call": 0.0}
