"""Does a segment-level estimator reach GRPO's accuracy in fewer training steps on the embedded task?

Real verl runs (``recipes/tiny_cpu/run.sh``) of ``common.METHODS`` variants, in two stages: a learning-rate sweep
(``--sweep``: ``--sweep-steps`` steps at each rate of ``SWEEP_LRS``, seed 0, on problems of a generator stream the
main runs do not validate on; the highest validation AUC wins, ties to the smaller rate), then main runs at the
chosen rates, seeds ``--seeds`` × ``--steps`` steps (segment_mc ``--segment-mc-steps``), greedy validation on
``--val-size`` problems every ``--test-freq`` steps, on the setting ``--setting`` (``common.SETTINGS``; its methods:
``methods_of``). On the answer-early and long settings every method trains at GRPO's swept rate; on the long one each
method but GRPO also at the rate matching GRPO's update norm (``<method>_norm_matched``: GRPO's rate × GRPO's median
Adam update norm / the method's, from the first seed's checkpoints at GRPO's rate, ``matched_learning_rate``; no
second runs where that rounds to GRPO's rate), and runs keep every checkpoint (``update_norms`` in each summary).

Every finished run is summarised in a ledger committed with the results (``results/sample_efficiency_runs/<setting>/
{sweep,main}/<run>.json``: launch settings and summary); a run the ledger holds is read, not launched, and an
interrupted main run resumes from its last verl checkpoint. ``--from-runs`` recomputes the JSON (seed-mean curves
with seed t and binomial intervals, AUC, steps and seconds to GRPO's final accuracy, differences from GRPO paired by
seed, diagnostics and localisation over the first and last 10 steps) from the ledger alone. RESULTS.md §3.

    python -m benchmarks.sample_efficiency --sweep                # the sweep only
    nohup nice -n 10 python -m benchmarks.sample_efficiency --setting hard > outputs/se_hard.log 2>&1 &
    python -m benchmarks.sample_efficiency --setting hard --from-runs --timing-seeds 1    # results/*_hard.json
    python -m benchmarks.sample_efficiency --setting default --from-runs --timing-seeds 3 \
        --methods grpo rredcot rredcot_exit_probe rredcot_group rredcot_ground_truth ibpo segment_mc
    python -m benchmarks.sample_efficiency --smoke                # seconds, no training: synthetic metrics (tests)
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks import common
from benchmarks.common import (
    MAIN_DATA_SEED,
    SETTINGS,
    Setting,
    area_under_curve,
    fmt,
    localisation_hit,
    t_interval,
)
from rredcot_verl.runs import load_metrics
from rredcot_verl.tasks import TASKS, load_model_dir
from rredcot_verl.tasks.model import PAD_TOKEN, chat_prompt_ids, response_ids

METHODS = ("grpo", "rredcot", "rredcot_exit_probe", "rredcot_group", "rredcot_ground_truth", "ibpo", "segment_mc",
           "rredcot_ibpo", "rredcot_repairs_degenerate", "rredcot_exit_probe_gated")  # the study's, of common.METHODS
# The long setting's: GRPO, the best configuration without reference solutions (the goal's), IBPO and rredcot with
# dataset references (benchmarks/length_scaling.py ROLES), in launch order; the repair operator that fits the long
# model's context (resume).
LONG_METHODS = ("grpo", "rredcot_repairs_degenerate_resume", "ibpo_resume", "rredcot")
# The hard setting's controls: GRPO with 1.5x and 2.5x the rollouts a prompt, gradients as much better than GRPO's as
# the repair-filled bank's at the gradient level (ESS 1.49 measured here, §4; about 2.4 elsewhere), so their steps to
# GRPO's final say what such a gradient buys in steps.
HARD_CONTROLS = ("grpo_n6", "grpo_n10")
# The answer-early setting's registered study (benchmarks/registrations/verdict.yaml): the policy's own exit-probe
# values, the best configuration without reference solutions and IBPO against GRPO at equal rollouts and at equal
# step time, every arm at GRPO's swept rate (a user swaps the estimator, not the learning rate).
EARLY_METHODS = ("grpo", "grpo_n5", "rredcot_exit_probe", "rredcot_repairs_degenerate", "ibpo")
CHOICES = tuple(dict.fromkeys((*METHODS, *HARD_CONTROLS, *LONG_METHODS, *EARLY_METHODS)))
# Settings whose methods all train at GRPO's rate and again at the rate matching GRPO's update norm.
NORM_MATCHED_SETTINGS = ("long",)
NORM_MATCHED = "_norm_matched"  # suffix of a run label at the matched rate
SWEEP_LRS = (1e-5, 3e-5, 1e-4)  # half-decades around the recipe's 2e-5 (3e-4 was dropped: RESULTS.md §3)
SWEEP_SETTING = "default"  # one sweep sets the rates of both settings
SWEEP_SEED = 0  # training seed (data.seed) of the sweep; the main runs use others
SWEEP_DATA_SEED = 1  # generator stream of the sweep's problems; the main runs' is MAIN_DATA_SEED
# No sweep of their own: segment_mc (its steps cost ~6x GRPO's) takes rredcot's rate; the methods added after the
# study take GRPO's (a user swaps the estimator, not the learning rate).
LEARNING_RATE_FROM = {"segment_mc": "rredcot", **{method: "grpo" for method in (
    "rredcot_ibpo", "rredcot_repairs_degenerate", "rredcot_exit_probe_gated", *HARD_CONTROLS)}}
LR_KEY = "actor_rollout_ref.actor.optim.lr"
WARMUP_KEY = "actor_rollout_ref.actor.optim.lr_warmup_steps"
RESULTS_PATH = common.RESULTS_DIR / "sample_efficiency.json"
# verl logs the reward function's score as acc (reward when it returns a dict without "acc"); both are 0/1 here.
VAL_KEYS = ("val-core/rredcot_arithmetic/acc/mean@1", "val-core/rredcot_arithmetic/reward/mean@1")
RUN_RECORD = "run.json"
LEDGER_DIR = common.RESULTS_DIR / "sample_efficiency_runs"
RUNS_ROOT_MARK = "<runs-root>"


def methods_of(setting: str) -> tuple[str, ...]:
    if setting in NORM_MATCHED_SETTINGS:
        return LONG_METHODS
    if setting == "early":
        return EARLY_METHODS
    return (*METHODS, *HARD_CONTROLS) if setting == "hard" else METHODS


def rates_from(setting: str, methods) -> dict[str, str]:
    """The methods that take another method's swept rate instead of their own, and whose."""
    if setting in (*NORM_MATCHED_SETTINGS, "early"):
        return {method: "grpo" for method in methods if method != "grpo"}
    return {method: source for method, source in LEARNING_RATE_FROM.items() if method in methods}


