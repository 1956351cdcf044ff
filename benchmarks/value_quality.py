"""How well do the segment values of each value source track Monte-Carlo values, and find the first wrong step?

On the warm start's own samples of validation prompts (several per prompt, so the group banks see several rollouts,
as in training), segmented as the tiny recipe segments them, every state S_0..S_{K-1} gets a Monte-Carlo value from
``--mc-samples`` continuations (``common.continuation_success_rates``), the ground truth here; S_K's value is the
outcome.
Compared with it: the exit probe (raw and self-normalised), reference and own continuations (what training computes,
``core.values.compute_segment_values``), the rule "no wrong line yet", and, per segment only, leave-one-out and
gradient × input (``benchmarks/attribution.py``) and MC's own segment rewards R_k = v_k − v_{k−1}. Reported: Spearman
and Pearson with MC (pooled, within trace, per third of the trace) and localisation: on incorrect traces whose first
wrong step is known, how often argmin_k R_k is the segment completing that step (chance: mean 1/K). Measured tables
and their reading: RESULTS.md §1.

    python -m benchmarks.value_quality                 # 52 traces, MC K=32: benchmarks/results/value_quality.json
    python -m benchmarks.value_quality --from-json benchmarks/results/value_quality.json --out /tmp/vq.json
                                                       # the tables again from a result's per-trace records
    python -m benchmarks.value_quality --smoke         # seconds: 4 traces, MC K=4, temp output
    python -m benchmarks.value_quality --setting long  # the long setting: benchmarks/results/value_quality_long.json
    python -m benchmarks.value_quality --setting items --model M --out O.json
                                                       # the items setting on another model folder (a prototype)

On the long setting (``build --setting long``: 16-17 step lines of about 25 tokens each) every line is a segment, and
the reference continuation is also measured under each ``probe.reference_alignment`` and against a coarse reference
that writes two steps per line (``coarse_steps``): a trace and a reference that differ in step count, where the
alignments disagree (docs/choices.md, "Reference values at length").
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import common
from benchmarks.attribution import gradient_times_input_attribution, leave_one_out_attribution
from benchmarks.common import EXIT_TEXT, RECIPE_SEGMENTATION, correlations, fmt, spearman
from benchmarks.reference_scorers import trace_log_probs_and_entropy
from rredcot_verl.core.values import compute_segment_values
from rredcot_verl.tasks import first_wrong_step, load_model_dir
from rredcot_verl.tasks.base import ARITHMETIC

RESULTS_PATH = common.RESULTS_DIR / "value_quality.json"
LONG_RESULTS_PATH = common.RESULTS_DIR / "value_quality_long.json"
RESULTS_PATHS = {"default": RESULTS_PATH, "long": LONG_RESULTS_PATH,
                 "early": common.RESULTS_DIR / "value_quality_early.json",
                 "items": common.RESULTS_DIR / "value_quality_items.json",
                 "items3": common.RESULTS_DIR / "value_quality_items3.json"}
# Every line of a long trace a segment (17-18 states), where the recipe's 8 would merge two or three lines each.
LONG_SEGMENTATION = dataclasses.replace(RECIPE_SEGMENTATION, max_segments=20)


@dataclasses.dataclass(frozen=True)
class Source:
    """A probe value source: ``probe.value_source``, its normalisation, ``probe.reference_alignment``, and whether
    the bank's reference solution is the coarse one (two steps a line)."""

    value_source: str
    normalization: str = "raw"
    alignment: str = "steps"
    coarse: bool = False


PROBE_SOURCES = {
    "exit_raw": Source("exit_probe"),
    "exit_selfnorm": Source("exit_probe", "self_normalized"),
    "reference": Source("reference_continuation"),  # always raw sums: its bank holds correct continuations only
    "own_continuation": Source("own_continuation"),
}
LONG_PROBE_SOURCES = {
    **PROBE_SOURCES,
    "reference_proportional": Source("reference_continuation", alignment="proportional"),
    "reference_content": Source("reference_continuation", alignment="content"),
    **{f"coarse_reference_{alignment}": Source("reference_continuation", alignment=alignment, coarse=True)
       for alignment in ("steps", "proportional", "content")},
}
STATE_SOURCES = [*LONG_PROBE_SOURCES, "rule"]
# Per setting: the probe sources measured and the segmentation (the recipe's on the default task and on items, whose
# seven lines it keeps apart; every line a segment on the long and answer-early ones).
SOURCES = {"default": PROBE_SOURCES, "long": LONG_PROBE_SOURCES, "early": PROBE_SOURCES, "items": PROBE_SOURCES,
           "items3": PROBE_SOURCES}
