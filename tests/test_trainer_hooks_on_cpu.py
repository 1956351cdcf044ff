"""The rredcot trainer's step hooks against recording stubs of verl's pieces they drive: the order of engine sleep,
actor forwards and extra generation; the failed-group count; the checkpoint order. (The end-to-end runs exercise the
same hooks with the real stack, where CPU mode turns vLLM's sleep mode off, so the order is only observable here.)"""

import json
import os
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf
from verl.trainer.ppo.v1.trainer_base import PPOTrainer

from rredcot_verl.core.settings import CandidateSettings, RRedCoTSettings
from rredcot_verl.integration import failures, trainer as trainer_module
from rredcot_verl.integration.estimators import ESTIMATORS, EngineUse, Stage
from rredcot_verl.integration.trainer import VALUE_GATE_FILE, SegmentCreditTrainer


class Engine:
    """The rollout replicas as verl's checkpoint manager drives them: awake after the rollouts, asleep after
    ``sleep_replicas``, awake (with the actor's weights) after ``update_weights``."""

    def __init__(self, events):
        self.awake, self.events = True, events

    def sleep_replicas(self):
        self.awake = False
        self.events.append("sleep")

    def update_weights(self, global_steps=None):
        self.awake = True
        self.events.append("wake")


def _trainer(estimator, events, monkeypatch, settings=RRedCoTSettings()):
    trainer = object.__new__(SegmentCreditTrainer)
    engine = Engine(events)

    def actor_forward(name):
        assert not engine.awake, f"actor {name} forward while the rollout engine holds its memory"
        events.append(name)

    def recording(stage):
        def produce(context, traces):
            # A stage that uses no engine scores probes on the actor (the value pass); the others generate.
            if stage.engine_use is EngineUse.NONE:
                actor_forward("value_pass")
            else:
                assert engine.awake, "generation while the engine sleeps"
                events.append("generate")
            return {key: None for key in ESTIMATORS[estimator].fields}, {}

        return Stage(produce, stage.engine_use)

    monkeypatch.setattr(PPOTrainer, "_compute_old_log_prob", lambda self, batch, metrics: actor_forward("log_prob") or batch)
    trainer.estimator = estimator
    spec = ESTIMATORS.get(estimator)
    trainer.spec = spec
    trainer.stages = () if spec is None else tuple(recording(stage) for stage in spec.stages(settings))
    trainer.settings = settings
    trainer.sampled_groups = None
    trainer.checkpoint_manager = engine
    trainer.curr_step_profile = False
    trainer.timing_raw = {}
    trainer.global_steps = 1
    trainer.step_context = lambda: None
    trainer._trace_batch = lambda batch, with_entropy: SimpleNamespace(with_entropy=with_entropy)
    trainer._put = lambda batch, tensors: None
    return trainer, engine


REPAIR_BANK = RRedCoTSettings(candidates=CandidateSettings(source="group_and_repairs"))


@pytest.mark.parametrize(
    "estimator, settings, expected",
    [
        ("grpo", RRedCoTSettings(), ["sleep", "log_prob"]),
        ("rredcot", RRedCoTSettings(), ["sleep", "log_prob", "value_pass"]),
        # repairs need only outcomes: generated before the pass
        ("ibpo", RRedCoTSettings(), ["generate", "sleep", "log_prob"]),
        # boundaries need the pass's entropy
        ("segment_mc", RRedCoTSettings(), ["sleep", "log_prob", "wake", "generate", "sleep"]),
        # repairs first (they fill the value pass's bank), then the value pass on the actor
        ("rredcot_ibpo", REPAIR_BANK, ["generate", "sleep", "log_prob", "value_pass"]),
        ("rredcot", REPAIR_BANK, ["generate", "sleep", "log_prob", "value_pass"]),
    ],
    ids=["grpo", "rredcot", "ibpo", "segment_mc", "rredcot_ibpo", "rredcot-repair-bank"],
)
def test_no_actor_forward_runs_while_the_engine_holds_its_memory(estimator, settings, expected, monkeypatch):
    """verl's step: rollouts, ``on_sample_end``, then the old-log-prob pass; our stages run around that pass.
    The engine must sleep through every actor forward and be awake for every generation, and sleep at the end."""
    events = []
    trainer, engine = _trainer(estimator, events, monkeypatch, settings)
    trainer.on_sample_end()
    trainer._compute_old_log_prob(batch=object(), metrics={})
    assert not engine.awake
    assert events == expected


def test_stages_of_one_step_share_its_context(monkeypatch):
    """The repair stage leaves the verified repairs in the step's context; the value stage reads them there."""
    trainer, _ = _trainer("rredcot_ibpo", [], monkeypatch, REPAIR_BANK)
    contexts = []
    trainer.stages = tuple(
        Stage(lambda context, traces: (contexts.append(context) or {}, {}), stage.engine_use) for stage in trainer.stages
    )
    trainer.step_context = lambda: {"step": len(contexts)}
    trainer.on_sample_end()
    trainer._compute_old_log_prob(batch=object(), metrics={})
    assert len(contexts) == 2 and contexts[0] is contexts[1]


