"""Run shapes: what this package's estimators cannot serve is refused at launch with the key named; what stock verl
runs with its own estimators is accepted unchanged; ``--check-only`` says which, without starting Ray."""

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from transformers import CohereConfig, Gemma2Config, MistralConfig, Qwen2Config, Qwen3Config, Qwen3NextConfig

from composing import compose_recipe
from rredcot_verl.integration.estimators import ESTIMATORS
from rredcot_verl.integration.launcher import LaunchError, check, prepare
from rredcot_verl.integration.run_shapes import SINGLE_TURN_AGENT_LOOP, value_pass_model

ROOT = Path(__file__).resolve().parents[1]
OURS = sorted(ESTIMATORS)


@pytest.fixture()
def cpu_build(build, monkeypatch):
    """The shared ``build``, launched in CPU mode on a local Ray; beside its training rows, the same rows naming the
    agent loop verl runs for each (``agent_name``): all ``tool_agent``, one in four, or all single-turn."""
    monkeypatch.setenv("RREDCOT_CPU", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    rows = pd.read_parquet(build / "data" / "train.parquet")
    for name, agent_names in (("tool_rows", ["tool_agent"] * len(rows)),
                              ("some_tool_rows", [("tool_agent" if i % 4 == 3 else SINGLE_TURN_AGENT_LOOP)
                                                  for i in range(len(rows))]),
                              ("single_turn_rows", [SINGLE_TURN_AGENT_LOOP] * len(rows))):  # fmt: skip
        rows.assign(agent_name=agent_names).to_parquet(build / "data" / f"{name}.parquet", index=False)
    return build


def _config(estimator: str, overrides=()):
    return compose_recipe(str(ROOT / "recipes" / "tiny_cpu"), "rredcot", [f"algorithm.adv_estimator={estimator}", *overrides])


# verl asks for it whenever a reference policy runs (KL loss or KL in reward).
REF_MICRO_BATCH = "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16"
# DAPO's overlong penalty as verl's DAPO recipe sets it (reward_kwargs are not in verl's config: added with +).
DAPO_OVERLONG = ["+reward.reward_kwargs.overlong_buffer_cfg.enable=true",
                 "+reward.reward_kwargs.overlong_buffer_cfg.len=16",
                 "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
                 "+reward.reward_kwargs.overlong_buffer_cfg.log=false", "+reward.reward_kwargs.max_resp_len=96"]
# shape -> (overrides, the key the refusal must name)
REFUSED_SHAPES = {
    "legacy_trainer": (["trainer.use_v1=false"], "trainer.use_v1=false"),
    "bypass_mode": (["algorithm.rollout_correction.bypass_mode=true"], "algorithm.rollout_correction.bypass_mode=true"),
    "critic": (["critic.enable=true", "critic.model.path=${actor_rollout_ref.model.path}",
                "critic.ppo_micro_batch_size_per_gpu=16"], "critic.enable=true"),
    "n_1": (["actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"], "actor_rollout_ref.rollout.n=1"),
    "kl_in_reward": (["algorithm.use_kl_in_reward=true", REF_MICRO_BATCH], "algorithm.use_kl_in_reward=true"),
    "dapo_overlong_penalty": (["reward.reward_manager.name=dapo", *DAPO_OVERLONG],
                              "reward.reward_kwargs.overlong_buffer_cfg.enable=true"),
    "dapo_overlong_penalty_legacy_keys": (["reward_model.reward_manager=dapo",
                                           *[o.replace("reward.", "reward_model.") for o in DAPO_OVERLONG]],
                                          "reward_model.reward_kwargs.overlong_buffer_cfg.enable=true"),
    "reward_model": (["reward.reward_model.enable=true"], "reward.reward_model.enable=true"),
    "async_trainer_mode": (["trainer.v1.trainer_mode=colocate_async"], "trainer.v1.trainer_mode=colocate_async"),
}  # fmt: skip


@pytest.mark.parametrize("estimator", OURS)
@pytest.mark.parametrize("shape", sorted(REFUSED_SHAPES))
def test_shapes_the_estimators_cannot_serve_are_refused_naming_the_key(cpu_build, estimator, shape):
    overrides, key = REFUSED_SHAPES[shape]
    with pytest.raises(LaunchError) as error:
        check(_config(estimator, overrides))
    message = str(error.value)
    assert key in message and f"algorithm.adv_estimator={estimator}" in message and "\n" not in message


# Multi-turn rollouts (tool output in the response, response_mask with holes): shape -> (overrides, the key named)
ROWS = "data.train_files=${{oc.env:RREDCOT_BUILD}}/data/{}.parquet"
MULTI_TURN_SHAPES = {
    "agent_name_rows": ([ROWS.format("tool_rows")], "data.train_files rows with agent_name=tool_agent"),
    "some_agent_name_rows": ([ROWS.format("some_tool_rows")], "data.train_files rows with agent_name=tool_agent"),
    "tool_agent_loop": (["actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"],
                        "default_agent_loop=tool_agent"),
}  # fmt: skip
# estimator -> (its overrides, what the refusal names): the runs whose extra generations are single-turn, tool-less
SINGLE_TURN_GENERATIONS = {
    "ibpo": ([], "IBPO's repairs"),
    "rredcot_ibpo": ([], "IBPO's repairs"),
    "segment_mc": ([], "Monte-Carlo continuations"),
    "rredcot": (["algorithm.rredcot.candidates.source=group_and_repairs"], "candidates.source=group_and_repairs"),
}


@pytest.mark.parametrize("estimator", sorted(SINGLE_TURN_GENERATIONS))
@pytest.mark.parametrize("shape", sorted(MULTI_TURN_SHAPES))
def test_multi_turn_is_refused_where_repairs_or_continuations_would_leave_the_agent_loop(cpu_build, shape, estimator):
    overrides, key = MULTI_TURN_SHAPES[shape]
    extra, named = SINGLE_TURN_GENERATIONS[estimator]
    with pytest.raises(LaunchError) as error:
        check(_config(estimator, [*overrides, *extra]))
    message = str(error.value)
    assert key in message and named in message and f"algorithm.adv_estimator={estimator}" in message
    assert "\n" not in message


@pytest.mark.parametrize("shape", sorted(MULTI_TURN_SHAPES))
def test_rredcot_values_multi_turn_traces_by_exit_probes_only(cpu_build, shape):
    overrides, key = MULTI_TURN_SHAPES[shape]
    exit_probe = "algorithm.rredcot.probe.value_source=exit_probe"
    for source in ("both", "group", "ground_truth"):
        assert check(_config("rredcot", [*overrides, exit_probe, f"algorithm.rredcot.candidates.source={source}"])) == []
    # A continuation glues a trajectory's assistant turns without the tool answers: refused, naming the key.
    for value_source in ("reference_continuation", "own_continuation"):
        with pytest.raises(LaunchError) as error:
            check(_config("rredcot", [*overrides, f"algorithm.rredcot.probe.value_source={value_source}"]))
        message = str(error.value)
        assert key in message and f"algorithm.rredcot.probe.value_source={value_source}" in message
        assert "\n" not in message


@pytest.mark.parametrize("estimator", OURS)
def test_rows_that_choose_the_single_turn_loop_and_the_multi_turn_flag_alone_are_single_turn(cpu_build, estimator):
    """verl runs a row's own agent_name over agent.default_agent_loop; and rollout.multi_turn.enable, read by verl's
    legacy trainer only, changes nothing in the V1 trainer: neither is refused."""
    check(_config(estimator, [ROWS.format("single_turn_rows"),
                              "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"]))  # fmt: skip
    check(_config(estimator, ["actor_rollout_ref.rollout.multi_turn.enable=true"]))


def _as_json(build: Path, name: str, suffix: str, **columns) -> Path:
    """The build's ``name`` parquet rows (with ``columns`` set) written as JSON lines, which verl reads by the ending
    ``.jsonl`` or ``.json`` through ``datasets``."""
    path = build / "data" / f"{name}{suffix}"
    pd.read_parquet(build / "data" / f"{name}.parquet").assign(**columns).to_json(path, orient="records", lines=True)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_json_training_files_are_read_as_verl_reads_them(cpu_build, suffix):
    """verl's RLHFDataset reads JSON files beside parquet ones: the launch checks read the same columns from them
    (ground truths, prompts, each row's agent loop, the data sources' scale) instead of stopping in pyarrow."""
    val = f"data.val_files={_as_json(cpu_build, 'val', suffix)}"
    train = f"data.train_files={_as_json(cpu_build, 'train', suffix)}"
    for estimator in ("grpo", *OURS):
        assert check(_config(estimator, [train, val])) == []
    with pytest.raises(LaunchError, match="^every sampled prompt of .* is longer than data.max_prompt_length=4 "):
        check(_config("grpo", [train, val, "data.max_prompt_length=4", "data.filter_overlong_prompts=true"]))
    tool_rows = f"data.train_files={_as_json(cpu_build, 'tool_rows', suffix)}"
    with pytest.raises(LaunchError, match=r"^data.train_files rows with agent_name=tool_agent \(multi-turn rollouts\)"):
        check(_config("ibpo", [tool_rows, val]))
    dapo_rows = f"data.train_files={_as_json(cpu_build, 'train', suffix, data_source='math_dapo')}"
    verls_scorer = ["reward.custom_reward_function.path=pkg://verl.utils.reward_score",
                    "reward.custom_reward_function.name=default_compute_score"]  # fmt: skip
    config = _config("rredcot", [dapo_rows, val, *verls_scorer])
    check(config)
    assert list(config.algorithm.rredcot.reward_range) == [-1.0, 1.0]


def test_a_training_file_verl_cannot_read_is_refused_in_one_line(cpu_build):
    csv = cpu_build / "data" / "train.csv"
    pd.read_parquet(cpu_build / "data" / "train.parquet").to_csv(csv)
    for estimator in ("grpo", "rredcot"):
        with pytest.raises(LaunchError) as error:
            check(_config(estimator, [f"data.train_files={csv}"]))
        assert str(error.value) == (f"data.train_files file '{csv}' is neither parquet nor JSON: verl reads .parquet, "
                                    ".json, .jsonl files (by their ending)")  # fmt: skip


def test_verls_v1_trainer_never_reads_the_multi_turn_flag():
    """What makes the flag a no-op here, in verl's installed source: it is read only by the legacy trainer (refused
    for these estimators) and the fully-async entry point (refused too)."""
    import verl

    package = Path(verl.__file__).parent
    readers = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                     if "multi_turn.enable" in path.read_text(errors="replace") and "config" not in path.parts)  # fmt: skip
    assert readers == ["experimental/fully_async_policy/detach_utils.py", "trainer/ppo/ray_trainer.py"]


