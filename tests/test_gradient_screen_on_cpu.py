"""``benchmarks/gradient_screen.py``: the committed screen recomputes from its runs and the ledgers; its judgements of
the three conditions and the ceiling by hand."""

import json

import numpy as np
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
        # every ceiling form and the exit probe measured on the same paired batches as GRPO: all 16, or a run stopped
        # early, which says so and cannot qualify
        for name in (*gradient_screen.CEILINGS, *gradient_screen.EXIT_PROBES[:2], "step_oracle", "step_oracle_signed"):
            assert entry["methods"][name]["n_batches"] == entry["batches"], (label, name)
        assert entry["conditions"]["all_batches"] == (entry["batches"] == gradient_screen.SCREEN_BATCHES)
        # the ceiling redistributed on every batch: no form's gradient is GRPO's (as under a closed value gate)
        assert set(entry["ceiling_batches_at_grpo"].values()) == {0}, label
        if not entry["conditions"]["all_batches"]:
            assert label not in committed["qualifies"]
            assert f"({entry['batches']} of 16 batches)" in gradient_screen.policy_text(label, entry)


def _trace(exit_probe, monte_carlo, outcome, holder):
    return {"exit_probe": exit_probe, "monte_carlo": monte_carlo, "outcome": outcome, "holder": holder}


def test_values_are_judged_state_by_state_and_by_where_the_first_wrong_step_is():
    traces = {"segments_per_trace": {"0,0": 3, "0,1": 3, "1,0": 9},
              "value_agreement": {
                  # exit probe and MC both fall at segment 1 (the verifier's): both localise, within-trace rank 1
                  "0,0": _trace([0.8, 0.7, 0.1, 0.0], [0.9, 0.8, 0.2, 0.0], 0.0, 1),
                  # the verifier blames segment 0: MC falls there, the exit probe rises and falls at segment 2
                  "0,1": _trace([0.5, 0.6, 0.7, 0.0], [0.9, 0.2, 0.2, 0.0], 0.0, 0),
                  # a correct trace: no localisation, within-trace ranks reversed; the exit probe saturates early
                  "1,0": _trace([0.1, 0.995, 0.999, 1.0], [0.9, 0.8, 0.7, 1.0], 1.0, None)}}
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
    # states after the first boundary, the last left out: 2 of 6 at >= 0.99, where MC gives 0.8 and 0.7
    assert values["saturated_share"] == pytest.approx(2 / 6)
    assert values["saturated_monte_carlo_below_0_9"] == 1.0
    assert values["saturated_monte_carlo_mean"] == pytest.approx(0.75)
    assert gradient_screen.segment_conditions(traces)["median_segments"] == 3


def test_the_bar_for_self_values_is_within_reach_of_exact_values():
    """Exact values ranked against K = 16 Monte-Carlo draws of themselves: certain states (0 or 1) draw as they are,
    so their ranks agree exactly; close probabilities are reordered by the draws' noise; a flat trace has no ranks."""
    certain = [np.array([0.0, 1.0, 1.0, 0.0]), np.array([1.0, 0.0])]
    assert gradient_screen.exact_values_spearman(certain) == 1.0
    close = [np.linspace(0.40, 0.60, 8)]
    spread = [np.linspace(0.05, 0.95, 8)]
    assert gradient_screen.exact_values_spearman(close) < gradient_screen.exact_values_spearman(spread) < 1.0
    assert gradient_screen.exact_values_spearman(spread) > 0.8
    assert gradient_screen.exact_values_spearman([np.full(5, 0.5)]) is None


def test_the_batched_within_trace_spearman_is_the_per_trace_one():
    """The exact-values bar ranks every trace twenty times, on all series of one length at once: the same mean as
    Spearman a trace (ties, NaN estimates dropped, constant and short series left out, mixed lengths)."""
    from benchmarks import common

    rng = np.random.default_rng(3)
    pairs = []
    for index in range(400):
        length = int(rng.integers(1, 10))
        estimate = rng.integers(0, 4, length).astype(float)
        truth = rng.binomial(16, rng.random(length)) / 16
        if index % 7 == 0 and length > 2:
            estimate[1] = np.nan
        if index % 11 == 0:
            truth[:] = 0.5
        pairs.append((estimate, truth))
    assert common.mean_within_spearman(pairs) == pytest.approx(common.correlations(pairs)["within_spearman"], abs=1e-12)
    assert common.mean_within_spearman(pairs[:1] + [(np.ones(4), np.arange(4.0))]) is None


