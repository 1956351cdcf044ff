"""Sample efficiency of GRPO, RREDCoT, IBPO and segment MC on the embedded task (real verl runs).

Each (method, seed) is one ``recipes/tiny_cpu/run.sh <method>`` run of ``--steps`` steps with validation every
``--test-freq`` steps, in ``<runs-dir>/<method>_seed<seed>``; runs whose ``metrics.jsonl`` is already complete are
read, not relaunched. From each run's ``metrics.jsonl`` (verl FileLogger lines):

* validation accuracy (``val-core/rredcot_arithmetic/acc/mean@1``, greedy) against step and against training
  wall-clock (the cumulative ``timing_s/step``, which leaves out validation), averaged over seeds;
* steps each method needs to reach GRPO's final accuracy (first validated step where the seed-mean accuracy is
  ≥ GRPO's seed-mean at the last step; None if never), and the ratio to GRPO's steps;
* the spread of the per-token advantage (``critic/advantages/{max,min}`` range, and the variance from the snapshots'
  token advantages when ``snapshots/step_*.json`` are there) and the variance of ``actor/grad_norm`` over steps.

Writes ``curves.png`` (accuracy vs step and vs seconds) next to the JSON and prints a table.

    python -m benchmarks.sample_efficiency                       # 4 methods x 3 seeds x 20 steps (about an hour)
    python -m benchmarks.sample_efficiency --runs-dir DIR        # read/complete the runs in DIR
    python -m benchmarks.sample_efficiency --smoke               # no training: parses synthetic metrics (tests)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import RESULTS_DIR, ROOT, build_task, fmt, machine_meta
from benchmarks.cost import launch_run, read_metrics
from rredcot_verl.tasks.model import PAD_TOKEN

RESULTS_PATH = RESULTS_DIR / "sample_efficiency.json"
METHODS = ("grpo", "rredcot", "ibpo", "segment_mc")
# verl logs the reward function's score as acc (reward when it returns a dict without "acc"); both are 0/1 here.
VAL_KEYS = ("val-core/rredcot_arithmetic/acc/mean@1", "val-core/rredcot_arithmetic/reward/mean@1")


def run_complete(out: Path, steps: int) -> bool:
    path = out / "metrics.jsonl"
    return path.exists() and any(row["step"] >= steps for row in read_metrics(path))


def ensure_runs(runs_dir: Path, methods, seeds, steps: int, test_freq: int, build: Path) -> dict:
    """Launch the missing runs (one retry each: the machine is shared); returns {(method, seed): exit code or 0}."""
    codes = {}
    for seed in seeds:
        for method in methods:
            out = runs_dir / f"{method}_seed{seed}"
            if run_complete(out, steps):
                codes[(method, seed)] = 0
                continue
            overrides = (f"trainer.total_training_steps={steps}", f"trainer.test_freq={test_freq}")
            code = launch_run(method, out, steps, seed, build, overrides, timeout_s=1800)
            if code != 0:
                code = launch_run(method, out, steps, seed, build, overrides, timeout_s=1800)
            codes[(method, seed)] = code
    return codes


def snapshot_advantage_variance(out: Path) -> float | None:
    """Mean over steps of the variance of the token advantages in ``snapshots/step_*.json`` (None if none);
    padding positions of the responses are left out."""
    variances = []
    for path in sorted((out / "snapshots").glob("step_*.json")):
        snapshot = json.loads(path.read_text())
        tokens = [a for trace in snapshot.get("traces", [])
                  for a, token in zip(trace.get("token_advantages", []), trace.get("response_tokens", []))
                  if token != PAD_TOKEN]
        if len(tokens) > 1:
            variances.append(float(np.var(tokens)))
    return float(np.mean(variances)) if variances else None


def summarise_run(out: Path) -> dict:
    rows = read_metrics(out / "metrics.jsonl")
    validation = [(row["step"], next(row[key] for key in VAL_KEYS if key in row)) for row in rows
                  if any(key in row for key in VAL_KEYS)]
    elapsed, seconds = {}, 0.0
    for row in rows:
        # verl times validation separately (timing_s/testing, outside timing_s/step): training time only.
        seconds += row.get("timing_s/step", 0.0)
        elapsed[row["step"]] = seconds
    ranges = [row["critic/advantages/max"] - row["critic/advantages/min"] for row in rows
              if "critic/advantages/max" in row and "critic/advantages/min" in row]
    grad_norms = [row["actor/grad_norm"] for row in rows if "actor/grad_norm" in row]
    step_times = [row["timing_s/step"] for row in rows if row["step"] >= 2 and "timing_s/step" in row]
    return {
        "validation": [{"step": step, "seconds": elapsed.get(step, 0.0), "accuracy": accuracy}
                       for step, accuracy in validation],
        "median_step_s": statistics.median(step_times) if step_times else None,
        "advantage_range_mean": float(np.mean(ranges)) if ranges else None,
        "token_advantage_variance": snapshot_advantage_variance(out),
        "grad_norm_mean": float(np.mean(grad_norms)) if grad_norms else None,
        "grad_norm_variance": float(np.var(grad_norms)) if len(grad_norms) > 1 else None,
        "steps": max((row["step"] for row in rows), default=0),
    }


def mean_curve(runs: list[dict]) -> list[dict]:
    """Seed-mean accuracy and seconds at the validation steps all seeds share."""
    shared = set.intersection(*({v["step"] for v in run["validation"]} for run in runs)) if runs else set()
    curve = []
    for step in sorted(shared):
        points = [next(v for v in run["validation"] if v["step"] == step) for run in runs]
        curve.append({"step": step, "accuracy": float(np.mean([p["accuracy"] for p in points])),
                      "accuracy_sd": float(np.std([p["accuracy"] for p in points])),
                      "seconds": float(np.mean([p["seconds"] for p in points]))})
    return curve


def steps_to_reach(curve: list[dict], target: float) -> int | None:
    return next((point["step"] for point in curve if point["step"] > 0 and point["accuracy"] >= target), None)


def analyse(runs_dir: Path, methods, seeds, steps: int) -> dict:
    """Summaries of the complete runs (all ``steps`` logged); unfinished or failed runs are left out."""
    per_method = {}
    for method in methods:
        runs = {seed: summarise_run(runs_dir / f"{method}_seed{seed}") for seed in seeds
                if run_complete(runs_dir / f"{method}_seed{seed}", steps)}
        runs = {seed: run for seed, run in runs.items() if run["validation"]}
        if not runs:
            continue

        def mean_of(key):
            values = [run[key] for run in runs.values() if run[key] is not None]
            return float(np.mean(values)) if values else None

        per_method[method] = {
            "seeds": sorted(runs), "curve": mean_curve(list(runs.values())),
            "runs": {str(s): r for s, r in runs.items()},
            **{key: mean_of(key) for key in ("median_step_s", "advantage_range_mean", "token_advantage_variance",
                                             "grad_norm_mean", "grad_norm_variance")},
        }
    grpo = per_method.get("grpo")
    target = grpo["curve"][-1]["accuracy"] if grpo and grpo["curve"] else None
    grpo_steps = steps_to_reach(grpo["curve"], target) if target is not None else None
    for entry in per_method.values():
        entry["initial_accuracy"] = entry["curve"][0]["accuracy"] if entry["curve"] else None
        entry["final_accuracy"] = entry["curve"][-1]["accuracy"] if entry["curve"] else None
        entry["final_seconds"] = entry["curve"][-1]["seconds"] if entry["curve"] else None
        entry["steps_to_grpo_final"] = steps_to_reach(entry["curve"], target) if target is not None else None
        reached = entry["steps_to_grpo_final"]
        entry["steps_ratio_to_grpo"] = reached / grpo_steps if reached and grpo_steps else None
    return {"grpo_final_accuracy": target, "grpo_steps_to_final": grpo_steps, "methods": per_method}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for method, entry in result["methods"].items():
        curve = entry["curve"]
        steps = [p["step"] for p in curve]
        accuracy = np.array([p["accuracy"] for p in curve])
        spread = np.array([p["accuracy_sd"] for p in curve])
        by_step.plot(steps, accuracy, marker="o", label=f"{method} ({len(entry['seeds'])} seeds)")
        by_step.fill_between(steps, accuracy - spread, accuracy + spread, alpha=0.15)
        by_time.plot([p["seconds"] for p in curve], accuracy, marker="o", label=method)
    if result["grpo_final_accuracy"] is not None:
        for axis in (by_step, by_time):
            axis.axhline(result["grpo_final_accuracy"], color="grey", linestyle=":", linewidth=1)
    by_step.set(xlabel="training step", ylabel="validation accuracy (mean@1)", title="accuracy vs step (±1 sd)")
    by_time.set(xlabel="training seconds (cumulative timing_s/step)", title="accuracy vs wall-clock")
    by_step.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def print_table(result: dict) -> None:
    print(f"GRPO final accuracy {fmt(result['grpo_final_accuracy'], 0, 3)} (reached at step "
          f"{result['grpo_steps_to_final']})")
    print(f"{'method':<12}{'seeds':>6}{'acc0':>7}{'final':>7}{'steps→':>7}{'/grpo':>7}{'step s':>8}{'train s':>9}"
          f"{'adv rng':>8}{'adv var':>9}{'gn var':>9}")
    for method, e in result["methods"].items():
        reached = e["steps_to_grpo_final"]
        print(f"{method:<12}{len(e['seeds']):>6}{fmt(e['initial_accuracy'], 7, 3)}{fmt(e['final_accuracy'], 7, 3)}"
              f"{reached if reached is not None else '-':>7}{fmt(e['steps_ratio_to_grpo'], 7)}"
              f"{fmt(e['median_step_s'])}{fmt(e['final_seconds'], 9, 0)}{fmt(e['advantage_range_mean'])}"
              f"{fmt(e['token_advantage_variance'], 9, 4)}{fmt(e['grad_norm_variance'], 9, 4)}")


def write_synthetic_runs(runs_dir: Path, seeds=(1, 2), steps: int = 6, test_freq: int = 2) -> None:
    """Metrics files shaped like verl's FileLogger output (for ``--smoke`` and the tests): method m improves by
    ``0.02·(m+1)`` per step from 0.3, ``5 + m`` training seconds per step, validation (1 s) at step 0 and every
    ``test_freq`` steps."""
    for m, method in enumerate(METHODS):
        for seed in seeds:
            out = runs_dir / f"{method}_seed{seed}"
            out.mkdir(parents=True, exist_ok=True)
            lines = [{"step": 0, "data": {VAL_KEYS[0]: 0.3}}]
            for step in range(1, steps + 1):
                data = {"timing_s/step": 5.0 + m, "actor/grad_norm": 0.1 * (seed + step % 2),
                        "critic/advantages/max": 1.0 + 0.1 * m, "critic/advantages/min": -1.0}
                if step % test_freq == 0 or step == steps:
                    data["timing_s/testing"] = 1.0  # outside timing_s/step, as in verl
                    data[VAL_KEYS[0]] = 0.3 + 0.02 * (m + 1) * step + 0.001 * seed
                lines.append({"step": step, "data": data})
            (out / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="no training: synthetic metrics in a temp folder")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON path (default {RESULTS_PATH}; temp with --smoke)")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "outputs" / "benchmarks" / "sample_efficiency")
    parser.add_argument("--build", type=Path, default=ROOT / "outputs" / "tiny_cpu" / "build")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--test-freq", type=int, default=5)
    parser.add_argument("--no-launch", action="store_true", help="only analyse the runs already in --runs-dir")
    args = parser.parse_args(argv)
    if args.smoke:
        args.runs_dir = Path(tempfile.mkdtemp()) / "runs"
        args.seeds, args.steps, args.no_launch = [1, 2], 6, True
        write_synthetic_runs(args.runs_dir, args.seeds, args.steps)
    out = args.out or (args.runs_dir.parent / "sample_efficiency.json" if args.smoke else RESULTS_PATH)
    codes = {}
    if not args.no_launch:
        build_task(args.build)
        codes = ensure_runs(args.runs_dir, args.methods, args.seeds, args.steps, args.test_freq, args.build)
    result = analyse(args.runs_dir, args.methods, args.seeds, args.steps)
    result["meta"] = {"runs_dir": str(args.runs_dir), "seeds": args.seeds, "steps": args.steps,
                      "test_freq": args.test_freq, "synthetic": args.smoke,
                      "exit_codes": {f"{m}_seed{s}": c for (m, s), c in codes.items()}, **machine_meta()}
    print_table(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if result["methods"]:
        plot(result, out.parent / "curves.png")
    print(f"wrote {out}")
    result["out"] = str(out)
    return result


if __name__ == "__main__":
    main()
