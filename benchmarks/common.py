"""The benchmarks' library: what every benchmark script shares, so that each script is one question.

* Records and CLI: paths, the task build, ``parser``; from ``benchmarks.output`` (re-exported) ``write_result`` (the
  one JSON writer), ``print_table`` (the one table printer), ``out_path``.
* Statistics (scipy): t intervals, paired differences, runs paired on shared steps, correlations, curve areas.
* Training runs: the task settings and their data, ``launch_run`` (``recipes/tiny_cpu/run.sh``), ``cost_runs`` (runs
  for their step time); ``median_step_s`` and ``load_metrics`` are the package's (``rredcot_verl.runs``).
* Sampling: the embedded task's problems and traces, the one ``generate`` loop, Monte-Carlo values through the
  package's ``core.montecarlo``.
* Gradient protocol (gradient_quality.py, turn_credit.py): pool, g*, paired batches, cosines, effective sample sizes.
* Methods: ``METHODS``, the one table of estimator variants (a recipe and hydra overrides), by name.

Results and their history live in ``benchmarks/RESULTS.md``; ``benchmarks/results/*.json`` are the scripts' output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from scipy import stats

from benchmarks.output import (  # noqa: F401  (the library's light half, re-exported)
    RESULTS_DIR,
    ROOT,
    fmt,
    machine_meta,
    out_path,
    print_table,
    relative_to_repository,
    write_result,
)
from rredcot_verl.core import montecarlo
from rredcot_verl.core.planning import TraceRecord
from rredcot_verl.core.probes import ProbeSettings
from rredcot_verl.core.profiles import PROFILE_PRESETS
from rredcot_verl.core.segmentation import SegmentationSettings
from rredcot_verl.core.settings import CandidateSettings, RRedCoTSettings
from rredcot_verl.tasks import ArithmeticTaskConfig, first_wrong_step, write_parquet
from rredcot_verl.tasks.arithmetic import problem_from_reference
from rredcot_verl.tasks.build import (DEFAULT_N_TRAIN, EARLY_TASK, ITEMS_TASK, LONG_TASK, THREE_DIGIT_ITEMS_TASK, build,
                                     testbed)
from rredcot_verl.tasks.model import chat_prompt_ids
from rredcot_verl.runs import load_metrics, median_step_s, step_seconds  # noqa: F401  (the one step-time statistic)
from rredcot_verl.tasks.reward import compute_score

BUILD_DIR = ROOT / "outputs" / "tiny_cpu" / "build"
BUILD_DIRS = {"default": BUILD_DIR, "long": ROOT / "outputs" / "tiny_cpu" / "build_long",
              "early": ROOT / "outputs" / "tiny_cpu" / "build_early",
              "items": ROOT / "outputs" / "tiny_cpu" / "build_items",
              "items3": ROOT / "outputs" / "tiny_cpu" / "build_items3"}  # per build preset
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


def on_shared_steps(mine: list[dict], theirs: list[dict]) -> tuple[list[dict], list[dict]]:
    """Two runs' validation points at the steps both have: a pair compared up to the shorter run's horizon."""
    shared = {p["step"] for p in mine} & {p["step"] for p in theirs}
    return [p for p in mine if p["step"] in shared], [p for p in theirs if p["step"] in shared]


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
    # seven independent items a±b a trace, answered as their results written one after another (14 digits), on a
    # warm start that can answer after a forced exit from any state
    "items": Setting(ITEMS_TASK, max_prompt_length=80, max_response_length=128, preset="items"),
    # the same with three-digit results (21 digits, responses of about 112 tokens), on a warm start trained on items
    # until it answers after a forced exit, then on these
    "items3": Setting(THREE_DIGIT_ITEMS_TASK, max_prompt_length=96, max_response_length=192, preset="items3"),
}
MAIN_DATA_SEED = 0  # the build's generator stream


def setting_data(data_dir: Path, setting: Setting, val_size: int, data_seed: int) -> dict:
    """The record of ``setting``'s train/val parquet in ``data_dir`` (what ``write_setting_data`` writes)."""
    return {"task": setting.task.as_dict(), "n_train": DEFAULT_N_TRAIN, "val_size": val_size, "data_seed": data_seed,
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
               timeout_s: int = 1800, preset: str = "default", attempts: int = 1) -> int:
    """One ``recipes/tiny_cpu/run.sh`` training run into ``out`` (metrics.jsonl, train.log) on the build of
    ``preset`` (``tasks.build.SETTINGS``) in ``build``, tried up to ``attempts`` times; returns its exit code."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "RREDCOT_SEED"}  # data.seed is passed as an int below
    env.update(RREDCOT_BUILD=str(build), OUT=str(out), RREDCOT_STEPS=str(steps), RUN_TIMEOUT=str(timeout_s),
               RREDCOT_SETTING=preset)
    code = 1
    for _ in range(attempts):
        with open(out / "train.log", "w") as log:
            code = subprocess.run([str(RECIPES / "run.sh"), recipe, f"data.seed={seed}", *overrides], env=env,
                                  stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
        if code == 0:
            break
    return code


def cost_runs(runs: dict[str, tuple[Method, Path]], steps: int, seed: int, build: Path, row, *,
              overrides: tuple[str, ...] = (), preset: str = "default", launch: bool = True,
              resume: bool = True) -> dict[str, dict]:
    """Step-time runs of one sitting, by name (method, run folder): ``row(folder)`` of each, launched first (the
    method's recipe and overrides, then ``overrides``; one retry, the machine is shared) unless not ``launch`` or,
    with ``resume``, its metrics already hold ``steps`` steps; a failed launch gives an error row. With each median
    step over GRPO's (``with_step_ratios``)."""
    rows = {}
    for name, (method, out) in runs.items():
        if launch and (not resume or len(load_metrics(out / "metrics.jsonl")) < steps):
            code = launch_run(method.recipe, out, steps, seed, build, (*method.overrides, *overrides),
                              preset=preset, attempts=2)
            if code != 0:
                rows[name] = {"error": f"run.sh exited {code}; see {out / 'train.log'}", "run": str(out)}
                continue
        rows[name] = row(out)
    return with_step_ratios(rows)


def step_cost(rows: list[dict]) -> dict:
    """A run's step time as the cost tables report it: ``median_step_s`` and the steps it is the median of."""
    return {"median_step_s": median_step_s(rows), "steps_used": len(step_seconds(rows))}


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

    def record(self, entropy: torch.Tensor, reference_steps: list[str] | None = None) -> TraceRecord:
        """The trace as a training step's ``TraceRecord`` (``reference_steps`` in place of the dataset's)."""
        return TraceRecord(self.prompt_ids, self.response_ids, entropy, self.outcome, self.group, self.ground_truth,
                           self.reference_steps if reference_steps is None else reference_steps)


def embedded_settings(value_source: str, normalization: str = "raw", candidates: str = "both",
                      segmentation: SegmentationSettings = RECIPE_SEGMENTATION, **probe) -> RRedCoTSettings:
    """The value pass's settings on the embedded task (the tiny recipes' probe profile): ``value_source`` with
    ``normalization`` over the bank of ``candidates``; ``probe``: further ``ProbeSettings`` fields."""
    probe = ProbeSettings(value_source=value_source, normalization=normalization, profile="embedded", **probe)
    return RRedCoTSettings(segmentation=segmentation, candidates=CandidateSettings(source=candidates), probe=probe)


def load_problems(val_path: Path, num_prompts: int) -> list[tuple]:
    """The first ``num_prompts`` rows of a task parquet: (problem, ground truth, reference steps)."""
    import pandas as pd

    rows = []
    for _, row in pd.read_parquet(val_path).head(num_prompts).iterrows():
        steps = [str(step) for step in row["extra_info"]["reference_steps"]]
        problem = problem_from_reference(row["prompt"][0]["content"], steps)
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
                  max_response_tokens: int = MAX_RESPONSE_TOKENS, temperature: float = 1.0) -> list[Trace]:
    """``samples_per_prompt`` responses to each problem at ``temperature`` (1: the rollout distribution), one
    batch."""
    eos = tokenizer.eos_token_id
    jobs = [(group, item) for group, item in enumerate(problems) for _ in range(samples_per_prompt)]
    prompts = [chat_prompt_ids(tokenizer, item[0].prompt) for _, item in jobs]
    outputs = generate(model, tokenizer, prompts, [max_response_tokens] * len(prompts), seed=seed,
                       temperature=temperature, batch_size=256)
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