def _run(path, lr, seed, steps, warmup, auc=0.5, rise=0.1):
    overrides = ["trainer.total_training_steps=%d" % steps]
    if warmup:
        overrides.append("actor_rollout_ref.actor.optim.lr_warmup_steps=10")
    summary = {"auc": auc, "validation": [{"step": 0, "accuracy": 0.3}, {"step": steps, "accuracy": 0.3 + rise}],
               "diagnostics": {"first": {"critic/score/mean": 0.2}, "last": {"critic/score/mean": 0.2 + rise / 2}}}
    path.write_text(json.dumps({"spec": {"method": "grpo", "seed": seed, "steps": steps, "lr": lr,
                                         "overrides": overrides}, "summary": summary}))


def test_a_sweep_meets_the_bar_with_three_rates_of_two_seeds_and_a_hundred_steps_with_warmup(tmp_path):
    for lr in (1e-5, 3e-5, 1e-4):
        for seed in (1, 2):
            _run(tmp_path / f"grpo_lr{lr:g}_seed{seed}.json", lr, seed, 100, True)
    assert gradient_screen.sweep_conditions(tmp_path)["sweep_meets_bar"]
    _run(tmp_path / "grpo_lr0.0001_seed2.json", 1e-4, 2, 30, True)  # one rate's second seed cut short
    assert not gradient_screen.sweep_conditions(tmp_path)["sweep_meets_bar"]
    _run(tmp_path / "grpo_lr0.0001_seed2.json", 1e-4, 2, 100, False)  # or without warmup
    swept = gradient_screen.sweep_conditions(tmp_path)
    assert not swept["sweep_meets_bar"] and swept["sweep"]["0.0001"] == {"seeds": 2, "steps": 100, "warmup": False,
                                                                         "auc": 0.5}
    assert not gradient_screen.sweep_conditions(tmp_path / "none")["sweep_meets_bar"]


def test_a_setting_without_main_runs_is_judged_by_its_sweeps_best_rate(tmp_path):
    """Condition (3) on a setting whose only GRPO runs are its own sweep: the rises of the runs at the rate with the
    highest seed-mean AUC (ties to the smaller rate)."""
    sweep = tmp_path / "items" / "sweep"
    sweep.mkdir(parents=True)
    for lr, auc, rise in ((3e-5, 0.40, 0.02), (1e-4, 0.55, 0.12), (3e-4, 0.45, 0.30)):
        for seed in (1, 2):
            _run(sweep / f"grpo_lr{lr:g}_seed{seed}.json", lr, seed, 100, True, auc, rise)
    training = gradient_screen.training_conditions("items", tmp_path)
    assert training["best_swept_rate"] == 1e-4 and training["rise_from"] == "sweep, best rate"
    assert training["rates"] == [1e-4] and training["grpo_runs"] == 2 and training["sweep_meets_bar"]
    assert abs(training["greedy_rise"] - 0.12) < 1e-9 and abs(training["sampled_rise"] - 0.06) < 1e-9
    empty = gradient_screen.training_conditions("other", tmp_path)
    assert empty["greedy_rise"] is None and empty["rise_from"] is None and empty["best_swept_rate"] is None