COOLER = "actor_rollout_ref.rollout.temperature=0.7"
# estimator -> (its overrides, the key of the extra generation's own temperature)
OWN_TEMPERATURES = {
    "ibpo": ([], "algorithm.rredcot.ibpo.revision_temperature"),
    "rredcot_ibpo": ([], "algorithm.rredcot.ibpo.revision_temperature"),
    "rredcot": (["algorithm.rredcot.candidates.source=group_and_repairs"], "algorithm.rredcot.ibpo.revision_temperature"),
    "segment_mc": ([], "algorithm.rredcot.segment_mc.temperature"),
}  # fmt: skip


@pytest.mark.parametrize("estimator", sorted(OWN_TEMPERATURES))
def test_extra_generations_at_another_temperature_than_the_rollouts_are_refused(cpu_build, estimator):
    """Repairs and continuations sample at their own temperature key (1.0 by default): under a rollout at 0.7 they
    would be samples of another policy. The key set to the rollout's (or interpolated from it) is accepted."""
    extra, key = OWN_TEMPERATURES[estimator]
    with pytest.raises(LaunchError) as error:
        check(_config(estimator, [*extra, COOLER]))
    assert str(error.value).startswith(f"{key}=1 differs from actor_rollout_ref.rollout.temperature=0.7: ")
    assert f"set {key}=0.7" in str(error.value) and "\n" not in str(error.value)
    check(_config(estimator, [*extra, COOLER, f"{key}=0.7"]))
    check(_config(estimator, [*extra, COOLER, f"{key}=${{actor_rollout_ref.rollout.temperature}}"]))


