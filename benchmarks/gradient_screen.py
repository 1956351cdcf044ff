"""Can credit pay on a setting at all? The gradient-level screen of every setting against the paper's three conditions.

RREDCoT's claim needs three things at once: (1) the policy can value its own states, (2) traces hold many uncertain
decisions, (3) training that moves. This script reads, per setting and policy (the warm start, and a GRPO policy
mid-training), the screen's gradient run (``python -m benchmarks.gradient_quality --screen --setting S
[--policy-grpo-steps 50]``, ``results/gradient_screen_runs/<setting>[_policy].json``: 16 paired batches of 32
prompts × 4 rollouts, each method's cosine with the pool's reference gradient g* minus GRPO's, t interval over the
batches) and the GRPO runs of ``sample_efficiency``'s ledger, and judges:

- **the ceiling**: Monte-Carlo values with K = 16 continuations a state through today's sigma shares (``mc_ceiling``
  with the recipe's affine mapping, ``mc_ceiling_raw`` without one) and through signed value differences
  (``mc_ceiling_signed``; ``_degenerate`` lets all-equal groups learn from them too), without the value gate: it
  guards a run against uninformative values, and judged on one batch it closed on near-true values by chance (a
  batch where a form's gradient is GRPO's is counted, ``ceiling_batches_at_grpo``). Its best form's cosine − GRPO's
  interval above 0 means credit can pay on that setting when values are near the truth; no form above 0 means it
  cannot, whatever the value source. The verifier's step oracle (``step_oracle``: 0.9 before the segment completing
  the first wrong line, 0 after) is a diagnostic of localisation alone, not a ceiling;
- **(1) self-values**: the exit probe's values against the ceiling's Monte-Carlo values of the same states (the
  run's distinct traces): pooled state-level Spearman, mean within-trace Spearman, and localisation of the first
  wrong step (argmin of R_k = V_k − V_{k-1} on the segment the verifier names) beside Monte-Carlo's own, and the
  within-trace Spearman exact values would reach against K = 16 draws (the bar's reach); bars
  within-trace ≥ 0.6 and localisation ≥ 60%;
- **(2) decisions**: median segments a trace (the recipes' entropy segmentation, at most ``max_segments`` = 8); bar ≥ 8;
- **(3) training moves**: GRPO's main runs on the setting, or on a setting without them the runs at the best rate of
  GRPO's own sweep there (``benchmarks/grpo_sweep.py``): greedy validation accuracy at the last step minus step 0,
  sampled training reward over the last 10 steps minus the first 10, seed means; bar ≥ 0.05 on both, at a rate
  swept on the setting itself (≥ 3 rates with warmup, ≥ 2 seeds, 100 steps).

Intervals are per comparison (95%, t over the 16 batches), not corrected: the screen gates a study, it is not one.

    python -m benchmarks.gradient_screen          # results/gradient_screen.json from the runs and the ledgers
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # ``python benchmarks/gradient_screen.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common
from benchmarks.grpo_sweep import RECIPE_TRAIN_BATCH, SWEEP_FOLDER, greedy_and_sampled_rise, train_batch_of
from benchmarks.output import print_table

RUNS_DIR = common.RESULTS_DIR / "gradient_screen_runs"
LEDGER_DIR = common.RESULTS_DIR / "sample_efficiency_runs"
OUT = common.RESULTS_DIR / "gradient_screen.json"
HEADLINE = "128"  # 32 prompts × 4 rollouts
SCREEN_BATCHES = 16  # paired batches a complete run has (gradient_quality --screen)
CEILINGS = ("mc_ceiling", "mc_ceiling_raw", "mc_ceiling_signed", "mc_ceiling_signed_degenerate")
# signed on all groups (the last): not run on `default`'s warm start or on `hard` (added after those runs)
EXIT_PROBES = ("rredcot_exit_probe", "rredcot_exit_probe_signed", "rredcot_exit_probe_signed_degenerate")
SATURATED = 0.99  # an exit-probe value this close to 1
EXACT_DRAWS = 20  # simulated Monte-Carlo draws for the within-trace Spearman an exact value source would reach
BARS = {"within_trace_spearman": 0.6, "localisation": 0.6, "median_segments": 8, "greedy_rise": 0.05,
        "sampled_rise": 0.05}


def method_rows(run: dict) -> dict:
    """Per method at 32 × 4: cosine − GRPO's (mean, 95% interval), mean cosine, ESS over GRPO with its interval."""
    rows = {}
    for name, entry in run["methods"].items():
        stats = entry["batches"].get(HEADLINE)
        if not stats:
            continue
        rows[name] = {"cosine": stats["cosine_mean"], "n_batches": stats["n_batches"],
                      "minus_grpo": stats.get("cosine_minus_grpo_mean"),
                      "minus_grpo_ci95": stats.get("cosine_minus_grpo_ci95"),
                      "ess_over_grpo": entry.get("ess_over_grpo_at_32"),
                      "ess_over_grpo_ci95": entry.get("ess_over_grpo_ci95")}
    return rows


