"""Projected GPU step time of each estimator at the paper recipe's shape, over GRPO's; and where the extra CPU step
time goes on the long setting.

GPU projection (``results/gpu_projection.json``): pure arithmetic on measured components, nothing runs on a GPU.

* The shape from ``recipes/paper/qwen3_4b_numina_rredcot.yaml`` (and its GRPO twin, which must agree): traces a step
  (``train_batch_size`` × ``rollout.n``), response budget, GPUs (``nnodes`` × ``n_gpus_per_node``), segments,
  ``gpu_memory_utilization``. Every trace is taken at the full budget, the shape ``gpu_check`` and ``driver_share``
  were measured at.
* Log-prob pass and value pass: ``results/gpu_check{_8000,,_40000}.json`` (one H200, Qwen3-4B's shape, bf16): seconds
  of one trace at 8k / 25k / 40k tokens, fitted as a·L + b·L² and evaluated at the recipe's length; each GPU scores
  its share of the traces one after the other.
* Driver (GPUs idle): ``results/driver_share.json``, per estimator, its seconds projected on a node driver's cores
  (``driver_seconds_projected_at_node_scaled``: its one-core phases plus its multi-core phases over the cores), plus
  its workers' share per rank.
* Generation, the actor update, IBPO's repairs, ``segment_mc``'s continuations and reference-continuation probes:
  from the ``ASSUMPTIONS`` below, each with a low and a high value and its source. The ratio's range is the lowest
  and highest ratio over every combination of those low and high values.

Long-setting breakdown (``results/long_step_cost.json``): the per-stage medians (``timing_s/*``) of the run folders
given with ``--long-runs`` (or those committed in ``results/long_step_cost_inputs.json``), the ledger's median step
of every long-study run and ``length_scaling.json``'s same-sitting step times; what the extra time is spent on and
what would bring ``rredcot`` within 1.5× GRPO's step.

    python -m benchmarks.gpu_projection                    # both JSONs from the committed inputs, prints the tables
    python -m benchmarks.gpu_projection --long-runs DIR    # re-extract the stage medians from DIR/<run>/metrics.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

if __package__ in (None, ""):  # ``python benchmarks/gpu_projection.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from rredcot_verl.runs import load_metrics  # noqa: E402

RESULTS_PATH = common.RESULTS_DIR / "gpu_projection.json"
LONG_RESULTS_PATH = common.RESULTS_DIR / "long_step_cost.json"
LONG_INPUTS_PATH = common.RESULTS_DIR / "long_step_cost_inputs.json"
RECIPES = {"rredcot": "recipes/paper/qwen3_4b_numina_rredcot.yaml", "grpo": "recipes/paper/qwen3_4b_numina_grpo.yaml"}
GPU_CHECKS = ("gpu_check_8000.json", "gpu_check.json", "gpu_check_40000.json")
GOAL_RATIO = 1.15  # issue 56: rredcot's projected GPU step within 1.15x GRPO's
LONG_GOAL_RATIO = 1.5  # issue 56: rredcot within 1.5x GRPO's step on the long CPU setting

# (central, low, high): "low" is the value that makes steps shorter. Each with where it comes from.
ASSUMPTIONS = {
    "gpu_memory_gb": {"value": 141.0, "source": "NVIDIA H200 datasheet (141 GB HBM3e), "
                      "https://www.nvidia.com/en-us/data-center/h200/; the GPU gpu_check ran on"},
    "memory_bandwidth_tb_s": {"value": 4.8, "source": "NVIDIA H200 datasheet (4.8 TB/s)"},
    "decode_bandwidth_efficiency": {
        "value": 0.65, "low": 0.8, "high": 0.5,
        "source": "assumed: the share of peak HBM bandwidth vLLM's paged-attention decode reaches. Decoding a "
                  "25k-token trace is bound by reading the KV cache: a token at context c reads c × KV bytes a "
                  "token (2 × layers × kv heads × head dim × 2 B = 147 KiB for Qwen3-4B), the weights once a batch, "
                  "and the cache holds what gpu_memory_utilization leaves after the weights"},
    "prompt_tokens": {"value": 128, "source": "gpu_check's prompt (Numina problems are short; the recipe's "
                      "max_prompt_length is a cap)"},
    "engine_reserve_gb": {"value": 4.0, "source": "assumed: activations and CUDA graphs of vLLM outside the KV cache"},
    "update_passes": {
        "value": 3.5, "low": 3.0, "high": 4.0,
        "source": "assumed: the actor update costs this many log-prob passes (forward + backward is 3 forwards; "
                  "gradient checkpointing, on in the recipe, recomputes the forward: 4), at the log-prob pass's "
                  "measured efficiency; FSDP traffic and the 4 optimizer steps (ppo_mini_batch_size 32 of 128 "
                  "prompts) left out. Published verl logs vary widely here: update_actor / old_log_prob 1.1 "
                  "(https://github.com/verl-project/verl/issues/7203, Megatron, 9B, 2k tokens) and 6.5 "
                  "(https://github.com/verl-project/verl/issues/7412, ref pass on, 3k tokens)"},
    "repair_tokens_scale": {
        "value": 0.75, "low": 0.5, "high": 1.0,
        "source": "assumed: IBPO's resumed repairs generate this fraction of the repair tokens driver_share "
                  "measured (measured.repair_metrics['ibpo/extra_generated_tokens']: its stand-in engine diverges "
                  "at the trace's start and every repair runs the whole budget, 1.0; a repair that resumes "
                  "mid-trace generates about half)"},
    "reference_probe_tokens": {
        "value": 300, "low": 100, "high": 800,
        "source": "assumed, not measured: tokens of the dataset reference left to score at a boundary (README row "
                  "A, candidates.source=ground_truth; probe.reference_alignment=steps resumes after the steps the "
                  "prefix completed, so late boundaries score little more than the answer). Numina-CoT solutions "
                  "are a few hundred tokens"},
    "bank_candidates": {
        "value": 1.5, "low": 1.0, "high": 3.0,
        "source": "assumed: correct traces or verified repairs in a trace's bank (group_and_repairs, README rows "
                  "C and D), each scored from the boundary to its end"},
    "remaining_fraction": {
        "value": 0.5, "low": 0.25, "high": 0.5,
        "source": "assumed: mean share of the budget left after a boundary that a continuation (segment_mc) or a "
                  "bank trace's remainder runs: 0.5 with boundaries spread evenly and continuations as long as "
                  "rollouts; 0.25 if they end twice as early"},
    "mc_continuations": {"value": 9, "source": "segment_mc.num_continuations default (docs/configuration.md)"},
}


def assumption(name: str, corner: str) -> float:
    entry = ASSUMPTIONS[name]
    return float(entry.get(corner, entry["value"]))


# ------------------------------------------------------------------------------------------------------- inputs
def recipe_shape() -> dict:
    """The step's shape from the paper recipes (their GRPO baseline must have the same)."""
    shapes = {}
    for name, path in RECIPES.items():
        recipe = OmegaConf.load(common.ROOT / path)
        shapes[name] = {
            "model": str(recipe.actor_rollout_ref.model.path),
            "traces": int(recipe.data.train_batch_size) * int(recipe.actor_rollout_ref.rollout.n),
            "response_tokens": int(recipe.data.max_response_length),
            "gpus": int(recipe.trainer.nnodes) * int(recipe.trainer.n_gpus_per_node),
            "gpu_memory_utilization": float(recipe.actor_rollout_ref.rollout.gpu_memory_utilization),
            "ppo_mini_batch_prompts": int(recipe.actor_rollout_ref.actor.ppo_mini_batch_size),
        }
    if shapes["rredcot"] != shapes["grpo"]:
        raise ValueError(f"the paper recipes disagree on the step's shape: {shapes}")
    rredcot = OmegaConf.load(common.ROOT / RECIPES["rredcot"]).algorithm.rredcot
    return {**shapes["rredcot"], "segments": int(rredcot.segmentation.max_segments), "recipes": list(RECIPES.values())}


