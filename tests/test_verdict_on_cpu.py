"""The verdict's statistics with numbers worked by hand, its registration check, and missing runs reported."""

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from benchmarks import verdict

LEDGER = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "sample_efficiency_runs"


def test_holm_adjusts_a_known_vector_step_down():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> held at 0.06 (non-decreasing)
    assert verdict.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert verdict.holm([0.3, 0.9]) == pytest.approx([0.6, 0.9])
    assert verdict.holm([0.6, 0.7]) == pytest.approx([1.0, 1.0])  # capped at 1
    # A comparison without a test counts in the family (m = 2) and is never rejected.
    assert verdict.holm([0.01, None]) == [pytest.approx(0.02), None]


def test_paired_interval_and_p_by_hand():
    """Differences 0.02, 0.03, 0.06: mean 0.036667, sd 0.020817, se 0.0120185; t(0.975, 2) = 4.302653 gives
    ±0.051711; t = 3.0509, and with 2 degrees of freedom p = 1 - t/sqrt(2 + t²) = 0.0927."""
    result = verdict.paired({1: 0.50, 2: 0.52, 3: 0.57, 4: 0.9}, {1: 0.48, 2: 0.49, 3: 0.51})
    assert result["n"] == 3 and result["difference"] == pytest.approx(0.036667, abs=1e-6)
    assert result["ci95"] == pytest.approx([-0.015045, 0.088378], abs=1e-6)
    t = 0.036667 / 0.0120185
    assert result["p"] == pytest.approx(1 - t / math.sqrt(2 + t**2), abs=1e-4) == pytest.approx(0.09274, abs=1e-4)
    assert result["per_seed"] == pytest.approx({"1": 0.02, "2": 0.03, "3": 0.06})
    assert verdict.paired({1: 0.5}, {1: 0.4}) is None  # one pair: no interval


def test_welch_difference_of_means_by_hand():
    """0.50, 0.52, 0.57 against 0.48, 0.49, 0.51: difference 0.036667; variances 0.0013 and 0.00023333, so the
    standard error is sqrt((0.0013 + 0.00023333) / 3) = 0.022608, with Welch-Satterthwaite df
    0.00051111² / ((0.0013/3)²/2 + (0.00023333/3)²/2) = 2.6955."""
    result = verdict.welch([0.50, 0.52, 0.57], [0.48, 0.49, 0.51])
    assert result["difference"] == pytest.approx(0.036667, abs=1e-6) and result["df"] == pytest.approx(2.6955, abs=1e-4)
    half = (result["ci95"][1] - result["ci95"][0]) / 2
    assert half == pytest.approx(stats.t.ppf(0.975, result["df"]) * 0.022608, abs=1e-5)


def curve(steps, values):
    return [{"step": int(s), "accuracy": float(v)} for s, v in zip(steps, values)]


GRID = np.arange(0, 101, 10)
KNOTS = np.arange(0, 201, 20)  # a GRPO curve linear between every 20 steps, to step 200
KNOT_VALUES = [0.40, 0.46, 0.50, 0.53, 0.55, 0.565, 0.575, 0.58, 0.585, 0.588, 0.59]


def grpo_at(steps):
    return np.interp(steps, KNOTS, KNOT_VALUES)


def test_time_shift_is_one_for_identical_curves_and_two_at_twice_the_speed():
    grpo = curve(GRID, grpo_at(GRID))
    assert verdict.time_shift(grpo, grpo) == {"factor": 1.0, "at_bound": False}
    # The method's step t is GRPO's step 2t: validated every 10 steps, it shows GRPO's curve to step 200.
    assert verdict.time_shift(curve(GRID, grpo_at(2 * GRID)), grpo)["factor"] == pytest.approx(2.0)
    # And half the speed: its step t is GRPO's t/2 (on GRPO's chords between validations).
    assert verdict.time_shift(curve(GRID, grpo_at(GRID / 2)), grpo)["factor"] == pytest.approx(0.5)


