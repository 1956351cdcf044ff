"""``benchmarks/turn_credit.py``: its smoke run (trajectories through the tool loop with the calculator tool, g*, two
batches per method with advantages checked zero on every tool-output token, Monte-Carlo values resumed at turn starts)
and its value tables on traces made by hand."""

import json

import pytest
import torch

from benchmarks import turn_credit


def test_turn_credit_smoke(tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "tc.json"
    result = turn_credit.main(["--smoke", "--cache", str(tmp_path / "cache"), "--out", str(out)])
    written = json.loads(out.read_text())
    gq = written["gradient_quality"]
    assert list(gq["methods"]) == list(turn_credit.METHODS)
    batches = json.loads((tmp_path / "cache" / "batches.json").read_text())["results"]
    for name, entry in gq["methods"].items():
        assert entry["batches"]["8"]["n_batches"] == 2, name  # 2 prompts x 4 rollouts
        for record in batches[name]["2"].values():
            assert -1.0 <= record["cosine"] <= 1.0 and record["norm_ratio"] > 0
            if name != "grpo":  # the package's values went through redistribute
                assert 0.0 <= record["fallback_frac"] <= 1.0
    assert gq["settings"]["pool_prompts"] * gq["settings"]["pool_rollouts_per_prompt"] == 32
    assert gq["settings"]["pool_mean_calls"] > 0  # the warm start calls the tool
    vq = written["value_quality"]
    assert vq["traces"]["n"] == 4 and vq["traces"]["states"] >= 4
    for trace in vq["per_trace"]:
        # States at turn starts: the first at the response start, one more after each tool answer that was merged.
        starts = [0, *trace["segment_ends"][:-1]]
        assert starts == trace["turn_starts"][: len(starts)]
        assert all(v in (0.0, 0.5, 1.0) for v in trace["mc"])  # K = 2 continuations judged 0/1
        for source in turn_credit.VALUE_SOURCES:
            assert len(trace[source]) == len(starts)
    assert written["step_cost"] is None  # --smoke launches nothing
    assert result["out"] == str(out)


def _trace(mc, estimate, outcome, holder):
    return {"response": "", "outcome": outcome, "turns": len(mc), "calls": len(mc) - 1,
            "segment_ends": list(range(1, len(mc) + 1)), "turn_starts": list(range(len(mc))), "mc": mc,
            **{name: estimate for name in turn_credit.VALUE_SOURCES}, "holder_segment": holder}


def test_value_tables_rank_states_and_find_the_drop_at_the_wrong_call():
    # Two failed traces whose value drops at their wrong call (segment 1, then 0), one correct trace.
    # Each estimate is MC squared: the same order, so Spearman is 1 (ties included).
    traces = [_trace([0.5, 0.6, 0.1], [0.25, 0.36, 0.01], 0.0, 1), _trace([0.5, 0.2, 0.1], [0.25, 0.04, 0.01], 0.0, 0),
              _trace([0.5, 0.8, 0.9], [0.25, 0.64, 0.81], 1.0, None)]
    tables = turn_credit.value_tables(traces)
    source = tables["sources"]["turn_exit_probe"]
    assert source["n_states"] == 9 and source["spearman"] == pytest.approx(1.0)
    # Trace 1: rewards (0.11, -0.35, -0.01): the drop is segment 1. Trace 2: (-0.21, -0.03, -0.01): segment 0.
    assert source["localisation"] == 1.0 and source["localisation_n"] == 2
    assert source["localisation_chance"] == pytest.approx(1 / 3)
    assert tables["traces"] == {"n": 3, "correct": 1, "states": 9, "mean_turns": 3.0, "failed_with_wrong_call": 2}
    # A source whose drop lands on the wrong segment of the first trace (rewards -0.4, -0.1, -0.4: the first
    # minimum), and has no estimate at one state.
    traces[0]["turn_exit_probe"] = [0.9, 0.5, 0.4]
    traces[2]["turn_exit_probe"] = [None, 0.7, 0.8]
    source = turn_credit.value_tables(traces)["sources"]["turn_exit_probe"]
    assert source["localisation"] == 0.5 and source["n_states"] == 8
    assert source["nan_fraction"] == pytest.approx(1 / 9)
