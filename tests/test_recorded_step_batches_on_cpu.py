"""Step batches recorded from short end-to-end runs, replayed through the trainer's code: the advantages are bit-equal.

The fixtures (``tests/fixtures/recorded_step_batches/<case>.pt``) were recorded at commit bc6dfe3 by
``.venv/bin/python tests/record_step_batches.py`` (each names its commit, ``commit``): two steps of a tiny recipe per
case, ``rredcot`` with the exit probe and with reference continuations, ``ibpo`` (the recipe's ``rewrite`` repairs),
``rredcot_ibpo`` and ``segment_mc``. Per step they keep what the advantage step received (verl's rewards, mask and
uids, the ``AdvantageBatch`` the trainer built, ``algorithm`` as a container) and the advantages and returns the
estimator gave verl; for the value pass's estimators also what the value stage read from verl's batch, the request it
sent the actor, the probe log-probs the actor computed and the values it returned.

Replayed here without Ray, vLLM or a forward: the trainer's ``_advantage_batch`` and verl's registered estimator
(inside ``advantage_step``, as verl's ``compute_advantage`` calls it) on the recorded inputs; and the value stage from
the recorded batch fields (``step_traces`` and the stage's planning), its request compared with the recorded one, the
actor's scoring replaced by the probe log-probs it recorded (a forward of the actor is not replayed), the values
assembled by ``core.values.score_plans`` and compared. Stages that generate (IBPO's repairs, segment_mc's
continuations) are not replayed: their outputs are the recorded batch's inputs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

from rredcot_verl.core import values as core_values
from rredcot_verl.core.concordance import ConcordanceCounts
from rredcot_verl.core.scoring import BatchStats, PackedScores
from rredcot_verl.core.settings import settings_from_config
from rredcot_verl.integration import trainer as trainer_module
from rredcot_verl.integration.estimators import AdvantageBatch, advantage_step

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "recorded_step_batches"
CASES = sorted(path.stem for path in FIXTURES.glob("*.pt"))


def _recorded(case: str) -> dict:
    return torch.load(FIXTURES / f"{case}.pt", weights_only=False)


def _field(value):
    """A recorded batch field as verl's batch held it: a ragged tensor from its rows, a list of values."""
    if isinstance(value, dict) and "nested_rows" in value:
        return torch.nested.as_nested_tensor(value["nested_rows"], layout=torch.jagged)
    return value if isinstance(value, torch.Tensor) else list(value)


