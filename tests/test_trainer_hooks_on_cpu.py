"""The rredcot trainer's step hooks against recording stubs of verl's pieces they drive: the order of engine sleep,
actor forwards and extra generation; the failed-group count; the checkpoint order. (The end-to-end runs exercise the
same hooks with the real stack, where CPU mode turns vLLM's sleep mode off, so the order is only observable here.)"""

import contextlib
import dataclasses
import functools
import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl import DataProto
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
from verl.trainer.ppo.v1.trainer_base import PPOTrainer

from rredcot_verl.core.concordance import ConcordanceCounts
from rredcot_verl.core.segmentation import turn_spans
from rredcot_verl.integration import failures, trainer as trainer_module
from rredcot_verl.integration.estimators import ESTIMATORS, EngineUse, Stage
from rredcot_verl.integration.estimators.rredcot import VALUE_STAGE
from rredcot_verl.integration.trainer import VALUE_GATE_FILE
from rredcot_verl.integration.workers import SegmentActorRolloutRefWorker
from rredcot_verl.tasks.arithmetic import ArithmeticProblem, reference_steps
from rredcot_verl.tasks.model import chat_prompt_ids, load_model_dir


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


# Two prompts of two traces a step (data.train_batch_size, rollout.n).
STEP = ("data.train_batch_size=2", "actor_rollout_ref.rollout.n=2")


def _sampled(keys, padding: int = 0):
    """A sampled batch as verl's replay buffer and ``_balance_batch`` leave it: TransferQueue keys ``{uid}_{session}``,
    then ``padding`` rows tagged ``is_padding``."""
    keys = [*keys, *(f"pad_{i}" for i in range(padding))]
    return SimpleNamespace(keys=keys, tags=[{"is_padding": key.startswith("pad_")} for key in keys])


FULL_STEP = _sampled(["a_0", "a_1", "b_0", "b_1"])


def _trainer(make_trainer, estimator, events, monkeypatch, *overrides):
    trainer = make_trainer(f"algorithm.adv_estimator={estimator}", *STEP, *overrides)
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
            return {name: None for name in ESTIMATORS[estimator].inputs}, {}

        return Stage(produce, stage.engine_use)

    monkeypatch.setattr(PPOTrainer, "_compute_old_log_prob", lambda self, batch, metrics: actor_forward("log_prob") or batch)
    trainer.stages = tuple(recording(stage) for stage in trainer.stages)
    trainer.checkpoint_manager = engine
    trainer.curr_step_profile = False
    trainer.step_context = lambda: None
    trainer._trace_batch = lambda batch, with_entropy: SimpleNamespace(with_entropy=with_entropy)
    # verl's rm_scores of the batch (one token reward per trace), on the default reward_range's scale
    trainer._fetch = lambda batch, fields: TensorDict({"rm_scores": torch.tensor([[0.0], [1.0]])}, batch_size=2)
    return trainer, engine


REPAIR_BANK = ("algorithm.rredcot.candidates.source=group_and_repairs",)


@pytest.mark.parametrize(
    "estimator, overrides, expected",
    [
        ("grpo", (), ["sleep", "log_prob"]),
        ("rredcot", (), ["sleep", "log_prob", "value_pass"]),
        # repairs need only outcomes: generated before the pass
        ("ibpo", (), ["generate", "sleep", "log_prob"]),
        # boundaries need the pass's entropy
        ("segment_mc", (), ["sleep", "log_prob", "wake", "generate", "sleep"]),
        # repairs first (they fill the value pass's bank), then the value pass on the actor
        ("rredcot_ibpo", REPAIR_BANK, ["generate", "sleep", "log_prob", "value_pass"]),
        ("rredcot", REPAIR_BANK, ["generate", "sleep", "log_prob", "value_pass"]),
    ],
    ids=["grpo", "rredcot", "ibpo", "segment_mc", "rredcot_ibpo", "rredcot-repair-bank"],
)
def test_no_actor_forward_runs_while_the_engine_holds_its_memory(estimator, overrides, expected, make_trainer,
                                                                 monkeypatch):
    """verl's step: rollouts, ``on_sample_end``, then the old-log-prob pass; our stages run around that pass.
    The engine must sleep through every actor forward and be awake for every generation, and sleep at the end."""
    events = []
    trainer, engine = _trainer(make_trainer, estimator, events, monkeypatch, *overrides)
    trainer.on_sample_end()
    trainer._compute_old_log_prob(batch=FULL_STEP, metrics={})
    assert not engine.awake
    assert events == expected


