"""Gain and cost against length: the gradient-quality protocol and the step-cost ratio to GRPO at three lengths.

The lengths are the embedded task's settings (``common.SETTINGS``): ``default`` (2-5 steps, about 45-token traces),
``hard`` (4-5 steps, about 55) and ``long`` (16-17 steps restating the terms left, about 390 tokens, on the long
build's own model). Six roles are measured at each:

* gain: the gradient-quality protocol's cosine with g* minus GRPO's at 32 prompts x 4 (paired over the same batches,
  95% t interval) and the effective sample size over GRPO's (bootstrap interval), read from the protocol's results
  (``benchmarks/gradient_quality.py``): ``gradient_quality{,_hard,_long}.json``, and for IBPO's resumed repairs at
  the default and hard lengths ``ibpo_operators{,_hard}.json`` (the same pools and batches);
* cost: the median ``timing_s/step`` (steps >= 2) of ``--cost-steps`` steps of each role's recipe launched through
  ``recipes/tiny_cpu/run.sh``, one length at a time with every role in one sitting, over GRPO's.

IBPO's repairs are resumed from the failure's divergence point at every length (``ibpo.repair_operator=resume``): a
rewrite of a 512-token failure would need 1,830 tokens of context and the long model has 1,024 positions. The
committed default and hard results of the repair-filled bank measured the rewrite operator; the table says so.

    python -m benchmarks.length_scaling                        # every length: benchmarks/results/length_scaling.json
    python -m benchmarks.length_scaling --settings long        # the long length's cost runs only (resumable)
    python -m benchmarks.length_scaling --settings long --roles rredcot_dataset_references   # and GRPO's only
    python -m benchmarks.length_scaling --cost-steps 0         # gain only, from the committed protocol results
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from benchmarks import common
from benchmarks.common import SETTINGS
from rredcot_verl.runs import load_metrics

RESULTS_PATH = common.RESULTS_DIR / "length_scaling.json"
RUNS_DIR = common.ROOT / "outputs" / "length_scaling"
LENGTHS = ("default", "hard", "long")
HEADLINE_ROLLOUTS = "128"  # 32 prompts x 4
# The method of each role (``common.METHODS``) in the cost runs and, at the long length, in the gradient protocol.
ROLES = {
    "grpo": "grpo",
    "ibpo": "ibpo_resume",
    "rredcot_dataset_references": "rredcot",
    "best_without_references": "rredcot_repairs_degenerate_resume",  # the repair-filled bank, value_differences
    "rredcot_ibpo": "rredcot_ibpo_resume",
    "exit_probe": "rredcot_exit_probe_log_affine",
}
# Where each length's gradient results are, and the method measured for a role where it differs from ROLES.
GRADIENT_FILES = {"default": "gradient_quality.json", "hard": "gradient_quality_hard.json",
                  "long": "gradient_quality_long.json"}
OPERATOR_FILES = {"default": "ibpo_operators.json", "hard": "ibpo_operators_hard.json"}
COMMITTED_REPAIR_BANK = "rredcot_repairs_degenerate"  # default and hard: measured with the rewrite operator


def gradient_source(length: str, role: str, results_dir: Path) -> tuple[Path, str]:
    """(result file, method) holding ``role``'s gradient measurement at ``length``."""
    method = ROLES[role]
    if length in OPERATOR_FILES and method in ("ibpo_resume", "rredcot_ibpo_resume"):
        return results_dir / OPERATOR_FILES[length], method
    if length in OPERATOR_FILES and role == "best_without_references":
        return results_dir / GRADIENT_FILES[length], COMMITTED_REPAIR_BANK
    return results_dir / GRADIENT_FILES[length], method


def gradient_entry(path: Path, method: str) -> dict:
    """The protocol's headline numbers for ``method`` in ``path`` (None where the file or method is missing)."""
    if not path.exists():
        return {"source": None, "method": method}
    result = json.loads(path.read_text())
    entry = result["methods"].get(method)
    if entry is None or HEADLINE_ROLLOUTS not in entry["batches"]:
        return {"source": None, "method": method}
    batch = entry["batches"][HEADLINE_ROLLOUTS]
    return {"source": str(path.relative_to(common.ROOT)), "method": method, "n_batches": batch["n_batches"],
            "cosine": batch["cosine_mean"], "cosine_minus_grpo": batch.get("cosine_minus_grpo_mean"),
            "cosine_minus_grpo_ci95": batch.get("cosine_minus_grpo_ci95"),
            "ess_over_grpo": entry.get("ess_over_grpo_at_32"), "ess_over_grpo_ci95": entry.get("ess_over_grpo_ci95"),
            "pool_accuracy": result["settings"].get("pool_accuracy")}


