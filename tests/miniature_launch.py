"""Launching ``python -m rredcot_verl.main`` in miniature and reading what a run that trained must show (shared by the
end-to-end tests of the recipes, the non-thinking model and the code task)."""

import math
import subprocess
import sys
from pathlib import Path

from rredcot_verl.runs import load_metrics

RUN_TIMEOUT_S = 900
# Errors verl catches and carries on from (a reward that raises, a failed agent loop).
CAUGHT_ERRORS = ("Error in _run_prompt", "Traceback (most recent call last)")


def launch_and_read(config_dir: Path, config_name: str, overrides: list[str], env: dict, cwd: Path, out: Path,
                    steps: int, finite_keys: tuple[str, ...]) -> tuple[str, list[dict]]:  # fmt: skip
    """Run the launcher under ``timeout`` + ``setsid`` (on expiry the whole process group, Ray and vLLM, ends with the
    driver), keep its log in ``out/stdout.log`` and check it trained: exit 0, no error verl caught, ``steps`` steps
    logged, no failed group or missing trace, ``finite_keys`` finite at every step. Returns (log, metric rows)."""
    command = ["timeout", "-k", "30", str(RUN_TIMEOUT_S), "setsid", sys.executable, "-m", "rredcot_verl.main",
               "--config-dir", str(config_dir), "--config-name", config_name, *overrides]  # fmt: skip
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S + 60)
    log = result.stdout + result.stderr
    (out / "stdout.log").write_text(log)
    assert result.returncode == 0, log[-6000:]
    for marker in CAUGHT_ERRORS:
        assert marker not in log, log[log.index(marker) - 2000 : log.index(marker) + 4000]
    rows = load_metrics(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    for row in rows:
        assert row["rollout/failed_groups"] == 0 and row["rollout/missing_traces"] == 0
        for key in finite_keys:
            assert math.isfinite(float(row[key])), (key, row[key])
    return log, rows
