"""End to end through the real stack: verl's V1 trainer, vLLM (CPU) servers in Ray workers, FSDP2 actor update.

Each run is a subprocess under a hard timeout in its own process group (recipes/tiny_cpu/run.sh uses setsid +
timeout), on the committed warm-started model, so a hang ends as a failure and Ray/vLLM are torn down with it.
"""

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rredcot_verl.runs import load_metrics

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "recipes" / "tiny_cpu" / "run.sh"
pytestmark = pytest.mark.e2e

# Two steps of 4 prompts x 4 samples, no validation: the smallest run that still has mixed groups.
SMALL = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.val_before_train=false", "trainer.test_freq=-1"]


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("build")
    subprocess.run(
        [sys.executable, "-m", "rredcot_verl.tasks.build", "--out", str(out)], check=True, capture_output=True, timeout=600
    )
    return out


def _train(estimator: str, build: Path, out: Path, steps: int = 2, extra=(), env_extra=None) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "RREDCOT_BUILD": str(build),
        "OUT": str(out),
        "RREDCOT_STEPS": str(steps),
        "RUN_TIMEOUT": "900",
        **(env_extra or {}),
    }
    result = subprocess.run(["bash", str(RUN), estimator, *SMALL, *extra], env=env, capture_output=True, text=True, timeout=1000)
    (out / "stdout.log").write_text(result.stdout + result.stderr)
    return result


def _latest_snapshot(out: Path) -> dict:
    return json.loads(sorted((out / "snapshots").glob("step_*.json"))[-1].read_text())


def _assert_finite_steps(out: Path, steps: int) -> list[dict]:
    rows = load_metrics(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    for row in rows:
        for key in ("actor/grad_norm", "critic/advantages/mean", "critic/advantages/max", "actor/pg_loss"):
            assert math.isfinite(float(row[key])), (key, row[key])
    return rows


def test_rredcot_trains_and_redistributes(build, tmp_path):
    result = _train("rredcot", build, tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = _assert_finite_steps(tmp_path, 2)
    assert any(row["rredcot/redistributed_frac"] > 0 for row in rows)
    assert all(row["rredcot/fallback/nonfinite"] == 0 for row in rows)
    traces = _latest_snapshot(tmp_path)["traces"]
    differing = 0
    for trace in traces:
        ends = [e for e in trace["seg_ends"] if e >= 0]
        values = [v for v in trace["values"] if v is not None and not math.isnan(v)]
        if len(ends) < 2 or len(values) != len(ends) + 1:
            continue
        advantages = trace["token_advantages"]
        starts = [0, *ends[:-1]]
        per_segment = {round(advantages[s], 6) for s in starts if s < len(advantages)}
        differing += len(per_segment) > 1
        rewards = [r for r in trace["segment_rewards"][: len(ends)]]
        assert sum(rewards) == pytest.approx(values[-1] - values[0], abs=1e-5)  # telescoping on real data
    assert differing > 0, "no redistributed trace had different advantages between its segments"


def test_ibpo_generates_repairs_and_localises_blame(build, tmp_path):
    result = _train("ibpo", build, tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = _assert_finite_steps(tmp_path, 2)
    assert all(row["ibpo/revisions"] > 0 for row in rows)
    assert all(row["ibpo/extra_generated_tokens"] > 0 for row in rows)
    traces = _latest_snapshot(tmp_path)["traces"]
    non_uniform_incorrect = [
        t for t in traces if t["outcome"] == 0 and len({round(a, 6) for a in t["token_advantages"]}) > 1
    ]
    assert non_uniform_incorrect, "no incorrect trace got a localised (non-uniform) advantage"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ray_job_submit_to_a_running_head_node(build, tmp_path):
    """A head node started by hand (as on a cluster), the tiny job sent with `ray job submit`, then torn down.
    The head runs in its own session (`ray start --block`) so teardown kills exactly its processes."""
    ray = str(Path(sys.executable).parent / "ray")
    gcs_port, dashboard_port = _free_port(), _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    temp_dir = Path("/tmp") / f"ray_e2e_{os.getpid()}"
    start = [
        ray, "start", "--head", "--block", f"--port={gcs_port}", "--num-cpus=32", "--num-gpus=1",
        "--include-dashboard=true", f"--dashboard-port={dashboard_port}", "--dashboard-host=127.0.0.1",
        f"--temp-dir={temp_dir}", "--disable-usage-stats",
    ]
    head_log = open(tmp_path / "ray_head.log", "w")
    head = subprocess.Popen(start, env=env, stdout=head_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for_dashboard(dashboard_port, timeout_s=180)
        result = _train(
            "grpo", build, tmp_path, steps=1, env_extra={**env, "RAY_ADDRESS": f"http://127.0.0.1:{dashboard_port}"}
        )
        assert result.returncode == 0, (
            result.stdout[-4000:] + result.stderr[-4000:] + (tmp_path / "ray_head.log").read_text()[-2000:]
        )
        assert "succeeded" in (result.stdout + result.stderr)
        _assert_finite_steps(tmp_path, 1)
    finally:
        _kill_session(head)
        head_log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_dashboard(port: int, timeout_s: float) -> None:
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/version", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"Ray dashboard on port {port} did not come up in {timeout_s} s")


def _kill_session(process: subprocess.Popen) -> None:
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=30)
            return
        except subprocess.TimeoutExpired:
            continue