# ---------------------------------------------------------------- data


def check_lengths_fit(record: dict, setting: Setting, build: Path) -> None:
    """Refuse a setting whose prompts or reference responses do not fit verl's limits (they would be cut)."""
    import pandas as pd

    _, tokenizer = load_model_dir(str(build / "model"), with_model=False)
    for path in (record["train_files"], record["val_files"]):
        frame = pd.read_parquet(path)
        prompt = max(len(chat_prompt_ids(tokenizer, messages[0]["content"])) for messages in frame["prompt"])
        response = max(len(response_ids(tokenizer, info["reference_response"])) for info in frame["extra_info"])
        if prompt > setting.max_prompt_length or response > setting.max_response_length:
            raise ValueError(f"{path}: prompts up to {prompt} tokens, references up to {response}; the setting allows "
                             f"{setting.max_prompt_length} and {setting.max_response_length}")


def data_overrides(record: dict, setting: Setting) -> tuple[str, ...]:
    return (f"data.train_files={record['train_files']}", f"data.val_files={record['val_files']}",
            f"data.max_prompt_length={setting.max_prompt_length}",
            f"data.max_response_length={setting.max_response_length}")


# ---------------------------------------------------------------- runs


@dataclass(frozen=True)
class RunSpec:
    method: str
    seed: int
    steps: int
    lr: float
    overrides: tuple[str, ...]  # the method's own, then data and schedule (the learning rate is ``lr``)

    def record(self) -> dict:
        return json.loads(json.dumps(asdict(self)))  # tuples as lists, as read back from disk


def checkpoint_overrides(out: Path, every: int, keep_all: bool = False) -> tuple[str, ...]:
    """verl checkpoints every ``every`` steps into ``out/checkpoints`` (the latest kept, or all with ``keep_all``:
    their optimizer states give the run's update norms), resumed by a relaunch."""
    return (f"trainer.default_local_dir={out / 'checkpoints'}", f"trainer.save_freq={every}",
            "trainer.resume_mode=auto", f"trainer.max_actor_ckpt_to_keep={'null' if keep_all else 1}")


def launch_files(out: Path) -> list[Path]:
    """The run's metrics files, one per launch, oldest first: ``metrics.launch<n>.jsonl`` (archived), then
    ``metrics.jsonl`` (the latest launch)."""
    archived = sorted(out.glob("metrics.launch*.jsonl"), key=lambda path: int(path.stem.removeprefix("metrics.launch")))
    return [*archived, *[out / "metrics.jsonl"] * (out / "metrics.jsonl").exists()]


def merge_launches(launches: list[list[dict]]) -> list[dict]:
    """One row per step across launches of a run. A launch starts at the checkpoint it resumed from (or at 0), so its
    rows replace every earlier row after its first step; at its first step (validation at resume) they are merged
    into the earlier row."""
    merged: dict[int, dict] = {}
    for rows in launches:
        if not rows:
            continue
        first = min(row["step"] for row in rows)
        merged = {step: row for step, row in merged.items() if step <= first}
        for row in rows:
            merged[row["step"]] = {**merged.get(row["step"], {}), **row}
    return [merged[step] for step in sorted(merged)]


def read_run(out: Path) -> list[dict]:
    return merge_launches([load_metrics(path) for path in launch_files(out)])


def run_complete(out: Path, spec: RunSpec) -> bool:
    """The run reached its last step under exactly this launch (a changed learning rate or data relaunches it)."""
    record = out / RUN_RECORD
    if not launch_files(out) or not record.exists() or json.loads(record.read_text()) != spec.record():
        return False
    return any(row["step"] >= spec.steps for row in read_run(out))


def archive_launch(out: Path) -> None:
    """Keep the last launch's metrics and log (``run.sh`` starts both afresh) as ``*.launch<n>.*``."""
    if not (out / "metrics.jsonl").exists():
        return
    number = len(launch_files(out))
    (out / "metrics.jsonl").rename(out / f"metrics.launch{number}.jsonl")
    if (out / "train.log").exists():
        (out / "train.log").rename(out / f"train.launch{number}.log")


def clear_run(out: Path) -> None:
    """Remove what a launch with other settings left: its metrics, logs, snapshots and checkpoints."""
    for path in (*out.glob("metrics*.jsonl"), *out.glob("train*.log")):
        path.unlink()
    for folder in ("snapshots", "checkpoints"):
        shutil.rmtree(out / folder, ignore_errors=True)


def ensure_run(out: Path, spec: RunSpec, build: Path, ledger: Ledger, preset: str = "default") -> int:
    """Launch the run unless the ledger has it or its folder is complete; a run interrupted under the same settings
    resumes from its last checkpoint (main runs; sweep runs start over), and a failed launch is retried once (the
    machine is shared). A complete run is recorded in the ledger. Returns the exit code (0 if complete)."""
    if ledger.summary(out, spec) is not None:
        return 0
    out.mkdir(parents=True, exist_ok=True)
    record = out / RUN_RECORD
    if not record.exists() or json.loads(record.read_text()) != spec.record():
        clear_run(out)
    record.write_text(json.dumps(spec.record(), indent=2) + "\n")
    overrides = (*spec.overrides, f"{LR_KEY}={spec.lr}")
    # A guard against hangs only: segment_mc steps take about 60 s here (benchmarks/results/cost.json), plus
    # validation (about 50 s per 1,000 problems; about 60 s at the long setting, whose steps take 6-13 s); an expired
    # launch is relaunched and resumes from its checkpoint.
    timeout_s = 900 + 90 * spec.steps
    recipe = common.METHODS[spec.method].recipe
    code = 1
    for _ in range(2):
        archive_launch(out)
        code = common.launch_run(recipe, out, spec.steps, spec.seed, build, overrides, timeout_s=timeout_s,
                                 preset=preset)
        if code == 0:
            break
    ledger.summary(out, spec)
    return code


