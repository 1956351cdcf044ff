"""The rredcot trainer is verl's *sync* trainer to verl's base class (integration/trainer.py, ``__init__``).

verl's ``PPOTrainer`` branches on ``self.trainer_mode == "sync"`` (replay buffer, ``data.gen_batch_size``, TransferQueue
prompt persistence, checkpoint save/resume) and sets that attribute from ``trainer.v1.trainer_mode``, which also names
the registered trainer class. ``SegmentCreditTrainer`` is selected as "rredcot" (verl's task runner reads the key before
building the trainer) and then sets the key of the config it is given to "sync". These tests fail when verl reads the
mode some other way (before the trainer exists, or by another question than "sync or not"), so the trainer would
silently run an async path again, and check the resulting behaviour on a trainer built from the tiny recipe (no Ray:
only ``__init__`` and the dataloader).
"""

import ast
import shutil
from pathlib import Path

import pytest
import verl
from hydra import compose, initialize_config_dir
from verl.trainer.ppo.v1 import trainer_base
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
from verl.trainer.ppo.v1.trainer_base import get_trainer_cls
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from rredcot_verl.compat import REPLAY_POLL_INTERVAL_S
from rredcot_verl.integration.launcher import prepare
from rredcot_verl.integration.trainer import SYNC_MODE, TRAINER_NAME, SegmentCreditTrainer

ROOT = Path(__file__).resolve().parents[1]
ARTEFACT = ROOT / "rredcot_verl" / "tasks" / "assets" / "warmstart"
VERL = Path(verl.__file__).parent


def _is_self_trainer_mode(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "trainer_mode"
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def test_verl_base_reads_the_mode_only_through_self_trainer_mode_and_only_tests_for_sync():
    tree = ast.parse(Path(trainer_base.__file__).read_text())
    config_reads, assignments, compared = [], [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "trainer_mode" and not _is_self_trainer_mode(node):
            config_reads.append((node.lineno, _dotted(node)))
        if isinstance(node, ast.Assign) and any(_is_self_trainer_mode(t) for t in node.targets):
            assignments.append((node.lineno, _dotted(node.value)))
        if isinstance(node, ast.Compare) and any(_is_self_trainer_mode(n) for n in [node.left, *node.comparators]):
            assert all(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops), ast.unparse(node)
            compared |= {n.value for n in [node.left, *node.comparators] if isinstance(n, ast.Constant)}
    # One read of the config, in __init__ (after the rredcot trainer set it to "sync"), stored on the instance ...
    assert [read for _, read in config_reads] == ["self.config.trainer.v1.trainer_mode"], config_reads
    assert [value for _, value in assignments] == ["self.config.trainer.v1.trainer_mode"], assignments
    # ... and every branch asks one question: "sync" or not.
    assert compared == {SYNC_MODE}, compared


def test_no_other_verl_module_branches_on_the_mode():
    """Where else verl names the mode; a new place must be checked (and added here) by hand."""
    users = sorted(
        str(path.relative_to(VERL))
        for path in VERL.rglob("*.py")
        if "trainer_mode" in path.read_text(errors="ignore")
    )
    assert users == [
        "trainer/main_ppo.py",  # get_trainer_cls(config.trainer.v1.trainer_mode): the selection, before __init__
        "trainer/ppo/v1/replay_buffer.py",  # stores the value it is given (ours: "sync")
        "trainer/ppo/v1/trainer_base.py",  # checked above
        "utils/skip/rollout_skip.py",  # trainer.v1.<mode>.parameter_sync_step, default 1 as in trainer.v1.sync
    ], users
    replay_buffer = ast.parse((VERL / "trainer/ppo/v1/replay_buffer.py").read_text())
    assert not any(
        isinstance(node, ast.Compare) and any(_is_self_trainer_mode(n) for n in [node.left, *node.comparators])
        for node in ast.walk(replay_buffer)
    ), "verl's ReplayBuffer now branches on trainer_mode"


def test_registration_selects_our_class_and_verls_sync_stays_verls():
    assert get_trainer_cls(TRAINER_NAME) is SegmentCreditTrainer
    assert get_trainer_cls(SYNC_MODE) is PPOTrainerSync
    assert issubclass(SegmentCreditTrainer, PPOTrainerSync)


@pytest.fixture()
def config(tmp_path, monkeypatch):
    from rredcot_verl.tasks.arithmetic import write_parquet

    write_parquet(str(tmp_path / "data"), n_train=16, n_val=4, seed=0)
    shutil.copytree(ARTEFACT, tmp_path / "model")
    monkeypatch.setenv("RREDCOT_BUILD", str(tmp_path))
    monkeypatch.setenv("RREDCOT_REWARD_FILE", str(ROOT / "rredcot_verl/tasks/reward.py"))
    monkeypatch.setenv("RREDCOT_CPU", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # gen_batch_size=2 of train_batch_size=4: verl's async paths would override it to 1.
    overrides = ["data.train_batch_size=4", "+data.gen_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
    with initialize_config_dir(config_dir=str(ROOT / "recipes" / "tiny_cpu"), version_base=None):
        return prepare(compose(config_name="rredcot", overrides=overrides))


def _built(cls, config):
    trainer = cls(config.copy())
    # The parts of init() that need no Ray: tokenizer and dataloaders (where the gen_batch_size rule lives).
    trainer._init_tokenizer()
    trainer._init_dataloader()
    return trainer


def test_rredcot_trainer_gets_verls_sync_replay_buffer_and_gen_batch_size(config):
    assert config.trainer.v1.trainer_mode == TRAINER_NAME
    ours = _built(SegmentCreditTrainer, config)
    assert ours.config.trainer.v1.trainer_mode == SYNC_MODE  # what verl reads from here on
    sync_config = config.copy()
    sync_config.trainer.v1.trainer_mode = SYNC_MODE
    theirs = _built(PPOTrainerSync, sync_config)
    assert ours.trainer_mode == theirs.trainer_mode == SYNC_MODE
    assert type(ours.replay_buffer) is type(theirs.replay_buffer) is ReplayBuffer
    for attribute in ("trainer_mode", "gen_batch_size", "train_batch_size", "max_inflight_gen_batches"):
        assert getattr(ours.replay_buffer, attribute) == getattr(theirs.replay_buffer, attribute), attribute
    assert ours.replay_buffer.gen_batch_size == 2
    # CPU mode (the fixture's RREDCOT_CPU=1): only how often the buffer looks for finished rollouts differs.
    assert ours.replay_buffer.poll_interval == REPLAY_POLL_INTERVAL_S < theirs.replay_buffer.poll_interval
    assert ours.train_dataloader.batch_size == theirs.train_dataloader.batch_size == 2
    assert ours.config.data.gen_batch_size == 2
    assert ours.parameter_sync_step == theirs.parameter_sync_step
    assert ours.boundary_vocab is not None  # built once the tokenizer exists


def test_the_class_refuses_to_run_under_another_name(config):
    config.trainer.v1.trainer_mode = "colocate_async"
    with pytest.raises(ValueError, match="trainer.v1.trainer_mode=rredcot"):
        SegmentCreditTrainer(config)