SEGMENTATIONS = {"default": RECIPE_SEGMENTATION, "long": LONG_SEGMENTATION, "early": LONG_SEGMENTATION,
                 "items": RECIPE_SEGMENTATION, "items3": RECIPE_SEGMENTATION}
# Settings whose warm start learned to answer after a forced exit: their states record the steps left, and the
# result holds the exit accuracy and the goals.
ANSWER_EARLY = ("early", "items", "items3")
# The answer-early setting's goals (issue 52): exit-probe values against MC at the warm start, and a reasoning task.
EARLY_GOALS = {"spearman": 0.6, "localisation": 0.6, "sampled_accuracy_band": (0.2, 0.5)}
THIRDS = ("early", "middle", "late")
_STEP = re.compile(r"(-?\d+[+-]\d+)=(-?\d+)(?: (\S+))?")


def coarse_steps(steps: list[str]) -> list[str]:
    """Two step lines as one: ``7-1=6 +5+9``, ``6+5=11 +9`` → ``7-1+5=11 +9`` (a last odd line kept as it is)."""
    merged = []
    for first, second in zip(steps[::2], steps[1::2]):
        a, b = _STEP.fullmatch(first), _STEP.fullmatch(second)
        merged.append(f"{a[1]}{b[1][len(a[2]):]}={b[2]}" + (f" {b[3]}" if b[3] else ""))
    return merged + steps[len(steps) - len(steps) % 2:]


def value_sources(model, tokenizer, traces, sources: dict[str, Source] = PROBE_SOURCES,
                  segmentation=RECIPE_SEGMENTATION) -> tuple[list[list[int]], dict, dict]:
    """Segment ends per trace; per probe source, values v_0..v_{K-1} per trace (NaN: no estimate); seconds per
    source (``compute_segment_values`` over the whole batch)."""
    entropies = [trace_log_probs_and_entropy(model, t.prompt_ids, t.response_ids)[1] for t in traces]
    ends, values, timings = None, {}, {}
    for name, source in sources.items():
        records = [t.record(entropy, coarse_steps(t.reference_steps) if source.coarse else None)
                   for t, entropy in zip(traces, entropies)]
        # The coarse reference stands alone: the group's correct traces would bring back the fine steps.
        candidates = "ground_truth" if source.coarse else "both"
        settings = common.embedded_settings(source.value_source, source.normalization, candidates, segmentation,
                                            reference_alignment=source.alignment)
        started = time.perf_counter()
        segment_ends, raw_values, _ = compute_segment_values(model, tokenizer, records, settings, task=ARITHMETIC,
                                        max_positions=model.config.max_position_embeddings)
        timings[name] = time.perf_counter() - started
        trace_ends = [[e for e in row.tolist() if e >= 0] for row in segment_ends]
        if ends is not None and trace_ends != ends:
            raise RuntimeError("segmentation differs between value sources")
        ends = trace_ends
        values[name] = [raw_values[i, : len(e)].numpy().astype(float) for i, e in enumerate(ends)]
    return ends, values, timings


def rule_values(tokenizer, trace, boundaries: list[int]) -> np.ndarray:
    """1 while every completed step line is right (first wrong step not yet written), else 0."""
    wrong = first_wrong_step(trace.problem, trace.text)
    ids = trace.response_ids.tolist()
    return np.array([1.0 if wrong is None or common.completed_lines(tokenizer, ids, b) < wrong else 0.0
                     for b in boundaries])