def test_the_value_pass_scores_at_the_rollout_temperature_whatever_it_is(cpu_build):
    """rredcot's probes are scored under logits / the rollout temperature: nothing of its own to mismatch."""
    check(_config("rredcot", [COOLER]))


@pytest.mark.parametrize("estimator", sorted(name for name, spec in ESTIMATORS.items() if spec.uses_value_pass))
def test_greedy_rollouts_are_refused_where_the_value_pass_scores_them(cpu_build, estimator):
    """The value pass refuses a temperature of 0 before scoring (core.scoring), after the first rollouts: the launch
    refuses it first. verl's own estimators train on it as verl does (its log-prob pass clamps it to 1e-8)."""
    greedy = ["actor_rollout_ref.rollout.temperature=0", "algorithm.rredcot.ibpo.revision_temperature=0"]
    with pytest.raises(LaunchError) as error:
        check(_config(estimator, greedy))
    assert str(error.value).startswith(f"actor_rollout_ref.rollout.temperature=0 (greedy rollouts) is not supported "
                                       f"with algorithm.adv_estimator={estimator}: ")  # fmt: skip
    assert "\n" not in str(error.value)
    check(_config("grpo", greedy[:1]))


@pytest.mark.parametrize("estimator", OURS)
@pytest.mark.parametrize("truncation", ["actor_rollout_ref.rollout.top_p=0.9", "actor_rollout_ref.rollout.top_k=20"])
def test_a_rollout_that_truncates_its_distribution_is_refused(cpu_build, estimator, truncation):
    """Probes, repairs and continuations use the whole distribution: top-p / top-k rollouts sample another one."""
    with pytest.raises(LaunchError) as error:
        check(_config(estimator, [truncation]))
    message = str(error.value)
    assert message.startswith(f"{truncation} is not supported with algorithm.adv_estimator={estimator}: ")
    assert "top_p=1 and actor_rollout_ref.rollout.top_k=-1" in message and "\n" not in message
    check(_config("grpo", [truncation]))
    check(_config(estimator, ["actor_rollout_ref.rollout.top_p=1.0", "actor_rollout_ref.rollout.top_k=0"]))