def gpu_check_fits() -> dict:
    """Seconds of one trace of L tokens (prompt + response) per pass, fitted as a·L + b·L² through the gpu_check
    runs, with the measured points and the model shape."""
    checks = [json.loads((common.RESULTS_DIR / name).read_text()) for name in GPU_CHECKS]
    lengths = np.array([c["cost"]["prompt_tokens"] + c["cost"]["response_tokens"] for c in checks], dtype=float)
    design = np.stack([lengths, lengths**2], axis=1)
    fits = {}
    for key in ("plain", "value_pass", "forward"):
        seconds = [c["cost"]["rows"][0][f"{key}_seconds"] for c in checks]
        (linear, quadratic), *_ = np.linalg.lstsq(design, np.array(seconds), rcond=None)
        fits[key] = {"per_token_s": float(linear), "per_token_squared_s": float(quadratic),
                     "measured": dict(zip([str(int(n)) for n in lengths], seconds))}
    shape = checks[1]["meta"]["model_shape"]
    return {"files": [f"benchmarks/results/{name}" for name in GPU_CHECKS], "device": checks[1]["meta"]["device"],
            "layers": checks[1]["cost"]["layers"], "boundaries": checks[1]["cost"]["boundaries"],
            "resident_mib": checks[1]["cost"]["rows"][0]["plain_resident_mib"],
            "kv_bytes_per_token": 2 * checks[1]["cost"]["layers"] * shape["num_key_value_heads"] * shape["head_dim"]
            * 2,  # K and V, bf16
            "passes": fits}


