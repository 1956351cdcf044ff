"""Extra generation through the running rollout engine: IBPO repairs and Monte-Carlo continuations (thin).

Both run in the trainer process, with the same vLLM servers (and weights) that produced the step's rollouts: repairs
before verl's old-log-prob pass, continuations after it (they need its entropies). They receive the step's traces
(``StepTraces``) and a ``RolloutContext``: a ``generate`` function (the trainer passes one over verl's
``LLMServerClient``; tests pass a fake), the step's rule reward, the tokenizer and the settings. Token accounting is
returned as metrics so the cost can be compared with GRPO.

Every extra generation is judged with the reward verl gives the rollouts (:func:`reward_function`), and revision
prompts are rendered with the dataset's ``data.apply_chat_template_kwargs`` as the rollouts' prompts are.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from verl.trainer.ppo.reward import get_custom_reward_fn
from verl.utils.tokenizer import normalize_token_ids
from verl.utils.tokenizer.chat_template import apply_chat_template

from rredcot_verl.core import ibpo, montecarlo, outcomes
from rredcot_verl.core.planning import TraceRecord
from rredcot_verl.core.segmentation import segment_response
from rredcot_verl.core.settings import RRedCoTSettings

if TYPE_CHECKING:  # the estimators import this module
    from rredcot_verl.integration.estimators.base import StepTraces

# (prompt ids, sampling params) -> objects with ``token_ids``, one per request, in order.
GenerateFn = Callable[[list[tuple[list[int], dict]]], list[Any]]


@dataclass
class RolloutContext:
    """What extra rollouts use: generation, scoring, tokenizer, settings and length budgets.

    Attributes:
        generate: runs every (prompt ids, sampling params) request; returns outputs with ``token_ids``.
        score: the rollouts' reward ``score(data_source, solution_str, ground_truth, extra_info) -> float`` (the
            trainer passes :func:`reward_function`'s).
        tokenizer: the policy's tokenizer.
        settings: ``algorithm.rredcot``.
        max_prompt_length / max_response_length: ``data.max_prompt_length`` / ``data.max_response_length``.
        seed: seeds the choice of IBPO references (the training step).
        max_model_length: the rollout engine's context (prompt + generation) in tokens, from
            :func:`engine_max_model_length`. It bounds IBPO's revision prompts, which hold a whole trace and a
            reference and so cannot live within ``data.max_prompt_length``. None: ``max_prompt_length +
            max_response_length``, a context every engine serving the step's rollouts provides (verl's vLLM server
            may provide more), so nothing is sent that the server would have to cut short.
        chat_template_kwargs: ``data.apply_chat_template_kwargs``, which verl renders the rollouts' prompts with (e.g.
            Qwen3's ``enable_thinking``); revision prompts get them too.
    """

    generate: GenerateFn
    score: Callable[..., float]
    tokenizer: Any
    settings: RRedCoTSettings
    max_prompt_length: int
    max_response_length: int
    seed: int
    max_model_length: int | None = None
    chat_template_kwargs: dict = field(default_factory=dict)

    def engine_length(self) -> int:
        """The context a request (prompt + generated tokens) may fill."""
        if self.max_model_length is None:
            return self.max_prompt_length + self.max_response_length
        return self.max_model_length

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat prompt as verl's agent loop renders a rollout's (``ContinuousTokenBuilder.
        render_prompt``: verl's ``apply_chat_template`` with the dataset's kwargs, then ``normalize_token_ids``)."""
        return normalize_token_ids(
            apply_chat_template(
                self.tokenizer, messages, tokenize=True, add_generation_prompt=True, **self.chat_template_kwargs
            )
        )