@pytest.mark.parametrize("estimator", ["rredcot", "ibpo", "segment_mc", "rredcot_ibpo"])
def test_a_first_batch_off_the_reward_range_stops_before_any_extra_work(estimator, make_trainer, monkeypatch):
    """verl's math_dapo scores a wrong answer -1: under the default reward_range [0, 1] the first batch stops the
    run, naming the key, before a repair, continuation, log-prob pass or value pass; a later batch is not checked
    (its outliers are the estimators' counted fallbacks)."""
    events = []
    trainer, _ = _trainer(make_trainer, estimator, events, monkeypatch)
    dapo = torch.tensor([[-1.0], [-1.0], [-1.0], [1.0]])  # one outcome a trace of FULL_STEP
    trainer._fetch = lambda batch, fields: TensorDict({"rm_scores": dapo}, batch_size=4)
    trainer.on_sample_end()
    with pytest.raises(trainer_module.RewardScaleError) as error:
        trainer._compute_old_log_prob(batch=FULL_STEP, metrics={})
    assert "3 of 4 outcomes of the first batch lie outside algorithm.rredcot.reward_range=[0, 1]" in str(error.value)
    assert "\n" not in str(error.value)
    assert [event for event in events if event != "sleep"] == []
    trainer._compute_old_log_prob(batch=FULL_STEP, metrics={})  # the second batch runs its stages
    assert "log_prob" in events

    trainer, _ = _trainer(make_trainer, estimator, [], monkeypatch, "algorithm.rredcot.reward_range=[-1.0,1.0]")
    trainer._fetch = lambda batch, fields: TensorDict({"rm_scores": dapo}, batch_size=4)
    trainer.on_sample_end()
    trainer._compute_old_log_prob(batch=FULL_STEP, metrics={})  # the scale declared: it trains


def test_stages_of_one_step_share_its_context(make_trainer, monkeypatch):
    """The repair stage leaves the verified repairs in the step's context; the value stage reads them there."""
    trainer, _ = _trainer(make_trainer, "rredcot_ibpo", [], monkeypatch, *REPAIR_BANK)
    contexts = []
    trainer.stages = tuple(
        Stage(lambda context, traces: (contexts.append(context) or {}, {}), stage.engine_use) for stage in trainer.stages
    )
    trainer.step_context = lambda: {"step": len(contexts)}
    trainer.on_sample_end()
    trainer._compute_old_log_prob(batch=FULL_STEP, metrics={})
    assert len(contexts) == 2 and contexts[0] is contexts[1]


def test_only_stages_after_the_pass_read_its_entropy(make_trainer, monkeypatch):
    seen = {}
    for estimator in ("rredcot", "ibpo", "segment_mc", "rredcot_ibpo"):
        trainer, _ = _trainer(make_trainer, estimator, [], monkeypatch)
        trainer._trace_batch = lambda batch, with_entropy, name=estimator: seen.setdefault(name, []).append(with_entropy)
        trainer.on_sample_end()
        trainer._compute_old_log_prob(batch=FULL_STEP, metrics={})
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


def test_a_step_past_the_failed_share_stops_with_the_first_error(make_trainer, monkeypatch):
    trainer, _ = _trainer(make_trainer, "grpo", [], monkeypatch)
    monkeypatch.setattr(failures, "first_error", lambda: "ValueError: signal only works in main thread")
    # b lost a session; verl's balancing padded the batch back to four rows, which are not traces of any group
    lost = _sampled(["a_0", "a_1", "b_0"], padding=1)
    trainer.on_sample_end()
    metrics = {}
    with pytest.raises(failures.RolloutFailure) as error:
        trainer._compute_old_log_prob(batch=lost, metrics=metrics)
    assert "1 of 2 prompt groups lost 1 traces" in str(error.value)
    assert "max_failed_group_share=0.1" in str(error.value) and "signal only works in main thread" in str(error.value)
    assert metrics["rollout/failed_groups"] == 1.0 and metrics["rollout/failed_group_share"] == 0.5

    trainer.settings = dataclasses.replace(trainer.settings, max_failed_group_share=0.5)  # at the share: logged
    metrics = {}
    trainer._compute_old_log_prob(batch=lost, metrics=metrics)
    assert metrics["rollout/failed_groups"] == 1.0 and metrics["rollout/missing_traces"] == 1.0
    trainer._compute_old_log_prob(batch=FULL_STEP, metrics=metrics)
    assert metrics["rollout/failed_groups"] == 0.0


