"""Turn-level credit on the calculator tool task: gradient quality against a reference gradient, value quality at the
assistant-turn boundaries against Monte-Carlo values with the tool, and the training step's cost.

Trajectories of the shipped calculator warm start (``tasks/calculator_miniature.py``) are played by
``calculator_miniature.tool_loop``: verl's ``ToolAgentLoop`` turn by turn (hermes parser, the calculator tool, verl's
Continuous Token builder), HF ``generate`` at temperature 1, the recipe's limits (6 assistant turns, 160 response
tokens); tool answers and template tokens stay in the response with ``response_mask`` 0. Problems are fresh draws of
the task's generator (``--seed``).

* **Gradient quality**: ``gradient_quality.py``'s protocol (``common``'s gradient protocol), token means over the
  model's tokens only. Methods (``METHODS``, on ``recipes/tiny_cpu/calculator.yaml``, one segment per assistant
  turn): GRPO; the recipe's exit probe (the gold answer, which the group's correct answers equal here: IGPO's
  p(gold | history) redistributed by telescoping); the same with ``degenerate_groups: value_differences`` (all-wrong
  groups learn from value differences); reference continuation from the group's correct trajectories (which glues a
  sibling's turns without their tool answers: measured to show why the launcher refuses it on multi-turn rollouts).
  None needs reference solutions; IBPO and ``segment_mc`` are refused on multi-turn rollouts. An advantage on a
  tool-output or template token is an error.
* **Value quality**: ``--vq-prompts`` × ``--vq-samples`` trajectories; each state S_k at an assistant-turn start gets
  a Monte-Carlo value from ``--mc-samples`` continuations resumed there (``calculator_miniature.resumed_state``);
  S_K's value is the outcome. Spearman with MC (pooled; within trace) per value source, and localisation: on failed
  trajectories with a wrong tool call, how often the most negative R_k = v_{k+1} − v_k is the turn of the first one.
* **Step cost**: ``--cost-steps`` steps of ``recipes/tiny_cpu/run.sh calculator`` (``common.cost_runs``) for the
  methods the launcher accepts (``LAUNCHED``), one sitting, same data seed: ``common.median_step_s``, ratio to GRPO's.

Caches under ``--cache`` (pool, g*, per-batch results, value quality, runs): a rerun resumes from them.

    python -m benchmarks.turn_credit            # benchmarks/results/turn_credit.json
    python -m benchmarks.turn_credit --smoke    # a tiny pool, one batch size, MC K=2, no launches; temp output
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):  # ``python benchmarks/turn_credit.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common
from rredcot_verl.core.outcomes import group_outcome_advantage
from rredcot_verl.core.traces import TraceRecord
from rredcot_verl.core.values import compute_segment_values
from rredcot_verl.integration.estimators import ESTIMATORS, AdvantageBatch
from rredcot_verl.runs import load_metrics
from rredcot_verl.tasks import calculator
from rredcot_verl.tasks import build as tasks_build, calculator_miniature as cm
from rredcot_verl.tasks.arithmetic import make_problem
from rredcot_verl.tasks.base import resolve_task
from rredcot_verl.tasks.model import load_model_dir

RESULTS_PATH = common.RESULTS_DIR / "turn_credit.json"
CACHE_DIR = common.ROOT / "outputs" / "turn_credit"
RECIPE = "calculator"
# The recipe's data.max_response_length and max_assistant_turns; a turn is at most the warm start's turn budget.
LOOP = dataclasses.replace(cm.CalculatorBuildConfig(), max_turns=6, max_response_tokens=160)
_RREDCOT = "algorithm.rredcot"
METHODS = {  # name: calculator.yaml overrides
    "grpo": ("algorithm.adv_estimator=grpo",),
    "turn_exit_probe": (),
    "turn_exit_probe_value_differences": (f"{_RREDCOT}.redistribution.degenerate_groups=value_differences",),
    "turn_group_continuation": (f"{_RREDCOT}.probe.value_source=reference_continuation",
                                f"{_RREDCOT}.candidates.source=group"),
}
VALUE_SOURCES = ("turn_exit_probe", "turn_group_continuation")
# The launcher refuses continuation values on multi-turn rollouts (what this benchmark found: docs/choices.md), so
# the step cost is measured for the methods a user can launch.
LAUNCHED = ("grpo", "turn_exit_probe", "turn_exit_probe_value_differences")


def method_settings(name: str):
    """(estimator, ``RRedCoTSettings``) of ``calculator.yaml`` with the method's overrides."""
    return common.method_settings(name, common.Method(RECIPE, METHODS[name]))


