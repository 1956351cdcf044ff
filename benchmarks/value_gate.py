"""Does the value gate (``redistribution.min_value_concordance``) tell informative segment values from uninformative ones?

The gate needs no ground truth: it asks whether a batch's boundary values order the traces of each prompt by their
outcomes (``rredcot_verl.core.concordance``). This benchmark checks it against what the gate is meant to protect,
error localisation (on incorrect traces whose first wrong step the arithmetic task annotates: does the most negative
segment reward fall on the segment holding that step; chance is the mean 1/K), in two parts:

1. **Warm start** (``--batches`` batches of 8 prompts × 4 samples per task setting, temperature 1 as in the rollouts,
   the tiny recipe's segmentation): per value source, the per-batch concordance (mean, 95% t interval over batches,
   comparisons per batch), the localisation of the redistribution (gate off, the source's value mapping as in the
   training study), and the share of batches on which the gate would be open when the batches arrive in sequence,
   for windows of 1 and ``concordance_window`` batches and three thresholds around the default. Sources: the exit
   probe (raw and self-normalised), reference continuations from the dataset reference, the group's correct traces,
   or both (the recipe's), and uniformly random values in the reference values' place (a negative control). Problems
   come from their own generator stream (``DATA_SEED``), not the study's validation set.
2. **Training** (``--runs``): the same statistics, per step, from the snapshots of training runs
   (``algorithm.rredcot.snapshot_dir``; the sample-efficiency study writes them under ``outputs/``): the concordance
   over the first and last ``WINDOW`` steps, and the replayed gate's open share (the runs trained without it).

    python -m benchmarks.value_gate                # 16 batches per setting + every study run folder with snapshots
    python -m benchmarks.value_gate --smoke        # seconds: one batch of 2 x 4 on the default setting, temp output
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import common
from benchmarks.common import RECIPE_SEGMENTATION, SETTINGS, mean_interval
from rredcot_verl.core.concordance import ConcordanceCounts, ConcordanceWindow, gate_is_open, value_outcome_concordance
from benchmarks.reference_scorers import trace_log_probs_and_entropy
from rredcot_verl.core.redistribution import RedistributionSettings, redistribute
from rredcot_verl.core.values import compute_segment_values
from rredcot_verl.tasks import load_model_dir
from rredcot_verl.tasks.base import ARITHMETIC
from rredcot_verl.tasks.model import PAD_TOKEN

RESULTS_PATH = common.RESULTS_DIR / "value_gate.json"
DATA_SEED = 2  # the study's problems come from streams 0 (main) and 1 (sweep)
PROMPTS_PER_BATCH, SAMPLES_PER_PROMPT = 8, 4  # the study's batch (data.train_batch_size × rollout.n)
DEFAULTS = RedistributionSettings()
THRESHOLDS = (0.55, DEFAULTS.min_value_concordance, 0.65)
WINDOWS = (1, DEFAULTS.concordance_window)
WINDOW = 10  # training steps per "first" and "last" summary window
# (value source, normalisation, candidate source, value mapping): the training study's rredcot variants
SOURCES = {
    "exit_probe_raw": ("exit_probe", "raw", "both", "affine"),
    "exit_probe_self_normalized": ("exit_probe", "self_normalized", "both", "affine"),
    "reference_both": ("reference_continuation", "raw", "both", "log_affine"),
    "reference_ground_truth": ("reference_continuation", "raw", "ground_truth", "log_affine"),
    "reference_group": ("reference_continuation", "raw", "group", "log_affine"),
}
RANDOM_CONTROL = "random_values"


def replay_gate(counts: list[ConcordanceCounts], threshold: float, window: int) -> list[bool]:
    """The gate's decision on each batch of a sequence, as the trainer takes it (the window of earlier batches
    pooled with the batch's own counts)."""
    previous, decisions = ConcordanceWindow(window), []
    for batch in counts:
        decisions.append(gate_is_open(previous.pooled() + batch, threshold))
        previous.push(batch)
    return decisions


def gate_open_shares(counts: list[ConcordanceCounts]) -> dict:
    """{"window <w>": {"<threshold>": share of batches with the gate open}}."""
    return {f"window {w}": {f"{t:g}": float(np.mean(replay_gate(counts, t, w))) for t in THRESHOLDS} for w in WINDOWS}


# ---------------------------------------------------------------- warm start