# ------------------------------------------------------------------------------------------------ gradient protocol
# gradient_quality.py and turn_credit.py: g* over a pool of rollouts, batches drawn from it, the cosine of each
# estimator's batch gradient with g*, and GRPO's cosine curve against batch size (effective sample sizes).
ROLLOUT_TEMPERATURE = 1.0  # base.yaml actor_rollout_ref.rollout.temperature


def forward_log_probs(model, prompts: list[list[int]], responses: list[list[int]], pad: int, with_entropy=False,
                      response_masks: list[list[int]] | None = None):
    """log π(o_t) (B, T) with grad, response mask (B, T), and optionally per-token entropy (detached); all three 0
    outside the mask. ``response_masks``: per response, 1 on the model's tokens and 0 on a multi-turn response's tool
    output and template tokens (context the policy read, not actions); None: every response token is the model's."""
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    width = max(len(s) for s in seqs)
    horizon = max(max(len(r) for r in responses), 1)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    attention = torch.zeros_like(ids)
    targets = torch.full((len(seqs), horizon), pad, dtype=torch.long)
    positions = torch.zeros((len(seqs), horizon), dtype=torch.long)
    mask = torch.zeros((len(seqs), horizon), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, : len(seqs[i])] = torch.tensor(seqs[i])
        attention[i, : len(seqs[i])] = 1
        if r:
            targets[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1.0 if response_masks is None else torch.tensor(response_masks[i], dtype=torch.float32)
        positions[i] = (len(p) - 1 + torch.arange(horizon)).clamp(max=width - 1)
    logits = model(input_ids=ids, attention_mask=attention).logits.float() / ROLLOUT_TEMPERATURE
    picked = logits.gather(1, positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    log_probs = picked.log_softmax(-1)
    token_logp = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(log_probs.exp() * log_probs).sum(-1) * mask
    return token_logp, mask, entropy


def flat_grad(loss, params, retain=True) -> torch.Tensor:
    grads = torch.autograd.grad(loss, params, retain_graph=retain, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).double()
                      for g, p in zip(grads, params)])


