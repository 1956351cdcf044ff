"""The launcher's checks: bad input ends with a clear message and exit code 2 before Ray starts."""

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from composing import compose_recipe
from rredcot_verl.integration.launcher import LaunchError, prepare

ROOT = Path(__file__).resolve().parents[1]


def _config(overrides=()):
    return compose_recipe(str(ROOT / "recipes" / "tiny_cpu"), "rredcot", overrides)


def test_valid_config_is_prepared_for_cpu(build, monkeypatch):
    monkeypatch.setenv("RREDCOT_CPU", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = prepare(_config())
    assert config.trainer.v1.trainer_mode == "rredcot"
    assert config.actor_rollout_ref.actor.strategy == "fsdp2"
    assert config.ray_kwargs.ray_init.address == "local" and config.ray_kwargs.ray_init.num_gpus == 1
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES == "rredcot_verl.integration.plugin"
    # One vLLM process fewer per server, no dashboard (compat test: vLLM keeps "uni" with multiprocessing off).
    assert config.actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend == "uni"
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.VLLM_ENABLE_V1_MULTIPROCESSING == "0"
    assert config.ray_kwargs.ray_init.include_dashboard is False


def test_cpu_mode_says_in_one_line_that_it_runs_fsdp2_for_verls_default_fsdp1(build, monkeypatch, capsys):
    monkeypatch.setenv("RREDCOT_CPU", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert _config().actor_rollout_ref.actor.strategy == "fsdp"  # verl's default, which the tiny recipes keep
    assert prepare(_config()).actor_rollout_ref.actor.strategy == "fsdp2"
    said = [line for line in capsys.readouterr().out.splitlines() if "strategy=fsdp2 instead of fsdp" in line]
    assert len(said) == 1 and said[0].startswith("rredcot_verl: CPU mode")
    prepare(_config(["actor_rollout_ref.actor.strategy=fsdp2"]))
    assert "instead of fsdp" not in capsys.readouterr().out


def test_local_cluster_declares_one_fake_gpu_per_actor_rank(build, monkeypatch):
    monkeypatch.setenv("RREDCOT_CPU", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = prepare(_config(["trainer.n_gpus_per_node=2"]))
    assert config.ray_kwargs.ray_init.num_gpus == 2


def test_tensor_parallel_engines_keep_vllms_multiprocess_executor_and_bind_a_core_group_a_rank(build, monkeypatch):
    """vLLM's CPU default binds each rank to a NUMA node and refuses more ranks than nodes (a one-node machine: a
    launch crashed at the engine's start); the launcher splits the cores instead, unless the user bound them."""
    tensor_parallel = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]
    monkeypatch.setenv("RREDCOT_CPU", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "")  # recorded as absent, so that the test leaves it unset
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    config = prepare(_config(tensor_parallel))
    assert "distributed_executor_backend" not in config.actor_rollout_ref.rollout.engine_kwargs.vllm
    assert config.ray_kwargs.ray_init.runtime_env.env_vars.VLLM_CPU_OMP_THREADS_BIND == "0,1|2,3"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0,1|2,3"  # the local cluster's workers inherit it
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|3")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in prepare(_config(tensor_parallel)).ray_kwargs.ray_init.runtime_env.env_vars
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(LaunchError, match=r"^actor_rollout_ref.rollout.tensor_model_parallel_size=2: 2 tensor-parallel "
                                          r"ranks need as many cores; this machine has 1"):
        prepare(_config(tensor_parallel))


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


def test_a_key_typo_is_one_line_naming_the_key_and_exit_2(tmp_path):
    """Without "+", a key the config lacks fails hydra's composition: hydra alone prints it over several lines and
    exits 1; the launcher answers it as every other refusal, before any check (no model folder needed)."""
    env = {**os.environ, "RREDCOT_CPU": "1", "RREDCOT_BUILD": str(tmp_path / "absent")}
    env.pop("HYDRA_FULL_ERROR", None)
    for flags in ((), ("--check-only",)):
        result = subprocess.run(
            [sys.executable, "-m", "rredcot_verl.main", *flags, "--config-dir", str(ROOT / "recipes/tiny_cpu"),
             "--config-name", "rredcot", "algorithm.rredcot.redistribution.mixx=0.5"],
            capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr.strip().splitlines() == [
            "rredcot_verl: Could not override 'algorithm.rredcot.redistribution.mixx'. To append to your config use "
            "+algorithm.rredcot.redistribution.mixx=0.5 (Key 'mixx' is not in struct)"
        ]


def _paper_data(folder: Path, monkeypatch) -> None:
    """$DATA_DIR as the paper recipes read it: a few rows in prepare_math_data.py's format."""
    from rredcot_verl.tasks.math_data import convert

    rows = [{"problem": f"What is {i} + {i}?", "solution": f"Add them.\n\nSo $\\boxed{{{2 * i}}}$."} for i in range(4)]
    for name in ("numina", "open_rs"):
        (folder / name).mkdir()
        for split in ("train", "test"):
            convert(rows, "test", split).to_parquet(folder / name / f"{split}.parquet")
    monkeypatch.setenv("DATA_DIR", str(folder))


@pytest.mark.parametrize(
    "recipe", ["qwen3_4b_numina_rredcot", "qwen3_4b_numina_grpo", "r1_distill_1p5b_openrs_rredcot"]
)
def test_the_launcher_accepts_the_paper_recipes_as_written(recipe, tmp_path, monkeypatch):
    """The recipes name hub ids (verl downloads them) and read $DATA_DIR in prepare_math_data.py's format."""
    _paper_data(tmp_path, monkeypatch)
    monkeypatch.setenv("RREDCOT_CPU", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with initialize_config_dir(config_dir=str(ROOT / "recipes" / "paper"), version_base=None):
        config = prepare(compose(config_name=recipe))
    assert config.actor_rollout_ref.model.path.count("/") == 1 and not Path(config.actor_rollout_ref.model.path).exists()
    assert config.trainer.v1.trainer_mode == "rredcot"


def test_prompts_all_longer_than_the_budget_are_refused(build):
    with pytest.raises(LaunchError, match=r"every sampled prompt .* is longer than data.max_prompt_length=4 tokens"):
        prepare(_config(["data.max_prompt_length=4", "data.filter_overlong_prompts=true"]))


def _positions(build: Path, positions: int) -> int:
    """The warm start's config with ``positions`` positions (a long-context model's launch checks read only its
    config); returns the longest sampled prompt with the chat template, what a resumed repair needs besides its
    response budget."""
    import json

    from transformers import AutoTokenizer

    from rredcot_verl.integration.launcher import sampled_prompt_lengths

    config_file = build / "model" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "max_position_embeddings": positions}))
    return max(sampled_prompt_lengths(_config(), AutoTokenizer.from_pretrained(build / "model")))


@pytest.mark.parametrize(
    "estimator", [["algorithm.adv_estimator=ibpo"], ["algorithm.adv_estimator=rredcot_ibpo"],
                  ["algorithm.adv_estimator=rredcot", "algorithm.rredcot.candidates.source=group_and_repairs"]],
    ids=["ibpo", "rredcot_ibpo", "rredcot-repair-bank"],
)  # fmt: skip
def test_ibpo_context_too_short_for_its_revisions_is_refused(build, estimator):
    """A 40,960-position model: a rewrite of a 25,000-token failure does not fit; resuming it does, so that is the
    first advice; raising the engine past the model is not offered."""
    prompt = _positions(build, 40960)
    overrides = [*estimator, "data.max_response_length=25000", "data.max_prompt_length=1024",
                 "actor_rollout_ref.rollout.max_model_len=40960"]  # fmt: skip
    need = prompt + 2 * 25000 + math.ceil(1.2 * 25000) + 128
    with pytest.raises(LaunchError) as error:
        prepare(_config([*overrides, "algorithm.rredcot.ibpo.repair_operator=rewrite"]))
    fits = (40960 - prompt - 128) * 5 // 16  # 2 L + ceil(1.2 L) <= room
    assert str(error.value).endswith(
        f"needs at least {need} tokens of engine context (question {prompt} + trace and reference 2 x 25000 + repair "
        f"30128), the engine has 40960; the model has 40960 positions: set algorithm.rredcot.ibpo.repair_operator="
        f"resume (it needs {prompt + 25000}, which the engine has), or data.max_response_length <= {fits}"
    )
    # Resumed, a repair needs its rollout's context: the longest prompt's, not data.max_prompt_length's.
    prepare(_config([*overrides[:-1], f"actor_rollout_ref.rollout.max_model_len={prompt + 25000}"]))
    with pytest.raises(LaunchError) as error:
        prepare(_config([*overrides[:-1], f"actor_rollout_ref.rollout.max_model_len={prompt + 24999}"]))
    assert str(error.value).endswith(
        f"resuming a failure needs its rollout's own context, the longest sampled prompt ({prompt} tokens with the "
        f"chat template) + data.max_response_length 25000 = {prompt + 25000} tokens, the engine has {prompt + 24999}; "
        f"the model has 40960 positions: set actor_rollout_ref.rollout.max_model_len >= {prompt + 25000}, or "
        f"data.max_response_length <= {40960 - prompt} (with max_model_len 40960)"
    )


def test_a_512_position_model_is_offered_only_what_it_can_take(build):
    """The warm start has 512 positions: neither a longer engine nor the resume operator can hold a 600-token
    rewrite, so the advice is a response length that fits, resumed (longer) or rewritten."""
    prompt = _positions(build, 512)
    with pytest.raises(LaunchError) as error:
        prepare(_config(["algorithm.adv_estimator=ibpo", "data.max_response_length=600",
                         "algorithm.rredcot.ibpo.repair_operator=rewrite"]))  # fmt: skip
    fits = max(n for n in range(600) if prompt + 2 * n + math.ceil(1.2 * n) + 128 <= 512)
    assert str(error.value).endswith(
        f"the engine has 512; the model has 512 positions: set algorithm.rredcot.ibpo.repair_operator=resume with "
        f"data.max_response_length <= {512 - prompt}, or data.max_response_length <= {fits}"
    )
    with pytest.raises(LaunchError) as error:
        prepare(_config(["algorithm.adv_estimator=ibpo", "data.max_response_length=600"]))  # resume
    assert str(error.value).endswith(f"set data.max_response_length <= {512 - prompt}")


def test_the_ibpo_recipe_at_a_longer_response_is_refused_in_one_line_naming_both_fixes(build, tmp_path):
    """The tiny recipe's rewrite repairs have a revision template, which the resume operator refuses: the advice to
    resume unsets it too (it once built that refused setting and ended in hydra's traceback, exit 1)."""
    env = {**os.environ, "RREDCOT_CPU": "1"}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, "-m", "rredcot_verl.main", "--check-only", "--config-dir", str(ROOT / "recipes/tiny_cpu"),
         "--config-name", "ibpo", "data.max_response_length=2048"],
        capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    refusal = result.stderr.strip().splitlines()[-1]
    assert refusal.startswith("rredcot_verl: algorithm.adv_estimator=ibpo generates IBPO repairs")
    resume = ("set algorithm.rredcot.ibpo.repair_operator=resume algorithm.rredcot.ibpo.revision_template=null with "
              "data.max_response_length <= ")
    assert resume in refusal and ", or data.max_response_length <= " in refusal