def length_build(length: str) -> tuple[Path, tuple[str, ...]]:
    """The build folder a length's runs use and the data overrides they need."""
    setting = SETTINGS[length]
    build = common.build_task(common.BUILD_DIRS[setting.preset], setting.preset)
    if length == "hard":
        record = common.write_setting_data(RUNS_DIR / "data_hard", setting, 256, common.MAIN_DATA_SEED)
        files = (f"data.train_files={record['train_files']}", f"data.val_files={record['val_files']}")
    else:
        files = ()
    return build, (*files, f"data.max_prompt_length={setting.max_prompt_length}",
                   f"data.max_response_length={setting.max_response_length}")


def cost_entry(out: Path) -> dict:
    """Median seconds of a run's steps >= 2 (step 1 carries the warm-up), from its metrics."""
    return {**common.step_cost(load_metrics(out / "metrics.jsonl")), "run": str(out)}


def measure_cost(length: str, steps: int, seed: int, roles: list[str]) -> dict:
    """``roles``' runs at ``length`` (a run with ``steps`` logged steps is kept, so a rerun resumes)."""
    build, overrides = length_build(length)
    runs = {role: (common.METHODS[ROLES[role]], RUNS_DIR / length / role) for role in roles}
    return common.cost_runs(runs, steps, seed, build, cost_entry, overrides=overrides,
                            preset=SETTINGS[length].preset)


def print_table(result: dict) -> None:
    common.print_table([{"length": length, "role": role, **entry["gradient"][role], **entry["cost"].get(role, {})}
                        for length, entry in result["lengths"].items() for role in ROLES],
                       ["length", "role", "cosine_minus_grpo", "cosine_minus_grpo_ci95", "ess_over_grpo",
                        "median_step_s", "over_grpo"])


def main(argv: list[str] | None = None) -> dict:
    cli = common.parser(__doc__, RESULTS_PATH, "no launches: the committed gradient results only", build=False)
    cli.add_argument("--settings", nargs="+", choices=LENGTHS, default=list(LENGTHS),
                     help="lengths whose cost runs to launch (the others' runs are read if present)")
    cli.add_argument("--cost-steps", type=int, default=4, help="steps per cost run (0: no launches)")
    cli.add_argument("--seed", type=int, default=1, help="data seed of the cost runs")
    cli.add_argument("--roles", nargs="+", choices=list(ROLES), default=list(ROLES),
                     help="roles whose cost runs to launch (GRPO's is always launched: the ratios are to it)")
    args = cli.parse_args(argv)
    if args.smoke:
        args.cost_steps = 0
    started = time.perf_counter()
    lengths = {}
    for length in LENGTHS:
        gradient = {role: gradient_entry(*gradient_source(length, role, common.RESULTS_DIR)) for role in ROLES}
        if args.cost_steps and length in args.settings:
            cost = measure_cost(length, args.cost_steps, args.seed, ["grpo", *(r for r in args.roles if r != "grpo")])
        else:
            cost = common.with_step_ratios({role: cost_entry(RUNS_DIR / length / role) for role in ROLES
                                            if (RUNS_DIR / length / role / "metrics.jsonl").exists()})
        lengths[length] = {"setting": {"task": SETTINGS[length].task.__dict__, "preset": SETTINGS[length].preset,
                                       "max_response_length": SETTINGS[length].max_response_length},
                           "gradient": gradient, "cost": cost}
    result = {"lengths": lengths, "roles": ROLES, "meta": {
        "headline": "32 prompts x 4 rollouts", "cost_steps": args.cost_steps, "seed": args.seed,
        "committed_repair_bank_at_default_and_hard": f"{COMMITTED_REPAIR_BANK} (rewrite operator)",
        "argv": sys.argv[1:] if argv is None else argv, "wall_s": time.perf_counter() - started,
        **common.machine_meta()}}
    print_table(result)
    return common.write_result(result, common.out_path(args, RESULTS_PATH))


if __name__ == "__main__":
    main()
