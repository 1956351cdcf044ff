"""Fixtures shared by the tests (a build for the launcher, a trainer instance), and the streams the end-to-end tier
runs in."""

from __future__ import annotations

import copy
import functools
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WARM_START = ROOT / "rredcot_verl" / "tasks" / "assets" / "warmstart"


@pytest.fixture()
def build(tmp_path, monkeypatch):
    """The embedded default as ``recipes/tiny_cpu`` reads it (``$RREDCOT_BUILD``: a few parquet rows and the shipped
    warm start), without the minutes of a full build."""
    from rredcot_verl.tasks.arithmetic import write_parquet

    write_parquet(str(tmp_path / "data"), n_train=8, n_val=4, seed=0)
    shutil.copytree(WARM_START, tmp_path / "model")
    monkeypatch.setenv("RREDCOT_BUILD", str(tmp_path))
    monkeypatch.setenv("RREDCOT_REWARD_FILE", str(ROOT / "rredcot_verl/tasks/reward.py"))
    return tmp_path


@pytest.fixture()
def blocked_attention_calls(monkeypatch) -> list:
    """One entry per call of the value pass's block-by-block probe attention (``scoring._blocked_probe_attention``),
    which still runs: whether a forward took that path."""
    from rredcot_verl.core import scoring

    calls = []
    blocked = scoring._blocked_probe_attention

    def counting(*args):
        calls.append(1)
        return blocked(*args)

    monkeypatch.setattr(scoring, "_blocked_probe_attention", counting)
    return calls