@pytest.mark.parametrize("shape", sorted({**REFUSED_SHAPES, **MULTI_TURN_SHAPES}))
def test_grpo_accepts_every_shape_verl_accepts(cpu_build, shape):
    overrides, _ = {**REFUSED_SHAPES, **MULTI_TURN_SHAPES}[shape]
    assert check(_config("grpo", overrides)) == []


def test_grpo_keeps_verls_async_trainer(cpu_build):
    config = prepare(_config("grpo", ["trainer.v1.trainer_mode=colocate_async"]))
    assert config.trainer.v1.trainer_mode == "colocate_async"
    assert prepare(_config("grpo")).trainer.v1.trainer_mode == "rredcot"  # sync: verl's, plus failed-group counts


def test_megatron_is_refused_for_the_value_pass_only(cpu_build):
    for estimator in ("rredcot", "rredcot_ibpo"):
        with pytest.raises(LaunchError, match="actor_rollout_ref.actor.strategy=megatron is not supported"):
            check(_config(estimator, ["actor_rollout_ref.actor.strategy=megatron"]))
    for estimator in ("grpo", "ibpo", "segment_mc"):  # passed on to verl, which wants its Megatron config for it
        with pytest.raises(LaunchError, match="^verl's config check refuses it: Missing key megatron"):
            check(_config(estimator, ["actor_rollout_ref.actor.strategy=megatron"]))