def loo_advantages(scores: torch.Tensor) -> torch.Tensor:
    """(P, R) rewards → r_i − mean_{j≠i} r_j within each row."""
    n = scores.shape[1]
    return scores - (scores.sum(1, keepdim=True) - scores) / (n - 1)


def compute_gstar(model, pool: dict, pad: int, chunk_prompts: int) -> dict:
    """Σ_i A_i ∇Σ_t log π over the pool (and over each half), pool token count, per-trace entropies; t runs over the
    model's tokens (``pool["response_masks"]`` where the pool has them)."""
    params = [p for p in model.parameters()]
    scores = pool["scores"]
    num_prompts, rollouts = scores.shape
    half = rollouts // 2
    advantage = loo_advantages(scores)
    halves = torch.cat([loo_advantages(scores[:, :half]), loo_advantages(scores[:, half:])], dim=1)
    in_first = torch.arange(rollouts) < half
    total = first = second = None
    tokens = 0
    entropies = [[None] * rollouts for _ in range(num_prompts)]
    for start in range(0, num_prompts, chunk_prompts):
        chunk = range(start, min(start + chunk_prompts, num_prompts))
        items = [(p, r) for p in chunk for r in range(rollouts)]
        masks = pool.get("response_masks")
        logp, mask, entropy = forward_log_probs(
            model, [pool["prompts"][p]["prompt_ids"] for p, _ in items], [pool["responses"][p][r] for p, r in items],
            pad, with_entropy=True, response_masks=None if masks is None else [masks[p][r] for p, r in items])
        seq_logp = logp.sum(1)
        a = torch.stack([advantage[p, r] for p, r in items])
        h = torch.stack([halves[p, r] for p, r in items])
        f = torch.stack([in_first[r] for _, r in items]).float()
        parts = [flat_grad(-(a * seq_logp).sum(), params), flat_grad(-(h * f * seq_logp).sum(), params),
                 flat_grad(-(h * (1 - f) * seq_logp).sum(), params, retain=False)]
        total = parts[0] if total is None else total + parts[0]
        first = parts[1] if first is None else first + parts[1]
        second = parts[2] if second is None else second + parts[2]
        tokens += int(mask.sum())
        for row, (p, r) in enumerate(items):
            entropies[p][r] = entropy[row, : len(pool["responses"][p][r])].clone()
    split_half = cosine(first, second)
    return {"sum": total, "tokens": tokens, "entropy": entropies, "split_half_cosine": split_half,
            "spearman_brown_cosine": math.sqrt(max(2 * split_half / (1 + split_half), 0.0))}


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp(min=1e-300))


