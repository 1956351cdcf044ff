"""Run shapes this package's estimators cannot serve, refused at launch with the key to change (thin).

Each check reads only the composed config and, where it needs one, the model's ``transformers`` config; it returns the
one-line refusal or None. They apply to the estimators of ``integration/estimators`` (``spec`` not None): ``grpo``
and every other verl estimator run through the launcher exactly as through ``verl.trainer.main_ppo``. The support
matrix (``benchmarks/support_matrix.py``, docs/usage.md) records each shape's outcome.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rredcot_verl.core.model_support import value_pass_refusal
from rredcot_verl.core.settings import settings_from_config
from rredcot_verl.integration import dataset_files
from rredcot_verl.integration.estimators import generates
from rredcot_verl.integration.estimators.ibpo import REPAIR_STAGE
from rredcot_verl.integration.estimators.segment_mc import CONTINUATION_STAGE

# verl's agent loop for plain single-turn generation; any other loop (tool_agent, a custom one) returns multi-turn
# trajectories whose response_mask has holes over the tool output and template tokens between turns.
SINGLE_TURN_AGENT_LOOP = "single_turn_agent"


def _get(config: DictConfig, dotted: str, default=None):
    node: Any = config
    for key in dotted.split("."):
        if node is None or not hasattr(node, "get"):
            return default
        node = node.get(key, None)
    return default if node is None else node


def megatron(config: DictConfig, spec, hf_config) -> str | None:
    """The value pass calls the actor module as one model; Megatron's engine holds a list of model chunks."""
    strategy = str(_get(config, "actor_rollout_ref.actor.strategy", "fsdp"))
    if spec.uses_value_pass and strategy == "megatron":
        return (
            f"actor_rollout_ref.actor.strategy=megatron is not supported with algorithm.adv_estimator={spec.name}: "
            "the segment value pass runs on FSDP/FSDP2 actors only; use strategy=fsdp2 (or adv_estimator=ibpo, "
            "which needs no value pass)"
        )
    return None


def value_pass_model(config: DictConfig, spec, hf_config) -> str | None:
    """A model the value pass cannot score exactly (``core.model_support.value_pass_refusal``, the predicate the value
    pass itself checks before scoring), read from the model's config with verl's ``override_config`` applied."""
    if not spec.uses_value_pass or hf_config is None:
        return None
    from verl.utils.model import update_model_config

    overrides = _get(config, "actor_rollout_ref.model.override_config", {})
    if isinstance(overrides, DictConfig):
        overrides = OmegaConf.to_container(overrides, resolve=True)
    hf_config = copy.deepcopy(hf_config)
    # As verl's HFModelConfig applies them to the actor's config (workers/config/model.py).
    update_model_config(hf_config, overrides.get("model_config", overrides))
    refusal = value_pass_refusal(hf_config)
    if refusal is not None:
        return (
            f"actor_rollout_ref.model.path is a {getattr(hf_config, 'model_type', '?')} model with {refusal}: the "
            f"segment value pass of algorithm.adv_estimator={spec.name} cannot score it exactly; use "
            "adv_estimator=ibpo or another model"
        )
    return None


def training_agent_loops(config: DictConfig) -> set[str]:
    """The agent loops verl 0.9.1 runs for the training rows: a file with an ``agent_name`` column runs each row's
    own loop, one without it ``agent.default_agent_loop`` (verl's agent-loop worker). The whole column of every local
    training file (one column of a parquet file: cheap); a remote file, which verl copies at start, counts as the
    default."""
    default = str(_get(config, "actor_rollout_ref.rollout.agent.default_agent_loop", SINGLE_TURN_AGENT_LOOP))
    files = _get(config, "data.train_files", [])
    loops: set[str] = set()
    for file in [files] if isinstance(files, str) else list(files):
        if not dataset_files.is_local_file(file) or "agent_name" not in dataset_files.column_names(file):
            loops.add(default)
            continue
        loops |= {str(name) for name in dataset_files.read_column(file, "agent_name")}
    return loops or {default}