# ------------------------------------------------------------------------------------------------------ trajectories
class Player:
    """The warm start, its tokenizer, verl's token builder and the tool: plays and resumes conversations."""

    def __init__(self, build: Path):
        self.model, self.tokenizer = load_model_dir(str(build / "model"))
        self.model.eval()
        self.tools = cm.load_tools()
        self.builder = cm.token_builder(self.tokenizer)
        self.schemas = cm.tool_schemas(self.tools)

    def play(self, problems, rollouts: int, seed: int) -> list[list[dict]]:
        """``rollouts`` sampled trajectories per problem: ``finished`` records with their final loop states."""
        states = [cm.initial_state(self.builder, self.schemas, p) for p in problems for _ in range(rollouts)]
        cm.tool_loop(self.model, self.tokenizer, self.builder, self.tools, states, True, LOOP, seed)
        records = [{**cm.finished(self.tokenizer, s, problems[i // rollouts], LOOP), "state": s}
                   for i, s in enumerate(states)]
        return [records[i * rollouts: (i + 1) * rollouts] for i in range(len(problems))]

    def continuation_scores(self, starts: list[tuple[dict, int, object]], samples: int, seed: int) -> list[float]:
        """Per (finished state, turn, problem): the mean score of ``samples`` continuations resumed at that turn."""
        states = [cm.resumed_state(state, turn) for state, turn, _ in starts for _ in range(samples)]
        cm.tool_loop(self.model, self.tokenizer, self.builder, self.tools, states, True, LOOP, seed)
        scores = [cm.finished(self.tokenizer, s, starts[i // samples][2], LOOP)["score"] for i, s in enumerate(states)]
        return [float(np.mean(scores[i * samples: (i + 1) * samples])) for i in range(len(starts))]


def draw_problems(count: int, seed: int, stream: str):
    rng = random.Random(f"turn-credit:{stream}:{seed}")
    return [make_problem(rng, calculator.TASK_CONFIG) for _ in range(count)]


def prompt_entry(problem, prompt_ids: list[int]) -> dict:
    return {"prompt_ids": prompt_ids, "question": problem.prompt, "ground_truth": str(problem.answer),
            "extra_info": {"operands": list(problem.operands), "ops": list(problem.ops),
                           "expressions": calculator.step_expressions(problem)}}


def make_pool(player: Player, num_prompts: int, rollouts: int, seed: int) -> dict:
    problems = draw_problems(num_prompts, seed, "pool")
    played = player.play(problems, rollouts, seed)
    return {"prompts": [prompt_entry(p, g[0]["prompt_ids"]) for p, g in zip(problems, played)],
            "responses": [[t["response_ids"] for t in g] for g in played],
            "response_masks": [[t["response_mask"] for t in g] for g in played],
            "scores": torch.tensor([[t["score"] for t in g] for g in played], dtype=torch.float32),
            "turns": [[t["turns"] for t in g] for g in played], "calls": [[t["calls"] for t in g] for g in played]}


def trace_records(prompts: list[dict], responses, masks, scores, groups, entropies) -> list[TraceRecord]:
    """Trajectories as a training step's ``TraceRecord``s: the full response with its mask (tool answers in place)."""
    return [TraceRecord(torch.tensor(p["prompt_ids"]), torch.tensor(r), e, float(s), g, p["ground_truth"], None,
                        question=p["question"], extra_info=p["extra_info"], data_source=calculator.DATA_SOURCE,
                        response_mask=torch.tensor(m))
            for p, r, m, s, g, e in zip(prompts, responses, masks, scores, groups, entropies)]


def player_segment_values(player: Player, records: list[TraceRecord], settings):
    return compute_segment_values(player.model, player.tokenizer, records, settings, task=resolve_task(settings.task),
                                  max_positions=player.model.config.max_position_embeddings)


# --------------------------------------------------------------------------------------------------- gradient quality
def gradient_concentration(model, tokenizer, flat: torch.Tensor, rows: int = 4) -> dict:
    """Where a flat gradient's squared norm lies: the share of the (tied) token-embedding matrix, and of its ``rows``
    largest rows, by token. A reference gradient concentrated on a few rows makes every batch's cosine with it close
    to ±1, and the mean cosine a noisy statistic."""
    offset, shares = 0, {}
    total = float(flat.pow(2).sum())
    for name, parameter in model.named_parameters():
        part = flat[offset: offset + parameter.numel()].view(parameter.shape)
        offset += parameter.numel()
        if name.endswith("embed_tokens.weight"):
            row_norms = part.pow(2).sum(1)
            top = row_norms.argsort(descending=True)[:rows].tolist()
            shares = {"embedding_share": float(row_norms.sum()) / total,
                      "top_rows": {tokenizer.convert_ids_to_tokens(i): float(row_norms[i]) / total for i in top}}
    return shares


def evaluate_batch(player: Player, pool: dict, gstar: dict, table: dict, items, methods) -> dict:
    """Per method: cosine, relative error and norm ratio of the batch gradient against g* without the batch."""
    model, pad = player.model, player.tokenizer.pad_token_id
    prompts = [pool["prompts"][p] for p, _ in items]
    responses = [pool["responses"][p][r] for p, r in items]
    masks = [pool["response_masks"][p][r] for p, r in items]
    scores = torch.stack([pool["scores"][p, r] for p, r in items]).float()
    index = np.array([str(p) for p, _ in items], dtype=object)
    logp, mask, entropy = common.forward_log_probs(model, [p["prompt_ids"] for p in prompts], responses, pad,
                                            with_entropy=True, response_masks=masks)
    reference, tokens = common.batch_reference(model, pool, gstar, items, logp, mask)
    records = trace_records(prompts, responses, masks, scores.tolist(), index,
                            [entropy[i, : len(r)].clone() for i, r in enumerate(responses)])
    results = {}
    for method in methods:
        estimator, settings = table[method]
        started, info = time.perf_counter(), {}
        if estimator == "grpo":
            advantages = group_outcome_advantage(scores, index)[0].unsqueeze(-1) * mask
        else:
            segment_ends, raw_values, value_metrics = player_segment_values(player, records, settings)
            outcome = ESTIMATORS[estimator].advantage(
                AdvantageBatch(scores=scores, response_mask=mask, index=index, segment_ends=segment_ends,
                               raw_values=raw_values), settings)
            advantages = outcome.advantages.float()
            info = {"fallback_frac": float(outcome.fallback.float().mean()),
                    "traces_without_candidates": value_metrics.get("rredcot/traces_without_candidates", 0.0)}
        if bool((advantages[mask == 0] != 0).any()):
            raise AssertionError(f"{method}: advantage on a tool-output, template or padding token")
        row = common.gradient_row(model, advantages, logp, mask, tokens, reference)
        results[method] = {**row, "seconds": time.perf_counter() - started, **info}
    return results


def gradient_quality(player: Player, args, cache: Path, table: dict, headline: int) -> dict:
    fingerprint = {"pool_prompts": args.pool_prompts, "pool_rollouts": args.pool_rollouts, "seed": args.seed,
                   "group_size": args.group_size}
    pool, gstar, records, batches_path = common.cached_pool(
        cache, fingerprint, lambda: make_pool(player, args.pool_prompts, args.pool_rollouts, args.seed),
        lambda pool: common.compute_gstar(player.model, pool, player.tokenizer.pad_token_id,
                                   chunk_prompts=max(1, 128 // args.pool_rollouts)))
    print(f"pool: {args.pool_prompts}x{args.pool_rollouts} trajectories ({pool['seconds']:.0f}s), accuracy "
          f"{float(pool['scores'].mean()):.3f}, mean turns {np.mean(pool['turns']):.2f}; g*: split-half cosine "
          f"{gstar['split_half_cosine']:.3f} ({gstar['seconds']:.0f}s)", flush=True)
    results, methods = records["results"], list(METHODS)
    common.run_batches(args, results, methods,
                       lambda items, missing, size, b: evaluate_batch(player, pool, gstar, table, items, missing),
                       lambda: common.write_result(records, batches_path, say=False))
    summary = common.summarise(results, methods, args.sizes, args.grpo_sizes, args.group_size, headline, args.bootstrap,
                        args.seed)
    scores = pool["scores"]
    summary["settings"] = {
        **common.pool_settings(args, scores, headline, pool_mean_turns=float(np.mean(pool["turns"])),
                               pool_mean_calls=float(np.mean(pool["calls"]))),
        "loss": "token mean over the model's tokens of the batch: -sum(A_t log pi(o_t)) / tokens (ratio 1); tool "
                "answers and template tokens between turns are context, in no sum",
        "gstar": {"estimator": "REINFORCE, leave-one-out baseline per prompt, token mean over the model's tokens of "
                               "the pool; the batch's own trajectories removed from it for each batch",
                  "pool_trajectories": int(scores.numel()), "pool_model_tokens": gstar["tokens"],
                  "split_half_cosine": gstar["split_half_cosine"],
                  "spearman_brown_cosine": gstar["spearman_brown_cosine"], "seconds": gstar.get("seconds")},
        "pool_seconds": pool.get("seconds"),
        "gstar_concentration": gradient_concentration(player.model, player.tokenizer, gstar["sum"]),
        "positive_cosine_batches": {method: {str(int(size) * args.group_size): float(np.mean(
            [r["cosine"] > 0 for r in results[method][str(size)].values()])) for size in results[method]}
            for method in methods},
        "ess": f"GRPO's mean cosine fitted as 1/cos^2 = alpha + beta/n over its sizes; ess_over_grpo_at_32: GRPO "
               f"rollouts matching the method's mean cosine at {headline}x{args.group_size} / "
               f"{headline * args.group_size}, bootstrap interval over batches",
    }
    return summary


# ----------------------------------------------------------------------------------------------------- value quality
def holder_segment(record: dict, problem, ends: list[int]) -> int | None:
    """The segment holding a failed trajectory's first wrong tool call: turn k's segment (turns are segments)."""
    wrong = calculator.calculator_wrong_step({"expressions": calculator.step_expressions(problem)}, record["response"])
    if record["score"] > 0 or wrong is None:
        return None
    turn = wrong[0] - 1
    return turn if turn < len(ends) else None


def value_quality(player: Player, args, cache: Path, table: dict) -> dict:
    path = cache / "value_quality.json"
    fingerprint = {"prompts": args.vq_prompts, "samples": args.vq_samples, "mc": args.mc_samples, "seed": args.seed}
    if path.exists() and json.loads(path.read_text()).get("fingerprint") == fingerprint:
        per_trace = json.loads(path.read_text())["per_trace"]
        seconds = json.loads(path.read_text())["seconds"]
    else:
        started = time.perf_counter()
        problems = draw_problems(args.vq_prompts, args.seed, "value_quality")
        played = player.play(problems, args.vq_samples, args.seed + 1)
        flat = [(i, t) for i, group in enumerate(played) for t in group]
        prompts = [prompt_entry(problems[i], t["prompt_ids"]) for i, t in flat]
        _, _, entropy = common.forward_log_probs(player.model, [p["prompt_ids"] for p in prompts],
                                          [t["response_ids"] for _, t in flat], player.tokenizer.pad_token_id,
                                          with_entropy=True, response_masks=[t["response_mask"] for _, t in flat])
        records = trace_records(prompts, [t["response_ids"] for _, t in flat], [t["response_mask"] for _, t in flat],
                                [t["score"] for _, t in flat], [str(i) for i, _ in flat],
                                [entropy[k, : len(t["response_ids"])].clone() for k, (_, t) in enumerate(flat)])
        ends, values, seconds = None, {}, {}
        for name in VALUE_SOURCES:
            t0 = time.perf_counter()
            segment_ends, raw_values, _ = player_segment_values(player, records, table[name][1])
            seconds[name] = time.perf_counter() - t0
            trace_ends = [[e for e in row.tolist() if e >= 0] for row in segment_ends]
            if ends is not None and trace_ends != ends:
                raise RuntimeError("segmentation differs between value sources")
            ends = trace_ends
            values[name] = [raw_values[k, : len(e)].tolist() for k, e in enumerate(ends)]
        starts = []  # (state, turn, problem) of every S_k, k < K
        for k, (i, t) in enumerate(flat):
            for start in [0, *ends[k][:-1]]:
                if start not in t["turn_starts"]:
                    raise RuntimeError(f"segment start {start} is not an assistant-turn start {t['turn_starts']}")
                starts.append((t["state"], t["turn_starts"].index(start), problems[i]))
        t0 = time.perf_counter()
        mc = player.continuation_scores(starts, args.mc_samples, args.seed + 2)
        seconds["mc"] = time.perf_counter() - t0
        per_trace, cursor = [], 0
        for k, (i, t) in enumerate(flat):
            count = len(ends[k])
            per_trace.append({
                "response": t["response"], "outcome": t["score"], "turns": t["turns"], "calls": t["calls"],
                "segment_ends": ends[k], "turn_starts": t["turn_starts"], "mc": mc[cursor: cursor + count],
                **{name: [None if v != v else v for v in values[name][k]] for name in VALUE_SOURCES},
                "holder_segment": holder_segment(t, problems[i], ends[k])})
            cursor += count
        seconds["total"] = time.perf_counter() - started
        common.write_result({"fingerprint": fingerprint, "per_trace": per_trace, "seconds": seconds}, path, say=False)
    return {**value_tables(per_trace), "seconds": seconds, "per_trace": per_trace}


def _series(values) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def value_tables(per_trace: list[dict]) -> dict:
    """Per value source (and MC itself): Spearman/Pearson with MC over states, and localisation of the first wrong
    call by the most negative segment reward."""
    traces = {"n": len(per_trace), "correct": int(sum(t["outcome"] > 0 for t in per_trace)),
              "states": int(sum(len(t["segment_ends"]) for t in per_trace)),
              "mean_turns": float(np.mean([t["turns"] for t in per_trace])),
              "failed_with_wrong_call": int(sum(t["holder_segment"] is not None for t in per_trace))}
    sources = {}
    for name in (*VALUE_SOURCES, "mc"):
        together = common.correlations([(_series(t[name]), _series(t["mc"])) for t in per_trace])
        hits, chance = [], []
        for t in per_trace:
            rewards = np.diff(np.append(_series(t[name]), t["outcome"]))
            hit = common.localisation_hit([None if r != r else float(r) for r in rewards], t["holder_segment"])
            if hit is not None:
                hits.append(hit[0])
                chance.append(hit[1])
        sources[name] = {"spearman": together["spearman"], "pearson": together["pearson"],
                         "n_states": together["n_points"], "within_trace_spearman": together["within_spearman"],
                         "within_trace_n": together["within_n"],
                         "localisation": float(np.mean(hits)) if hits else None, "localisation_n": len(hits),
                         "localisation_chance": float(np.mean(chance)) if chance else None,
                         "nan_fraction": float(np.mean([v is None for t in per_trace for v in t[name]]))}
    return {"traces": traces, "sources": sources}


# --------------------------------------------------------------------------------------------------------- step cost
def step_cost(build: Path, args, cache: Path) -> dict:
    """``--cost-steps`` steps of the calculator recipe per launched method, one after another (one sitting)."""

    def row(out: Path) -> dict:
        logged = load_metrics(out / "metrics.jsonl")
        steps = [r for r in logged if r["step"] >= 2]
        return {"median_step_s": common.median_step_s(logged),
                "median_adv_s": statistics.median(r.get("timing_s/adv", float("nan")) for r in steps),
                "steps": len(steps), "mean_score": float(np.mean([r["critic/score/mean"] for r in steps])),
                "failed_groups": int(sum(r["rollout/failed_groups"] for r in steps))}

    runs = {name: (common.Method(RECIPE, METHODS[name]), cache / "runs" / name) for name in LAUNCHED}
    return common.cost_runs(runs, args.cost_steps, args.seed + 1, build, row, preset=RECIPE,
                            overrides=(f"trainer.total_training_steps={args.cost_steps}",))


# ---------------------------------------------------------------------------------------------------------------- run
def print_tables(result: dict) -> None:
    gq = result["gradient_quality"]
    print(f"GRADIENT QUALITY ({gq['settings']['pool_prompts']}x{gq['settings']['pool_rollouts_per_prompt']} pool, "
          f"accuracy {gq['settings']['pool_accuracy']:.3f})")
    common.print_gradient_table({**gq, "settings": {"gstar": {**gq["settings"]["gstar"], "pool_rollouts":
                                                       gq["settings"]["gstar"]["pool_trajectories"]}}},
                         gq["settings"]["group_size"])
    vq = result["value_quality"]
    common.print_table([{"source": name, **e} for name, e in vq["sources"].items()],
                       ["source", "spearman", "pearson", "within_trace_spearman", "localisation", "localisation_n",
                        "localisation_chance"], f"VALUE QUALITY {vq['traces']}")
    if result.get("step_cost"):
        common.print_table([{"method": name, **row} for name, row in result["step_cost"].items()],
                           ["method", "median_step_s", "over_grpo"], "STEP COST (median timing_s/step, steps >= 2)")


def main(argv: list[str] | None = None) -> dict:
    cli = common.parser(__doc__, RESULTS_PATH, "tiny pool, one batch size, MC K=2, no launches; temp cache and output",
                        build=False)
    cli.add_argument("--cache", type=Path, default=None, help=f"caches (default {CACHE_DIR})")
    common.add_pool_arguments(cli, pool_rollouts=32)
    cli.add_argument("--vq-prompts", type=int, default=24)
    cli.add_argument("--vq-samples", type=int, default=4)
    cli.add_argument("--mc-samples", type=int, default=16)
    cli.add_argument("--cost-steps", type=int, default=5, help="steps per launch for the step cost (0: none)")
    args = cli.parse_args(argv)
    if args.smoke:
        args.pool_prompts, args.pool_rollouts, args.sizes, args.grpo_sizes, args.batches = 4, 8, [2], [], 2
        args.vq_prompts, args.vq_samples, args.mc_samples, args.cost_steps, args.bootstrap = 2, 2, 2, 0, 20
    cache = args.cache or (Path(tempfile.mkdtemp()) / "turn_credit" if args.smoke else CACHE_DIR)
    out = args.out or (cache / "turn_credit.json" if args.smoke else RESULTS_PATH)
    headline = common.start_pool_protocol(cli, args)
    cache.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    build = cache / "build"
    tasks_build.build(tasks_build.testbed("calculator"), str(build), log=lambda *a, **k: None)  # the shipped warm start
    player = Player(build)
    table = {name: method_settings(name) for name in METHODS}
    result = {"gradient_quality": gradient_quality(player, args, cache, table, headline),
              "value_quality": value_quality(player, args, cache, table),
              "step_cost": step_cost(build, args, cache) if args.cost_steps else None}
    warm_start = json.loads((build / tasks_build.BUILD_RECORD).read_text())["warm_start"]["sft"]["kept"]
    result["settings"] = {
        "task": "calculator (tasks/calculator.py): 3 operands of 1..9, two tool calls and a boxed answer",
        "model": "the shipped calculator warm start (rredcot_verl/tasks/assets/calculator_warmstart)",
        "warm_start_sampled_accuracy": warm_start["sampled"]["accuracy"],
        "loop": {"engine": "HF generate at temperature 1 in verl's ToolAgentLoop turn order (hermes parser, the "
                           "calculator tool, verl's Continuous Token builder)", "max_turns": LOOP.max_turns,
                 "max_response_tokens": LOOP.max_response_tokens, "max_turn_tokens": LOOP.max_turn_tokens},
        "methods": {name: f"recipes/tiny_cpu/{RECIPE}.yaml" + (f" with {', '.join(o)}" if o else " as is")
                    for name, o in METHODS.items()},
        "seed": args.seed, "mc_samples": args.mc_samples, "cost_steps": args.cost_steps,
        "commands": {"run": ".venv/bin/python -m benchmarks.turn_credit  (rerun: resumes from --cache)",
                     "smoke": ".venv/bin/python -m benchmarks.turn_credit --smoke"},
        "argv": sys.argv[1:] if argv is None else argv, "wall_s": time.perf_counter() - started,
        **common.machine_meta()}
    print_tables(result)
    return common.write_result(result, out)


if __name__ == "__main__":
    main()
