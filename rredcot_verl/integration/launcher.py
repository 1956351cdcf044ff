"""``python -m rredcot_verl.main``: verl's PPO entry point with the rredcot estimators, trainer and CPU support.

Config: verl's ``ppo_trainer`` composed with ``conf/rredcot_trainer.yaml`` (hydra), so every verl key works as usual;
``algorithm.adv_estimator`` may be ``grpo`` or any verl estimator, or ``rredcot`` / ``ibpo`` / ``rredcot_ibpo`` /
``segment_mc``, whose settings live under ``algorithm.rredcot``. Every estimator trains with the rredcot trainer, verl's sync trainer plus
the estimators' hooks. Before Ray starts, the launcher checks what would otherwise fail late or hang: one of verl's
async trainer modes, unknown estimator or ``algorithm.rredcot`` keys, a missing/broken model folder (hub ids are
verl's to download), datasets without ``reward_model.ground_truth`` or whose prompts all exceed
``data.max_prompt_length``, a log-prob token budget whose unchunked entropy cannot fit a GPU, extra generations
without a rule reward to judge them, an engine context too short for IBPO's revisions. On a machine without an accelerator it switches on ``rredcot_verl.compat`` and the
matching config (``RREDCOT_CPU=0`` forces it off; ``RREDCOT_CPU=1`` forces it on).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, open_dict

from rredcot_verl.compat.cpu import CPU_ENV, CPU_PROCESS_ENV, accelerator_present, enable_cpu_mode
from rredcot_verl.core.settings import settings_from_config

# Config for a CPU-only run of verl 0.9.1 (docs/cpu.md): fake Ray GPU for verl's resource pools, enough
# logical CPUs for TransferQueue's actors (under-declaring hangs silently), FSDP2 over gloo, sdpa attention, no vLLM
# sleep mode (unsupported on CPU).
CPU_CONFIG = {
    "trainer.device": "cpu",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units": 1,
    "actor_rollout_ref.model.override_config.attn_implementation": "sdpa",
    "actor_rollout_ref.model.use_remove_padding": False,
    "actor_rollout_ref.actor.strategy": "fsdp2",
    "actor_rollout_ref.actor.use_torch_compile": False,
    "actor_rollout_ref.rollout.enable_sleep_mode": False,
    "actor_rollout_ref.rollout.free_cache_engine": False,
    "actor_rollout_ref.rollout.enforce_eager": True,
}


# Resources a local CPU cluster declares: verl's resource pools ask for one (fake) GPU per actor rank, and
# TransferQueue starts ~10 one-CPU actors. A cluster started by hand needs the same (`ray start --head --num-cpus=32
# --num-gpus=<trainer.n_gpus_per_node>`).
LOCAL_CPU_CLUSTER_CPUS = 32


def local_cpu_cluster(config: DictConfig) -> dict:
    gpus = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    return {"ray_kwargs.ray_init.num_cpus": LOCAL_CPU_CLUSTER_CPUS, "ray_kwargs.ray_init.num_gpus": gpus}


# Variables of the launching shell that every Ray process must see (local workers inherit them; a remote cluster
# gets them through runtime_env).
FORWARDED_ENV = ("VERL_FILE_LOGGER_PATH", "RREDCOT_BUILD", "RREDCOT_REWARD_FILE", "RREDCOT_SEED", "RREDCOT_STEPS")


# The verl.plugins entry point; named again for Ray workers on clusters that do not read entry points.
PLUGIN_MODULE = "rredcot_verl.integration.plugin"


class LaunchError(RuntimeError):
    """A configuration problem found before Ray starts; printed without a traceback."""


def _set(config: DictConfig, dotted: str, value) -> None:
    node = config
    *parents, leaf = dotted.split(".")
    with open_dict(config):
        for key in parents:
            if node.get(key) is None:
                node[key] = {}
            node = node[key]
        node[leaf] = value


def use_cpu_mode() -> bool:
    forced = os.environ.get(CPU_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return not accelerator_present()


# A Hugging Face hub id ("Qwen/Qwen3-4B"), which verl downloads itself (workers/config/model.py: copy_to_local).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_remote_model(path: str) -> bool:
    """A hub id or a ``scheme://`` location (hdfs://...) that verl fetches, rather than a local folder."""
    return "://" in path or (_HUB_ID.match(path) is not None and not Path(path).exists())