def draw_batch(seed: int, num_prompts: int, rollouts: int, batch_prompts: int, group: int, b: int):
    rng = np.random.default_rng([seed, batch_prompts, group, b])
    picked = rng.choice(num_prompts, size=batch_prompts, replace=False)
    return [(int(p), int(r)) for p in picked for r in rng.choice(rollouts, size=group, replace=False)]


def add_pool_arguments(cli: argparse.ArgumentParser, pool_rollouts: int) -> None:
    """The protocol's options: the pool, the paired batches drawn from it, the seed and the ESS bootstrap."""
    cli.add_argument("--pool-prompts", type=int, default=128, help="≥ the largest batch's prompts")
    cli.add_argument("--pool-rollouts", type=int, default=pool_rollouts)
    cli.add_argument("--group-size", type=int, default=4)
    cli.add_argument("--sizes", type=int, nargs="+", default=[32, 8, 16], help="prompts per batch, all methods")
    cli.add_argument("--grpo-sizes", type=int, nargs="*", default=[64, 128], help="extra GRPO-only batch prompts")
    cli.add_argument("--batches", type=int, default=20)
    cli.add_argument("--seed", type=int, default=0, help="pool draw, sampling, batch draws")
    cli.add_argument("--bootstrap", type=int, default=1000)


def start_pool_protocol(cli: argparse.ArgumentParser, args) -> int:
    """Refuse batches that do not fit the pool, seed torch, use at most 2 threads; returns the headline size (32
    prompts, else the largest)."""
    if max(args.sizes + args.grpo_sizes) > args.pool_prompts or args.group_size > args.pool_rollouts:
        cli.error("batches must fit in the pool (prompts and rollouts per prompt)")
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return 32 if 32 in args.sizes else max(args.sizes)


def batch_reference(model, pool: dict, gstar: dict, items, logp: torch.Tensor, mask: torch.Tensor):
    """(g* without the batch's own rollouts, token mean; the batch's token count): the batch's share of g*'s sum
    (its leave-one-out REINFORCE gradient) is taken out, so that no method is compared with its own noise."""
    tokens = float(mask.sum())
    advantage = loo_advantages(pool["scores"])
    loo = torch.stack([advantage[p, r] for p, r in items])
    own = flat_grad(-(loo * logp.sum(1)).sum(), list(model.parameters()))
    return (gstar["sum"] - own) / (gstar["tokens"] - tokens), tokens


def gradient_row(model, advantages: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor, tokens: float,
                 reference: torch.Tensor) -> dict:
    """The token-mean loss −Σ A_t log π(o_t) / tokens: its gradient's cosine, relative squared error and norm
    ratio against ``reference``, and the share of the batch's tokens with no advantage."""
    g = flat_grad(-(advantages * logp).sum() / tokens, list(model.parameters()))
    return {"cosine": cosine(g, reference), "rel_error": float((g - reference).pow(2).sum() / reference.pow(2).sum()),
            "norm_ratio": float(g.norm() / reference.norm()),
            "zero_advantage_frac": float(((advantages == 0) & (mask > 0)).sum() / tokens)}