@dataclass(frozen=True)
class Ledger:
    """Finished runs' summaries, ``<root>/<setting>/<sweep|main>/<run>.json``, keyed by the run folder's place under
    ``runs_root``; paths in the launch settings are kept relative to ``runs_root`` so another checkout matches them."""
    root: Path
    runs_root: Path

    def path(self, out: Path) -> Path:
        relative = out.relative_to(self.runs_root)
        return self.root / relative.parent / f"{relative.name}.json"  # not with_suffix: "lr0.0001" has a dot

    def portable(self, spec: RunSpec) -> dict:
        record = spec.record()
        record["overrides"] = [item.replace(str(self.runs_root), RUNS_ROOT_MARK) for item in record["overrides"]]
        return record

    def read(self, out: Path, spec: RunSpec) -> dict | None:
        """The ledger's summary of the run if it was recorded under exactly this launch."""
        path = self.path(out)
        if not path.exists():
            return None
        entry = json.loads(path.read_text())
        return entry["summary"] if entry["spec"] == self.portable(spec) else None

    def summary(self, out: Path, spec: RunSpec) -> dict | None:
        """The run's summary: from the ledger, else from a complete run folder (then recorded); None if neither."""
        recorded = self.read(out, spec)
        if recorded is not None:
            return recorded
        if not run_complete(out, spec):
            return None
        summary = {**summarise_run(out), "source": "metrics"}
        self.path(out).parent.mkdir(parents=True, exist_ok=True)
        self.path(out).write_text(json.dumps({"spec": self.portable(spec), "summary": summary}, indent=1) + "\n")
        return summary


def schedule_overrides(steps: int, test_freq: int) -> tuple[str, ...]:
    return f"trainer.total_training_steps={steps}", f"trainer.test_freq={test_freq}"


def sweep_specs(method: str, steps: int, test_freq: int, data: tuple[str, ...]) -> dict[float, RunSpec]:
    overrides = (*common.METHODS[method].overrides, *data, *schedule_overrides(steps, test_freq))
    return {lr: RunSpec(method, SWEEP_SEED, steps, lr, overrides) for lr in SWEEP_LRS}


def sweep_dir(setting_dir: Path, method: str, lr: float) -> Path:
    return setting_dir / "sweep" / f"{method}_lr{lr:g}"


def main_dir(setting_dir: Path, method: str, seed: int) -> Path:
    return setting_dir / "main" / f"{method}_seed{seed}"


# ---------------------------------------------------------------- analysis


def read_snapshots(out: Path) -> list[dict]:
    """The estimator's per-step snapshots (``snapshots/step_*.json``), in step order."""
    return [json.loads(path.read_text()) for path in sorted((out / "snapshots").glob("step_*.json"))]


def snapshot_advantage_variance(snapshots: list[dict]) -> float | None:
    """Mean over steps of the variance of the snapshots' token advantages (None if none); padding positions of the
    responses are left out."""
    variances = []
    for snapshot in snapshots:
        tokens = [a for trace in snapshot.get("traces", [])
                  for a, token in zip(trace.get("token_advantages", []), trace.get("response_tokens", []))
                  if token != PAD_TOKEN]
        if len(tokens) > 1:
            variances.append(float(np.var(tokens)))
    return float(np.mean(variances)) if variances else None


# Per-step training metrics averaged over the first and the last ``DIAGNOSTIC_WINDOW`` steps of a run: where a method
# does not beat GRPO, these say whether its signal was there (train reward, advantage spread), cut (clipping,
# fallbacks) or spent elsewhere (entropy, length).
DIAGNOSTIC_KEYS = (
    "critic/score/mean", "actor/entropy", "actor/pg_clipfrac", "response_length/mean",
    "rredcot/redistributed_frac", "rredcot/clipped_trace_frac", "rredcot/negative_coef_frac",
    "rredcot/degenerate_groups", "rredcot/traces_without_candidates",
    "ibpo/repair_success_rate", "ibpo/masked_token_frac", "ibpo/phi_mean_incorrect",
    "segment_mc/truncated_continuations",
    "rredcot/value_gate_open", "rredcot_ibpo/value_gate_open", "rredcot_ibpo/credit_from_values_frac",
    "rredcot/bank_groups_from_traces", "rredcot/bank_groups_from_repairs", "rredcot/bank_groups_empty",
)
FALLBACK_PREFIX, FALLBACK_TOTAL = "rredcot/fallback/", "rredcot/fallback_total"  # the per-reason counts, summed
DIAGNOSTIC_WINDOW = 10


def with_fallback_total(row: dict) -> dict:
    fallbacks = [value for key, value in row.items() if key.startswith(FALLBACK_PREFIX)]
    return {**row, FALLBACK_TOTAL: float(sum(fallbacks))} if fallbacks else row


def window_means(rows: list[dict]) -> dict:
    """{"first": {key: mean}, "last": {key: mean}} over the first and last ``DIAGNOSTIC_WINDOW`` training steps."""
    steps = sorted({row["step"] for row in rows if row["step"] >= 1 and "timing_s/step" in row})
    windows = {"first": set(steps[:DIAGNOSTIC_WINDOW]), "last": set(steps[-DIAGNOSTIC_WINDOW:])}
    means = {}
    for name, window in windows.items():
        picked = [with_fallback_total(row) for row in rows if row["step"] in window]
        means[name] = {key: float(np.mean([row[key] for row in picked if key in row]))
                       for key in (*DIAGNOSTIC_KEYS, FALLBACK_TOTAL) if any(key in row for row in picked)}
    return means


