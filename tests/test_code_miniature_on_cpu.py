"""The code task launched as a user launches it (``python -m rredcot_verl.main --config-dir recipes/tiny_cpu
--config-name code``), in miniature on CPU: generated function-writing problems with assert tests, a tiny Qwen3-family
model warm-started to pass some of them (``tasks/code_miniature.py``), every response and every Monte-Carlo
continuation judged by ``tasks/code_reward.py`` in the sandbox inside verl's Ray workers.

One launch (``segment_mc``: the estimator that judges the most programs, its continuations included) serves every
assertion; the launch checks are answered by ``--check-only`` without Ray.
"""

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from miniature_launch import launch_and_read
from rredcot_verl.integration.launcher import LaunchError, check
from rredcot_verl.tasks import code_miniature
from rredcot_verl.tasks.code_reward import compute_score

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes" / "tiny_cpu"
ARTEFACT = ROOT / "rredcot_verl" / "tasks" / "assets" / "warmstart"
STEPS, PROMPTS, SAMPLES = 2, 4, 4


def test_the_launch_check_refuses_the_exit_probe_for_code_and_accepts_segment_mc(tmp_path, monkeypatch):
    """The recipe on code data; the launch checks read only the tokenizer and config of the model, so the committed
    warm start stands in for the code model (no SFT here). The same ``check`` as ``--check-only`` runs, in this
    process (tests/test_run_shapes_on_cpu.py runs the command itself)."""
    code_miniature.write_data(code_miniature.make_problems(20, 0), str(tmp_path / "data"), 0)
    shutil.copytree(ARTEFACT, tmp_path / "model")
    monkeypatch.setenv("RREDCOT_BUILD", str(tmp_path))

    def config(estimator: str):
        with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
            return compose(config_name="code", overrides=[f"algorithm.adv_estimator={estimator}"])

    with pytest.raises(LaunchError) as refused:
        check(config("rredcot"))
    assert str(refused.value).startswith(
        "algorithm.rredcot.probe.value_source=exit_probe has no meaning for algorithm.rredcot.task=code"
    ), str(refused.value)
    check(config("segment_mc"))


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("code_miniature")
    subprocess.run(
        [sys.executable, "-m", "rredcot_verl.tasks.build", "--setting", "code", "--out", str(out), "--threads", "1"],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    return out


@pytest.mark.e2e
def test_segment_mc_trains_on_code_judged_in_the_sandbox(build, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    env = {**os.environ, "RREDCOT_BUILD": str(build), "VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl")}
    env.pop("RAY_ADDRESS", None)
    overrides = [
        f"data.train_batch_size={PROMPTS}", f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
        f"actor_rollout_ref.rollout.n={SAMPLES}", f"trainer.total_training_steps={STEPS}",
        "trainer.val_before_train=false", "trainer.test_freq=-1", f"trainer.rollout_data_dir={out / 'rollouts'}",
        f"algorithm.rredcot.snapshot_dir={out / 'snapshots'}", f"trainer.default_local_dir={out / 'checkpoints'}",
    ]  # fmt: skip
    start = time.monotonic()
    _, rows = launch_and_read(RECIPES, "code", overrides, env, tmp_path, out, STEPS,
                              ("actor/grad_norm", "actor/pg_loss", "critic/advantages/mean", "critic/advantages/max",
                               "critic/advantages/min"))  # fmt: skip
    for row in rows:
        assert row["segment_mc/continuations"] > 0 and row["segment_mc/extra_generated_tokens"] > 0, row

    # The reward workers judged every trace through the sandbox: their scores equal the reward recomputed here, and
    # the run saw both outcomes.
    dumped = [json.loads(line) for path in sorted((out / "rollouts").glob("*.jsonl"))
              for line in path.read_text().splitlines()]
    assert len(dumped) == STEPS * PROMPTS * SAMPLES
    scores = [row["score"] for row in dumped]
    for row in dumped:
        assert row["score"] == compute_score(code_miniature.DATA_SOURCE, row["output"], row["gts"]), row["output"]
    assert 0.0 in scores and 1.0 in scores, scores

    # The continuations were judged too: Monte-Carlo values of the states before the last segment (2 continuations
    # each) include passing and failing programs.
    mc_values = []
    for snapshot in sorted((out / "snapshots").glob("step_*.json")):
        for trace in json.loads(snapshot.read_text())["traces"]:
            ends = [e for e in trace["seg_ends"] if e >= 0]
            assert math.isfinite(trace["seg_raw_values"][len(ends)])
            mc_values += [v for v in trace["seg_raw_values"][: len(ends)] if v is not None and not math.isnan(v)]
            assert all(math.isfinite(a) for a in trace["token_advantages"])
    assert mc_values and min(mc_values) < 1.0 and max(mc_values) > 0.0, mc_values
    print(f"code miniature run: {time.monotonic() - start:.0f} s, pass rate {sum(scores) / len(scores):.0%}, "
          f"continuations per step {[row['segment_mc/continuations'] for row in rows]}, "
          f"states with a value {len(mc_values)}")