def run_batches(args, results: dict, methods, evaluate, written) -> None:
    """Every (size, batch) a method misses in ``results`` ({method: {size: {batch: row}}}): GRPO first at every
    size (cheap: its fitted curve exists early), then the other methods at ``args.sizes``; ``evaluate(items,
    missing, size, b)`` gives the rows, and ``written()`` saves them after each batch (a rerun resumes)."""
    plan = [(s, ["grpo"]) for s in args.sizes + args.grpo_sizes] + [(s, [m for m in methods if m != "grpo"])
                                                                      for s in args.sizes]
    for size, todo in plan:
        for b in range(args.batches):
            missing = [m for m in todo if str(b) not in results.get(m, {}).get(str(size), {})]
            if not missing:
                continue
            started = time.perf_counter()
            items = draw_batch(args.seed, args.pool_prompts, args.pool_rollouts, size, args.group_size, b)
            rows = evaluate(items, missing, size, b)
            for method, row in rows.items():
                results.setdefault(method, {}).setdefault(str(size), {})[str(b)] = row
            written()
            print(f"size {size}x{args.group_size} batch {b}: " + " ".join(f"{m}={v['cosine']:.3f}" for m, v in
                                                                         rows.items())
                  + f" ({time.perf_counter() - started:.1f}s)", flush=True)


def pool_settings(args, scores: torch.Tensor, headline: int, **pool_means) -> dict:
    """The pool and batch settings a gradient result records; ``pool_means`` follow the pool's accuracy."""
    return {"pool_prompts": args.pool_prompts, "pool_rollouts_per_prompt": args.pool_rollouts,
            "pool_accuracy": float(scores.mean()), **pool_means,
            "pool_prompts_all_correct": int((scores.min(1).values == 1).sum()),
            "pool_prompts_all_wrong": int((scores.max(1).values == 0).sum()),
            "group_size": args.group_size, "sizes_prompts": args.sizes, "grpo_only_sizes_prompts": args.grpo_sizes,
            "batches_per_size": args.batches, "headline_prompts": headline}


def fit_inverse_square(sizes, cosines):
    """Least squares of 1/cos² = α + β/n; None when fewer than 2 sizes or a mean cosine is not positive."""
    if len(sizes) < 2 or min(cosines) <= 0:
        return None
    x = 1.0 / np.asarray(sizes, dtype=float)
    y = 1.0 / np.asarray(cosines, dtype=float) ** 2
    beta, alpha = np.polyfit(x, y, 1)
    return float(alpha), float(beta)


def matched_rollouts(fit, cos: float) -> float | None:
    """GRPO rollouts whose fitted mean cosine equals ``cos`` (None: not reachable by any GRPO batch size)."""
    if fit is None or cos <= 0:
        return None
    alpha, beta = fit
    gap = 1.0 / cos**2 - alpha
    if beta <= 0 or gap <= 0:
        return None
    return beta / gap