def driver_inputs() -> dict:
    share = json.loads((common.RESULTS_DIR / "driver_share.json").read_text())
    return {"file": "benchmarks/results/driver_share.json", "shape": share["shape"],
            "seconds": {name: (entry["driver_seconds_projected_at_node_scaled"]
                               + entry["workers_seconds_per_rank_scaled"])
                        for name, entry in share["estimators"].items()},
            "node_cores": share["node_cores"],
            # measured over driver_share's traces (--traces N), scaled to the recipe's as its seconds are
            "repair_tokens": share["measured"]["repair_metrics"]["ibpo/extra_generated_tokens"]
            * share["scaled_to_recipe"]}


def collect_inputs() -> dict:
    return {"shape": recipe_shape(), "gpu_check": gpu_check_fits(), "driver": driver_inputs()}


# ------------------------------------------------------------------------------------------------------- model
def pass_seconds(fit: dict, tokens: float) -> float:
    return fit["per_token_s"] * tokens + fit["per_token_squared_s"] * tokens**2


def continuation_probe_seconds(forward: dict, trace_tokens: float, probe_tokens: float) -> float:
    """The extra time of ``probe_tokens`` continuation-probe tokens in one trace's value pass: their own tokens at
    the forward's per-token rate, and their attention over the trace and the other probes (dense under the probe
    mask) at the forward's cost per causal query-key pair (b·L² holds L²/2 pairs)."""
    return forward["per_token_s"] * probe_tokens + 2 * forward["per_token_squared_s"] * probe_tokens * (
        trace_tokens + probe_tokens)


def continuation_probe_tokens(shape: dict, a: dict) -> dict[str, float]:
    """Continuation-probe tokens in one trace's value-pass row: a reference's rest, or each bank trace's rest, at
    every boundary (probes at different boundaries share no tokens)."""
    return {"rredcot_reference": shape["segments"] * a["reference_probe_tokens"],
            "rredcot_repair_bank": shape["segments"] * a["bank_candidates"] * a["remaining_fraction"]
            * shape["response_tokens"]}


