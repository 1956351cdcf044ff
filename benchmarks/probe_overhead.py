"""Cost of exit-probe values relative to the plain log-prob pass, against the token-count limit.

For a trace of L response tokens with K boundaries, |C| candidates and probes of a tokens, scoring every probe token
costs at least limit = (L + K·|C|·a) / L times the plain pass (one forward over prompt + trace computing per-token
log-probs and entropies, which verl runs anyway). The packed scorer runs the exit text shared by a boundary's |C|
probes once, so with |C| > 1 it can come in below that limit. This script measures

* plain:  ``trace_log_probs_and_entropy`` (the baseline pass),
* packed: ``score_probes_packed`` (one forward over the trace followed by all probes' tree tokens, with the
  response's log-probs and entropies computed from hidden states in row chunks),
* naive:  ``score_probes_naive`` (one forward per probe; only at L = 1024, it is slow),

and reports packed/plain next to the limit (goal: packed/plain ≤ 1.15 × limit).

Times are process CPU seconds (``time.process_time``) with ``torch.set_num_threads(1)``: the benchmark machine's
cores are shared, and CPU time of a single-threaded run is not inflated by other processes' time slices the way
wall time is. Plain and packed are timed in back-to-back pairs (order alternating); packed/plain is the median of
the per-pair ratios, the times are medians. At least ``--repeats`` pairs, more for cheap settings (about one
CPU-second of plain passes). The naive path runs at L = 1024 only, and on the large model only
where K·|C| ≤ 30 (it costs K·|C| forwards).

    python benchmarks/probe_overhead.py                # full run, writes benchmarks/results/probe_overhead.json
    python benchmarks/probe_overhead.py --smoke        # a few seconds, writes to a temp file (or --out)
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

if __package__ in (None, ""):  # ``python benchmarks/probe_overhead.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.reference_scorers import score_probes_naive, trace_log_probs_and_entropy  # noqa: E402
from rredcot_verl.core.probes import Probe  # noqa: E402
from rredcot_verl.core.scoring import score_probes_packed  # noqa: E402

RESULTS_PATH = common.RESULTS_DIR / "probe_overhead.json"
PROMPT_LENGTH = 32
PROBE_LENGTH = 6  # a: forced + scored tokens per probe
FORCED_LENGTH = 3  # exit text tokens; with the scored answer tokens they make the probe length a
GOAL_RATIO_TO_LIMIT = 1.15

# name → (hidden, heads, layers, vocab); head dim hidden/heads, MLP 3×hidden.
MODEL_CONFIGS = {
    "smoke": (32, 2, 1, 64),
    "tiny": (128, 4, 3, 300),
    "large": (512, 8, 8, 300),
}
FULL_LENGTHS = {"tiny": (1024, 4096, 8192), "large": (1024, 4096)}  # large at 8192: ~10 CPU-s per pass, too slow
NAIVE_LENGTH = 1024
# The naive path costs K·|C| forwards; on the large model it runs only where K·|C| is small (~20 CPU-s at 30).
NAIVE_MAX_PROBES = {"smoke": 1000, "tiny": 1000, "large": 30}
MIN_MEASURED_SECONDS = 1.0  # cheap settings get more repeats: medians of a handful of 50 ms runs are noisy


def build_model(name: str, max_positions: int) -> Qwen2ForCausalLM:
    hidden, heads, layers, vocab = MODEL_CONFIGS[name]
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).eval()


def build_probes(response_len: int, num_boundaries: int, num_candidates: int, probe_len: int, vocab: int,
                 generator: torch.Generator) -> list[Probe]:
    """K boundaries spread evenly over [0, L], |C| distinct answers each, after the same forced exit text."""
    boundaries = torch.linspace(0, response_len, num_boundaries).round().long().tolist()
    exit_ids = torch.randint(0, vocab, (FORCED_LENGTH,), generator=generator).tolist()
    answers = [torch.randint(0, vocab, (probe_len - FORCED_LENGTH,), generator=generator).tolist()
               for _ in range(num_candidates)]
    return [Probe(b, exit_ids, answer, value_index=k) for k, b in enumerate(boundaries) for answer in answers]


def cpu_seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def run(model_names, lengths_by_model, boundary_counts, candidate_counts, probe_len, repeats, naive_length):
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for name in model_names:
        lengths = lengths_by_model[name]
        torch.manual_seed(0)
        model = build_model(name, max_positions=PROMPT_LENGTH + max(lengths) + 64)
        vocab = model.config.vocab_size
        for response_len in lengths:
            prompt = torch.randint(0, vocab, (PROMPT_LENGTH,), generator=generator)
            response = torch.randint(0, vocab, (response_len,), generator=generator)
            settings = [(k, c) for k in boundary_counts for c in candidate_counts]
            probes = {s: build_probes(response_len, *s, probe_len, vocab, generator) for s in settings}
            warm_up = cpu_seconds(lambda: trace_log_probs_and_entropy(model, prompt, response))
            num_repeats = max(repeats, min(25, int(MIN_MEASURED_SECONDS / max(warm_up, 1e-3))))
            for (num_boundaries, num_candidates) in settings:
                trace_probes = probes[(num_boundaries, num_candidates)]
                run_plain = lambda: trace_log_probs_and_entropy(model, prompt, response)  # noqa: E731
                run_packed = lambda: score_probes_packed(model, prompt, response, trace_probes)  # noqa: E731
                plain_times, packed_times, ratios = [], [], []
                for repeat in range(num_repeats):
                    # Back-to-back pairs, order alternating: the shared cores' load changes between pairs.
                    if repeat % 2 == 0:
                        plain_times.append(cpu_seconds(run_plain))
                        packed_times.append(cpu_seconds(run_packed))
                    else:
                        packed_times.append(cpu_seconds(run_packed))
                        plain_times.append(cpu_seconds(run_plain))
                    ratios.append(packed_times[-1] / plain_times[-1])
                ratio = statistics.median(ratios)
                limit = (response_len + num_boundaries * num_candidates * probe_len) / response_len
                row = {
                    "config": name, "L": response_len, "K": num_boundaries, "C": num_candidates, "a": probe_len,
                    "plain_s": statistics.median(plain_times), "packed_s": statistics.median(packed_times),
                    "packed_over_plain": ratio, "limit": limit, "ratio_over_limit": ratio / limit,
                    "repeats": num_repeats, "naive_s": None, "max_rel_err_vs_naive": None,
                }
                if response_len == naive_length and num_boundaries * num_candidates <= NAIVE_MAX_PROBES[name]:
                    naive_scores = []
                    row["naive_s"] = cpu_seconds(
                        lambda: naive_scores.append(score_probes_naive(model, prompt, response, trace_probes)))
                    packed_scores = score_probes_packed(model, prompt, response, trace_probes).probe_logp
                    row["max_rel_err_vs_naive"] = float(
                        ((packed_scores - naive_scores[0]).abs() / naive_scores[0].abs()).max())
                rows.append(row)
                print(format_row(row), flush=True)
    return rows


HEADER = (f"{'config':<7}{'L':>6}{'K':>4}{'|C|':>4}{'plain s':>10}{'packed s':>10}{'pk/plain':>9}"
          f"{'limit':>7}{'ratio/limit':>12}{'naive s':>9}{'rel err':>9}")


def format_row(row: dict) -> str:
    naive = f"{row['naive_s']:9.2f}" if row["naive_s"] is not None else f"{'-':>9}"
    error = f"{row['max_rel_err_vs_naive']:9.1e}" if row["max_rel_err_vs_naive"] is not None else f"{'-':>9}"
    return (f"{row['config']:<7}{row['L']:>6}{row['K']:>4}{row['C']:>4}{row['plain_s']:>10.3f}{row['packed_s']:>10.3f}"
            f"{row['packed_over_plain']:>9.3f}{row['limit']:>7.3f}{row['ratio_over_limit']:>12.3f}{naive}{error}")


def main(argv: list[str] | None = None) -> dict:
    parser = common.parser(__doc__, RESULTS_PATH, "tiny sizes, a few seconds; writes to --out or a temp", build=False)
    parser.add_argument("--repeats", type=int, default=3, help="minimum number of plain/packed pairs per row")
    parser.add_argument("--configs", nargs="+", choices=["tiny", "large"], default=["tiny", "large"])
    args = parser.parse_args(argv)

    if args.smoke:
        model_names, lengths_by_model = ["smoke"], {"smoke": (64,)}
        boundary_counts, candidate_counts, repeats, naive_length = (4,), (1, 2), 1, 64
    else:
        model_names, lengths_by_model = args.configs, FULL_LENGTHS
        boundary_counts, candidate_counts, repeats, naive_length = (10, 20, 40), (1, 3), args.repeats, NAIVE_LENGTH
    out = common.out_path(args, RESULTS_PATH)

    print(HEADER)
    rows = run(model_names, lengths_by_model, boundary_counts, candidate_counts, PROBE_LENGTH, repeats, naive_length)
    result = {
        "meta": {
            "timer": "process CPU seconds, torch.set_num_threads(1); packed/plain = median of back-to-back pair ratios",
            "min_repeats": repeats, "naive_max_probes": {name: NAIVE_MAX_PROBES[name] for name in model_names},
            "prompt_length": PROMPT_LENGTH, "probe_length_a": PROBE_LENGTH, "forced_length": FORCED_LENGTH,
            "goal": f"packed/plain <= {GOAL_RATIO_TO_LIMIT} x limit, limit = (L + K*|C|*a)/L",
            "models": {name: dict(zip(("hidden", "heads", "layers", "vocab"), MODEL_CONFIGS[name]))
                       for name in model_names},
            **common.machine_meta(),
        },
        "rows": rows,
        "worst_ratio_over_limit": max(row["ratio_over_limit"] for row in rows),
    }
    print(f"worst packed/plain / limit: {result['worst_ratio_over_limit']:.3f} (goal <= {GOAL_RATIO_TO_LIMIT})")
    return common.write_result(result, out)


if __name__ == "__main__":
    main()