def engine_max_model_length(config) -> int:
    """The context verl's vLLM server runs with: ``actor_rollout_ref.rollout.max_model_len``, else the model's
    ``max_position_embeddings`` (what ``vLLMHttpServer._validate_configs`` falls back to).

    Args:
        config: verl's full trainer config.
    """
    configured = config.actor_rollout_ref.rollout.get("max_model_len", None)
    if configured is not None:
        return int(configured)
    from transformers import AutoConfig
    from verl.utils.fs import copy_to_local
    from verl.workers.rollout.utils import get_max_position_embeddings

    model = config.actor_rollout_ref.model
    local = copy_to_local(model.path, use_shm=bool(model.get("use_shm", False)))
    hf_config = AutoConfig.from_pretrained(local, trust_remote_code=bool(model.get("trust_remote_code", False)))
    return get_max_position_embeddings(hf_config)


# verl 0.9.1's reward managers (experimental/reward_loop/reward_manager/) whose run_single returns the reward
# function's own result (dapo: without its overlong penalty, checked below); rate_limited scores errors and timeouts 0
# and an importlib manager may do anything. The managers' additions to extra_info (num_turns, the agent loop's fields)
# are not reproduced: they describe the rollout's agent loop, which extra generations do not run.
_SCORE_PRESERVING_MANAGERS = ("naive", "dapo", "gdpo", "remote")


def reward_manager_refusal(config) -> str | None:
    """Why the extra generations could not be judged as verl's reward manager judges the rollouts, or None.

    Args:
        config: verl's full trainer config.
    """
    manager = config.reward.get("reward_manager", None) or {}
    source, manager_name = manager.get("source", "register"), manager.get("name", "naive")  # verl's defaults
    name = f"reward.reward_manager (source={source}, name={manager_name})"
    if source != "register" or manager_name not in _SCORE_PRESERVING_MANAGERS:
        return (
            f"{name} may score a rollout otherwise than its reward function does, and extra generations (repairs, "
            f"continuations) are judged by the reward function: use one of {', '.join(_SCORE_PRESERVING_MANAGERS)}"
        )
    overlong = (config.reward.get("reward_kwargs", None) or {}).get("overlong_buffer_cfg", None)
    if manager_name == "dapo" and overlong is not None and overlong.get("enable", False):
        # DAPO's penalty depends on the response's token count against reward.reward_kwargs.max_resp_len, a budget
        # the rollouts have but repairs (revision budget) and continuations (prefix + continuation) do not share.
        return (
            f"{name} with reward.reward_kwargs.overlong_buffer_cfg.enable=true penalises long rollouts, a penalty "
            "extra generations (repairs, continuations) would not get: set it to false"
        )
    return None


def reward_function(config) -> Callable[[Any, str, Any, Any], float]:
    """The reward verl gives a rollout, as ``score(data_source, solution_str, ground_truth, extra_info) -> float``.

    The function is verl's own ``get_custom_reward_fn`` (``reward.custom_reward_function``: path, name and
    ``reward_kwargs``), called as verl's reward managers call it: by keyword, awaited when it is a coroutine
    function, a dict result read at ``"score"``; the score is then rounded to float32 as verl's ``rm_scores`` holds
    it (the rollouts' outcomes are read from there). Raises ValueError without a custom reward function or with a
    reward manager whose score differs from the function's (:func:`reward_manager_refusal`).

    Args:
        config: verl's full trainer config.
    """
    refusal = reward_manager_refusal(config)
    if refusal:
        raise ValueError(refusal)
    compute_score = get_custom_reward_fn(config)
    if compute_score is None:
        raise ValueError(
            f"adv_estimator={config.algorithm.adv_estimator!r} scores its extra rollouts with the rule reward: set "
            "reward.custom_reward_function.path (and .name, default compute_score)"
        )
    is_async = inspect.iscoroutinefunction(compute_score)

    def score(data_source, solution_str: str, ground_truth, extra_info) -> float:
        kwargs = {"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
                  "extra_info": extra_info}  # fmt: skip
        # Called from the trainer's thread, which runs no event loop between generation calls.
        result = asyncio.run(compute_score(**kwargs)) if is_async else compute_score(**kwargs)
        # NaiveRewardManager.run_single: a dict's "score" is the reward (its other keys are logged).
        value = result["score"] if isinstance(result, dict) else result
        return torch.tensor(value, dtype=torch.float32).item()

    return score