def project(inputs: dict, corner: dict[str, str]) -> dict[str, dict[str, float]]:
    """Seconds per stage of one step for every estimator, the assumptions at ``corner`` (name → value/low/high)."""
    shape, check, driver = inputs["shape"], inputs["gpu_check"], inputs["driver"]
    a = {name: assumption(name, corner.get(name, "value")) for name in ASSUMPTIONS}
    tokens = a["prompt_tokens"] + shape["response_tokens"]
    probe_tokens = continuation_probe_tokens(shape, a)
    traces_per_gpu = shape["traces"] / shape["gpus"]
    response_tokens_per_gpu = traces_per_gpu * shape["response_tokens"]

    weights_gb = check["resident_mib"] * 2**20 / 1e9
    cache_gb = a["gpu_memory_gb"] * shape["gpu_memory_utilization"] - weights_gb - a["engine_reserve_gb"]
    mean_context = a["prompt_tokens"] + shape["response_tokens"] / 2
    # Each decode step reads the weights and the full cache; it yields one token per sequence the cache holds.
    sequences = cache_gb * 1e9 / (check["kv_bytes_per_token"] * mean_context)
    bandwidth = a["memory_bandwidth_tb_s"] * 1e12 * a["decode_bandwidth_efficiency"]
    decode_step_s = (weights_gb + cache_gb) * 1e9 / bandwidth
    generation = response_tokens_per_gpu / (sequences / decode_step_s)

    log_prob = traces_per_gpu * pass_seconds(check["passes"]["plain"], tokens)
    grpo = {"generation": generation, "old_log_prob": log_prob, "update_actor": a["update_passes"] * log_prob}

    exit_value_pass = traces_per_gpu * pass_seconds(check["passes"]["value_pass"], tokens)
    forward = check["passes"]["forward"]
    repairs = generation * a["repair_tokens_scale"] * driver["repair_tokens"] / (
        shape["traces"] * shape["response_tokens"])
    mc = generation * a["mc_continuations"] * shape["segments"] * a["remaining_fraction"]
    seconds = driver["seconds"]
    return {
        "grpo": grpo,
        "rredcot_exit_probe": {**grpo, "value_pass": exit_value_pass, "driver": seconds["rredcot"]},
        "rredcot_reference": {**grpo, "value_pass": exit_value_pass + traces_per_gpu * continuation_probe_seconds(
            forward, tokens, probe_tokens["rredcot_reference"]), "driver": seconds["rredcot"]},
        "rredcot_repair_bank": {**grpo, "repairs": repairs, "value_pass": exit_value_pass + traces_per_gpu
                                * continuation_probe_seconds(forward, tokens, probe_tokens["rredcot_repair_bank"]),
                                "driver": seconds["rredcot_ibpo"]},
        "ibpo": {**grpo, "repairs": repairs, "driver": seconds["ibpo"]},
        "rredcot_ibpo": {**grpo, "repairs": repairs, "value_pass": exit_value_pass, "driver": seconds["rredcot_ibpo"]},
        "segment_mc": {**grpo, "continuations": mc},
    }


VARIED = [name for name, entry in ASSUMPTIONS.items() if "low" in entry]
ESTIMATOR_NOTES = {
    "grpo": "verl's GRPO: generation, the log-prob pass, the update (reward, advantage, weight sync left out of every "
            "estimator)",
    "rredcot_exit_probe": "the paper recipe as shipped: exit-probe value pass (gpu_check's measured pass) and the "
                          "driver's probe planning",
    "rredcot_reference": "README row A (dataset references, candidates.source=ground_truth): the exit-probe pass "
                         "plus the reference continuations' probe tokens (the exit probes' ~1k tokens counted too, an "
                         "overestimate); driver time taken as rredcot's (not measured for continuations)",
    "rredcot_repair_bank": "README row C (reference continuations of the group's correct traces or verified repairs, "
                           "no dataset references): repairs + continuation probes of bank traces; driver as "
                           "rredcot_ibpo's",
    "ibpo": "repairs generated after the rollouts (resume operator) and judged, aligned on the driver",
    "rredcot_ibpo": "as measured by driver_share (exit-probe values on a repair-filled bank); its launch default "
                    "(README row D) values with bank continuations, which cost as rredcot_repair_bank's value pass",
    "segment_mc": "K continuations from every boundary, generated and judged (the judging is not in driver_share: "
                  "left out, so this is a lower bound)",
}