def blamed_segment(trace: dict) -> int | None:
    """0-based segment holding an incorrect trace's first wrong step (for a missing step, the segment that reaches
    where it would start), from the arithmetic task's annotator; None when the annotator finds no wrong step."""
    wrong = TASKS["arithmetic"].first_wrong_step(trace["extra_info"], trace["response"])
    if wrong is None:
        return None
    _, (start, stop) = wrong
    tokens = [token for token in trace["response_tokens"] if token != PAD_TOKEN]
    char_ends = np.cumsum([len(token) for token in tokens])
    for j, end in enumerate(end for end in trace["seg_ends"] if end != -1):
        if char_ends[min(end, len(tokens)) - 1] >= max(stop, start + 1):
            return j
    return None


def snapshot_localisation(snapshots: list[dict]) -> dict | None:
    """Value quality during training, from the estimator's per-step snapshots: on incorrect traces with a known first
    wrong step, how often the most negative segment reward falls on the segment holding that step ("first" and
    "last" ``DIAGNOSTIC_WINDOW`` steps; ``chance``: mean 1/K). None for estimators without segment rewards (grpo,
    ibpo)."""
    if not snapshots:
        return None
    windows = {"first": snapshots[:DIAGNOSTIC_WINDOW], "last": snapshots[-DIAGNOSTIC_WINDOW:]}
    result = {}
    for name, window in windows.items():
        scored = []
        for snapshot in window:
            for trace in snapshot.get("traces", []):
                rewards = trace.get("segment_rewards") or []
                # The annotator runs only on incorrect traces that have segment rewards to compare.
                if trace.get("outcome") == 0.0 and sum(r is not None for r in rewards) >= 2:
                    scored.append(localisation_hit(rewards, blamed_segment(trace)))
        scored = [s for s in scored if s is not None]
        if not scored:
            return None
        result[name] = {"localisation": float(np.mean([hit for hit, _ in scored])),
                        "chance": float(np.mean([chance for _, chance in scored])), "traces": len(scored)}
    return result


def checkpoint_update_norms(out: Path) -> list[dict] | None:
    """From every verl checkpoint of the run (``checkpoints/global_step_<n>/actor``, all ranks' shards): the norm of
    the AdamW step taken at that step, ``lr·m̂/(√v̂ + ε)`` from the saved moments (the decoupled weight decay left
    out), the parameter norm, and the distance the parameters moved since the previous checkpoint. None without
    checkpoints. Under Adam the step's size follows the consistency of the gradient's signs, not its norm."""
    import torch

    folders = sorted((out / "checkpoints").glob("global_step_*/actor"), key=lambda path: int(
        path.parent.name.removeprefix("global_step_")))
    if not folders:
        return None
    norms, previous = [], None
    for folder in folders:
        update_sq, parameters = 0.0, {}
        for path in sorted(folder.glob("optim_world_size_*_rank_*.pt")):
            state = torch.load(path, weights_only=False, map_location="cpu")
            group = state["param_groups"][0]
            (beta1, beta2), eps, lr = group["betas"], group["eps"], group["lr"]
            for moments in state["state"].values():
                step = float(moments["step"])
                mean = common.local_tensor(moments["exp_avg"]) / (1 - beta1**step)
                scale = (common.local_tensor(moments["exp_avg_sq"]) / (1 - beta2**step)).sqrt() + eps
                update_sq += float(((lr * mean / scale) ** 2).sum())
        for path in sorted(folder.glob("model_world_size_*_rank_*.pt")):
            for name, tensor in torch.load(path, weights_only=False, map_location="cpu").items():
                parameters[(path.name, name)] = common.local_tensor(tensor)
        entry = {"step": int(folder.parent.name.removeprefix("global_step_")), "adam_update_norm": update_sq**0.5,
                 "parameter_norm": sum(float((t**2).sum()) for t in parameters.values()) ** 0.5}
        if previous is not None:
            entry["moved_since_previous"] = sum(float(((t - previous[key]) ** 2).sum())
                                                for key, t in parameters.items()) ** 0.5
        norms.append(entry)
        previous = parameters
    return norms


def summarise_run(out: Path) -> dict:
    rows, snapshots = read_run(out), read_snapshots(out)
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
    points = [{"step": step, "seconds": elapsed.get(step, 0.0), "accuracy": accuracy} for step, accuracy in validation]
    return {
        "validation": points,
        "auc": area_under_curve(points),
        "median_step_s": common.median_step_s(rows),
        "advantage_range_mean": float(np.mean(ranges)) if ranges else None,
        "token_advantage_variance": snapshot_advantage_variance(snapshots),
        "grad_norm_mean": float(np.mean(grad_norms)) if grad_norms else None,
        "grad_norm_variance": float(np.var(grad_norms)) if len(grad_norms) > 1 else None,
        "steps": max((row["step"] for row in rows), default=0),
        "diagnostics": window_means(rows),
        "localisation": snapshot_localisation(snapshots),
        "update_norms": checkpoint_update_norms(out),
    }


def mean_or_none(values: list) -> float | None:
    """Mean of the values present (a run transcribed from a lost machine has no timings); None if none is."""
    present = [value for value in values if value is not None]
    return float(np.mean(present)) if present else None


def mean_curve(runs: list[dict], val_size: int) -> list[dict]:
    """Seed-mean accuracy, its intervals and seconds at the validation steps all seeds share."""
    shared = set.intersection(*({v["step"] for v in run["validation"]} for run in runs)) if runs else set()
    curve = []
    for step in sorted(shared):
        points = [next(v for v in run["validation"] if v["step"] == step) for run in runs]
        accuracies = [p["accuracy"] for p in points]
        curve.append({"step": step, "accuracy": float(np.mean(accuracies)),
                      "accuracy_sd": float(np.std(accuracies, ddof=1)) if len(accuracies) > 1 else 0.0,
                      "ci95_seeds": t_interval(accuracies),
                      "ci95_binomial": common.binomial_interval(accuracies, val_size),
                      "seconds": mean_or_none([p["seconds"] for p in points])})
    return curve


def first_reaching(curve: list[dict], target: float) -> dict | None:
    return next((point for point in curve if point["step"] > 0 and point["accuracy"] >= target), None)