def form_differences(run: dict) -> dict:
    """Each other form of the ceiling minus the published one (``mc_ceiling``: sigma shares, the recipe's mapping),
    cosine paired by batch: mean and 95% t interval."""
    cosines = run["batch_cosines"]
    out = {}
    for name in CEILINGS[1:]:
        paired = common.paired_differences(cosines[name], cosines["mc_ceiling"])
        out[name] = {"mean": float(np.mean(paired)), "ci95": common.t_interval(paired), "n_batches": len(paired)}
    return out


def batches_at_grpo(run: dict) -> dict:
    """Per ceiling form, the batches whose gradient is GRPO's exactly (cosine equal to GRPO's): a form that
    redistributed nothing there, as under a closed value gate. The ceiling's values pass ungated (``common``'s
    ``_UNGATED``), so a complete ceiling has none."""
    cosines = run["batch_cosines"]
    return {name: sum(cosine == cosines["grpo"].get(batch) for batch, cosine in cosines.get(name, {}).items())
            for name in CEILINGS}


def ahead(row: dict | None) -> bool | None:
    """Whether a method's cosine − GRPO's interval lies above 0 (None: not measured)."""
    if row is None or row.get("minus_grpo_ci95") is None:
        return None
    return row["minus_grpo_ci95"][0] > 0


def best_of(rows: dict, names) -> str | None:
    """The measured method of ``names`` with the largest mean cosine − GRPO's."""
    measured = [name for name in names if rows.get(name, {}).get("minus_grpo") is not None]
    return max(measured, key=lambda name: rows[name]["minus_grpo"]) if measured else None


def value_conditions(traces: dict) -> dict:
    """Condition (1) from the run's distinct traces: exit-probe values v̂_0..v̂_{K-1} against Monte-Carlo values of the
    same states, and the localisation of the first wrong step by each."""
    pairs, exit_hits, mc_hits, chance, inner = [], [], [], [], []
    for trace in traces["value_agreement"].values():
        exit_row, mc_row = np.array(trace["exit_probe"]), np.array(trace["monte_carlo"])
        pairs.append((exit_row[:-1], mc_row[:-1]))
        inner += list(zip(exit_row[1:-1], mc_row[1:-1]))
        holder = trace["holder"]
        if trace["outcome"] == 0.0 and holder is not None and len(exit_row) > 2 and holder < len(exit_row) - 1:
            exit_hits.append(float(int(np.argmin(np.diff(exit_row))) == holder))
            mc_hits.append(float(int(np.argmin(np.diff(mc_row))) == holder))
            chance.append(1.0 / (len(exit_row) - 1))
    states = common.correlations(pairs)
    # Saturation: the states after the first boundary that the exit probe values at >= 0.99, and how many of them
    # Monte-Carlo values still put below 0.9 (a value near 1 leaves nothing to redistribute after it).
    inner_exit, inner_mc = np.array(inner).reshape(-1, 2).T
    saturated = inner_exit >= SATURATED
    return {"traces": len(pairs), "state_spearman": states["spearman"],
            "within_trace_spearman_exact_values": exact_values_spearman([mc for _, mc in pairs]),
            "saturated_share": float(saturated.mean()) if inner else None,
            "saturated_monte_carlo_below_0_9": float((inner_mc[saturated] < 0.9).mean()) if saturated.any() else None,
            "saturated_monte_carlo_mean": float(inner_mc[saturated].mean()) if saturated.any() else None,
            "within_trace_spearman": states["within_spearman"], "within_trace_n": states["within_n"],
            "localisation": float(np.mean(exit_hits)) if exit_hits else None,
            "localisation_monte_carlo": float(np.mean(mc_hits)) if mc_hits else None,
            "localisation_chance": float(np.mean(chance)) if chance else None, "localisation_n": len(exit_hits)}


