"""Every shipped GPU recipe, launched as a user launches it (``python -m rredcot_verl.main --config-dir ...
--config-name ...``) in miniature on CPU, or, where two recipes differ only in listed keys, composed and compared key by
key with one that is (``COVERED_BY_ANOTHER_LAUNCH``): 2 training steps with a tiny model of the recipe's family (its
chat template and thinking markers, so the ``qwen3`` / ``r1_distill`` probe profiles are the ones exercised), data
written by the recipes' own converter, and only what cannot run here overridden (``PERMITTED_OVERRIDES``). Everything
else is the recipe's: estimator, task, the math-verify reward through the recipe's own ``pkg://`` path, segmentation,
dynamic batch size, checkpointing. The launcher's CPU accommodations (``launcher.CPU_CONFIG``: device, attention
backend, remove-padding, vLLM sleep mode) apply as to any CPU run.

A run that exits 0 is not enough: each test reads the step metrics (no failed groups, finite advantages, the
estimator's own counts), the rollouts verl dumped (the reward workers' scores equal the recipe's reward function
recomputed here, and some responses were parsed) and the log (no error that verl caught and carried on from).
"""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from miniature_launch import launch_and_read, shared_build_folder
from rredcot_verl.tasks.math_reward import compute_score
from verl.utils.reward_score import default_compute_score

ROOT = Path(__file__).resolve().parents[1]

# recipe -> (folder under recipes/, model family, data folder the recipe reads under $DATA_DIR, estimator overrides)
RECIPES = {
    "qwen3_4b_numina_grpo": ("paper", "qwen3", "numina", {}),
    "qwen3_4b_numina_rredcot": ("paper", "qwen3", "numina", {}),
    "r1_distill_1p5b_openrs_rredcot": ("paper", "r1_distill", "open_rs", {}),
    # compare.sh trains grpo and the README's rows A-D on the one-GPU recipe; the paper recipes cover grpo and rredcot,
    # this run row D without the dataset's solutions (IBPO's repairs and the value pass, on a chat template).
    # verl's own GSM8K rows (#### answers, verl's reward) for a Qwen3 thinking model.
    "qwen3_0p6b_gsm8k": ("gpu_single", "qwen3_gsm8k", "gsm8k",
                         {"algorithm.adv_estimator": "rredcot_ibpo",
                          "algorithm.rredcot.candidates.source": "group_and_repairs",
                          "algorithm.rredcot.snapshot_dir": "<out>/snapshots", "algorithm.rredcot.snapshot_freq": "1"}),
}

# What a miniature run may change, and why: the model (a tiny one of the family, built here), lengths and batch
# sizes (CPU scale), devices and workers (one CPU box), the number of steps and validation (time), output paths
# (snapshots included) and loggers (no wandb here), the estimator of the one-GPU recipe with its bank (compare.sh
# swaps them), and the value gate's threshold: its decision on two batches of 16 traces is noise (a batch's
# concordance varies by about 0.06-0.1), and a closed gate leaves the redistribution these runs check untried. The gate
# is tested in tests/test_value_gate_on_cpu.py; its window is still kept and saved here.
PERMITTED_OVERRIDES = frozenset(
    {
        "actor_rollout_ref.model.path",
        "data.max_prompt_length",
        "data.max_response_length",
        "data.train_batch_size",
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "actor_rollout_ref.rollout.agent.num_workers",
        "reward.num_workers",
        "data.dataloader_num_workers",
        "trainer.n_gpus_per_node",
        "trainer.nnodes",
        "trainer.total_training_steps",
        "trainer.val_before_train",
        "trainer.test_freq",
        "trainer.default_local_dir",
        "trainer.rollout_data_dir",
        "trainer.logger",
        "algorithm.adv_estimator",
        "algorithm.rredcot.candidates.source",
        "algorithm.rredcot.snapshot_dir",
        "algorithm.rredcot.snapshot_freq",
        "algorithm.rredcot.redistribution.min_value_concordance",
    }
)
STEPS = 2

# A recipe not launched here, the launched recipe it equals, and the keys in which they differ: the paper's GRPO
# baseline is the RREDCoT recipe with another estimator and learning rate. GRPO through this package's trainer is
# launched by tests/test_calculator_miniature_on_cpu.py (the tool task).
COVERED_BY_ANOTHER_LAUNCH = {
    "qwen3_4b_numina_grpo": (
        "qwen3_4b_numina_rredcot",
        {"algorithm.adv_estimator", "actor_rollout_ref.actor.optim.lr", "trainer.experiment_name"},
    ),
}


