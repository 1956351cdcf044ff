"""``algorithm.rredcot.snapshot_freq`` and ``snapshot_max_traces`` at both places that write snapshots: the trainer's
``step_XXXXX.json`` (``SegmentCreditTrainer._compute_advantage``) and ``rredcot``'s ``step_XXXXX_plans.pt``
(``estimators.rredcot.probe_values``), driven with the committed warm-start tokenizer and model, real probe plans and
the real value pass; only verl's own advantage step and TransferQueue are stood in for."""

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from verl import DataProto
from verl.trainer.ppo.v1.trainer_base import PPOTrainer

from rredcot_verl.core.traces import TraceRecord
from rredcot_verl.core.probes import ProbeSettings
from rredcot_verl.core.segmentation import SegmentationSettings
from rredcot_verl.core.settings import RRedCoTSettings, settings_from_config
from rredcot_verl.integration.estimators.base import StepContext, StepTraces
from rredcot_verl.integration.estimators.rredcot import probe_values
from rredcot_verl.integration.workers import SegmentActorRolloutRefWorker
from rredcot_verl.tasks.arithmetic import ArithmeticProblem, reference_response, reference_steps
from rredcot_verl.tasks.base import ARITHMETIC
from rredcot_verl.tasks.model import chat_prompt_ids, load_model_dir, response_ids

torch.set_num_threads(1)
ARTEFACT = Path(__file__).resolve().parents[1] / "rredcot_verl" / "tasks" / "assets" / "warmstart"
PROBLEM = ArithmeticProblem(operands=(23, 45, 17, 8), ops=("+", "-", "+"))
WRONG = "<think>\n23+45=68\n68-17=50\n50+8=58\n</think>\n\\boxed{58}"
# Three prompt groups of two traces, in verl's batch order (a group's traces are adjacent).
GROUPS = ["a", "a", "b", "b", "c", "c"]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    model, tokenizer = load_model_dir(str(ARTEFACT))
    return model.eval(), tokenizer


def _settings(tmp_path, **snapshot) -> RRedCoTSettings:
    return RRedCoTSettings(
        snapshot_dir=str(tmp_path / "snapshots"),
        task="arithmetic",
        segmentation=SegmentationSettings(max_segments=8, min_segment_len=2),
        probe=ProbeSettings(value_source="reference_continuation", profile="embedded"),
        **snapshot,
    )


def _written(tmp_path, pattern: str) -> list[str]:
    return sorted(path.name for path in (tmp_path / "snapshots").glob(pattern))


# -------------------------------------------------------------------------------------------- the trainer's JSON


def _trainer(make_trainer, tmp_path, monkeypatch, *snapshot):
    """The trainer (``grpo``: verl's own advantage step, stood in for) after its advantage step over a 6-trace batch
    served from memory, with ``snapshot`` settings."""
    trainer = make_trainer("algorithm.adv_estimator=grpo", f"algorithm.rredcot.snapshot_dir={tmp_path / 'snapshots'}",
                           *(f"algorithm.rredcot.{setting}" for setting in snapshot))  # fmt: skip
    tokenizer = trainer.tokenizer
    prompt = torch.tensor(chat_prompt_ids(tokenizer, PROBLEM.prompt))
    texts = [reference_response(PROBLEM), WRONG] * 3
    responses = [torch.tensor(response_ids(tokenizer, text)) for text in texts]
    width = max(len(r) for r in responses)
    trainer.store.update({
        "prompts": torch.stack([prompt] * len(texts)),
        "responses": torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in responses]),
        "advantages": torch.arange(len(texts) * width, dtype=torch.float32).reshape(len(texts), width),
        "rm_scores": torch.tensor([[1.0], [0.0]] * 3),
        "uid": list(GROUPS),
        "extra_info": [{"operands": list(PROBLEM.operands), "ops": list(PROBLEM.ops)}] * len(texts),
    })  # fmt: skip
    monkeypatch.setattr(PPOTrainer, "_compute_advantage", lambda self, batch, metrics: batch)
    return trainer


def _train(trainer, steps: int) -> None:
    batch = list(range(len(GROUPS)))
    for step in range(1, steps + 1):
        trainer.global_steps = step
        trainer._compute_advantage(batch, {})


def test_trainer_writes_a_snapshot_every_snapshot_freq_steps(tmp_path, make_trainer, monkeypatch):
    trainer = _trainer(make_trainer, tmp_path, monkeypatch, "snapshot_freq=2")
    _train(trainer, 5)
    assert _written(tmp_path, "step_*.json") == ["step_00002.json", "step_00004.json"]


