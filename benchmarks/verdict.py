"""The verdict against GRPO: statistics computed from the committed ledgers for exactly what a registration names.

A registration (``benchmarks/registrations/<name>.yaml``, schema ``Registration``) fixes, before the runs: the setting,
the arms (ledger label -> ``common.METHODS`` method, extra overrides, learning rate, steps), seeds, validation, the
reference arm(s), the primary statistic, the correction and the decision rule. ``load_registration`` refuses a file
that does not fit the schema. The verdict reads ``<ledger>/<setting>/main/<arm>_seed<k>.json`` (what
``sample_efficiency.py`` writes) for every registered arm and seed; a run the ledger lacks is listed as missing, one
launched otherwise than registered as ``not_as_registered`` (with the reason), and an arm with either is decided
"incomplete": nothing is dropped silently.

Per arm against each reference, on the validation steps both share (the shorter run's horizon):

* AUC, the mean height of the greedy validation-accuracy curve (``common.area_under_curve``): unpaired (Welch's t:
  difference of the seed means, Welch-Satterthwaite interval, p) and paired by seed (a seed fixes the order of the
  training prompts, which both runs of a pair see alike: mean difference, t interval, p).
* Holm's step-down adjustment of the p-values over the arms compared with one reference (the family), each test's
  own: a comparison without a p counts in the family and is never rejected. ``ci_bonferroni`` is the simultaneous
  interval at 1 - alpha/m, conservative beside Holm.
* The time shift, GRPO-equivalent steps per step (``time_shift``): for one run, the factor s for which the
  reference's curve at s*t best matches the run's curve at t. Both curves are interpolated linearly between their
  validation points; the loss is the mean squared accuracy difference over every point of either curve that the
  other, rescaled, covers (a run point t where s*t is within the reference's steps, a reference point u where u/s is
  within the run's), so each curve is compared only where the other was observed: a run's points past the
  reference's horizon at that speed, or the reference's past the run's, are censored, not extrapolated. A run that
  never reaches the reference's level gets s < 1 from the part of the reference it does match; one that does not
  learn at all falls to the lower bound 1/16 (``at_bound`` says so). s is searched on a grid of 2^(1/200) over
  [1/16, 16] (ties to the s nearest 1). Identical curves give 1, a curve that is the reference's at twice the speed
  gives 2. Paired: each seed against the reference's run of that seed; unpaired: each run against the reference's
  seed-mean curve (which leaves the reference's own seed spread out of the interval). Over runs: the geometric mean
  with the t interval of log s. **Only where the reference learns** (``reference_rises``): the time shift reads "how
  many of the reference's steps one step is worth", which presumes the reference's curve goes up. The reference's
  seed-mean validation curve (up to the comparison's horizon) counts as rising when the mean of its points in the
  last third of the horizon (steps >= 2/3 of the last step) is above its step-0 value, i.e. it ends above where it
  started. When it does not, both time shifts are null and ``time_shift.not_applicable`` gives the reason: against a
  falling curve a factor above 1 means "falls faster", not "learns faster" (the early study's ``grpo`` against
  ``grpo_n5`` read 1.46 with a lower AUC before this check).

Beside the statistics, read from the same ledger entries and not part of any decision:

* ``step_time``: per arm, the median over its runs of each run's ``median_step_s`` with the runs' minimum and
  maximum; per reference, each arm's step time over the reference's, paired by seed (the runs of one seed ran in one
  sitting), with the median, range and geometric mean of those ratios; and per arm the reference whose median ratio
  is nearest 1 (on a log scale), i.e. the GRPO arm nearest equal time in the study itself, whatever a pilot predicted.
* ``training_signal``: per arm, the sampled training reward (``critic/score/mean``) as the ledger keeps it, the mean
  over a run's first and over its last ``DIAGNOSTIC_WINDOW`` training steps (nothing in between is recorded), its
  change from first to last window paired within runs, the greedy validation accuracy at step 0 and at the last
  step; per reference, each arm's last-window reward minus the reference's, paired by seed, with Holm over the family.

    python -m benchmarks.verdict benchmarks/registrations/verdict.yaml         # results/verdict.json
    python -m benchmarks.verdict benchmarks/registrations/restated_hard.yaml   # results/restated_hard.json
    python -m benchmarks.verdict benchmarks/registrations/restated_long.yaml   # results/restated_long.json
    python -m benchmarks.verdict --equal-compute 2.60 1.66 4   # GRPO's rollouts a prompt at the estimator's step time
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from scipy import stats

from benchmarks import common
from benchmarks.common import area_under_curve, t_interval

LEDGER_DIR = common.RESULTS_DIR / "sample_efficiency_runs"
STATISTICS = ("auc_paired", "auc_unpaired")
TIME_SHIFT_BOUNDS = (1 / 16, 16.0)
TIME_SHIFT_GRID = 200  # grid points per doubling of s
RISING_TAIL = 1 / 3  # reference_rises: the last third of the horizon against step 0
REWARD_KEY = "critic/score/mean"  # the sampled training reward in the ledger's diagnostics
DIAGNOSTIC_WINDOW = 10  # training steps the ledger's diagnostics "first" and "last" average (sample_efficiency.py)


# -------------------------------------------------------------------------------------------------- registration
@dataclass
class Arm:
    method: str = MISSING  # a name of common.METHODS (recipe and overrides)
    overrides: list[str] = field(default_factory=list)  # hydra overrides beyond the method's
    lr: float | None = None  # the learning rate it runs at (None: not checked)
    steps: int | None = None  # None: the registration's


@dataclass
class Validation:
    problems: int = MISSING  # greedy validation set size (sample_efficiency --val-size; not in the ledger)
    every: int = MISSING  # steps between validations (trainer.test_freq)


@dataclass
class DecisionRule:
    alpha: float = 0.05  # family-wise error over the arms compared with the reference
    time_shift_at_least: float | None = None  # the time shift's estimate must reach this
    time_shift_interval_above: float | None = None  # the lower end of its 95% interval must exceed this
    text: str = MISSING  # the rule in words, as registered


@dataclass
class Registration:
    name: str = MISSING  # the verdict's JSON is results/<name>.json
    post_hoc: bool = MISSING  # true: written after the runs (a restatement), not before them
    registered: str = MISSING  # date the file was committed
    setting: str = MISSING  # common.SETTINGS
    seeds: list[int] = MISSING
    steps: int = MISSING
    validation: Validation = MISSING
    arms: dict[str, Arm] = MISSING  # ledger label -> what it runs
    reference: str = "grpo"  # the arm the decision compares with
    secondary_references: list[str] = field(default_factory=list)  # further comparisons, their own Holm family
    primary_statistic: str = "auc_paired"  # STATISTICS
    correction: str = "holm"
    decision_rule: DecisionRule = MISSING


def load_registration(path: Path) -> Registration:
    """The registration at ``path``, checked: keys and types against ``Registration`` (OmegaConf refuses unknown keys
    and wrong types), then the values; a ``ValueError`` names what is wrong."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Registration), OmegaConf.load(path))
        registration: Registration = OmegaConf.to_object(merged)
    except (OmegaConfBaseException, yaml.YAMLError) as error:  # unknown key, wrong type, missing value, bad YAML
        raise ValueError(f"{path}: {error}") from error
    problems = []
    if registration.setting not in common.SETTINGS:
        problems.append(f"setting {registration.setting!r} is none of {sorted(common.SETTINGS)}")
    if not registration.seeds or len(set(registration.seeds)) != len(registration.seeds) or min(registration.seeds) < 1:
        problems.append(f"seeds {registration.seeds}: distinct, at least 1 (seed 0 is the sweep's)")
    for name, arm in registration.arms.items():
        if arm.method not in common.METHODS:
            problems.append(f"arm {name}: method {arm.method!r} is not in benchmarks.common.METHODS")
    for reference in (registration.reference, *registration.secondary_references):
        if reference not in registration.arms:
            problems.append(f"reference {reference!r} is not an arm")
    if registration.primary_statistic not in STATISTICS:
        problems.append(f"primary_statistic {registration.primary_statistic!r} is none of {STATISTICS}")
    if registration.correction != "holm":
        problems.append(f"correction {registration.correction!r}: only 'holm' is implemented")
    if not 0 < registration.decision_rule.alpha < 1:
        problems.append(f"decision_rule.alpha {registration.decision_rule.alpha} is not in (0, 1)")
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems))
    return registration