def test_time_shift_of_a_run_that_does_not_learn_is_the_lower_bound():
    grpo = curve(GRID, grpo_at(GRID))
    flat = verdict.time_shift(curve(GRID, [0.40] * len(GRID)), grpo)
    assert flat == {"factor": verdict.TIME_SHIFT_BOUNDS[0], "at_bound": True}


def test_geometric_interval_is_the_t_interval_of_the_logs():
    result = verdict.geometric_interval([1.0, 2.0, 4.0])  # log2: 0, 1, 2 -> mean 1, se 1/sqrt(3)
    assert result["estimate"] == pytest.approx(2.0)
    half = 4.302653 / math.sqrt(3)
    assert result["ci95"] == pytest.approx([2 ** (1 - half), 2 ** (1 + half)], rel=1e-6)


def test_equal_compute_rollouts_from_one_or_two_grpo_step_times():
    assert verdict.equal_compute_rollouts(2.6, 1.3, 4) == pytest.approx(8.0)  # proportional to rollouts
    # 4 rollouts 1.0 s, 8 rollouts 1.8 s: 0.2 s a rollout over a fixed 0.2 s; 2.0 s buys 9 rollouts.
    assert verdict.equal_compute_rollouts(2.0, 1.0, 4, 1.8, 8) == pytest.approx(9.0)
    with pytest.raises(ValueError, match="does not grow"):
        verdict.equal_compute_rollouts(2.0, 1.0, 4, 0.9, 8)
    assert verdict.main(["--equal-compute", "2.0", "1.0", "4", "1.8", "8"]) == pytest.approx(9.0)


REGISTRATION = """
name: check
post_hoc: false
registered: "2026-11-27"
setting: hard
seeds: [1, 2, 3]
steps: 100
validation: {problems: 1000, every: 10}
primary_statistic: auc_paired
decision_rule: {alpha: 0.05, time_shift_at_least: 1.5, time_shift_interval_above: 1.0, text: rule}
arms:
  grpo: {method: grpo, lr: 3.0e-5}
  ibpo: {method: ibpo, lr: 3.0e-5}
"""


@pytest.mark.parametrize("change, message", [
    (("arms:", "unknown_key: 1\narms:"), "unknown_key"),
    (("seeds: [1, 2, 3]", "seeds: one"), "seeds"),
    (("method: ibpo", "method: ibpo_typo"), "ibpo_typo"),
    (("primary_statistic: auc_paired", "primary_statistic: final_accuracy"), "primary_statistic"),
    (("primary_statistic: auc_paired", "primary_statistic: auc_paired\nreference: rredcot"), "reference 'rredcot'"),
    (("primary_statistic: auc_paired", "primary_statistic: auc_paired\ncorrection: bonferroni"), "only 'holm'"),
    (("setting: hard\n", ""), "setting"),
    (("steps: 100", "steps: [100"), "flow sequence"),  # not YAML
])
def test_registration_schema_refuses_a_bad_file(tmp_path, change, message):
    path = tmp_path / "bad.yaml"
    path.write_text(REGISTRATION.replace(*change))
    with pytest.raises(ValueError, match=message):
        verdict.load_registration(path)


def test_runs_missing_or_not_as_registered_are_reported_and_the_arm_left_undecided(tmp_path):
    """Of ibpo's three registered seeds the ledger holds two, one of them at another rate: one run is used, both
    others are listed, and the arm is "incomplete" although its statistics are shown."""
    (tmp_path / "check.yaml").write_text(REGISTRATION)
    registration = verdict.load_registration(tmp_path / "check.yaml")
    folder = tmp_path / "ledger" / "hard" / "main"
    folder.mkdir(parents=True)
    for name in ("grpo_seed1", "grpo_seed2", "grpo_seed3", "ibpo_seed1", "ibpo_seed2"):
        shutil.copy(LEDGER / "hard" / "main" / f"{name}.json", folder)
    moved = json.loads((folder / "ibpo_seed2.json").read_text())
    moved["spec"]["lr"] = 1e-4
    (folder / "ibpo_seed2.json").write_text(json.dumps(moved))
    result = verdict.verdict(registration, tmp_path / "ledger")
    assert result["arms"]["ibpo"]["missing_seeds"] == [3]
    assert result["arms"]["ibpo"]["not_as_registered"] == {"2": "lr 0.0001"}
    assert result["arms"]["ibpo"]["seeds"] == [1] and result["arms"]["grpo"]["seeds"] == [1, 2, 3]
    comparison = result["comparisons"]["grpo"]["ibpo"]
    assert comparison["decision"] == "incomplete" and comparison["paired"] is None  # one pair: no test
    assert set(comparison["criteria"]) == {"auc_above_after_holm", "time_shift_at_least", "time_shift_interval_above"}