def summarise(records: dict, methods, sizes, grpo_sizes, group: int, headline: int, boot: int, seed: int) -> dict:
    """records: {method: {size: {b: result}}} → the JSON's ``methods`` block and the GRPO fit."""
    out = {}
    for method in methods:
        entry = {"batches": {}}
        for size in (sizes + grpo_sizes if method == "grpo" else sizes):
            rows = records.get(method, {}).get(str(size), {})
            if not rows:
                continue
            column = lambda key: [r[key] for r in rows.values()]  # noqa: E731
            stats = {"n_batches": len(rows), "cosine_mean": float(np.mean(column("cosine"))),
                     "cosine_ci95": t_interval(column("cosine")),
                     "rel_error_mean": float(np.mean(column("rel_error"))),
                     "rel_error_ci95": t_interval(column("rel_error")),
                     "norm_ratio_mean": float(np.mean(column("norm_ratio"))),
                     "zero_advantage_token_frac": float(np.mean(column("zero_advantage_frac"))),
                     "seconds_per_batch": float(np.mean(column("seconds")))}
            cosines = lambda name: {b: r["cosine"] for b, r in records.get(name, {}).get(str(size), {}).items()}  # noqa: E731
            paired = paired_differences(cosines(method), cosines("grpo"))  # the same batches
            if method != "grpo" and paired:
                stats["cosine_minus_grpo_mean"] = float(np.mean(paired))
                stats["cosine_minus_grpo_ci95"] = t_interval(paired)
            entry["batches"][str(size * group)] = stats
        out[method] = entry
    # GRPO curve and effective sample sizes at the headline size.
    grpo = records.get("grpo", {})
    curve_sizes = [s for s in sorted(set(sizes + grpo_sizes)) if grpo.get(str(s))]
    fit = fit_inverse_square([s * group for s in curve_sizes],
                             [np.mean([r["cosine"] for r in grpo[str(s)].values()]) for s in curve_sizes])
    rng = np.random.default_rng(seed)
    for method in methods:
        rows = records.get(method, {}).get(str(headline), {})
        entry = out[method]
        entry["ess_over_grpo_at_32"] = entry["ess_over_grpo_ci95"] = None
        if fit is None or not rows:
            continue
        cos = float(np.mean([r["cosine"] for r in rows.values()]))
        rollouts = matched_rollouts(fit, cos)
        entry["matched_grpo_rollouts"] = rollouts
        entry["ess_over_grpo_at_32"] = None if rollouts is None else rollouts / (headline * group)
        entry["ess_beyond_fitted_range"] = (rollouts is None or not
                                            (curve_sizes[0] * group <= rollouts <= curve_sizes[-1] * group))
        # Bootstrap over batches; at the headline size the method and GRPO share batches, resampled together.
        samples, shared = [], sorted(rows)
        for _ in range(boot):
            picked = rng.choice(len(shared), size=len(shared))
            means = []
            for s in curve_sizes:
                batches = grpo[str(s)]
                if s == headline and all(shared[k] in batches for k in picked):
                    means.append(np.mean([batches[shared[k]]["cosine"] for k in picked]))
                else:
                    keys = sorted(batches)
                    means.append(np.mean([batches[keys[k]]["cosine"] for k in rng.choice(len(keys), len(keys))]))
            boot_fit = fit_inverse_square([s * group for s in curve_sizes], means)
            matched = matched_rollouts(boot_fit, float(np.mean([rows[shared[k]]["cosine"] for k in picked])))
            samples.append(np.inf if matched is None else matched / (headline * group))
        if samples:
            low, high = np.percentile(samples, [2.5, 97.5])
            entry["ess_over_grpo_ci95"] = [float(low), None if not np.isfinite(high) else float(high)]
    fit_block = None
    if fit is not None:
        fit_block = {"model": "1/cos^2 = alpha + beta/n (n = batch rollouts)", "alpha": fit[0], "beta": fit[1],
                     "asymptotic_cosine": 1 / math.sqrt(fit[0]) if fit[0] > 0 else None,
                     "sizes_rollouts": [s * group for s in curve_sizes],
                     "measured_cosines": [float(np.mean([r["cosine"] for r in grpo[str(s)].values()]))
                                          for s in curve_sizes],
                     "fitted_cosines": [1 / math.sqrt(fit[0] + fit[1] / (s * group))
                                        if fit[0] + fit[1] / (s * group) > 0 else None for s in curve_sizes]}
    return {"methods": out, "grpo_fit": fit_block}


def print_gradient_table(result: dict, group: int) -> None:
    gq = result["settings"]["gstar"]
    print(f"g*: {gq['pool_rollouts']} rollouts, split-half cosine {gq['split_half_cosine']:.3f}, "
          f"est. cos(g*, E g*) {gq['spearman_brown_cosine']:.3f}; fit {result.get('grpo_fit')}")
    sizes = sorted({int(k) for e in result["methods"].values() for k in e["batches"]})
    headline = str(32 * group)
    print_table([{"method": method, **{f"cos@{s}": e["batches"].get(str(s), {}).get("cosine_mean") for s in sizes},
                  **{f"{key}@{headline}": e["batches"].get(headline, {}).get(key) for key in (
                      "rel_error_mean", "cosine_minus_grpo_mean", "cosine_minus_grpo_ci95")},
                  "ess_over_grpo": e.get("ess_over_grpo_at_32"), "ess_ci95": e.get("ess_over_grpo_ci95")}
                 for method, e in result["methods"].items()],
                ["method", *(f"cos@{s}" for s in sizes), *(f"{key}@{headline}" for key in (
                    "rel_error_mean", "cosine_minus_grpo_mean", "cosine_minus_grpo_ci95")), "ess_over_grpo",
                 "ess_ci95"])


