"""The value-pass scale benchmark's smoke mode runs end to end and writes the documented row fields."""

import importlib.util
import json
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "value_pass_scale.py"
FIELDS = {"model", "device", "length", "boundaries", "candidates", "time_over_plain", "peak_memory_over_plain"}


def test_benchmark_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("value_pass_scale", BENCHMARK)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    out = tmp_path / "smoke.json"

    result = benchmark.main(["--smoke", "--out", str(out)])

    assert json.loads(out.read_text())["rows"] == result["rows"] and result["out"] == str(out)
    (row,) = result["rows"]
    assert FIELDS <= set(row) and row["boundaries"] == 40 and row["candidates"] == 3
    assert row["probes"] == 40 * 3 and row["length"] == 96 and row["model"] == "smoke (2 layers)"
    # The ratios are those of the measurements written beside them.
    assert row["time_over_plain"] == row["value_pass_cpu_s"] / row["plain_cpu_s"]
    assert row["peak_memory_over_plain"] == row["value_pass_peak_mib"] / row["plain_peak_mib"]
    assert row["time_over_bare_forward"] == row["value_pass_cpu_s"] / row["bare_forward_cpu_s"]
    # Each pass's peak includes what was resident before it (weights, interpreter).
    for name in ("plain", "value_pass", "bare_forward"):
        assert row[f"{name}_peak_mib"] >= row[f"{name}_resident_before_mib"]
