"""The value pass's cost, one script, three modes; each writes its own JSON (protocols and tables: RESULTS.md §2, §5, §7).

* ``values`` (results/cost.json): traces sampled from the tiny warm start, segmented as the tiny_cpu recipe does, and
  every method valuing the same states: ``score_probes_packed`` (packed), ``score_probes_naive`` (one forward a
  probe), ``compute_segment_values`` with the recipe's reference continuations (recipe_values, wall seconds only)
  and ``--mc-samples`` continuations a state (``segment_mc``'s estimate). Wall seconds (one thread, medians over
  ``--repeats``, MC once) and model tokens: packed Σ(P + L + Σ|probe|), naive Σ(P + b + |probe|), MC Σ N·(P + b) +
  the sampled continuations. With ``--train-steps`` N > 0 also N training steps of grpo, rredcot, segment_mc and
  ibpo (``recipes/tiny_cpu/run.sh``, or the runs in ``--runs-dir``): median step time and its ratio to GRPO's.
* ``scale`` (results/value_pass_scale.json): ``core.values.score_plans`` on one trace of a Qwen3-shaped model
  (``--layers`` of its depth, real width and vocabulary) at long lengths, over the plain log-prob pass and the bare
  decoder; each measurement in a fresh subprocess: CPU seconds and peak RSS (VmHWM reset after the model is built;
  Linux). Qwen3-4B was measured with ``--layers 1`` (under no_grad the activation peak is one layer's).
* ``gpu`` (results/gpu_check.json): accuracy of the bf16 value pass (sdpa, and flash_attention_2 where installed)
  and of the fp32 packing against an fp32 ``eager`` one-forward-a-probe reference on ``--accuracy-layers`` layers;
  cost of the value pass, the plain pass and a bare forward at ``--tokens`` tokens on ``--layers`` layers (halved on
  CUDA out-of-memory), wall seconds and CUDA peak memory. Imports torch, transformers and the package's core scoring
  only: the GPU image has nothing else.

Synthetic traces: a 128-token prompt, K boundaries spread over [0, L], 3 candidate answers (one correct: self-normalised
exit probes), exit text and answers of 4 tokens (``reference_scorers``' constants).

    python -m benchmarks.value_pass values --train-steps 10   # cost.json (about 25 min)
    python -m benchmarks.value_pass scale                      # value_pass_scale.json: Qwen3-0.6B, 4 layers, 2k-8k
    python -m benchmarks.value_pass scale --model qwen3-4b --layers 1 --lengths 25000 --append
    python benchmarks/value_pass.py gpu                        # CUDA, gpu_check.json; --tokens 8000 --out ... too
    python -m benchmarks.value_pass MODE --smoke               # values, scale: seconds, a temp file
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import json
import platform
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, Qwen3Config
from transformers.utils import is_flash_attn_2_available

if __package__ in (None, ""):  # ``python benchmarks/value_pass.py``, also from a checkout where nothing is installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import output  # noqa: E402
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
from rredcot_verl.core.scoring import (  # noqa: E402
    VALUE_PASS_ATTENTION,
    score_batch_packed_with_stats,
    score_probes_packed,
)

RESULTS = {mode: output.RESULTS_DIR / name for mode, name in (
    ("values", "cost.json"), ("scale", "value_pass_scale.json"), ("gpu", "gpu_check.json"))}
NORMALIZATION = "self_normalized"
MIB = 1 << 20


@dataclasses.dataclass
class Trace:
    """One synthetic trace: ``probes`` are exit probes in ``num_values`` groups (one per boundary)."""

    prompt: torch.Tensor
    response: torch.Tensor
    probes: list[Probe]
    num_values: int


def synthetic_trace(length: int, boundaries: list[int], vocab: int, generator: torch.Generator) -> Trace:
    """Random prompt and response of ``length`` tokens, one exit text and ``NUM_CANDIDATES`` answers (the first the
    correct one) scored at each of ``boundaries``."""
    draw = lambda n: torch.randint(0, vocab, (n,), generator=generator)  # noqa: E731
    prompt, response = draw(PROMPT_LENGTH), draw(length)
    answers = [draw(ANSWER_LENGTH).tolist() for _ in range(NUM_CANDIDATES)]
    probes = build_exit_probes(boundaries, draw(EXIT_LENGTH).tolist(), answers[:1], thinking_length=length,
                               all_answers=answers)
    return Trace(prompt, response, probes, len(boundaries))


def spread(length: int, count: int) -> list[int]:
    """``count`` boundaries spread evenly over [0, ``length``], both ends included."""
    return torch.linspace(0, length, count).round().long().tolist()


# --------------------------------------------------------------------------------------------------------- values
def probe_batch(model, tokenizer, traces):
    """Per sampled trace: (boundaries S_0..S_{K-1}, exit probes for the ground truth and the group's other boxed
    answers, entropy (L,))."""
    from benchmarks import common
    from rredcot_verl.core.segmentation import BoundaryVocab, segment_response
    from rredcot_verl.tasks import extract_boxed_answer

    vocab = BoundaryVocab.from_tokenizer(tokenizer, common.RECIPE_SEGMENTATION, think_end="</think>")
    exit_ids = tokenizer.encode(common.EXIT_TEXT, add_special_tokens=False)
    answer = lambda text: tokenizer.encode("{" + text + "}", add_special_tokens=False) + [tokenizer.eos_token_id]  # noqa: E731
    group_answers: dict[int, set[str]] = {}
    for trace in traces:
        found = extract_boxed_answer(trace.text)
        group_answers.setdefault(trace.group, set()).update({trace.ground_truth} | ({found} if found else set()))
    batch = []
    for trace in traces:
        _, entropy = trace_log_probs_and_entropy(model, trace.prompt_ids, trace.response_ids)
        ends = segment_response(trace.response_ids, entropy, vocab, common.RECIPE_SEGMENTATION)
        boundaries = [0, *ends[:-1]]
        probes = build_exit_probes(boundaries, exit_ids, [answer(trace.ground_truth)],
                                   thinking_length=common.thinking_length(tokenizer, trace.response_ids.tolist()),
                                   all_answers=[answer(a) for a in sorted(group_answers[trace.group])])
        batch.append((boundaries, probes, entropy))
    return batch


def measure_values(model, tokenizer, traces, mc_samples: int, repeats: int) -> dict:
    from benchmarks import common
    from rredcot_verl.core.values import compute_segment_values
    from rredcot_verl.tasks.base import ARITHMETIC

    batch = probe_batch(model, tokenizer, traces)

    def timed(fn):
        started = time.perf_counter()
        result = fn()
        return time.perf_counter() - started, result

    run_packed = lambda: [score_probes_packed(model, t.prompt_ids, t.response_ids, probes, return_trace_stats=False)  # noqa: E731
                          for t, (_, probes, _) in zip(traces, batch)]
    run_naive = lambda: [score_probes_naive(model, t.prompt_ids, t.response_ids, probes)  # noqa: E731
                         for t, (_, probes, _) in zip(traces, batch)]
    run_packed()  # warm-up: the first forward pays one-off allocations
    packed_times, naive_times = [], []
    for _ in range(repeats):
        seconds, packed = timed(run_packed)
        packed_times.append(seconds)
        seconds, naive = timed(run_naive)
        naive_times.append(seconds)
    max_error = max([float((p.probe_logp - n).abs().max()) for p, n in zip(packed, naive) if n.numel()], default=0.0)
    # What a training step of the tiny_cpu recipe runs on the actor: reference-continuation probes, packed.
    records = [t.record(entropy) for t, (_, _, entropy) in zip(traces, batch)]
    settings = common.embedded_settings("reference_continuation")
    recipe_seconds = statistics.median(
        timed(lambda: compute_segment_values(model, tokenizer, records, settings, task=ARITHMETIC))[0]
        for _ in range(repeats))
    ends = [[*boundaries[1:], t.response_ids.numel()] for t, (boundaries, _, _) in zip(traces, batch)]
    mc_seconds, (_, mc_generated) = timed(lambda: common.continuation_success_rates(
        model, tokenizer, traces, ends, num_samples=mc_samples))
    flat = [(t, b) for t, (boundaries, _, _) in zip(traces, batch) for b in boundaries]
    mc = f"mc_k{mc_samples}"
    rows = {
        "packed": {"seconds": statistics.median(packed_times), "tokens": sum(
            t.prompt_ids.numel() + t.response_ids.numel() + sum(len(p.tokens) for p in probes)
            for t, (_, probes, _) in zip(traces, batch))},
        "naive": {"seconds": statistics.median(naive_times), "tokens": sum(
            t.prompt_ids.numel() + p.boundary + len(p.tokens) for t, (_, probes, _) in zip(traces, batch)
            for p in probes)},
        mc: {"seconds": mc_seconds,
             "tokens": sum(mc_samples * (t.prompt_ids.numel() + b) for t, b in flat) + mc_generated},
        "recipe_values": {"seconds": recipe_seconds, "tokens": None},
    }
    for row in rows.values():
        row["seconds_over_packed"] = row["seconds"] / rows["packed"]["seconds"]
        row["tokens_over_packed"] = row["tokens"] / rows["packed"]["tokens"] if row["tokens"] else None
    rows[mc]["seconds_over_recipe_values"] = mc_seconds / recipe_seconds
    return {"traces": len(traces), "states": len(flat), "probes": sum(len(p) for _, p, _ in batch), "methods": rows,
            "max_abs_logp_diff_packed_vs_naive": max_error, "mc_samples": mc_samples, "repeats": repeats}


def measure_training(runs_dir: Path, steps: int, seed: int, build: Path, launch: bool) -> dict:
    """One run of each of grpo, rredcot, segment_mc and ibpo (launched, or read): step time and its phases."""
    from benchmarks import common

    def row(out: Path) -> dict:
        rows = common.load_metrics(out / "metrics.jsonl")
        return {**common.step_cost(rows), "phase_median_s": common.phase_medians(rows), "run": str(out)}

    runs = {method: (common.METHODS[method], runs_dir / f"{method}_seed{seed}")
            for method in ("grpo", "rredcot", "segment_mc", "ibpo")}
    return common.cost_runs(runs, steps, seed, build, row, launch=launch, resume=False)  # one sitting with the values


def run_values(args) -> dict:
    from benchmarks import common
    from rredcot_verl.tasks import load_model_dir

    if args.smoke:
        args.prompts, args.samples_per_prompt, args.repeats, args.train_steps = 1, 2, 1, 0
    common.build_task(args.build)
    torch.set_num_threads(1)
    model, tokenizer = load_model_dir(str(args.build / "model"))
    model.eval()
    problems = common.load_problems(args.build / "data" / "val.parquet", args.prompts)
    traces = common.sample_traces(model, tokenizer, problems, args.samples_per_prompt, args.seed)
    result = {"values": measure_values(model, tokenizer, traces, args.mc_samples, args.repeats)}
    if args.train_steps > 0 or args.runs_dir is not None:
        result["training"] = measure_training(args.runs_dir or common.ROOT / "outputs" / "benchmarks" / "cost",
                                              args.train_steps, args.seed, args.build, launch=args.runs_dir is None)
    result["meta"] = {"prompts": args.prompts, "samples_per_prompt": args.samples_per_prompt,
                      "segmentation": dataclasses.asdict(common.RECIPE_SEGMENTATION), "exit_text": common.EXIT_TEXT,
                      "train_steps": args.train_steps, "runs_dir": str(args.runs_dir) if args.runs_dir else None,
                      "timer": "wall seconds (perf_counter), torch.set_num_threads(1); medians over repeats, MC once",
                      **output.machine_meta()}
    values = result["values"]
    print(f"value estimation: {values['traces']} traces, {values['states']} states, {values['probes']} probes; "
          f"max |logp packed - naive| {values['max_abs_logp_diff_packed_vs_naive']:.1e}")
    output.print_table([{"method": name, **row} for name, row in values["methods"].items()], {
        "method": "", "seconds": ".3f", "tokens": "d", "seconds_over_packed": ".1f", "tokens_over_packed": ".1f"})
    if result.get("training"):
        output.print_table([{"method": name, **row} for name, row in result["training"].items()], {
            "method": "", "median_step_s": ".2f", "over_grpo": ".2f", "steps_used": "d", "error": ""})
    return result


# ---------------------------------------------------------------------------------------------------------- scale
SCALE_PASSES = ("plain", "value_pass", "bare_forward")
SCALE_GOALS = {"time_over_plain": 1.3, "peak_memory_over_plain": 1.25}  # at L >= 4096; reported, not asserted


def status_mib(field: str) -> float:
    """A memory field of /proc/self/status (kB) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure_scale(spec: dict) -> dict:
    """One pass in this process (a fresh one a measurement): its CPU seconds and peak RSS."""
    from transformers import Qwen3ForCausalLM

    from rredcot_verl.core.traces import TraceRecord
    from rredcot_verl.core.values import score_plans

    torch.set_num_threads(1)
    torch.manual_seed(0)
    length = spec["length"]
    model = Qwen3ForCausalLM(Qwen3Config(**MODELS[spec["model"]], num_hidden_layers=spec["layers"],
                                         max_position_embeddings=PROMPT_LENGTH + length + 64,
                                         attn_implementation="sdpa")).eval()
    ends = torch.linspace(0, length, NUM_BOUNDARIES + 1).round().long().tolist()[1:]
    trace = synthetic_trace(length, [0, *ends[:-1]], model.config.vocab_size, torch.Generator().manual_seed(1))
    plan = TraceRecord(trace.prompt, trace.response, None, 1.0, "g", segment_ends=ends, probes=trace.probes,
                       value_rule=NORMALIZATION)
    passes = {
        "value_pass": lambda: score_plans(model, [plan], max_segments=NUM_BOUNDARIES),
        "plain": lambda: score_batch_packed_with_stats(model, [trace.prompt], [trace.response], [[]],
                                                       return_trace_stats=True),
        "bare_forward": lambda: model.model(input_ids=torch.cat([trace.prompt, trace.response])[None],
                                            use_cache=False),
    }
    # Building the model peaks above some passes: the high-water mark is reset before the pass, so the peak read
    # afterwards is the pass's (weights and interpreter included, as they stay resident).
    Path("/proc/self/clear_refs").write_text("5")
    resident_mib = status_mib("VmRSS")
    with torch.no_grad():
        seconds, _ = output.cpu_seconds(passes[spec["pass"]])
    return {"cpu_s": seconds, "peak_mib": status_mib("VmHWM"), "resident_before_mib": resident_mib,
            "probes": len(plan.probes)}