def miniature_overrides(recipe: str, build: Path, out: Path) -> dict[str, object]:
    """The overrides a miniature run of ``recipe`` passes (each key must be in ``PERMITTED_OVERRIDES``)."""
    overrides = {
        "actor_rollout_ref.model.path": str(build / "model"),
        "data.max_prompt_length": 192,
        "data.max_response_length": 128,
        "data.train_batch_size": 4,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "actor_rollout_ref.rollout.gpu_memory_utilization": 0.1,
        "actor_rollout_ref.rollout.agent.num_workers": 1,
        "reward.num_workers": 1,
        "data.dataloader_num_workers": 0,
        "trainer.n_gpus_per_node": 1,
        "trainer.nnodes": 1,
        "trainer.total_training_steps": STEPS,
        "trainer.val_before_train": False,
        "trainer.test_freq": -1,
        "trainer.default_local_dir": str(out / "checkpoints"),
        "trainer.rollout_data_dir": str(out / "rollouts"),
        "trainer.logger": "[console,file]",
        "algorithm.rredcot.redistribution.min_value_concordance": 0.0,
    }
    extra = {key: value.replace("<out>", str(out)) for key, value in RECIPES[recipe][3].items()}
    return {**overrides, **extra}


def _as_cli(overrides: dict) -> list[str]:
    return [f"{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in overrides.items()]


def _recipe_dir(recipe: str) -> Path:
    return ROOT / "recipes" / RECIPES[recipe][0]


def test_every_shipped_gpu_recipe_has_a_miniature_run():
    shipped = {path.stem for folder in ("paper", "gpu_single") for path in (ROOT / "recipes" / folder).glob("*.yaml")}
    assert shipped == set(RECIPES)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_miniature_runs_override_only_permitted_keys_that_exist(recipe, tmp_path, monkeypatch):
    """A key outside the list fails here; so does a listed key the recipe's composed config does not have (a typo
    would otherwise add a new key and leave the recipe's own value in force)."""
    monkeypatch.setenv("DATA_DIR", str(tmp_path))
    overrides = miniature_overrides(recipe, tmp_path, tmp_path)
    assert set(overrides) <= PERMITTED_OVERRIDES, sorted(set(overrides) - PERMITTED_OVERRIDES)
    with initialize_config_dir(config_dir=str(_recipe_dir(recipe)), version_base=None):
        plain = compose(config_name=recipe)
        overridden = compose(config_name=recipe, overrides=_as_cli(overrides))
    from omegaconf import OmegaConf

    for key in overrides:
        assert OmegaConf.select(plain, key, default="<missing>") != "<missing>", key
    # Nothing else differs from the recipe.
    recipe_values = dict(_flatten(OmegaConf.to_container(plain, resolve=False)))
    run_values = dict(_flatten(OmegaConf.to_container(overridden, resolve=False)))
    changed = {key for key, value in run_values.items() if recipe_values.get(key) != value}
    assert changed <= set(overrides), sorted(changed - set(overrides))


@pytest.mark.parametrize("recipe", sorted(COVERED_BY_ANOTHER_LAUNCH))
def test_a_recipe_without_a_launch_equals_a_launched_one_but_for_listed_keys(recipe, tmp_path, monkeypatch):
    monkeypatch.setenv("DATA_DIR", str(tmp_path))
    launched, differing = COVERED_BY_ANOTHER_LAUNCH[recipe]
    assert RECIPES[launched][:3] == RECIPES[recipe][:3]  # same folder, model family and data

    def flat(name: str) -> dict:
        from omegaconf import OmegaConf

        with initialize_config_dir(config_dir=str(_recipe_dir(name)), version_base=None):
            return dict(_flatten(OmegaConf.to_container(compose(config_name=name), resolve=False)))

    ours, theirs = flat(recipe), flat(launched)
    assert {key for key in ours.keys() | theirs.keys() if ours.get(key) != theirs.get(key)} == differing


def _flatten(tree, prefix=""):
    """(dotted key, leaf value) pairs of a nested dict."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], tree


@pytest.fixture(scope="module")
def miniatures(tmp_path_factory):
    """A family's build (data + warm-started tiny model), made when a run first needs it and shared by the runs."""
    builds: dict[str, Path] = {}

    def build(family: str) -> Path:
        if family not in builds:
            with shared_build_folder(f"miniature_{family}", tmp_path_factory) as out:
                subprocess.run(
                    [sys.executable, "-m", "rredcot_verl.tasks.build", "--setting", family, "--out", str(out)],
                    check=True, capture_output=True, timeout=900,
                )  # fmt: skip
            builds[family] = out
        return builds[family]

    return build


LAUNCHED = sorted(set(RECIPES) - set(COVERED_BY_ANOTHER_LAUNCH))


# One stream of the end-to-end tier runs a family's recipes, on one build (conftest.py).
@pytest.mark.e2e
@pytest.mark.parametrize(
    "recipe", [pytest.param(recipe, marks=pytest.mark.launch_group(f"miniature_{RECIPES[recipe][1]}")) for recipe in LAUNCHED]
)
def test_recipe_trains_in_miniature(recipe, miniatures, tmp_path):
    _, family, data_name, _ = RECIPES[recipe]
    build = miniatures(family)
    data_dir = tmp_path / "data"
    shutil.copytree(build / "data", data_dir / data_name)
    out = tmp_path / "run"
    out.mkdir()
    env = {**os.environ, "DATA_DIR": str(data_dir), "VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl")}
    log, rows = launch_and_read(_recipe_dir(recipe), recipe, _as_cli(miniature_overrides(recipe, build, out)), env,
                                tmp_path, out, STEPS,
                                ("actor/grad_norm", "actor/pg_loss", "critic/advantages/mean", "critic/score/mean"))
    estimator = RECIPES[recipe][3].get("algorithm.adv_estimator") or "rredcot"
    if estimator in ("rredcot", "rredcot_ibpo"):
        assert all(row[f"{estimator}/fallback/nonfinite"] == 0 for row in rows)
        assert any(row[f"{estimator}/redistributed_frac"] > 0 for row in rows), "no trace was redistributed"
    if estimator == "rredcot_ibpo":
        # The fused estimator: repairs through the vLLM server before the log-prob pass, the value pass on the actor
        # after it, each group's bank from its correct traces or else its verified repairs (counted against the
        # step's own outcomes, read from the snapshots), and the shaped advantage placed by the values.
        assert all(row["ibpo/incorrect_traces"] > 0 for row in rows)
        assert any(row["ibpo/revisions"] > 0 and row["ibpo/extra_generated_tokens"] > 0 for row in rows)
        for row in rows:  # no reference solutions: every group's bank is its own traces, its repairs, or empty
            traces = json.loads((out / "snapshots" / f"step_{row['step']:05d}.json").read_text())["traces"]
            groups: dict[str, list[float]] = {}
            for trace in traces:
                groups.setdefault(trace["uid"], []).append(trace["outcome"])
            with_correct = sum(max(outcomes) == 1.0 for outcomes in groups.values())
            assert row["rredcot/bank_groups_from_dataset"] == 0
            assert row["rredcot/bank_groups_from_traces"] == with_correct
            assert row["rredcot/bank_groups_from_repairs"] + row["rredcot/bank_groups_empty"] == len(groups) - with_correct
            assert all(math.isfinite(a) for trace in traces for a in trace["token_advantages"])
        assert any(row["rredcot_ibpo/credit_from_values_frac"] > 0 for row in rows)

    # The reward workers ran the recipe's reward (math-verify off the main thread, or verl's GSM8K rule) on parsed
    # answers: their scores equal the recipe's function, recomputed here, and some responses had an answer to parse.
    dumped = [json.loads(line) for path in sorted((out / "rollouts").glob("*.jsonl")) for line in path.read_text().splitlines()]
    with initialize_config_dir(config_dir=str(_recipe_dir(recipe)), version_base=None):
        config = compose(config_name=recipe)
    samples_per_prompt = int(config.actor_rollout_ref.rollout.n)
    assert len(dumped) == STEPS * miniature_overrides(recipe, build, out)["data.train_batch_size"] * samples_per_prompt
    reward = config.reward.custom_reward_function
    score, data_source, marker = {
        ("pkg://rredcot_verl.tasks.math_reward", "compute_score"): (compute_score, "miniature/math", "\\boxed{"),
        ("pkg://verl.utils.reward_score", "default_compute_score"): (default_compute_score, "openai/gsm8k", "#### "),
    }[(reward.path, reward.name)]
    answered = [row for row in dumped if marker in row["output"]]
    assert len(answered) >= len(dumped) // 4, f"only {len(answered)} of {len(dumped)} responses wrote {marker!r}"
    for row in dumped:
        assert row["score"] == score(data_source, row["output"], row["gts"]), row["output"]
    if int(config.trainer.save_freq) > 0:  # the recipe saves (at the last step too): with the gate's window
        assert (out / "checkpoints" / f"global_step_{STEPS}" / "value_gate.json").is_file()
