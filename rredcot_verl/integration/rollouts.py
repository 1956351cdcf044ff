"""What extra generation through the running rollout engine shares: IBPO's repairs (``estimators.ibpo.ibpo_repairs``)
and Monte-Carlo continuations (``estimators.segment_mc.monte_carlo_values``) (thin).

Both run in the trainer process, with the same vLLM servers (and weights) that produced the step's rollouts: repairs
before verl's old-log-prob pass, continuations after it (they need its entropies). They receive the step's traces
(``StepTraces``) and its ``StepContext``, whose ``generate`` (the trainer's runs over verl's ``LLMServerClient``,
:func:`server_generate`; tests pass a fake) and ``score`` (:func:`reward_function`) come from here. Token accounting
is returned as metrics so the cost can be compared with GRPO.

Every extra generation is judged with the reward verl gives the rollouts (:func:`reward_function`); revision prompts
are rendered with the dataset's ``data.apply_chat_template_kwargs`` as the rollouts' prompts are
(``StepContext.chat_prompt_ids``). The estimators import this module, so it imports none of them.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import Callable
from typing import Any

import torch
from verl.trainer.ppo.reward import get_custom_reward_fn

from rredcot_verl.core.traces import TraceRecord

# (prompt ids, sampling params) -> objects with ``token_ids``, one per request, in order.
GenerateFn = Callable[[list[tuple[list[int], dict]]], list[Any]]


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


def generation_truncated(output, max_tokens: int, eos_id: int) -> bool:
    """The generation stopped at its token budget without an end of sequence, or the server aborted it."""
    if getattr(output, "stop_reason", None) == "aborted":
        return True
    return len(output.token_ids) >= max_tokens and (not output.token_ids or output.token_ids[-1] != eos_id)


def reward_inputs(record: TraceRecord) -> tuple[Any, Any, Any]:
    """(ground truth, extra_info, data_source) of a trace, as verl's rule reward takes them."""
    if record.ground_truth is None:
        raise ValueError("extra rollouts need reward_model.ground_truth in the dataset (verl's rule-reward format)")
    return record.ground_truth, record.extra_info, record.data_source