def measure_in_subprocess(spec: dict) -> dict:
    run = subprocess.run([sys.executable, __file__, "scale", "--measure", json.dumps(spec)], capture_output=True,
                         text=True, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"measurement {spec} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def run_scale(args) -> dict | None:
    if args.measure is not None:
        print(json.dumps(measure_scale(json.loads(args.measure))))
        return None
    model, layers, lengths = ("smoke", 2, [96]) if args.smoke else (args.model, args.layers, args.lengths)
    rows = []
    for length in lengths:
        measured = {name: measure_in_subprocess({"model": model, "layers": layers, "length": length, "pass": name})
                    for name in SCALE_PASSES}
        value, plain, bare = (measured[name] for name in ("value_pass", "plain", "bare_forward"))
        row = {"model": f"{model} ({layers} layers)", "device": f"cpu ({platform.machine()}, 1 thread)",
               "length": length, "boundaries": NUM_BOUNDARIES, "candidates": NUM_CANDIDATES,
               "time_over_plain": value["cpu_s"] / plain["cpu_s"],
               "peak_memory_over_plain": value["peak_mib"] / plain["peak_mib"],
               "time_over_bare_forward": value["cpu_s"] / bare["cpu_s"],
               "peak_memory_over_bare_forward": value["peak_mib"] / bare["peak_mib"],
               "probes": value["probes"], "layers": layers, "model_shape": MODELS[model]}
        for name in SCALE_PASSES:
            row |= {f"{name}_cpu_s": measured[name]["cpu_s"], f"{name}_peak_mib": measured[name]["peak_mib"],
                    f"{name}_resident_before_mib": measured[name]["resident_before_mib"]}
        rows.append(row)
    output.print_table(rows, {"model": "", "length": "d", "plain_cpu_s": ".2f", "value_pass_cpu_s": ".2f",
                              "bare_forward_cpu_s": ".2f", "time_over_plain": ".3f", "time_over_bare_forward": ".3f",
                              "plain_peak_mib": ".0f", "value_pass_peak_mib": ".0f", "peak_memory_over_plain": ".3f"})
    out = output.out_path(args, RESULTS["scale"])
    if args.append and out.is_file():
        previous = json.loads(out.read_text())
        return {"meta": previous["meta"], "rows": previous["rows"] + rows}
    return {
        "meta": {
            "value_pass": "core.values.score_plans on one trace's plan (self-normalised exit probes)",
            "plain": "one no-grad forward over prompt + response, per-token log-prob and entropy of all L response "
                     "tokens from the final hidden states in row chunks (verl's log-prob pass, fused-kernel style)",
            "bare_forward": "model.model: final hidden states only, no output projection",
            "timer": "process CPU seconds of one pass, torch.set_num_threads(1), fresh subprocess per measurement",
            "memory": "peak RSS (VmHWM, reset after the model is built) of that subprocess during the pass: model "
                      "weights + interpreter + the pass; *_resident_before_mib is the RSS before the pass",
            "model_shape": {**MODELS[model], "num_hidden_layers": layers,
                            "note": "Qwen3-0.6B has 28 layers; fewer here for CPU time, width and vocab are real"
                            if model != "smoke" else "smoke"},
            "prompt_length": PROMPT_LENGTH, "exit_length": EXIT_LENGTH, "answer_length": ANSWER_LENGTH,
            "goals_at_L_ge_4096": SCALE_GOALS, **output.machine_meta(),
        },
        "rows": rows,
    }


# ------------------------------------------------------------------------------------------------------------ gpu
SEED = 0
ACCURACY_MAX_TOKENS, ACCURACY_BOUNDARIES = 1024, 6
REFERENCE_ATTENTION = "eager"
BF16_BACKENDS = ("sdpa", "flash_attention_2")
COST_PASSES = ("value_pass", "plain", "forward")
DIFFERENCE_FIELDS = ("probe_logp", "values", "trace_logp")


def qwen3_model(name: str, layers: int, vocab: int | None, dtype: torch.dtype, attention: str,
                device: torch.device):
    """A random Qwen3 of ``MODELS[name]``'s widths, built on ``device`` in ``dtype`` (a 36-layer Qwen3-4B is 16 GB in
    fp32: it is never materialised on the host)."""
    config = Qwen3Config(**{**MODELS[name], **({"vocab_size": vocab} if vocab else {})}, num_hidden_layers=layers)
    torch.manual_seed(SEED)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention).eval()