def warm_start_batch(model, tokenizer, problems, samples: int, seed: int, rng: np.random.Generator) -> dict:
    """One batch (``samples`` traces per problem): per source its concordance counts and localisation hits."""
    traces = common.sample_traces(model, tokenizer, problems, samples, seed)
    records = [t.record(trace_log_probs_and_entropy(model, t.prompt_ids, t.response_ids)[1]) for t in traces]
    outcomes = torch.tensor([t.outcome for t in traces], dtype=torch.float32)
    lengths = torch.tensor([len(t.response_ids) for t in traces])
    index = [t.group for t in traces]
    mask = (torch.arange(int(lengths.max())) < lengths.unsqueeze(1)).long()
    result = {"accuracy": float(outcomes.mean()), "sources": {}}
    reference = None
    for name in [*SOURCES, RANDOM_CONTROL]:
        if name == RANDOM_CONTROL:
            ends, raw = reference
            raw = torch.tensor(rng.uniform(size=tuple(raw.shape)), dtype=raw.dtype).where(~raw.isnan(), float("nan"))
            mapping = SOURCES["reference_both"][3]
        else:
            value_source, normalization, candidates, mapping = SOURCES[name]
            settings = common.embedded_settings(value_source, normalization, candidates)
            ends, raw, _ = compute_segment_values(model, tokenizer, records, settings, task=ARITHMETIC,
                                                  max_positions=model.config.max_position_embeddings)
            if name == "reference_both":
                reference = (ends, raw)
        # The gate off, so that localisation is measured on every batch; the counts are the gate's own.
        redistributed = redistribute(outcomes, mask, index, ends, raw.float(),
                                     RedistributionSettings(value_mapping=mapping, min_value_concordance=0.0))
        trace_ends = [[e for e in row.tolist() if e >= 0] for row in ends]
        holders = [None if redistributed.fallback[i] else common.holder_segment(tokenizer, trace, trace_ends[i])
                   for i, trace in enumerate(traces)]
        scored = [common.localisation_hit(rewards, holder)
                  for rewards, holder in zip(redistributed.segment_rewards.double().tolist(), holders)]
        hits, chance = [s[0] for s in scored if s is not None], [s[1] for s in scored if s is not None]
        counts = redistributed.concordance
        result["sources"][name] = {"concordant": counts.concordant, "comparisons": counts.comparisons,
                                   "hits": hits, "chance": chance}
    return result


def warm_start(build: Path, work: Path, setting: str, batches: int, prompts: int, samples: int, seed: int) -> dict:
    """Part 1 for one setting; its problems and result are kept in ``<work>/<setting>/`` and the result is reused by a
    later invocation with the same parameters (the training part then reads the newest snapshots)."""
    data_dir = work / setting
    cache = data_dir / "warm_start.json"
    key = {"batches": batches, "prompts": prompts, "samples": samples, "seed": seed, "data_seed": DATA_SEED,
           "sources": {k: list(v) for k, v in SOURCES.items()}, "build": str(build)}
    if cache.exists() and json.loads(cache.read_text())["key"] == key:
        return json.loads(cache.read_text())["result"]
    torch.set_num_threads(1)
    model, tokenizer = load_model_dir(str(build / "model"))
    model.eval()
    data_dir.mkdir(parents=True, exist_ok=True)
    record = common.write_setting_data(data_dir, SETTINGS[setting], prompts * batches, DATA_SEED)
    problems = common.load_problems(Path(record["val_files"]), prompts * batches)
    rng = np.random.default_rng(seed)
    per_batch = []
    for b in range(batches):
        started = time.perf_counter()
        per_batch.append(warm_start_batch(model, tokenizer, problems[prompts * b: prompts * (b + 1)], samples,
                                          seed + b, rng))
        print(f"{setting} batch {b + 1}/{batches}: accuracy {per_batch[-1]['accuracy']:.2f}, "
              f"{time.perf_counter() - started:.0f} s", flush=True)
    sources = {}
    for name in [*SOURCES, RANDOM_CONTROL]:
        rows = [batch["sources"][name] for batch in per_batch]
        counts = [ConcordanceCounts(row["concordant"], row["comparisons"]) for row in rows]
        hits = [h for row in rows for h in row["hits"]]
        sources[name] = {
            "concordance": mean_interval([c.concordance for c in counts]),
            "concordance_pooled": sum(counts, ConcordanceCounts()).concordance,
            "comparisons_per_batch": float(np.mean([c.comparisons for c in counts])),
            "localisation": float(np.mean(hits)) if hits else None,
            "localisation_chance": float(np.mean([c for row in rows for c in row["chance"]])) if hits else None,
            "localisation_traces": len(hits),
            "gate_open_share": gate_open_shares(counts),
        }
    result = {"batches": batches, "prompts_per_batch": prompts, "samples_per_prompt": samples,
              "accuracy": float(np.mean([b["accuracy"] for b in per_batch])), "sources": sources}
    cache.write_text(json.dumps({"key": key, "result": result}) + "\n")
    return result


# ---------------------------------------------------------------- training snapshots


def snapshot_counts(snapshot: dict) -> ConcordanceCounts:
    """The gate's counts for one training step's snapshot (as the estimator computed them: raw values, outcomes)."""
    traces = [t for t in snapshot.get("traces", []) if t.get("seg_raw_values") is not None]
    if not traces:
        return ConcordanceCounts()
    kmax = max(len(t["seg_ends"]) for t in traces)
    ends = torch.tensor([t["seg_ends"] + [-1] * (kmax - len(t["seg_ends"])) for t in traces], dtype=torch.int64)
    raw = torch.tensor([[np.nan if v is None else v for v in t["seg_raw_values"]] + [np.nan] * (kmax - len(t["seg_ends"]))
                        for t in traces], dtype=torch.float64)
    lengths = torch.tensor([sum(token != PAD_TOKEN for token in t["response_tokens"]) for t in traces])
    outcome = torch.tensor([t["outcome"] for t in traces], dtype=torch.float64)
    eligible = (lengths > 0) & (ends >= 0).any(1)
    return value_outcome_concordance(raw, ends, lengths, outcome, [t["uid"] for t in traces], eligible,
                                     tie=DEFAULTS.epsilon)