@pytest.mark.parametrize(
    "hf_config, refused",
    [
        (Gemma2Config(), "layer_types with sliding_attention layers (sliding_window=4096)"),
        (MistralConfig(sliding_window=4096), "sliding_window=4096 (windowed attention)"),
        (Gemma2Config(layer_types=["full_attention"] * 26), "attn_logit_softcapping=50.0"),
        (Qwen3NextConfig(), "layer_types with linear_attention layers"),
        (Gemma2Config(layer_types=["full_attention"] * 26, attn_logit_softcapping=None), None),  # logits capped alike
        (CohereConfig(), None),  # logit_scale, applied by the value pass
        (Qwen2Config(), None),  # sliding_window is set but use_sliding_window is false
        (Qwen3Config(), None),
        (MistralConfig(sliding_window=None), None),
    ],
    ids=["gemma2", "mistral-v0.1", "softcapped-attention", "qwen3-next", "softcapped-logits", "cohere", "qwen2",
         "qwen3", "mistral-v0.3"],
)
def test_what_the_value_pass_cannot_score_is_refused_at_launch(hf_config, refused):
    for name in OURS:
        message = value_pass_model(_config_stub(), ESTIMATORS[name], hf_config)
        if refused is None or not ESTIMATORS[name].uses_value_pass:
            assert message is None
        else:
            assert message.startswith(f"actor_rollout_ref.model.path is a {hf_config.model_type} model with {refused}")
            assert f"algorithm.adv_estimator={name} cannot score it exactly" in message and "\n" not in message


def test_the_launch_reads_the_model_config_as_verls_override_config_leaves_it():
    """verl applies actor_rollout_ref.model.override_config to the actor's config; the launch check reads the same."""
    from omegaconf import OmegaConf

    overridden = OmegaConf.create({"actor_rollout_ref": {"model": {"override_config": {"attn_logit_softcapping": None}}}})
    softcapped = Gemma2Config(layer_types=["full_attention"] * 26)
    assert value_pass_model(overridden, ESTIMATORS["rredcot"], softcapped) is None
    assert "attn_logit_softcapping" in value_pass_model(_config_stub(), ESTIMATORS["rredcot"], softcapped)
    assert softcapped.attn_logit_softcapping == 50.0  # the model folder's config is left as it was


def _config_stub():
    from omegaconf import OmegaConf

    return OmegaConf.create({})


def test_grpo_needs_no_ground_truth_but_the_estimators_do(cpu_build):
    frame = pd.read_parquet(cpu_build / "data" / "train.parquet")
    frame["reward_model"] = [{"style": "model", "ground_truth": None}] * len(frame)
    frame.to_parquet(cpu_build / "data" / "train.parquet")
    check(_config("grpo"))
    with pytest.raises(LaunchError, match="lack reward_model.ground_truth"):
        check(_config("rredcot"))


def test_remote_dataset_uris_are_left_to_verl_and_named_as_skipped(cpu_build):
    skipped = check(_config("rredcot", ["data.val_files=hdfs://namenode/data/val.parquet"]))
    assert skipped == ["data.val_files 'hdfs://namenode/data/val.parquet' (remote: verl copies it at start)"]


def test_verls_default_log_prob_budget_is_accepted(cpu_build):
    """verl's default (16,384 tokens, dynamic batch size) was refused for every estimator by a memory check of
    verl's own entropy; the value pass bounds its logits itself (core/scoring.py), so nothing is added to check."""
    overrides = ["actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                 "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384"]  # fmt: skip
    for estimator in ("grpo", "rredcot"):
        check(_config(estimator, overrides))


def test_a_gpu_launch_leaves_ray_to_verl_so_a_running_cluster_is_joined(cpu_build, monkeypatch):
    """verl's ray.init() joins a cluster brought up with `ray start`; forcing address=local would start another."""
    monkeypatch.setenv("RREDCOT_CPU", "0")
    config = prepare(_config("rredcot"))
    assert config.ray_kwargs.ray_init.get("address") is None and config.ray_kwargs.ray_init.get("num_gpus") is None
    assert config.trainer.device != "cpu"


def test_a_cluster_address_in_the_recipe_is_kept_on_cpu(cpu_build):
    config = prepare(_config("rredcot", ["+ray_kwargs.ray_init.address=auto"]))
    assert config.ray_kwargs.ray_init.address == "auto" and config.ray_kwargs.ray_init.get("num_gpus") is None


def _check_only(*overrides, config_name="rredcot", cwd=None):
    env = {**os.environ, "RREDCOT_CPU": "1"}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, "-m", "rredcot_verl.main", "--check-only", "--config-dir", str(ROOT / "recipes/tiny_cpu"),
         "--config-name", config_name, *overrides],
        capture_output=True, text=True, env=env, timeout=300, cwd=cwd,
    )  # fmt: skip


