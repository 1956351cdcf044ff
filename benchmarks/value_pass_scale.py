"""Time and peak memory of the actor's value pass at long lengths, relative to a plain no-grad pass over the same trace.

Model: randomly initialised, Qwen3-0.6B's shape (hidden 1024, MLP 3072, 16 query / 8 key-value heads of 128, tied
embeddings) and real vocabulary (151,936), built from a ``Qwen3Config`` (nothing downloaded), fp32 on CPU. Its number
of layers is ``--layers`` (default 4 instead of 28: on two shared CPU cores an 8k-token pass of the full depth takes
minutes); with fewer layers the output projection, which only "plain" runs over every position, weighs more, so
``time_over_bare_forward`` is reported as well.

One trace per row: a 128-token prompt and an L-token response, 40 boundaries spread over [0, L], 3 candidate answers
(one correct, two incorrect: self-normalised exit probes), an exit text of 4 tokens and answers of 4 tokens.

* value pass: ``core.values.score_plans`` on that trace's plan (one forward of trace + probe tokens, log-probs only
  where probes read them), i.e. exactly what the actor worker runs;
* plain: the log-prob pass verl runs on the same trace: one no-grad forward over prompt + response giving the
  per-token log-prob AND entropy of all L response tokens. It is computed from the final hidden states in bounded
  row chunks (as verl's fused-kernel path does; a full L × 151,936 fp32 logits tensor would alone take 4.6 GiB at
  8k), with ``score_batch_packed(..., probes=[[]], return_trace_stats=True)``;
* bare forward: the decoder alone (``model.model``), final hidden states, no output projection.

Each measurement runs in a fresh subprocess: build the model, reset the peak-RSS mark (``/proc/self/clear_refs``),
run the pass once, report process CPU seconds (``time.process_time``, one thread: the cores are shared) and the
process's peak resident memory during the pass (``VmHWM``: model weights and interpreter included, as they stay
resident; the resident size before the pass is reported too). Linux only.

    python benchmarks/value_pass_scale.py            # writes benchmarks/results/value_pass_scale.json
    python benchmarks/value_pass_scale.py --smoke    # tiny model and lengths, seconds; writes to a temp file (or --out)
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # ``python benchmarks/value_pass_scale.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import reference_scorers as shapes  # noqa: E402  (torch and the core only: measurements stay light)

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "value_pass_scale.json"
PASSES = ("plain", "value_pass", "bare_forward")
GOALS = {"time_over_plain": 1.3, "peak_memory_over_plain": 1.25}  # at L >= 4096; reported, not asserted
# Qwen3-4B (36 layers) was measured with --layers 1 at 25k tokens: under no_grad the activation peak is one layer's,
# so the full model's peak is this one plus the other layers' weights (--append adds the row).


def measure(spec: dict) -> dict:
    """Run one pass in this process (a fresh one per measurement) and return its CPU seconds and peak RSS."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rredcot_verl.core.planning import TracePlan
    from rredcot_verl.core.probes import build_exit_probes
    from rredcot_verl.core.scoring import score_batch_packed
    from rredcot_verl.core.values import score_plans

    torch.set_num_threads(1)
    torch.manual_seed(0)
    length = spec["length"]
    config = Qwen3Config(
        **shapes.MODELS[spec["model"]], num_hidden_layers=spec["layers"],
        max_position_embeddings=shapes.PROMPT_LENGTH + length + 64,
        attn_implementation="sdpa",
    )
    model = Qwen3ForCausalLM(config).eval()
    vocab = config.vocab_size
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (shapes.PROMPT_LENGTH,), generator=generator)
    response = torch.randint(0, vocab, (length,), generator=generator)
    draw = lambda n: torch.randint(0, vocab, (n,), generator=generator).tolist()  # noqa: E731
    answers = [draw(shapes.ANSWER_LENGTH) for _ in range(shapes.NUM_CANDIDATES)]
    ends = torch.linspace(0, length, shapes.NUM_BOUNDARIES + 1).round().long().tolist()[1:]
    plan = TracePlan(prompt, response, 1.0, ends, value_rule="self_normalized")
    plan.probes = build_exit_probes(plan.starts, draw(shapes.EXIT_LENGTH), answers[:1], thinking_length=length,
                                    all_answers=answers)
    passes = {
        "value_pass": lambda: score_plans(model, [plan], max_segments=shapes.NUM_BOUNDARIES),
        "plain": lambda: score_batch_packed(model, [prompt], [response], [[]], return_trace_stats=True),
        "bare_forward": lambda: model.model(input_ids=torch.cat([prompt, response])[None], use_cache=False),
    }
    # Building the model peaks above some passes: reset the kernel's high-water mark (VmHWM) before the pass, so
    # that the peak read afterwards is the pass's (weights and interpreter included, as they stay resident).
    Path("/proc/self/clear_refs").write_text("5")
    resident_mib = _status_mib("VmRSS")
    with torch.no_grad():
        start = time.process_time()
        passes[spec["pass"]]()
        seconds = time.process_time() - start
    return {"cpu_s": seconds, "peak_mib": _status_mib("VmHWM"), "resident_before_mib": resident_mib,
            "probes": len(plan.probes)}


