"""``benchmarks/value_pass.py``: its GPU mode runs end to end on CPU at a tiny setting, writes the documented fields
without absolute paths, finds the fp32 value pass equal to the fp32 reference, and imports nothing that the GPU image
lacks; its scale mode's smoke run writes the documented row fields. Its values mode: tests/test_benchmarks_on_cpu.py."""

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import value_pass

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "value_pass.py"
# The project's dependencies beyond torch and transformers: none of them is installed on the GPU image.
ABSENT_ON_GPU_IMAGE = (
    "verl", "vllm", "ray", "rapidfuzz", "omegaconf", "hydra", "math_verify", "matplotlib", "pandas", "scipy",
)
DIFF_FIELDS = [
    f"{field}_{stat}_abs_diff" for field in ("probe_logp", "values", "trace_logp") for stat in ("max", "median")
]


def test_gpu_mode_tiny_cpu_run(tmp_path):
    out = tmp_path / "gpu_check.json"

    result = value_pass.main([
        "gpu", "--device", "cpu", "--model", "smoke", "--vocab", "256", "--layers", "1", "--accuracy-layers", "1",
        "--tokens", "200", "--repeats", "1", "--out", str(out),
    ])

    text = out.read_text()
    assert result["out"] == str(out) and str(tmp_path) not in text and str(ROOT) not in text
    written = json.loads(text)
    meta = written["meta"]
    assert meta["script"] == "benchmarks/value_pass.py gpu" and meta["model_shape"]["vocab_size"] == 256

    accuracy = written["accuracy"]
    assert accuracy["response_lengths"] == [50, 100, 200] and accuracy["reference_ran"] == ["eager"]
    assert accuracy["probes"] == 3 * 6 * 3 and accuracy["values"] == 3 * 6
    assert set(accuracy["skipped"]) == {"flash_attention_2"}
    fp32, bf16 = accuracy["cases"]
    assert (fp32["case"], bf16["case"]) == ("float32/eager", "bfloat16/sdpa")
    assert fp32["value_pass_ran"] == bf16["value_pass_ran"] == ["rredcot_value_pass"] and bf16["naive_ran"] == ["sdpa"]
    assert all(fp32[field] < 1e-4 for field in DIFF_FIELDS)
    for prefix in ("", "naive_"):  # bf16 rounding shows, but stays small
        assert all(bf16[prefix + field] < 0.1 for field in DIFF_FIELDS)
        assert bf16[prefix + "probe_logp_max_abs_diff"] > 0

    cost = written["cost"]
    assert cost["layers"] == 1 and cost["out_of_memory_at_layers"] == [] and cost["response_tokens"] == 200
    (row,) = cost["rows"]
    assert row["configured"] == "sdpa" and row["probes"] == 40 * 3
    assert row["value_pass_ran"] == row["plain_ran"] == ["rredcot_value_pass"] and row["forward_ran"] == ["sdpa"]
    for name in ("value_pass", "plain", "forward"):
        assert row[f"{name}_peak_mib"] is None  # no CUDA memory on CPU
    assert row["time_over_plain"] == row["value_pass_seconds"] / row["plain_seconds"]
    assert row["time_over_forward"] == row["value_pass_seconds"] / row["forward_seconds"]
    assert row["peak_over_plain"] is None


def test_gpu_mode_imports_only_torch_and_transformers():
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in ABSENT_ON_GPU_IMAGE)
    code = f"import runpy, sys; {blocked}; runpy.run_path({str(SCRIPT)!r}); print('imported')"

    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)

    assert run.returncode == 0 and run.stdout.strip() == "imported", run.stderr[-2000:]


SCALE_FIELDS = {"model", "device", "length", "boundaries", "candidates", "time_over_plain", "peak_memory_over_plain"}


def test_scale_mode_smoke(tmp_path):
    out = tmp_path / "smoke.json"

    result = value_pass.main(["scale", "--smoke", "--out", str(out)])

    assert json.loads(out.read_text())["rows"] == result["rows"] and result["out"] == str(out)
    (row,) = result["rows"]
    assert SCALE_FIELDS <= set(row) and row["boundaries"] == 40 and row["candidates"] == 3
    assert row["probes"] == 40 * 3 and row["length"] == 96 and row["model"] == "smoke (2 layers)"
    # The ratios are those of the measurements written beside them.
    assert row["time_over_plain"] == row["value_pass_cpu_s"] / row["plain_cpu_s"]
    assert row["peak_memory_over_plain"] == row["value_pass_peak_mib"] / row["plain_peak_mib"]
    assert row["time_over_bare_forward"] == row["value_pass_cpu_s"] / row["bare_forward_cpu_s"]
    # Each pass's peak includes what was resident before it (weights, interpreter).
    for name in ("plain", "value_pass", "bare_forward"):
        assert row[f"{name}_peak_mib"] >= row[f"{name}_resident_before_mib"]