def test_decision_follows_the_registered_rule():
    rule = verdict.DecisionRule(alpha=0.05, time_shift_at_least=1.5, time_shift_interval_above=1.0, text="rule")
    comparison = {"paired": {"difference": 0.03, "p_holm": 0.01},
                  "time_shift": {"paired": {"estimate": 1.6, "ci95": [1.1, 2.2]}, "unpaired": None}}
    assert verdict.decide(comparison, rule, "auc_paired", True)["decision"] == "beats"
    assert verdict.decide(comparison, rule, "auc_paired", False)["decision"] == "incomplete"
    slow = {**comparison, "time_shift": {"paired": {"estimate": 1.6, "ci95": [0.9, 2.2]}}}
    assert verdict.decide(slow, rule, "auc_paired", True) == {"decision": "not resolved", "criteria": {
        "auc_above_after_holm": True, "time_shift_at_least": True, "time_shift_interval_above": False}}
    worse = {**comparison, "paired": {"difference": -0.03, "p_holm": 0.01}}
    assert verdict.decide(worse, rule, "auc_paired", True)["decision"] == "below"


@pytest.mark.parametrize("heading, sources", [
    ("### Restated (2026-11-27)", [("restated_hard", "grpo"), ("restated_hard", "grpo_n6"), ("restated_long", "grpo")]),
    ("### The verdict", [("verdict", "grpo_n5"), ("verdict", "grpo")]),
], ids=["restated", "verdict"])
def test_results_md_verdict_tables_are_the_committed_json(heading, sources):
    """RESULTS.md's tables of a verdict ("Restated" in §3: hard against GRPO and against GRPO with 6 rollouts, long
    against GRPO; "The verdict": the registered study against GRPO at equal compute and at equal rollouts): every row
    is its arm's comparison in the committed results/<name>.json, at the rounding shown."""
    results = LEDGER.parent
    text = (results.parent / "RESULTS.md").read_text(encoding="utf-8").replace("\u2212", "-")
    section = text[text.index(heading):]
    section = section[:min(section.index(end, 1) for end in ("\n### ", "\n## ") if end in section[1:])]
    tables = [rows for header, rows in re.findall(r"^(\| arm \|.*?)\n\|---.*?\n((?:\|.*\n)+)", section, re.M)
              if "time shift" in header]  # the comparison tables, not the verdict's step-time and reward tables
    assert len(tables) == len(sources)

    def signed_interval(test):
        return f"{test['difference']:+.3f} [{test['ci95'][0]:+.3f}, {test['ci95'][1]:+.3f}]"

    def p_values(test):
        return " -> ".join("<0.001" if p < 0.001 else f"{p:.3f}" for p in (test["p"], test["p_holm"]))

    def shift(fit):
        if fit is None:  # time shift not applicable: the reference's curve does not rise
            return "n/a"
        high = fit["ci95"][1]
        return f"{fit['estimate']:.2f} [{fit['ci95'][0]:.2f}, {'>100' if high > 100 else f'{high:.2f}'}]"

    for rows, (name, reference) in zip(tables, sources):
        block = json.loads((results / f"{name}.json").read_text())["comparisons"][reference]
        shown = {}
        for row in rows.strip().splitlines():
            cells = [cell.strip().replace("\u2192", "->") for cell in row.strip("|").split("|")]
            shown[cells[0].strip("`")] = cells[1:]
        assert set(shown) == set(block), name
        for arm, cells in shown.items():
            c = block[arm]
            assert (c["time_shift"]["paired"] is None) == (c["time_shift"]["not_applicable"] is not None)
            expected = [signed_interval(c["paired"]), p_values(c["paired"]), signed_interval(c["unpaired"]),
                        p_values(c["unpaired"]), shift(c["time_shift"]["paired"])]
            if len(cells) == 8:  # the full tables: seeds first, the unpaired time shift and the decision last
                expected = [str(len(c["seeds"])), *expected, shift(c["time_shift"]["unpaired"]), c["decision"]]
            assert cells == expected, (name, reference, arm)