def check_model_dir(path: str) -> None:
    """A local model folder must hold a config, a tokenizer and weights; hub ids and remote paths are verl's to fetch."""
    if is_remote_model(path):
        return
    folder = Path(path)
    if not folder.is_dir():
        raise LaunchError(
            f"model folder {path!r} does not exist (actor_rollout_ref.model.path); give a local folder or a hub id "
            "such as Qwen/Qwen3-4B"
        )
    missing = [name for name in ("config.json", "tokenizer_config.json") if not (folder / name).is_file()]
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        missing.append("*.safetensors weights")
    if missing:
        raise LaunchError(f"model folder {path!r} is broken: missing {', '.join(missing)}")


def check_dataset(path: str, key: str) -> None:
    import pyarrow.parquet as pq

    files = [path] if isinstance(path, str) else list(path)
    for file in files:
        if not Path(file).is_file():
            raise LaunchError(f"{key} file {file!r} does not exist")
        table = pq.read_table(file, columns=None)
        if "reward_model" not in table.column_names:
            raise LaunchError(f"{key} file {file!r} has no reward_model column (need reward_model.ground_truth)")
        rows = table.column("reward_model").to_pylist()
        bad = sum(1 for row in rows if not isinstance(row, dict) or row.get("ground_truth") is None)
        if bad:
            raise LaunchError(f"{key} file {file!r}: {bad} of {len(rows)} rows lack reward_model.ground_truth")


def _local_pretrained(loader, path: str):
    """``loader.from_pretrained`` on a local folder or a hub id already in the local cache; None otherwise (the
    checks that need it are skipped rather than download at launch)."""
    try:
        return loader.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        return None


def check_prompt_lengths(config: DictConfig, tokenizer, sample: int = 64) -> None:
    """Refuse a training set whose sampled prompts all exceed ``data.max_prompt_length`` with the chat template: verl
    would filter every row out and fail later with ``num_samples=0``."""
    import pyarrow.parquet as pq

    if tokenizer is None or not config.data.get("filter_overlong_prompts", True):
        return
    files = config.data.train_files
    first = files if isinstance(files, str) else list(files)[0]
    key = config.data.get("prompt_key", "prompt")
    first_rows = next(pq.ParquetFile(first).iter_batches(batch_size=sample, columns=[key]), None)
    prompts = [] if first_rows is None else first_rows.column(key).to_pylist()
    kwargs = dict(config.data.get("apply_chat_template_kwargs", None) or {})
    lengths = [
        len(tokenizer.apply_chat_template(list(p), add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs))
        for p in prompts
    ]
    limit = int(config.data.max_prompt_length)
    if lengths and min(lengths) > limit:
        raise LaunchError(
            f"every sampled prompt of {first!r} is longer than data.max_prompt_length={limit} tokens with the chat "
            f"template (shortest {min(lengths)}): verl would filter out the whole dataset; raise data.max_prompt_length"
        )


# Bytes per logit verl's unchunked entropy holds beside the logits (fp32 softmax and product).
_ENTROPY_BYTES_PER_LOGIT = 8
LOGIT_MEMORY_LIMIT_BYTES = 16 << 30