def _same(actual, expected, where: str) -> None:
    """Equal to the bit, through dicts, lists and tensors (NaN equal to NaN)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, where
        assert actual.shape == expected.shape and torch.equal(actual.nan_to_num(7.0), expected.nan_to_num(7.0)), where
        assert torch.equal(actual.isnan(), expected.isnan()), where
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), (where, set(actual) ^ set(expected))
        for key in expected:
            _same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            _same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, (where, actual, expected)


def _trainer(make_trainer, recorded_step: dict):
    """The rredcot trainer of the recorded estimator, its settings those of the recorded run (snapshots off)."""
    advantage = recorded_step["advantage"]
    trainer = make_trainer(f"algorithm.adv_estimator={advantage['estimator']}")
    settings = settings_from_config(OmegaConf.create(advantage["config"]))
    trainer.settings = dataclasses.replace(settings, snapshot_dir=None)
    trainer.stages = trainer.spec.stages(trainer.settings)
    return trainer


@pytest.mark.parametrize("case", CASES)
def test_recorded_advantages_are_bit_equal(case, make_trainer):
    """verl's registered estimator, called as verl's ``compute_advantage`` calls it inside the trainer's
    ``advantage_step``, on each recorded step's inputs: the trainer's ``AdvantageBatch`` and the advantages and
    returns are the recorded ones."""
    recorded = _recorded(case)
    for step in recorded["steps"]:
        advantage = step["advantage"]
        trainer = _trainer(make_trainer, step)
        trainer.global_steps = advantage["step"]
        batch = advantage["batch"]
        trainer.store["uid"] = list(batch["index"])
        for name in trainer.spec.inputs:
            trainer.store[AdvantageBatch.BATCH_KEYS[name]] = batch[name]
        prior = ConcordanceCounts(**batch["prior_concordance"])
        trainer.value_window.pooled = lambda prior=prior: prior
        built = {}

        def advantage_fn(token_level_rewards, response_mask, uid):
            built["batch"] = trainer._advantage_batch(None, token_level_rewards, response_mask, uid)
            return trainer.spec.advantage(built["batch"], trainer.settings)

        arguments = advantage["verl_arguments"]
        index = np.array(arguments["index"], dtype=object)
        with advantage_step(advantage_fn):
            advantages, returns = ADV_ESTIMATOR_REGISTRY[advantage["estimator"]](
                arguments["token_level_rewards"], arguments["response_mask"], index=index, config=None
            )
        where = f"{case} step {advantage['step']}"
        fields = {field.name: getattr(built["batch"], field.name) for field in dataclasses.fields(AdvantageBatch)}
        fields["index"] = list(fields["index"])
        fields["prior_concordance"] = dataclasses.asdict(fields["prior_concordance"])
        _same(fields, batch, f"{where} AdvantageBatch")
        _same(advantages, advantage["result"]["advantages"], f"{where} advantages")
        _same(returns, advantage["result"]["returns"], f"{where} returns")


def _replayed_value_pass(recorded_pass: dict, monkeypatch, where: str):
    """The actor's value pass on the recorded request: the request's plans must be the recorded ones; the actor's
    probe scoring returns what it recorded; ``core.values.score_plans`` assembles the values as the worker does."""
    scores = recorded_pass["scores"]
    packed = [PackedScores(**result) for result in scores["results"]]
    monkeypatch.setattr(core_values, "score_batch_packed_with_stats",
                        lambda *args, **kwargs: (packed, BatchStats(**scores["stats"])))  # fmt: skip

    def value_pass(request: DataProto) -> DataProto:
        (plans,) = [list(traces) for traces in request.non_tensor_batch.values()]
        # The fields the recorded plans had, each equal (the request's traces may carry more).
        assert len(plans) == len(recorded_pass["plans"]), where
        sent = [{key: dataclasses.asdict(plan)[key] for key in recorded} for plan, recorded in
                zip(plans, recorded_pass["plans"])]  # fmt: skip
        _same(sent, recorded_pass["plans"], f"{where} value-pass plans")
        _same({key: request.batch[key] for key in request.batch.keys()}, recorded_pass["tensors"], f"{where} request")
        _same(dict(request.meta_info), recorded_pass["meta_info"], f"{where} meta_info")
        meta = request.meta_info
        segment_ends, raw_values, metrics = core_values.score_plans(
            None, plans, max_segments=int(meta["max_segments"]), max_token_len=meta["value_pass"]["max_token_len"])
        return DataProto.from_dict(tensors={"segment_ends": segment_ends, "raw_values": raw_values},
                                   meta_info={"metrics": metrics})  # fmt: skip

    return value_pass


@pytest.mark.parametrize("case", [case for case in CASES if "value_pass" in _recorded(case)["steps"][0]])
def test_recorded_value_stage_plans_and_values_are_bit_equal(case, make_trainer, monkeypatch):
    """The value stage on each recorded step's batch fields: the same plans go to the actor, and the values it
    returns (from the recorded probe log-probs) are the recorded ones and the ``AdvantageBatch``'s inputs."""
    recorded = _recorded(case)
    for step in recorded["steps"]:
        where = f"{case} step {step['advantage']['step']}"
        trainer = _trainer(make_trainer, step)
        trainer.global_steps = step["advantage"]["step"]
        recorded_pass = step["value_pass"]
        # The value stage alone (the last): a repair stage before it generates, and left the recorded repairs.
        value_stage = trainer.stages[-1]
        trainer.stages = (value_stage,)
        trainer.actor_rollout_wg = SimpleNamespace(value_pass=_replayed_value_pass(recorded_pass, monkeypatch, where))
        context = trainer.step_context()
        context.verified_repairs = recorded_pass["verified_repairs"]
        data = {key: _field(value) for key, value in step["traces"]["fields"].items()}
        traces = trainer_module.step_traces(data, with_entropy=True)
        inputs, _ = value_stage.produce(context, traces)
        _same({key: inputs[key] for key in recorded_pass["output"]}, recorded_pass["output"], f"{where} values")
        for name in ("segment_ends", "raw_values"):
            _same(inputs[name], step["advantage"]["batch"][name], f"{where} {name}")
