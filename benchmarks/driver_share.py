"""The CPU work our code adds to a training step at paper scale, outside the model's forward: on one core, and on a
driver's cores.

Synthetic traces of the paper recipe's shape (``recipes/paper/qwen3_4b_numina_rredcot.yaml``: 25,000-token responses,
up to 40 segments, groups of ``rollout.n`` = 4, ``train_batch_size`` 128 prompts, so 512 traces a step), with that
recipe's ``algorithm.rredcot`` (boxed-maths task, Qwen3 thinking profile, exit-probe values; ``--profile plain``: the
same traces read as a model's without thinking markers, whose answer region planning finds by decoding prefixes of
each trace). The text is the shipped
word problems' solution paragraphs (``tasks/assets/math_problems.jsonl``), shuffled per trace behind an opening the
group shares, closed by the Qwen3 answer (``</think> ... **Final Answer** \\boxed{a}``), right or wrong by group
(0, 1, 2 or 3 correct of 4: a third of the traces right, a quarter of the groups all wrong); tokenised by the
miniature Qwen3-family tokenizer (``tasks/miniature.py``: byte-level BPE with Qwen3's special tokens and chat template,
1,024 tokens, so fewer characters per token than Qwen3's 152k vocabulary: text-bound parts, decoding and the reward's
parsing, would read about 1.5x more characters per trace there). Entropies are uniform noise.

What is timed, with the package's own functions, in the order a step runs them (CPU seconds of every thread and of
planning's worker processes, and wall seconds; torch on one thread in every process; decoding, the rewrite guard and
planning's worker processes on ``--threads`` cores, one by default):

* driver, ``ibpo`` / ``rredcot_ibpo``: the step's traces read from verl's ragged tensors (``trainer._trace_batch`` on
  in-memory tensors); IBPO's repairs (``estimators.ibpo.ibpo_repairs``, the default ``repair_operator: resume``),
  split into decoding the repairs for the reward (``profiles.decode_batch``, multi-core in a real run), judging
  them with the recipe's reward (``tasks.math_reward``), judging the repairs (``core.ibpo.evaluate_repairs``:
  failures, the rewrite guard's distances, multi-core in a real run, the alignment of the local ones) and
  the rest (the plan, divergence points and requests, φ, masks); a stand-in engine continues every request with
  another problem's body (a repair that leaves the trace at its divergence point, the costliest to align), half of
  them right, and its own time is subtracted.
* driver, ``rredcot`` / ``rredcot_ibpo``: the traces again with entropies; the probe plans (``planning.plan_traces``,
  with the verified repairs in the bank for ``rredcot_ibpo``, ``candidates.source: group_and_repairs``), split into
  decoding the traces, segmentation and probe tokenisation per trace (in ``--threads`` worker processes,
  ``core.processes``: their CPU seconds as they measured them), sending the traces to the workers and reading the
  plans back, and the rest (the group banks, the plans assembled); the pool is started before the step, untimed (a
  run starts it once); and the value pass's request (``DataProto``), pickled as Ray ships it to the workers.
* workers, outside the forward: the probe rows and micro-batches of ``core.scoring`` (``_build_row``,
  ``plan_micro_batches``) and the values from probe log-probs (``values_from_probe_logp``, on random log-probs); split
  over the data-parallel ranks in a real run (8 in the recipe), reported whole.
* driver, the advantage (``shaped_advantages``, ``redistribute`` or ``fused_advantages``) over the (512, 25,000) batch.

Not timed: generation and the forwards (GPU); TransferQueue, whose controller and storage units are Ray actors (the
bytes our hooks fetch and put are counted instead); snapshots, off by default (``snapshot_dir``). Everything scales
with the number of traces, so a run at ``--traces N`` is scaled by 512 / N (``scaled_to_recipe`` in the JSON).

Per estimator: its driver's seconds on one core (every phase's CPU seconds: the work), and projected on C cores as its
one-core phases plus its multi-core phases (``MULTI_CORE_PHASES``: decoding, the rewrite guard, planning per trace)
over C, at C = ``--threads`` (beside the wall seconds measured with them) and at a GPU node driver's
``--node-cores`` (16 by default), where issue 56's bar of 10 s is read. The projection assumes perfect sharing and no
contention: a lower bound, which the wall seconds at ``--threads`` check on a quiet machine.

    python benchmarks/driver_share.py                 # 512 traces, writes benchmarks/results/driver_share.json
    python benchmarks/driver_share.py --traces 64     # measured at 64 traces, scaled to 512
    python benchmarks/driver_share.py --smoke         # 8 traces of 2,000 tokens, seconds; writes to a temp file
    python benchmarks/driver_share.py --threads 0     # the multi-core phases on every core (default: one)
    python benchmarks/driver_share.py --node-cores 32 # the projection for a driver with 32 cores
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from omegaconf import OmegaConf

if __package__ in (None, ""):  # ``python benchmarks/driver_share.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from rredcot_verl.core import ibpo, planning, processes  # noqa: E402
from rredcot_verl.core.concordance import ConcordanceCounts  # noqa: E402
from rredcot_verl.core.fused import fused_advantages  # noqa: E402
from rredcot_verl.core.planning import bank_metrics, plan_traces  # noqa: E402
from rredcot_verl.core.profiles import ProbeTokenizer  # noqa: E402
from rredcot_verl.core.probes import values_from_probe_logp  # noqa: E402
from rredcot_verl.core.redistribution import redistribute  # noqa: E402
from rredcot_verl.core.scoring import _build_row, plan_micro_batches  # noqa: E402
from rredcot_verl.core.settings import settings_from_config  # noqa: E402
from rredcot_verl.tasks import resolve_task  # noqa: E402
from rredcot_verl.tasks.math_reward import compute_score  # noqa: E402
from rredcot_verl.tasks.miniature import (  # noqa: E402
    FAMILIES,
    MathRow,
    MiniatureConfig,
    build_tokenizer,
    load_problems,
)
from rredcot_verl.tasks.model import chat_prompt_ids  # noqa: E402
from rredcot_verl.tasks.reward import extract_boxed_answer  # noqa: E402

RESULTS_PATH = common.RESULTS_DIR / "driver_share.json"
PAPER_RECIPE = common.ROOT / "recipes" / "paper" / "qwen3_4b_numina_rredcot.yaml"
DATA_SOURCE = "numina"
BAR_SECONDS = 10.0  # issue 56's goal: the driver's seconds a step at the paper shape, on a driver node's cores
DRIVER_NODE_CORES = 16  # the cores assumed for a GPU node's driver process (--node-cores), for the projection
CORRECT_PER_GROUP = (0, 1, 2, 3)  # cycled over the groups


@dataclasses.dataclass(frozen=True)
class Shape:
    """The step's shape: traces, response tokens, group size, data-parallel ranks, from the recipe unless told."""

    traces: int
    response_tokens: int
    group_size: int
    ranks: int
    recipe_traces: int


