"""The calculator task trained through verl's real tool agent loop: ``ToolAgentLoop`` with the hermes parser calls
the task's calculator tool between the turns that vLLM generates, for ``grpo`` and ``rredcot`` (one segment per
assistant turn, exit-probe values).

The launch is a user's (``python -m rredcot_verl.main`` on ``recipes/tiny_cpu/calculator.yaml``) on the calculator
miniature (``tasks/calculator_miniature.py``: a tiny Qwen2.5-style model warm-started to call the tool once per step).
Read from verl's rollout dump: the tool answered the model's calls (every answer is the calculator's value of the call
before it), responses take several turns, verl's rule judged the boxed answers, groups mix right and wrong traces.
From our snapshots: zero advantage on every token the model did not write (tool answers, template tokens, padding)
and, for rredcot, a segment boundary with a finite probe value at every assistant-turn start. From the step metrics: no failed group or missing
trace, and rredcot's fallbacks by reason, none for NaN values or missing segments.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from miniature_launch import launch_and_read
from rredcot_verl.tasks.calculator import calculate
from rredcot_verl.tasks.reward import compute_score

STEPS = 2
ROOT = Path(__file__).resolve().parents[1]
# A call and the tool's answer as verl's dump decodes them (special tokens skipped: the tool turn's header is "user").
CALL_AND_ANSWER = re.compile(r"<tool_call>(.*?)</tool_call>\s*user\s*<tool_response>\n(.*?)\n</tool_response>",
                             re.DOTALL)


@pytest.fixture(scope="module")
def calculator_build(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("calculator_miniature")
    subprocess.run([sys.executable, "-m", "rredcot_verl.tasks.build", "--setting", "calculator", "--out", str(out)], check=True,
                   capture_output=True, timeout=900)
    return out


def model_positions(tokens: list[str]) -> list[bool]:
    """Whether each response token (decoded one by one, special tokens kept) is the model's: assistant turns run
    from the response start, or from an ``<|im_start|>assistant\\n`` header, to their ``<|im_end|>`` inclusive."""
    written, in_turn, header = [], True, None
    for token in tokens:
        if in_turn:
            written.append(True)
            in_turn = token != "<|im_end|>"
            continue
        written.append(False)
        if token == "<|im_start|>":
            header = ""
        elif header is not None:
            header += token
            if header == "assistant\n":
                in_turn, header = True, None
            elif not "assistant\n".startswith(header):
                header = None
    return written


def test_model_positions_follow_the_turns():
    tokens = ["<tool_call>", "x", "</tool_call>", "<|im_end|>", "\n", "<|im_start|>", "user", "\n", "<tool_response>",
              "7", "</tool_response>", "<|im_end|>", "\n", "<|im_start|>", "assistant", "\n", "**", "<|im_end|>",
              "<|endoftext|>"]
    assert model_positions(tokens) == [True] * 4 + [False] * 12 + [True] * 2 + [False]


@pytest.mark.e2e
@pytest.mark.launch_group("calculator")
@pytest.mark.parametrize("estimator", ["grpo", "rredcot"])
def test_tool_agent_loop_trains_the_calculator_task(calculator_build, tmp_path, estimator):
    out = tmp_path / "run"
    out.mkdir()
    env = {**os.environ, "RREDCOT_BUILD": str(calculator_build), "VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl")}
    env.pop("RAY_ADDRESS", None)
    overrides = [f"algorithm.adv_estimator={estimator}", f"trainer.total_training_steps={STEPS}",
                 f"trainer.rollout_data_dir={out / 'rollouts'}", f"algorithm.rredcot.snapshot_dir={out / 'snapshots'}"]
    _, rows = launch_and_read(ROOT / "recipes" / "tiny_cpu", "calculator", overrides, env, tmp_path, out, STEPS,
                              ("actor/grad_norm", "actor/pg_loss", "critic/advantages/mean", "critic/advantages/max",
                               "critic/advantages/min"))  # fmt: skip

    # verl's rollout dump: the tool answered every call it received, with the calculator's value; traces take turns.
    dumped = [json.loads(line) for path in sorted((out / "rollouts").glob("*.jsonl"))
              for line in path.read_text().splitlines()]
    assert len(dumped) == STEPS * 4 * 4
    answered = []
    for row in dumped:
        pairs = CALL_AND_ANSWER.findall(row["output"])
        for call, answer in pairs:
            try:
                expected = str(calculate(json.loads(call)["arguments"]["expression"]))
            except (ValueError, KeyError, TypeError):
                expected = None  # a malformed call: the tool (or verl) answers with an error text
            assert answer == expected if expected is not None else not re.fullmatch(r"-?\d+", answer), (call, answer)
        answered.append(len(pairs))
        assert row["score"] == compute_score(None, row["output"], row["gts"]), row["output"]
    print(f"{estimator}: tool answers per trace {answered}; scores {[row['score'] for row in dumped]}")
    assert sum(n >= 2 for n in answered) >= len(dumped) // 2, answered  # multi-turn: two calls or more
    assert 0 < sum(row["score"] for row in dumped) < len(dumped)  # right and wrong traces

    # Our snapshots: the model's tokens only are credited; rredcot values every assistant-turn start.
    snapshots = sorted((out / "snapshots").glob("step_*.json"))
    assert len(snapshots) == STEPS
    credited = 0
    for snapshot in snapshots:
        for trace in json.loads(snapshot.read_text())["traces"]:
            written = model_positions(trace["response_tokens"])
            advantages = trace["token_advantages"]
            assert all(a == 0.0 for a, mine in zip(advantages, written) if not mine), trace["response"]
            credited += any(a != 0.0 for a in advantages)
            if estimator != "rredcot":
                continue
            ends = [e for e in trace["seg_ends"] if e >= 0]
            starts = [i for i in range(1, len(written)) if written[i] and not written[i - 1]]
            assert starts and set(starts) <= set(ends), (starts, ends)  # a segment ends where each later turn starts
            # The probe value before each turn (column j is the state after segment j), also in groups that fall back
            # (their mapped values are not needed and stay empty).
            raw = trace["seg_raw_values"]
            assert all(math.isfinite(raw[j]) for j in [0, *(ends.index(s) + 1 for s in starts)]), (starts, ends, raw)
    assert credited > 0
    if estimator == "rredcot":
        for row in rows:
            fallbacks = {k: row[k] for k in row if k.startswith("rredcot/fallback/")}
            print("fallbacks by reason:", fallbacks, "probes per trace:", row["rredcot/probes_per_trace"])
            assert fallbacks and fallbacks["rredcot/fallback/nonfinite"] == 0, fallbacks
            assert fallbacks["rredcot/fallback/missing_segments"] == 0, fallbacks
            assert row["rredcot/probes_per_trace"] > 0
