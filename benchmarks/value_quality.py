"""Segment value estimates against Monte-Carlo ground truth on the embedded arithmetic task.

Traces are sampled from the warm-started model on validation prompts (``--samples-per-prompt`` per prompt, so the
group banks of the probes see several rollouts, as in training) and segmented with the tiny_cpu recipe's settings
(hybrid, max_segments 8, min_segment_len 2: one segment per step line). For every state S_0..S_{K-1} the Monte-Carlo
value with ``--mc-samples`` continuations is the ground truth; S_K's value is the outcome ζ for every source.

Compared (states: boundary values v_k; segments: R_k = v_k − v_{k−1}, k = 1..K, in probability space):

* exit probe, raw and self-normalised; reference continuation (raw sums); own continuation
  (``rredcot_verl.core.values.compute_segment_values``, i.e. what training computes on the actor);
* leave-one-out and gradient × input (``rredcot_verl.core.attribution``; segment level only): the target is the
  ground-truth answer after the recipe's exit text, over the thinking part (the answer segment gets 0);
* rule: the model-free "no wrong line yet" indicator (1 while the completed step lines are all right, checked
  against the problem, so the privileged part of the reference's signal is visible);
* MC itself for localisation (its own R_k).

Reported: Spearman and Pearson with MC, pooled over (trace, state) and mean within trace (traces where both series
vary), pooled per third of the trace (by k/K); and error localisation on incorrect traces whose first wrong step is
known: argmin_k R_k equals the segment that completes that step (or, for a missing step, the one closing the
thinking), with chance level mean 1/K.

    python -m benchmarks.value_quality            # 52 traces, MC K=32; writes benchmarks/results/value_quality.json
    python -m benchmarks.value_quality --smoke    # seconds: 4 traces, MC K=4, temp output
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from benchmarks.common import (
    RESULTS_DIR,
    ROOT,
    build_task,
    fmt,
    machine_meta,
    monte_carlo_values,
    pearson,
    spearman,
    write_result,
)
from benchmarks.attribution import gradient_times_input_attribution, leave_one_out_attribution
from rredcot_verl.core.profiles import PROFILE_PRESETS
from rredcot_verl.core.settings import CandidateSettings, RRedCoTSettings
from rredcot_verl.core.probes import ProbeSettings
from benchmarks.reference_scorers import trace_log_probs_and_entropy
from rredcot_verl.core.segmentation import SegmentationSettings
from rredcot_verl.tasks import ArithmeticProblem, first_wrong_step, load_model_dir, parse_prompt
from rredcot_verl.tasks.base import ARITHMETIC
from rredcot_verl.tasks.model import chat_prompt_ids
from rredcot_verl.tasks.reward import compute_score
from rredcot_verl.core.planning import TraceRecord
from rredcot_verl.core.values import compute_segment_values

RESULTS_PATH = RESULTS_DIR / "value_quality.json"
MAX_RESPONSE_TOKENS = 96  # recipes/tiny_cpu/base.yaml data.max_response_length
EXIT_TEXT = PROFILE_PRESETS["embedded"].exit_text  # recipes/tiny_cpu/rredcot.yaml: probe.profile=embedded
RECIPE_SEGMENTATION = SegmentationSettings(strategy="hybrid", max_segments=8, min_segment_len=2)
PROBE_SOURCES = {
    "exit_raw": ("exit_probe", "raw"),
    "exit_selfnorm": ("exit_probe", "self_normalized"),
    "reference": ("reference_continuation", "raw"),  # always raw sums: its bank holds correct continuations only
    "own_continuation": ("own_continuation", "raw"),
}
STATE_SOURCES = [*PROBE_SOURCES, "rule"]
SEGMENT_SOURCES = [*STATE_SOURCES, "loo", "grad_x_input", "mc"]
THIRDS = ("early", "middle", "late")


@dataclasses.dataclass
class Trace:
    problem: ArithmeticProblem
    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    text: str
    outcome: float
    group: int
    ground_truth: str
    reference_steps: list[str]


def load_problems(val_path: Path, num_prompts: int):
    frame = pd.read_parquet(val_path)
    rows = []
    for _, row in frame.head(num_prompts).iterrows():
        rows.append((parse_prompt(row["prompt"][0]["content"]), str(row["reward_model"]["ground_truth"]),
                     [str(step) for step in row["extra_info"]["reference_steps"]]))
    return rows


@torch.no_grad()
def sample_traces(model, tokenizer, problems, samples_per_prompt: int, seed: int) -> list[Trace]:
    """Temperature-1 samples (the rollout distribution); responses keep their EOS, truncated ones have none."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    jobs = [(group, item) for group, item in enumerate(problems) for _ in range(samples_per_prompt)]
    prompts = [chat_prompt_ids(tokenizer, item[0].prompt) for _, item in jobs]
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    torch.manual_seed(seed)
    output = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=MAX_RESPONSE_TOKENS,
                            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=eos,
                            pad_token_id=pad)[:, width:]
    traces = []
    for row, (group, (problem, truth, steps)) in enumerate(jobs):
        tokens = output[row].tolist()
        response = tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
        text = tokenizer.decode(response, skip_special_tokens=True)
        traces.append(Trace(problem, torch.tensor(prompts[row]), torch.tensor(response), text,
                            compute_score(None, text, truth) if eos in tokens else 0.0, group, truth, steps))
    return traces