# ------------------------------------------------------------------ where the time shift applies, step time, reward
def test_reference_rises_compares_the_last_third_with_step_zero():
    rising = verdict.reference_rises(curve(GRID, grpo_at(GRID)))
    assert rising["rises"] and rising["start"] == 0.40
    assert rising["tail_steps"] == [70, 80, 90, 100]  # steps >= 2/3 of 100
    assert rising["tail_mean"] == pytest.approx(np.mean(grpo_at(np.array([70, 80, 90, 100]))))
    # Up at step 10, then back below the start: the last third decides, not the first gain.
    falling = verdict.reference_rises(curve([0, 10, 20, 30, 40, 50, 60], [0.5, 0.55, 0.4, 0.35, 0.3, 0.32, 0.31]))
    assert not falling["rises"] and falling["tail_steps"] == [40, 50, 60]
    assert falling["tail_mean"] == pytest.approx(0.31)
    assert not verdict.reference_rises(curve([0, 10, 20], [0.5, 0.5, 0.5]))["rises"]  # flat is not rising


def summary(points, step_s=1.0, first=0.2, last=0.2):
    return {"validation": points, "median_step_s": step_s,
            "diagnostics": {"first": {verdict.REWARD_KEY: first}, "last": {verdict.REWARD_KEY: last}}}


def test_time_shift_is_not_applicable_against_a_falling_reference():
    """Against a reference whose curve falls, a run that falls faster would read as 'faster': no factor is given."""
    steps = [0, 10, 20, 30]
    reference = {1: summary(curve(steps, [0.5, 0.45, 0.4, 0.35])), 2: summary(curve(steps, [0.5, 0.44, 0.41, 0.36]))}
    faster = {1: summary(curve(steps, [0.5, 0.4, 0.3, 0.25])), 2: summary(curve(steps, [0.5, 0.38, 0.33, 0.2]))}
    result = verdict.compare(faster, reference, 30, 1, 0.05)
    assert result["time_shift"]["paired"] is None and result["time_shift"]["unpaired"] is None
    assert "does not rise" in result["time_shift"]["not_applicable"]
    assert result["time_shift"]["reference_curve"]["rises"] is False
    assert result["paired"] is not None  # the AUC statistics are unchanged
    rule = verdict.DecisionRule(alpha=0.05, time_shift_at_least=1.5, time_shift_interval_above=1.0, text="rule")
    criteria = verdict.decide({**result, "paired": {**result["paired"], "p_holm": 0.01}}, rule, "auc_paired", True)
    assert criteria["criteria"]["time_shift_at_least"] is False  # no factor: the criterion is unmet
    # The same runs against a rising reference get a factor.
    rising = {1: summary(curve(steps, [0.5, 0.55, 0.6, 0.65])), 2: summary(curve(steps, [0.5, 0.56, 0.6, 0.67]))}
    shifted = verdict.compare(faster, rising, 30, 1, 0.05)["time_shift"]
    assert shifted["not_applicable"] is None and shifted["paired"]["estimate"] > 0