def test_only_stages_after_the_pass_read_its_entropy(monkeypatch):
    seen = {}
    for estimator in ("rredcot", "ibpo", "segment_mc", "rredcot_ibpo"):
        trainer, _ = _trainer(estimator, [], monkeypatch)
        trainer._trace_batch = lambda batch, with_entropy, name=estimator: seen.setdefault(name, []).append(with_entropy)
        trainer.on_sample_end()
        trainer._compute_old_log_prob(batch=object(), metrics={})
    assert seen == {"rredcot": [True], "ibpo": [False], "segment_mc": [True], "rredcot_ibpo": [False, True]}


@pytest.mark.parametrize(
    "keys, requested, expected",
    [
        (["a_0", "a_1", "b_0", "b_1"], 2, (0, 0)),
        (["a_0", "a_1", "b_1"], 2, (1, 1)),  # b lost a session
        (["a_0", "a_1"], 3, (2, 4)),  # two prompts lost every session
        ([], 1, (1, 2)),
    ],
)
def test_groups_that_lost_sessions_are_counted(keys, requested, expected):
    count = failures.count_groups(keys, requested, samples_per_prompt=2)
    assert (count.failed, count.missing_traces) == expected
    assert count.share == pytest.approx(expected[0] / requested)


def test_a_step_past_the_failed_share_stops_with_the_first_error(monkeypatch):
    trainer, _ = _trainer("grpo", [], monkeypatch)
    monkeypatch.setattr(failures, "first_error", lambda: "ValueError: signal only works in main thread")
    trainer.sampled_groups = failures.count_groups(["a_0", "a_1", "b_0"], 2, samples_per_prompt=2)
    trainer.on_sample_end()
    metrics = {}
    with pytest.raises(failures.RolloutFailure) as error:
        trainer._compute_old_log_prob(batch=object(), metrics=metrics)
    assert "1 of 2 prompt groups lost 1 traces" in str(error.value)
    assert "max_failed_group_share=0.1" in str(error.value) and "signal only works in main thread" in str(error.value)
    assert metrics["rollout/failed_groups"] == 1.0 and metrics["rollout/failed_group_share"] == 0.5

    trainer.settings = RRedCoTSettings(max_failed_group_share=0.5)  # at the share: logged, the step goes on
    metrics = {}
    trainer._compute_old_log_prob(batch=object(), metrics=metrics)
    assert metrics["rollout/failed_groups"] == 1.0 and metrics["rollout/missing_traces"] == 1.0


def test_value_gate_window_is_written_before_verl_declares_the_checkpoint_complete(tmp_path, monkeypatch):
    """verl's save ends with latest_checkpointed_iteration.txt and the checkpoint callback (remote upload): the
    window file must already be in the folder by then."""
    trainer, _ = _trainer("rredcot", [], monkeypatch)
    trainer.config = OmegaConf.create({"trainer": {"default_local_dir": str(tmp_path)}})
    trainer.value_window = trainer_module.ConcordanceWindow(3)
    seen = {}

    def verl_save(self):
        folder = tmp_path / f"global_step_{self.global_steps}"
        seen["window_present_at_completion"] = (folder / VALUE_GATE_FILE).is_file()
        (tmp_path / "latest_checkpointed_iteration.txt").write_text(str(self.global_steps))

    monkeypatch.setattr(PPOTrainer, "_save_checkpoint", verl_save)
    trainer._save_checkpoint()
    assert seen == {"window_present_at_completion": True}
    saved = json.loads((tmp_path / "global_step_1" / VALUE_GATE_FILE).read_text())
    assert saved == {"previous_batches": trainer.value_window.state_dict()}
    assert os.path.isfile(tmp_path / "latest_checkpointed_iteration.txt")


@pytest.mark.parametrize("estimator, fallback", [("rredcot", "GRPO's advantage"), ("rredcot_ibpo", "IBPO's advantage")])
def test_the_log_says_when_the_value_gate_closes_and_what_the_batch_trains_with(estimator, fallback, monkeypatch, caplog):
    trainer, _ = _trainer(estimator, [], monkeypatch)
    trainer.value_gate_open = True
    closed = {f"{estimator}/value_gate_open": 0.0, f"{estimator}/value_concordance_pooled": 0.54}
    with caplog.at_level("WARNING", logger=trainer_module.logger.name):
        trainer._report_value_gate(closed)
        trainer._report_value_gate(closed)  # still closed: said once
        trainer._report_value_gate({f"{estimator}/value_gate_open": 1.0})
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2
    assert "value gate closed (pooled value-outcome concordance 0.540, threshold 0.6)" in messages[0]
    assert f"this batch trains with {fallback}" in messages[0] and "value gate opened" in messages[1]