def completed_lines(tokenizer, response_ids: list[int], end: int) -> int:
    """Step lines of the think block completed (newline-terminated) within response[:end]."""
    text = tokenizer.decode(response_ids[:end], skip_special_tokens=True)
    if "<think>" not in text:
        return 0
    body = text.split("<think>", 1)[1].split("</think>", 1)[0]
    return sum(1 for line in body.split("\n")[:-1] if line.strip())


def thinking_length(tokenizer, response_ids: list[int]) -> int:
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    return response_ids.index(think_end) if think_end in response_ids else len(response_ids)


def rule_values(tokenizer, trace: Trace, boundaries: list[int]) -> np.ndarray:
    """1 while every completed step line is right (first wrong step not yet written), else 0."""
    wrong = first_wrong_step(trace.problem, trace.text)
    ids = trace.response_ids.tolist()
    return np.array([1.0 if wrong is None or completed_lines(tokenizer, ids, b) < wrong else 0.0
                     for b in boundaries])


def holder_segment(tokenizer, trace: Trace, ends: list[int], wrong: int) -> int:
    """0-based segment completing step line ``wrong``; for a missing step, the segment that closes thinking."""
    ids = trace.response_ids.tolist()
    for j, end in enumerate(ends):
        if completed_lines(tokenizer, ids, end) >= wrong:
            return j
    think_len = thinking_length(tokenizer, ids)
    return next((j for j, end in enumerate(ends) if end > think_len), len(ends) - 1)


def value_sources(model, tokenizer, traces: list[Trace]) -> tuple[list[list[int]], dict, dict]:
    """Segment ends per trace; per probe source, values v_0..v_{K-1} per trace (NaN: no estimate); seconds per
    source (``compute_segment_values`` over the whole batch)."""
    records = []
    for trace in traces:
        _, entropy = trace_log_probs_and_entropy(model, trace.prompt_ids, trace.response_ids)
        records.append(TraceRecord(trace.prompt_ids, trace.response_ids, entropy, trace.outcome, trace.group,
                                   trace.ground_truth, trace.reference_steps))
    base = RRedCoTSettings(segmentation=RECIPE_SEGMENTATION, candidates=CandidateSettings())
    ends, values, timings = None, {}, {}
    for name, (source, normalization) in PROBE_SOURCES.items():
        settings = dataclasses.replace(base, probe=ProbeSettings(value_source=source, normalization=normalization,
                                                                 profile="embedded"))
        started = time.perf_counter()
        result = compute_segment_values(model, tokenizer, records, settings, task=ARITHMETIC,
                                        max_positions=model.config.max_position_embeddings)
        timings[name] = time.perf_counter() - started
        trace_ends = [[e for e in row.tolist() if e >= 0] for row in result.segment_ends]
        if ends is None:
            ends = trace_ends
        elif trace_ends != ends:
            raise RuntimeError("segmentation differs between value sources")
        values[name] = [result.raw_values[i, : len(e)].numpy().astype(float) for i, e in enumerate(ends)]
    return ends, values, timings


def attributions(model, tokenizer, trace: Trace, ends: list[int]) -> dict[str, np.ndarray]:
    ids = trace.response_ids.tolist()
    think_len = thinking_length(tokenizer, ids)
    context = trace.response_ids[:think_len]
    clipped = [min(end, think_len) for end in ends]
    exit_ids = tokenizer.encode(EXIT_TEXT, add_special_tokens=False)
    answer_ids = tokenizer.encode("{" + trace.ground_truth + "}", add_special_tokens=False) + [tokenizer.eos_token_id]
    args = (model, trace.prompt_ids, context, clipped, exit_ids, answer_ids)
    return {"loo": leave_one_out_attribution(*args).numpy().astype(float),
            "grad_x_input": gradient_times_input_attribution(*args).numpy().astype(float)}