def gpu_projection(inputs: dict) -> dict:
    central = project(inputs, {})
    corners = [project(inputs, dict(zip(VARIED, choice)))
               for choice in itertools.product(("low", "high"), repeat=len(VARIED))]
    def step(stages: dict) -> float:
        return sum(stages.values())  # the stages run one after the other in verl's trainer

    estimators = {}
    for name, stages in central.items():
        ratios = [step(corner[name]) / step(corner["grpo"]) for corner in corners]
        steps = [step(corner[name]) for corner in corners]
        estimators[name] = {"stages_s": stages, "step_s": step(stages), "step_s_range": [min(steps), max(steps)],
                            "over_grpo": step(stages) / step(central["grpo"]),
                            "over_grpo_range": [min(ratios), max(ratios)], "note": ESTIMATOR_NOTES[name]}
    central_assumptions = {name: assumption(name, "value") for name in ASSUMPTIONS}
    trace_tokens = central_assumptions["prompt_tokens"] + inputs["shape"]["response_tokens"]
    for name, tokens in continuation_probe_tokens(inputs["shape"], central_assumptions).items():
        # core.scoring builds a (probe tokens × (trace + probe tokens)) boolean mask per row: one byte an entry
        estimators[name] |= {"probe_tokens_per_trace": tokens,
                             "probe_mask_gib_per_trace": tokens * (trace_tokens + tokens) / 2**30}
    grpo_steps = estimators["grpo"]["step_s_range"]
    extra = {name: step(central[name]) - step(central["grpo"]) for name in ("rredcot_exit_probe", "rredcot_reference")}
    return {
        "inputs": inputs, "assumptions": ASSUMPTIONS, "device": inputs["gpu_check"]["device"],
        "estimators": estimators,
        "goal": {"rredcot_over_grpo_at_most": GOAL_RATIO,
                 "met_at_every_corner": {name: estimators[name]["over_grpo_range"][1] <= GOAL_RATIO
                                         for name in ("rredcot_exit_probe", "rredcot_reference")},
                 "grpo_step_needed_s": {name: seconds / (GOAL_RATIO - 1) for name, seconds in extra.items()},
                 "grpo_step_s_range": grpo_steps},
        "command": "python -m benchmarks.gpu_projection",
    }


# ----------------------------------------------------------------------------------------------- long setting
LONG_ESTIMATORS = {  # the long study's ledger labels and length_scaling.json's roles, by estimator
    "grpo": ("grpo", "grpo"),
    "rredcot_dataset_references": ("rredcot", "rredcot_dataset_references"),
    "rredcot_repair_bank": ("rredcot_repairs_degenerate_resume", "best_without_references"),
    "ibpo": ("ibpo_resume", "ibpo"),
    "rredcot_ibpo": (None, "rredcot_ibpo"),
}


def extract_stage_medians(runs_dir: Path) -> dict:
    """``timing_s/*`` medians (steps ≥ 2) and mean response length of every ``runs_dir/<run>/metrics.jsonl``."""
    runs = {}
    for metrics in sorted(runs_dir.glob("*/metrics.jsonl")):
        rows = load_metrics(metrics)
        lengths = [row["response_length/mean"] for row in rows if "response_length/mean" in row]
        runs[metrics.parent.name] = {"phase_median_s": common.phase_medians(rows), "steps": len(rows),
                                     "response_length_median": statistics.median(lengths) if lengths else None}
    return runs