def attributions(model, tokenizer, trace, ends: list[int]) -> dict[str, np.ndarray]:
    """LOO and gradient × input of the ground-truth answer after the exit text, over the thinking part."""
    think_len = common.thinking_length(tokenizer, trace.response_ids.tolist())
    exit_ids = tokenizer.encode(EXIT_TEXT, add_special_tokens=False)
    answer_ids = tokenizer.encode("{" + trace.ground_truth + "}", add_special_tokens=False) + [tokenizer.eos_token_id]
    args = (model, trace.prompt_ids, trace.response_ids[:think_len], [min(end, think_len) for end in ends], exit_ids,
            answer_ids)
    return {"loo": leave_one_out_attribution(*args).numpy().astype(float),
            "grad_x_input": gradient_times_input_attribution(*args).numpy().astype(float)}


def analyse(ends, state_values, segment_values, mc_values, holders) -> dict:
    """Correlation tables (states and segments) and localisation; ``holders``: trace index → erroneous segment."""
    states, segments = {}, {}
    for name in state_values:
        pairs = list(zip(state_values[name], mc_values))
        entry = correlations(pairs)
        for part in THIRDS:
            in_part = [[THIRDS[min(int(3 * k / len(v)), 2)] == part for k in range(len(v))] for v, _ in pairs]
            xs = np.concatenate([v[keep] for (v, _), keep in zip(pairs, in_part)])
            ys = np.concatenate([m[keep] for (_, m), keep in zip(pairs, in_part)])
            entry[f"spearman_{part}"] = spearman(xs[~np.isnan(xs)], ys[~np.isnan(xs)])
        flat = np.concatenate(state_values[name])
        entry["mean_value"], entry["nan_fraction"] = float(np.nanmean(flat)), float(np.mean(np.isnan(flat)))
        states[name] = entry
    for name in segment_values:
        entry = correlations(list(zip(segment_values[name], segment_values["mc"]))) if name != "mc" else {}
        judged = [(segment_values[name][i], holder) for i, holder in holders.items()
                  if not np.all(np.isnan(segment_values[name][i]))]
        entry["localisation"] = (sum(int(np.nanargmin(r)) == holder for r, holder in judged) / len(judged)
                                 if judged else None)
        entry["localisation_n"] = len(judged)
        segments[name] = entry
    chance = float(np.mean([1.0 / len(ends[i]) for i in holders])) if holders else None
    return {"states": states, "segments": segments, "localisation_chance": chance,
            "localisation_traces": len(holders)}


def segment_rewards(values: np.ndarray, outcome: float) -> np.ndarray:
    """R_k = v_k − v_{k−1}, k = 1..K, with v_K = ζ."""
    return np.diff(np.append(values, outcome))


def by_steps_left(per_trace: list[dict]) -> dict:
    """Mean exit values (raw, self-normalised) and Monte-Carlo values of the states by the steps left after them,
    apart for states whose written lines are all right (``rule`` 1) and states after a wrong line: the shape of the
    values along a trace. ``{"right" | "wrong": {steps left: {"n", "exit_raw", "exit_selfnorm", "mc"}}}``."""
    names = ("exit_raw", "exit_selfnorm", "mc")
    groups: dict[str, dict[int, list[tuple[float, ...]]]] = {"right": {}, "wrong": {}}
    for t in per_trace:
        for k, left in enumerate(t["steps_left"]):
            kind = "right" if t["rule"][k] == 1.0 else "wrong"
            groups[kind].setdefault(left, []).append(tuple(np.nan if t[name][k] is None else t[name][k]
                                                           for name in names))

    def mean(column: list[float]) -> float:  # NaN where no state has an estimate
        present = [x for x in column if not np.isnan(x)]
        return float(np.mean(present)) if present else float("nan")

    return {kind: {left: {"n": len(rows), **{name: mean(column) for name, column in zip(names, zip(*rows))}}
                   for left, rows in sorted(rows_by_left.items())}
            for kind, rows_by_left in groups.items()}


def early_goals(result: dict) -> dict:
    """The answer-early setting's goals read off a result: each exit normalisation's pooled state Spearman and
    localisation against their bars, the sampled accuracy against its band, the immediate exit against the chain."""
    low, high = EARLY_GOALS["sampled_accuracy_band"]
    sampled = result["traces"]["correct"] / result["traces"]["n"]
    immediate = result["exit_accuracy"]["immediate"]
    goals = {name: {"spearman": result["states"][name]["spearman"],
                    "localisation": result["segments"][name]["localisation"],
                    "met": (result["states"][name]["spearman"] >= EARLY_GOALS["spearman"]
                            and result["segments"][name]["localisation"] >= EARLY_GOALS["localisation"])}
             for name in ("exit_raw", "exit_selfnorm")}
    goals["sampled_accuracy"] = {"value": sampled, "band": [low, high], "met": low <= sampled <= high}
    goals["immediate_exit"] = {"value": immediate, "greedy_chain": result["exit_accuracy"]["greedy_chain"],
                               "sampled_chain": sampled}
    return goals