def training_run(folder: Path) -> dict | None:
    paths = sorted((folder / "snapshots").glob("step_*.json"))
    counts = [snapshot_counts(json.loads(path.read_text())) for path in paths]
    if not any(c.comparisons for c in counts):
        return None
    windows = {"first": counts[:WINDOW], "last": counts[-WINDOW:]}
    return {
        "steps": len(counts),
        "concordance": {name: sum(w, ConcordanceCounts()).concordance for name, w in windows.items()},
        "comparisons_per_step": float(np.mean([c.comparisons for c in counts])),
        "gate_open_share": gate_open_shares(counts),
        "gate_open_share_by_window": {
            name: float(np.mean(replay_gate(counts, DEFAULTS.min_value_concordance, DEFAULTS.concordance_window)[sl]))
            for name, sl in (("first", slice(0, WINDOW)), ("last", slice(-WINDOW, None)))
        },
    }


# ---------------------------------------------------------------- report


def print_tables(result: dict) -> None:
    t, last = f"{DEFAULTS.min_value_concordance:g}", f"window {WINDOWS[-1]}"
    for setting, part in result["warm_start"].items():
        common.print_table([{"source": name, **row["concordance"], "pairs": row["comparisons_per_batch"],
                             "localisation": row["localisation"], "chance": row["localisation_chance"],
                             "open_w1": row["gate_open_share"]["window 1"][t],
                             f"open_w{WINDOWS[-1]}": row["gate_open_share"][last][t]}
                            for name, row in part["sources"].items()],
                           ["source", "mean", "ci95", "sd", "pairs", "localisation", "chance", "open_w1",
                            f"open_w{WINDOWS[-1]}"],
                           f"WARM START, {setting}: {part['batches']} batches of {part['prompts_per_batch']}x"
                           f"{part['samples_per_prompt']}, sampled accuracy {part['accuracy']:.2f}")
    if result["training"]:
        common.print_table([{"run": run, "steps": row["steps"], "first": row["concordance"]["first"],
                             "last": row["concordance"]["last"], "open": row["gate_open_share"][last][t],
                             "open_first": row["gate_open_share_by_window"]["first"],
                             "open_last": row["gate_open_share_by_window"]["last"]}
                            for run, row in result["training"].items()],
                           ["run", "steps", "first", "last", "open", "open_first", "open_last"],
                           f"TRAINING SNAPSHOTS: concordance in the first and last {WINDOW} steps, replayed gate "
                           f"(threshold {t})")


def main(argv: list[str] | None = None) -> dict:
    parser = common.parser(__doc__, RESULTS_PATH, "one batch of 2 prompts x 4 samples, default setting")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", nargs="*", type=Path, default=None,
                        help="run folders with snapshots/ (default: every study run under outputs/bench)")
    args = parser.parse_args(argv)
    prompts, samples = PROMPTS_PER_BATCH, SAMPLES_PER_PROMPT
    if args.smoke:
        args.settings, args.batches, prompts, samples = ["default"], 1, 2, 4
        args.runs = [] if args.runs is None else args.runs
    if args.runs is None:
        args.runs = sorted(p.parent for p in (common.ROOT / "outputs" / "bench" / "sample_efficiency").glob("*/main/*/snapshots"))
    scratch = Path(tempfile.mkdtemp()) if args.smoke else None
    out = args.out or (scratch / RESULTS_PATH.name if args.smoke else RESULTS_PATH)
    work = scratch or common.ROOT / "outputs" / "bench" / "value_gate"
    common.build_task(args.build)
    started = time.perf_counter()
    result = {
        "threshold": DEFAULTS.min_value_concordance, "window": DEFAULTS.concordance_window,
        "warm_start": {s: warm_start(args.build, work, s, args.batches, prompts, samples, args.seed)
                       for s in args.settings},
        "training": {},
    }
    for folder in args.runs:
        run = training_run(folder)
        if run is not None:
            result["training"][f"{folder.parent.parent.name}/{folder.name}"] = run
    result["meta"] = {"seed": args.seed, "data_seed": DATA_SEED, "segmentation": dataclasses.asdict(RECIPE_SEGMENTATION),
                      "sources": {k: list(v) for k, v in SOURCES.items()}, "thresholds": list(THRESHOLDS),
                      "windows": list(WINDOWS), "wall_s": time.perf_counter() - started, **common.machine_meta()}
    print_tables(result)
    return common.write_result(result, out)


if __name__ == "__main__":
    main()
