"""GRPO's own learning-rate sweep on a setting: does the baseline train there, and at which rate?

The screen's condition (3) (``benchmarks/gradient_screen.py``): GRPO trains at its best rate from a sweep on the setting
itself, at least 3 rates with warmup, 2 seeds and 100 steps, and at that rate greedy and sampled accuracy both rise by
at least 0.05. Each run is a real verl run (``recipes/tiny_cpu/run.sh grpo``) on the setting's build, with problems
of the sweep's generator stream (``sample_efficiency.SWEEP_DATA_SEED``: not the main runs' validation problems) and
greedy validation every ``--test-freq`` steps. Finished runs go to ``sample_efficiency``'s ledger
(``results/sample_efficiency_runs/<setting>/sweep/grpo_lr<rate>_seed<seed>.json``), where the screen reads them; a run
the ledger holds is read, not launched, so an interrupted sweep resumes. The best rate is the one with the highest
seed-mean validation AUC (ties to the smaller rate); its rises are seed means of last minus first: greedy validation,
and the sampled reward (``critic/score/mean``) averaged over the first and last 10 steps.

The batch is a second dimension: ``--train-batch N`` sweeps at N prompts a step (the recipe's 8 otherwise; PPO's
mini-batch is the whole batch, as in the recipe) into ``<setting>/sweep_batch<N>/`` and
``results/grpo_sweep_<setting>_batch<N>.json``. Of every committed sweep on a setting that meets the bar (a partial one
only where none does), the screen and its GRPO policy mid-training take the batch whose best rate has the highest AUC:
steps, not rollouts, are the axis condition (3) asks about, so a larger batch may win by spending more rollouts a step,
and a study there runs every arm at that batch.

    nohup nice -n 10 python -m benchmarks.grpo_sweep --setting items > outputs/grpo_sweep_items.log 2>&1 &
    python -m benchmarks.grpo_sweep --setting items --no-launch     # results/grpo_sweep_items.json from the ledger
    python -m benchmarks.grpo_sweep --setting items3 --train-batch 32 --rates 1e-5 3e-5 5e-5
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from benchmarks import common
from benchmarks import sample_efficiency as se

# The recipe's rate and one below it (3e-5 was the best of the first three, the grid's edge), then the 1e-4..3e-4
# that tiny-model RL reports use with warmup.
RATES = (1e-5, 3e-5, 1e-4, 3e-4)
SEEDS = (1, 2)
WARMUP_STEPS = 10
RISE_BAR = 0.05  # greedy and sampled accuracy, last minus first, at the best rate
RESULTS_PATH = common.RESULTS_DIR / "grpo_sweep_items.json"
RECIPE_TRAIN_BATCH = int(OmegaConf.load(common.RECIPES / "base.yaml").data.train_batch_size)  # prompts a step
SWEEP_FOLDER = "sweep"


def sweep_folder(train_batch: int) -> str:
    """The ledger's and the runs' folder of a sweep at ``train_batch`` prompts a step (the recipe's: ``sweep``)."""
    return SWEEP_FOLDER if train_batch == RECIPE_TRAIN_BATCH else f"{SWEEP_FOLDER}_batch{train_batch}"


def train_batch_of(folder: str) -> int:
    """``sweep_folder``'s inverse."""
    return RECIPE_TRAIN_BATCH if folder == SWEEP_FOLDER else int(folder.removeprefix(f"{SWEEP_FOLDER}_batch"))


def batch_overrides(train_batch: int) -> tuple[str, ...]:
    """``train_batch`` prompts a step, all in one PPO mini-batch as in the recipe; () at the recipe's own."""
    return () if train_batch == RECIPE_TRAIN_BATCH else (
        f"data.train_batch_size={train_batch}", f"actor_rollout_ref.actor.ppo_mini_batch_size={train_batch}")


def run_specs(steps: int, test_freq: int, data: tuple[str, ...], rates=RATES,
              train_batch: int = RECIPE_TRAIN_BATCH) -> dict[tuple[float, int], se.RunSpec]:
    overrides = (*common.METHODS["grpo"].overrides, *data, *se.schedule_overrides(steps, test_freq),
                 f"{se.WARMUP_KEY}={WARMUP_STEPS}", *batch_overrides(train_batch))
    return {(lr, seed): se.RunSpec("grpo", seed, steps, lr, overrides) for lr in rates for seed in SEEDS}


def results_path(setting: str, train_batch: int = RECIPE_TRAIN_BATCH) -> Path:
    suffix = "" if train_batch == RECIPE_TRAIN_BATCH else f"_batch{train_batch}"
    return RESULTS_PATH.with_name(f"grpo_sweep_{setting}{suffix}.json")


def best_swept(setting: str) -> dict | None:
    """Of the committed sweeps on ``setting`` (one per batch) that meet the sweep's bar (of all, where none does), the
    one whose best rate has the highest mean AUC (ties to the smaller batch): ``{"rate", "warmup_steps", "train_batch",
    "auc"}``; None without a sweep with a best rate. A partial sweep's best rate is provisional: a complete one wins."""
    candidates = []
    for path in [results_path(setting), *RESULTS_PATH.parent.glob(f"grpo_sweep_{setting}_batch*.json")]:
        if not path.exists():
            continue
        result = json.loads(path.read_text())
        if result["best_rate"] is None:
            continue
        train_batch = result["meta"].get("train_batch", RECIPE_TRAIN_BATCH)  # sweeps before the batch dimension
        candidates.append({"rate": result["best_rate"], "warmup_steps": result["meta"]["warmup_steps"],
                           "train_batch": train_batch, "auc": result["by_rate"][f"{result['best_rate']:g}"]["auc"],
                           "meets_sweep_bar": result["meets_sweep_bar"]})
    best = max(candidates, key=lambda c: (c["meets_sweep_bar"], c["auc"], -c["train_batch"]), default=None)
    return None if best is None else {key: value for key, value in best.items() if key != "meets_sweep_bar"}


def best_rate_overrides(setting: str) -> tuple[str, ...]:
    """The learning rate, warmup and batch of GRPO's best configuration in the committed sweeps on ``setting``
    (``best_swept``); () without one (the recipe's rate and batch stand)."""
    best = best_swept(setting)
    if best is None:
        return ()
    return (f"{se.LR_KEY}={best['rate']:g}", f"{se.WARMUP_KEY}={best['warmup_steps']}",
            *batch_overrides(best["train_batch"]))


def run_dir(setting_dir: Path, lr: float, seed: int, train_batch: int = RECIPE_TRAIN_BATCH) -> Path:
    return setting_dir / sweep_folder(train_batch) / f"grpo_lr{lr:g}_seed{seed}"


def greedy_and_sampled_rise(summary: dict) -> tuple[float, float | None]:
    """A run summary's last minus first greedy validation accuracy, and sampled reward (means over the first and last
    10 steps; None when the run logged none)."""
    validation, diagnostics = summary["validation"], summary.get("diagnostics") or {}
    first, last = (diagnostics.get(part) or {} for part in ("first", "last"))
    sampled = (last["critic/score/mean"] - first["critic/score/mean"]
               if "critic/score/mean" in first and "critic/score/mean" in last else None)
    return validation[-1]["accuracy"] - validation[0]["accuracy"], sampled


def rises(summary: dict) -> dict:
    greedy, sampled = greedy_and_sampled_rise(summary)
    validation = summary["validation"]
    return {"greedy_first": validation[0]["accuracy"], "greedy_last": validation[-1]["accuracy"],
            "greedy_rise": greedy, "sampled_rise": sampled,
            "auc": summary["auc"], "steps": summary["steps"], "median_step_s": summary["median_step_s"]}


def analyse(summaries: dict[tuple[float, int], dict | None], rates=RATES) -> dict:
    """Per rate: each seed's rises and their means; the best rate (highest mean AUC among complete rates, ties to
    the smaller) and whether it trains (both rises at least ``RISE_BAR``)."""
    by_rate = {}
    for lr in rates:
        runs = {seed: rises(summaries[lr, seed]) for seed in SEEDS if summaries.get((lr, seed))}
        entry = {"seeds": {str(seed): run for seed, run in runs.items()}, "complete": len(runs) == len(SEEDS)}
        for key in ("greedy_rise", "sampled_rise", "auc"):
            values = [run[key] for run in runs.values() if run[key] is not None]
            entry[key] = float(np.mean(values)) if values else None
        by_rate[f"{lr:g}"] = entry
    complete = [lr for lr in rates if by_rate[f"{lr:g}"]["complete"]]
    best = max(complete, key=lambda lr: (by_rate[f"{lr:g}"]["auc"], -lr)) if complete else None
    chosen = by_rate[f"{best:g}"] if best is not None else None
    trains = None if chosen is None or chosen["sampled_rise"] is None else (
        chosen["greedy_rise"] >= RISE_BAR and chosen["sampled_rise"] >= RISE_BAR)
    return {"by_rate": by_rate, "best_rate": best, "complete_rates": len(complete), "trains_at_best_rate": trains,
            "meets_sweep_bar": len(complete) >= 3}


def print_table(result: dict) -> None:
    print("| rate | seeds | greedy first → last (rise) | sampled rise | AUC |")
    print("|---|---|---|---|---|")
    best = None if result["best_rate"] is None else f"{result['best_rate']:g}"
    for rate, entry in result["by_rate"].items():
        seeds = entry["seeds"].values()
        greedy = ", ".join(f"{run['greedy_first']:.3f} → {run['greedy_last']:.3f}" for run in seeds)
        print(f"| {rate}{' (best)' if rate == best else ''} | {len(entry['seeds'])} | {greedy} ({common.fmt(entry['greedy_rise'])}) | "
              f"{common.fmt(entry['sampled_rise'])} | {common.fmt(entry['auc'])} |")
    print(f"trains at its best rate (both rises >= {RISE_BAR}): {result['trains_at_best_rate']}")


def main(argv: list[str] | None = None) -> dict:
    parser = common.parser(__doc__, RESULTS_PATH, "not supported: the sweep is real runs only", build=False)
    parser.add_argument("--setting", choices=tuple(common.SETTINGS), default="items")
    parser.add_argument("--runs-root", type=Path, default=common.ROOT / "outputs" / "bench" / "sample_efficiency",
                        help="runs go to <runs-root>/<setting>/sweep[_batch<N>]/")
    parser.add_argument("--rates", type=float, nargs="+", default=list(RATES),
                        help="learning rates, swept in this order (a stopped sweep has its first rates complete)")
    parser.add_argument("--train-batch", type=int, default=RECIPE_TRAIN_BATCH,
                        help=f"prompts a step (the recipe's {RECIPE_TRAIN_BATCH}), each a PPO mini-batch")
    parser.add_argument("--ledger", type=Path, default=se.LEDGER_DIR)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--test-freq", type=int, default=10)
    parser.add_argument("--val-size", type=int, default=256)
    parser.add_argument("--no-launch", action="store_true", help="only read the ledger")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.error("--smoke: the sweep has no synthetic mode; --no-launch reads the ledger")
    if args.train_batch < 1 or args.val_size < 1:
        parser.error("--train-batch and --val-size must be positive")
    setting = common.SETTINGS[args.setting]
    setting_dir, ledger = args.runs_root / args.setting, se.Ledger(args.ledger, args.runs_root)
    data = common.setting_data if args.no_launch else common.write_setting_data
    record = data(setting_dir / "data_sweep", setting, args.val_size, se.SWEEP_DATA_SEED)
    build = common.BUILD_DIRS[setting.preset]
    if not args.no_launch:
        common.build_task(build, setting.preset)
        se.check_lengths_fit(record, setting, build)
    specs = run_specs(args.steps, args.test_freq, se.data_overrides(record, setting), args.rates, args.train_batch)
    codes = {}
    for (lr, seed), spec in specs.items():  # rate-major: a stopped sweep has its first rates complete
        if not args.no_launch:
            codes[f"grpo_lr{lr:g}_seed{seed}"] = se.ensure_run(run_dir(setting_dir, lr, seed, args.train_batch), spec,
                                                               build, ledger, setting.preset)
    result = analyse({key: ledger.summary(run_dir(setting_dir, *key, args.train_batch), spec)
                      for key, spec in specs.items()}, args.rates)
    result["meta"] = {"setting": args.setting, "rates": list(args.rates), "seeds": list(SEEDS),
                      "train_batch": args.train_batch, "warmup_steps": WARMUP_STEPS, "steps": args.steps, "test_freq": args.test_freq,
                      "val_size": args.val_size, "data_seed": se.SWEEP_DATA_SEED, "rise_bar": RISE_BAR,
                      "rule": "best rate: highest seed-mean validation AUC, ties to the smaller rate",
                      "exit_codes": codes, **common.machine_meta()}
    print_table(result)
    out = args.out or results_path(args.setting, args.train_batch)
    return common.write_result(result, out)


if __name__ == "__main__":
    main()
