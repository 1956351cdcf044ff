"""Installs: a non-editable install (``pip install .``, a wheel on a cluster) ships every module, config and the warm
start; the README's GPU install resolves in a fresh virtualenv against PyPI.

The suite itself runs on an editable install, which finds sub-packages whether or not packaging would include them.
"""

import configparser
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
# The README's GPU install, the line the dry run below resolves; then flash-attn, built against the torch it installed.
GPU_INSTALL = "pip install -e '.[gpu]'"
FLASH_ATTN = "pip install flash-attn --no-build-isolation"


def test_wheel_ships_every_module_config_and_asset_and_names_the_plugin(tmp_path):
    tracked = subprocess.run(["git", "ls-files", "setup.py", "rredcot_verl"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    source = tmp_path / "src"
    for name in tracked:  # build from a copy: setuptools writes build/ and *.egg-info next to setup.py
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
         str(source)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("rredcot_verl-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())

    expected = {name for name in tracked if name.startswith("rredcot_verl/")}
    missing = sorted(expected - shipped)
    assert not missing, f"the wheel leaves out {missing}"
    entry_points = configparser.ConfigParser()
    dist_info = next(name.split("/")[0] for name in shipped if name.endswith(".dist-info/entry_points.txt"))
    entry_points.read_string(zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode())
    assert entry_points["verl.plugins"]["rredcot_verl"] == "rredcot_verl.integration.plugin"


def _pinned(name: str) -> str:
    (line,) = [line for line in (ROOT / "requirements-pinned.txt").read_text().splitlines() if line.startswith(f"{name}==")]
    return line.split("==")[1]


def test_the_readme_gpu_install_resolves_in_a_fresh_virtualenv(tmp_path):
    """The README's GPU install, as written, resolves in a new virtualenv against PyPI (this machine's local wheels,
    indexes and constraints left out) with ``--dry-run --report``. The venv's pip is upgraded first: a current pip
    reads the wheels' metadata files (PEP 658) and downloads no wheel, where the pip Python 3.11 bundles (23.2)
    downloads them all (3.7 GB, CUDA wheels mostly). It installs verl 0.9.1 with verl's own vLLM, torch and transformers
    pins, and the transformers the pinned test environment runs (requirements-pinned.txt); flash-attn, an sdist whose
    build needs torch, is the README's separate second step, not part of the extra."""
    blocks = [block for block in re.findall(r"```bash\n(.*?)```", README, re.S) if "[gpu]" in block]
    assert len(blocks) == 1, "no single bash block with the GPU install"
    commands = [line.split("#")[0].strip() for line in blocks[0].strip().splitlines()]
    assert commands == [GPU_INSTALL, FLASH_ATTN]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    env.update(PIP_FIND_LINKS="", PIP_EXTRA_INDEX_URL="", PIP_CONSTRAINT="", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_DEFAULT_TIMEOUT="60")
    if os.environ.get("PIP_CERT"):
        env["PIP_CERT"] = os.environ["PIP_CERT"]
    python = str(venv / "bin" / "python")
    upgrade = subprocess.run([python, "-m", "pip", "install", "--quiet", "--upgrade", "pip"], env=env,
                             capture_output=True, text=True, timeout=300)
    assert upgrade.returncode == 0, upgrade.stderr[-2000:]
    report = tmp_path / "report.json"
    started = time.monotonic()
    result = subprocess.run(
        [python, "-m", *shlex.split(GPU_INSTALL), "--dry-run", "--ignore-installed",
         "--report", str(report), "--quiet"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    resolved = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    print(f"resolved {len(resolved)} distributions in {time.monotonic() - started:.0f} s")
    assert resolved["rredcot-verl"] and resolved["verl"] == "0.9.1"
    assert (resolved["vllm"], resolved["torch"]) == ("0.24.0", "2.11.0")  # verl[vllm]'s pins
    assert resolved["transformers"] == _pinned("transformers")
    assert "flash-attn" not in resolved