def _status_mib(field: str) -> float:
    """A memory field of /proc/self/status (kB) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def run_measurement(spec: dict) -> dict:
    result = subprocess.run(
        [sys.executable, __file__, "--measure", json.dumps(spec)], capture_output=True, text=True, check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"measurement {spec} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


HEADER = (f"{'model':<12}{'layers':>7}{'L':>7}{'K':>4}{'|C|':>4}{'plain s':>9}{'value s':>9}{'bare s':>9}"
          f"{'t/plain':>8}{'t/bare':>8}{'plain MiB':>10}{'value MiB':>10}{'m/plain':>8}")


def format_row(row: dict) -> str:
    return (f"{row['model']:<12}{row['layers']:>7}{row['length']:>7}{row['boundaries']:>4}{row['candidates']:>4}"
            f"{row['plain_cpu_s']:>9.2f}{row['value_pass_cpu_s']:>9.2f}{row['bare_forward_cpu_s']:>9.2f}"
            f"{row['time_over_plain']:>8.3f}{row['time_over_bare_forward']:>8.3f}{row['plain_peak_mib']:>10.0f}"
            f"{row['value_pass_peak_mib']:>10.0f}{row['peak_memory_over_plain']:>8.3f}")


def main(argv: list[str] | None = None) -> dict:
    import argparse

    from benchmarks import common  # here, not at the top: the measuring subprocesses stay light

    parser = common.parser(__doc__, RESULTS_PATH, "tiny model and lengths; writes to --out or a temp file", build=False)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192], help="response lengths L")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (Qwen3-0.6B has 28, Qwen3-4B 36)")
    parser.add_argument("--model", choices=[m for m in shapes.MODELS if m != "smoke"], default="qwen3-0.6b")
    parser.add_argument("--append", action="store_true", help="add the rows to the existing JSON instead of replacing")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # internal: one measurement, JSON spec
    args = parser.parse_args(argv)
    if args.measure is not None:
        print(json.dumps(measure(json.loads(args.measure))))
        return {}

    model, layers, lengths = ("smoke", 2, [96]) if args.smoke else (args.model, args.layers, args.lengths)
    out = common.out_path(args, RESULTS_PATH)
    print(HEADER, flush=True)
    rows = []
    for length in lengths:
        spec = {"model": model, "layers": layers, "length": length}
        measured = {name: run_measurement({**spec, "pass": name}) for name in PASSES}
        row = {
            "model": f"{model} ({layers} layers)", "device": f"cpu ({platform.machine()}, 1 thread)",
            "length": length, "boundaries": shapes.NUM_BOUNDARIES, "candidates": shapes.NUM_CANDIDATES,
            "time_over_plain": measured["value_pass"]["cpu_s"] / measured["plain"]["cpu_s"],
            "peak_memory_over_plain": measured["value_pass"]["peak_mib"] / measured["plain"]["peak_mib"],
            "time_over_bare_forward": measured["value_pass"]["cpu_s"] / measured["bare_forward"]["cpu_s"],
            "peak_memory_over_bare_forward": measured["value_pass"]["peak_mib"] / measured["bare_forward"]["peak_mib"],
            "probes": measured["value_pass"]["probes"], "layers": layers, "model_shape": shapes.MODELS[model],
        }
        for name in PASSES:
            row[f"{name}_cpu_s"], row[f"{name}_peak_mib"] = measured[name]["cpu_s"], measured[name]["peak_mib"]
            row[f"{name}_resident_before_mib"] = measured[name]["resident_before_mib"]
        rows.append(row)
        print(format_row(row), flush=True)

    result = {
        "meta": {
            "value_pass": "core.values.score_plans on one trace's plan (self-normalised exit probes)",
            "plain": "one no-grad forward over prompt + response, per-token log-prob and entropy of all L response "
                     "tokens from the final hidden states in row chunks (verl's log-prob pass, fused-kernel style)",
            "bare_forward": "model.model: final hidden states only, no output projection",
            "timer": "process CPU seconds of one pass, torch.set_num_threads(1), fresh subprocess per measurement",
            "memory": "peak RSS (VmHWM, reset after the model is built) of that subprocess during the pass: model "
                      "weights + interpreter + the pass; *_resident_before_mib is the RSS before the pass",
            "model_shape": {**shapes.MODELS[model], "num_hidden_layers": layers,
                            "note": "Qwen3-0.6B has 28 layers; fewer here for CPU time, width and vocab are real"
                            if model != "smoke" else "smoke"},
            "prompt_length": shapes.PROMPT_LENGTH, "exit_length": shapes.EXIT_LENGTH,
            "answer_length": shapes.ANSWER_LENGTH,
            "goals_at_L_ge_4096": GOALS, **common.machine_meta(),
        },
        "rows": rows,
    }
    if args.append and out.is_file():
        previous = json.loads(out.read_text())
        result = {"meta": previous["meta"], "rows": previous["rows"] + rows}
    return common.write_result(result, out)


if __name__ == "__main__":
    main()