def server_generate(client) -> GenerateFn:
    """A ``GenerateFn`` over verl's ``LLMServerClient``: all requests concurrently."""

    async def generate_all(requests):
        return await asyncio.gather(
            *[client.generate(uuid.uuid4().hex, prompt_ids=ids, sampling_params=dict(p)) for ids, p in requests]
        )

    def generate(requests: list[tuple[list[int], dict]]) -> list[Any]:
        return asyncio.run(generate_all(requests)) if requests else []

    return generate


def _truncated(output, max_tokens: int, eos_id: int) -> bool:
    """The generation stopped at its token budget without an end of sequence, or the server aborted it."""
    if getattr(output, "stop_reason", None) == "aborted":
        return True
    return len(output.token_ids) >= max_tokens and (not output.token_ids or output.token_ids[-1] != eos_id)


def _reward_inputs(record: TraceRecord) -> tuple[Any, Any, Any]:
    """(ground truth, extra_info, data_source) of a trace, as verl's rule reward takes them."""
    if record.ground_truth is None:
        raise ValueError("extra rollouts need reward_model.ground_truth in the dataset (verl's rule-reward format)")
    return record.ground_truth, record.extra_info, record.data_source


def _question(record: TraceRecord, i: int) -> str:
    """The last user message of the dataset's chat prompt (verl's ``raw_prompt``)."""
    if record.question is None:
        raise ValueError(f"trace {i}: raw_prompt has no user message to build a revision prompt from")
    return record.question


# ---------------------------------------------------------------------------------------------------------- IBPO
@dataclass(frozen=True)
class _RepairRequest:
    """One repair to generate: the prompt ids, the trace tokens the repair keeps verbatim before the generated ones,
    and the generation budget."""

    prompt_ids: list[int]
    kept: int
    max_new_tokens: int