def cached_pool(cache: Path, fingerprint: dict, make, gstar_of) -> tuple[dict, dict, dict, Path]:
    """The pool, its g* and the per-batch records kept under ``cache``, each made once and reused on a rerun.

    ``make()`` samples the pool and ``gstar_of(pool)`` computes g*; both are timed (``seconds``) and saved. The pool
    and the batch records carry ``fingerprint``: a cache made with other settings is refused, not mixed in.
    Returns (pool, g*, records with their ``results``, the records' path).
    """
    pool_path, gstar_path, batches_path = cache / "pool.pt", cache / "gstar.pt", cache / "batches.json"
    pool = torch.load(pool_path, weights_only=False) if pool_path.exists() else None
    if pool is not None and pool.get("fingerprint") != fingerprint:
        raise SystemExit(f"{pool_path} was made with {pool.get('fingerprint')}, not {fingerprint}: use another --cache")
    if pool is None:
        started = time.perf_counter()
        pool = make()
        pool["fingerprint"], pool["seconds"] = fingerprint, time.perf_counter() - started
        cache.mkdir(parents=True, exist_ok=True)
        torch.save(pool, pool_path)
    if gstar_path.exists():
        gstar = torch.load(gstar_path, weights_only=False)
    else:
        started = time.perf_counter()
        gstar = gstar_of(pool)
        gstar["seconds"] = time.perf_counter() - started
        torch.save(gstar, gstar_path)
    records = json.loads(batches_path.read_text()) if batches_path.exists() else {}
    if records and records.get("fingerprint") != fingerprint:
        raise SystemExit(f"{batches_path} belongs to another pool; use another --cache")
    records["fingerprint"] = fingerprint
    records.setdefault("results", {})
    return pool, gstar, records, batches_path