def third(k: int, num: int) -> str:
    return THIRDS[min(int(3 * k / num), 2)]


def correlations(pairs: list[tuple[np.ndarray, np.ndarray]]) -> dict:
    """Pooled and mean-within-trace Spearman/Pearson over (estimate, MC) series; NaN estimates are dropped."""
    pooled_x, pooled_y, within_s, within_p = [], [], [], []
    for estimate, truth in pairs:
        keep = ~np.isnan(estimate)
        x, y = estimate[keep], truth[keep]
        pooled_x += list(x)
        pooled_y += list(y)
        s, p = spearman(x, y), pearson(x, y)
        if s is not None:
            within_s.append(s)
            within_p.append(p)
    return {
        "n_points": len(pooled_x),
        "spearman": spearman(pooled_x, pooled_y), "pearson": pearson(pooled_x, pooled_y),
        "within_spearman": float(np.mean(within_s)) if within_s else None,
        "within_pearson": float(np.mean(within_p)) if within_p else None, "within_n": len(within_s),
    }


def analyse(ends, state_values, segment_values, mc_values, holders) -> dict:
    """Correlation tables (states and segments) and localisation; ``holders``: trace index → erroneous segment."""
    states, segments = {}, {}
    num_traces = len(ends)
    for name in STATE_SOURCES:
        pairs = [(state_values[name][i], mc_values[i]) for i in range(num_traces)]
        entry = correlations(pairs)
        for part in THIRDS:
            picked = [(v[[third(k, len(v)) == part for k in range(len(v))]],
                       m[[third(k, len(m)) == part for k in range(len(m))]]) for v, m in pairs]
            xs = np.concatenate([v for v, _ in picked])
            ys = np.concatenate([m for _, m in picked])
            keep = ~np.isnan(xs)
            entry[f"spearman_{part}"] = spearman(xs[keep], ys[keep])
        entry["mean_value"] = float(np.nanmean(np.concatenate(state_values[name])))
        entry["nan_fraction"] = float(np.mean(np.isnan(np.concatenate(state_values[name]))))
        states[name] = entry
    mc_segments = segment_values["mc"]
    for name in SEGMENT_SOURCES:
        entry = correlations([(segment_values[name][i], mc_segments[i]) for i in range(num_traces)]) \
            if name != "mc" else {}
        hits, judged = 0, 0
        for i, holder in holders.items():
            r = segment_values[name][i]
            if np.all(np.isnan(r)):
                continue
            judged += 1
            hits += int(int(np.nanargmin(r)) == holder)
        entry["localisation"] = hits / judged if judged else None
        entry["localisation_n"] = judged
        segments[name] = entry
    chance = float(np.mean([1.0 / len(ends[i]) for i in holders])) if holders else None
    return {"states": states, "segments": segments, "localisation_chance": chance,
            "localisation_traces": len(holders)}