def tables(per_trace: list[dict]) -> dict:
    """``analyse`` of per-trace records (the JSON's ``per_trace``), over the sources they hold; with the states'
    steps left recorded (the answer-early setting), also ``by_steps_left``."""
    names = [name for name in STATE_SOURCES if name in per_trace[0]]
    state_values = {name: [np.array([np.nan if v is None else v for v in t[name]], dtype=float) for t in per_trace]
                    for name in names}
    mc_values = [np.array(t["mc"], dtype=float) for t in per_trace]
    segment_values = {name: [segment_rewards(v, t["outcome"]) for v, t in zip(state_values[name], per_trace)]
                      for name in names}
    for name in ("loo", "grad_x_input"):
        segment_values[name] = [np.array(t[name], dtype=float) for t in per_trace]
    segment_values["mc"] = [segment_rewards(v, t["outcome"]) for v, t in zip(mc_values, per_trace)]
    holders = {i: t["holder_segment"] for i, t in enumerate(per_trace) if t["holder_segment"] is not None}
    result = analyse([t["segment_ends"] for t in per_trace], state_values, segment_values, mc_values, holders)
    if "steps_left" in per_trace[0]:
        result["by_steps_left"] = by_steps_left(per_trace)
    return result


def steps_left(tokenizer, trace, boundaries: list[int]) -> list[int]:
    """Steps of the problem still to write after each state (0 once as many lines as steps are written)."""
    ids = trace.response_ids.tolist()
    return [max(trace.problem.num_steps - common.completed_lines(tokenizer, ids, b), 0) for b in boundaries]


def run(build: Path, num_prompts: int, samples_per_prompt: int, mc_samples: int, seed: int,
        setting: str = "default", model_dir: Path | None = None) -> dict:
    torch.set_num_threads(1)
    model, tokenizer = load_model_dir(str(model_dir or build / "model"))
    model.eval()
    early = setting in ANSWER_EARLY
    max_tokens = common.SETTINGS[setting].max_response_length
    problems = common.load_problems(build / "data" / "val.parquet", num_prompts)
    traces = common.sample_traces(model, tokenizer, problems, samples_per_prompt, seed, max_tokens)
    ends, probe_values, timings = value_sources(model, tokenizer, traces, SOURCES[setting], SEGMENTATIONS[setting])
    started = time.perf_counter()
    mc_values, _ = common.continuation_success_rates(model, tokenizer, traces, ends, num_samples=mc_samples,
                                                     seed=seed + 1, max_response_tokens=max_tokens)
    timings["mc"] = time.perf_counter() - started
    started = time.perf_counter()
    attribution = [attributions(model, tokenizer, t, e) for t, e in zip(traces, ends)]
    timings["loo+grad_x_input"] = time.perf_counter() - started
    per_trace = [
        {"text": t.text, "outcome": t.outcome, "segment_ends": ends[i], "mc": mc_values[i].tolist(),
         **{name: [None if np.isnan(x) else float(x) for x in values[i]] for name, values in probe_values.items()},
         "rule": rule_values(tokenizer, t, [0, *ends[i][:-1]]).tolist(),
         **{name: attribution[i][name].tolist() for name in ("loo", "grad_x_input")},
         "first_wrong_step": first_wrong_step(t.problem, t.text), "holder_segment": common.holder_segment(
             tokenizer, t, ends[i]),
         **({"steps_left": steps_left(tokenizer, t, [0, *ends[i][:-1]])} if early else {})}
        for i, t in enumerate(traces)
    ]
    result = {**tables(per_trace), "traces": {
        "n": len(traces), "correct": int(sum(t.outcome for t in traces)), "states": int(sum(len(e) for e in ends)),
        "mean_segments": float(np.mean([len(e) for e in ends]))}, "timings_s": timings, "per_trace": per_trace}
    if early:
        result["exit_accuracy"] = exit_and_chain_accuracy(model, tokenizer, [problem for problem, _, _ in problems],
                                                          max_tokens)
    return result