@functools.lru_cache(maxsize=None)
def _trainer_config(overrides: tuple[str, ...]):
    """The package's composed config (verl's ppo_trainer and algorithm.rredcot) with hydra ``overrides``; composed once
    per distinct overrides (about 0.4 s each), copied for each trainer (which changes its config)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "rredcot_verl" / "conf"), version_base=None):
        return compose(config_name="rredcot_trainer", overrides=list(overrides))


def _transfer_queue(store: dict):
    """TransferQueue's two calls verl's own trainer steps make (``kv_batch_get``, ``kv_batch_put``), on ``store``:
    field name to rows (tensors, or lists of a non-tensor field's values)."""
    from types import SimpleNamespace

    from tensordict import NonTensorStack, TensorDict

    def kv_batch_get(keys, partition_id, select_fields):
        fields = {key: store[key] for key in select_fields if key in store}
        fields = {key: NonTensorStack(*value) if isinstance(value, list) else value for key, value in fields.items()}
        return TensorDict(fields, batch_size=[len(keys)])

    def kv_batch_put(keys, partition_id, fields):
        store.update(dict(fields.items()))
        return SimpleNamespace(keys=keys, partition_id=partition_id)

    return SimpleNamespace(kv_batch_get=kv_batch_get, kv_batch_put=kv_batch_put)


@pytest.fixture()
def make_trainer(monkeypatch):
    """``make_trainer(*overrides, store=None)``: the rredcot trainer as verl's task runner builds it (its own
    ``__init__`` on the package's composed config: the embedded task on the shipped warm start, with hydra
    ``overrides``; the tokenizer loaded by verl's ``_init_tokenizer``), without Ray. TransferQueue is the dict
    ``trainer.store`` (field name to rows), for the trainer's own reads and writes and for verl's steps it runs (those
    of the trainer made last: verl's trainer module has one ``tq``); what a test drives beyond it (worker groups, the
    checkpoint manager, the engine's client) the test sets."""
    from verl.trainer.ppo.v1 import trainer_base

    from rredcot_verl.integration.trainer import TRAINER_NAME, SegmentCreditTrainer

    def make(*overrides: str, store: dict | None = None):
        # The value source's keys as the tiny recipe pins them: the launcher, not run here, would resolve their
        # `auto` default from the training rows.
        base = (f"trainer.v1.trainer_mode={TRAINER_NAME}", f"actor_rollout_ref.model.path={WARM_START}",
                "algorithm.rredcot.task=arithmetic", "algorithm.rredcot.probe.profile=embedded",
                "algorithm.rredcot.probe.value_source=exit_probe", "algorithm.rredcot.candidates.source=both",
                "algorithm.rredcot.redistribution.value_mapping=affine",
                "algorithm.rredcot.redistribution.degenerate_groups=grpo")  # fmt: skip
        trainer = SegmentCreditTrainer(copy.deepcopy(_trainer_config((*base, *overrides))))
        trainer._init_tokenizer()
        trainer.global_steps, trainer.timing_raw = 1, {}
        trainer.store = {} if store is None else store
        trainer._fetch = lambda batch, fields: {key: trainer.store[key] for key in fields if key in trainer.store}
        trainer._put = lambda batch, tensors: trainer.store.update(tensors) or batch
        monkeypatch.setattr(trainer_base, "tq", _transfer_queue(trainer.store))
        return trainer

    return make


# ----------------------------------------------------------------------------------------------------------------
# Streams of end-to-end launches (scripts/test.sh). With RREDCOT_E2E_CLAIMS naming a folder, several pytest processes
# over the same tests share the work: each runs the groups it claims first (an exclusive file per group), the largest
# groups first, and skips the rest without reporting them. A group is the items marked with the same
# ``launch_group`` (tests that read one launch, or builds worth sharing); any other item is a group of its own.
CLAIMS_ENV = "RREDCOT_E2E_CLAIMS"


def pytest_configure(config):
    config.addinivalue_line("markers", "launch_group(name): items that one stream runs together (see CLAIMS_ENV)")
    config.claimed_groups = []


# ----------------------------------------------------------------------------------------------------------------
# Which tests touch a library, from what they import: ``transformers`` marks every test of a module whose imports
# reach ``transformers`` (the statements anywhere in the module, followed through the repository's own modules);
# ``vllm`` marks a test that reaches ``vllm`` through its module's top-level imports or its own body. Computed at
# collection, so the list follows the code. scripts/test_pinned.sh runs ``-m "transformers and not vllm and not e2e"``
# on verl 0.9.1's pinned transformers, where vLLM is not installed.
REPOSITORY_PACKAGES = ("rredcot_verl", "benchmarks")
LIBRARY_MARKERS = ("transformers", "vllm")


def _repository_file(module: str) -> Path | None:
    """The file of a repository module (package, module, or a helper module beside the tests), else None."""
    parts = module.split(".")
    if parts[0] in REPOSITORY_PACKAGES:
        base = ROOT.joinpath(*parts)
        for candidate in (base / "__init__.py", base.with_suffix(".py")):
            if candidate.is_file():
                return candidate
        return None
    helper = ROOT / "tests" / f"{module}.py"
    return helper if len(parts) == 1 and helper.is_file() else None


def _imported(nodes) -> set[str]:
    """Module names the import statements among ``nodes`` (and below them) name, ``from a import b`` giving a and
    a.b (b may be a module)."""
    import ast

    names: set[str] = set()
    for node in (n for top in nodes for n in ast.walk(top)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return names


_FILE_IMPORTS: dict[Path, set[str]] = {}


def _libraries(names: set[str]) -> set[str]:
    """Top-level packages outside the repository that importing ``names`` reaches, through repository modules."""
    import ast

    libraries, seen, todo = set(), set(), list(names)
    while todo:
        name = todo.pop()
        path = _repository_file(name)
        if path is None:
            if name.split(".")[0] not in REPOSITORY_PACKAGES:
                libraries.add(name.split(".")[0])
            continue
        if path in seen:
            continue
        seen.add(path)
        if path not in _FILE_IMPORTS:
            _FILE_IMPORTS[path] = _imported([ast.parse(path.read_text())])
        todo += _FILE_IMPORTS[path]
    return libraries


def _test_libraries(item) -> tuple[set[str], set[str]]:
    """(what the item's whole module reaches, what its module's top level and its own function reach)."""
    import ast

    module = ast.parse(Path(item.fspath).read_text())
    top = [node for node in module.body if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    name = getattr(getattr(item, "function", None), "__name__", None)
    own = [node for node in ast.walk(module) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
           and node.name == name]
    return _libraries(_imported([module])), _libraries(_imported(top + own))


def pytest_collection_modifyitems(config, items):
    reached: dict[str, tuple[set[str], set[str]]] = {}
    for item in items:
        key = f"{item.fspath}::{getattr(item, 'originalname', item.name)}"
        if key not in reached:
            reached[key] = _test_libraries(item)
        whole, own = reached[key]
        if "transformers" in whole:
            item.add_marker("transformers")
        if "vllm" in own:
            item.add_marker("vllm")


def _groups(items) -> dict[str, list]:
    groups: dict[str, list] = {}
    for item in items:
        marker = item.get_closest_marker("launch_group")
        groups.setdefault(marker.args[0] if marker else item.nodeid, []).append(item)
    # The largest first (sorted is stable: collection order otherwise), so a stream that starts late finds small ones.
    return dict(sorted(groups.items(), key=lambda group: -len(group[1])))


def _claim(folder: Path, name: str) -> bool:
    import hashlib
    import os

    path = folder / hashlib.sha1(name.encode()).hexdigest()
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    path.write_text(name)
    return True


def pytest_runtestloop(session):
    import os

    folder = os.environ.get(CLAIMS_ENV)
    if not folder or session.config.option.collectonly or not session.items:
        return None  # pytest's own loop
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        raise session.Interrupted(f"{session.testsfailed} error(s) during collection")
    groups = _groups(session.items)
    pending = iter(groups)

    def next_claimed() -> str | None:
        for name in pending:
            if _claim(Path(folder), name):
                session.config.claimed_groups.append(name)
                return name
        return None

    current = next_claimed()
    while current is not None:
        items = groups[current]
        upcoming = None
        for index, item in enumerate(items):
            if index + 1 < len(items):
                nextitem = items[index + 1]
            else:
                # Claimed before the teardown so pytest knows which fixtures the next item keeps.
                upcoming = next_claimed()
                nextitem = groups[upcoming][0] if upcoming is not None else None
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
        current = upcoming
    return True


def pytest_terminal_summary(terminalreporter, config):
    import os

    if os.environ.get(CLAIMS_ENV) and not config.option.collectonly:
        terminalreporter.write_line(f"this stream ran {len(config.claimed_groups)} group(s): {config.claimed_groups}")
