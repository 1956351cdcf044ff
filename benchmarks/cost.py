"""Cost of segment values: packed probes vs naive probes vs Monte-Carlo, and one training step per estimator.

Value estimation (one run, side by side): traces sampled from the warm-started model on validation prompts are
segmented with the tiny_cpu recipe's settings; every method values the same states S_0..S_{K-1} of the same traces:

* packed: ``score_probes_packed`` (one trace pass with a KV cache + one packed forward of all probes),
* naive:  ``score_probes_naive`` (one forward over prefix + probe per probe),
* recipe_values: ``compute_segment_values`` with the tiny_cpu recipe's value source (reference continuation,
  raw), i.e. what a training step runs on the actor (wall seconds only; its probes are longer than exit probes),
* MC:     ``--mc-samples`` sampled continuations per state (HF ``generate``, batched; ``segment_mc``'s estimate).

Probes are the exit probes of ``values.py`` for the ground-truth answer and the group's other answers. Reported per
method: wall seconds (``time.perf_counter``, ``torch.set_num_threads(1)``, medians over ``--repeats``; MC once) and
model tokens processed: packed = Σ_traces (P + L + Σ_probes |probe|) (the exit text shared by a boundary's probes
counts once per probe, an upper bound); naive = Σ_probes (P + b + |probe|); MC = Σ_states N·(P + b) prefill
+ the continuation tokens actually sampled. Ratios MC/packed and naive/packed.

Training step (optional, ``--train-steps 0`` skips it): ``recipes/tiny_cpu/run.sh <method>`` for grpo, rredcot,
segment_mc and ibpo with the same data seed, median ``timing_s/step`` over steps ≥ 2, and each over GRPO's. With
``--runs-dir`` the runs already in ``<runs-dir>/<method>_seed<seed>`` are read instead of launched.

    python -m benchmarks.cost                   # writes benchmarks/results/cost.json (3 training steps per method)
    python -m benchmarks.cost --train-steps 0   # value estimation only
    python -m benchmarks.cost --smoke           # seconds, no training
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import torch

from benchmarks import common
from benchmarks.common import EXIT_TEXT, RECIPE_SEGMENTATION, fmt, launch_run, phase_medians, read_metrics, step_seconds
from benchmarks.reference_scorers import score_probes_naive, trace_log_probs_and_entropy
from rredcot_verl.core.planning import TraceRecord
from rredcot_verl.core.probes import ProbeSettings, build_exit_probes
from rredcot_verl.core.scoring import score_probes_packed
from rredcot_verl.core.segmentation import BoundaryVocab, segment_response
from rredcot_verl.core.settings import RRedCoTSettings
from rredcot_verl.core.values import compute_segment_values
from rredcot_verl.tasks import extract_boxed_answer, load_model_dir
from rredcot_verl.tasks.base import ARITHMETIC

RESULTS_PATH = common.RESULTS_DIR / "cost.json"
METHODS = ("grpo", "rredcot", "segment_mc", "ibpo")


def probe_batch(model, tokenizer, traces):
    """Per trace: (boundaries S_0..S_{K-1}, exit probes, entropy (L,)).

    The probes' answers: the ground truth (correct) and the group's other boxed answers (for self-normalising)."""
    vocab = BoundaryVocab.from_tokenizer(tokenizer, RECIPE_SEGMENTATION, think_end="</think>")
    exit_ids = tokenizer.encode(EXIT_TEXT, add_special_tokens=False)
    eos = [tokenizer.eos_token_id]
    answer = lambda text: tokenizer.encode("{" + text + "}", add_special_tokens=False) + eos  # noqa: E731
    group_answers: dict[int, set[str]] = {}
    for trace in traces:
        found = extract_boxed_answer(trace.text)
        group_answers.setdefault(trace.group, set()).update({trace.ground_truth} | ({found} if found else set()))
    batch = []
    for trace in traces:
        _, entropy = trace_log_probs_and_entropy(model, trace.prompt_ids, trace.response_ids)
        ends = segment_response(trace.response_ids, entropy, vocab, RECIPE_SEGMENTATION)
        boundaries = [0, *ends[:-1]]
        probes = build_exit_probes(boundaries, exit_ids, [answer(trace.ground_truth)],
                                   thinking_length=common.thinking_length(tokenizer, trace.response_ids.tolist()),
                                   all_answers=[answer(a) for a in sorted(group_answers[trace.group])])
        batch.append((boundaries, probes, entropy))
    return batch


def measure_values(model, tokenizer, traces, mc_samples: int, repeats: int) -> dict:
    batch = probe_batch(model, tokenizer, traces)

    def run_packed():
        return [score_probes_packed(model, t.prompt_ids, t.response_ids, probes, return_trace_stats=False)
                for t, (_, probes, _) in zip(traces, batch)]

    def run_naive():
        return [score_probes_naive(model, t.prompt_ids, t.response_ids, probes)
                for t, (_, probes, _) in zip(traces, batch)]

    def timed(fn):
        started = time.perf_counter()
        output = fn()
        return time.perf_counter() - started, output

    run_packed()  # warm-up: the first forward pays one-off allocations
    packed_times, naive_times, max_error = [], [], 0.0
    for _ in range(repeats):
        seconds, packed = timed(run_packed)
        packed_times.append(seconds)
        seconds, naive = timed(run_naive)
        naive_times.append(seconds)
    for p, n in zip(packed, naive):
        if n.numel():
            max_error = max(max_error, float((p.probe_logp - n).abs().max()))
    # What training runs on the actor with the tiny_cpu recipe: segmentation + reference-continuation probes, packed.
    records = [TraceRecord(t.prompt_ids, t.response_ids, entropy, t.outcome, t.group, t.ground_truth,
                           t.reference_steps) for t, (_, _, entropy) in zip(traces, batch)]
    settings = RRedCoTSettings(segmentation=RECIPE_SEGMENTATION, probe=ProbeSettings(
        value_source="reference_continuation", normalization="raw", profile="embedded"))
    recipe_seconds = statistics.median(
        timed(lambda: compute_segment_values(model, tokenizer, records, settings, task=ARITHMETIC))[0] for _ in range(repeats))
    ends = [[*boundaries[1:], t.response_ids.numel()] for t, (boundaries, _, _) in zip(traces, batch)]
    mc_seconds, (_, mc_generated) = timed(lambda: common.continuation_success_rates(model, tokenizer, traces, ends,
                                                                            num_samples=mc_samples))
    flat = [(t, b) for t, (boundaries, _, _) in zip(traces, batch) for b in boundaries]

    packed_tokens = sum(t.prompt_ids.numel() + t.response_ids.numel() + sum(len(p.tokens) for p in probes)
                        for t, (_, probes, _) in zip(traces, batch))
    naive_tokens = sum(t.prompt_ids.numel() + p.boundary + len(p.tokens) for t, (_, probes, _) in zip(traces, batch)
                       for p in probes)
    mc_tokens = sum(mc_samples * (t.prompt_ids.numel() + b) for t, b in flat) + mc_generated
    rows = {
        "packed": {"seconds": statistics.median(packed_times), "tokens": packed_tokens},
        "naive": {"seconds": statistics.median(naive_times), "tokens": naive_tokens},
        f"mc_k{mc_samples}": {"seconds": mc_seconds, "tokens": mc_tokens},
    }
    rows["recipe_values"] = {"seconds": recipe_seconds, "tokens": None}
    for row in rows.values():
        row["seconds_over_packed"] = row["seconds"] / rows["packed"]["seconds"]
        row["tokens_over_packed"] = row["tokens"] / rows["packed"]["tokens"] if row["tokens"] else None
    rows[f"mc_k{mc_samples}"]["seconds_over_recipe_values"] = mc_seconds / recipe_seconds
    return {
        "traces": len(traces), "states": len(flat), "probes": sum(len(p) for _, p, _ in batch), "methods": rows,
        "max_abs_logp_diff_packed_vs_naive": max_error, "mc_samples": mc_samples, "repeats": repeats,
    }


def measure_training(runs_dir: Path, steps: int, seed: int, build: Path, launch: bool) -> dict:
    result = {}
    for method in METHODS:
        out = runs_dir / f"{method}_seed{seed}"
        recipe, overrides = common.METHODS[method].recipe, common.METHODS[method].overrides
        if launch:
            code = launch_run(recipe, out, steps, seed, build, overrides)
            if code != 0:  # the machine is shared: one retry for a run killed by load or a timeout
                code = launch_run(recipe, out, steps, seed, build, overrides)
            if code != 0:
                result[method] = {"error": f"run.sh exited {code}; see {out / 'train.log'}"}
                continue
        rows = read_metrics(out / "metrics.jsonl")
        seconds = step_seconds(rows)
        result[method] = {"median_step_s": statistics.median(seconds) if seconds else None, "steps_used": len(seconds),
                          "phase_median_s": phase_medians(rows), "run": str(out)}
    return common.with_step_ratios(result)


def print_tables(result: dict) -> None:
    values = result["values"]
    print(f"value estimation: {values['traces']} traces, {values['states']} states, {values['probes']} probes; "
          f"max |logp packed - naive| {values['max_abs_logp_diff_packed_vs_naive']:.1e}")
    print(f"{'method':<14}{'seconds':>10}{'tokens':>10}{'s/packed':>10}{'tok/packed':>11}")
    for name, row in values["methods"].items():
        print(f"{name:<14}{row['seconds']:>10.3f}{row['tokens'] or '-':>10}{row['seconds_over_packed']:>10.1f}"
              f"{fmt(row['tokens_over_packed'], 11, 1)}")
    if result.get("training"):
        print(f"{'method':<12}{'step s':>8}{'/grpo':>8}{'steps':>7}")
        for name, row in result["training"].items():
            if "error" in row:
                print(f"{name:<12} {row['error']}")
            else:
                print(f"{name:<12}{fmt(row['median_step_s'])}{fmt(row.get('over_grpo'))}{row['steps_used']:>7}")


def main(argv: list[str] | None = None) -> dict:
    parser = common.parser(__doc__, RESULTS_PATH, "2 traces, no training; writes to --out or a temp file")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--mc-samples", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1, help="sampling seed and the training runs' data.seed")
    parser.add_argument("--train-steps", type=int, default=3, help="steps per training run; 0 skips training")
    parser.add_argument("--runs-dir", type=Path, default=None,
                        help="read existing runs <runs-dir>/<method>_seed<seed> instead of launching them")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.samples_per_prompt, args.repeats, args.train_steps = 1, 2, 1, 0
    out = common.out_path(args, RESULTS_PATH)
    common.build_task(args.build)
    torch.set_num_threads(1)
    model, tokenizer = load_model_dir(str(args.build / "model"))
    model.eval()
    traces = common.sample_traces(model, tokenizer, common.load_problems(args.build / "data" / "val.parquet",
                                                                         args.prompts), args.samples_per_prompt, args.seed)
    result = {"values": measure_values(model, tokenizer, traces, args.mc_samples, args.repeats)}
    if args.train_steps > 0 or args.runs_dir is not None:
        runs_dir = args.runs_dir or common.ROOT / "outputs" / "benchmarks" / "cost"
        result["training"] = measure_training(runs_dir, args.train_steps, args.seed, args.build,
                                              launch=args.runs_dir is None)
    result["meta"] = {"prompts": args.prompts, "samples_per_prompt": args.samples_per_prompt,
                      "segmentation": dataclasses.asdict(RECIPE_SEGMENTATION), "exit_text": EXIT_TEXT,
                      "train_steps": args.train_steps, "runs_dir": str(args.runs_dir) if args.runs_dir else None,
                      "timer": "wall seconds (perf_counter), torch.set_num_threads(1); medians over repeats, MC once",
                      **common.machine_meta()}
    print_tables(result)
    return common.write_result(result, out)


if __name__ == "__main__":
    main()