def exit_and_chain_accuracy(model, tokenizer, problems, max_response_tokens: int) -> dict:
    """``tasks.sft.exit_accuracy`` (greedy answers after a forced exit on the reference cut after each line, by
    steps left) on the prompts, beside the greedy accuracy of whole traces on them."""
    from rredcot_verl.tasks.sft import accuracy_report, exit_accuracy, generate_responses

    greedy = generate_responses(model, tokenizer, problems, False, max_response_tokens)
    return {**exit_accuracy(model, tokenizer, problems), "greedy_chain": accuracy_report(problems, greedy)["accuracy"],
            "problems": len(problems)}


def print_tables(result: dict) -> None:
    print(f"traces {result['traces']}  timings {({k: round(v, 1) for k, v in result['timings_s'].items()})}")
    common.print_table([{"source": name, **e} for name, e in result["states"].items()], [
        "source", "spearman", "pearson", "within_spearman", "within_pearson", "within_n", "spearman_early",
        "spearman_middle", "spearman_late", "mean_value", "nan_fraction"], "STATES: values v_k vs MC (k = 0..K-1)")
    common.print_table([{"source": name, **e} for name, e in result["segments"].items()], [
        "source", "spearman", "pearson", "within_spearman", "within_n", "localisation"],
        f"SEGMENTS: R_k vs MC R_k (k = 1..K); localisation over {result['localisation_traces']} incorrect traces, "
        f"chance {fmt(result['localisation_chance'], 0)}")


def main(argv: list[str] | None = None) -> dict:
    cli = common.parser(__doc__, RESULTS_PATH, "4 traces, MC K=4; writes to --out or a temp file")
    cli.add_argument("--prompts", type=int, default=13)
    cli.add_argument("--samples-per-prompt", type=int, default=4)
    cli.add_argument("--mc-samples", type=int, default=32)
    cli.add_argument("--seed", type=int, default=0)
    cli.add_argument("--setting", choices=tuple(SOURCES), default="default",
                     help="the task build: default, long, early or items (their own build folders unless --build is "
                          "given)")
    cli.add_argument("--model", type=Path, default=None,
                     help="a model folder (save_pretrained: weights and tokenizer) that replaces the build's warm "
                          "start, such as a longer-trained prototype; the build still gives the data")
    cli.add_argument("--from-json", type=Path, default=None,
                     help="recompute the tables from this result's per-trace records (no model, no sampling)")
    args = cli.parse_args(argv)
    if args.smoke:
        args.prompts, args.samples_per_prompt, args.mc_samples = 2, 2, 4
    if args.build == common.BUILD_DIR:
        args.build = common.BUILD_DIRS[common.SETTINGS[args.setting].preset]
    out = common.out_path(args, RESULTS_PATHS[args.setting])
    if args.from_json is not None:
        stored = json.loads(args.from_json.read_text())
        result = {**stored, **tables(stored["per_trace"])}
        if "exit_accuracy" in result:
            result["goals"] = early_goals(result)
        print_tables(result)
        return common.write_result(result, out)
    common.build_task(args.build, common.SETTINGS[args.setting].preset)
    started = time.perf_counter()
    result = run(args.build, args.prompts, args.samples_per_prompt, args.mc_samples, args.seed, args.setting,
                 args.model)
    result["meta"] = {"setting": args.setting, "model": str(args.model) if args.model else "the build's warm start",
                      "prompts": args.prompts, "samples_per_prompt": args.samples_per_prompt,
                      "mc_samples": args.mc_samples, "seed": args.seed, "exit_text": EXIT_TEXT,
                      "segmentation": dataclasses.asdict(SEGMENTATIONS[args.setting]),
                      "max_response_tokens": common.SETTINGS[args.setting].max_response_length,
                      "wall_s": time.perf_counter() - started, **common.machine_meta()}
    if "exit_accuracy" in result:
        result["goals"] = early_goals(result)
    print_tables(result)
    return common.write_result(result, out)


if __name__ == "__main__":
    main()