def ledger_steps(label: str | None) -> dict:
    ledger = common.RESULTS_DIR / "sample_efficiency_runs" / "long" / "main"
    if label is None:
        return {}
    runs = {}
    for seed in (1, 2, 3):
        summary = json.loads((ledger / f"{label}_seed{seed}.json").read_text())["summary"]
        accuracy = [summary["diagnostics"][when]["critic/score/mean"] for when in ("first", "last")]
        runs[str(seed)] = {"median_step_s": summary["median_step_s"], "train_accuracy_first_last": accuracy}
    return runs


def long_step_cost(inputs: dict) -> dict:
    """Where each estimator's extra step time goes on the long setting, and what would bring it within 1.5x."""
    scaling = json.loads((common.RESULTS_DIR / "length_scaling.json").read_text())["lengths"]["long"]["cost"]
    grpo_stages = inputs["grpo_stage_medians"]["phase_median_s"]
    grpo_sitting = scaling["grpo"]["median_step_s"]
    ledger = {name: ledger_steps(label) for name, (label, _) in LONG_ESTIMATORS.items()}
    estimators = {}
    for name, (_, role) in LONG_ESTIMATORS.items():
        step = scaling[role]["median_step_s"]
        extra = step - grpo_sitting
        entry = {"step_s": step, "over_grpo": step / grpo_sitting, "extra_s": extra,
                 "ledger_over_grpo_by_seed": {seed: run["median_step_s"] / ledger["grpo"][seed]["median_step_s"]
                                              for seed, run in ledger[name].items()}}
        inputs_s = inputs["estimator_inputs_s"].get(name)
        if inputs_s is not None:
            entry |= {"estimator_inputs_s": inputs_s, "estimator_inputs_share_of_extra": inputs_s / extra}
        estimators[name] = entry

    # rredcot with dataset references: at each of K boundaries its value pass scores the rest of every candidate
    # (the reference and the group's correct traces, each about a trace long on this task) after re-reading the
    # trace, so it reads 1 + C·Σ_k (1 − k/K) traces' worth of tokens for the log-prob pass's 1.
    accuracy = statistics.mean(a for run in ledger["rredcot_dataset_references"].values()
                               for a in run["train_accuracy_first_last"])
    tiny = {name: OmegaConf.load(common.RECIPES / f"{name}.yaml") for name in ("base", "rredcot")}
    candidates = 1 + (int(tiny["base"].actor_rollout_ref.rollout.n) - 1) * accuracy
    boundaries = int(tiny["rredcot"].algorithm.rredcot.segmentation.max_segments)

    def traces_read(bank: float, segments: int) -> float:
        return 1 + bank * sum(1 - k / segments for k in range(segments))

    value_s = estimators["rredcot_dataset_references"]["estimator_inputs_s"]
    rest = estimators["rredcot_dataset_references"]["extra_s"] - value_s
    today = traces_read(candidates, boundaries)
    grpo_log_prob = grpo_sitting * grpo_stages["old_log_prob"] / grpo_stages["step"]

    def lever(what: str, bank: float, segments: int) -> dict:
        fraction = traces_read(bank, segments) / today
        return {"what": what, "traces_read": traces_read(bank, segments), "value_pass_fraction": fraction,
                "over_grpo": (grpo_sitting + rest + value_s * fraction) / grpo_sitting}

    levers = {
        "ground_truth_candidates": lever("candidates.source=ground_truth: the reference alone", 1, boundaries),
        "half_the_segments": lever(f"segmentation.max_segments {boundaries} -> {boundaries // 2}", candidates,
                                   boundaries // 2),
        "both": lever("both of the above", 1, boundaries // 2),
    }
    referenced = {
        "mean_train_accuracy": accuracy, "candidates_per_trace": candidates, "segments": boundaries,
        "traces_read_by_the_value_pass": today,
        "estimator_inputs_over_grpo_log_prob": value_s / grpo_log_prob,
        "grpo_log_prob_s": grpo_log_prob,
        "levers": levers, "goal_over_grpo": LONG_GOAL_RATIO,
        "value_pass_fraction_for_goal": ((LONG_GOAL_RATIO - 1) * grpo_sitting - rest) / value_s,
        "exit_probe_over_grpo": scaling["exit_probe"]["over_grpo"],
    }
    return {
        "inputs": inputs, "grpo_stages_s": grpo_stages,
        "grpo_stage_shares": {stage: seconds / grpo_stages["step"] for stage, seconds in grpo_stages.items()
                              if stage not in ("step", "testing", "save_checkpoint")},
        "estimators": estimators,
        "rredcot_dataset_references": referenced,
        "sources": {"step_s": "benchmarks/results/length_scaling.json (lengths.long.cost: 4-step runs, one sitting)",
                    "ledger": "benchmarks/results/sample_efficiency_runs/long/main (100-step runs, one sitting per "
                              "seed)"},
        "assumption": "GRPO's log-prob pass in the length_scaling sitting: its share of the re-run's step times that "
                      "sitting's GRPO step. The levers scale the whole estimator-input time (value pass and probe "
                      "planning, both growing with the probe tokens) by the tokens the value pass reads; projected, "
                      "not measured",
        "command": "python -m benchmarks.gpu_projection",
    }


# ---------------------------------------------------------------------------------------------------------- cli
def print_tables(projection: dict, long_cost: dict) -> None:
    stages = ("generation", "repairs", "continuations", "old_log_prob", "value_pass", "driver", "update_actor")
    common.print_table([{"estimator": name, **entry["stages_s"], **entry}
                        for name, entry in projection["estimators"].items()],
                       {"estimator": "", **dict.fromkeys((*stages, "step_s"), ".0f"), "over_grpo": ".3f",
                        "over_grpo_range": ".3f"},
                       f"Projected step at the paper recipe ({projection['device']}), seconds a stage (central values)")
    common.print_table([{"estimator": name, **entry} for name, entry in long_cost["estimators"].items()],
                       ["estimator", "step_s", "over_grpo", "extra_s", "estimator_inputs_s",
                        "estimator_inputs_share_of_extra"], "Long setting (CPU): step over GRPO's, where the extra is")
    referenced = long_cost["rredcot_dataset_references"]
    print(f"  rredcot's value pass reads {referenced['traces_read_by_the_value_pass']:.1f} traces' worth a trace; its "
          f"inputs take {referenced['estimator_inputs_over_grpo_log_prob']:.1f}x GRPO's log-prob pass")
    for name, lever in referenced["levers"].items():
        print(f"  {name}: value pass x{lever['value_pass_fraction']:.2f} -> {lever['over_grpo']:.2f}x GRPO")
    print(f"  within {referenced['goal_over_grpo']}x: value pass x{referenced['value_pass_fraction_for_goal']:.2f}")


def main(argv=None) -> dict:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("--out", type=Path, default=RESULTS_PATH, help="the projection's JSON")
    cli.add_argument("--long-runs", type=Path, default=None,
                     help="folder of long-setting run folders (<run>/metrics.jsonl): refresh the committed medians")
    cli.add_argument("--long-out", type=Path, default=LONG_RESULTS_PATH, help="the long-setting breakdown's JSON")
    args = cli.parse_args(argv)
    long_inputs = json.loads(LONG_INPUTS_PATH.read_text())
    if args.long_runs is not None:
        runs = extract_stage_medians(args.long_runs)
        source = long_inputs["grpo_stage_medians"]["source"]
        long_inputs["grpo_stage_medians"] = {**runs["grpo_seed1"], "source": source}
        common.write_result(long_inputs, LONG_INPUTS_PATH)
    projection = common.write_result(gpu_projection(collect_inputs()), args.out)
    long_cost = common.write_result(long_step_cost(long_inputs), args.long_out)
    print_tables(projection, long_cost)
    return {"projection": projection, "long": long_cost}


if __name__ == "__main__":
    main()