@contextmanager
def dispatched_attention(model):
    """The attention backends the model's layers dispatch to inside the block, read from their config at call time
    (after the value pass's own switch to ``VALUE_PASS_ATTENTION``), i.e. what actually ran."""
    seen: set[str] = set()
    hooks = [layer.self_attn.register_forward_pre_hook(lambda module, args: seen.add(module.config._attn_implementation))
             for layer in model.model.layers]
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


def scores(traces: list[Trace], probe_logp: list[torch.Tensor], trace_logp: list[torch.Tensor]) -> dict:
    """Probe log-probs, values (as ``score_plans`` computes them) and response log-probs, concatenated over traces."""
    values = [values_from_probe_logp(logp, t.probes, t.num_values, NORMALIZATION) for t, logp in zip(traces, probe_logp)]
    return {"probe_logp": torch.cat(probe_logp), "values": torch.cat(values), "trace_logp": torch.cat(trace_logp)}


def naive_scores(model, traces: list[Trace]) -> dict:
    return scores(traces, [score_probes_naive(model, t.prompt, t.response, t.probes) for t in traces],
                  [trace_log_probs_and_entropy(model, t.prompt, t.response)[0] for t in traces])


def value_pass_scores(model, traces: list[Trace]) -> dict:
    scored, _ = score_batch_packed_with_stats(model, [t.prompt for t in traces], [t.response for t in traces],
                                              [t.probes for t in traces], return_trace_stats=True)
    return scores(traces, [s.probe_logp for s in scored], [s.trace_log_probs for s in scored])


