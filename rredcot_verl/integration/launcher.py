"""``python -m rredcot_verl.main``: verl's PPO entry point with the rredcot estimators, trainer and CPU support.

Config: verl's ``ppo_trainer`` composed with ``conf/rredcot_trainer.yaml`` (hydra), so every verl key works as usual;
``algorithm.adv_estimator`` may be ``grpo`` or any verl estimator, or ``rredcot`` / ``ibpo`` / ``segment_mc``, whose
settings live under ``algorithm.rredcot``. Every estimator trains with the rredcot trainer, verl's sync trainer plus
the estimators' hooks. Before Ray starts, the launcher checks what would otherwise fail late or hang: one of verl's
async trainer modes, unknown estimator or ``algorithm.rredcot`` keys, a missing/broken model folder, datasets without
``reward_model.ground_truth``. On a machine without an accelerator it switches on ``rredcot_verl.compat`` and the
matching config (``RREDCOT_CPU=0`` forces it off; ``RREDCOT_CPU=1`` forces it on).
"""

from __future__ import annotations

import os
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


def check_model_dir(path: str) -> None:
    folder = Path(path)
    if not folder.is_dir():
        raise LaunchError(f"model folder {path!r} does not exist (actor_rollout_ref.model.path)")
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


def check_estimator(name: str) -> None:
    import rredcot_verl.integration.plugin  # noqa: F401  (registers ours)
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

    if name not in ADV_ESTIMATOR_REGISTRY:
        raise LaunchError(f"unknown algorithm.adv_estimator {name!r}; known: {sorted(ADV_ESTIMATOR_REGISTRY)}")


# Estimators whose actor-side value pass (core.values.score_plans) runs whole traces on each rank.
VALUE_PASS_ESTIMATORS = ("rredcot", "segment_mc")


def check_value_pass_parallelism(config: DictConfig, estimator: str) -> None:
    """Refuse Ulysses sequence parallelism with a value-pass estimator: the value pass feeds each rank whole traces
    (plus probe tokens) with a probe mask, while Ulysses ranks each hold a slice of one sequence."""
    size = int(config.actor_rollout_ref.actor.get("ulysses_sequence_parallel_size", 1) or 1)
    if estimator in VALUE_PASS_ESTIMATORS and size > 1:
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
    estimator = str(config.algorithm.adv_estimator)
    check_estimator(estimator)
    check_value_pass_parallelism(config, estimator)
    try:
        settings_from_config(config.algorithm)
    except ValueError as error:
        raise LaunchError(str(error)) from error
    check_model_dir(str(config.actor_rollout_ref.model.path))
    check_dataset(config.data.train_files, "data.train_files")
    check_dataset(config.data.val_files, "data.val_files")
    select_trainer(config)
    env = {"VERL_USE_EXTERNAL_MODULES": PLUGIN_MODULE}
    env.update({key: os.environ[key] for key in FORWARDED_ENV if key in os.environ})
    if os.environ.get("RAY_ADDRESS"):
        print(f"rredcot_verl: connecting to the Ray cluster at {os.environ['RAY_ADDRESS']}")
    else:
        # A new local cluster even when another one runs on this machine (ray.init() would otherwise join it and
        # then refuse the resource arguments).
        _set(config, "ray_kwargs.ray_init.address", "local")
    if use_cpu_mode():
        env.update(CPU_PROCESS_ENV)
        cpu_config = dict(CPU_CONFIG)
        if not os.environ.get("RAY_ADDRESS"):
            cpu_config.update(local_cpu_cluster(config))
        for key, value in cpu_config.items():
            _set(config, key, value)
    os.environ.update(env)
    if os.environ.get(CPU_ENV) == "1":
        enable_cpu_mode()
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