def recipe_shape(recipe, traces: int | None, response_tokens: int | None) -> Shape:
    per_step = int(recipe.data.train_batch_size) * int(recipe.actor_rollout_ref.rollout.n)
    return Shape(traces or per_step, response_tokens or int(recipe.data.max_response_length),
                 int(recipe.actor_rollout_ref.rollout.n), int(recipe.trainer.n_gpus_per_node), per_step)


# ------------------------------------------------------------------------------------------------------ traces
def qwen3_tokenizer():
    """The miniature Qwen3-family tokenizer, trained on the shipped problems (deterministic, seconds)."""
    problems = load_problems()
    rows = [MathRow(p["problem"], extract_boxed_answer(p["solution"]), p["solution"]) for p in problems]
    return build_tokenizer(FAMILIES["qwen3"], rows, MiniatureConfig()), problems


def closing_ids(tokenizer, answer: str) -> list[int]:
    """The end of a Qwen3 thinking response: the thinking closed, the boxed answer, eos."""
    return tokenizer.encode(f"\n</think>\n\n**Final Answer**\n\\boxed{{{answer}}}{tokenizer.eos_token}",
                            add_special_tokens=False)


def wrong_answer(truth: str) -> str:
    """An answer math-verify cannot find equal to ``truth`` (the shipped answers are non-negative)."""
    return "-1" if truth != "-1" else "-2"