def mean_within_spearman(pairs: list[tuple[np.ndarray, np.ndarray]]) -> float | None:
    """``correlations(pairs)["within_spearman"]``, computed on all series of one length at once (average ranks along
    the rows, then each row's Pearson): the same statistic as ``spearman`` a series, for callers that need it over
    many thousand series (``gradient_screen.exact_values_spearman`` draws every trace twenty times)."""
    by_length: dict[int, list[tuple[int, np.ndarray, np.ndarray]]] = {}
    for index, (estimate, truth) in enumerate(pairs):
        estimate, truth = np.asarray(estimate, dtype=float), np.asarray(truth, dtype=float)
        keep = ~np.isnan(estimate)
        by_length.setdefault(int(keep.sum()), []).append((index, estimate[keep], truth[keep]))
    within: dict[int, float] = {}
    for length, rows in by_length.items():
        if length < 3:
            continue
        x, y = np.array([row[1] for row in rows]), np.array([row[2] for row in rows])
        varying = (np.ptp(x, axis=1) > 0) & (np.ptp(y, axis=1) > 0)
        x = stats.rankdata(x, axis=1)
        y = stats.rankdata(y, axis=1)
        x -= x.mean(axis=1, keepdims=True)
        y -= y.mean(axis=1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            r = (x * y).sum(axis=1) / np.sqrt((x * x).sum(axis=1) * (y * y).sum(axis=1))
        within.update((row[0], float(value)) for row, value, keep in zip(rows, r, varying) if keep)
    # in the series' own order, as ``correlations`` averages them
    return float(np.mean([within[index] for index in sorted(within)])) if within else None


def correlations(pairs: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """Pooled and mean-within-trace Spearman/Pearson over (estimate, MC) series; NaN estimates are dropped."""
    pooled_x, pooled_y, within_s, within_p = [], [], [], []
    for estimate, truth in pairs:
        keep = ~np.isnan(estimate)
        pooled_x += list(estimate[keep])
        pooled_y += list(truth[keep])
        s = spearman(estimate[keep], truth[keep])
        if s is not None:
            within_s.append(s)
            within_p.append(pearson(estimate[keep], truth[keep]))
    return {
        "n_points": len(pooled_x), "spearman": spearman(pooled_x, pooled_y), "pearson": pearson(pooled_x, pooled_y),
        "within_spearman": float(np.mean(within_s)) if within_s else None,
        "within_pearson": float(np.mean(within_p)) if within_p else None, "within_n": len(within_s),
    }


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
# Values given rather than estimated (the ceiling, the step oracle) pass without the value gate: it guards a run
# against uninformative values, and in the screen it sees one batch (a run pools ten), where it closed on near-true
# Monte-Carlo values by chance on `early` and `long` and made the ceiling GRPO on those batches.
_UNGATED = f"{_RREDCOT}.redistribution.min_value_concordance=0"
# The Monte-Carlo ceiling (issue 63's screen): segment_mc with K = 16 continuations a state, so that the values' noise
# is small, through today's sigma shares and through signed value differences (VinePPO's and SPO's step advantage).
_MC_CEILING = ("algorithm.rredcot.segment_mc.num_continuations=16", _UNGATED)
_RAW = f"{_RREDCOT}.redistribution.value_mapping=raw"
_SIGNED = f"{_RREDCOT}.redistribution.advantage_form=signed"
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
    "mc_ceiling": Method("segment_mc", _MC_CEILING),  # the recipe's affine mapping, sigma shares
    "mc_ceiling_raw": Method("segment_mc", (*_MC_CEILING, _RAW)),
    "mc_ceiling_signed": Method("segment_mc", (*_MC_CEILING, _RAW, _SIGNED)),
    "mc_ceiling_signed_degenerate": Method("segment_mc", (*_MC_CEILING, _RAW, _SIGNED, _VALUE_DIFFERENCES)),
    "rredcot_exit_probe_signed": Method("rredcot", (*_EXIT_PROBE, _SIGNED)),
    "rredcot_exit_probe_signed_degenerate": Method("rredcot", (*_EXIT_PROBE, _SIGNED, _VALUE_DIFFERENCES)),
    # A diagnostic, not a value source: gradient_quality.py replaces the values by the task's verifier (0.9 before
    # the segment completing the first wrong step line, 0 from it on), through both forms.
    "step_oracle": Method("segment_mc", (_UNGATED, _RAW)),
    "step_oracle_signed": Method("segment_mc", (_UNGATED, _RAW, _SIGNED)),
    # The fade's mechanism (RESULTS.md §4): value credit on wrong traces only / on correct traces only
    "rredcot_credit_incorrect": Method("rredcot", (_CREDIT.format("incorrect"),)),
    "rredcot_credit_correct": Method("rredcot", (_CREDIT.format("correct"),)),
    "rredcot_repairs_degenerate_resume_credit_incorrect": Method(
        "rredcot_ibpo", (_AS_RREDCOT, _VALUE_DIFFERENCES, *_RESUME, _CREDIT.format("incorrect"))),
    "rredcot_repairs_degenerate_resume_credit_correct": Method(
        "rredcot_ibpo", (_AS_RREDCOT, _VALUE_DIFFERENCES, *_RESUME, _CREDIT.format("correct"))),
}


def method_algorithm(name: str, method: Method | None = None) -> dict:
    """``algorithm`` of a run of ``method`` (default ``METHODS[name]``) as plain data: base.yaml's and the recipe's,
    merged, with the overrides."""
    from omegaconf import OmegaConf

    method = method or METHODS[name]
    sections = [OmegaConf.load(RECIPES / f"{recipe}.yaml").get("algorithm", {}) for recipe in ("base", method.recipe)]
    overrides = OmegaConf.from_dotlist(list(method.overrides)).get("algorithm", {})
    return OmegaConf.to_container(OmegaConf.merge(*sections, overrides), resolve=True)


def method_settings(name: str, method: Method | None = None):
    """(estimator name, ``RRedCoTSettings``) of a method, read by the package's strict reader."""
    from rredcot_verl.core.settings import settings_from_config

    algorithm = method_algorithm(name, method)
    return algorithm["adv_estimator"], settings_from_config(algorithm)