def exact_values_spearman(monte_carlo: list[np.ndarray], seed: int = 0) -> float | None:
    """The mean within-trace Spearman that exact values would reach against the ceiling's Monte-Carlo values (K
    continuations a state): the bar's reach, since the K continuations' noise alone keeps any value source below 1.
    Taking each state's measured Monte-Carlo value as its true success probability, K outcomes a state are drawn
    (``EXACT_DRAWS`` times) and the true values ranked against their means, as ``value_conditions`` ranks the exit
    probe's."""
    k = common.method_settings("mc_ceiling")[1].segment_mc.num_continuations
    rng = np.random.default_rng(seed)
    draws = [common.mean_within_spearman([(values, rng.binomial(k, values) / k) for values in monte_carlo])
             for _ in range(EXACT_DRAWS)]
    measured = [draw for draw in draws if draw is not None]
    return float(np.mean(measured)) if measured else None


def segment_conditions(traces: dict) -> dict:
    counts = list(traces["segments_per_trace"].values())
    return {"traces": len(counts), "median_segments": float(np.median(counts)) if counts else None,
            "max_segments_allowed": 8}


def training_conditions(setting: str, ledger: Path = LEDGER_DIR) -> dict:
    """Condition (3) from GRPO's main runs in the ledger (``grpo_seed<k>.json``) or, on a setting without them, from
    the runs at the best rate of GRPO's own sweeps there (``benchmarks/grpo_sweep.py``; one a batch: of the sweeps that
    meet the bar, or of all where none does, the batch whose best rate has the highest mean AUC, ties to the smaller
    batch, as ``grpo_sweep.best_swept`` picks: a sweep still running cannot name a best rate yet)."""
    sweeps = {train_batch_of(folder.name): sweep_conditions(folder)
              for folder in sorted((ledger / setting).glob(f"{SWEEP_FOLDER}*")) if folder.is_dir()}
    def rank(b: int) -> tuple:
        return sweeps[b]["sweep_meets_bar"], sweeps[b]["sweep"][f"{sweeps[b]['best_swept_rate']:g}"]["auc"], -b

    batch = max((b for b in sweeps if sweeps[b]["best_swept_rate"] is not None), key=rank, default=None)
    sweep = sweeps[batch] if batch is not None else sweep_conditions(ledger / setting / SWEEP_FOLDER)
    best_rate_paths = sweep.pop("best_rate_paths")
    sweep = {**sweep, "best_swept_batch": batch,
             "sweeps_by_batch": {str(b): {key: value for key, value in entry.items() if key != "best_rate_paths"}
                                 for b, entry in sorted(sweeps.items())}}
    main_paths = sorted((ledger / setting / "main").glob("grpo_seed*.json"))
    source = "main runs" if main_paths else "sweep, best rate"
    greedy, sampled, rates, steps = [], [], set(), set()
    for path in main_paths or best_rate_paths:
        run = json.loads(path.read_text())
        greedy_rise, sampled_rise = greedy_and_sampled_rise(run["summary"])
        greedy.append(greedy_rise)
        if sampled_rise is not None:
            sampled.append(sampled_rise)
        rates.add(run["spec"]["lr"])
        steps.add(run["spec"]["steps"])
    return {"grpo_runs": len(greedy), "rise_from": source if greedy else None, "rates": sorted(rates),
            "steps": sorted(steps), "greedy_rise": float(np.mean(greedy)) if greedy else None,
            "sampled_rise": float(np.mean(sampled)) if sampled else None, "sampled_runs": len(sampled), **sweep}


