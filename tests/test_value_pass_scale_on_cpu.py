"""The value-pass scale benchmark's smoke mode runs end to end and writes the documented row fields."""

import importlib.util
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "value_pass_scale.py"
FIELDS = {"model", "device", "length", "boundaries", "candidates", "time_over_plain", "peak_memory_over_plain"}


def test_benchmark_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("value_pass_scale", BENCHMARK)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    out = tmp_path / "smoke.json"

    result = benchmark.main(["--smoke", "--out", str(out)])

    assert out.exists() and result["out"] == str(out)
    (row,) = result["rows"]
    assert FIELDS <= set(row) and row["boundaries"] == 40 and row["candidates"] == 3
    assert row["probes"] == 40 * 3
    assert row["time_over_plain"] > 0 and row["peak_memory_over_plain"] > 0
    assert row["plain_peak_mib"] > 0 and row["value_pass_cpu_s"] > 0
