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
    tables = re.findall(r"^\| arm \|.*?\n\|---.*?\n((?:\|.*\n)+)", section, re.M)
    assert len(tables) == len(sources)

    def signed_interval(test):
        return f"{test['difference']:+.3f} [{test['ci95'][0]:+.3f}, {test['ci95'][1]:+.3f}]"

    def p_values(test):
        return " -> ".join("<0.001" if p < 0.001 else f"{p:.3f}" for p in (test["p"], test["p_holm"]))

    def shift(fit):
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
            expected = [signed_interval(c["paired"]), p_values(c["paired"]), signed_interval(c["unpaired"]),
                        p_values(c["unpaired"]), shift(c["time_shift"]["paired"])]
            if len(cells) == 8:  # the full tables: seeds first, the unpaired time shift and the decision last
                expected = [str(len(c["seeds"])), *expected, shift(c["time_shift"]["unpaired"]), c["decision"]]
            assert cells == expected, (name, reference, arm)