def run(build: Path, num_prompts: int, samples_per_prompt: int, mc_samples: int, seed: int) -> dict:
    torch.set_num_threads(1)
    model, tokenizer = load_model_dir(str(build / "model"))
    model.eval()
    problems = load_problems(build / "data" / "val.parquet", num_prompts)
    traces = sample_traces(model, tokenizer, problems, samples_per_prompt, seed)
    ends, probe_values, timings = value_sources(model, tokenizer, traces)
    boundaries = [[0, *e[:-1]] for e in ends]

    started = time.perf_counter()
    flat = [(i, b) for i in range(len(traces)) for b in boundaries[i]]
    mc_flat = monte_carlo_values(
        model, tokenizer, [traces[i].prompt_ids.tolist() for i, _ in flat],
        [traces[i].response_ids[:b].tolist() for i, b in flat], [traces[i].ground_truth for i, _ in flat],
        num_samples=mc_samples, max_response_tokens=MAX_RESPONSE_TOKENS, seed=seed + 1).values.numpy().astype(float)
    timings["mc"] = time.perf_counter() - started
    mc_values, offset = [], 0
    for b in boundaries:
        mc_values.append(mc_flat[offset: offset + len(b)])
        offset += len(b)

    state_values = dict(probe_values)
    state_values["rule"] = [rule_values(tokenizer, t, b) for t, b in zip(traces, boundaries)]
    started = time.perf_counter()
    attribution = [attributions(model, tokenizer, t, e) for t, e in zip(traces, ends)]
    timings["loo+grad_x_input"] = time.perf_counter() - started

    def rewards(values: np.ndarray, outcome: float) -> np.ndarray:
        return np.diff(np.append(values, outcome))  # R_k = v_k − v_{k−1}, k = 1..K, with v_K = ζ

    segment_values = {name: [rewards(state_values[name][i], t.outcome) for i, t in enumerate(traces)]
                      for name in STATE_SOURCES}
    segment_values["mc"] = [rewards(mc_values[i], t.outcome) for i, t in enumerate(traces)]
    for name in ("loo", "grad_x_input"):
        segment_values[name] = [a[name] for a in attribution]

    holders = {}
    for i, trace in enumerate(traces):
        wrong = first_wrong_step(trace.problem, trace.text)
        if trace.outcome == 0 and wrong is not None:
            holders[i] = holder_segment(tokenizer, trace, ends[i], wrong)

    result = analyse(ends, state_values, segment_values, mc_values, holders)
    result["traces"] = {
        "n": len(traces), "correct": int(sum(t.outcome for t in traces)),
        "states": int(sum(len(b) for b in boundaries)), "mean_segments": float(np.mean([len(e) for e in ends])),
    }
    result["timings_s"] = timings
    result["per_trace"] = [
        {"text": t.text, "outcome": t.outcome, "segment_ends": ends[i], "mc": mc_values[i].tolist(),
         **{name: [None if np.isnan(x) else float(x) for x in state_values[name][i]] for name in STATE_SOURCES},
         **{name: segment_values[name][i].tolist() for name in ("loo", "grad_x_input")},
         "first_wrong_step": first_wrong_step(t.problem, t.text), "holder_segment": holders.get(i)}
        for i, t in enumerate(traces)
    ]
    return result


def print_tables(result: dict) -> None:
    print(f"traces {result['traces']}  timings {({k: round(v, 1) for k, v in result['timings_s'].items()})}")
    print("STATES: values v_k vs MC (k = 0..K-1)")
    print(f"{'source':<20}{'sp pool':>8}{'pe pool':>8}{'sp in':>8}{'pe in':>8}{'n in':>6}"
          f"{'early':>8}{'middle':>8}{'late':>8}{'mean v':>8}{'NaN':>6}")
    for name, e in result["states"].items():
        print(f"{name:<20}{fmt(e['spearman'])}{fmt(e['pearson'])}{fmt(e['within_spearman'])}"
              f"{fmt(e['within_pearson'])}{e['within_n']:>6}{fmt(e['spearman_early'])}{fmt(e['spearman_middle'])}"
              f"{fmt(e['spearman_late'])}{fmt(e['mean_value'])}{e['nan_fraction']:>6.2f}")
    print(f"SEGMENTS: R_k vs MC R_k (k = 1..K); localisation over {result['localisation_traces']} incorrect traces, "
          f"chance {fmt(result['localisation_chance'], 0)}")
    print(f"{'source':<20}{'sp pool':>8}{'pe pool':>8}{'sp in':>8}{'n in':>6}{'loc':>8}")
    for name, e in result["segments"].items():
        print(f"{name:<20}{fmt(e.get('spearman'))}{fmt(e.get('pearson'))}{fmt(e.get('within_spearman'))}"
              f"{e.get('within_n', 0):>6}{fmt(e['localisation'])}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="4 traces, MC K=4; writes to --out or a temp file")
    parser.add_argument("--out", type=Path, default=None, help=f"JSON path (default {RESULTS_PATH}; temp with --smoke)")
    parser.add_argument("--build", type=Path, default=ROOT / "outputs" / "tiny_cpu" / "build",
                        help="task build folder (created with rredcot_verl.tasks.build if missing)")
    parser.add_argument("--prompts", type=int, default=13)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--mc-samples", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.samples_per_prompt, args.mc_samples = 2, 2, 4
    out = args.out or (Path(tempfile.mkdtemp()) / "value_quality.json" if args.smoke else RESULTS_PATH)
    build_task(args.build)
    started = time.perf_counter()
    result = run(args.build, args.prompts, args.samples_per_prompt, args.mc_samples, args.seed)
    result["meta"] = {"prompts": args.prompts, "samples_per_prompt": args.samples_per_prompt,
                      "mc_samples": args.mc_samples, "seed": args.seed, "exit_text": EXIT_TEXT,
                      "segmentation": dataclasses.asdict(RECIPE_SEGMENTATION),
                      "max_response_tokens": MAX_RESPONSE_TOKENS, "wall_s": time.perf_counter() - started,
                      **machine_meta()}
    print_tables(result)
    return write_result(result, out)


if __name__ == "__main__":
    main()
