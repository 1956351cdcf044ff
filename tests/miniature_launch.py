"""Launching ``python -m rredcot_verl.main`` in miniature and reading what a run that trained must show (shared by the
end-to-end tests of the recipes, the non-thinking model and the code task)."""

import fcntl
import math
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from rredcot_verl.runs import load_metrics

RUN_TIMEOUT_S = 900
# scripts/test.sh names a folder here that its pytest processes share builds in (see shared_build_folder).
SHARED_BUILDS_ENV = "RREDCOT_TEST_BUILDS"


@contextmanager
def shared_build_folder(name: str, tmp_path_factory):
    """The folder a build named ``name`` goes to. Under scripts/test.sh the pytest processes of one suite share it:
    the builders reuse a folder whose fingerprint matches, so a family's warm start is trained once per suite, not
    once in the fast tier and again for its launches; the lock keeps a second process from building into it at the
    same time. The tests only read a build. Without the variable: a folder of this process's own."""
    parent = os.environ.get(SHARED_BUILDS_ENV)
    if not parent:
        yield tmp_path_factory.mktemp(name)
        return
    folder = Path(parent) / name
    folder.mkdir(parents=True, exist_ok=True)
    with open(Path(parent) / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield folder


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
