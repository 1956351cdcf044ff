"""The value pass with its probe tokens attending block by block against the dense probe mask, on the long setting's
shape.

The long CPU setting's `rredcot` (dataset references, RESULTS.md §2 "Long setting") spends its extra step time in the
value pass, which reads about 10 traces' worth of reference-continuation tokens for each trace. Those probe tokens
attend through a (probe tokens × (trace + probe tokens)) mask, most of it masked: a boundary's continuations see only
the trace up to that boundary and themselves. ``core.scoring`` runs them block by block where that is at most
``BLOCKED_ATTENTION_SHARE`` of the dense mask's query-key pairs. This script times ``score_batch_packed`` both ways,
on the long build's model shape (``tasks.build.PRESETS['long']``: hidden 128, 3 layers, 1,024 positions) with random
weights, for the step's 32 traces of about 390 response tokens after a 100-token prompt, 8 segments (the long
recipe's), C reference continuations a boundary, each the rest of a trace-long solution (C = 2.1 on average in the
long runs), and for exit probes at the same boundaries (which stay dense), beside the plain log-prob pass.

Times are process CPU seconds with ``torch.set_num_threads(1)``, the minimum of ``--repeats`` runs each (the machine
is shared); ``max_relative_difference`` is the largest relative difference of a probe log-prob between the two.

    python -m benchmarks.probe_attention            # writes benchmarks/results/probe_attention.json
    python -m benchmarks.probe_attention --traces 8 # a quarter of the step's traces, about 20 CPU seconds
    python -m benchmarks.probe_attention --smoke    # 4 traces of 80 tokens, seconds; writes to a temp file
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

if __package__ in (None, ""):  # ``python benchmarks/probe_attention.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.reference_scorers import trace_log_probs_and_entropy  # noqa: E402
from rredcot_verl.core import scoring  # noqa: E402
from rredcot_verl.core.probes import Probe, build_exit_probes  # noqa: E402
from rredcot_verl.tasks.build import PRESETS  # noqa: E402

RESULTS_PATH = common.RESULTS_DIR / "probe_attention.json"


@dataclasses.dataclass(frozen=True)
class Shape:
    traces: int
    prompt_tokens: int
    response_tokens: int
    segments: int


LONG = Shape(traces=32, prompt_tokens=100, response_tokens=390, segments=8)
SMOKE = Shape(traces=4, prompt_tokens=10, response_tokens=80, segments=8)


def model_of_the_long_build() -> Qwen2ForCausalLM:
    config = PRESETS["long"].model
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings)).eval()


def batch(shape: Shape, vocab: int, probes_of: str, continuations: int, seed: int = 0):
    rng = random.Random(seed)
    ids = lambda n: torch.tensor([rng.randrange(vocab) for _ in range(n)], dtype=torch.long)  # noqa: E731
    prompts = [ids(shape.prompt_tokens) for _ in range(shape.traces)]
    responses = [ids(shape.response_tokens) for _ in range(shape.traces)]
    boundaries = [round(k * shape.response_tokens / shape.segments) for k in range(shape.segments)]
    if probes_of == "exit":
        answers = [[rng.randrange(vocab) for _ in range(3)] for _ in range(continuations)]
        probes = [build_exit_probes(boundaries, [1, 2, 3], answers, thinking_length=shape.response_tokens)
                  for _ in range(shape.traces)]
    else:  # the rest of a trace-long solution from each boundary, plus its answer's few tokens
        probes = [[Probe(b, [], [rng.randrange(vocab) for _ in range(shape.response_tokens - b + 8)], value_index=k)
                   for k, b in enumerate(boundaries) for _ in range(continuations)] for _ in range(shape.traces)]
    return prompts, responses, probes


def cpu_seconds(fn, repeats: int):
    best, result = float("inf"), None
    for _ in range(repeats):
        started = time.process_time()
        result = fn()
        best = min(best, time.process_time() - started)
    return best, result


def measure_row(model, shape: Shape, probes_of: str, continuations: int, repeats: int) -> dict:
    prompts, responses, probes = batch(shape, model.config.vocab_size, probes_of, continuations)
    timed = {}
    for name, share in (("dense", 0.0), ("block_by_block", scoring.BLOCKED_ATTENTION_SHARE)):
        timed[name] = cpu_seconds(lambda: scoring.score_batch_packed(
            model, prompts, responses, probes, max_token_len=1 << 20, blocked_attention_share=share), repeats)
    plain, _ = cpu_seconds(lambda: [trace_log_probs_and_entropy(model, p, r) for p, r in zip(prompts, responses)],
                           repeats)
    dense, blocked = timed["dense"][1], timed["block_by_block"][1]
    difference = max(((b.probe_logp - d.probe_logp).abs() / d.probe_logp.abs().clamp_min(1e-12)).max().item()
                     for b, d in zip(blocked, dense))
    row = scoring._build_row(prompts[0], responses[0], probes[0], None, False)
    return {"probes": probes_of, "continuations_per_boundary": continuations,
            "tree_tokens_per_trace": len(row.tree_ids),
            "attends_block_by_block": scoring._probe_blocks([row], row.tokens.numel(), len(row.tree_ids)) is not None,
            "plain_s": plain, "dense_s": timed["dense"][0], "block_by_block_s": timed["block_by_block"][0],
            "block_by_block_over_dense": timed["block_by_block"][0] / timed["dense"][0],
            "dense_over_plain": timed["dense"][0] / plain, "block_by_block_over_plain": timed["block_by_block"][0] / plain,
            "max_relative_difference": difference}


def main(argv: list[str] | None = None) -> dict:
    cli = common.parser(__doc__, RESULTS_PATH, "4 traces of 80 tokens", build=False)
    cli.add_argument("--repeats", type=int, default=2)
    cli.add_argument("--traces", type=int, default=LONG.traces,
                     help="traces in the batch (default the long step's 32; each is its own row, so the ratios hold)")
    args = cli.parse_args(argv)
    torch.set_num_threads(1)
    shape = SMOKE if args.smoke else dataclasses.replace(LONG, traces=args.traces)
    model = model_of_the_long_build()
    rows = []
    with torch.no_grad():
        for probes_of, continuations in (("references", 1), ("references", 2), ("references", 3), ("exit", 2)):
            rows.append(measure_row(model, shape, probes_of, continuations, 1 if args.smoke else args.repeats))
    print(f"{'probes':<12}{'C':>3}{'tree tokens':>13}{'plain s':>9}{'dense s':>9}{'blocks s':>10}{'blocks/dense':>14}"
          f"{'max rel diff':>14}")
    for row in rows:
        print(f"{row['probes']:<12}{row['continuations_per_boundary']:>3}{row['tree_tokens_per_trace']:>13}"
              f"{row['plain_s']:>9.2f}{row['dense_s']:>9.2f}{row['block_by_block_s']:>10.2f}"
              f"{row['block_by_block_over_dense']:>14.2f}{row['max_relative_difference']:>14.1e}")
    result = {"shape": dataclasses.asdict(shape), "model": "tasks.build.PRESETS['long'].model, random weights",
              "blocked_attention_share": scoring.BLOCKED_ATTENTION_SHARE, "rows": rows,
              "timer": "process CPU seconds, torch.set_num_threads(1), minimum of the repeats",
              "repeats": 1 if args.smoke else args.repeats,
              "command": " ".join(["python -m benchmarks.probe_attention", *(argv if argv is not None else sys.argv[1:])]),
              **common.machine_meta()}
    return common.write_result(result, common.out_path(args, RESULTS_PATH))


if __name__ == "__main__":
    main()