def differences(measured: dict, reference: dict, prefix: str = "") -> dict[str, float]:
    """Max and median absolute difference of each field against the reference."""
    result = {}
    for field in DIFFERENCE_FIELDS:
        diff = (measured[field] - reference[field]).abs()
        result |= {f"{prefix}{field}_max_abs_diff": float(diff.max()),
                   f"{prefix}{field}_median_abs_diff": float(diff.median())}
    return result


def bf16_backends(device: torch.device) -> tuple[list[str], dict[str, str]]:
    """The bf16 backends to configure here, and why the others are left out."""
    if device.type == "cuda" and is_flash_attn_2_available():
        return list(BF16_BACKENDS), {}
    why = "needs CUDA" if device.type != "cuda" else "transformers finds no usable flash_attn package"
    return ["sdpa"], {"flash_attention_2": why}


def run_accuracy(args, device: torch.device) -> dict:
    """Value pass (fp32, then bf16 per backend) and bf16 naive path against the fp32 eager naive reference."""
    length = min(args.tokens, ACCURACY_MAX_TOKENS)
    generator = torch.Generator().manual_seed(SEED + 1)
    model = qwen3_model(args.model, args.accuracy_layers, args.vocab, torch.float32, REFERENCE_ATTENTION, device)
    traces = [synthetic_trace(n, spread(n, ACCURACY_BOUNDARIES), model.config.vocab_size, generator)
              for n in (max(1, length // d) for d in (4, 2, 1))]
    with dispatched_attention(model) as reference_ran:
        reference = naive_scores(model, traces)
    with dispatched_attention(model) as ran:
        fp32 = value_pass_scores(model, traces)
    cases = [{"case": f"float32/{REFERENCE_ATTENTION}", "dtype": "float32", "configured": REFERENCE_ATTENTION,
              "value_pass_ran": sorted(ran), **differences(fp32, reference)}]
    # Parameters only: model.to(dtype) would also round the rotary inverse frequencies, which a bf16 model keeps in
    # fp32, and add that error to the bf16 one (each tied parameter once, so the tie holds).
    for parameter in model.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    backends, skipped = bf16_backends(device)  # sdpa first
    for backend in backends:
        model.set_attn_implementation(backend)
        with dispatched_attention(model) as ran:
            packed = value_pass_scores(model, traces)
        with dispatched_attention(model) as naive_ran:
            naive = naive_scores(model, traces)
        case = {"case": f"bfloat16/{backend}", "dtype": "bfloat16", "configured": backend, "value_pass_ran": sorted(ran)}
        if backend == "sdpa":
            sdpa_probe_logp = packed["probe_logp"]
        else:  # the value pass should not depend on the configured backend at all
            case["value_pass_identical_to_sdpa"] = bool(torch.equal(packed["probe_logp"], sdpa_probe_logp))
        cases.append({**case, **differences(packed, reference), "naive_ran": sorted(naive_ran),
                      **differences(naive, reference, "naive_")})
    return {"layers": args.accuracy_layers, "response_lengths": [t.response.numel() for t in traces],
            "boundaries_per_trace": ACCURACY_BOUNDARIES, "probes": sum(len(t.probes) for t in traces),
            "values": sum(t.num_values for t in traces), "reference_ran": sorted(reference_ran),
            "reference_probe_logp_median": float(reference["probe_logp"].median()),
            "reference_values_median": float(reference["values"].median()), "cases": cases, "skipped": skipped}


@torch.no_grad()
def measure_pass(run, model, device: torch.device, repeats: int) -> dict:
    """Median wall seconds of ``repeats`` runs after a warm-up (which records the attention dispatched) and, on
    CUDA, their peak allocated memory next to the memory resident before them."""
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda device: None
    with dispatched_attention(model) as ran:
        run()
    synchronize(device)
    resident = peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device) / MIB
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / MIB
    return {"seconds": statistics.median(seconds), "peak_mib": peak, "resident_mib": resident,
            "pass_peak_mib": None if peak is None else peak - resident, "ran": sorted(ran)}


def measure_cost(args, layers: int, device: torch.device) -> list[dict]:
    """One row per configured backend: the three passes over one trace of ``args.tokens`` response tokens."""
    model = qwen3_model(args.model, layers, args.vocab, torch.bfloat16, "sdpa", device)
    trace = synthetic_trace(args.tokens, spread(args.tokens, NUM_BOUNDARIES), model.config.vocab_size,
                            torch.Generator().manual_seed(SEED))
    input_ids = torch.cat([trace.prompt, trace.response])[None].to(device)

    def value_pass() -> torch.Tensor:
        """What ``score_plans`` runs for this trace's exit probes: probe log-probs only, then the values."""
        (scored,), _ = score_batch_packed_with_stats(model, [trace.prompt], [trace.response], [trace.probes],
                                                     return_trace_stats=False)
        return values_from_probe_logp(scored.probe_logp, trace.probes, trace.num_values, NORMALIZATION)

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


def run_cost(args, device: torch.device) -> dict:
    """``measure_cost`` at ``args.layers`` layers, halving the depth on CUDA out-of-memory until it fits."""
    layers, out_of_memory, rows = args.layers, [], []
    while True:
        try:
            rows = measure_cost(args, layers, device)
            break
        except torch.cuda.OutOfMemoryError:
            out_of_memory.append(layers)
        gc.collect()  # outside the handler: its traceback (and with it the model) is released by now
        torch.cuda.empty_cache()
        if layers == 1:
            break
        layers = max(1, layers // 2)
    return {"layers_requested": args.layers, "layers": layers if rows else None,
            "out_of_memory_at_layers": out_of_memory, "prompt_tokens": PROMPT_LENGTH, "response_tokens": args.tokens,
            "boundaries": NUM_BOUNDARIES, "candidates": NUM_CANDIDATES, "dtype": "bfloat16", "repeats": args.repeats,
            "rows": rows}


def flash_attn_version() -> str | None:
    try:
        return importlib.metadata.version("flash_attn")
    except importlib.metadata.PackageNotFoundError:
        return None


def run_gpu(args) -> dict:
    device = torch.device(args.device)
    torch.set_float32_matmul_precision("highest")  # the fp32 reference in full fp32 (no TF32) on CUDA
    accuracy = run_accuracy(args, device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    cost = run_cost(args, device)
    lines = [{"case": f"{case['case']} {label}", "ran": ",".join(case[prefix + "ran"] if prefix else
                                                                 case["value_pass_ran"]),
              **{field: case[f"{prefix}{field}_abs_diff"] for field in (
                  "probe_logp_max", "probe_logp_median", "values_max", "values_median", "trace_logp_max")}}
             for case in accuracy["cases"] for label, prefix in [("value pass", ""), ("naive", "naive_")]
             if prefix == "" or "naive_ran" in case]
    output.print_table(lines, {"case": "", "ran": "", "probe_logp_max": ".2e", "probe_logp_median": ".2e",
                               "values_max": ".2e", "values_median": ".2e", "trace_logp_max": ".2e"},
                       f"accuracy against fp32 {REFERENCE_ATTENTION} naive ({accuracy['layers']} layers; not run: "
                       f"{accuracy['skipped'] or 'none'})")
    output.print_table([{"configured": row["configured"], "pass": name, "ran": ",".join(row[f"{name}_ran"]),
                         **{key: row[f"{name}_{key}"] for key in ("seconds", "peak_mib", "pass_peak_mib")},
                         **({key: row[key] for key in row if "_over_" in key} if name == "value_pass" else {})}
                        for row in cost["rows"] for name in COST_PASSES],
                       {"configured": "", "pass": "", "ran": "", "seconds": ".3f", "peak_mib": ".0f",
                        "pass_peak_mib": ".0f", "time_over_plain": ".3f", "time_over_forward": ".3f",
                        "peak_over_plain": ".3f", "peak_over_forward": ".3f"},
                       f"cost: {cost['response_tokens']} response tokens, {cost['layers']} layers (asked "
                       f"{cost['layers_requested']}, out of memory at {cost['out_of_memory_at_layers'] or 'none'})")
    shape = {**MODELS[args.model], **({"vocab_size": args.vocab} if args.vocab else {})}
    device_name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                   else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)")
    return {
        "meta": {
            "script": "benchmarks/value_pass.py gpu", "device": device_name, "model": args.model,
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
            "torch": torch.__version__, "transformers": transformers.__version__,
            "flash_attn": flash_attn_version(), "python": platform.python_version(),
        },
        "accuracy": accuracy,
        "cost": cost,
    }


# ------------------------------------------------------------------------------------------------------------ cli
def parse(argv: list[str] | None) -> argparse.Namespace:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = cli.add_subparsers(dest="mode", required=True)
    sub = {mode: modes.add_parser(mode) for mode in RESULTS}
    for mode, parser in sub.items():
        parser.add_argument("--out", type=Path, default=None,
                            help=f"JSON path (default {RESULTS[mode].relative_to(output.ROOT)}; a temp file with --smoke)")
        if mode != "gpu":
            parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds, no training")
    values = sub["values"]
    values.add_argument("--build", type=Path, default=output.ROOT / "outputs" / "tiny_cpu" / "build",
                        help="task build folder (created with rredcot_verl.tasks.build if missing)")
    values.add_argument("--prompts", type=int, default=8)
    values.add_argument("--samples-per-prompt", type=int, default=4)
    values.add_argument("--mc-samples", type=int, default=9)
    values.add_argument("--repeats", type=int, default=3)
    values.add_argument("--seed", type=int, default=1, help="sampling seed and the training runs' data.seed")
    values.add_argument("--train-steps", type=int, default=3, help="steps per training run; 0 skips training")
    values.add_argument("--runs-dir", type=Path, default=None,
                        help="read existing runs <runs-dir>/<method>_seed<seed> instead of launching them")
    scale = sub["scale"]
    scale.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192], help="response lengths L")
    scale.add_argument("--layers", type=int, default=4, help="decoder layers (Qwen3-0.6B has 28, Qwen3-4B 36)")
    scale.add_argument("--model", choices=[m for m in MODELS if m != "smoke"], default="qwen3-0.6b")
    scale.add_argument("--append", action="store_true", help="add the rows to the existing JSON instead of replacing")
    scale.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # internal: one measurement, JSON spec
    gpu = sub["gpu"]
    gpu.add_argument("--device", default="cuda", help="torch device (cpu for a small run)")
    gpu.add_argument("--model", choices=sorted(MODELS), default="qwen3-4b", help="widths (reference_scorers.MODELS)")
    gpu.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the model's)")
    gpu.add_argument("--layers", type=int, default=36, help="cost model's layers, halved on out-of-memory")
    gpu.add_argument("--accuracy-layers", type=int, default=2, help="accuracy model's layers")
    gpu.add_argument("--tokens", type=int, default=25_000, help="cost trace's response tokens")
    gpu.add_argument("--repeats", type=int, default=3, help="timed runs per pass (median), after a warm-up")
    gpu.set_defaults(smoke=False)
    return cli.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    out = output.out_path(args, RESULTS[args.mode])
    result = {"values": run_values, "scale": run_scale, "gpu": run_gpu}[args.mode](args)
    return {} if result is None else output.write_result(result, out)


if __name__ == "__main__":
    main()
