"""``python -m rredcot_verl.main``: verl's PPO entry point with the rredcot estimators, trainer and CPU support.

Config: verl's ``ppo_trainer`` composed with ``conf/rredcot_trainer.yaml`` (hydra), so every verl key works as usual;
``algorithm.adv_estimator`` may be ``grpo`` or any verl estimator, or ``rredcot`` / ``ibpo`` / ``segment_mc``, whose
settings live under ``algorithm.rredcot``. Before Ray starts, the launcher checks what would otherwise fail late or
hang: unknown estimator or ``algorithm.rredcot`` keys, a missing/broken model folder, datasets without
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
from rredcot_verl.config import settings_from_config

# Config for a CPU-only run of verl 0.9.1 (research/verl_cpu.md §4): fake Ray GPU for verl's resource pools, enough
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


# Resources a local CPU cluster declares; a cluster started by hand needs the same (`ray start --head --num-cpus=32
# --num-gpus=1`), since verl's resource pools ask for GPUs and TransferQueue starts ~10 one-CPU actors.
LOCAL_CPU_CLUSTER = {"ray_kwargs.ray_init.num_cpus": 32, "ray_kwargs.ray_init.num_gpus": 1}

# Variables of the launching shell that every Ray process must see (local workers inherit them; a remote cluster
# gets them through runtime_env).
FORWARDED_ENV = ("VERL_FILE_LOGGER_PATH", "RREDCOT_BUILD", "RREDCOT_REWARD_FILE", "RREDCOT_SEED", "RREDCOT_STEPS")


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
    import rredcot_verl.estimators  # noqa: F401  (registers ours)
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

    if name not in ADV_ESTIMATOR_REGISTRY:
        raise LaunchError(f"unknown algorithm.adv_estimator {name!r}; known: {sorted(ADV_ESTIMATOR_REGISTRY)}")


def prepare(config: DictConfig) -> DictConfig:
    """Validate the config and adapt it (trainer mode, CPU accommodations, plugin loading). Returns it."""
    estimator = str(config.algorithm.adv_estimator)
    check_estimator(estimator)
    try:
        settings_from_config(config.algorithm)
    except ValueError as error:
        raise LaunchError(str(error)) from error
    check_model_dir(str(config.actor_rollout_ref.model.path))
    check_dataset(config.data.train_files, "data.train_files")
    check_dataset(config.data.val_files, "data.val_files")
    _set(config, "trainer.v1.trainer_mode", "rredcot")
    env = {"VERL_USE_EXTERNAL_MODULES": "rredcot_verl"}
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
            cpu_config.update(LOCAL_CPU_CLUSTER)
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
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    config = prepare(config)
    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    run_ppo(config, task_runner_class=TaskRunnerV1)


@hydra.main(config_path="conf", config_name="rredcot_trainer", version_base=None)
def main(config: DictConfig) -> None:
    try:
        run(config)
    except LaunchError as error:
        print(f"rredcot_verl: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