def test_check_only_says_ok_refuses_and_names_what_it_skipped(cpu_build, tmp_path):
    """One process for three answers would hide which one exits how: three runs, none starting Ray, none writing
    into the working directory (hydra's output folder and log)."""
    work = tmp_path / "cwd"  # tmp_path holds the build
    work.mkdir()
    ok = _check_only(cwd=work)
    assert list(work.iterdir()) == []
    assert ok.returncode == 0 and ok.stdout.strip().splitlines()[-1] == "rredcot_verl: ok", ok.stderr[-2000:]
    refused = _check_only("algorithm.use_kl_in_reward=true")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines()[-1].startswith("rredcot_verl: algorithm.use_kl_in_reward=true")
    hub = _check_only("actor_rollout_ref.model.path=Qwen/Qwen3-4B")
    assert hub.returncode == 0, hub.stderr[-2000:]
    assert "skipped (not on this machine): model config of 'Qwen/Qwen3-4B'" in hub.stdout
    for result in (ok, refused, hub):
        assert "Started a local Ray instance" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "entry_point, why",
    [
        ("verl.trainer.main_ppo", "its trainer runs none of the estimators' stages (segment data, values, repairs), "
                                  "nor this package's launch checks"),
        ("verl.experimental.one_step_off_policy.main_ppo", "its stages run in verl's sync trainer"),
        ("verl.experimental.fully_async_policy.fully_async_main", "its stages run in verl's sync trainer"),
    ],
)  # fmt: skip
def test_verls_own_entry_points_refuse_the_estimators_before_ray_starts(entry_point, why):
    """They do not go through this launcher; the plugin (loaded by `import verl`) refuses at their first call, before
    Ray starts and before any rollout: verl's main_ppo would otherwise run its rollouts and fail at the first
    advantage."""
    env = {**os.environ, "RREDCOT_CPU": "1"}
    result = subprocess.run(
        [sys.executable, "-m", entry_point, "algorithm.adv_estimator=rredcot",
         "hydra.searchpath=[pkg://verl.trainer.config]"],  # the async configs name verl's by a repo-relative path
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"rredcot_verl: algorithm.adv_estimator=rredcot is not supported by {entry_point}: {why}; launch with "
        "`python -m rredcot_verl.main` (the same overrides)"
    )
    assert "Started a local Ray instance" not in result.stdout + result.stderr


def test_verls_main_ppo_keeps_verls_own_estimators():
    """The refusal is for this package's estimators only: under verl's main_ppo, grpo passes the guard."""
    from rredcot_verl.integration.verl_entry_points import entry_point_refusal

    assert entry_point_refusal("verl.trainer.main_ppo", "grpo") is None
    assert entry_point_refusal("rredcot_verl.main", "rredcot") is None
    assert "verl.trainer.main_ppo" in entry_point_refusal("verl.trainer.main_ppo", "segment_mc")


def test_a_reward_manager_that_rescores_is_refused_for_extra_generations(cpu_build):
    overrides = ["reward.reward_manager.name=prime"]
    with pytest.raises(LaunchError, match=r"reward.reward_manager \(source=register, name=prime\) may score"):
        check(_config("ibpo", overrides))
    check(_config("rredcot", overrides))  # no extra generations: the rollouts' scores are verl's own
    check(_config("grpo", overrides))


def test_the_engine_context_of_a_hub_model_is_read_once_per_run(make_trainer, monkeypatch):
    """Without rollout.max_model_len the context comes from the model's config: a hub lookup, not one per step."""
    from rredcot_verl.integration import rollouts

    reads = []
    monkeypatch.setattr(rollouts, "engine_max_model_length", lambda config: reads.append(config) or 40960)
    trainer = make_trainer()
    assert [trainer.engine_max_model_length for _ in range(3)] == [40960] * 3 and len(reads) == 1