def test_value_gate_window_is_written_before_verl_declares_the_checkpoint_complete(tmp_path, make_trainer,
                                                                                    monkeypatch):
    """verl's save ends with latest_checkpointed_iteration.txt and the checkpoint callback (remote upload): the
    window file must already be in the folder by then."""
    trainer, _ = _trainer(make_trainer, "rredcot", [], monkeypatch, f"trainer.default_local_dir={tmp_path}")
    trainer.value_window.push(ConcordanceCounts(3.0, 4))
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
def test_the_log_says_when_the_value_gate_closes_and_what_the_batch_trains_with(estimator, fallback, make_trainer,
                                                                               monkeypatch, caplog):
    trainer, _ = _trainer(make_trainer, estimator, [], monkeypatch)
    closed = {f"{estimator}/value_gate_open": 0.0, f"{estimator}/value_concordance_pooled": 0.54}
    with caplog.at_level("WARNING", logger=trainer_module.logger.name):
        trainer._report_value_gate(closed)
        trainer._report_value_gate(closed)  # still closed: said once
        trainer._report_value_gate({f"{estimator}/value_gate_open": 1.0})
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2
    assert "value gate closed (pooled value-outcome concordance 0.540, threshold 0.6)" in messages[0]
    assert f"this batch trains with {fallback}" in messages[0] and "value gate opened" in messages[1]


# ------------------------------------------------------------------------------- multi-turn traces, end to end
# A batch as verl's tool agent loop leaves it in TransferQueue (Qwen's continuous-token layout): the model's turns
# (mask 1, each closed by its own <|im_end|>), then the separator verl inserts after <|im_end|> and the tool message
# up to the next assistant header (mask 0). Read by the trainer, valued by the real value pass on the warm-start
# model, redistributed by the trainer's advantage step.

WARM_START = Path(__file__).resolve().parents[1] / "rredcot_verl" / "tasks" / "assets" / "warmstart"
PROBLEM = ArithmeticProblem(operands=(23, 45, 17, 8), ops=("+", "-", "+"))
TOOL_TURNS = {  # (outcome, [turn texts], [tool answers])
    "two_turns_correct": (1.0, ["<think>\n23+45=68\n68-17=51\n</think>\nadd(51,8)",
                                "<think>\n51+8=59\n</think>\n\\boxed{59}"], ["59"]),
    "two_turns_wrong": (0.0, ["<think>\n23+45=68\n68-17=50\n</think>\nadd(50,8)",
                              "<think>\n50+8=58\n</think>\n\\boxed{58}"], ["58"]),
    "one_turn_correct": (1.0, ["<think>\n23+45=68\n68-17=51\n51+8=59\n</think>\n\\boxed{59}"], []),
    "one_turn_wrong": (0.0, ["<think>\n23+45=68\n68-17=50\n50+8=58\n</think>\n\\boxed{58}"], []),
}  # fmt: skip


@pytest.fixture(scope="module")
def warm_start():
    torch.set_num_threads(1)
    model, tokenizer = load_model_dir(str(WARM_START))
    return model.eval(), tokenizer