def test_step_times_are_medians_with_ratios_paired_by_seed():
    """Arm a: 2, 3, 10 s; reference r: 1, 2, 4 s; reference q: 2, 3, 9 s. a/r by seed 2, 1.5, 2.5 (median 2,
    geometric mean (2 x 1.5 x 2.5)^(1/3)); a/q 1, 1, 1.11 (median 1): q is the nearer equal time."""
    points = curve([0, 10], [0.5, 0.5])
    runs = {name: {"runs": {seed: summary(points, s) for seed, s in zip((1, 2, 3), times)}}
            for name, times in (("a", (2.0, 3.0, 10.0)), ("r", (1.0, 2.0, 4.0)), ("q", (2.0, 3.0, 9.0)))}
    result = verdict.step_times(runs, ["r", "q"])
    assert result["arms"]["a"] == {"per_seed": {"1": 2.0, "2": 3.0, "3": 10.0}, "median": 3.0, "min": 2.0, "max": 10.0}
    ratio = result["ratio_to_reference"]["r"]["a"]
    assert ratio["per_seed"] == pytest.approx({"1": 2.0, "2": 1.5, "3": 2.5})
    assert (ratio["median"], ratio["min"], ratio["max"]) == (2.0, 1.5, 2.5)
    assert ratio["geometric_mean"] == pytest.approx((2 * 1.5 * 2.5) ** (1 / 3))
    assert result["ratio_to_reference"]["q"]["a"]["median"] == 1.0
    assert result["nearest_equal_time"]["a"] == {"reference": "q", "median_ratio": 1.0}
    runs["a"]["runs"][3]["median_step_s"] = None  # a run without timings is left out, not counted as 0
    assert verdict.step_times(runs, ["r"])["arms"]["a"]["max"] == 3.0


def test_training_signal_reads_the_ledgers_two_reward_windows():
    """Rewards (first, last): arm a (0.2, 0.3), (0.2, 0.4), (0.3, 0.3): changes 0.1, 0.2, 0.0; reference r's last
    window 0.2, 0.2, 0.25, so a - r by seed is 0.1, 0.2, 0.05."""
    points = curve([0, 10, 20], [0.5, 0.45, 0.4])
    runs = {"a": {"runs": {1: summary(points, first=0.2, last=0.3), 2: summary(points, first=0.2, last=0.4),
                           3: summary(points, first=0.3, last=0.3)}},
            "r": {"runs": {1: summary(points, last=0.2), 2: summary(points, last=0.2), 3: summary(points, last=0.25)}}}
    result = verdict.training_signal(runs, ["r"], 0.05)
    arm = result["arms"]["a"]
    assert arm["reward_change"]["per_seed"] == pytest.approx({"1": 0.1, "2": 0.2, "3": 0.0})
    assert arm["reward_change"]["ci95"] == pytest.approx(verdict.t_interval([0.1, 0.2, 0.0]))
    assert arm["reward_last"]["mean"] == pytest.approx(1 / 3) and arm["reward_first"]["max"] == 0.3
    assert arm["validation_start"]["mean"] == 0.5 and arm["validation_end"]["mean"] == pytest.approx(0.4)
    assert arm["validation_end_step"] == [20]
    against = result["last_window_against_reference"]["r"]["a"]
    assert against["per_seed"] == pytest.approx({"1": 0.1, "2": 0.2, "3": 0.05})
    assert against["p_holm"] == pytest.approx(against["p"])  # a family of one
    assert result["window_steps"] == 10 and result["reward_key"] == "critic/score/mean"


# -------------------------------------------------------------- RESULTS.md's verdict section against verdict.json
RESULTS_DIR = LEDGER.parent
VERDICT = json.loads((RESULTS_DIR / "verdict.json").read_text())


def flat(text: str) -> str:
    return " ".join(text.replace("\u2212", "-").replace("\u00d7", "x").replace("\u2192", "->").replace("\u2014", "-")
                    .split())


def results_section(heading: str) -> str:
    text = (RESULTS_DIR.parent / "RESULTS.md").read_text(encoding="utf-8")
    section = text[text.index(heading):]
    return section[:min(section.index(end, 1) for end in ("\n### ", "\n## ") if end in section[1:])]