def test_an_unknown_repair_operator_is_refused_in_one_line(build):
    with pytest.raises(LaunchError) as error:
        prepare(_config(["algorithm.adv_estimator=ibpo", "algorithm.rredcot.ibpo.repair_operator=resum"]))
    message = str(error.value)
    assert "\n" not in message and "algorithm.rredcot.ibpo" in message and "repair_operator must be one of" in message


@pytest.mark.parametrize("estimator", ["ibpo", "rredcot_ibpo"])
@pytest.mark.parametrize("recipe", ["qwen3_4b_numina_rredcot", "r1_distill_1p5b_openrs_rredcot"])
def test_the_paper_recipes_launch_with_repairs_resumed_on_a_40960_position_engine(recipe, estimator, tmp_path,
                                                                                   monkeypatch):
    """The paper recipes at their lengths with IBPO's repairs, on the 40,960 positions of Qwen3-4B's engine: every
    launch check (``--check-only``'s) accepts the default operator, resume; the rewrite operator is still refused
    where two responses and a rewrite exceed the engine (the 25k-token recipe)."""
    from omegaconf import OmegaConf

    from rredcot_verl.integration.launcher import check

    _paper_data(tmp_path, monkeypatch)
    overrides = [f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.rollout.max_model_len=40960"]
    with initialize_config_dir(config_dir=str(ROOT / "recipes" / "paper"), version_base=None):
        config = compose(config_name=recipe, overrides=overrides)
        rewrite = compose(config_name=recipe, overrides=[*overrides, "algorithm.rredcot.ibpo.repair_operator=rewrite"])
    assert OmegaConf.select(config, "algorithm.rredcot.ibpo.repair_operator") == "resume"
    check(config)
    prompt, response = int(config.data.max_prompt_length), int(config.data.max_response_length)
    if prompt + 2 * response + math.ceil(1.2 * response) + 128 > 40960:
        assert response == 25_000
        with pytest.raises(LaunchError, match="repair_operator=rewrite.*needs at least 81152 tokens"):
            check(rewrite)
    else:  # the 1,024-token recipe fits either operator
        assert recipe == "r1_distill_1p5b_openrs_rredcot"
        check(rewrite)


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
