"""verl's own preprocessed data as it comes (``examples/data_preprocess/gsm8k.py`` and ``math_dataset.py``: their
file names, columns and answer formats), and what the launcher makes of it before Ray starts: the value source chosen
from what the rows offer when only the estimator is set, a configuration that needs worked solutions the rows lack
refused naming the key, the GPU recipes pointed at these files, and a missing environment variable named in one line.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from datasets import Dataset, DatasetDict

from composing import compose_recipe
from rredcot_verl.core.settings import settings_from_config
from rredcot_verl.integration.launcher import LaunchError, check, prepare

ROOT = Path(__file__).resolve().parents[1]
PRIMARY = str(ROOT / "rredcot_verl" / "conf")
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def verl_gsm8k_rows(split: str) -> pd.DataFrame:
    """Rows as verl's gsm8k.py writes them: the number in ground_truth, the rationale ending ``#### n`` in
    extra_info.answer."""
    rows = []
    for index, (a, b) in enumerate([(3, 4), (12, 5), (7, 8), (20, 22)]):
        question = f"Tom has {a} apples and buys {b} more. How many apples does he have?"
        rows.append({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": index, "question": question,
                           "answer": f"He has {a}+{b}=<<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"},
        })  # fmt: skip
    return pd.DataFrame(rows)


def verl_math_rows(split: str) -> pd.DataFrame:
    """Rows as verl's math_dataset.py writes them: the boxed answer in ground_truth, no worked solution."""
    rows = []
    for index, n in enumerate([2, 3, 5, 7]):
        rows.append({
            "data_source": "DigitalLearningGmbH/MATH-lighteval",
            "prompt": [{"role": "user", "content": f"What is {n} squared? {MATH_INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(n * n)},
            "extra_info": {"split": split, "index": index},
        })  # fmt: skip
    return pd.DataFrame(rows)


@pytest.fixture()
def verl_data(tmp_path, monkeypatch):
    """$DATA_DIR/{gsm8k,math}/{train,test}.parquet, as verl's scripts name them."""
    for name, rows in (("gsm8k", verl_gsm8k_rows), ("math", verl_math_rows)):
        (tmp_path / name).mkdir()
        for split in ("train", "test"):
            rows(split).to_parquet(tmp_path / name / f"{split}.parquet")
    monkeypatch.setenv("DATA_DIR", str(tmp_path))
    monkeypatch.setenv("RREDCOT_CPU", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return tmp_path


def launch_config(data: Path, dataset: str, *overrides: str):
    """A plain ``k=v`` launch on the package's primary config, with verl's reward for the rows' data_source."""
    return compose_recipe(PRIMARY, "rredcot_trainer", [
        f"data.train_files={data / dataset / 'train.parquet'}", f"data.val_files={data / dataset / 'test.parquet'}",
        "data.train_batch_size=4", "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "reward.custom_reward_function.path=pkg://verl.utils.reward_score",
        "reward.custom_reward_function.name=default_compute_score", *overrides])  # fmt: skip


def value_keys(config) -> tuple[str, str, str, str]:
    s = settings_from_config(config.algorithm)
    return (s.probe.value_source, s.candidates.source, s.redistribution.value_mapping,
            s.redistribution.degenerate_groups)


ROW_A = ("reference_continuation", "ground_truth", "log_affine", "grpo")
ROW_C = ("reference_continuation", "group_and_repairs", "log_affine", "value_differences")


def test_only_the_estimator_set_takes_row_a_on_verls_gsm8k_and_says_so(verl_data, capsys):
    config = prepare(launch_config(verl_data, "gsm8k", "algorithm.adv_estimator=rredcot",
                                   "algorithm.rredcot.task=gsm8k"))
    assert value_keys(config) == ROW_A  # written into the config the trainer's processes read
    lines = [line for line in capsys.readouterr().out.splitlines() if "(auto)" in line]
    assert len(lines) == 1 and "worked solutions" in lines[0] and 'row A' in lines[0]
    assert "algorithm.rredcot.candidates.source=ground_truth" in lines[0]


def test_only_the_estimator_set_takes_row_c_on_verls_math_rows(verl_data, capsys):
    config = prepare(launch_config(verl_data, "math", "algorithm.adv_estimator=rredcot"))
    assert value_keys(config) == ROW_C
    line = next(line for line in capsys.readouterr().out.splitlines() if "(auto)" in line)
    assert "no worked solutions" in line and "row C" in line


def test_rredcot_ibpo_alone_takes_row_d(verl_data):
    config = prepare(launch_config(verl_data, "math", "algorithm.adv_estimator=rredcot_ibpo"))
    assert value_keys(config) == ("reference_continuation", "group_and_repairs", "log_affine", "grpo")


@pytest.mark.parametrize(
    "overrides, expected",
    [
        # an explicit value, even the dataclass default, is kept; the keys left to auto follow its measured row
        (["algorithm.rredcot.probe.value_source=exit_probe"], ("exit_probe", "both", "affine", "grpo")),
        (["algorithm.rredcot.candidates.source=group_and_repairs"], ROW_C),
        (["algorithm.rredcot.redistribution.degenerate_groups=grpo"], ROW_A[:3] + ("grpo",)),
        (["algorithm.rredcot.redistribution.value_mapping=affine"], ("reference_continuation", "ground_truth",
                                                                     "affine", "grpo")),
    ],
)
def test_an_explicit_setting_wins_over_auto(verl_data, overrides, expected):
    config = prepare(launch_config(verl_data, "gsm8k", "algorithm.adv_estimator=rredcot",
                                   "algorithm.rredcot.task=gsm8k", *overrides))
    assert value_keys(config) == expected


def test_multi_turn_rollouts_take_the_exit_probe(verl_data):
    """Rollouts verl makes multi-turn (its tool agent loop by default; run_shapes.multi_turn_key) take exit probes."""
    config = launch_config(verl_data, "gsm8k", "algorithm.adv_estimator=rredcot", "algorithm.rredcot.task=gsm8k",
                           "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent")
    check(config)
    assert value_keys(config) == ("exit_probe", "both", "affine", "grpo")


def test_remote_training_files_take_row_c_and_say_they_were_not_read(verl_data):
    config = launch_config(verl_data, "gsm8k", "algorithm.adv_estimator=rredcot", "algorithm.rredcot.task=gsm8k",
                           "data.train_files=hdfs://namenode/gsm8k/train.parquet")
    skipped = check(config)
    assert value_keys(config) == ROW_C
    assert any("worked solutions in data.train_files (remote)" in item for item in skipped)


@pytest.mark.parametrize("source", ["ground_truth", "both"])
def test_reference_solutions_the_rows_lack_are_refused_naming_the_key(verl_data, source):
    config = launch_config(verl_data, "math", "algorithm.adv_estimator=rredcot",
                           f"algorithm.rredcot.candidates.source={source}")
    with pytest.raises(LaunchError) as error:
        check(config)
    message = str(error.value)
    assert f"algorithm.rredcot.candidates.source={source}" in message and "none of the 4 sampled rows" in message
    assert "\n" not in message


def test_exit_probe_answers_from_the_ground_truth_need_no_worked_solution(verl_data):
    config = launch_config(verl_data, "math", "algorithm.adv_estimator=rredcot",
                           "algorithm.rredcot.probe.value_source=exit_probe",
                           "algorithm.rredcot.candidates.source=ground_truth")
    check(config)


def _cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rredcot_verl.main", "--check-only", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_the_one_gpu_recipe_reads_verls_gsm8k_files_and_refuses_its_math_files_in_one_line(verl_data):
    """Pointed at verl's GSM8K folder the recipe passes every check; renamed onto verl's MATH files (boxed answers)
    it is refused before Ray, in one line naming the task that reads them."""
    recipe = ["--config-dir", str(ROOT / "recipes" / "gpu_single"), "--config-name", "qwen3_0p6b_gsm8k"]
    env = {**os.environ, "DATA_DIR": str(verl_data), "RREDCOT_CPU": "1"}
    accepted = _cli(*recipe, env=env)
    assert accepted.returncode == 0 and "rredcot_verl: ok" in accepted.stdout, accepted.stderr[-2000:]
    (verl_data / "gsm8k").rename(verl_data / "gsm8k_verl")
    (verl_data / "math").rename(verl_data / "gsm8k")
    refused = _cli(*recipe, env=env)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("rredcot_verl: algorithm.rredcot.task=gsm8k") and "boxed_math" in line


def test_a_missing_environment_variable_is_named_in_one_line(verl_data):
    env = {key: value for key, value in os.environ.items() if key != "DATA_DIR"}
    result = _cli("--config-dir", str(ROOT / "recipes" / "paper"), "--config-name", "qwen3_4b_numina_rredcot", env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "rredcot_verl: environment variable DATA_DIR is not set: data.train_files reads it")


def _prepare_math_data():
    spec = importlib.util.spec_from_file_location("prepare_math_data", ROOT / "recipes/paper/prepare_math_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dataset(**splits: int) -> DatasetDict:
    return DatasetDict({name: Dataset.from_dict({"problem": [f"{name} {i}" for i in range(n)],
                                                 "solution": [f"\\boxed{{{i}}}" for i in range(n)]})
                        for name, n in splits.items()})


def test_prepare_math_data_holds_out_the_official_test_split():
    script = _prepare_math_data()
    train, test = script.official_splits(_dataset(train=5, test=2), "numina")
    assert list(train["problem"]) == [f"train {i}" for i in range(5)] and list(test["problem"]) == ["test 0", "test 1"]
    train, test = script.official_splits(_dataset(train=5), "open-rs", _dataset(test=3), "MATH-500")
    assert len(train) == 5 and list(test["problem"]) == ["test 0", "test 1", "test 2"]
    with pytest.raises(ValueError, match="open-rs has no test split .* --test-dataset"):
        script.official_splits(_dataset(train=5), "open-rs")