def test_verls_own_config_check_is_a_launch_refusal(cpu_build):
    """A reference policy without a log-prob micro-batch size fails verl's validate_config: one line, before Ray."""
    with pytest.raises(LaunchError, match=r"^verl's config check refuses it: \[actor_rollout_ref.ref\] Please set"):
        check(_config("grpo", ["actor_rollout_ref.actor.use_kl_loss=true"]))


def test_a_task_that_reads_no_answer_in_the_data_is_refused_at_launch(cpu_build):
    """verl's own GSM8K rows (answers after ``####``) with ``task: boxed_math``: every probe would score nothing."""
    from rredcot_verl.tasks.miniature import GSM8K_INSTRUCTION

    question = "Natalia sold clips to 48 of her friends in April, and half as many in May. How many in total?"
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
             "reward_model": {"style": "rule", "ground_truth": "72"},
             "extra_info": {"answer": "48/2 = 24 clips in May.\n48+24 = 72.\n#### 72", "question": question}}] * 8
    pd.DataFrame(rows).to_parquet(cpu_build / "data" / "train.parquet")
    with pytest.raises(LaunchError, match=r"^algorithm.rredcot.task=boxed_math reads no answer"):
        check(_config("rredcot", ["algorithm.rredcot.task=boxed_math"]))
    check(_config("rredcot", ["algorithm.rredcot.task=gsm8k", "algorithm.rredcot.probe.profile=auto"]))
    check(_config("grpo", ["algorithm.rredcot.task=boxed_math"]))  # verl's estimators read no answers


def test_thinking_switched_off_in_the_template_kwargs_makes_auto_the_plain_profile(cpu_build):
    """Qwen3 with enable_thinking=false: the chat template closes an empty thinking block in the prompt, and the
    responses are plain reasoning; `auto` alone would read the template's thinking markers."""
    off = ["+data.apply_chat_template_kwargs.enable_thinking=false"]

    def profile(*overrides):
        return prepare(_config("rredcot", list(overrides))).algorithm.rredcot.probe.profile

    assert profile(*off, "algorithm.rredcot.probe.profile=auto") == "plain"
    assert profile(*off, "algorithm.rredcot.probe.profile=qwen3") == "qwen3"  # named: kept
    assert profile("algorithm.rredcot.probe.profile=auto") == "auto"


def test_the_package_defaults_leave_verls_own_keys_alone():
    """Composed without a recipe, the launcher's config is verl's ppo_trainer plus algorithm.rredcot only: a recipe
    relying on verl's defaults (its logger, e.g.) keeps them."""
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "rredcot_verl" / "conf"), version_base=None):
        ours = OmegaConf.to_container(compose(config_name="rredcot_trainer"), resolve=False)
    with initialize_config_dir(config_dir=str(Path(pytest.importorskip("verl").__file__).parent / "trainer" / "config"),
                               version_base=None):  # fmt: skip
        verls = OmegaConf.to_container(compose(config_name="ppo_trainer"), resolve=False)
    assert ours["trainer"]["logger"] == verls["trainer"]["logger"]
    ours["algorithm"].pop("rredcot")
    assert ours == verls


@pytest.mark.parametrize("estimator", ["grpo", *OURS])
def test_a_step_whose_traces_do_not_split_into_micro_batches_is_refused_before_ray(cpu_build, estimator):
    """8 prompts x 5 rollouts = 40 traces against micro batches of 16: verl asserts at its first log-prob pass, after
    the rollouts (the verdict study's first grpo_n5 runs); refused at launch for every estimator, verl's included,
    naming the key; micro batches of 8, or verl's length balancing, pass."""
    with pytest.raises(LaunchError, match=r"log_prob_micro_batch_size_per_gpu=16 does not divide the 40 traces"):
        check(_config(estimator, ["actor_rollout_ref.rollout.n=5"]))
    eights = ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"]
    with pytest.raises(LaunchError, match=r"ppo_micro_batch_size_per_gpu=16 does not divide the 40 traces"):
        check(_config(estimator, ["actor_rollout_ref.rollout.n=5", eights[0]]))
    check(_config(estimator, ["actor_rollout_ref.rollout.n=5", *eights]))
    check(_config(estimator, ["actor_rollout_ref.rollout.n=5", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                              "actor_rollout_ref.actor.use_dynamic_bsz=true"]))