def arm_steps(registration: Registration, name: str) -> int:
    return registration.arms[name].steps or registration.steps


def registered_runs(registration: Registration, ledger: Path) -> dict[str, dict]:
    """Per arm: {"runs": {seed: ledger summary}, "missing": [seeds], "not_as_registered": {seed: reason}}."""
    folder = ledger / registration.setting / "main"
    arms = {}
    for name, arm in registration.arms.items():
        entry = {"runs": {}, "missing": [], "not_as_registered": {}}
        wanted = [*common.METHODS[arm.method].overrides, *arm.overrides,
                  f"trainer.test_freq={registration.validation.every}"]
        for seed in registration.seeds:
            path = folder / f"{name}_seed{seed}.json"
            if not path.exists():
                entry["missing"].append(seed)
                continue
            record = json.loads(path.read_text())
            spec, reasons = record["spec"], []
            if spec["method"] != arm.method:
                reasons.append(f"method {spec['method']}")
            reasons += [f"override {item} absent" for item in wanted if item not in spec["overrides"]]
            if spec["steps"] != arm_steps(registration, name) or record["summary"]["steps"] < spec["steps"]:
                reasons.append(f"{record['summary']['steps']} of {spec['steps']} steps")
            if arm.lr is not None and not math.isclose(spec["lr"], arm.lr, rel_tol=1e-9):
                reasons.append(f"lr {spec['lr']:g}")
            if reasons:
                entry["not_as_registered"][seed] = ", ".join(reasons)
            else:
                entry["runs"][seed] = record["summary"]
        arms[name] = entry
    return arms