def ibpo_repairs(
    ctx: RolloutContext, traces: StepTraces
) -> tuple[dict[str, torch.Tensor], dict[str, float], dict[Any, list[list[int]]]]:
    """For each incorrect trace, repairs guided by sibling references, judged and aligned against the trace.

    A trace is incorrect, and a repair verified, when its outcome falls short of / reaches the top of
    ``settings.reward_range``. Requests by ``ibpo.repair_operator``:

    - ``resume``: the rollout's own prompt ids followed by the trace's first ``k = ibpo.divergence_point(trace,
      reference)`` tokens, generating at most ``max_response_length − k`` tokens; the repair is the kept prefix
      followed by the generation (ids reused, nothing decoded and re-encoded, so the prefix is the trace's exactly).
    - ``rewrite``: the revision template's user message rendered as the rollouts' prompts are, with trace and
      reference texts decoded without special tokens (an end-of-sequence or chat marker copied into the user message
      would close the turn early), generating at most ``ibpo.revision_budget(L)`` tokens.

    A request that does not fit ``ctx.engine_length()`` (or, resumed, leaves no response budget) is skipped and the
    trace's next reference tried. Every incorrect trace is accounted for in the metrics: revised, without a sibling,
    without a reference that fits, or dropped by ``max_revisions``.

    Args:
        ctx: generation, reward, tokenizer, settings and the engine's context length.
        traces: the step's traces (each record's tokens, outcome, prompt group, question and reward inputs).

    Returns:
        ``{"ibpo_phi": (bs,) float32, "ibpo_edited_mask": (bs, R) bool}`` (R = the batch's response width), metrics,
        and per prompt group the token ids of its verified repairs (rewrites included: a correct solution of the
        prompt, whatever it kept of the trace), for a reference bank (``candidates.source: group_and_repairs``).
    """
    cfg = ctx.settings.ibpo
    tokenizer, reward_range = ctx.tokenizer, ctx.settings.reward_range
    records = traces.records
    responses = [record.response_ids.tolist() for record in records]
    correct = outcomes.correct_outcomes(traces.outcomes, reward_range).tolist()
    template = cfg.revision_template or ibpo.DEFAULT_REVISION_TEMPLATE
    engine_length = ctx.engine_length()

    texts: dict[int, str] = {}
    requests_by_pair: dict[tuple[int, int], _RepairRequest] = {}

    def text(i: int) -> str:
        if i not in texts:
            texts[i] = tokenizer.decode(responses[i], skip_special_tokens=True)
        return texts[i]

    def request(i: int, j: int) -> _RepairRequest:
        if cfg.repair_operator == "resume":
            kept = ibpo.divergence_point(responses[i], responses[j])
            prompt = records[i].prompt_ids.tolist() + responses[i][:kept]
            return _RepairRequest(prompt, kept, ctx.max_response_length - kept)
        user = ibpo.build_revision_prompt(_question(records[i], i), text(i), text(j), template)
        prompt = ctx.chat_prompt_ids([{"role": "user", "content": user}])
        return _RepairRequest(prompt, 0, ibpo.revision_budget(len(responses[i]), cfg))

    def fits(i: int, j: int) -> bool:
        requests_by_pair[(i, j)] = planned = request(i, j)
        return ibpo.fits_engine(len(planned.prompt_ids), planned.max_new_tokens, engine_length)

    plan = ibpo.plan_revisions(
        correct, [record.group for record in records], cfg, np.random.default_rng(ctx.seed), responses, usable=fits
    )
    planned = [requests_by_pair[pair] for pair in plan.pairs]
    outputs = ctx.generate(
        [(r.prompt_ids, {"temperature": cfg.revision_temperature, "top_p": 1.0, "max_tokens": r.max_new_tokens})
         for r in planned]
    )  # fmt: skip
    if len(outputs) != len(planned):
        raise ValueError(f"generate returned {len(outputs)} outputs for {len(planned)} revision requests")
    per_trace: dict[int, list[ibpo.RepairEvaluation]] = {}
    verified: dict[Any, list[list[int]]] = {}
    generated_tokens = 0
    for (i, _), r, output in zip(plan.pairs, planned, outputs):
        truth, extra, source = _reward_inputs(records[i])
        generated = list(output.token_ids)
        generated_tokens += len(generated)
        repair = responses[i][: r.kept] + generated
        reward = ctx.score(source, tokenizer.decode(repair, skip_special_tokens=True), truth, extra)
        truncated = _truncated(output, r.max_new_tokens, tokenizer.eos_token_id)
        evaluation = ibpo.evaluate_repair(
            responses[i], repair, outcomes.is_correct(reward, reward_range), truncated, cfg,
            max_repair_tokens=r.kept + r.max_new_tokens,
        )  # fmt: skip
        per_trace.setdefault(i, []).append(evaluation)
        if evaluation.correct:
            verified.setdefault(records[i].group, []).append(repair)
    width = traces.response_width
    phi = torch.zeros(len(responses), dtype=torch.float32)
    masks = []
    for i, response in enumerate(responses):
        evaluations = per_trace.get(i, [])
        phi[i] = ibpo.repair_signal(bool(correct[i]), evaluations, cfg)
        masks.append(ibpo.localisation_mask(evaluations, len(response)))
    metrics = ibpo.repair_metrics([e for es in per_trace.values() for e in es])
    metrics.update(
        {
            "ibpo/incorrect_traces": float(plan.incorrect_traces),
            "ibpo/incorrect_traces_revised": float(len(per_trace)),
            "ibpo/traces_without_reference": float(plan.traces_without_reference),
            "ibpo/traces_without_fitting_reference": float(plan.traces_without_usable_reference),
            "ibpo/traces_skipped_by_cap": float(plan.traces_skipped_by_cap),
            "ibpo/revisions_skipped_by_cap": float(plan.skipped_by_cap),
            "ibpo/revisions_skipped_no_room": float(plan.rejected_pairs),
            "ibpo/extra_prompt_tokens": float(sum(len(r.prompt_ids) for r in planned)),
            "ibpo/extra_generated_tokens": float(generated_tokens),
        }
    )
    if cfg.repair_operator == "resume":
        # How far into the trace the repairs start: near 0, they are fresh solves (the rewrite guard's business).
        kept_fracs = [r.kept / max(len(responses[i]), 1) for (i, _), r in zip(plan.pairs, planned)]
        metrics["ibpo/resume_kept_frac_mean"] = sum(kept_fracs) / len(kept_fracs) if kept_fracs else 0.0
    return {"ibpo_phi": phi, "ibpo_edited_mask": ibpo.stack_edited_masks(masks, width)}, metrics, verified


