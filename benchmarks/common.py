"""The benchmarks' library: what every benchmark script shares, so that each script is one question.

* Records and CLI: paths, the task build, ``write_result`` (the one JSON writer), ``parser`` / ``out_path``.
* Statistics (scipy): t intervals, paired differences, Pearson / Spearman, binomial intervals, curve areas.
* Training runs: the task settings and their data, ``launch_run`` (``recipes/tiny_cpu/run.sh``), verl's metrics.
* Sampling: problems and traces of the embedded task, the one left-padded ``generate`` loop, and Monte-Carlo values
  through the package's own ``core.montecarlo`` (planning and tallying of continuations).
* Methods: ``METHODS``, the one table of estimator variants (a recipe and hydra overrides), by name.

Results and their history live in ``benchmarks/RESULTS.md``; ``benchmarks/results/*.json`` are the scripts' output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from scipy import stats

from rredcot_verl.core import montecarlo
from rredcot_verl.core.profiles import PROFILE_PRESETS
from rredcot_verl.core.segmentation import SegmentationSettings
from rredcot_verl.tasks import ArithmeticTaskConfig, first_wrong_step, parse_prompt, write_parquet
from rredcot_verl.tasks.build import DEFAULT_N_TRAIN, EARLY_TASK, LONG_TASK, build, testbed
from rredcot_verl.tasks.model import chat_prompt_ids
from rredcot_verl.tasks.reward import compute_score

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
BUILD_DIR = ROOT / "outputs" / "tiny_cpu" / "build"
BUILD_DIRS = {"default": BUILD_DIR, "long": ROOT / "outputs" / "tiny_cpu" / "build_long",
              "early": ROOT / "outputs" / "tiny_cpu" / "build_early"}  # per build preset
RECIPES = ROOT / "recipes" / "tiny_cpu"


# ------------------------------------------------------------------------------------------------ records and CLI
def build_task(out: Path, preset: str = "default") -> Path:
    """The task build of ``preset`` (``tasks.build.PRESETS``) under ``out`` (data + the committed warm start;
    reused when cached); returns ``out``."""
    build(testbed(preset), str(out), log=lambda *args, **kwargs: None)
    return out


def local_tensor(tensor):
    """A DTensor's shard (verl's FSDP2 checkpoints hold DTensors), or the tensor itself, in float64."""
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).double()


def machine_meta() -> dict:
    return {"torch": torch.__version__, "transformers": transformers.__version__, "machine": platform.machine(),
            "python": platform.python_version()}


def relative_to_repository(value):
    """``value`` with every absolute path inside the repository written relative to it (recursively through dicts
    and lists): a committed result must not carry the paths of the machine that ran it."""
    if isinstance(value, dict):
        return {key: relative_to_repository(item) for key, item in value.items()}
    if isinstance(value, list):
        return [relative_to_repository(item) for item in value]
    if isinstance(value, str) and value.startswith("/"):
        path = Path(value)
        return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else value
    return value


def write_result(result: dict, out: Path, say: bool = True) -> dict:
    """Write a benchmark's JSON to ``out`` (folders made, written whole or not at all; paths inside the repository
    made relative to it), say where (unless not ``say``), and return the result with its path."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".tmp")
    partial.write_text(json.dumps(relative_to_repository(result), indent=2, default=float) + "\n")
    partial.replace(out)
    if say:
        print(f"wrote {out}")
    return {**result, "out": str(out)}


def fmt(value, width: int = 8, digits: int = 2) -> str:
    """A number right-aligned, or '-' for None."""
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def parser(doc: str, results_path: Path, smoke: str, build: bool = True) -> argparse.ArgumentParser:
    """A script's parser: its docstring's first paragraph, ``--smoke`` (what it does: ``smoke``), ``--out`` (default
    ``results_path``; a temp file with --smoke) and, with ``build``, ``--build`` (the task build folder)."""
    cli = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    cli.add_argument("--smoke", action="store_true", help=smoke)
    cli.add_argument("--out", type=Path, default=None,
                     help=f"JSON path (default {results_path.relative_to(ROOT)}; a temp file with --smoke)")
    if build:
        cli.add_argument("--build", type=Path, default=BUILD_DIR,
                         help="task build folder (created with rredcot_verl.tasks.build if missing)")
    return cli


