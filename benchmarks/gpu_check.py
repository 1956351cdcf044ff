"""GPU check of the value pass at Qwen3-4B's shape: bf16 accuracy against an fp32 reference, and cost at 25k tokens.

Written for a GPU machine whose image holds torch and transformers only (no verl, vLLM, ray, rapidfuzz), so it
imports nothing of the package beyond ``rredcot_verl.core.probes`` and ``core.scoring`` (``core.values`` would pull in rapidfuzz through
``core.planning``); the value of a trace is computed as ``core.values.score_plans`` computes it for exit probes:
``score_batch_packed_with_stats`` then ``values_from_probe_logp(..., "self_normalized")``.

Model: ``Qwen3ForCausalLM`` built from a ``Qwen3Config`` with a fixed seed (nothing downloaded), the widths of
``reference_scorers.MODELS`` (default Qwen3-4B: hidden 2560, 32 query / 8 key-value heads of 128, MLP 9728, tied
embeddings, vocabulary 151,936; ``--vocab`` overrides the vocabulary for small runs).

Traces (synthetic, random tokens): a 128-token prompt, an L-token response, exit probes at K boundaries spread over
[0, L] with 3 candidate answers (one correct, two incorrect: self-normalised values), exit text and answers of 4
tokens each (``reference_scorers``' constants).

* accuracy: ``--accuracy-layers`` layers (default 2), three traces of L = n/4, n/2, n (n = min(--tokens, 1024)),
  6 boundaries each. Reference: ``score_probes_naive`` (one forward per probe) and ``trace_log_probs_and_entropy`` on
  the fp32 model configured with ``eager`` attention. Compared with it: the value pass on that same fp32 model (the
  packing alone), then the value pass on the model cast to bf16 and configured with ``sdpa`` and, where flash-attn
  is installed on CUDA, ``flash_attention_2``; for each bf16 backend the naive path too (the bf16 error without
  packing). The value pass swaps the attention backend for its own function (``scoring.VALUE_PASS_ATTENTION``, torch
  sdpa: the probe mask is not a padding mask) whatever the model is configured with, so each case records the
  backends its attention layers actually dispatched to, and whether its value pass is bitwise identical to sdpa's.
* cost: ``--layers`` layers (default 36, Qwen3-4B's depth; halved on CUDA out-of-memory until it fits), bf16, one
  trace of L = --tokens (default 25,000) with 40 boundaries. Passes (``value_pass_scale``'s names where they agree):
  ``value_pass`` (the values of the trace's probes, no trace stats, as ``score_plans`` runs exit probes),
  ``plain`` (the same machinery without probes but with the per-token log-probs and entropies of all L response
  tokens: verl's log-prob pass, fused-kernel style) and ``forward`` (``model(input_ids, logits_to_keep=1)`` under the
  configured backend: the decoder alone, plus one logit row). Wall seconds (median of --repeats after a warm-up,
  CUDA synchronised) and, on CUDA, peak allocated memory (``torch.cuda.max_memory_allocated``, reset before each
  pass) with the resident memory before the pass (weights) and the difference (the pass's own peak).

    python benchmarks/gpu_check.py             # CUDA; writes benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --device cpu --tokens 512 --layers 1 --vocab 4096 --out /tmp/gpu_check.json
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3Config
from transformers.utils import is_flash_attn_2_available

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # ``python benchmarks/gpu_check.py``, also from a checkout where nothing is installed
    sys.path.insert(0, str(ROOT))

from benchmarks.reference_scorers import (  # noqa: E402
    ANSWER_LENGTH,
    EXIT_LENGTH,
    MODELS,
    NUM_BOUNDARIES,
    NUM_CANDIDATES,
    PROMPT_LENGTH,
    score_probes_naive,
    trace_log_probs_and_entropy,
)
from rredcot_verl.core.probes import Probe, build_exit_probes, values_from_probe_logp  # noqa: E402
from rredcot_verl.core.scoring import VALUE_PASS_ATTENTION, score_batch_packed_with_stats  # noqa: E402

RESULTS_PATH = ROOT / "benchmarks" / "results" / "gpu_check.json"
SEED = 0
NORMALIZATION = "self_normalized"
ACCURACY_MAX_TOKENS = 1024
ACCURACY_BOUNDARIES = 6
REFERENCE_ATTENTION = "eager"
BF16_BACKENDS = ("sdpa", "flash_attention_2")
COST_PASSES = ("value_pass", "plain", "forward")
MIB = 1 << 20


@dataclass
class Trace:
    """One synthetic trace: ``probes`` are self-normalised exit probes in ``num_values`` groups (one per boundary)."""

    prompt: torch.Tensor
    response: torch.Tensor
    probes: list[Probe]
    num_values: int


def synthetic_trace(response_len: int, num_boundaries: int, vocab: int, generator: torch.Generator) -> Trace:
    """Random prompt and response, ``num_boundaries`` boundaries spread over [0, L] (both ends included), one exit
    text and ``NUM_CANDIDATES`` answers of which the first is the correct one."""
    draw = lambda n: torch.randint(0, vocab, (n,), generator=generator)  # noqa: E731
    prompt, response = draw(PROMPT_LENGTH), draw(response_len)
    answers = [draw(ANSWER_LENGTH).tolist() for _ in range(NUM_CANDIDATES)]
    boundaries = torch.linspace(0, response_len, num_boundaries).round().long().tolist()
    probes = build_exit_probes(boundaries, draw(EXIT_LENGTH).tolist(), answers[:1], thinking_length=response_len,
                               all_answers=answers)
    return Trace(prompt, response, probes, num_boundaries)


def build_model(model: str, layers: int, vocab: int | None, dtype: torch.dtype, attention: str,
                device: torch.device) -> PreTrainedModel:
    """A randomly initialised Qwen3 of ``reference_scorers.MODELS[model]``'s widths, built on ``device`` in ``dtype``
    (a 36-layer Qwen3-4B is 16 GB in fp32: it is never materialised on the host)."""
    shape = {**MODELS[model], **({"vocab_size": vocab} if vocab else {})}
    config = Qwen3Config(**shape, num_hidden_layers=layers)
    torch.manual_seed(SEED)
    with torch.device(device):
        built = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    return built.eval()


def cast_parameters(model: PreTrainedModel, dtype: torch.dtype) -> None:
    """Cast the parameters only: ``model.to(dtype)`` would also round the rotary inverse frequencies, which a model
    loaded or built in bf16 keeps in fp32, and add that error to the bf16 one."""
    for parameter in model.parameters():  # each tied parameter once, so the tie holds
        parameter.data = parameter.data.to(dtype)


@contextmanager
def dispatched_attention(model: PreTrainedModel) -> Iterator[set[str]]:
    """The attention backends the model's attention layers dispatch to inside the block, read from their config at
    call time (after the value pass's own switch), i.e. what actually ran."""
    seen: set[str] = set()
    record = lambda module, args: seen.add(module.config._attn_implementation)  # noqa: E731
    hooks = [layer.self_attn.register_forward_pre_hook(record) for layer in model.model.layers]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


@dataclass
class Scores:
    """Probe log-probs, values and response log-probs of a list of traces, concatenated over the traces (fp32)."""

    probe_logp: torch.Tensor
    values: torch.Tensor
    trace_logp: torch.Tensor


def naive_scores(model: PreTrainedModel, traces: Sequence[Trace]) -> Scores:
    """One forward per probe and one plain log-prob pass per trace (``benchmarks/reference_scorers.py``)."""
    probe_logp = [score_probes_naive(model, t.prompt, t.response, t.probes) for t in traces]
    trace_logp = [trace_log_probs_and_entropy(model, t.prompt, t.response)[0] for t in traces]
    return _scores(traces, probe_logp, trace_logp)


def value_pass_scores(model: PreTrainedModel, traces: Sequence[Trace]) -> Scores:
    """The value pass over all traces at once, with their response log-probs."""
    scored, _ = score_batch_packed_with_stats(
        model, [t.prompt for t in traces], [t.response for t in traces], [t.probes for t in traces],
        return_trace_stats=True,
    )
    return _scores(traces, [s.probe_logp for s in scored], [s.trace_log_probs for s in scored])


def _scores(traces: Sequence[Trace], probe_logp: Sequence[torch.Tensor], trace_logp: Sequence[torch.Tensor]) -> Scores:
    """Per-trace probe log-probs and response log-probs → ``Scores``, the values computed as ``score_plans`` does."""
    values = [values_from_probe_logp(logp, trace.probes, trace.num_values, NORMALIZATION)
              for trace, logp in zip(traces, probe_logp)]
    return Scores(torch.cat(list(probe_logp)), torch.cat(values), torch.cat(list(trace_logp)))


def differences(scores: Scores, reference: Scores) -> dict[str, float]:
    """Max and median absolute difference of each field against the reference."""
    result = {}
    for field in ("probe_logp", "values", "trace_logp"):
        diff = (getattr(scores, field) - getattr(reference, field)).abs()
        result[f"{field}_max_abs_diff"] = float(diff.max())
        result[f"{field}_median_abs_diff"] = float(diff.median())
    return result


def bf16_backends(device: torch.device) -> tuple[list[str], dict[str, str]]:
    """The bf16 backends to configure here, and why the others are left out."""
    if device.type == "cuda" and is_flash_attn_2_available():
        return list(BF16_BACKENDS), {}
    why = "needs CUDA" if device.type != "cuda" else "transformers finds no usable flash_attn package"
    return ["sdpa"], {"flash_attention_2": why}


def run_accuracy(args: argparse.Namespace, device: torch.device) -> dict:
    """Value pass (fp32, then bf16 per backend) and bf16 naive path against the fp32 eager naive reference."""
    length = min(args.tokens, ACCURACY_MAX_TOKENS)
    generator = torch.Generator().manual_seed(SEED + 1)
    model = build_model(args.model, args.accuracy_layers, args.vocab, torch.float32, REFERENCE_ATTENTION, device)
    traces = [synthetic_trace(max(1, length // d), ACCURACY_BOUNDARIES, model.config.vocab_size, generator)
              for d in (4, 2, 1)]
    with dispatched_attention(model) as reference_ran:
        reference = naive_scores(model, traces)
    cases = []
    with dispatched_attention(model) as ran:
        fp32 = value_pass_scores(model, traces)
    cases.append({"case": f"float32/{REFERENCE_ATTENTION}", "dtype": "float32", "configured": REFERENCE_ATTENTION,
                  "value_pass_ran": sorted(ran), **differences(fp32, reference)})

    cast_parameters(model, torch.bfloat16)  # the reference's weights, rounded
    backends, skipped = bf16_backends(device)  # sdpa first
    sdpa_probe_logp = None
    for backend in backends:
        model.set_attn_implementation(backend)
        with dispatched_attention(model) as ran:
            packed = value_pass_scores(model, traces)
        with dispatched_attention(model) as naive_ran:
            naive = naive_scores(model, traces)
        case = {"case": f"bfloat16/{backend}", "dtype": "bfloat16", "configured": backend,
                "value_pass_ran": sorted(ran)}
        if backend == "sdpa":
            sdpa_probe_logp = packed.probe_logp
        else:  # the value pass should not depend on the configured backend at all
            case["value_pass_identical_to_sdpa"] = bool(torch.equal(packed.probe_logp, sdpa_probe_logp))
        cases.append({**case, **differences(packed, reference), "naive_ran": sorted(naive_ran),
                      **{f"naive_{key}": value for key, value in differences(naive, reference).items()}})
    return {
        "layers": args.accuracy_layers, "response_lengths": [t.response.numel() for t in traces],
        "boundaries_per_trace": ACCURACY_BOUNDARIES, "probes": sum(len(t.probes) for t in traces),
        "values": sum(t.num_values for t in traces), "reference_ran": sorted(reference_ran),
        "reference_probe_logp_median": float(reference.probe_logp.median()),
        "reference_values_median": float(reference.values.median()),
        "cases": cases, "skipped": skipped,
    }


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels, so that wall time covers them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_pass(run: Callable[[], object], model: PreTrainedModel, device: torch.device, repeats: int) -> dict:
    """Median wall seconds of ``repeats`` runs after a warm-up (which records the attention dispatched) and, on
    CUDA, their peak allocated memory next to the memory resident before them."""
    with dispatched_attention(model) as ran:
        run()
    _synchronize(device)
    resident = peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device) / MIB
    seconds = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        run()
        _synchronize(device)
        seconds.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / MIB
    return {"seconds": statistics.median(seconds), "peak_mib": peak, "resident_mib": resident,
            "pass_peak_mib": None if peak is None else peak - resident, "ran": sorted(ran)}


def measure_cost(args: argparse.Namespace, layers: int, device: torch.device) -> list[dict]:
    """One row per configured backend: the three passes over one trace of ``args.tokens`` response tokens."""
    model = build_model(args.model, layers, args.vocab, torch.bfloat16, "sdpa", device)
    trace = synthetic_trace(args.tokens, NUM_BOUNDARIES, model.config.vocab_size, torch.Generator().manual_seed(SEED))
    input_ids = torch.cat([trace.prompt, trace.response])[None].to(device)

    def value_pass() -> torch.Tensor:
        """What ``score_plans`` runs for this trace's exit probes: probe log-probs only, then the values."""
        (scores,), _ = score_batch_packed_with_stats(model, [trace.prompt], [trace.response], [trace.probes],
                                                     return_trace_stats=False)
        return values_from_probe_logp(scores.probe_logp, trace.probes, trace.num_values, NORMALIZATION)

    passes = {
        "value_pass": value_pass,
        "plain": lambda: score_batch_packed_with_stats(model, [trace.prompt], [trace.response], [[]],
                                                       return_trace_stats=True),
        "forward": lambda: model(input_ids=input_ids, use_cache=False, logits_to_keep=1),
    }
    rows = []
    for backend in bf16_backends(device)[0]:
        model.set_attn_implementation(backend)
        measured = {name: measure_pass(run, model, device, args.repeats) for name, run in passes.items()}
        row = {"configured": backend, "layers": layers, "probes": len(trace.probes), **{
            f"{name}_{key}": value for name, result in measured.items() for key, value in result.items()}}
        for baseline in ("plain", "forward"):
            row[f"time_over_{baseline}"] = measured["value_pass"]["seconds"] / measured[baseline]["seconds"]
            for key in ("peak_mib", "pass_peak_mib"):
                value, base = measured["value_pass"][key], measured[baseline][key]
                row[f"{key.removesuffix('_mib')}_over_{baseline}"] = None if value is None else value / base
        rows.append(row)
    return rows


def run_cost(args: argparse.Namespace, device: torch.device) -> dict:
    """``measure_cost`` at ``args.layers`` layers, halving the depth on CUDA out-of-memory until it fits."""
    layers, out_of_memory = args.layers, []
    while True:
        try:
            rows = measure_cost(args, layers, device)
            break
        except torch.cuda.OutOfMemoryError:
            out_of_memory.append(layers)
        # Outside the handler: its traceback (and with it the model) is released by now.
        gc.collect()
        torch.cuda.empty_cache()
        if layers == 1:
            rows = []
            break
        layers = max(1, layers // 2)
    return {
        "layers_requested": args.layers, "layers": layers if rows else None, "out_of_memory_at_layers": out_of_memory,
        "prompt_tokens": PROMPT_LENGTH, "response_tokens": args.tokens, "boundaries": NUM_BOUNDARIES,
        "candidates": NUM_CANDIDATES, "dtype": "bfloat16", "repeats": args.repeats, "rows": rows,
    }


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's architecture and torch's thread count (the timings depend on both)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def flash_attn_version() -> str | None:
    """The installed flash-attn's version, None without it: the flash_attention_2 rows depend on it."""
    try:
        return importlib.metadata.version("flash_attn")
    except importlib.metadata.PackageNotFoundError:
        return None


def _ratio(value: float | None) -> str:
    """A ratio for the table, '-' where it is not measured (memory on CPU)."""
    return "-" if value is None else f"{value:.3f}"


def print_tables(result: dict) -> None:
    """The accuracy differences and the cost of each pass, as written to the JSON."""
    accuracy = result["accuracy"]
    print(f"\naccuracy against fp32 {REFERENCE_ATTENTION} naive ({accuracy['layers']} layers, "
          f"{accuracy['probes']} probes, {accuracy['values']} values)")
    print(f"{'case':<28}{'ran':<28}{'logp max':>10}{'logp med':>10}{'value max':>10}{'value med':>10}"
          f"{'trace max':>10}")
    columns = ("probe_logp_max", "probe_logp_median", "values_max", "values_median", "trace_logp_max")
    for case in accuracy["cases"]:
        paths = [("value pass", "value_pass_", "")] + ([("naive", "naive_", "naive_")] if "naive_ran" in case else [])
        for label, ran, prefix in paths:
            diffs = "".join(f"{case[f'{prefix}{column}_abs_diff']:>10.2e}" for column in columns)
            print(f"{case['case'] + ' ' + label:<28}{','.join(case[ran + 'ran']):<28}{diffs}")
    for backend, why in accuracy["skipped"].items():
        print(f"bfloat16/{backend}: not run ({why})")
    cost = result["cost"]
    print(f"\ncost: {cost['response_tokens']} response tokens, {cost['boundaries']} boundaries x "
          f"{cost['candidates']} candidates, {cost['layers']} layers (asked {cost['layers_requested']}, "
          f"out of memory at {cost['out_of_memory_at_layers'] or 'none'})")
    print(f"{'configured':<20}{'pass':<12}{'ran':<28}{'seconds':>9}{'peak MiB':>10}{'pass MiB':>10}")
    for row in cost["rows"]:
        for name in COST_PASSES:
            peak, own = row[f"{name}_peak_mib"], row[f"{name}_pass_peak_mib"]
            print(f"{row['configured']:<20}{name:<12}{','.join(row[f'{name}_ran']):<28}{row[f'{name}_seconds']:>9.3f}"
                  f"{'-' if peak is None else f'{peak:.0f}':>10}{'-' if own is None else f'{own:.0f}':>10}")
        ratios = [f"{key} / {baseline} {_ratio(row[f'{key}_over_{baseline}'])}"
                  for baseline in ("plain", "forward") for key in ("time", "peak")]
        print(f"{'':<20}value_pass: {', '.join(ratios)}")


def main(argv: list[str] | None = None) -> dict:
    """Run both checks, print the tables, write the JSON; returns the result with ``out``, the path written."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="torch device (cpu for a small run)")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-4b", help="widths (reference_scorers.MODELS)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the model's)")
    parser.add_argument("--layers", type=int, default=36, help="cost model's layers, halved on out-of-memory")
    parser.add_argument("--accuracy-layers", type=int, default=2, help="accuracy model's layers")
    parser.add_argument("--tokens", type=int, default=25_000, help="cost trace's response tokens")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per pass (median), after a warm-up")
    parser.add_argument("--out", type=Path, default=RESULTS_PATH,
                        help="JSON path (default benchmarks/results/gpu_check.json)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_float32_matmul_precision("highest")  # the fp32 reference in full fp32 (no TF32) on CUDA

    accuracy = run_accuracy(args, device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    cost = run_cost(args, device)
    shape = {**MODELS[args.model], **({"vocab_size": args.vocab} if args.vocab else {})}
    result = {
        "meta": {
            "script": "benchmarks/gpu_check.py", "device": device_name(device), "model": args.model,
            "model_shape": shape, "seed": SEED, "normalization": NORMALIZATION,
            "value_pass_attention": f"{VALUE_PASS_ATTENTION} (torch sdpa, set by the value pass whatever the model "
                                    "is configured with)",
            "reference": f"float32 {REFERENCE_ATTENTION}: score_probes_naive and trace_log_probs_and_entropy",
            "cost_passes": {
                "value_pass": "score_batch_packed_with_stats with the trace's exit probes, no trace stats, then "
                              "values_from_probe_logp",
                "plain": "score_batch_packed_with_stats without probes, log-prob and entropy of every response token",
                "forward": "model(input_ids, use_cache=False, logits_to_keep=1) under the configured backend",
            },
            "memory": "torch.cuda.max_memory_allocated over the timed runs (reset before them); resident_mib: "
                      "allocated before them; pass_peak_mib: the difference" if device.type == "cuda" else None,
            "torch": torch.__version__, "transformers": transformers.__version__, "flash_attn": flash_attn_version(),
            "python": platform.python_version(),
        },
        "accuracy": accuracy,
        "cost": cost,
    }
    print_tables(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return {**result, "out": str(args.out)}


if __name__ == "__main__":
    main()
