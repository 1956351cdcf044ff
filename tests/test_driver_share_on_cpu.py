"""benchmarks/driver_share.py at smoke size: the step's phases run through the package's own functions and are scaled
to the recipe's 512 traces."""

import json

import pytest

from benchmarks import driver_share


def test_driver_share_smoke(tmp_path):
    out = tmp_path / "driver_share.json"
    result = driver_share.main(["--smoke", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["shape"] == {"traces": 8, "response_tokens": 2000, "group_size": 4, "ranks": 8, "recipe_traces": 512}
    assert written["scaled_to_recipe"] == 64
    seconds, scaled = written["phases_seconds"], written["phases_seconds_scaled"]
    assert all(scaled[name] == pytest.approx(64 * value) for name, value in seconds.items())
    assert written["threads"] == written["planning_workers"] == 1 and written["node_cores"] == 16
    for estimator, phases in driver_share.DRIVER_PHASES.items():
        entry = written["estimators"][estimator]
        assert entry["driver_seconds"] == pytest.approx(sum(seconds[p] for p in phases))
        # the projection: the one-core phases, and the multi-core ones over the cores
        multi_core = sum(scaled[p] for p in phases if p in driver_share.MULTI_CORE_PHASES)
        assert multi_core > 0 and entry["driver_multi_core_part_seconds_scaled"] == pytest.approx(multi_core)
        assert entry["driver_seconds_projected_at_threads_scaled"] == pytest.approx(entry["driver_seconds_scaled"])
        assert entry["driver_seconds_projected_at_node_scaled"] == pytest.approx(
            entry["driver_seconds_scaled"] - multi_core + multi_core / 16)
        assert entry["within_bar"] == (entry["driver_seconds_projected_at_node_scaled"] <= driver_share.BAR_SECONDS)
        assert entry["within_bar_on_one_core"] == (entry["driver_seconds_scaled"] <= driver_share.BAR_SECONDS)
    # Both groups with a failure were repaired (resumed, the default) and every repair judged; the plans hold the
    # recipe's 40 segments, and the value pass's request was pickled whole.
    metrics = written["measured"]["repair_metrics"]
    assert metrics["ibpo/revisions"] == 3 * metrics["ibpo/incorrect_traces"] > 0
    assert 0 < metrics["ibpo/resume_kept_frac_mean"] < 0.1  # siblings share only the opening
    assert written["measured"]["segments_per_trace"] == 40
    assert min(written["measured"]["value_pass_request_bytes"].values()) > 8 * 2000 * 8
    assert result["out"] == str(out)


def test_driver_share_smoke_with_planning_in_worker_processes(tmp_path):
    # Two workers: the per-trace planning is their CPU seconds, its dispatch this process's; the plans are the same
    # (tests/test_driver_equivalence_on_cpu.py), so are the probes and segments counted here.
    out = tmp_path / "driver_share.json"
    driver_share.main(["--smoke", "--threads", "2", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["threads"] == written["planning_workers"] == 2
    seconds = written["phases_seconds"]
    for estimator in ("rredcot", "rredcot_ibpo"):
        names = driver_share.value_stage_names(estimator)
        assert seconds[names["plans_per_trace"]] > 0 and seconds[names["plans_dispatch"]] > 0
    assert written["measured"]["segments_per_trace"] == 40 and written["measured"]["probes_per_trace"] > 0
    for entry in written["estimators"].values():
        assert entry["driver_seconds_projected_at_threads_scaled"] == pytest.approx(
            entry["driver_seconds_scaled"] - entry["driver_multi_core_part_seconds_scaled"] / 2)


def test_driver_share_smoke_for_a_model_without_thinking_markers(tmp_path):
    # --profile plain: the traces read as a model's without a thinking block; planning finds their answer regions.
    out = tmp_path / "driver_share_plain.json"
    driver_share.main(["--smoke", "--profile", "plain", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["probe_profile"] == "plain"
    assert written["measured"]["segments_per_trace"] > 0 and written["measured"]["probes_per_trace"] > 0