def out_path(args: argparse.Namespace, results_path: Path) -> Path:
    """``--out``, else a temp file named as ``results_path`` with --smoke, else ``results_path``."""
    if args.out is not None:
        return args.out
    return Path(tempfile.mkdtemp()) / results_path.name if args.smoke else results_path


# ----------------------------------------------------------------------------------------------------- statistics
def t_interval(values, confidence: float = 0.95) -> list[float] | None:
    """The t interval of the mean, mean ± t_{(1+c)/2, n−1} · sd/√n; None for fewer than two values. Identical values
    give a zero-width interval at their value."""
    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        return None
    mean = float(values.mean())
    half = float(stats.t.ppf((1 + confidence) / 2, len(values) - 1) * stats.sem(values))
    return [mean - half, mean + half]


def mean_interval(values) -> dict:
    """{"mean", "ci95" (t interval), "sd", "n"} of the values that are not None."""
    values = [value for value in values if value is not None]
    if not values:
        return {"mean": None, "ci95": None, "sd": None, "n": 0}
    return {"mean": float(np.mean(values)), "ci95": t_interval(values),
            "sd": float(np.std(values, ddof=1)) if len(values) > 1 else None, "n": len(values)}


def paired_differences(mine: dict, theirs: dict) -> list[float]:
    """``mine[k] − theirs[k]`` for every key both have, in key order (the pairs of a paired comparison)."""
    return [mine[key] - theirs[key] for key in sorted(set(mine) & set(theirs))]


def _varying(x, y) -> tuple[np.ndarray, np.ndarray] | None:
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    return None if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0 else (x, y)


def pearson(x, y) -> float | None:
    """Pearson correlation; None when fewer than 3 points or either series is constant."""
    pair = _varying(x, y)
    return None if pair is None else float(stats.pearsonr(*pair).statistic)


def spearman(x, y) -> float | None:
    """Spearman correlation (ties at their average rank); None as for ``pearson``."""
    pair = _varying(x, y)
    return None if pair is None else float(stats.spearmanr(*pair).statistic)


def binomial_interval(accuracies: list[float], n: int) -> list[float]:
    """95% interval of the mean of k accuracies measured on n items each, from the items' sampling error alone
    (normal approximation): mean ± 1.96 · √(Σ p(1−p)/n) / k."""
    mean = float(np.mean(accuracies))
    half = 1.96 * math.sqrt(sum(p * (1 - p) for p in accuracies) / n) / len(accuracies)
    return [mean - half, mean + half]


def area_under_curve(points: list[dict]) -> float | None:
    """Trapezoid area under accuracy vs step divided by the step span (a flat curve at a gives a); None for fewer
    than two points."""
    if len(points) < 2:
        return None
    steps = np.array([p["step"] for p in points], dtype=float)
    accuracy = np.array([p["accuracy"] for p in points], dtype=float)
    return float(np.trapezoid(accuracy, steps)) / float(steps[-1] - steps[0])


# -------------------------------------------------------------------------------------------------- training runs
@dataclass(frozen=True)
class Setting:
    """A setting of the embedded task, with verl's limits (prompts and references must fit, or they would be cut)
    and the build (``tasks.build.PRESETS``) whose warm start samples it."""

    task: ArithmeticTaskConfig
    max_prompt_length: int = 32
    max_response_length: int = 96
    preset: str = "default"


SETTINGS = {
    "default": Setting(ArithmeticTaskConfig()),  # the warm start's own task: 2..5-step chains
    "hard": Setting(ArithmeticTaskConfig(min_operands=5, max_operands=6)),  # its longest chains (RESULTS.md §3)
    # 16-17-step chains restating the terms left: responses of about 390 tokens, on the long build's own model
    "long": Setting(LONG_TASK, max_prompt_length=64, max_response_length=512, preset="long"),
    # 2-step chains of operands 1..99 restating the term left, on a warm start that can answer after a forced exit
    "early": Setting(EARLY_TASK, preset="early"),
}
MAIN_DATA_SEED = 0  # the build's generator stream


def setting_data(data_dir: Path, setting: Setting, val_size: int, data_seed: int) -> dict:
    """The record of ``setting``'s train/val parquet in ``data_dir`` (what ``write_setting_data`` writes)."""
    return {"task": asdict(setting.task), "n_train": DEFAULT_N_TRAIN, "val_size": val_size, "data_seed": data_seed,
            "train_files": str(data_dir / "train.parquet"), "val_files": str(data_dir / "val.parquet")}