def swept_methods(methods, borrowed: dict[str, str]) -> list[str]:
    """The methods with sweep runs of their own: ``methods``, each borrower replaced by its source in ``borrowed``."""
    return list(dict.fromkeys(borrowed.get(method, method) for method in methods))


def choose_learning_rates(setting_dir: Path, methods, steps: int, test_freq: int, data: tuple[str, ...],
                          ledger: Ledger, borrowed: dict[str, str]) -> dict:
    """Per method: the AUC of each complete sweep run and the chosen rate (highest AUC, ties to the smaller
    rate); a method whose sweep is incomplete gets ``lr`` None and no main runs. A method in ``borrowed``
    (``rates_from``) gets the rate chosen for its source (``lr_from``) and no AUCs."""
    chosen = {}
    for method in swept_methods(methods, borrowed):
        aucs = {}
        for lr, spec in sweep_specs(method, steps, test_freq, data).items():
            summary = ledger.summary(sweep_dir(setting_dir, method, lr), spec)
            aucs[lr] = summary["auc"] if summary else None
        complete = all(auc is not None for auc in aucs.values())
        best = max(SWEEP_LRS, key=lambda lr: (aucs[lr], -lr)) if complete else None
        chosen[method] = {"lr": best, "auc_by_lr": {f"{lr:g}": auc for lr, auc in aucs.items()}}
    for method in methods:
        if method in borrowed:
            source = borrowed[method]
            chosen[method] = {"lr": chosen[source]["lr"], "auc_by_lr": None, "lr_from": source}
    return chosen


def median_update_norm(run: dict | None) -> float | None:
    """A run summary's median AdamW step norm over its checkpoints; None for a run that kept none."""
    norms = [entry["adam_update_norm"] for entry in (run or {}).get("update_norms") or ()]
    return statistics.median(norms) if norms else None


def matched_learning_rate(grpo_lr: float, grpo_run: dict | None, method_run: dict | None) -> dict | None:
    """The rate at which the method's Adam steps match GRPO's in norm: GRPO's rate × GRPO's median update norm over
    the method's, both at GRPO's rate (the first seed's runs), to two significant digits so the launch settings stay
    fixed. None until both runs have update norms."""
    medians = [median_update_norm(grpo_run), median_update_norm(method_run)]
    if None in medians:
        return None
    ratio = medians[0] / medians[1]
    return {"lr": float(f"{grpo_lr * ratio:.2g}"), "update_norm_ratio": ratio, "grpo_median_update_norm": medians[0],
            "method_median_update_norm": medians[1]}


def mean_over_runs(per_run: list[dict | None]) -> dict | None:
    """Seed mean of ``{window: {key: value}}`` summaries (``traces`` counts are summed); None if no run has one."""
    present = [summary for summary in per_run if summary]
    if not present:
        return None
    merged = {}
    for window in present[0]:
        keys = {key for summary in present for key in summary.get(window, {})}
        merged[window] = {key: (sum if key == "traces" else np.mean)([s[window][key] for s in present
                                                                      if key in s.get(window, {})]) for key in keys}
        merged[window] = {key: float(value) for key, value in sorted(merged[window].items())}
    return merged


def paired_with_grpo(runs: dict[str, dict], grpo_runs: dict[str, dict]) -> dict | None:
    """Per seed both have, the method's run minus GRPO's on the validation steps both runs share (segment_mc's
    shorter runs against GRPO's first steps): AUC and accuracy at the last shared step, seed mean and 95% t interval.
    A seed fixes the order of the training prompts, which both runs of a pair then see alike."""
    auc_differences, final_differences, last_steps = [], [], set()
    for seed in sorted(set(runs) & set(grpo_runs), key=int):
        mine, theirs = common.on_shared_steps(runs[seed]["validation"], grpo_runs[seed]["validation"])
        if len(mine) < 2:
            continue
        auc_differences.append(area_under_curve(mine) - area_under_curve(theirs))
        final_differences.append(mine[-1]["accuracy"] - theirs[-1]["accuracy"])
        last_steps.add(mine[-1]["step"])
    if not auc_differences:
        return None
    return {"seeds": len(auc_differences), "up_to_step": max(last_steps),
            "auc_difference": float(np.mean(auc_differences)), "auc_difference_ci95": t_interval(auc_differences),
            "final_difference": float(np.mean(final_differences)),
            "final_difference_ci95": t_interval(final_differences)}


def without_timings(run: dict) -> dict:
    """The run's summary with its seconds dropped, for a run outside the timing seeds."""
    return {**run, "median_step_s": None,
            "validation": [{**point, "seconds": None} for point in run["validation"]]}


def analyse(setting_dir: Path, specs: dict, val_size: int, ledger: Ledger,
            timing_seeds: list[int] | None = None) -> dict:
    """Summaries of the complete main runs; ``specs``: {method: [RunSpec per seed]}. Training seconds (curve,
    median step, seconds to GRPO's final) come from ``timing_seeds`` only, when given: seconds measured in different
    sittings of a shared machine are not comparable (the same run's steps took up to 5x longer on one day)."""
    per_method = {}
    for method, method_specs in specs.items():
        runs = {spec.seed: ledger.summary(main_dir(setting_dir, method, spec.seed), spec) for spec in method_specs}
        runs = {seed: run if timing_seeds is None or seed in timing_seeds else without_timings(run)
                for seed, run in runs.items() if run and run["validation"]}
        if not runs:
            continue

        curve = mean_curve(list(runs.values()), val_size)
        per_method[method] = {
            "seeds": sorted(runs), "steps": method_specs[0].steps, "val_size": val_size, "lr": method_specs[0].lr,
            "curve": curve, "auc": area_under_curve(curve),
            "auc_ci95_seeds": t_interval([run["auc"] for run in runs.values() if run["auc"] is not None]),
            "runs": {str(s): r for s, r in runs.items()},
            "diagnostics": mean_over_runs([run["diagnostics"] for run in runs.values()]),
            "localisation": mean_over_runs([run["localisation"] for run in runs.values()]),
            **{key: mean_or_none([run[key] for run in runs.values()])
               for key in ("median_step_s", "advantage_range_mean", "token_advantage_variance",
                           "grad_norm_mean", "grad_norm_variance")},
            # seed mean of each run's median AdamW step norm over its checkpoints (runs that kept them)
            "adam_update_norm": mean_or_none([median_update_norm(run) for run in runs.values()]),
        }
    grpo = per_method.get("grpo")
    for method, entry in per_method.items():
        entry["paired_with_grpo"] = paired_with_grpo(entry["runs"], grpo["runs"]) if grpo and method != "grpo" else None
    target = grpo["curve"][-1]["accuracy"] if grpo and grpo["curve"] else None
    grpo_reached = first_reaching(grpo["curve"], target) if target is not None else None
    for entry in per_method.values():
        entry["initial_accuracy"] = entry["curve"][0]["accuracy"] if entry["curve"] else None
        entry["final_accuracy"] = entry["curve"][-1]["accuracy"] if entry["curve"] else None
        entry["final_seconds"] = entry["curve"][-1]["seconds"] if entry["curve"] else None
        reached = first_reaching(entry["curve"], target) if target is not None else None
        entry["steps_to_grpo_final"] = reached["step"] if reached else None
        entry["seconds_to_grpo_final"] = reached["seconds"] if reached else None
        entry["steps_to_grpo_final_over_grpo"] = (reached["step"] / grpo_reached["step"]
                                                  if reached and grpo_reached else None)
    return {"grpo_final_accuracy": target, "grpo_steps_to_final": grpo_reached["step"] if grpo_reached else None,
            "methods": per_method}


