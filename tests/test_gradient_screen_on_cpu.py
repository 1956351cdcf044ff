"""``benchmarks/gradient_screen.py``: the committed screen recomputes from its runs and the ledgers; its judgements of
the three conditions and the ceiling by hand."""

import json

import pytest

from benchmarks import gradient_screen


def test_the_committed_screen_recomputes_from_its_runs_and_the_ledgers(tmp_path):
    committed = json.loads(gradient_screen.OUT.read_text())
    result = gradient_screen.main(["--out", str(tmp_path / "screen.json")])
    assert json.loads((tmp_path / "screen.json").read_text())["settings"] == committed["settings"]
    assert result["qualifies"] == committed["qualifies"]
    runs = sorted(path.stem for path in gradient_screen.RUNS_DIR.glob("*.json"))
    assert sorted(committed["settings"]) == runs
    for label, entry in committed["settings"].items():
        # every ceiling form and the exit probe measured on the same 16 paired batches as GRPO
        for name in (*gradient_screen.CEILINGS, *gradient_screen.EXIT_PROBES, "step_oracle", "step_oracle_signed"):
            assert entry["methods"][name]["n_batches"] == 16, (label, name)
            assert entry["methods"][name]["minus_grpo_ci95"] is not None


def _trace(exit_probe, monte_carlo, outcome, holder):
    return {"exit_probe": exit_probe, "monte_carlo": monte_carlo, "outcome": outcome, "holder": holder}


def test_values_are_judged_state_by_state_and_by_where_the_first_wrong_step_is():
    traces = {"segments_per_trace": {"0,0": 3, "0,1": 3, "1,0": 9},
              "value_agreement": {
                  # exit probe and MC both fall at segment 1 (the verifier's): both localise, within-trace rank 1
                  "0,0": _trace([0.8, 0.7, 0.1, 0.0], [0.9, 0.8, 0.2, 0.0], 0.0, 1),
                  # the verifier blames segment 0: MC falls there, the exit probe rises and falls at segment 2
                  "0,1": _trace([0.5, 0.6, 0.7, 0.0], [0.9, 0.2, 0.2, 0.0], 0.0, 0),
                  # a correct trace: no localisation, within-trace ranks reversed
                  "1,0": _trace([0.1, 0.2, 0.3, 1.0], [0.9, 0.8, 0.7, 1.0], 1.0, None)}}
    values = gradient_screen.value_conditions(traces)
    assert values["traces"] == 3 and values["localisation_n"] == 2
    # R = diff: trace 0,0 exit [-.1, -.6, -.1] -> argmin 1 (hit); MC [-.1, -.6, -.2] -> 1 (hit)
    # trace 0,1 exit [.1, .1, -.7] -> 2 (miss, holder 0); MC [-.7, 0, -.2] -> 0 (hit)
    assert values["localisation"] == pytest.approx(0.5)
    assert values["localisation_monte_carlo"] == pytest.approx(1.0)
    assert values["localisation_chance"] == pytest.approx(1 / 3)
    # within-trace Spearman over v_0..v_{K-1}: +1, -0.866 (MC tied), -1
    assert values["within_trace_n"] == 3
    assert values["within_trace_spearman"] == pytest.approx((1 - 0.8660254 - 1) / 3, abs=1e-6)
    assert gradient_screen.segment_conditions(traces)["median_segments"] == 3


def _run(path, lr, seed, steps, warmup):
    overrides = ["trainer.total_training_steps=%d" % steps]
    if warmup:
        overrides.append("actor_rollout_ref.actor.optim.lr_warmup_steps=10")
    path.write_text(json.dumps({"spec": {"method": "grpo", "seed": seed, "steps": steps, "lr": lr,
                                         "overrides": overrides}}))


def test_a_sweep_meets_the_bar_with_three_rates_of_two_seeds_and_a_hundred_steps_with_warmup(tmp_path):
    for lr in (1e-5, 3e-5, 1e-4):
        for seed in (1, 2):
            _run(tmp_path / f"grpo_lr{lr:g}_seed{seed}.json", lr, seed, 100, True)
    assert gradient_screen.sweep_conditions(tmp_path)["sweep_meets_bar"]
    _run(tmp_path / "grpo_lr0.0001_seed2.json", 1e-4, 2, 30, True)  # one rate's second seed cut short
    assert not gradient_screen.sweep_conditions(tmp_path)["sweep_meets_bar"]
    _run(tmp_path / "grpo_lr0.0001_seed2.json", 1e-4, 2, 100, False)  # or without warmup
    swept = gradient_screen.sweep_conditions(tmp_path)
    assert not swept["sweep_meets_bar"] and swept["sweep"]["0.0001"] == {"seeds": 2, "steps": 100, "warmup": False}
    assert not gradient_screen.sweep_conditions(tmp_path / "none")["sweep_meets_bar"]


def test_the_best_ceiling_is_the_form_with_the_largest_gain_and_is_ahead_only_above_zero():
    rows = {"mc_ceiling": {"minus_grpo": 0.01, "minus_grpo_ci95": [-0.02, 0.04]},
            "mc_ceiling_signed": {"minus_grpo": 0.05, "minus_grpo_ci95": [0.01, 0.09]},
            "mc_ceiling_raw": {"minus_grpo": None, "minus_grpo_ci95": None}}
    best = gradient_screen.best_of(rows, gradient_screen.CEILINGS)
    assert best == "mc_ceiling_signed" and gradient_screen.ahead(rows[best])
    assert gradient_screen.ahead(rows["mc_ceiling"]) is False
    assert gradient_screen.ahead(rows["mc_ceiling_raw"]) is None and gradient_screen.best_of({}, ["x"]) is None


def test_results_md_shows_the_screens_tables_as_the_json_gives_them():
    """RESULTS.md's "The screen" holds the two tables ``markdown_tables`` writes from the committed JSON, verbatim."""
    text = (gradient_screen.RUNS_DIR.parent.parent / "RESULTS.md").read_text(encoding="utf-8")
    section = text[text.index("## The screen: can credit pay here?"):text.index("## History")]
    committed = json.loads(gradient_screen.OUT.read_text())
    assert gradient_screen.markdown_tables(committed) in section


def test_the_readme_and_results_md_lines_on_the_screen_are_the_json():
    """The README's screen bullet and RESULTS.md's one-line answer quote the best ceiling on `hard` and on `early`
    at the rounding they show, and say no setting qualifies only while the JSON says so."""
    root = gradient_screen.RUNS_DIR.parent.parent.parent
    readme = (root / "README.md").read_text(encoding="utf-8").replace("\u2212", "-")
    results = (root / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8").replace("\u2212", "-")
    committed = json.loads(gradient_screen.OUT.read_text())
    assert committed["qualifies"] == []
    assert "no setting yet meets the claim's three conditions" in readme
    assert "no setting meets all three conditions" in results
    for setting in ("hard", "early"):
        entry = committed["settings"][setting]
        shown = gradient_screen.interval_text(entry["methods"][entry["best_ceiling"]])
        assert shown in " ".join(readme.split()) and shown in results, (setting, shown)
    hard = committed["settings"]["hard"]
    assert hard["conditions"]["ceiling_ahead"] and not hard["conditions"]["self_values"]
    assert not committed["settings"]["early"]["conditions"]["ceiling_ahead"]