def synthetic_step(tokenizer, problems, shape: Shape, seed: int) -> list[dict]:
    """Per trace: prompt ids, response ids (exactly ``shape.response_tokens``), outcome, group, ground truth and
    question, as verl's batch holds them; plus the tokens of every trace's body (for the stand-in engine)."""
    rng = random.Random(seed)
    paragraphs = [p for problem in problems for p in problem["solution"].split("\n\n")]
    traces = []
    for group in range(shape.traces // shape.group_size):
        problem = problems[group % len(problems)]
        truth = extract_boxed_answer(problem["solution"])
        prompt = chat_prompt_ids(tokenizer, problem["problem"])
        opening = tokenizer.encode(f"<think>\nLet me restate the problem. {problem['problem']}\n\n",
                                   add_special_tokens=False)
        n_correct = CORRECT_PER_GROUP[group % len(CORRECT_PER_GROUP)]
        for member in range(shape.group_size):
            correct = member < n_correct
            answer = truth if correct else wrong_answer(truth)
            closing = closing_ids(tokenizer, answer)
            room = shape.response_tokens - len(opening) - len(closing)
            body: list[int] = []
            while len(body) < room:
                chunk = "\n\n".join(rng.sample(paragraphs, 64)) + "\n\n"
                body += tokenizer.encode(chunk, add_special_tokens=False)
            traces.append({"prompt": prompt, "response": opening + body[:room] + closing, "body": body[:room],
                           "opening": len(opening), "outcome": float(correct), "group": f"g{group}",
                           "truth": truth, "question": problem["problem"]})
    return traces


def ragged_batch(traces: list[dict], with_entropy: bool, seed: int) -> dict:
    """What ``trainer._trace_batch`` fetches from TransferQueue, as in-memory ragged tensors and lists."""
    generator = torch.Generator().manual_seed(seed)
    nested = lambda rows: torch.nested.nested_tensor(rows, layout=torch.jagged)  # noqa: E731
    responses = [torch.tensor(t["response"], dtype=torch.int64) for t in traces]
    scores = []
    for t, r in zip(traces, responses):
        row = torch.zeros(r.numel(), dtype=torch.float32)
        row[-1] = t["outcome"]  # verl's rm_scores: the outcome on the last response token
        scores.append(row)
    data = {
        "prompts": nested([torch.tensor(t["prompt"], dtype=torch.int64) for t in traces]),
        "responses": nested(responses),
        "response_mask": nested([torch.ones(r.numel(), dtype=torch.int64) for r in responses]),
        "rm_scores": nested(scores),
        "uid": [t["group"] for t in traces],
        "reward_model": [{"style": "rule", "ground_truth": t["truth"]} for t in traces],
        "extra_info": [{"index": i} for i in range(len(traces))],
        "data_source": [DATA_SOURCE] * len(traces),
        "raw_prompt": [[{"role": "user", "content": t["question"]}] for t in traces],
    }
    if with_entropy:
        data["entropy"] = nested([2 * torch.rand(r.numel(), generator=generator) for r in responses])
    return data


def nbytes(value) -> int:
    """Bytes of a tensor's values (ragged: its rows'), 0 for lists (TransferQueue pickles those)."""
    if isinstance(value, torch.Tensor):
        rows = value.unbind(0) if value.is_nested else [value]
        return sum(row.numel() * row.element_size() for row in rows)
    return 0


# ------------------------------------------------------------------------------------------------------ timing
class Clock:
    """CPU seconds (``time.process_time``: every thread of the process) and wall seconds of named phases, in order."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.wall: dict[str, float] = {}

    def time(self, name: str, fn, *args, **kwargs):
        started, started_wall = time.process_time(), time.perf_counter()
        result = fn(*args, **kwargs)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.process_time() - started
        self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - started_wall
        return result


class FreshTailEngine:
    """Stand-in for the rollout engine: a resumed request (rollout prompt + the trace's first k tokens) is answered
    with another group's body from k on (a continuation that shares nothing more with the trace, the costliest to
    align) and a closing that is right for every other request; its own CPU time is kept apart to be subtracted."""

    def __init__(self, tokenizer, traces: list[dict], group_size: int):
        self.traces, self.group_size, self.tokenizer = traces, group_size, tokenizer
        self.prompts = {tuple(trace["prompt"]): trace for trace in traces}
        self.seconds = 0.0
        self.wall = 0.0
        self.requests = 0

    def __call__(self, requests):
        started, started_wall = time.process_time(), time.perf_counter()
        outputs = []
        for ids, params in requests:
            trace = next(t for p, t in self.prompts.items() if tuple(ids[: len(p)]) == p)
            kept = len(ids) - len(trace["prompt"])
            position = (self.requests * self.group_size + 1) % len(self.traces)
            if self.traces[position]["question"] == trace["question"]:
                position = (position + self.group_size) % len(self.traces)
            other = self.traces[position]
            answer = trace["truth"] if self.requests % 2 == 0 else wrong_answer(trace["truth"])
            tokens = other["body"][max(kept - trace["opening"], 0):] + closing_ids(self.tokenizer, answer)
            outputs.append(SimpleNamespace(token_ids=tokens[-params["max_tokens"]:], stop_reason=None))
            self.requests += 1
        self.seconds += time.process_time() - started
        self.wall += time.perf_counter() - started_wall
        return outputs


def worker_share(plans, settings, clock: Clock, names: dict[str, str]) -> None:
    """The value pass's CPU work around the forward, as ``core.scoring`` and ``core.values`` do it."""

    def rows_and_batches():
        rows = [_build_row(p.prompt_ids, p.response_ids, p.probes, None, False) for p in plans]
        shapes = [(row.tokens.numel(), len(row.tree_ids)) for row in rows if row.needs_forward]
        return plan_micro_batches(shapes, settings.value_pass.max_token_len)

    clock.time(names["rows"], rows_and_batches)
    logp = [torch.rand(len(p.probes)).log() for p in plans]
    clock.time(names["values"], lambda: [values_from_probe_logp(lp, p.probes, p.num_values, p.value_rule)
                                         for lp, p in zip(logp, plans) if p.probes])


def segment_fields(plans, settings, seed: int):
    """(seg_ends, raw values) as the value pass returns them, values uniform in (0, 1)."""
    k_max = max([settings.segmentation.max_segments, *(p.num_values for p in plans)])
    ends = torch.full((len(plans), k_max), -1, dtype=torch.int64)
    values = torch.full((len(plans), k_max + 1), float("nan"))
    generator = torch.Generator().manual_seed(seed)
    for i, plan in enumerate(plans):
        ends[i, : plan.num_values] = torch.tensor(plan.segment_ends)
        values[i, : plan.num_values] = torch.rand(plan.num_values, generator=generator)
        values[i, plan.num_values] = plan.outcome
    return ends, values


# ------------------------------------------------------------------------------------------------------ the step
TRACES, TRACES_WITH_ENTROPY = "traces (trainer._trace_batch)", "traces with entropies (trainer._trace_batch)"
REPAIRS = "ibpo: plan, requests, phi, masks (rollouts.ibpo_repairs, the rest)"
DECODING = "ibpo: decoding repairs for the reward (profiles.decode_batch)"
JUDGING = "ibpo: judging repairs (tasks.math_reward)"
ALIGNING = "ibpo: failures, rewrite guard, alignment (core.ibpo.evaluate_repairs)"


@contextlib.contextmanager
def timed_attribute(owner, name: str, clock: Clock, phase: str):
    """``owner.name`` timed under ``phase`` while the block runs (how ``ibpo_repairs`` splits its time)."""
    original = getattr(owner, name)
    setattr(owner, name, lambda *args, **kwargs: clock.time(phase, original, *args, **kwargs))
    try:
        yield
    finally:
        setattr(owner, name, original)


def value_stage_names(estimator: str) -> dict[str, str]:
    return {"plans": f"{estimator}: probe plans, banks and the rest (planning.plan_traces)",
            "plans_decoding": f"{estimator}: probe plans, decoding the traces (ProbeTokenizer.decode_batch)",
            "plans_per_trace": f"{estimator}: probe plans, segments and probes per trace (planning._plan_chunk)",
            "plans_dispatch": f"{estimator}: probe plans, sent to and read from the workers (processes.map_chunks)",
            "banks": f"{estimator}: bank metrics",
            "request": f"{estimator}: value-pass request, pickled for Ray",
            "rows": f"{estimator} (workers): probe rows and micro-batches (core.scoring)",
            "values": f"{estimator} (workers): values from probe log-probs"}


ADVANTAGE = {"ibpo": "ibpo: advantage (shaped_advantages)", "rredcot": "rredcot: advantage (redistribute)",
             "rredcot_ibpo": "rredcot_ibpo: advantage (fused_advantages)"}


@contextlib.contextmanager
def driver_threads(threads: int):
    """The driver's multi-core work on ``threads`` cores (0: every core): the tokenizers library's pool (one thread:
    ``TOKENIZERS_PARALLELISM=false``; more: ``RAYON_NUM_THREADS``, read when the pool starts) and the rewrite guard's
    rapidfuzz workers."""
    saved = {key: os.environ.get(key) for key in ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS")}
    if threads == 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    elif threads > 1:
        os.environ["RAYON_NUM_THREADS"] = str(threads)
    original = ibpo.evaluate_repairs
    ibpo.evaluate_repairs = lambda *args, **kwargs: original(*args, **{**kwargs, "workers": threads or -1})
    try:
        yield
    finally:
        ibpo.evaluate_repairs = original
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def timed_plans(clock: Clock, names: dict[str, str], workers: int, *args, **kwargs):
    """``plan_traces(*args, workers=workers, **kwargs)``, its time split as it runs: decoding the traces (the
    tokenizers library's threads), segments and probes per trace (in the worker processes: their CPU seconds as they
    measured them; in this process with one worker), sending the traces to the workers and reading their plans back
    (this process's CPU in ``processes.map_chunks``, one worker: none), and the rest (banks, plans assembled)."""
    started, started_wall = time.process_time(), time.perf_counter()
    in_workers = processes.worker_cpu_seconds()
    dispatch = {"cpu": 0.0, "wall": 0.0}
    map_chunks = processes.map_chunks

    def timed_map(*map_args, **map_kwargs):
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            return map_chunks(*map_args, **map_kwargs)
        finally:
            dispatch["cpu"] += time.process_time() - cpu
            dispatch["wall"] += time.perf_counter() - wall

    decoding = names["plans_decoding"]
    before = clock.seconds.get(decoding, 0.0), clock.wall.get(decoding, 0.0)
    processes.map_chunks = timed_map
    try:
        with timed_attribute(ProbeTokenizer, "decode_batch", clock, decoding):
            plans = plan_traces(*args, workers=workers, **kwargs)
    finally:
        processes.map_chunks = map_chunks
    decoded = clock.seconds.get(decoding, 0.0) - before[0], clock.wall.get(decoding, 0.0) - before[1]
    in_workers = processes.worker_cpu_seconds() - in_workers
    clock.seconds[names["plans_per_trace"]] = in_workers if workers > 1 else dispatch["cpu"]
    clock.seconds[names["plans_dispatch"]] = dispatch["cpu"] if workers > 1 else 0.0
    clock.wall[names["plans_per_trace"]] = dispatch["wall"]  # the chunks' wall, their dispatch in it
    clock.wall[names["plans_dispatch"]] = 0.0
    clock.seconds[names["plans"]] = time.process_time() - started - decoded[0] - dispatch["cpu"]
    clock.wall[names["plans"]] = time.perf_counter() - started_wall - decoded[1] - dispatch["wall"]
    return plans


def start_planning_workers(workers: int, records, settings_of_estimators, tokenizer, task, vocab) -> float:
    """Wall seconds to start the planning pool's processes and load each estimator's context into them, which a run
    pays once, at its first step: plans of traces without a response (no bank, nothing judged here), untimed."""
    started = time.perf_counter()
    if workers > 1:
        empty = [dataclasses.replace(record, response_ids=record.response_ids[:0], entropy=None, ground_truth=None,
                                     group=i) for i, record in enumerate(records[:workers])]
        for use in settings_of_estimators:
            plan_traces(empty, use, tokenizer, task, vocab=vocab, repairs={}, workers=workers)
    return time.perf_counter() - started


def measure(shape: Shape, seed: int, planning_workers: int, profile: str | None = None) -> dict:
    from verl import DataProto

    from rredcot_verl.integration.estimators.base import StepContext, object_array
    from rredcot_verl.integration.estimators import ibpo as ibpo_estimator
    from rredcot_verl.integration.estimators.ibpo import ibpo_repairs
    from rredcot_verl.integration.trainer import step_traces

    torch.set_num_threads(1)
    recipe = OmegaConf.load(PAPER_RECIPE)
    if profile:
        recipe.algorithm.rredcot.probe.profile = profile
    settings = settings_from_config(recipe.algorithm)
    bank_settings = dataclasses.replace(settings, candidates=dataclasses.replace(settings.candidates,
                                                                                 source="group_and_repairs"))
    tokenizer, problems = qwen3_tokenizer()
    step = synthetic_step(tokenizer, problems, shape, seed)
    task = resolve_task(settings.task)
    vocab = settings.boundary_vocab(tokenizer)
    clock = Clock()

    # The trainer's own reading of the step's ragged tensors (TransferQueue's fetch replaced by a dict).
    fetched, read = {}, {}
    for with_entropy, name in ((False, TRACES), (True, TRACES_WITH_ENTROPY)):
        data = ragged_batch(step, with_entropy, seed)
        fetched[name] = sum(nbytes(v) for v in data.values())
        read[with_entropy] = clock.time(name, step_traces, data, with_entropy)
    traces = read[True]
    pool_start_seconds = start_planning_workers(planning_workers, traces.records, (settings, bank_settings), tokenizer,
                                                task, vocab)

    # IBPO's repairs, generation excluded (the stand-in engine's own time is subtracted).
    engine = FreshTailEngine(tokenizer, step, shape.group_size)

    def score(data_source, solution_str, ground_truth, extra_info):
        return clock.time(JUDGING, compute_score, data_source, solution_str, ground_truth, extra_info)

    context = StepContext(settings=settings, tokenizer=tokenizer, step=seed, generate=engine, score=score,
                          max_prompt_length=int(recipe.data.max_prompt_length),
                          max_response_length=int(recipe.data.max_response_length))
    started, started_wall = time.process_time(), time.perf_counter()
    with timed_attribute(ibpo, "evaluate_repairs", clock, ALIGNING), \
            timed_attribute(ibpo_estimator, "decode_batch", clock, DECODING):  # fmt: skip
        repair_inputs, repair_metrics = ibpo_repairs(context, read[False])
    verified = context.verified_repairs
    parts = engine.seconds + sum(clock.seconds.get(phase, 0.0) for phase in (JUDGING, DECODING, ALIGNING))
    clock.seconds[REPAIRS] = time.process_time() - started - parts
    parts_wall = engine.wall + sum(clock.wall.get(phase, 0.0) for phase in (JUDGING, DECODING, ALIGNING))
    clock.wall[REPAIRS] = time.perf_counter() - started_wall - parts_wall

    # The value pass's plans and request, with the recipe's bank and with the repair-filled one; the workers' part.
    plans, request_bytes = {}, {}
    groups = [record.group for record in traces.records]
    for estimator, use, repairs in (("rredcot", settings, None), ("rredcot_ibpo", bank_settings, verified)):
        names = value_stage_names(estimator)
        plans[estimator] = timed_plans(clock, names, planning_workers, traces.records, use, tokenizer, task,
                                       vocab=vocab, temperature=1.0, repairs=repairs)
        clock.time(names["banks"], bank_metrics, plans[estimator], groups)

        def request(plans=plans[estimator], use=use):
            proto = DataProto.from_dict(tensors={"outcome": traces.outcomes},
                                        non_tensors={"plan": object_array(plans)},
                                        meta_info={"max_segments": use.segmentation.max_segments,
                                                   "value_pass": dataclasses.asdict(use.value_pass)})
            return pickle.dumps(proto, protocol=pickle.HIGHEST_PROTOCOL)

        request_bytes[estimator] = len(clock.time(names["request"], request))
        worker_share(plans[estimator], use, clock, names)

    # The advantage over the batch.
    scores, index = traces.outcomes, np.array(groups, dtype=object)
    mask = torch.zeros(len(traces), traces.response_width)
    for i, record in enumerate(traces.records):
        mask[i, : record.response_ids.numel()] = 1.0
    phi, edited = repair_inputs["phi"], repair_inputs["edited_mask"]
    redistribution = dataclasses.replace(settings.redistribution, norm_adv_by_std=True)
    ibpo_cfg = dataclasses.replace(settings.ibpo, norm_adv_by_std=True)
    clock.time(ADVANTAGE["ibpo"], ibpo.shaped_advantages, scores, mask, index, phi, edited, ibpo_cfg,
               settings.reward_range)
    ends, values = segment_fields(plans["rredcot"], settings, seed)
    clock.time(ADVANTAGE["rredcot"], redistribute, scores, mask, index, ends, values, redistribution,
               settings.reward_range, ConcordanceCounts())
    ends, values = segment_fields(plans["rredcot_ibpo"], bank_settings, seed)
    clock.time(ADVANTAGE["rredcot_ibpo"], fused_advantages, scores, mask, index, ends, values, phi, edited, ibpo_cfg,
               redistribution, bank_settings.rredcot_ibpo, settings.reward_range, ConcordanceCounts())

    return {"seconds": clock.seconds, "wall": clock.wall, "repair_metrics": repair_metrics,
            "engine_stand_in_seconds": engine.seconds, "planning_pool_start_wall_seconds": pool_start_seconds,
            "fetched_bytes": fetched, "value_pass_request_bytes": request_bytes,
            "put_bytes": {"ibpo": nbytes(phi) + nbytes(edited), "segment_values": nbytes(ends) + nbytes(values)},
            "characters_per_token": float(np.mean([len(tokenizer.decode(t["response"])) / len(t["response"])
                                                   for t in step[:8]])),
            "segments_per_trace": float(np.mean([p.num_values for p in plans["rredcot"]])),
            "probes_per_trace": float(np.mean([len(p.probes) for p in plans["rredcot"]]))}


# Which phases each estimator's step runs (``trainer._compute_old_log_prob``'s stages, then the advantage).
PLANNING = ("plans_decoding", "plans_per_trace", "plans_dispatch", "plans", "banks", "request")
DRIVER_PHASES = {
    "ibpo": (TRACES, REPAIRS, DECODING, JUDGING, ALIGNING, ADVANTAGE["ibpo"]),
    "rredcot": (TRACES_WITH_ENTROPY, *[value_stage_names("rredcot")[k] for k in PLANNING], ADVANTAGE["rredcot"]),
    "rredcot_ibpo": (TRACES, REPAIRS, DECODING, JUDGING, ALIGNING, TRACES_WITH_ENTROPY,
                     *[value_stage_names("rredcot_ibpo")[k] for k in PLANNING], ADVANTAGE["rredcot_ibpo"]),
}
# The driver's work that runs on several cores: decoding (the tokenizers library's thread pool), the rewrite guard's
# distances (rapidfuzz's workers) and planning's per-trace part (worker processes, ``core.processes``); ``--threads``
# bounds all three here. The rest runs on one core whatever the node.
MULTI_CORE_PHASES = (DECODING, ALIGNING, *[value_stage_names(name)[k] for name in ("rredcot", "rredcot_ibpo")
                                          for k in ("plans_decoding", "plans_per_trace")])
WORKER_PHASES = {name: tuple(value_stage_names(name)[k] for k in ("rows", "values")) for name in ("rredcot",
                                                                                                 "rredcot_ibpo")}


def summarise(measured: dict, shape: Shape, threads: int, node_cores: int) -> dict:
    """Per estimator, its driver's seconds a step: on one core (the CPU seconds of every phase, the workers'
    included: the work), and projected on ``cores`` cores as its one-core phases plus its multi-core phases over
    ``cores`` (``MULTI_CORE_PHASES``; perfect sharing, no contention: a lower bound), at this run's ``threads`` (to
    set beside the wall seconds measured with them) and at a driver node's ``node_cores``; the bar is read there."""
    scale = shape.recipe_traces / shape.traces
    seconds, wall = measured["seconds"], measured["wall"]
    estimators = {}
    for estimator, phases in DRIVER_PHASES.items():
        driver = sum(seconds[p] for p in phases)
        multi_core = sum(seconds[p] for p in phases if p in MULTI_CORE_PHASES)
        driver_wall = sum(wall[p] for p in phases)
        workers = sum(seconds[p] for p in WORKER_PHASES.get(estimator, ()))
        projected = {cores: (driver - multi_core + multi_core / cores) * scale for cores in (threads, node_cores)}
        estimators[estimator] = {
            "driver_seconds": driver, "driver_seconds_scaled": driver * scale,
            "driver_one_core_part_seconds_scaled": (driver - multi_core) * scale,
            "driver_multi_core_part_seconds_scaled": multi_core * scale,
            "driver_seconds_projected_at_threads_scaled": projected[threads],
            "driver_wall_seconds": driver_wall, "driver_wall_seconds_scaled": driver_wall * scale,
            "driver_seconds_projected_at_node_scaled": projected[node_cores],
            "workers_seconds_one_core": workers, "workers_seconds_one_core_scaled": workers * scale,
            "workers_seconds_per_rank_scaled": workers * scale / shape.ranks,
            "within_bar": projected[node_cores] <= BAR_SECONDS,
            "within_bar_on_one_core": driver * scale <= BAR_SECONDS,
            "largest_phase": max(phases, key=lambda p: seconds[p]),
        }
    return {"phases_seconds": seconds, "phases_seconds_scaled": {k: v * scale for k, v in seconds.items()},
            "phases_wall_seconds_scaled": {k: v * scale for k, v in wall.items()}, "estimators": estimators}


def print_table(result: dict) -> None:
    scaled = result["scaled_to_recipe"]
    common.print_table([{"phase": name, "CPU s": value, f"CPU s x{scaled:g}": result["phases_seconds_scaled"][name],
                         f"wall s x{scaled:g} ({result['cores']} cores)": result["phases_wall_seconds_scaled"][name]}
                        for name, value in result["phases_seconds"].items()],
                       ["phase", "CPU s", f"CPU s x{scaled:g}", f"wall s x{scaled:g} ({result['cores']} cores)"])
    threads, node = result["threads"], result["node_cores"]
    common.print_table([{"estimator": name, "one core": e["driver_seconds_scaled"],
                         f"projected, {threads} cores": e["driver_seconds_projected_at_threads_scaled"],
                         f"wall, {threads} cores": e["driver_wall_seconds_scaled"],
                         f"projected, {node} cores": e["driver_seconds_projected_at_node_scaled"],
                         "workers a rank": e["workers_seconds_per_rank_scaled"], "within_bar": e["within_bar"]}
                        for name, e in result["estimators"].items()],
                       ["estimator", "one core", f"projected, {threads} cores", f"wall, {threads} cores",
                        f"projected, {node} cores", "workers a rank", "within_bar"])


def main(argv: list[str] | None = None) -> dict:
    cli = common.parser(__doc__, RESULTS_PATH, "8 traces of 2,000 tokens", build=False)
    cli.add_argument("--traces", type=int, default=None, help="traces measured (default: the recipe's 512)")
    cli.add_argument("--response-tokens", type=int, default=None, help="default: the recipe's 25,000")
    cli.add_argument("--seed", type=int, default=0)
    cli.add_argument("--threads", type=int, default=1,
                     help="cores for decoding, the rewrite guard and planning's worker processes (default 1: all on "
                          "this process's one core; 0: every core)")
    cli.add_argument("--profile", default=None,
                     help="probe.profile instead of the recipe's (plain: the traces read as a model's without thinking "
                          "markers, whose answer region planning finds by decoding prefixes)")
    cli.add_argument("--node-cores", type=int, default=DRIVER_NODE_CORES,
                     help=f"a GPU node driver's cores, for the projection (default {DRIVER_NODE_CORES})")
    args = cli.parse_args(argv)
    if args.threads < 0 or args.node_cores < 1:
        raise SystemExit("--threads must be >= 0 and --node-cores >= 1")
    threads = args.threads or processes.available_cores()
    recipe = OmegaConf.load(PAPER_RECIPE)
    shape = recipe_shape(recipe, 8 if args.smoke else args.traces, 2000 if args.smoke else args.response_tokens)
    if shape.traces % shape.group_size:
        raise SystemExit(f"--traces must be a multiple of the group size {shape.group_size}")
    started = time.perf_counter()
    with driver_threads(threads):
        measured = measure(shape, args.seed, threads, args.profile)
    result = {
        **summarise(measured, shape, threads, args.node_cores),
        "scaled_to_recipe": shape.recipe_traces / shape.traces,
        "bar_seconds_per_step": BAR_SECONDS,
        "shape": dataclasses.asdict(shape),
        "measured": {k: v for k, v in measured.items() if k not in ("seconds", "wall")},
        "cores": os.cpu_count(),
        "threads": threads,
        "planning_workers": threads,
        "node_cores": args.node_cores,
        "multi_core_phases": list(MULTI_CORE_PHASES),
        "timing": ("CPU seconds count every thread of the process and, for planning's per-trace part, of its worker "
                   "processes (as they measured them); wall seconds are this machine's ('cores' cores, shared with "
                   "other jobs); 'threads' cores (threads and planning workers) for the multi-core phases, torch on "
                   "one thread in every process"),
        "projection": ("driver_seconds_projected_at_*: the one-core phases' CPU seconds plus the multi-core phases' "
                       "(multi_core_phases) divided by the cores ('threads', or 'node_cores' for a GPU node's driver): "
                       "perfect sharing, no contention, so a lower bound; the one-core part includes the pool's "
                       "dispatch (pickling the traces out and the plans back). within_bar reads the node's figure, "
                       "within_bar_on_one_core the one-core work"),
        "not_timed": ["generation and the model's forwards (GPU)",
                      "TransferQueue traffic: its controller and storage units are Ray actors; measured.fetched_bytes "
                      "(per _trace_batch read) and measured.put_bytes are what our hooks move through it",
                      "snapshots (off unless algorithm.rredcot.snapshot_dir is set)"],
        "recipe": str(PAPER_RECIPE.relative_to(common.ROOT)),
        "probe_profile": args.profile or OmegaConf.select(recipe, "algorithm.rredcot.probe.profile", default="auto"),
        "command": " ".join(["python benchmarks/driver_share.py", *(argv if argv is not None else sys.argv[1:])]),
        "wall_seconds": time.perf_counter() - started,
        **common.machine_meta(),
    }
    print_table(result)
    return common.write_result(result, common.out_path(args, RESULTS_PATH))


if __name__ == "__main__":
    main()