# ------------------------------------------------------------------------------------------------- segment MC
def monte_carlo_values(ctx: RolloutContext, traces: StepTraces) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Values of S_0..S_{K-1} as the mean reward of K sampled continuations from each boundary prefix.

    A continuation may fill ``data.max_prompt_length + data.max_response_length`` (the length a training rollout may
    have), so a state whose prefix leaves no room gets no continuations and a NaN value; a truncated continuation
    scores 0. Rewards are read on the probability scale, ``(reward − low) / (high − low)`` of ``reward_range``.

    Args:
        ctx: generation, reward, tokenizer, settings (``segment_mc``, ``segmentation``, ``reward_range``).
        traces: the step's traces, with the log-prob pass's entropies.

    Returns:
        ``{"seg_ends": (bs, Kmax) int64, "seg_raw_values": (bs, Kmax + 1) float32}`` (see
        ``montecarlo.monte_carlo_values``) and metrics.
    """
    mc, tokenizer = ctx.settings.segment_mc, ctx.tokenizer
    vocab = ctx.settings.boundary_vocab(tokenizer)
    records = traces.records
    ends = [
        segment_response(record.response_ids, record.entropy.float(), vocab, ctx.settings.segmentation)
        if record.response_ids.numel()
        else []
        for record in records
    ]
    prompts = [record.prompt_ids.tolist() for record in records]
    responses = [record.response_ids.tolist() for record in records]
    def judge(i: int, response_ids: list[int]) -> float:
        # On the probability scale of the other value sources: 1 = the top of the reward range.
        truth, extra, source = _reward_inputs(records[i])
        reward = ctx.score(source, tokenizer.decode(response_ids, skip_special_tokens=True), truth, extra)
        return ctx.settings.success_probability(reward)

    # Requested and judged a chunk of traces at a time (MonteCarloSettings.max_prefix_tokens_per_call).
    tally = montecarlo.ContinuationTally(len(records), montecarlo.max_k(ends, ctx.settings.segmentation.max_segments))
    for requests in montecarlo.continuation_chunks(
        prompts, responses, ends, mc, ctx.max_prompt_length + ctx.max_response_length
    ):
        outputs = ctx.generate(
            [(list(r.prefix_ids), {"temperature": mc.temperature, "top_p": 1.0, "max_tokens": r.max_tokens})
             for r in requests]
        )  # fmt: skip
        if len(outputs) != len(requests):
            raise ValueError(f"generate returned {len(outputs)} outputs for {len(requests)} continuation requests")
        continuations = [
            montecarlo.Continuation(tuple(o.token_ids), _truncated(o, r.max_tokens, tokenizer.eos_token_id))
            for r, o in zip(requests, outputs)
        ]
        tally.add(responses, requests, continuations, judge)
    seg_ends, raw_values, metrics = tally.values(ends, [record.outcome for record in records])
    return {"seg_ends": seg_ends, "seg_raw_values": raw_values}, metrics