# ---------------------------------------------------------------- output


def timed_seeds(result: dict) -> list[int]:
    """The seeds whose training seconds the curves use: the timing seeds that have complete runs so far."""
    return sorted({int(seed) for entry in result["methods"].values() for seed, run in entry["runs"].items()
                   if run["median_step_s"] is not None})


def seed_band(entry: dict) -> np.ndarray | None:
    """The curve's 95% seed interval to shade, clipped to [0, 1]: only from three seeds on, because two seeds' t
    interval (±12.7 sd) is wide enough to hide every other curve."""
    if len(entry["seeds"]) < 3 or not all(p["ci95_seeds"] for p in entry["curve"]):
        return None
    return np.clip([p["ci95_seeds"] for p in entry["curve"]], 0.0, 1.0)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    colours = plt.get_cmap("tab20").colors  # one colour a method for up to 20; controls and matched rates dashed
    for index, (method, entry) in enumerate(result["methods"].items()):
        curve = entry["curve"]
        steps = [p["step"] for p in curve]
        accuracy = np.array([p["accuracy"] for p in curve])
        style = {"color": colours[(2 * index) % 20 + index // 10],
                 "linestyle": "--" if method in HARD_CONTROLS or method.endswith(NORM_MATCHED) else "-"}
        by_step.plot(steps, accuracy, marker="o", label=f"{method} ({len(entry['seeds'])} seeds, lr {entry['lr']:g})",
                     **style)
        band = seed_band(entry)
        if band is not None:
            by_step.fill_between(steps, band[:, 0], band[:, 1], alpha=0.12, color=style["color"])
        timed = [(p["seconds"], p["accuracy"]) for p in curve if p["seconds"] is not None]
        by_time.plot([t for t, _ in timed], [a for _, a in timed], marker="o", label=method, **style)
    if result["grpo_final_accuracy"] is not None:
        for axis in (by_step, by_time):
            axis.axhline(result["grpo_final_accuracy"], color="grey", linestyle=":", linewidth=1)
    by_step.set(xlabel="training step", ylabel="validation accuracy (mean@1)",
                title=f"accuracy vs step (95% seed t interval, 3+ seeds), {result['meta']['setting']}")
    timing_seeds = timed_seeds(result)
    by_time.set(xlabel="training seconds (cumulative timing_s/step)",
                title=f"accuracy vs wall-clock (seconds of seed{'s' if len(timing_seeds) > 1 else ''} "
                      f"{' '.join(map(str, timing_seeds))})")
    by_step.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def print_table(result: dict) -> None:
    print(f"GRPO final accuracy {fmt(result['grpo_final_accuracy'], 0, 3)} (reached at step "
          f"{result['grpo_steps_to_final']})")
    methods = result["methods"]

    def window(entry: dict | None, key: str) -> str:
        """``first→last`` of a windowed summary, '-' without one."""
        values = [((entry or {}).get(name) or {}).get(key) for name in ("first", "last")]
        return "-" if values[0] is None else "→".join(fmt(value, 0, 3) for value in values)

    common.print_table([{"method": method, **e, "seeds": len(e["seeds"])} for method, e in methods.items()], {
        "method": "", "seeds": "d", "lr": ".2g", "initial_accuracy": ".3f", "final_accuracy": ".3f", "auc": ".3f",
        "steps_to_grpo_final": "", "steps_to_grpo_final_over_grpo": ".2f", "seconds_to_grpo_final": ".0f",
        "median_step_s": ".2f", "advantage_range_mean": ".2f", "grad_norm_variance": ".4f"})
    common.print_table([{"method": method, **e["paired_with_grpo"]} for method, e in methods.items()
                        if e["paired_with_grpo"]],
                       ["method", "seeds", "up_to_step", "auc_difference", "auc_difference_ci95", "final_difference",
                        "final_difference_ci95"], "\nminus GRPO, paired by seed (mean, 95% t interval)")
    common.print_table([{"method": method, **{key: window(e["diagnostics"], key) for key in (
        "critic/score/mean", "rredcot/redistributed_frac", "rredcot/clipped_trace_frac")},
        "localisation (chance)": window(e["localisation"], "localisation") + (
            f" ({e['localisation']['last']['chance']:.2f})" if e["localisation"] else "")}
        for method, e in methods.items()],
        ["method", "critic/score/mean", "rredcot/redistributed_frac", "rredcot/clipped_trace_frac",
         "localisation (chance)"], f"\nfirst → last {DIAGNOSTIC_WINDOW} steps")


def write_synthetic_metrics(out: Path, slope: float, seed: int, steps: int, test_freq: int, step_s: float) -> None:
    """A metrics file shaped like verl's FileLogger output: accuracy ``0.3 + slope·step + 0.001·seed`` validated at
    step 0 and every ``test_freq`` steps (1 s each, outside timing_s/step), ``step_s`` training seconds a step."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [{"step": 0, "data": {VAL_KEYS[0]: 0.3 + 0.001 * seed}}]
    for step in range(1, steps + 1):
        data = {"timing_s/step": step_s, "actor/grad_norm": 0.1 * (seed + step % 2),
                "critic/score/mean": 0.3 + slope * step,
                "critic/advantages/max": 1.0 + 0.1 * slope, "critic/advantages/min": -1.0}
        if step % test_freq == 0 or step == steps:
            data["timing_s/testing"] = 1.0
            data[VAL_KEYS[0]] = 0.3 + slope * step + 0.001 * seed
        lines.append({"step": step, "data": data})
    (out / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def write_synthetic_runs(sweep_setting_dir: Path, setting_dir: Path, sweep: dict[str, dict[float, RunSpec]],
                         main: dict[str, list[RunSpec]], test_freq: int) -> None:
    """For ``--smoke`` and the tests. Sweep: the second rate of ``SWEEP_LRS`` learns fastest, so it is chosen.
    Main: the m-th run label of ``main`` gains ``0.01·(m mod 10 + 1)`` accuracy a step and takes ``5 + m`` s a step."""
    for method, specs in sweep.items():
        for lr, spec in specs.items():
            out = sweep_dir(sweep_setting_dir, method, lr)
            write_synthetic_metrics(out, 0.02 if lr == SWEEP_LRS[1] else 0.01, spec.seed, spec.steps, test_freq, 5.0)
            (out / RUN_RECORD).write_text(json.dumps(spec.record()))
    for m, (label, specs) in enumerate(main.items()):
        for spec in specs:
            out = main_dir(setting_dir, label, spec.seed)
            write_synthetic_metrics(out, 0.01 * (m % 10 + 1), spec.seed, spec.steps, test_freq, 5.0 + m)
            (out / RUN_RECORD).write_text(json.dumps(spec.record()))


def main_specs(setting_name: str, methods, lrs: dict, seeds: list[int], steps: int, segment_mc_steps: int,
               test_freq: int, data: tuple[str, ...], setting_dir: Path, ledger: Ledger) -> dict[str, list[RunSpec]]:
    """The main runs by label: each method at its rate in ``lrs`` (skipped while that is None) and, on the
    ``NORM_MATCHED_SETTINGS``, each method but GRPO at the rate matching GRPO's update norm (``<method>_norm_matched``,
    once the first seed's runs at GRPO's rate are complete; its rate is added to ``lrs``, and to the method's entry
    as ``norm_matched``). A matched rate equal to the method's own rate adds no runs: they would repeat its runs."""
    keep_all = setting_name in NORM_MATCHED_SETTINGS

    def specs_at(label: str, method: str, lr: float) -> list[RunSpec]:
        run_steps = segment_mc_steps if method == "segment_mc" else steps
        overrides = (*common.METHODS[method].overrides, *data, *schedule_overrides(run_steps, test_freq))
        return [RunSpec(method, seed, run_steps, lr, (
            *overrides, *checkpoint_overrides(main_dir(setting_dir, label, seed), test_freq, keep_all)))
            for seed in seeds]

    specs = {method: specs_at(method, method, lrs[method]["lr"]) for method in methods if lrs[method]["lr"] is not None}
    if not keep_all or "grpo" not in specs:
        return specs

    def first_run(method: str) -> dict | None:
        return ledger.summary(main_dir(setting_dir, method, seeds[0]), specs[method][0])

    for method in [m for m in methods if m != "grpo" and m in specs]:
        matched = matched_learning_rate(lrs["grpo"]["lr"], first_run("grpo"), first_run(method))
        if matched is None:
            continue
        lrs[method]["norm_matched"] = matched
        if matched["lr"] == lrs[method]["lr"]:
            continue  # the method's rate already matches GRPO's update norm: its runs there are the matched runs
        label = method + NORM_MATCHED
        lrs[label] = {**matched, "auc_by_lr": None, "lr_from": "grpo", "matched_on_seed": seeds[0]}
        specs[label] = specs_at(label, method, matched["lr"])
    return specs