def check_log_prob_memory(config: DictConfig, vocab_size: int | None) -> None:
    """Refuse a log-prob token budget whose unchunked full-vocabulary entropy alone would not fit a GPU (verl computes
    entropy in every log-prob pass, whatever the estimator)."""
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    if vocab_size is None or not rollout.get("log_prob_use_dynamic_bsz", False):
        return
    if actor.get("entropy_from_logits_with_chunking", False) or config.actor_rollout_ref.model.get("use_fused_kernels", False):
        return
    tokens = int(rollout.log_prob_max_token_len_per_gpu)
    need = tokens * vocab_size * _ENTROPY_BYTES_PER_LOGIT
    if need > LOGIT_MEMORY_LIMIT_BYTES:
        raise LaunchError(
            f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={tokens} with a {vocab_size}-token vocabulary "
            f"needs ~{need / 2**30:.0f} GiB for the log-prob pass's unchunked entropy: set "
            "actor_rollout_ref.actor.entropy_from_logits_with_chunking=true (or lower the token budget)"
        )


def _stages(config: DictConfig, settings) -> tuple:
    from rredcot_verl.integration.estimators import ESTIMATORS

    spec = ESTIMATORS.get(str(config.algorithm.adv_estimator))
    return () if spec is None else spec.stages(settings)


def check_rule_reward(config: DictConfig, settings) -> None:
    """Refuse an estimator that judges extra generations (repairs, continuations) without a rule reward to judge them
    with (it would fail at the first step)."""
    from rredcot_verl.integration.estimators import EngineUse

    generates = any(stage.engine_use is not EngineUse.NONE for stage in _stages(config, settings))
    custom = config.reward.get("custom_reward_function", None) or {}
    if generates and not custom.get("path"):
        raise LaunchError(
            f"algorithm.adv_estimator={config.algorithm.adv_estimator} (candidates.source={settings.candidates.source})"
            " judges its extra generations with the rule reward: set reward.custom_reward_function.path (and .name)"
        )


def check_ibpo_context(config: DictConfig, settings, hf_config) -> None:
    """Refuse an engine context in which IBPO could not revise a failure of the full response budget: its revision
    prompt holds the question, the trace and a reference, and the repair may be ``revision_budget`` tokens."""
    from rredcot_verl.core.ibpo import revision_budget
    from rredcot_verl.integration.estimators.ibpo import REPAIR_STAGE

    if REPAIR_STAGE not in _stages(config, settings):
        return
    estimator = str(config.algorithm.adv_estimator)
    context = config.actor_rollout_ref.rollout.get("max_model_len", None)
    if context is None:
        if hf_config is None:
            return
        from verl.workers.rollout.utils import get_max_position_embeddings

        context = get_max_position_embeddings(hf_config)
    prompt, response = int(config.data.max_prompt_length), int(config.data.max_response_length)
    need = prompt + 2 * response + revision_budget(response, settings.ibpo)
    if int(context) < need:
        raise LaunchError(
            f"algorithm.adv_estimator={estimator} generates IBPO repairs: revising a {response}-token failure needs "
            f"at least {need} tokens of engine "
            f"context (question {prompt} + trace and reference 2 x {response} + repair {need - prompt - 2 * response}), "
            f"the engine has {context}: set actor_rollout_ref.rollout.max_model_len >= {need} (within the model's "
            "context), or lower data.max_response_length or algorithm.rredcot.ibpo.revision_length_factor"
        )


def check_estimator(name: str) -> None:
    import rredcot_verl.integration.plugin  # noqa: F401  (registers ours)
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

    if name not in ADV_ESTIMATOR_REGISTRY:
        raise LaunchError(f"unknown algorithm.adv_estimator {name!r}; known: {sorted(ADV_ESTIMATOR_REGISTRY)}")


def check_value_pass_parallelism(config: DictConfig, estimator: str) -> None:
    """Refuse Ulysses sequence parallelism with an estimator whose inputs are computed on whole traces
    (``EstimatorSpec.whole_traces_per_rank``: the value pass feeds each rank whole traces plus probe tokens with a
    probe mask), while Ulysses ranks each hold a slice of one sequence."""
    from rredcot_verl.integration.estimators import ESTIMATORS

    size = int(config.actor_rollout_ref.actor.get("ulysses_sequence_parallel_size", 1) or 1)
    spec = ESTIMATORS.get(estimator)
    if spec is not None and spec.whole_traces_per_rank and size > 1:
        raise LaunchError(
            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={size} is not supported with "
            f"algorithm.adv_estimator={estimator}: the segment value pass scores whole traces per rank; set it to 1"
        )