def sweep_conditions(folder: Path) -> dict:
    """GRPO's learning-rate sweep on the setting (``grpo_lr*.json``): per rate, the seeds and the fewest steps; whether
    it meets the bar (≥ 3 rates, each with ≥ 2 seeds of ≥ 100 steps with a warmup override); and the best rate
    (highest seed-mean validation AUC, ties to the smaller) with its runs' paths."""
    by_rate: dict[float, dict] = {}
    for path in sorted(folder.glob("grpo_lr*.json")):
        run = json.loads(path.read_text())
        spec = run["spec"]
        entry = by_rate.setdefault(spec["lr"], {"seeds": set(), "steps": spec["steps"], "warmup": True, "aucs": [],
                                                "paths": []})
        entry["seeds"].add(spec["seed"])
        entry["steps"] = min(entry["steps"], spec["steps"])
        entry["warmup"] &= any("warmup" in override for override in spec["overrides"])
        entry["aucs"].append(run["summary"]["auc"])
        entry["paths"].append(path)
    qualified = [rate for rate, entry in by_rate.items()
                 if len(entry["seeds"]) >= 2 and entry["steps"] >= 100 and entry["warmup"]]
    best = max(by_rate, key=lambda rate: (float(np.mean(by_rate[rate]["aucs"])), -rate)) if by_rate else None
    return {"sweep": {f"{rate:g}": {"seeds": len(entry["seeds"]), "steps": entry["steps"], "warmup": entry["warmup"],
                                    "auc": float(np.mean(entry["aucs"]))}
                      for rate, entry in sorted(by_rate.items())},
            "sweep_meets_bar": len(qualified) >= 3, "best_swept_rate": best,
            "best_rate_paths": by_rate[best]["paths"] if best is not None else []}


def judge(value: float | None, bar: float) -> bool | None:
    return None if value is None else value >= bar


def batches_done(rows: dict) -> int:
    """Paired batches every screened method has (a run written while it goes on, or stopped, has fewer)."""
    return min((row["n_batches"] for name, row in rows.items() if name != "grpo" and row.get("n_batches")), default=0)


def screen_entry(run: dict, label: str) -> dict:
    settings = run["settings"]
    setting = settings["setting"]
    rows = method_rows(run)
    batches = batches_done(rows)
    ceiling = best_of(rows, CEILINGS)
    probe = best_of(rows, EXIT_PROBES)
    values = value_conditions(run["traces"])
    segments = segment_conditions(run["traces"])
    training = training_conditions(setting)
    conditions = {
        "self_values": judge(values["within_trace_spearman"], BARS["within_trace_spearman"]) and
        judge(values["localisation"], BARS["localisation"]),
        "decisions": judge(segments["median_segments"], BARS["median_segments"]),
        "ceiling_ahead": ahead(rows.get(ceiling)) if ceiling else None,
        "training_moves": (judge(training["greedy_rise"], BARS["greedy_rise"]) and
                           judge(training["sampled_rise"], BARS["sampled_rise"])),
        "rate_swept_on_setting": training["sweep_meets_bar"],
        "all_batches": batches == SCREEN_BATCHES,
    }
    return {"setting": setting, "batches": batches, "policy": settings["model"], "pool_accuracy": settings["pool_accuracy"],
            "gstar_split_half_cosine": settings["gstar"]["split_half_cosine"], "methods": rows,
            "best_ceiling": ceiling, "ceiling_forms_minus_sigma": form_differences(run),
            "ceiling_batches_at_grpo": batches_at_grpo(run), "best_exit_probe": probe,
            "exit_probe_ahead": ahead(rows.get(probe)),
            "values": values, "segments": segments, "training": training, "conditions": conditions,
            "run": f"benchmarks/results/gradient_screen_runs/{label}.json", "command": settings["commands"]["run"]}