# ---------------------------------------------------------------------------------------------------- statistics
def holm(pvalues: list[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values, in the input order: the i-th smallest of m is multiplied by m - i + 1,
    then made non-decreasing and capped at 1. A None (no test) counts in m as p = 1 and stays None."""
    filled = np.array([1.0 if p is None else p for p in pvalues])
    order = np.argsort(filled, kind="stable")
    adjusted, running = np.empty(len(filled)), 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(filled) - rank) * filled[index]))
        adjusted[index] = running
    return [None if p is None else float(q) for p, q in zip(pvalues, adjusted)]


def _test_result(result, difference: float, n_family: int, alpha: float) -> dict:
    if not np.isfinite(result.pvalue):  # no spread at all: no test
        return {"difference": difference, "ci95": None, "p": None, "ci_bonferroni": None}
    return {"difference": difference, "ci95": list(map(float, result.confidence_interval(0.95))),
            "p": float(result.pvalue), "df": float(result.df),
            "ci_bonferroni": list(map(float, result.confidence_interval(1 - alpha / n_family)))}


def welch(mine: list[float], theirs: list[float], n_family: int = 1, alpha: float = 0.05) -> dict | None:
    """Unpaired: mean(mine) - mean(theirs), Welch's t interval and p; None with fewer than two runs a side."""
    if len(mine) < 2 or len(theirs) < 2:
        return None
    result = stats.ttest_ind(mine, theirs, equal_var=False)
    return {**_test_result(result, float(np.mean(mine) - np.mean(theirs)), n_family, alpha), "n": [len(mine),
                                                                                                   len(theirs)]}


def paired(mine: dict, theirs: dict, n_family: int = 1, alpha: float = 0.05) -> dict | None:
    """Paired by key: the mean of mine[k] - theirs[k] over the keys both have, its t interval and p (None with
    fewer than two pairs)."""
    keys = sorted(set(mine) & set(theirs))
    if len(keys) < 2:
        return None
    result = stats.ttest_rel([mine[k] for k in keys], [theirs[k] for k in keys])
    differences = common.paired_differences(mine, theirs)
    return {**_test_result(result, float(np.mean(differences)), n_family, alpha), "n": len(keys),
            "per_seed": {str(k): float(mine[k] - theirs[k]) for k in keys}}


def time_shift(curve: list[dict], reference: list[dict]) -> dict:
    """GRPO-equivalent steps per step of ``curve`` against ``reference`` (both ``[{"step", "accuracy"}]`` with a
    point at step 0): the module docstring's definition. Returns {"factor", "at_bound"}."""
    steps, accuracy = (np.array([p[key] for p in curve], dtype=float) for key in ("step", "accuracy"))
    ref_steps, ref_accuracy = (np.array([p[key] for p in reference], dtype=float) for key in ("step", "accuracy"))
    mine, theirs = steps > 0, ref_steps > 0  # step 0 maps to step 0 at every s: no information
    tolerance = 1e-9

    def loss(s: float) -> float:
        ahead = mine & (s * steps <= ref_steps[-1] + tolerance)
        behind = theirs & (ref_steps / s <= steps[-1] + tolerance)
        differences = np.concatenate([
            accuracy[ahead] - np.interp(s * steps[ahead], ref_steps, ref_accuracy),
            ref_accuracy[behind] - np.interp(ref_steps[behind] / s, steps, accuracy)])
        return float(np.mean(differences**2))

    low, high = (round(math.log2(bound) * TIME_SHIFT_GRID) for bound in TIME_SHIFT_BOUNDS)
    exponents = np.arange(low, high + 1) / TIME_SHIFT_GRID
    losses = np.array([loss(2.0**e) for e in exponents])
    best = exponents[np.flatnonzero(losses <= losses.min() + 1e-15)]
    exponent = float(best[np.argmin(np.abs(best))])
    return {"factor": 2.0**exponent, "at_bound": exponent in (exponents[0], exponents[-1])}


def geometric_interval(factors: list[float]) -> dict:
    """Geometric mean of positive factors with the 95% t interval of their logs (None below two)."""
    logs = np.log2(factors)
    interval = t_interval(logs)
    return {"estimate": float(2.0 ** logs.mean()), "ci95": None if interval is None else [2.0**x for x in interval],
            "n": len(factors)}


def mean_curve(runs: list[list[dict]]) -> list[dict]:
    """Seed-mean accuracy at the validation steps every run has."""
    shared = sorted(set.intersection(*({p["step"] for p in run} for run in runs)))
    return [{"step": step, "accuracy": float(np.mean([next(p["accuracy"] for p in run if p["step"] == step)
                                                      for run in runs]))} for step in shared]


def up_to(points: list[dict], horizon: int) -> list[dict]:
    return [p for p in points if p["step"] <= horizon]


def reference_rises(curve: list[dict]) -> dict:
    """Whether a validation curve (``[{"step", "accuracy"}]`` with a point at step 0) rises: the mean of its points
    at steps >= (1 - RISING_TAIL) x its last step is above its step-0 value. Returns {"rises", "start",
    "tail_mean", "tail_steps"}."""
    start = next(p["accuracy"] for p in curve if p["step"] == 0)
    last = max(p["step"] for p in curve)
    tail = [p for p in curve if p["step"] > 0 and p["step"] >= (1 - RISING_TAIL) * last - 1e-9]
    tail_mean = float(np.mean([p["accuracy"] for p in tail]))
    return {"rises": bool(tail_mean > start), "start": float(start), "tail_mean": tail_mean,
            "tail_steps": [p["step"] for p in tail]}


def spread(values: dict) -> dict | None:
    """{"per_seed", "median", "min", "max", "mean"} of {seed: value} (None without values)."""
    if not values:
        return None
    numbers = list(values.values())
    return {"per_seed": {str(k): float(v) for k, v in sorted(values.items())}, "median": float(np.median(numbers)),
            "min": float(min(numbers)), "max": float(max(numbers)), "mean": float(np.mean(numbers))}


def step_times(runs: dict[str, dict], references: list[str]) -> dict:
    """The study's own step times (module docstring, ``step_time``) from {arm: {"runs": {seed: summary}}}; a run
    without a recorded ``median_step_s`` is left out."""
    timed = {name: {seed: run["median_step_s"] for seed, run in entry["runs"].items()
                    if run.get("median_step_s") is not None} for name, entry in runs.items()}
    ratios = {}
    for reference in references:
        block = {}
        for name, seconds in timed.items():
            shared = sorted(set(seconds) & set(timed[reference]))
            pairs = {seed: seconds[seed] / timed[reference][seed] for seed in shared}
            block[name] = None if not pairs else {
                **spread(pairs), "geometric_mean": float(np.exp(np.mean(np.log(list(pairs.values())))))}
        ratios[reference] = block
    nearest = {}
    for name in timed:
        candidates = {reference: ratios[reference][name]["median"] for reference in references
                      if reference != name and ratios[reference][name] is not None}
        if candidates:
            best = min(candidates, key=lambda reference: abs(math.log(candidates[reference])))
            nearest[name] = {"reference": best, "median_ratio": candidates[best]}
    return {"arms": {name: None if not seconds else {
        key: value for key, value in spread(seconds).items() if key != "mean"} for name, seconds in timed.items()},
        "ratio_to_reference": ratios, "nearest_equal_time": nearest}


def training_signal(runs: dict[str, dict], references: list[str], alpha: float) -> dict:
    """Whether anything trained (module docstring, ``training_signal``) from {arm: {"runs": {seed: summary}}}; a run
    without the reward in its diagnostics is left out of the reward's figures."""
    reward = {name: {window: {seed: run["diagnostics"][window][REWARD_KEY] for seed, run in entry["runs"].items()
                              if REWARD_KEY in ((run.get("diagnostics") or {}).get(window) or {})}
                     for window in ("first", "last")} for name, entry in runs.items()}
    arms = {}
    for name, entry in runs.items():
        first, last = reward[name]["first"], reward[name]["last"]
        change = {seed: last[seed] - first[seed] for seed in sorted(set(first) & set(last))}
        interval = t_interval(list(change.values())) if change else None
        start = {seed: next(p["accuracy"] for p in run["validation"] if p["step"] == 0)
                 for seed, run in entry["runs"].items()}
        end = {seed: run["validation"][-1]["accuracy"] for seed, run in entry["runs"].items()}
        arms[name] = {"reward_first": spread(first), "reward_last": spread(last),
                      "reward_change": None if not change else {**spread(change), "ci95": interval},
                      "validation_start": spread(start), "validation_end": spread(end),
                      "validation_end_step": sorted({run["validation"][-1]["step"] for run in entry["runs"].values()})}
    against = {}
    for reference in references:
        family = [name for name in runs if name != reference]
        tests = {name: paired(reward[name]["last"], reward[reference]["last"], len(family), alpha) for name in family}
        for name, adjusted in zip(family, holm([None if tests[n] is None else tests[n]["p"] for n in family])):
            if tests[name] is not None:
                tests[name]["p_holm"] = adjusted
        against[reference] = tests
    return {"reward_key": REWARD_KEY, "window_steps": DIAGNOSTIC_WINDOW, "arms": arms,
            "last_window_against_reference": against}


def equal_compute_rollouts(estimator_step_s: float, grpo_step_s: float, grpo_rollouts: int,
                           other_step_s: float | None = None, other_rollouts: int | None = None) -> float:
    """GRPO's rollouts a prompt whose step takes the estimator's median step time, all measured in one sitting.
    From one GRPO measurement, step time proportional to rollouts: n * estimator / GRPO. From two (n1, t1), (n2, t2),
    the line through them (a fixed cost per step plus a cost per rollout): n = n1 + (estimator - t1) (n2 - n1) /
    (t2 - t1). Round to the nearest integer to launch it."""
    if other_step_s is None:
        return grpo_rollouts * estimator_step_s / grpo_step_s
    slope = (other_step_s - grpo_step_s) / (other_rollouts - grpo_rollouts)
    if slope <= 0:
        raise ValueError("GRPO's step time does not grow with its rollouts in these measurements")
    return grpo_rollouts + (estimator_step_s - grpo_step_s) / slope


# ------------------------------------------------------------------------------------------------------- verdict
def compare(runs: dict[int, dict], reference_runs: dict[int, dict], horizon: int, n_family: int,
            alpha: float) -> dict:
    """One arm's complete runs against the reference's ({seed: ledger summary}), on steps up to ``horizon``."""
    curves = {seed: up_to(run["validation"], horizon) for seed, run in runs.items()}
    reference = {seed: up_to(run["validation"], horizon) for seed, run in reference_runs.items()}
    auc = {seed: area_under_curve(curve) for seed, curve in curves.items()}
    reference_auc = {seed: area_under_curve(curve) for seed, curve in reference.items()}
    paired_auc = {}
    for seed in sorted(set(curves) & set(reference)):
        paired_auc[seed] = tuple(map(area_under_curve, common.on_shared_steps(curves[seed], reference[seed])))
    mean_reference = mean_curve(list(reference.values())) if reference else []
    rising = reference_rises(mean_reference) if mean_reference else None
    shifts = {"paired": [time_shift(curves[seed], reference[seed]) for seed in sorted(paired_auc)],
              "unpaired": [time_shift(curve, mean_reference) for curve in curves.values()] if mean_reference else []}
    not_applicable = None
    if rising is not None and not rising["rises"]:
        not_applicable = (f"the reference's seed-mean curve does not rise: {rising['tail_mean']:.3f} over steps "
                          f"{rising['tail_steps'][0]}-{rising['tail_steps'][-1]} against {rising['start']:.3f} at "
                          "step 0, so a factor would say how fast a run follows its fall, not how fast it learns")
        shifts = {"paired": [], "unpaired": []}
    return {
        "horizon": horizon, "seeds": sorted(curves), "reference_seeds": sorted(reference),
        "auc": {str(seed): value for seed, value in auc.items()},
        "reference_auc": {str(seed): value for seed, value in reference_auc.items()},
        "unpaired": welch(list(auc.values()), list(reference_auc.values()), n_family, alpha),
        "paired": paired({s: pair[0] for s, pair in paired_auc.items()}, {s: pair[1] for s, pair in paired_auc.items()},
                         n_family, alpha),
        "time_shift": {**{kind: None if not fits else {**geometric_interval([fit["factor"] for fit in fits]),
                                                       "per_run": [fit["factor"] for fit in fits],
                                                       "at_bound": any(fit["at_bound"] for fit in fits)}
                          for kind, fits in shifts.items()},
                       "reference_curve": rising, "not_applicable": not_applicable},
    }


def decide(comparison: dict, rule: DecisionRule, statistic: str, complete: bool) -> dict:
    """The registered rule on one comparison: "beats" (difference above 0 with Holm p below alpha, and the time
    shift's criteria where registered), "below" (difference below 0 with Holm p below alpha), else "not resolved";
    "incomplete" when a registered run of the arm or the reference is missing or not as registered."""
    test = comparison[statistic.removeprefix("auc_")]
    shift = comparison["time_shift"]["paired" if statistic == "auc_paired" else "unpaired"]
    significant = test is not None and test["p_holm"] is not None and test["p_holm"] < rule.alpha
    criteria = {"auc_above_after_holm": significant and test["difference"] > 0}
    if rule.time_shift_at_least is not None:
        criteria["time_shift_at_least"] = shift is not None and shift["estimate"] >= rule.time_shift_at_least
    if rule.time_shift_interval_above is not None:
        criteria["time_shift_interval_above"] = (shift is not None and shift["ci95"] is not None
                                                 and shift["ci95"][0] > rule.time_shift_interval_above)
    if not complete:
        decision = "incomplete"
    elif all(criteria.values()):
        decision = "beats"
    elif significant and test["difference"] < 0:
        decision = "below"
    else:
        decision = "not resolved"
    return {"decision": decision, "criteria": criteria}


def verdict(registration: Registration, ledger: Path = LEDGER_DIR) -> dict:
    """The verdict JSON: the registration, per arm its runs (and what is missing), per reference every other arm
    compared with it, Holm-adjusted within that reference's family, and the registered decision."""
    runs = registered_runs(registration, ledger)
    rule = registration.decision_rule
    comparisons = {}
    references = [registration.reference, *registration.secondary_references]
    for reference in references:
        family = [name for name in registration.arms if name != reference]
        block = {name: compare(runs[name]["runs"], runs[reference]["runs"],
                               min(arm_steps(registration, name), arm_steps(registration, reference)),
                               len(family), rule.alpha) for name in family}
        for kind in ("paired", "unpaired"):
            tests = [block[name][kind] for name in family]
            for test, adjusted in zip(tests, holm([None if t is None else t["p"] for t in tests])):
                if test is not None:
                    test["p_holm"] = adjusted
        for name in family:
            complete = not any(runs[arm]["missing"] or runs[arm]["not_as_registered"] for arm in (name, reference))
            block[name].update(decide(block[name], rule, registration.primary_statistic, complete))
        comparisons[reference] = block
    return {
        "registration": asdict(registration),
        "arms": {name: {"seeds": sorted(entry["runs"]), "missing_seeds": entry["missing"],
                        "not_as_registered": {str(seed): reason for seed, reason in entry["not_as_registered"].items()},
                        "auc": {str(seed): run["auc"] for seed, run in entry["runs"].items()},
                        "median_step_s": {str(seed): run["median_step_s"] for seed, run in entry["runs"].items()}}
                 for name, entry in runs.items()},
        "comparisons": comparisons,
        "step_time": step_times(runs, references),
        "training_signal": training_signal(runs, references, rule.alpha),
        "meta": {"ledger": str(ledger / registration.setting / "main"), "time_shift_bounds": list(TIME_SHIFT_BOUNDS),
                 "time_shift_grid_per_doubling": TIME_SHIFT_GRID, **common.machine_meta()},
    }


def print_table(result: dict) -> None:
    def interval(test, digits=3):
        return "-" if test is None or test["ci95"] is None else (
            f"{test['difference']:+.{digits}f} [{test['ci95'][0]:+.{digits}f}, {test['ci95'][1]:+.{digits}f}]")

    def p_values(test):
        return "-" if test is None or test["p"] is None else f"{test['p']:.3f} -> {test['p_holm']:.3f}"

    for reference, block in result["comparisons"].items():
        width = max(len(name) for name in block) + 1
        print(f"\nagainst {reference}: AUC difference (paired / unpaired), p -> Holm, time shift (paired), decision")
        for name, c in block.items():
            shift = c["time_shift"]["paired"]
            shown = "n/a" if c["time_shift"]["not_applicable"] else "-" if shift is None or shift["ci95"] is None \
                else f"{shift['estimate']:.2f} [{shift['ci95'][0]:.2f}, {shift['ci95'][1]:.2f}]"
            print(f"{name:<{width}}{interval(c['paired']):>27} {p_values(c['paired']):>15}"
                  f"{interval(c['unpaired']):>27} {p_values(c['unpaired']):>15} {shown:>20}  {c['decision']}")
    for reference, block in result["comparisons"].items():
        reasons = {c["time_shift"]["not_applicable"] for c in block.values()} - {None}
        for reason in reasons:
            print(f"time shift against {reference} not applicable: {reason}")
    print("\nstep time (median of runs' median step, range), over each reference paired by seed: median [range]")
    for name, arm in result["step_time"]["arms"].items():
        ratios = "  ".join(f"/{reference} {r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}]" for reference, block in
                           result["step_time"]["ratio_to_reference"].items() if (r := block[name]) is not None)
        print(f"{name:<30} {arm['median']:.2f} s [{arm['min']:.2f}, {arm['max']:.2f}]  {ratios}" if arm else name)
    signal = result["training_signal"]
    print(f"\nsampled reward ({signal['reward_key']}, first / last {signal['window_steps']} steps, mean over runs), "
          "greedy validation start -> end")
    for name, arm in signal["arms"].items():
        if arm["reward_first"] and arm["reward_last"]:
            print(f"{name:<30} {arm['reward_first']['mean']:.3f} -> {arm['reward_last']['mean']:.3f}   "
                  f"{arm['validation_start']['mean']:.3f} -> {arm['validation_end']['mean']:.3f}")
    for name, arm in result["arms"].items():
        if arm["missing_seeds"] or arm["not_as_registered"]:
            print(f"{name}: missing seeds {arm['missing_seeds']}, not as registered {arm['not_as_registered']}")


def main(argv: list[str] | None = None) -> dict | float:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("registration", type=Path, nargs="?", help="benchmarks/registrations/<name>.yaml")
    cli.add_argument("--ledger", type=Path, default=LEDGER_DIR, help="the sample-efficiency ledger's root")
    cli.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/<registration name>.json")
    cli.add_argument("--equal-compute", nargs="+", type=float, metavar="S",
                     help="ESTIMATOR_S GRPO_S GRPO_N [GRPO_S2 GRPO_N2]: GRPO's rollouts at the estimator's step time")
    args = cli.parse_args(argv)
    if args.equal_compute:
        if len(args.equal_compute) not in (3, 5):
            cli.error("--equal-compute takes ESTIMATOR_S GRPO_S GRPO_N [GRPO_S2 GRPO_N2]")
        values = args.equal_compute
        rollouts = equal_compute_rollouts(values[0], values[1], int(values[2]), *(
            (values[3], int(values[4])) if len(values) == 5 else ()))
        print(f"GRPO at the estimator's step time: {rollouts:.2f} rollouts a prompt (launch {round(rollouts)})")
        return rollouts
    if args.registration is None:
        cli.error("a registration file is required")
    registration = load_registration(args.registration)
    result = verdict(registration, args.ledger)
    print_table(result)
    return common.write_result(result, args.out or common.RESULTS_DIR / f"{registration.name}.json")


if __name__ == "__main__":
    main()
