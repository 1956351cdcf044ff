"""The launcher's checks: bad input ends with a clear message and exit code 2 before Ray starts."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from rredcot_verl.integration.launcher import LaunchError, prepare

ROOT = Path(__file__).resolve().parents[1]


def _config(overrides=()):
    with initialize_config_dir(config_dir=str(ROOT / "recipes" / "tiny_cpu"), version_base=None):
        return compose(config_name="rredcot", overrides=list(overrides))


def test_valid_config_is_prepared_for_cpu(build, monkeypatch):
    monkeypatch.setenv("RREDCOT_CPU", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = prepare(_config())
    assert config.trainer.v1.trainer_mode == "rredcot"
    assert config.actor_rollout_ref.actor.strategy == "fsdp2"
    assert config.ray_kwargs.ray_init.address == "local" and config.ray_kwargs.ray_init.num_gpus == 1
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES == "rredcot_verl.integration.plugin"


def test_local_cluster_declares_one_fake_gpu_per_actor_rank(build, monkeypatch):
    monkeypatch.setenv("RREDCOT_CPU", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = prepare(_config(["trainer.n_gpus_per_node=2"]))
    assert config.ray_kwargs.ray_init.num_gpus == 2


@pytest.mark.parametrize("mode", ["colocate_async", "separate_async"])
def test_verls_async_trainer_modes_are_refused(build, mode):
    with pytest.raises(LaunchError, match=f"trainer.v1.trainer_mode={mode} is not supported"):
        prepare(_config([f"trainer.v1.trainer_mode={mode}"]))


def test_connecting_to_a_cluster_declares_no_local_resources(build, monkeypatch):
    monkeypatch.setenv("RREDCOT_CPU", "1")
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    config = prepare(_config())
    assert "num_gpus" not in config.ray_kwargs.ray_init and config.ray_kwargs.ray_init.get("address") is None


@pytest.mark.parametrize(
    "breakage, message",
    [
        ("no_model", "does not exist (actor_rollout_ref.model.path)"),
        ("no_weights", "is broken: missing *.safetensors weights"),
        ("no_ground_truth", "lack reward_model.ground_truth"),
        ("unknown_estimator", "unknown algorithm.adv_estimator 'rredcott'"),
        ("unknown_key", "unknown key(s) ['mixx']"),
    ],
)
def test_bad_input_is_refused_before_ray_starts(build, breakage, message):
    overrides = []
    if breakage == "no_model":
        shutil.rmtree(build / "model")
    elif breakage == "no_weights":
        (build / "model" / "model.safetensors").unlink()
    elif breakage == "no_ground_truth":
        frame = pd.read_parquet(build / "data" / "train.parquet")
        frame["reward_model"] = [{"style": "rule", "ground_truth": None}] * len(frame)
        frame.to_parquet(build / "data" / "train.parquet")
    elif breakage == "unknown_estimator":
        overrides.append("algorithm.adv_estimator=rredcott")
    elif breakage == "unknown_key":
        overrides.append("+algorithm.rredcot.redistribution.mixx=0.5")
    with pytest.raises(LaunchError) as error:
        prepare(_config(overrides))
    assert message in str(error.value)


def test_cli_exits_with_code_2_and_one_line(build):
    shutil.rmtree(build / "model")
    env = {**os.environ, "RREDCOT_CPU": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "rredcot_verl.main", "--config-dir", str(ROOT / "recipes/tiny_cpu"), "--config-name", "grpo"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 2
    assert "rredcot_verl: model folder" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "recipe", ["qwen3_4b_numina_rredcot", "qwen3_4b_numina_grpo", "r1_distill_1p5b_openrs_rredcot"]
)
def test_the_launcher_accepts_the_paper_recipes_as_written(recipe, tmp_path, monkeypatch):
    """The recipes name hub ids (verl downloads them) and read $DATA_DIR in prepare_math_data.py's format."""
    from rredcot_verl.tasks.math_data import convert

    rows = [{"problem": f"What is {i} + {i}?", "solution": f"Add them.\n\nSo $\\boxed{{{2 * i}}}$."} for i in range(4)]
    for name in ("numina", "open_rs"):
        (tmp_path / name).mkdir()
        for split in ("train", "val"):
            convert(rows, "test", split).to_parquet(tmp_path / name / f"{split}.parquet")
    monkeypatch.setenv("DATA_DIR", str(tmp_path))
    monkeypatch.setenv("RREDCOT_CPU", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with initialize_config_dir(config_dir=str(ROOT / "recipes" / "paper"), version_base=None):
        config = prepare(compose(config_name=recipe))
    assert config.actor_rollout_ref.model.path.count("/") == 1 and not Path(config.actor_rollout_ref.model.path).exists()
    assert config.trainer.v1.trainer_mode == "rredcot"


def test_prompts_all_longer_than_the_budget_are_refused(build):
    with pytest.raises(LaunchError, match=r"every sampled prompt .* is longer than data.max_prompt_length=4 tokens"):
        prepare(_config(["data.max_prompt_length=4", "data.filter_overlong_prompts=true"]))


def test_an_empty_dataset_after_verls_filter_names_the_key(monkeypatch):
    """The trainer's own message where the launcher could not tokenize (a hub model not cached at launch)."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from rredcot_verl.integration.trainer import SegmentCreditTrainer

    def verl_init_dataloader(self):
        self.train_dataset = []
        raise ValueError("num_samples should be a positive integer value, but got num_samples=0")

    monkeypatch.setattr(PPOTrainer, "_init_dataloader", verl_init_dataloader)
    trainer = object.__new__(SegmentCreditTrainer)
    trainer.config = OmegaConf.create({"data": {"max_prompt_length": 1024}})
    with pytest.raises(ValueError, match="train dataset is empty .* data.max_prompt_length=1024"):
        trainer._init_dataloader()


@pytest.mark.parametrize(
    "estimator", [["algorithm.adv_estimator=ibpo"], ["algorithm.adv_estimator=rredcot_ibpo"],
                  ["algorithm.adv_estimator=rredcot", "algorithm.rredcot.candidates.source=group_and_repairs"]],
    ids=["ibpo", "rredcot_ibpo", "rredcot-repair-bank"],
)  # fmt: skip
def test_ibpo_context_too_short_for_its_revisions_is_refused(build, estimator):
    overrides = [*estimator, "data.max_response_length=25000", "data.max_prompt_length=1024",
                 "actor_rollout_ref.rollout.max_model_len=40960"]  # fmt: skip
    with pytest.raises(LaunchError, match=r"needs at least 81152 tokens .*max_model_len >= 81152"):
        prepare(_config(overrides))


def test_extra_generations_without_a_rule_reward_are_refused(build):
    """Repairs (and continuations) are judged by the rule reward; without one the first step would fail."""
    for estimator in (["algorithm.adv_estimator=rredcot_ibpo"],
                      ["algorithm.rredcot.candidates.source=group_and_repairs"]):  # fmt: skip
        with pytest.raises(LaunchError, match="set reward.custom_reward_function.path"):
            prepare(_config([*estimator, "reward.custom_reward_function.path=null"]))


def test_a_cpu_platform_left_in_the_environment_does_not_break_the_launch(build):
    """VERL_PLATFORM=cpu exported by an earlier CPU run (or a shell profile): verl resolves its platform on import, so
    the launcher registers the CPU platform before it first imports verl."""
    shutil.rmtree(build / "model")
    env = {key: value for key, value in os.environ.items() if key != "RREDCOT_CPU"}
    env["VERL_PLATFORM"] = "cpu"
    result = subprocess.run(
        [sys.executable, "-m", "rredcot_verl.main", "--config-dir", str(ROOT / "recipes/tiny_cpu"), "--config-name", "grpo"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "rredcot_verl: model folder" in result.stderr and "Unknown platform" not in result.stderr
