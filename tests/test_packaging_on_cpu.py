"""A non-editable install (``pip install .``, a wheel on a cluster) ships every module, config and the warm start.

The suite itself runs on an editable install, which finds sub-packages whether or not packaging would include them.
"""

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
