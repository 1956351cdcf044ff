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
    for estimator, phases in driver_share.DRIVER_PHASES.items():
        entry = written["estimators"][estimator]
        assert entry["driver_seconds"] == pytest.approx(sum(seconds[p] for p in phases))
        assert entry["within_bar"] == (entry["driver_seconds_scaled"] <= driver_share.BAR_SECONDS)
    # Both groups with a failure were repaired (resumed, the default) and every repair judged; the plans hold the
    # recipe's 40 segments, and the value pass's request was pickled whole.
    metrics = written["measured"]["repair_metrics"]
    assert metrics["ibpo/revisions"] == 3 * metrics["ibpo/incorrect_traces"] > 0
    assert 0 < metrics["ibpo/resume_kept_frac_mean"] < 0.1  # siblings share only the opening
    assert written["measured"]["segments_per_trace"] == 40
    assert min(written["measured"]["value_pass_request_bytes"].values()) > 8 * 2000 * 8
    assert result["out"] == str(out)