def main(argv: list[str] | None = None) -> dict:
    parser = common.parser(__doc__, RESULTS_PATH, "no training: synthetic metrics in a temp folder")
    parser.add_argument("--setting", choices=tuple(SETTINGS), default="default")
    parser.add_argument("--sweep", action="store_true", help="launch only the learning-rate sweep runs")
    parser.add_argument("--runs-root", type=Path, default=common.ROOT / "outputs" / "bench" / "sample_efficiency",
                        help="runs go to <runs-root>/<setting>/{sweep,main}/")
    parser.add_argument("--ledger", type=Path, default=LEDGER_DIR,
                        help="finished runs' summaries, read before launching (temp with --smoke)")
    parser.add_argument("--methods", nargs="+", choices=CHOICES, default=None,
                        help="default: the setting's study (LONG_METHODS on the long setting, else METHODS)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--segment-mc-steps", type=int, default=50,
                        help="main-run steps for segment_mc (its steps cost about 6x GRPO's)")
    parser.add_argument("--test-freq", type=int, default=10)
    parser.add_argument("--val-size", type=int, default=1000, help="validation problems of the main runs and sweep")
    parser.add_argument("--sweep-steps", type=int, default=30)
    parser.add_argument("--sweep-test-freq", type=int, default=10)
    parser.add_argument("--no-launch", action="store_true", help="only analyse the runs already there")
    parser.add_argument("--from-runs", action="store_true",
                        help="recompute the JSON from the ledger (and run folders) alone: no build, data or launch")
    parser.add_argument("--timing-seeds", nargs="+", type=int, default=None,
                        help="seeds whose runs' training seconds enter the analysis (default all): those whose runs "
                             "of every method ran back to back in one sitting, so that their seconds compare")
    args = parser.parse_args(argv)
    if SWEEP_SEED in args.seeds:
        parser.error(f"seed {SWEEP_SEED} is the sweep's; main runs must use others")
    setting = SETTINGS[args.setting]
    args.methods = args.methods or list(methods_of(args.setting))
    borrowed = rates_from(args.setting, args.methods)
    if args.smoke:
        args.runs_root = Path(tempfile.mkdtemp()) / "runs"
        args.ledger = args.runs_root.parent / "ledger"
        args.seeds, args.steps, args.segment_mc_steps, args.test_freq = [1, 2], 6, 6, 2
        args.sweep_steps, args.sweep_test_freq, args.no_launch = 4, 2, True
    setting_dir, sweep_setting_dir = args.runs_root / args.setting, args.runs_root / SWEEP_SETTING
    ledger = Ledger(args.ledger, args.runs_root)
    sweep_setting = SETTINGS[SWEEP_SETTING]
    default_out = RESULTS_PATH if args.setting == "default" else RESULTS_PATH.with_stem(
        f"{RESULTS_PATH.stem}_{args.setting}")
    out = args.out or (args.runs_root.parent / default_out.name if args.smoke else default_out)
    args.no_launch = args.no_launch or args.from_runs
    # The sweep trains the default build; the main runs the build of their setting's preset.
    sweep_build = args.build
    main_build = common.BUILD_DIRS[setting.preset] if args.build == common.BUILD_DIR else args.build

    main_data = sweep_data = {"train_files": "synthetic", "val_files": "synthetic", "val_size": args.val_size}
    if not args.smoke:
        data = common.setting_data if args.from_runs else common.write_setting_data
        main_data = data(setting_dir / "data_main", setting, args.val_size, MAIN_DATA_SEED)
        sweep_data = data(sweep_setting_dir / "data_sweep", sweep_setting, args.val_size, SWEEP_DATA_SEED)
    if not args.smoke and not args.from_runs:
        common.build_task(sweep_build)
        common.build_task(main_build, setting.preset)
        check_lengths_fit(main_data, setting, main_build)
    sweep_overrides = data_overrides(sweep_data, sweep_setting)
    sweep = {m: sweep_specs(m, args.sweep_steps, args.sweep_test_freq, sweep_overrides)
             for m in swept_methods(args.methods, borrowed)}

    def specs_now(lrs: dict) -> dict[str, list[RunSpec]]:
        return main_specs(args.setting, args.methods, lrs, args.seeds, args.steps, args.segment_mc_steps,
                          args.test_freq, data_overrides(main_data, setting), setting_dir, ledger)

    codes = {}
    if args.smoke:
        synthetic_lrs = {m: {"lr": SWEEP_LRS[1]} for m in args.methods}
        write_synthetic_runs(sweep_setting_dir, setting_dir, sweep, specs_now(synthetic_lrs), args.test_freq)
    if not args.no_launch:  # sweep first: the main runs need its choice
        for method, specs in sweep.items():
            for lr, spec in specs.items():
                out_dir = sweep_dir(sweep_setting_dir, method, lr)
                codes[f"sweep/{method}_lr{lr:g}"] = ensure_run(out_dir, spec, sweep_build, ledger)
    lrs = choose_learning_rates(sweep_setting_dir, args.methods, args.sweep_steps, args.sweep_test_freq,
                                sweep_overrides, ledger, borrowed)
    if not args.no_launch and not args.sweep:
        # Seed-major: an interrupted study has every method at the same number of seeds. The specs are read again
        # before each run: a norm-matched rate exists once the first seed's runs at GRPO's rate are in.
        labels = [*args.methods, *(m + NORM_MATCHED for m in args.methods
                                   if args.setting in NORM_MATCHED_SETTINGS and m != "grpo")]
        for seed in args.seeds:
            for label in labels:
                spec = next((s for s in specs_now(lrs).get(label, ()) if s.seed == seed), None)
                if spec is not None:
                    codes[f"main/{label}_seed{seed}"] = ensure_run(main_dir(setting_dir, label, seed), spec,
                                                                   main_build, ledger, setting.preset)
    specs = specs_now(lrs)  # with --sweep too: the JSON keeps the main runs already complete

    result = analyse(setting_dir, specs, args.val_size, ledger, args.timing_seeds)
    for method, entry in result["methods"].items():
        entry["sweep"] = lrs[method]["auc_by_lr"]
    result["sweep"] = lrs
    result["meta"] = {
        "setting": args.setting, "setting_parameters": {**asdict(setting), "task": setting.task.as_dict()},
        "runs_dir": str(setting_dir),
        "ledger": str(ledger.root),
        "seeds": args.seeds, "timing_seeds": args.timing_seeds or args.seeds, "steps": args.steps,
        "segment_mc_steps": args.segment_mc_steps,
        "test_freq": args.test_freq, "val_size": args.val_size, "val_files": main_data["val_files"],
        "sweep_setting": SWEEP_SETTING, "sweep_lrs": list(SWEEP_LRS), "sweep_seed": SWEEP_SEED,
        "sweep_steps": args.sweep_steps,
        "sweep_test_freq": args.sweep_test_freq, "sweep_val_files": sweep_data["val_files"],
        "lr_rule": "highest validation AUC of the sweep run, ties to the smaller rate",
        "learning_rate_from": borrowed,
        "method_overrides": {m: list(common.METHODS[m].overrides) for m in args.methods},
        "synthetic": args.smoke, "exit_codes": codes, **common.machine_meta(),
    }
    if args.setting in NORM_MATCHED_SETTINGS:
        result["meta"]["norm_matched_rule"] = ("GRPO's rate x GRPO's median Adam update norm / the method's, from the "
                                               f"seed-{args.seeds[0]} runs at GRPO's rate, to 2 significant digits; "
                                               "a matched rate equal to the method's own adds no runs (sweep[method]"
                                               "['norm_matched'])")
    print("chosen learning rates: " + ", ".join(f"{m} {v['lr']}" for m, v in lrs.items()))
    print_table(result)
    result = common.write_result(result, out)
    if result["methods"]:
        plot(result, out.parent / ("curves.png" if args.setting == "default" else f"curves_{args.setting}.png"))
    return result


if __name__ == "__main__":
    main()