def signed(x: float) -> str:
    return f"{x:+.3f}"


def table_rows(section: str, first_header: str) -> dict[str, list[str]]:
    """The rows of the table whose header starts with ``first_header``: {first cell without backticks: cells}."""
    match = re.search(rf"^\| {re.escape(first_header)}.*?\n\|---.*?\n((?:\|.*\n)+)", section, re.M)
    assert match, first_header
    rows = {}
    for row in match.group(1).strip().splitlines():
        cells = [flat(cell.strip()) for cell in row.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_results_md_verdict_step_times_are_the_json():
    """The verdict's step-time table and sentences: `step_time` in results/verdict.json; the pilot's figures are the
    registration's, and its rollouts are ``equal_compute_rollouts`` of them."""
    section = results_section("### The verdict")
    step = VERDICT["step_time"]
    rows = table_rows(section, "arm | step, s")
    assert set(rows) == set(step["arms"])

    def ranged(x, unit=""):
        return f"{x['median']:.2f}{unit} [{x['min']:.2f}, {x['max']:.2f}]"

    for arm, cells in rows.items():
        ratios = [("-" if arm == reference else ranged(step["ratio_to_reference"][reference][arm]))
                  for reference in ("grpo_n5", "grpo")]
        assert cells == [ranged(step["arms"][arm]), *ratios], arm
    text = flat(section)
    exit_n5, exit_grpo = (step["ratio_to_reference"][reference]["rredcot_exit_probe"] for reference in ("grpo_n5", "grpo"))
    assert (f"the exit probe's step was {exit_n5['median']:.2f}x `grpo_n5`'s (median over seeds, "
            f"{exit_n5['min']:.2f}-{exit_n5['max']:.2f}) and {exit_grpo['median']:.2f}x `grpo`'s "
            f"({exit_grpo['min']:.2f}-{exit_grpo['max']:.2f})") in text
    nearest = step["nearest_equal_time"]["rredcot_exit_probe"]["reference"]
    assert f"the GRPO arm nearest the exit probe's step time was `{nearest}`" in text
    assert abs(math.log(exit_n5["median"])) < abs(math.log(exit_grpo["median"]))  # "grpo was nearly as near"
    own = step["arms"]["rredcot_exit_probe"]
    assert f"the exit probe's own runs ranged {own['min']:.2f} -> {own['max']:.2f} s" in text
    n5 = step["ratio_to_reference"]["grpo"]["grpo_n5"]
    assert f"`grpo_n5` took {n5['median']:.2f}x `grpo`'s step ({n5['min']:.2f}-{n5['max']:.2f})" in text
    assert exit_n5["min"] < 1 < exit_n5["max"]  # "not equal compute": the per-seed ratios straddle 1 widely
    registration = (RESULTS_DIR.parent / "registrations" / "verdict.yaml").read_text()
    grpo_s, exit_s = map(float, re.search(r"median step ([0-9.]+) s and ([0-9.]+) s", registration).groups())
    rollouts = verdict.equal_compute_rollouts(exit_s, grpo_s, 4)
    assert (f"gave GRPO {grpo_s:.3f} s and `rredcot_exit_probe` {exit_s:.3f} s a step, {exit_s / grpo_s:.2f}x, hence "
            f"{rollouts:.2f} rollouts and `grpo_n5`") in text


def test_results_md_verdict_training_signal_is_the_json():
    """The verdict's reward and accuracy table and the sentences that quote it: `training_signal` in verdict.json."""
    section = results_section("### The verdict")
    signal = VERDICT["training_signal"]
    reference = VERDICT["registration"]["reference"]
    rows = table_rows(section, "arm | reward, first")
    assert set(rows) == set(signal["arms"])

    def ranged(x):
        return f"{x['mean']:.3f} [{x['min']:.3f}, {x['max']:.3f}]"

    def interval(x, difference="difference"):
        return f"{signed(x[difference])} [{signed(x['ci95'][0])}, {signed(x['ci95'][1])}]"

    for arm, cells in rows.items():
        a = signal["arms"][arm]
        test = signal["last_window_against_reference"][reference].get(arm)
        assert a["validation_end_step"] == [VERDICT["registration"]["steps"]]
        assert cells == [ranged(a["reward_first"]), ranged(a["reward_last"]), interval(a["reward_change"], "mean"),
                         "-" if test is None else interval(test),
                         "-" if test is None else f"{test['p']:.3f} -> {test['p_holm']:.3f}",
                         f"{a['validation_start']['mean']:.3f} -> {ranged(a['validation_end'])}"], arm
    # "No arm trained": no change interval above 0, every arm's greedy accuracy ends below its start.
    assert all(a["reward_change"]["ci95"][0] <= 0 for a in signal["arms"].values())
    assert all(a["validation_end"]["max"] < a["validation_start"]["min"] for a in signal["arms"].values())
    text = flat(section)
    tests = {arm: t for arm, t in signal["last_window_against_reference"][reference].items()}
    differences = [t["difference"] for t in tests.values()]
    assert f"is {signed(min(differences))} to {signed(max(differences))} from `{reference}`'s" in text
    excluding = [arm for arm, t in tests.items() if t["ci95"][0] > 0 or t["ci95"][1] < 0]
    assert excluding == ["rredcot_repairs_degenerate"] and all(t["p_holm"] >= 0.05 for t in tests.values())
    bank = tests["rredcot_repairs_degenerate"]
    assert f"({interval(bank)}, p {bank['p']:.3f}), not after Holm over the 4 arms ({bank['p_holm']:.3f})" in text
    starts = {a["validation_start"]["mean"] for a in signal["arms"].values()}
    (start,) = starts
    ends = [a["validation_end"]["mean"] for a in signal["arms"].values()]
    runs = [v for a in signal["arms"].values() for v in a["validation_end"]["per_seed"].values()]
    assert (f"from {start:.3f} at the warm start to {min(ends):.3f}-{max(ends):.3f} at step 60 (arm means; runs "
            f"{min(runs):.3f}-{max(runs):.3f})") in text
    assert "a digit-margin analysis quoted here before is withdrawn, because the step-60 checkpoints" in text
    # The time shift is not applicable against either reference: their curves fall.
    for name, block in VERDICT["comparisons"].items():
        curves = {c["time_shift"]["reference_curve"]["tail_mean"] for c in block.values()}
        assert len(curves) == 1 and all(c["time_shift"]["not_applicable"] for c in block.values())
    tail = {name: next(iter(block.values()))["time_shift"]["reference_curve"] for name, block in
            VERDICT["comparisons"].items()}
    assert (f"`grpo_n5`'s averages {tail['grpo_n5']['tail_mean']:.3f} over steps {tail['grpo_n5']['tail_steps'][0]}-"
            f"{tail['grpo_n5']['tail_steps'][-1]} against {tail['grpo_n5']['start']:.3f} at step 0, `grpo`'s "
            f"{tail['grpo']['tail_mean']:.3f}") in text


def test_results_md_verdict_reading_rate_and_value_figures_are_the_json():
    """The corrected reading in the opening paragraph, the goals table and the verdict section; the rate's origin
    (the default setting's sweep ledger: one seed, 30 steps; no sweep on the study's setting); the exit probe's
    value figures on that setting (results/value_quality_early.json), state-level and within-trace side by side."""
    text = (RESULTS_DIR.parent / "RESULTS.md").read_text(encoding="utf-8")
    whole, section = flat(text), flat(results_section("### The verdict"))
    signal = VERDICT["training_signal"]["arms"]
    first = [a["reward_first"]["mean"] for a in signal.values()]
    last = [a["reward_last"]["mean"] for a in signal.values()]
    ends = [a["validation_end"]["mean"] for a in signal.values()]
    means = (f"{min(first):.3f}-{max(first):.3f} over the first 10 steps, {min(last):.3f}-{max(last):.3f} over the "
             "last 10")
    assert f"(arm means {means})" in whole  # the opening paragraph
    assert f"sampled reward {means} (arm means)" in whole  # the goals table
    assert whole.count(f"0.508 at the warm start to {min(ends):.3f}-{max(ends):.3f} at step 60") == 2
    assert f"greedy accuracy 0.508 -> {min(ends):.3f}-{max(ends):.3f} at step 60 in every arm" in whole
    assert "inconclusive, because its setting failed: no arm trained" in whole
    assert "inconclusive: the setting failed" in section and "level with GRPO at equal compute" not in whole.replace(
        "is level with GRPO at equal compute, as this section and the README read before", "")
    primary = VERDICT["comparisons"]["grpo_n5"]["rredcot_exit_probe"]
    paired = primary["paired"]
    shown = f"{signed(paired['difference'])} [{signed(paired['ci95'][0])}, {signed(paired['ci95'][1])}]"
    assert whole.count(f"rollouts {shown}, Holm p {paired['p_holm']:.2f})") == 2  # the opening and the goals table
    exit_n5 = VERDICT["step_time"]["ratio_to_reference"]["grpo_n5"]["rredcot_exit_probe"]
    assert (f"`grpo_n5` was not held at the exit probe's step time (the exit probe's step {exit_n5['min']:.2f}-"
            f"{exit_n5['max']:.2f}x `grpo_n5`'s, seed by seed)") in whole
    assert {c["decision"] for block in VERDICT["comparisons"].values() for c in block.values()} == {"not resolved"}
    # The rate: every arm at GRPO's rate from the default setting's sweep, one seed, 30 steps.
    rates = {arm["lr"] for arm in VERDICT["registration"]["arms"].values()}
    sweep = json.loads((LEDGER / "default" / "sweep" / "grpo_lr3e-05.json").read_text())["spec"]
    assert rates == {sweep["lr"]} == {3e-5}
    assert not (LEDGER / VERDICT["registration"]["setting"] / "sweep").exists()
    seeds = {json.loads(path.read_text())["spec"]["seed"] for path in (LEDGER / "default" / "sweep").glob("*.json")}
    assert seeds == {sweep["seed"]}
    assert (f"a {sweep['steps']}-step sweep on one seed (training seed {sweep['seed']}) on the `default` setting"
            in section)
    early = json.loads((RESULTS_DIR / "value_quality_early.json").read_text())
    states, segments = early["states"]["exit_selfnorm"], early["segments"]
    pooled, within = f"{states['spearman']:.2f}", f"{states['within_spearman']:.2f}"
    localised, mc = (f"{segments[name]['localisation']:.0%}" for name in ("exit_selfnorm", "mc"))
    chance = f"{early['localisation_chance']:.0%}"
    assert (f"(states: Spearman {pooled} with Monte-Carlo values, {within} within a trace; segments: first wrong step "
            f"localised {localised}, Monte-Carlo values {mc}, chance {chance})") in whole
    assert f"states: Spearman {pooled} pooled, {within} within a trace; segments: localisation {localised}" in whole
    assert (f"Spearman {pooled} pooled and {within} within a trace, and its segment rewards localise {localised} of "
            f"first wrong steps, Monte-Carlo values {mc}, chance {chance}") in section
    assert (f"(states: Spearman {pooled} pooled, {within} within a trace) and localise {localised} of first errors "
            f"(Monte-Carlo values {mc}, chance {chance})") in section
    assert f"Spearman >= 0.6 **met** ({pooled} pooled over states, {within} within a trace" in whole.replace("≥", ">=")
    # "Spearman 0.75" is never quoted alone: every mention has the within-trace figure beside it.
    for match in re.finditer(rf"Spearman {pooled}\b", whole):
        assert f"{within} within a trace" in whole[match.start():match.start() + 80], whole[match.start() - 80:][:200]