def main(argv: list[str] | None = None) -> dict:
    parser = common.parser(__doc__, OUT, "", build=False)
    args = parser.parse_args(argv)
    runs = sorted(RUNS_DIR.glob("*.json"))
    if not runs:
        raise SystemExit(f"no screen runs in {RUNS_DIR}: run python -m benchmarks.gradient_quality --screen first")
    entries = {path.stem: screen_entry(json.loads(path.read_text()), path.stem) for path in runs}
    result = {"bars": BARS, "headline_batch": "32 prompts x 4 rollouts, 16 paired batches", "settings": entries,
              "qualifies": [label for label, entry in entries.items() if all(entry["conditions"].values())],
              "meta": {"script": "benchmarks/gradient_screen.py", "inputs": [f"benchmarks/results/gradient_screen_runs/"
                                                                              f"{path.name}" for path in runs]}}
    common.write_result(result, args.out or OUT, say=False)
    print_table([screen_row(label, entry) for label, entry in entries.items()], SCREEN_COLUMNS)
    print(markdown_tables(result))
    return result


GRADIENT_COLUMNS = {"mc_ceiling": "MC ceiling, sigma", "mc_ceiling_raw": "MC, sigma, raw mapping",
                    "mc_ceiling_signed": "MC, signed", "mc_ceiling_signed_degenerate": "MC, signed, all groups",
                    "rredcot_exit_probe": "exit probe, sigma", "rredcot_exit_probe_signed": "exit probe, signed",
                    "rredcot_exit_probe_signed_degenerate": "exit probe, signed, all groups",
                    "step_oracle": "step oracle, sigma", "step_oracle_signed": "step oracle, signed",
                    "rredcot": "references", "ibpo_resume": "IBPO (resume)"}


def interval_text(row: dict | None) -> str:
    if not row or row.get("minus_grpo") is None:
        return "—"
    if row.get("minus_grpo_ci95") is None:  # one batch: no interval
        return f"{row['minus_grpo']:+.3f} [—]"
    low, high = row["minus_grpo_ci95"]
    return f"{row['minus_grpo']:+.3f} [{low:+.3f}, {high:+.3f}]"


def signed_text(value: float | None) -> str:
    return "—" if value is None else f"{value:+.3f}"


def batch_text(training: dict) -> str:
    """Where condition (3) was read off a sweep at another batch than the recipe's: at which."""
    batch = training.get("best_swept_batch")
    return "" if training["rise_from"] != "sweep, best rate" or batch in (None, RECIPE_TRAIN_BATCH) else \
        f" (batch {batch})"


def policy_text(label: str, entry: dict) -> str:
    """``setting``, warm start, or the GRPO step its run label ends with (``..._step<n>``; the GRPO run's batch where
    its name has one, ``_grpo_batch<N>_``)."""
    step = re.search(r"_step(\d+)$", label)
    batch = re.search(r"_grpo_batch(\d+)_", label)
    partial = "" if entry["batches"] == SCREEN_BATCHES else f" ({entry['batches']} of {SCREEN_BATCHES} batches)"
    grpo = f"GRPO at batch {batch.group(1)}, step" if batch else "GRPO step"
    return f"`{entry['setting']}`, " + (f"{grpo} {step.group(1)}" if step else "warm start") + partial