def multi_turn_key(config: DictConfig) -> str | None:
    """The setting that makes rollouts multi-turn (an agent loop other than the single-turn one, chosen by the config
    or by the training rows as verl chooses it), as ``key=value``; None for single-turn. verl's V1 trainer never reads
    ``rollout.multi_turn.enable`` (only its legacy trainer does, refused here), so that flag alone changes nothing."""
    default = str(_get(config, "actor_rollout_ref.rollout.agent.default_agent_loop", SINGLE_TURN_AGENT_LOOP))
    loops = training_agent_loops(config) - {SINGLE_TURN_AGENT_LOOP}
    if default in loops:
        return f"actor_rollout_ref.rollout.agent.default_agent_loop={default}"
    if loops:
        return f"data.train_files rows with agent_name={sorted(loops)[0]}"
    if _get(config, "actor_rollout_ref.rollout.agent.agent_loop_config_path"):
        return "actor_rollout_ref.rollout.agent.agent_loop_config_path"
    return None


def multi_turn(config: DictConfig, spec, hf_config) -> str | None:
    """Multi-turn tool trajectories: the value pass and the redistribution read them with their holes (tool output
    and template tokens are context, never credited), but IBPO's repairs and ``segment_mc``'s continuations are
    single-turn generations without tools, which cannot continue an agent's trajectory; and a reference or own
    continuation scores a trajectory's text without its tool answers (a bank entry glues its assistant turns), so
    the value pass takes exit probes only."""
    key = multi_turn_key(config)
    if key is None:
        return None
    settings = settings_from_config(_get(config, "algorithm"))
    stages = spec.stages(settings)
    if generates(stages):
        generated = "IBPO's repairs" if REPAIR_STAGE in stages else "Monte-Carlo continuations"
        source = settings.candidates.source
        estimator = (f"{spec.name} and algorithm.rredcot.candidates.source={source}" if spec.name == "rredcot"
                     else spec.name)
        return (
            f"{key} (multi-turn rollouts) is not supported with algorithm.adv_estimator={estimator}: {generated} "
            "are single-turn generations without tools; use a single-turn rollout, or adv_estimator=rredcot with a "
            "candidates.source other than group_and_repairs"
        )
    value_source = settings.probe.value_source
    if spec.uses_value_pass and value_source != "exit_probe":
        return (
            f"{key} (multi-turn rollouts) is not supported with algorithm.rredcot.probe.value_source={value_source}:"
            " its continuations are a trajectory's assistant turns glued without the tool answers between them, a "
            "text the policy never saw (on the calculator task every such value was 0 and every trace fell back to "
            "GRPO); use probe.value_source=exit_probe"
        )
    return None


def sampling(config: DictConfig, spec, hf_config) -> str | None:
    """Values and extra generations of another policy than the rollouts': the value pass scores probes under
    softmax(logits / rollout temperature) over the whole vocabulary, and IBPO's repairs and ``segment_mc``'s
    continuations sample at their own temperature with neither top-p nor top-k. A temperature that differs from the
    rollout's, or a rollout that truncates its distribution (top_p < 1, top_k > 0), would make every value one of
    another policy; greedy rollouts (temperature 0) leave the value pass's distribution undefined."""
    rollout = "actor_rollout_ref.rollout"
    temperature = float(_get(config, f"{rollout}.temperature", 1.0))
    if spec.uses_value_pass and not temperature > 0:
        # verl's own log-prob pass clamps the temperature to 1e-8; the value pass refuses it before scoring, which
        # would stop the run after its first rollouts.
        return (
            f"{rollout}.temperature={temperature:g} (greedy rollouts) is not supported with algorithm.adv_estimator="
            f"{spec.name}: the value pass scores probes under softmax(logits / temperature), which a temperature of 0 "
            "leaves undefined; sample the rollouts at a temperature > 0"
        )
    settings = settings_from_config(_get(config, "algorithm"))
    stages = spec.stages(settings)
    own_temperatures = []
    if REPAIR_STAGE in stages:
        own_temperatures.append(("ibpo.revision_temperature", settings.ibpo.revision_temperature, "IBPO's repairs"))
    if CONTINUATION_STAGE in stages:
        own_temperatures.append(("segment_mc.temperature", settings.segment_mc.temperature, "the continuations"))
    for key, value, generated in own_temperatures:
        if float(value) != temperature:
            return (
                f"algorithm.rredcot.{key}={value:g} differs from {rollout}.temperature={temperature:g}: {generated} "
                f"would sample another policy than the rollouts; set algorithm.rredcot.{key}={temperature:g} (or "
                f"${{{rollout}.temperature}})"
            )
    top_p, top_k = float(_get(config, f"{rollout}.top_p", 1.0)), int(_get(config, f"{rollout}.top_k", -1))
    truncation = f"{rollout}.top_p={top_p:g}" if top_p < 1.0 else (f"{rollout}.top_k={top_k}" if top_k > 0 else None)
    if truncation is None:
        return None
    uses = (("the value pass's probes", spec.uses_value_pass), ("IBPO's repairs", REPAIR_STAGE in stages),
            ("the Monte-Carlo continuations", CONTINUATION_STAGE in stages))
    readers = [name for name, used in uses if used]
    return (
        f"{truncation} is not supported with algorithm.adv_estimator={spec.name}: {' and '.join(readers)} use the "
        f"policy's whole distribution at the rollout temperature, not the truncated one the rollouts sample; set "
        f"{rollout}.top_p=1 and {rollout}.top_k=-1"
    )