def test_trainer_snapshot_holds_whole_groups_up_to_the_bound(tmp_path, make_trainer, monkeypatch):
    trainer = _trainer(make_trainer, tmp_path, monkeypatch, "snapshot_max_traces=5")
    _train(trainer, 1)
    traces = json.loads((tmp_path / "snapshots" / "step_00001.json").read_text())["traces"]
    # 5 traces allowed: groups a and b (4 traces) fit, c would make 6.
    assert [trace["uid"] for trace in traces] == ["a", "a", "b", "b"]
    assert [trace["outcome"] for trace in traces] == [1.0, 0.0, 1.0, 0.0]
    # Each kept trace carries its own row: row i of the advantages starts at i x the padded width.
    firsts = [trace["token_advantages"][0] for trace in traces]
    assert firsts[1] > 0 and firsts == [i * firsts[1] for i in range(4)]


def test_trainer_snapshot_without_a_bound_keeps_every_trace(tmp_path, make_trainer, monkeypatch):
    trainer = _trainer(make_trainer, tmp_path, monkeypatch, "snapshot_max_traces=null")
    _train(trainer, 1)
    traces = json.loads((tmp_path / "snapshots" / "step_00001.json").read_text())["traces"]
    assert [trace["uid"] for trace in traces] == GROUPS


# ---------------------------------------------------------------------------------------------- rredcot's plans


def _records(tokenizer) -> list[TraceRecord]:
    prompt = torch.tensor(chat_prompt_ids(tokenizer, PROBLEM.prompt))
    records = []
    for group, text, outcome in zip(GROUPS, [reference_response(PROBLEM), WRONG] * 3, [1.0, 0.0] * 3):
        response = torch.tensor(response_ids(tokenizer, text), dtype=torch.long)
        records.append(TraceRecord(prompt_ids=prompt, response_ids=response, entropy=torch.ones(response.numel()),
                                   outcome=outcome, group=group, ground_truth="59",
                                   reference_steps=reference_steps(PROBLEM)))
    return records


def _value_steps(settings, model, tokenizer, steps: int) -> None:
    """``rredcot``'s value stage for ``steps`` steps, its value pass the actor workers' own on the warm-start
    model."""
    engine = SimpleNamespace(module=model, eval_mode=contextlib.nullcontext)
    worker = SimpleNamespace(actor=SimpleNamespace(engine=engine))

    def value_pass(request: DataProto) -> DataProto:
        return SegmentActorRolloutRefWorker.value_pass(worker, request)

    records = _records(tokenizer)
    traces = StepTraces(records, response_width=max(r.response_ids.numel() for r in records))
    for step in range(1, steps + 1):
        context = StepContext(settings=settings, tokenizer=tokenizer, step=step, task=ARITHMETIC,
                              boundary_vocab=settings.boundary_vocab(tokenizer), value_pass=value_pass)
        inputs, _ = probe_values(context, traces)
        assert inputs["segment_ends"].shape[0] == len(records)  # the value pass itself still covers the whole batch


def test_value_stage_saves_plans_every_snapshot_freq_steps_for_the_kept_traces(tmp_path, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    _value_steps(_settings(tmp_path, snapshot_freq=3, snapshot_max_traces=3), model, tokenizer, 6)
    assert _written(tmp_path, "step_*_plans.pt") == ["step_00003_plans.pt", "step_00006_plans.pt"]
    plans = torch.load(tmp_path / "snapshots" / "step_00003_plans.pt", weights_only=False)
    # 3 traces allowed: group a only (b would make 4), the same rows as the trainer's JSON of that step keeps.
    records = _records(tokenizer)
    assert len(plans) == 2
    for plan, record in zip(plans, records[:2]):
        assert torch.equal(torch.as_tensor(plan.response_ids), record.response_ids)
        assert plan.outcome == record.outcome


def test_a_bound_below_one_group_keeps_that_groups_first_traces(tmp_path):
    settings = RRedCoTSettings(snapshot_max_traces=1)
    assert settings.snapshot_rows(GROUPS) == [0]
    assert RRedCoTSettings(snapshot_max_traces=64).snapshot_rows(GROUPS) == list(range(6))
    # Groups are whole in the order they first appear, even where a batch interleaves them.
    assert RRedCoTSettings(snapshot_max_traces=4).snapshot_rows(["a", "b", "a", "b", "c", "c"]) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "section, message",
    [
        ({"snapshot_freq": 0}, "snapshot_freq must be an integer >= 1"),
        ({"snapshot_freq": 2.5}, "snapshot_freq must be an integer >= 1"),
        ({"snapshot_max_traces": 0}, "snapshot_max_traces must be an integer >= 1 or null"),
        ({"snapshot_frequency": 10}, "unknown key(s) ['snapshot_frequency'] in algorithm.rredcot"),
    ],
)
def test_snapshot_settings_are_checked_and_unknown_keys_still_refused(section, message):
    with pytest.raises(ValueError) as error:
        settings_from_config({"rredcot": section})
    assert message in str(error.value)


def test_snapshots_off_by_default():
    assert not RRedCoTSettings().snapshot_due(1)
    assert RRedCoTSettings(snapshot_dir="x").snapshot_due(1)