def markdown_tables(result: dict) -> str:
    """The tables RESULTS.md shows ("The screen"): cosine − GRPO's per method, the conditions, and each form of the
    ceiling against the published sigma form (paired by batch)."""
    entries = result["settings"]
    order = sorted(entries, key=lambda label: (entries[label]["setting"], label != entries[label]["setting"]))
    lines = ["| setting, policy | GRPO cosine | " + " | ".join(GRADIENT_COLUMNS.values()) + " |",
             "|---" * (len(GRADIENT_COLUMNS) + 2) + "|"]
    for label in order:
        entry = entries[label]
        cells = [interval_text(entry["methods"].get(name)) for name in GRADIENT_COLUMNS]
        lines.append(f"| {policy_text(label, entry)} | {entry['methods']['grpo']['cosine']:.3f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "| setting, policy | (1) within-trace Spearman, exit probe vs MC (pooled states; exact values' "
              "reach) | (1) localisation: exit probe / MC "
              "/ chance | exit probe ≥ 0.99: share of states / of them MC < 0.9 | (2) median segments | (3) GRPO "
              "greedy / sampled rise | best ceiling ahead | met |",
              "|---|---|---|---|---|---|---|---|"]
    for label in order:
        entry = entries[label]
        values, training = entry["values"], entry["training"]
        met = [name for name, ok in entry["conditions"].items() if ok]
        lines.append(
            f"| {policy_text(label, entry)} | {values['within_trace_spearman']:.2f} (states {values['state_spearman']:.2f}; "
            f"exact {values['within_trace_spearman_exact_values']:.2f}) "
            f"| {values['localisation']:.0%} / {values['localisation_monte_carlo']:.0%} / "
            f"{values['localisation_chance']:.0%} | {values['saturated_share']:.0%} / "
            f"{values['saturated_monte_carlo_below_0_9']:.0%} | {entry['segments']['median_segments']:g} | "
            f"{signed_text(training['greedy_rise'])} / {signed_text(training['sampled_rise'])}{batch_text(training)} | "
            f"{'yes' if entry['conditions']['ceiling_ahead'] else 'no'} (`{entry['best_ceiling']}`) | "
            f"{', '.join(met) if met else 'none'} |")
    forms = CEILINGS[1:]
    lines += ["", "| setting, policy | " + " | ".join(f"{GRADIENT_COLUMNS[name]} − MC ceiling, sigma" for name in forms)
              + " |", "|---" * (len(forms) + 1) + "|"]
    for label in order:
        differences = entries[label]["ceiling_forms_minus_sigma"]
        lines.append(f"| {policy_text(label, entries[label])} | " + " | ".join(
            interval_text({"minus_grpo": d["mean"], "minus_grpo_ci95": d["ci95"]}) for d in map(differences.get, forms))
            + " |")
    return "\n".join(lines) + "\n"


SCREEN_COLUMNS = ["run", "grpo_cos", "ceiling", "ceiling_minus_grpo", "exit_probe_minus_grpo", "within_spearman",
                  "localisation", "median_segments", "greedy_rise", "sampled_rise"]


def screen_row(label: str, entry: dict) -> dict:
    return {"run": label, "grpo_cos": entry["methods"]["grpo"]["cosine"], "ceiling": entry["best_ceiling"],
            "ceiling_minus_grpo": interval_text(entry["methods"].get(entry["best_ceiling"])),
            "exit_probe_minus_grpo": interval_text(entry["methods"].get(entry["best_exit_probe"])),
            "within_spearman": entry["values"]["within_trace_spearman"],
            "localisation": entry["values"]["localisation"], "median_segments": entry["segments"]["median_segments"],
            "greedy_rise": entry["training"]["greedy_rise"], "sampled_rise": entry["training"]["sampled_rise"]}


if __name__ == "__main__":
    main()
