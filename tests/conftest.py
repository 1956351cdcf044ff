"""Fixtures shared by the launcher tests."""

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WARM_START = ROOT / "rredcot_verl" / "tasks" / "assets" / "warmstart"


@pytest.fixture()
def build(tmp_path, monkeypatch):
    """The embedded default as ``recipes/tiny_cpu`` reads it (``$RREDCOT_BUILD``: a few parquet rows and the shipped
    warm start), without the minutes of a full build."""
    from rredcot_verl.tasks.arithmetic import write_parquet

    write_parquet(str(tmp_path / "data"), n_train=8, n_val=4, seed=0)
    shutil.copytree(WARM_START, tmp_path / "model")
    monkeypatch.setenv("RREDCOT_BUILD", str(tmp_path))
    monkeypatch.setenv("RREDCOT_REWARD_FILE", str(ROOT / "rredcot_verl/tasks/reward.py"))
    return tmp_path