def _tool_agent_response(tokenizer, turns, tool_answers):
    """Response ids and mask as verl's tool agent loop writes them for a Qwen chat template."""
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    ids, mask = [], []
    for j, turn in enumerate(turns):
        if j:
            context = ("\n<|im_start|>user\n<tool_response>\n" + tool_answers[j - 1]
                       + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
            ids += encode(context)
            mask += [0] * len(encode(context))
        own = encode(turn) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        ids += own
        mask += [1] * len(own)
    return torch.tensor(ids), torch.tensor(mask)


def _fields(tokenizer, names, ragged: bool) -> dict:
    """TransferQueue's fields of the step (``ragged``: each row its own length, as verl writes them; else right
    padded)."""
    prompt = torch.tensor(chat_prompt_ids(tokenizer, PROBLEM.prompt))
    rows = [_tool_agent_response(tokenizer, *TOOL_TURNS[name][1:]) for name in names]
    entropy = [torch.linspace(0.1, 2.0, len(ids)) for ids, _ in rows]
    scores = []
    for (ids, _), name in zip(rows, names):
        score = torch.zeros(len(ids))
        score[-1] = TOOL_TURNS[name][0]
        scores.append(score)

    def field(values, dtype=None):
        values = [value if dtype is None else value.to(dtype) for value in values]
        if ragged:
            return torch.nested.nested_tensor(values, layout=torch.jagged)
        return torch.nn.utils.rnn.pad_sequence(values, batch_first=True)

    return {
        "prompts": field([prompt] * len(names)),
        "responses": field([ids for ids, _ in rows]),
        "response_mask": field([mask for _, mask in rows]),
        "entropy": field(entropy),
        "rm_scores": field(scores),
        "uid": ["q"] * len(names),
        "reward_model": [{"ground_truth": "59"}] * len(names),
        "extra_info": [{"reference_steps": reference_steps(PROBLEM)}] * len(names),
        "data_source": ["arithmetic"] * len(names),
        "raw_prompt": [[{"role": "user", "content": PROBLEM.prompt}]] * len(names),
    }


def _algorithm(value_source: str) -> tuple[str, ...]:
    prefix = "algorithm.rredcot"
    return (
        "algorithm.adv_estimator=rredcot",
        # max_segments below the segments of a two-turn trace: turn starts and </think> cuts are kept anyway.
        f"{prefix}.segmentation.strategy=turns", f"{prefix}.segmentation.max_segments=2",
        f"{prefix}.segmentation.min_segment_len=2", f"{prefix}.probe.value_source={value_source}",
        f"{prefix}.redistribution.min_value_concordance=0.0",
    )  # fmt: skip


def _sharded_value_pass(model):
    """The actor workers' value pass on two data-parallel shards (verl's DP_COMPUTE_PROTO: contiguous chunks, the
    outputs concatenated), each running the worker's own ``value_pass``."""
    worker = SimpleNamespace(actor=SimpleNamespace(engine=SimpleNamespace(module=model, eval_mode=contextlib.nullcontext)))

    def value_pass(request: DataProto) -> DataProto:
        return DataProto.concat([SegmentActorRolloutRefWorker.value_pass(worker, shard) for shard in request.chunk(2)])

    return value_pass


def _value_stage(trainer, model) -> dict:
    """``rredcot``'s value stage as the trainer runs it after the log-prob pass, the actor workers' pass on
    ``model``."""
    trainer.actor_rollout_wg = SimpleNamespace(value_pass=_sharded_value_pass(model))
    metrics = {}
    trainer._produce(VALUE_STAGE, trainer.step_context(), batch=None, metrics=metrics, with_entropy=True)
    return metrics


@pytest.mark.parametrize("value_source", ["exit_probe", "reference_continuation"])
def test_tool_output_is_context_never_credited(warm_start, value_source, make_trainer):
    """Read by the trainer from verl's ragged fields, valued by the real value pass, redistributed by the trainer's
    advantage step."""
    model, tokenizer = warm_start
    names = list(TOOL_TURNS)
    trainer = make_trainer(*_algorithm(value_source), store=_fields(tokenizer, names, ragged=True))
    store = trainer.store

    traces = trainer._trace_batch(None, with_entropy=True)
    for record, name in zip(traces.records, names):
        ids, mask = _tool_agent_response(tokenizer, *TOOL_TURNS[name][1:])
        assert torch.equal(record.response_ids, ids)  # tool output and template tokens kept in place
        assert (record.response_mask is None) == bool(mask.all())
        if record.response_mask is not None:
            assert torch.equal(record.response_mask, mask.bool())
        assert record.entropy.numel() == ids.numel()

    _value_stage(trainer, model)
    ends, values = store["seg_ends"], store["seg_raw_values"]
    assert ends.shape[1] == 4  # two turns, each thinking + answer: beyond max_segments, one width on both shards
    rows = KVBatchMeta(partition_id="train", keys=[f"q_{i}_0" for i in range(len(names))], tags=[{}] * len(names))
    trainer._compute_advantage(batch=rows, metrics={})
    advantages = trainer_module._padded(store["advantages"])
    mask = trainer_module._padded(store["response_mask"]).bool()
    assert (advantages[~mask] == 0).all()  # tool output, template tokens and padding get nothing

    uid = np.array(store["uid"], dtype=object)
    grpo, _ = compute_grpo_outcome_advantage(trainer_module._padded(store["rm_scores"]).float(), mask.float(), uid)
    for i, name in enumerate(names):
        row_ends = [end for end in ends[i].tolist() if end >= 0]
        assert len(row_ends) == 2 * len(TOOL_TURNS[name][1])
        starts = [0, *row_ends[:-1]]
        # every assistant turn starts a valued state, with a finite value; no segment starts in a hole
        assert {start for start, _ in turn_spans(mask[i].tolist())} <= set(starts)
        assert all(mask[i, start] for start in starts)
        assert torch.isfinite(values[i, : len(row_ends) + 1]).all()
        # per trace, the redistribution only moves GRPO's credit: the same sum over the model's tokens
        assert float(advantages[i][mask[i]].sum()) == pytest.approx(float(grpo[i][mask[i]].sum()), abs=1e-4)
    # and the values did move it: the two turns of the wrong two-turn trace get different advantages
    own = mask[1].nonzero()[:, 0]
    assert advantages[1, own[0]] != advantages[1, own[-1]]


def test_padded_multi_turn_rows_read_and_value_as_ragged_ones(warm_start, make_trainer):
    """Right-padded fields (a trailing hole and the padding both 0) give the traces and values of verl's ragged
    ones."""
    model, tokenizer = warm_start
    names = list(TOOL_TURNS)
    read = {}
    for ragged in (True, False):
        trainer = make_trainer(*_algorithm("exit_probe"), store=_fields(tokenizer, names, ragged))
        records = trainer._trace_batch(None, with_entropy=True).records
        _value_stage(trainer, model)
        read[ragged] = records, trainer.store["seg_ends"], trainer.store["seg_raw_values"]
    for ragged_record, padded_record in zip(read[True][0], read[False][0]):
        assert torch.equal(ragged_record.response_ids, padded_record.response_ids)
        assert (ragged_record.response_mask is None) == (padded_record.response_mask is None)
        if ragged_record.response_mask is not None:
            assert torch.equal(ragged_record.response_mask, padded_record.response_mask)
        assert torch.equal(ragged_record.entropy, padded_record.entropy)
    assert torch.equal(read[True][1], read[False][1])
    torch.testing.assert_close(read[True][2], read[False][2], equal_nan=True)


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "padded"])
def test_single_turn_rows_are_read_as_before(warm_start, ragged, make_trainer):
    """Rows without holes give the records the trainer built before multi-turn support (the mask's 1s kept, no
    mask carried), so single-turn runs are unchanged."""
    _, tokenizer = warm_start
    store = _fields(tokenizer, ["one_turn_correct", "one_turn_wrong"], ragged)
    trainer = make_trainer(*_algorithm("exit_probe"), store=store)
    records = trainer._trace_batch(None, with_entropy=True).records
    masks = [mask.bool() for mask in store["response_mask"].unbind(0)]
    for record, response, entropy, mask in zip(records, store["responses"].unbind(0), store["entropy"].unbind(0), masks):
        assert torch.equal(record.response_ids, response[: mask.numel()][mask[: response.numel()]])
        assert torch.equal(record.entropy, entropy[: mask.numel()][mask[: entropy.numel()]].float())
        assert record.response_mask is None


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged", "padded"])
def test_each_trace_owns_its_tensors(warm_start, ragged):
    """A record's tensors hold its own tokens only, not views of the batch: the value pass's request pickles every
    plan's tensors, and a view pickles its batch's whole storage (the request then grows as the batch squared)."""
    _, tokenizer = warm_start
    for record in trainer_module.step_traces(_fields(tokenizer, list(TOOL_TURNS), ragged), with_entropy=True).records:
        for tensor in (record.prompt_ids, record.response_ids, record.entropy, record.response_mask):
            if tensor is not None:
                assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