def test_sweeps_at_several_batches_are_judged_at_the_batch_whose_best_rate_trains_best(tmp_path):
    """Condition (3) with a sweep at the recipe's batch and one at 32 prompts a step: of the sweeps that meet the bar,
    the batch whose best rate has the higher mean AUC (a partial sweep, however high, waits until it meets the bar);
    each batch's sweep kept in the record; the table names the batch."""
    from benchmarks import grpo_sweep

    def sweep(folder, rates):
        (tmp_path / "items3" / folder).mkdir(parents=True, exist_ok=True)
        for lr, auc, rise in rates:
            for seed in (1, 2):
                _run(tmp_path / "items3" / folder / f"grpo_lr{lr:g}_seed{seed}.json", lr, seed, 100, True, auc, rise)

    sweep("sweep", ((1e-5, 0.50, 0.02), (3e-5, 0.45, 0.01), (1e-4, 0.20, -0.3)))
    sweep("sweep_batch32", ((1e-5, 0.58, 0.07), (3e-5, 0.62, 0.09)))
    training = gradient_screen.training_conditions("items3", tmp_path)
    assert training["best_swept_batch"] == 8 and training["best_swept_rate"] == 1e-5 and training["sweep_meets_bar"]
    assert not training["sweeps_by_batch"]["32"]["sweep_meets_bar"]  # two rates at batch 32: still running
    assert training["sweeps_by_batch"]["32"]["best_swept_rate"] == 3e-5
    sweep("sweep_batch32", ((5e-5, 0.30, -0.1),))
    training = gradient_screen.training_conditions("items3", tmp_path)
    assert training["best_swept_batch"] == 32 and training["best_swept_rate"] == 3e-5 and training["sweep_meets_bar"]
    assert abs(training["greedy_rise"] - 0.09) < 1e-9 and training["rates"] == [3e-5]
    assert set(training["sweeps_by_batch"]) == {"8", "32"} and training["sweeps_by_batch"]["8"]["sweep_meets_bar"]
    assert gradient_screen.batch_text(training) == " (batch 32)"
    recipe_only = gradient_screen.training_conditions("items3", tmp_path / "elsewhere")
    assert recipe_only["best_swept_batch"] is None and gradient_screen.batch_text(recipe_only) == ""
    assert grpo_sweep.RECIPE_TRAIN_BATCH == 8  # recipes/tiny_cpu/base.yaml
    assert gradient_screen.policy_text("items3_items3_grpo_batch32_seed1_step50", {"setting": "items3", "batches": 16}) \
        == "`items3`, GRPO at batch 32, step 50"


