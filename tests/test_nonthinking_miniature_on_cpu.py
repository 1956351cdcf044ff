"""verl's quickstart setting in miniature: a non-thinking Qwen2.5-style model on verl's GSM8K rows with verl's own
GSM8K reward, trained by ``rredcot`` with the reference-continuation value source and no probe profile named.

The launch is a user's (``python -m rredcot_verl.main`` on the shipped ``recipes/tiny_cpu/gsm8k_plain.yaml``), on the
``qwen2_5`` miniature (tasks/miniature.py: the Qwen2.5 chat template, no ``<think>`` token, data in verl's GSM8K format
with data_source ``openai/gsm8k``), so ``probe.profile: auto`` must resolve to ``plain`` in the
planner and the workers, the ``gsm8k`` task must read the ``#### 27`` answers, and the probes must be valued. Read
from the step metrics: no failed group, every trace has candidates and finite values (no fallback for NaN values or
missing segments, which is where a profile that does not fit the model shows), some trace redistributed, finite
advantages; and from the log: no error verl caught and carried on from. The value gate's threshold is 0 here: its
decision on two batches of 16 traces is noise (a closed gate on both steps, concordance 0.42 and 0.83 on a handful of
comparisons, failed this test once); the gate is tested in test_value_gate_on_cpu.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miniature_launch import launch_and_read

STEPS = 2

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def qwen2_5_build(tmp_path_factory) -> Path:
    # 24 problems (19 to train on): the warm start memorises them well enough that groups mix right and wrong traces.
    out = tmp_path_factory.mktemp("miniature_qwen2_5")
    subprocess.run([sys.executable, "-m", "rredcot_verl.tasks.build", "--setting", "qwen2_5", "--out", str(out),
                    "--problems", "24"], check=True, capture_output=True, timeout=900)
    return out


@pytest.mark.e2e
def test_rredcot_trains_a_nonthinking_model_on_verls_gsm8k(qwen2_5_build, tmp_path):
    from verl.utils.reward_score import default_compute_score

    out = tmp_path / "run"
    out.mkdir()
    env = {**os.environ, "RREDCOT_BUILD": str(qwen2_5_build), "VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl")}
    env.pop("RAY_ADDRESS", None)
    overrides = [f"trainer.total_training_steps={STEPS}", f"trainer.rollout_data_dir={out / 'rollouts'}",
                 "algorithm.rredcot.redistribution.min_value_concordance=0.0"]
    _, rows = launch_and_read(ROOT / "recipes" / "tiny_cpu", "gsm8k_plain", overrides, env, tmp_path, out, STEPS,
                              ("actor/grad_norm", "actor/pg_loss", "critic/advantages/mean", "critic/advantages/max",
                               "critic/advantages/min"))  # fmt: skip
    for row in rows:
        # A profile that does not fit the model shows as traces without values: NaN values, no segments, no bank.
        assert row["rredcot/fallback/nonfinite"] == 0 and row["rredcot/fallback/missing_segments"] == 0, row
        assert row["rredcot/traces_without_candidates"] == 0 and row["rredcot/bank_groups_empty"] == 0, row
        assert row["rredcot/probes_per_trace"] > 0
    assert all(row["rredcot/value_gate_open"] == 1.0 for row in rows)
    assert any(row["rredcot/redistributed_frac"] > 0 for row in rows), [row["rredcot/redistributed_frac"] for row in rows]

    # verl's GSM8K reward judged the responses, and some wrote a "#### " answer it read.
    dumped = [json.loads(line) for path in sorted((out / "rollouts").glob("*.jsonl"))
              for line in path.read_text().splitlines()]
    assert len(dumped) == STEPS * 4 * 4
    for row in dumped:
        assert row["score"] == default_compute_score("openai/gsm8k", row["output"], row["gts"]), row["output"]
    assert sum("#### " in row["output"] for row in dumped) >= len(dumped) // 4