def bypass_mode(config: DictConfig, spec, hf_config) -> str | None:
    """In bypass mode verl skips the old-log-prob pass, around which the estimators' stages run."""
    if bool(_get(config, "algorithm.rollout_correction.bypass_mode", False)):
        return (
            f"algorithm.rollout_correction.bypass_mode=true is not supported with algorithm.adv_estimator={spec.name}:"
            " its inputs are produced around verl's old-log-prob pass, which bypass mode skips; set it to false"
        )
    return None


def legacy_trainer(config: DictConfig, spec, hf_config) -> str | None:
    """The estimators' stages hook into verl's V1 trainer only."""
    if not bool(_get(config, "trainer.use_v1", True)):
        return (
            f"trainer.use_v1=false (verl's legacy trainer) is not supported with algorithm.adv_estimator={spec.name}:"
            " its stages run in verl's V1 trainer; set trainer.use_v1=true"
        )
    return None


def group_size(config: DictConfig, spec, hf_config) -> str | None:
    """Every estimator here compares the traces of one prompt; a group of one keeps GRPO's advantage (zero)."""
    n = int(_get(config, "actor_rollout_ref.rollout.n", 1))
    if n < 2:
        return (
            f"actor_rollout_ref.rollout.n={n} gives groups of one trace, which algorithm.adv_estimator={spec.name} "
            "cannot compare (every trace would fall back); set actor_rollout_ref.rollout.n >= 2"
        )
    return None


def kl_in_reward(config: DictConfig, spec, hf_config) -> str | None:
    """With KL in the reward, verl hands the estimator the KL-penalised sum, no longer an outcome on the declared
    scale, and every trace whose sum leaves ``reward_range`` falls back."""
    if bool(_get(config, "algorithm.use_kl_in_reward", False)):
        return (
            f"algorithm.use_kl_in_reward=true is not supported with algorithm.adv_estimator={spec.name}: the outcome "
            "it redistributes would carry the per-token KL penalty; use actor_rollout_ref.actor.use_kl_loss=true"
        )
    return None


def overlong_penalty(config: DictConfig, spec, hf_config) -> str | None:
    """DAPO's reward manager subtracts a penalty from responses that run into its overlong buffer: a right answer then
    scores below the top of ``reward_range`` (not correct) and a wrong one below its bottom (a fallback), exactly as
    KL in the reward moves outcomes off the scale. verl reads it from ``reward.reward_kwargs`` (or the legacy
    ``reward_model.reward_kwargs``, which it moves there) with the ``dapo`` reward manager."""
    manager = _get(config, "reward.reward_manager.name", "naive")
    legacy_manager = _get(config, "reward_model.reward_manager", None)
    kwargs_key = "reward.reward_kwargs"
    if _get(config, "reward_model.reward_kwargs", None) is not None:  # verl moves the legacy kwargs over the new ones
        kwargs_key = "reward_model.reward_kwargs"
    if str(legacy_manager or manager) != "dapo" or not bool(_get(config, f"{kwargs_key}.overlong_buffer_cfg.enable",
                                                                  False)):  # fmt: skip
        return None
    return (
        f"{kwargs_key}.overlong_buffer_cfg.enable=true (DAPO's overlong penalty) is not supported with "
        f"algorithm.adv_estimator={spec.name}: it moves the outcomes it redistributes off "
        "algorithm.rredcot.reward_range, as KL in the reward would; set it to false (data.max_response_length still "
        "bounds the responses)"
    )