def test_a_sweep_at_another_batch_launches_at_it_and_the_best_batch_trains_the_screens_policy(tmp_path, monkeypatch):
    """``--train-batch 32``: its runs set verl's batch and PPO mini-batch, live in ``sweep_batch32`` and write their own
    JSON; the GRPO policy mid-training takes the best of the committed sweeps, batch included."""
    from benchmarks import grpo_sweep

    assert grpo_sweep.batch_overrides(grpo_sweep.RECIPE_TRAIN_BATCH) == ()
    specs = grpo_sweep.run_specs(100, 10, (), (1e-5, 3e-5), 32)
    assert sorted(specs) == [(1e-5, 1), (1e-5, 2), (3e-5, 1), (3e-5, 2)]
    assert {"data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=32"} <= set(
        specs[1e-5, 1].overrides)
    assert grpo_sweep.run_dir(tmp_path, 1e-5, 1, 32) == tmp_path / "sweep_batch32" / "grpo_lr1e-05_seed1"
    assert grpo_sweep.train_batch_of(grpo_sweep.sweep_folder(32)) == 32
    assert grpo_sweep.train_batch_of(grpo_sweep.sweep_folder(grpo_sweep.RECIPE_TRAIN_BATCH)) == 8
    assert grpo_sweep.results_path("items3", 32).name == "grpo_sweep_items3_batch32.json"

    monkeypatch.setattr(grpo_sweep, "RESULTS_PATH", tmp_path / "grpo_sweep_items.json")

    def committed(name, rate, auc, meta, complete=True):
        (tmp_path / name).write_text(json.dumps({"best_rate": rate, "by_rate": {f"{rate:g}": {"auc": auc}},
                                                 "meets_sweep_bar": complete, "meta": {"warmup_steps": 10, **meta}}))

    committed("grpo_sweep_items3.json", 1e-5, 0.60, {})  # written before the batch dimension: the recipe's batch
    committed("grpo_sweep_items3_batch32.json", 3e-5, 0.55, {"train_batch": 32})
    assert grpo_sweep.best_rate_overrides("items3") == (
        "actor_rollout_ref.actor.optim.lr=1e-05", "actor_rollout_ref.actor.optim.lr_warmup_steps=10")
    committed("grpo_sweep_items3_batch32.json", 3e-5, 0.65, {"train_batch": 32}, complete=False)
    assert grpo_sweep.best_swept("items3")["train_batch"] == 8  # a partial sweep's best rate is provisional
    committed("grpo_sweep_items3_batch32.json", 3e-5, 0.65, {"train_batch": 32})
    assert grpo_sweep.best_rate_overrides("items3") == (
        "actor_rollout_ref.actor.optim.lr=3e-05", "actor_rollout_ref.actor.optim.lr_warmup_steps=10",
        "data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=32")
    assert grpo_sweep.best_swept("items") is None and grpo_sweep.best_rate_overrides("items") == ()


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
    """The README's screen bullet and RESULTS.md's one-line answer quote the best ceiling on `hard`, `early` and
    `long` at the rounding they show, and say no setting qualifies only while the JSON says so."""
    root = gradient_screen.RUNS_DIR.parent.parent.parent
    readme = (root / "README.md").read_text(encoding="utf-8").replace("\u2212", "-")
    results = (root / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8").replace("\u2212", "-")
    committed = json.loads(gradient_screen.OUT.read_text())
    assert committed["qualifies"] == []
    assert "no setting yet meets the claim's three conditions" in readme
    assert "no setting meets all three conditions" in results
    for setting in ("hard", "early", "long"):
        entry = committed["settings"][setting]
        shown = gradient_screen.interval_text(entry["methods"][entry["best_ceiling"]])
        assert shown in " ".join(readme.split()) and shown in results, (setting, shown)
    hard = committed["settings"]["hard"]
    assert hard["conditions"]["ceiling_ahead"] and not hard["conditions"]["self_values"]
    # `early`: the ceiling just ahead, on traces too short and a policy that does not train; `long`: all but (1)
    early = committed["settings"]["early"]["conditions"]
    assert early["ceiling_ahead"] and not early["decisions"] and not early["training_moves"]
    long = committed["settings"]["long"]["conditions"]
    assert long["ceiling_ahead"] and long["decisions"] and long["training_moves"] and not long["self_values"]
    # `items3`: (1) and (2) met, (3) and the ceiling not, over all 16 batches; RESULTS.md quotes its best ceiling and
    # exit probe
    items3 = committed["settings"]["items3"]
    conditions = items3["conditions"]
    assert conditions["self_values"] and conditions["decisions"]
    assert not conditions["ceiling_ahead"] and not conditions["training_moves"]
    flat = " ".join(results.split())
    for best in (items3["best_ceiling"], items3["best_exit_probe"], "ibpo_resume"):
        assert gradient_screen.interval_text(items3["methods"][best]) in flat, best
    assert items3["batches"] == 16 and conditions["all_batches"] and "`items3`, warm start |" in results
    values = items3["values"]
    assert (f"within a trace at {values['within_trace_spearman']:.2f} against Monte-Carlo values and localises "
            f"{values['localisation']:.0%} of first wrong items (Monte-Carlo's own "
            f"{values['localisation_monte_carlo']:.0%})") in flat


def test_grpo_sweep_picks_the_rate_with_the_best_mean_auc_and_says_whether_it_trains():
    from benchmarks import grpo_sweep

    def summary(auc, greedy_rise, sampled_rise):
        return {"auc": auc, "steps": 100, "median_step_s": 2.0,
                "validation": [{"step": 0, "accuracy": 0.5}, {"step": 100, "accuracy": 0.5 + greedy_rise}],
                "diagnostics": {"first": {"critic/score/mean": 0.3},
                                "last": {"critic/score/mean": 0.3 + sampled_rise}}}

    rates = grpo_sweep.RATES
    summaries = {(rates[0], 1): summary(0.50, 0.02, 0.01), (rates[0], 2): summary(0.52, 0.04, 0.03),
                 (rates[1], 1): summary(0.60, 0.10, 0.08), (rates[1], 2): summary(0.58, 0.06, 0.04),
                 (rates[2], 1): summary(0.70, 0.20, 0.20)}  # the highest AUC, but one seed short
    result = grpo_sweep.analyse(summaries)
    assert result["best_rate"] == rates[1] and result["complete_rates"] == 2 and not result["meets_sweep_bar"]
    chosen = result["by_rate"][f"{rates[1]:g}"]
    assert abs(chosen["greedy_rise"] - 0.08) < 1e-9 and abs(chosen["sampled_rise"] - 0.06) < 1e-9
    assert result["trains_at_best_rate"] is True
    summaries[rates[2], 2] = summary(0.66, -0.20, -0.16)
    result = grpo_sweep.analyse(summaries)
    assert result["best_rate"] == rates[2] and result["meets_sweep_bar"]
    assert result["trains_at_best_rate"] is False  # seed means: greedy 0.00, sampled 0.02
    assert grpo_sweep.analyse({})["best_rate"] is None


@pytest.mark.parametrize("setting", ["items", "items3"])
def test_the_committed_sweeps_recompute_from_the_ledger(tmp_path, setting):
    """results/grpo_sweep_<setting>.json is what grpo_sweep makes of the committed ledger alone (no run folders), and
    the screen's condition (3) on that setting reads the same runs."""
    from benchmarks import grpo_sweep

    committed = json.loads((gradient_screen.OUT.parent / f"grpo_sweep_{setting}.json").read_text())
    result = grpo_sweep.main(["--setting", setting, "--no-launch", "--runs-root", str(tmp_path / "runs"),
                              "--out", str(tmp_path / "sweep.json")])
    assert result["by_rate"] == committed["by_rate"] and result["best_rate"] == committed["best_rate"]
    assert result["meets_sweep_bar"] == committed["meets_sweep_bar"]
    training = gradient_screen.training_conditions(setting)
    assert training["best_swept_rate"] == committed["best_rate"]
    best = committed["by_rate"][f"{committed['best_rate']:g}"]
    assert abs(training["greedy_rise"] - best["greedy_rise"]) < 1e-12
    # The screen's GRPO policy mid-training trains at that rate, with the sweep's warmup; elsewhere the recipe's.
    assert grpo_sweep.best_rate_overrides(setting) == (
        f"actor_rollout_ref.actor.optim.lr={committed['best_rate']:g}",
        f"actor_rollout_ref.actor.optim.lr_warmup_steps={committed['meta']['warmup_steps']}")
    assert grpo_sweep.best_rate_overrides("hard") == ()


def test_a_slip_changes_one_digit_by_one_and_never_writes_a_leading_zero():
    from benchmarks.exit_probe_variants import slips

    assert slips("61") == ["51", "71", "60", "62"]
    assert slips("12") == ["22", "11", "13"]  # "02" would be another number's spelling
    assert slips("9") == ["8"]
    assert slips("-3") == ["-2", "-4"]


def test_the_committed_exit_probe_variants_recompute_the_screens_own_exit_probe_row():
    """The variants' self-normalised row is the screen's exit probe on the same batches, so it must give the screen's
    condition (1) (the screen's values are rounded to 4 decimals, these are not: ranks may move a little)."""
    from benchmarks import exit_probe_variants

    variants = json.loads(exit_probe_variants.RESULTS_PATH.read_text())
    assert variants["runs"]
    for name, rows in variants["runs"].items():
        assert sorted(rows) == sorted(exit_probe_variants.VARIANTS)
        screen = gradient_screen.value_conditions(
            json.loads((gradient_screen.RUNS_DIR / f"{name}.json").read_text())["traces"])
        own = rows["self_normalized"]
        assert own["traces"] == screen["traces"], name
        assert own["within_trace_spearman"] == pytest.approx(screen["within_trace_spearman"], abs=0.03), name
        assert own["localisation"] == pytest.approx(screen["localisation"], abs=0.02), name
        assert own["localisation_monte_carlo"] == screen["localisation_monte_carlo"], name
    results_md = (gradient_screen.RUNS_DIR.parent.parent / "RESULTS.md").read_text(encoding="utf-8")
    assert exit_probe_variants.markdown_table(variants) in results_md  # RESULTS.md quotes the table verbatim