def select_trainer(config: DictConfig) -> None:
    """Select the rredcot trainer (verl's sync trainer plus the estimators' hooks) for every estimator. verl's async
    trainer modes are refused rather than silently replaced: the estimators' producers exist only in the sync one."""
    from rredcot_verl.integration.trainer import SYNC_MODE, TRAINER_NAME

    mode = str(config.trainer.v1.trainer_mode)
    if mode not in (SYNC_MODE, TRAINER_NAME):
        raise LaunchError(
            f"trainer.v1.trainer_mode={mode} is not supported: rredcot_verl trains with verl's sync trainer "
            f"(trainer.v1.trainer_mode={SYNC_MODE}, the default)"
        )
    _set(config, "trainer.v1.trainer_mode", TRAINER_NAME)


def prepare(config: DictConfig) -> DictConfig:
    """Validate the config and adapt it (trainer mode, CPU accommodations, plugin loading). Returns it."""
    cpu = use_cpu_mode()
    if cpu:
        # Before verl is first imported (check_estimator loads the plugin): verl resolves its platform on import,
        # and a VERL_PLATFORM=cpu already in the environment names a platform only enable_cpu_mode registers.
        os.environ.update(CPU_PROCESS_ENV)
        enable_cpu_mode()
    estimator = str(config.algorithm.adv_estimator)
    check_estimator(estimator)
    check_value_pass_parallelism(config, estimator)
    try:
        settings = settings_from_config(config.algorithm)
    except ValueError as error:
        raise LaunchError(str(error)) from error
    model_path = str(config.actor_rollout_ref.model.path)
    check_model_dir(model_path)
    check_dataset(config.data.train_files, "data.train_files")
    check_dataset(config.data.val_files, "data.val_files")
    from transformers import AutoConfig, AutoTokenizer

    hf_config = _local_pretrained(AutoConfig, model_path)
    check_prompt_lengths(config, _local_pretrained(AutoTokenizer, model_path))
    check_log_prob_memory(config, getattr(hf_config, "vocab_size", None))
    check_rule_reward(config, settings)
    check_ibpo_context(config, settings, hf_config)
    select_trainer(config)
    env = {"VERL_USE_EXTERNAL_MODULES": PLUGIN_MODULE}
    env.update({key: os.environ[key] for key in FORWARDED_ENV if key in os.environ})
    if os.environ.get("RAY_ADDRESS"):
        print(f"rredcot_verl: connecting to the Ray cluster at {os.environ['RAY_ADDRESS']}")
    else:
        # A new local cluster even when another one runs on this machine (ray.init() would otherwise join it and
        # then refuse the resource arguments).
        _set(config, "ray_kwargs.ray_init.address", "local")
    if cpu:
        env.update(CPU_PROCESS_ENV)
        cpu_config = dict(CPU_CONFIG)
        if not os.environ.get("RAY_ADDRESS"):
            cpu_config.update(local_cpu_cluster(config))
        for key, value in cpu_config.items():
            _set(config, key, value)
    os.environ.update(env)
    # Workers on a remote cluster do not inherit this process's environment: pass it through Ray's runtime_env.
    for key, value in env.items():
        _set(config, f"ray_kwargs.ray_init.runtime_env.env_vars.{key}", value)
    return config


def run(config: DictConfig) -> None:
    launch(prepare(config))


def launch(config: DictConfig) -> None:
    """What verl's ``main_ppo.main`` does with a config: the V1 task runner, with whichever trainer it selects."""
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    run_ppo(config, task_runner_class=TaskRunnerV1)


@hydra.main(config_path="../conf", config_name="rredcot_trainer", version_base=None)
def main(config: DictConfig) -> None:
    try:
        run(config)
    except LaunchError as error:
        print(f"rredcot_verl: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