def write_setting_data(data_dir: Path, setting: Setting, val_size: int, data_seed: int) -> dict:
    """Train/val parquet of ``setting`` from the task's own generator (reused when already written with the same
    parameters); returns the record kept in ``data.json``."""
    record = setting_data(data_dir, setting, val_size, data_seed)
    record_path = data_dir / "data.json"
    if record_path.exists() and json.loads(record_path.read_text()) == record:
        return record
    write_parquet(str(data_dir), DEFAULT_N_TRAIN, val_size, data_seed, setting.task)
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    return record


def launch_run(recipe: str, out: Path, steps: int, seed: int, build: Path, overrides: tuple[str, ...] = (),
               timeout_s: int = 1800, preset: str = "default") -> int:
    """One ``recipes/tiny_cpu/run.sh`` training run into ``out`` (metrics.jsonl, train.log) on the build of
    ``preset`` (``tasks.build.PRESETS``) in ``build``; returns its exit code."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "RREDCOT_SEED"}  # data.seed is passed as an int below
    env.update(RREDCOT_BUILD=str(build), OUT=str(out), RREDCOT_STEPS=str(steps), RUN_TIMEOUT=str(timeout_s),
               RREDCOT_SETTING=preset)
    with open(out / "train.log", "w") as log:
        return subprocess.run([str(RECIPES / "run.sh"), recipe, f"data.seed={seed}", *overrides], env=env,
                              stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode


def step_seconds(rows: list[dict], phase: str = "step") -> list[float]:
    """``timing_s/<phase>`` of steps ≥ 2 (step 1 carries warm-up)."""
    key = f"timing_s/{phase}"
    return [row[key] for row in rows if row["step"] >= 2 and key in row]


def phase_medians(rows: list[dict]) -> dict[str, float]:
    """Median seconds of every ``timing_s/*`` phase verl logs (nested phases included, so they do not add up)."""
    phases = sorted({key.removeprefix("timing_s/") for row in rows for key in row if key.startswith("timing_s/")})
    return {phase: float(np.median(seconds)) for phase in phases if (seconds := step_seconds(rows, phase))}


def with_step_ratios(entries: dict[str, dict]) -> dict[str, dict]:
    """Add ``over_grpo`` (median step seconds over GRPO's, from runs of one sitting) to every entry that has a median
    when the ``grpo`` entry has one; returns ``entries``."""
    grpo = entries.get("grpo", {}).get("median_step_s")
    for entry in entries.values():
        if grpo and entry.get("median_step_s"):
            entry["over_grpo"] = entry["median_step_s"] / grpo
    return entries


def read_metrics(path: Path) -> list[dict]:
    """verl FileLogger lines ``{"step": n, "data": {...}}`` → list of ``{"step": n, **data}``, in file order; a last
    line cut short by a killed run is dropped (a broken line elsewhere raises)."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for number, line in enumerate(lines):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) - 1:
                break
            raise
        rows.append({"step": entry["step"], **entry["data"]})
    return rows


def localisation_hit(segment_rewards: list, holder: int | None) -> tuple[float, float] | None:
    """For one incorrect trace: (1 if its most negative segment reward R_k falls on ``holder``, the segment holding
    the first wrong step, else 0; the chance level 1/K). None when it cannot be scored: no holder, fewer than two
    segment rewards (None and NaN entries are padding or fallback), or a holder beyond them."""
    rewards = [r for r in segment_rewards if r is not None and math.isfinite(r)]
    if holder is None or len(rewards) < 2 or holder >= len(rewards):
        return None
    return float(int(np.argmin(rewards)) == holder), 1.0 / len(rewards)


# ------------------------------------------------------------------------------------------------------- sampling
MAX_RESPONSE_TOKENS = 96  # recipes/tiny_cpu/base.yaml data.max_response_length
EXIT_TEXT = PROFILE_PRESETS["embedded"].exit_text  # recipes/tiny_cpu/base.yaml: probe.profile=embedded
RECIPE_SEGMENTATION = SegmentationSettings(strategy="hybrid", max_segments=8, min_segment_len=2)  # rredcot.yaml


@dataclass
class Trace:
    """A sampled response of the embedded task; ``response_ids`` keep their EOS (a truncated one has none)."""

    problem: object  # tasks.ArithmeticProblem
    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    text: str
    outcome: float
    group: int
    ground_truth: str
    reference_steps: list[str]


def load_problems(val_path: Path, num_prompts: int) -> list[tuple]:
    """The first ``num_prompts`` rows of a task parquet: (problem, ground truth, reference steps). The prompt does not
    say whether step lines restate the terms left; the reference's first line does (a space before the terms), and
    the problem keeps it, so that text written from it (``reference_steps``, exit examples) is the build's format."""
    import pandas as pd

    rows = []
    for _, row in pd.read_parquet(val_path).head(num_prompts).iterrows():
        steps = [str(step) for step in row["extra_info"]["reference_steps"]]
        problem = dataclasses.replace(parse_prompt(row["prompt"][0]["content"]),
                                      restate_remaining_terms=len(steps) > 1 and " " in steps[0])
        rows.append((problem, str(row["reward_model"]["ground_truth"]), steps))
    return rows


@torch.no_grad()
def generate(model, tokenizer, sequences: list[list[int]], max_new_tokens: list[int], *, seed: int,
             temperature: float = 1.0, batch_size: int | None = None) -> list[list[int]]:
    """Temperature sampling (no top-k/top-p: the rollouts' distribution) after each sequence, in batches of
    ``batch_size`` (None: one batch), left-padded; each output cut to its own ``max_new_tokens`` (EOS and what
    follows it included). Seeded with ``seed``; the global RNG state and the model's mode are restored."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    device = model.get_input_embeddings().weight.device
    outputs = []
    rng_state, was_training = torch.random.get_rng_state(), model.training
    torch.manual_seed(seed)
    model.eval()
    try:
        for start in range(0, len(sequences), batch_size or max(len(sequences), 1)):
            chunk = range(start, min(start + (batch_size or len(sequences)), len(sequences)))
            width = max(len(sequences[i]) for i in chunk)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            attention_mask = torch.zeros_like(input_ids)
            for row, i in enumerate(chunk):
                input_ids[row, width - len(sequences[i]):] = torch.tensor(sequences[i])
                attention_mask[row, width - len(sequences[i]):] = 1
            output = model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                max_new_tokens=max(max_new_tokens[i] for i in chunk), do_sample=True, temperature=temperature,
                top_k=0, top_p=1.0, eos_token_id=eos, pad_token_id=pad,
                cache_implementation="static",  # a growing cache is copied whole each token: 2.5x slower on long traces
            )[:, width:].cpu()  # fmt: skip
            outputs += [output[row, : max_new_tokens[i]].tolist() for row, i in enumerate(chunk)]
    finally:
        torch.random.set_rng_state(rng_state)
        model.train(was_training)
    return outputs


def sample_traces(model, tokenizer, problems, samples_per_prompt: int, seed: int,
                  max_response_tokens: int = MAX_RESPONSE_TOKENS) -> list[Trace]:
    """``samples_per_prompt`` temperature-1 responses (the rollout distribution) to each problem, one batch."""
    eos = tokenizer.eos_token_id
    jobs = [(group, item) for group, item in enumerate(problems) for _ in range(samples_per_prompt)]
    prompts = [chat_prompt_ids(tokenizer, item[0].prompt) for _, item in jobs]
    outputs = generate(model, tokenizer, prompts, [max_response_tokens] * len(prompts), seed=seed, batch_size=256)
    traces = []
    for prompt, tokens, (group, (problem, truth, steps)) in zip(prompts, outputs, jobs):
        response = tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
        text = tokenizer.decode(response, skip_special_tokens=True)
        traces.append(Trace(problem, torch.tensor(prompt), torch.tensor(response), text,
                            compute_score(None, text, truth) if eos in tokens else 0.0, group, truth, steps))
    return traces


def continuation_success_rates(model, tokenizer, traces: list[Trace], segment_ends: list[list[int]], *,
                               num_samples: int, max_response_tokens: int = MAX_RESPONSE_TOKENS,
                               temperature: float = 1.0, seed: int = 0,
                               batch_size: int = 512) -> tuple[list[np.ndarray], int]:
    """Values of the states S_0..S_{K-1} of each trace (S_k: the response up to segment k's start): the mean task
    reward of ``num_samples`` continuations sampled by ``generate``, planned and tallied by ``core.montecarlo`` as
    ``segment_mc`` does. A continuation may take the response to ``max_response_tokens`` (training's response
    budget), its EOS included; one that has not ended by then counts as a failure.

    Returns:
        per trace, its K values (fp64, successes / num_samples); the continuation tokens sampled in all.
    """
    cfg = montecarlo.MonteCarloSettings(num_continuations=num_samples, temperature=temperature)
    requests = [dataclasses.replace(request, trace=i) for i, (trace, ends) in enumerate(zip(traces, segment_ends))
                for request in montecarlo.plan_continuations(
                    [trace.prompt_ids.tolist()], [trace.response_ids.tolist()], [ends], cfg,
                    trace.prompt_ids.numel() + max_response_tokens)]  # a room of max_response_tokens − start
    requests.sort(key=lambda request: request.start)  # similar lengths together: less padding, one length a batch
    eos = tokenizer.eos_token_id
    outputs = generate(model, tokenizer, [list(r.prefix_ids) for r in requests], [r.max_tokens for r in requests],
                       seed=seed, temperature=temperature, batch_size=batch_size)
    continuations = [montecarlo.Continuation(tuple(ids[: ids.index(eos) + 1] if eos in ids else ids), eos not in ids)
                     for ids in outputs]

    def judge(i: int, response_ids: list[int]) -> float:
        return compute_score(None, tokenizer.decode(response_ids, skip_special_tokens=True), traces[i].ground_truth)

    _, raw, metrics = montecarlo.values_from_continuations(
        [t.response_ids.tolist() for t in traces], segment_ends, [t.outcome for t in traces], requests,
        continuations, judge, max_segments=max([len(ends) for ends in segment_ends], default=0))
    values = [raw[i, : len(ends)].double().numpy() for i, ends in enumerate(segment_ends)]
    return values, int(metrics["segment_mc/extra_generated_tokens"])


def thinking_length(tokenizer, response_ids: list[int]) -> int:
    """Tokens before ``</think>`` (the whole response when it has none)."""
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    return response_ids.index(think_end) if think_end in response_ids else len(response_ids)


def completed_lines(tokenizer, response_ids: list[int], end: int) -> int:
    """Step lines of the think block completed (newline-terminated) within response[:end]."""
    text = tokenizer.decode(response_ids[:end], skip_special_tokens=True)
    if "<think>" not in text:
        return 0
    body = text.split("<think>", 1)[1].split("</think>", 1)[0]
    return sum(1 for line in body.split("\n")[:-1] if line.strip())


def holder_segment(tokenizer, trace: Trace, ends: list[int]) -> int | None:
    """0-based segment completing the first wrong step line of an incorrect trace (for a missing step, the segment
    that closes thinking); None for a correct trace or one whose first wrong step the task does not find."""
    wrong = first_wrong_step(trace.problem, trace.text) if trace.outcome == 0.0 else None
    if wrong is None:
        return None
    ids = trace.response_ids.tolist()
    for j, end in enumerate(ends):
        if completed_lines(tokenizer, ids, end) >= wrong:
            return j
    think_len = thinking_length(tokenizer, ids)
    return next((j for j, end in enumerate(ends) if end > think_len), len(ends) - 1)


# -------------------------------------------------------------------------------------------------------- methods
@dataclass(frozen=True)
class Method:
    """An estimator variant: ``recipes/tiny_cpu/<recipe>.yaml`` with hydra ``overrides`` (how a user would run it)."""

    recipe: str
    overrides: tuple[str, ...] = ()


_RREDCOT = "algorithm.rredcot"
_EXIT_PROBE = (f"{_RREDCOT}.probe.value_source=exit_probe", f"{_RREDCOT}.redistribution.value_mapping=affine")
_AS_RREDCOT = "algorithm.adv_estimator=rredcot"  # on rredcot_ibpo.yaml: rredcot on its repair-filled bank
_VALUE_DIFFERENCES = f"{_RREDCOT}.redistribution.degenerate_groups=value_differences"
_CREDIT = _RREDCOT + ".redistribution.credit_traces={}"
# Repairs resumed from the failed trace's divergence point (the package's default operator) instead of the tiny
# recipes' rewrite, which sends a revision template.
_RESUME = (f"{_RREDCOT}.ibpo.repair_operator=resume", f"{_RREDCOT}.ibpo.revision_template=null")
# Every variant any benchmark trains or measures, by one name each (the names in results/*.json and RESULTS.md).
METHODS = {
    "grpo": Method("grpo"),
    # GRPO with 1.5x and 2.5x the rollouts a prompt (6 or 10 instead of 4; one optimizer step a training step all the
    # same): how many steps a better gradient buys when it is GRPO's own
    "grpo_n6": Method("grpo", ("actor_rollout_ref.rollout.n=6",)),
    "grpo_n10": Method("grpo", ("actor_rollout_ref.rollout.n=10",)),
    # GRPO at rredcot's (exit probe) step time on the answer-early setting (registrations/verdict.yaml's pilot); micro
    # batches of 8, since verl splits the 40 traces of a step into micro batches without a remainder (base.yaml's 16)
    "grpo_n5": Method("grpo", ("actor_rollout_ref.rollout.n=5", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
                               "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8")),
    "rredcot": Method("rredcot"),  # reference continuations from the dataset reference + the group's correct traces
    "rredcot_exit_probe": Method("rredcot", _EXIT_PROBE),  # the answer-forcing exit probe, affine value mapping
    "rredcot_exit_probe_gated": Method("rredcot", (*_EXIT_PROBE, f"{_RREDCOT}.redistribution.min_value_concordance=0.6")),
    "rredcot_exit_probe_log_affine": Method("rredcot", _EXIT_PROBE[:1]),  # the recipe's log-affine mapping kept
    "rredcot_group": Method("rredcot", (f"{_RREDCOT}.candidates.source=group",)),
    "rredcot_ground_truth": Method("rredcot", (f"{_RREDCOT}.candidates.source=ground_truth",)),
    "rredcot_degenerate": Method("rredcot", (_VALUE_DIFFERENCES,)),
    "rredcot_repairs": Method("rredcot_ibpo", (_AS_RREDCOT,)),
    "rredcot_repairs_degenerate": Method("rredcot_ibpo", (_AS_RREDCOT, _VALUE_DIFFERENCES)),
    "ibpo": Method("ibpo"),
    "ibpo_resume": Method("ibpo", _RESUME),
    "rredcot_ibpo": Method("rredcot_ibpo"),
    "rredcot_ibpo_resume": Method("rredcot_ibpo", _RESUME),
    "rredcot_repairs_degenerate_resume": Method("rredcot_ibpo", (_AS_RREDCOT, _VALUE_DIFFERENCES, *_RESUME)),
    "rredcot_ibpo_edit_mask": Method("rredcot_ibpo", (f"{_RREDCOT}.rredcot_ibpo.wrong_trace_credit=edit_mask",)),
    "rredcot_ibpo_degenerate": Method("rredcot_ibpo", (_VALUE_DIFFERENCES,)),
    "segment_mc": Method("segment_mc"),
    # The fade's mechanism (RESULTS.md §4): value credit on wrong traces only / on correct traces only
    "rredcot_credit_incorrect": Method("rredcot", (_CREDIT.format("incorrect"),)),
    "rredcot_credit_correct": Method("rredcot", (_CREDIT.format("correct"),)),
    "rredcot_repairs_degenerate_resume_credit_incorrect": Method(
        "rredcot_ibpo", (_AS_RREDCOT, _VALUE_DIFFERENCES, *_RESUME, _CREDIT.format("incorrect"))),
    "rredcot_repairs_degenerate_resume_credit_correct": Method(
        "rredcot_ibpo", (_AS_RREDCOT, _VALUE_DIFFERENCES, *_RESUME, _CREDIT.format("correct"))),
}


def method_algorithm(name: str) -> dict:
    """``algorithm`` of the method's run as plain data: base.yaml's and the recipe's, merged, with the overrides."""
    from omegaconf import OmegaConf

    method = METHODS[name]
    sections = [OmegaConf.load(RECIPES / f"{recipe}.yaml").get("algorithm", {}) for recipe in ("base", method.recipe)]
    overrides = OmegaConf.from_dotlist(list(method.overrides)).get("algorithm", {})
    return OmegaConf.to_container(OmegaConf.merge(*sections, overrides), resolve=True)


def method_settings(name: str):
    """(estimator name, ``RRedCoTSettings``) of a method, read by the package's strict reader."""
    from rredcot_verl.core.settings import settings_from_config

    algorithm = method_algorithm(name)
    return algorithm["adv_estimator"], settings_from_config(algorithm)
