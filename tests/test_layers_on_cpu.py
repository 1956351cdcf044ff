"""The layering rule: the algorithm core (and the tasks, the report) import without verl or ray."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rredcot_verl"
# rglob: the core has sub-packages (core.ibpo), whose modules are checked too; a sub-package's __init__.py stands
# for the package itself.
CORE_FILES = sorted((PACKAGE / "core").rglob("*.py"))
CORE_MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for p in CORE_FILES
    if p != PACKAGE / "core" / "__init__.py"
)
# Modules a user runs where only torch and transformers are installed (a GPU box, a notebook on a saved batch).
STANDALONE = ["rredcot_verl", *CORE_MODULES, "rredcot_verl.tasks", "rredcot_verl.report"]

BLOCKER = """
import importlib.abc, sys, time
BLOCKED = ("verl", "ray", "transfer_queue", "vllm")

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Blocker())
started = time.perf_counter()
for module in sys.argv[1:]:
    __import__(module)
print(f"{time.perf_counter() - started:.2f}")
"""


def test_core_tasks_and_report_import_with_verl_and_ray_unimportable():
    result = subprocess.run(
        [sys.executable, "-c", BLOCKER, *STANDALONE], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    print(f"import time of {len(STANDALONE)} modules without verl/ray: {result.stdout.strip()} s")


def test_blocker_does_block_verl():
    # The check above is only meaningful if the blocker stops a module that needs verl.
    result = subprocess.run(
        [sys.executable, "-c", BLOCKER, "rredcot_verl.integration.estimators"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode != 0 and "is blocked in this test" in result.stderr


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: p.relative_to(PACKAGE / "core").as_posix())
def test_core_imports_only_the_core(path):
    # The core receives task functions and settings; it never reaches into tasks/, integration/ or compat/.
    imported = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.append(node.module)
        elif isinstance(node, ast.Import):
            imported.extend(alias.name for alias in node.names)
    outside = [m for m in imported if m.startswith("rredcot_verl") and not m.startswith("rredcot_verl.core")]
    assert not outside, f"{path.name} imports {outside}"