def critic(config: DictConfig, spec, hf_config) -> str | None:
    """The estimators write advantages directly; a critic's values and GAE would be trained and then unused."""
    if bool(_get(config, "critic.enable", False)):
        return (
            f"critic.enable=true is not supported with algorithm.adv_estimator={spec.name}: its advantages come from "
            "segment values, not a critic; set critic.enable=false (or adv_estimator=gae for PPO with a critic)"
        )
    return None


def reward_model(config: DictConfig, spec, hf_config) -> str | None:
    """A reward model's scores have no declared scale; correctness and the redistribution need outcomes on
    ``algorithm.rredcot.reward_range``, and extra generations are judged by the rule reward."""
    if bool(_get(config, "reward.reward_model.enable", False)):
        return (
            f"reward.reward_model.enable=true is not supported with algorithm.adv_estimator={spec.name}: it needs a "
            "rule reward on algorithm.rredcot.reward_range (reward.custom_reward_function); set it to false"
        )
    return None


# In the order a user meets them (trainer, rollout, reward, model); the launcher raises the first refusal.
SHAPE_CHECKS: tuple[Callable[[DictConfig, Any, Any], str | None], ...] = (
    legacy_trainer, bypass_mode, critic, group_size, multi_turn, sampling, kl_in_reward, overlong_penalty, reward_model,
    megatron, value_pass_model,
)  # fmt: skip


def micro_batches(config: DictConfig) -> str | None:
    """verl splits each rank's traces into micro batches without a remainder when it does not balance them by length
    (``use_dynamic_bsz`` off): its log-prob pass and its update assert it after the first rollouts. Checked here for
    every estimator, verl's included, so that a step's trace count (prompts x ``rollout.n``) that does not split
    stops before Ray starts."""
    n = int(_get(config, "actor_rollout_ref.rollout.n", 1))
    ranks = int(_get(config, "trainer.n_gpus_per_node", 1)) * int(_get(config, "trainer.nnodes", 1))
    data_parallel = max(ranks // int(_get(config, "actor_rollout_ref.actor.ulysses_sequence_parallel_size", 1)), 1)
    passes = (
        ("data.train_batch_size", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
         "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
         "actor_rollout_ref.actor.use_dynamic_bsz"),
    )
    for prompts_key, micro_key, dynamic_key in passes:
        prompts, micro = _get(config, prompts_key), _get(config, micro_key)
        if prompts is None or micro is None or _get(config, dynamic_key, False):
            continue
        traces = int(prompts) * n
        # A rank with fewer traces than one micro batch is left to verl (not observed to fail here); more traces than
        # a micro batch that do not split stopped the verdict study's grpo_n5 runs (40 traces, micro batches of 16).
        per_rank = traces // data_parallel
        if traces % data_parallel == 0 and per_rank > int(micro) and per_rank % int(micro):
            return (
                f"{micro_key}={micro} does not divide the {per_rank} traces a rank gets ({prompts_key}={prompts} x "
                f"actor_rollout_ref.rollout.n={n} over {data_parallel} data-parallel ranks): verl would stop at the "
                f"first log-prob pass or update; choose a divisor of {per_rank} or set {dynamic_key}=true"
            )
    return None


def shape_refusal(config: DictConfig, spec, hf_config) -> str | None:
    """The first refusal of ``SHAPE_CHECKS`` for this package's estimator ``spec`` (None for verl's own)."""
    if spec is None:
        return None
    for check in SHAPE_CHECKS:
        message = check(config, spec, hf_config)
        if message:
            return message
    return None
