"""The actor-side value pass (rredcot_verl.core.values) on the committed warm-started model and real task traces."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from rredcot_verl.core.settings import CandidateSettings, RRedCoTSettings
from rredcot_verl.core.probes import ProbeSettings
from rredcot_verl.core.segmentation import SegmentationSettings
from rredcot_verl.core.traces import TraceRecord, records_from_arrays
from rredcot_verl.tasks.base import ARITHMETIC
from rredcot_verl.tasks.arithmetic import ArithmeticProblem, reference_response, reference_steps
from rredcot_verl.tasks.model import chat_prompt_ids, load_model_dir, response_ids
from rredcot_verl.core.planning import plan_traces
from rredcot_verl.core.values import compute_segment_values, score_plans

torch.set_num_threads(1)
ARTEFACT = Path(__file__).resolve().parents[1] / "rredcot_verl" / "tasks" / "assets" / "warmstart"
PROBLEM = ArithmeticProblem(operands=(23, 45, 17, 8), ops=("+", "-", "+"))
WRONG = "<think>\n23+45=68\n68-17=50\n50+8=58\n</think>\n\\boxed{58}"


@pytest.fixture(scope="module")
def model_and_tokenizer():
    model, tokenizer = load_model_dir(str(ARTEFACT))
    return model.eval(), tokenizer


def _settings(source="reference_continuation", **segmentation):
    return RRedCoTSettings(
        segmentation=SegmentationSettings(max_segments=8, min_segment_len=2, **segmentation),
        probe=ProbeSettings(value_source=source, profile="embedded"),
    )


def _record(tokenizer, text, outcome, group="g", truth="59", steps=True):
    prompt = torch.tensor(chat_prompt_ids(tokenizer, PROBLEM.prompt))
    response = torch.tensor(response_ids(tokenizer, text), dtype=torch.long)
    return TraceRecord(
        prompt_ids=prompt,
        response_ids=response,
        entropy=torch.ones(response.numel()),
        outcome=outcome,
        group=group,
        ground_truth=truth,
        reference_steps=reference_steps(PROBLEM) if steps else None,
    )


def test_reference_values_fall_after_the_wrong_step(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    traces = [_record(tokenizer, reference_response(PROBLEM), 1.0), _record(tokenizer, WRONG, 0.0)]
    segment_ends, raw_values, metrics = compute_segment_values(model, tokenizer, traces, _settings(), task=ARITHMETIC)
    for i, trace in enumerate(traces):
        ends = [e for e in segment_ends[i].tolist() if e >= 0]
        assert ends[-1] == trace.response_ids.numel() and len(ends) == 5  # <think>, 3 step lines, answer segment
        values = raw_values[i, : len(ends) + 1]
        assert torch.isfinite(values).all() and ((values >= 0) & (values <= 1)).all()
        assert values[-1] == trace.outcome
    correct, wrong = raw_values[0], raw_values[1]
    # Same prefix up to the end of step 1; the wrong second line collapses the reference continuation's probability.
    assert wrong[2] == pytest.approx(float(correct[2]), rel=1e-4)
    assert wrong[3] < 0.01 * correct[3]
    assert metrics["rredcot/traces_without_candidates"] == 0


def test_exit_probe_and_own_continuation_sources(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    traces = [_record(tokenizer, reference_response(PROBLEM), 1.0), _record(tokenizer, WRONG, 0.0)]
    for source in ("exit_probe", "own_continuation"):
        values = compute_segment_values(model, tokenizer, traces, _settings(source), task=ARITHMETIC)[1][:, :5]
        assert torch.isfinite(values).all() and ((values >= 0) & (values <= 1)).all(), source
    _, own_values, _ = compute_segment_values(model, tokenizer, traces, _settings("own_continuation"), task=ARITHMETIC)
    assert (own_values[1, :5] == 0).all()  # ζ = 0: the own continuation carries no value


def test_no_candidates_empty_responses_and_position_budget_fall_back(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    no_truth = _record(tokenizer, WRONG, 0.0, group="alone", truth=None, steps=False)
    empty = dataclasses.replace(_record(tokenizer, WRONG, 0.0, group="e"), response_ids=torch.zeros(0, dtype=torch.long),
                                entropy=torch.zeros(0))
    segment_ends, raw_values, metrics = compute_segment_values(model, tokenizer, [no_truth, empty],
                                                                _settings("exit_probe"), task=ARITHMETIC)
    assert math.isnan(raw_values[0, 0]) and metrics["rredcot/traces_without_candidates"] == 1
    assert (segment_ends[1] == -1).all()
    long_trace = _record(tokenizer, reference_response(PROBLEM), 1.0)
    _, limited_values, limited_metrics = compute_segment_values(model, tokenizer, [long_trace], _settings(),
                                                                task=ARITHMETIC, max_positions=30)
    assert limited_metrics["rredcot/probes_skipped_too_long"] > 0
    assert torch.isnan(limited_values[0, :4]).any()


def test_records_from_padded_arrays_strip_padding_and_read_dataset_fields(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    pad = tokenizer.pad_token_id
    prompt = chat_prompt_ids(tokenizer, PROBLEM.prompt)
    left_padded = torch.tensor([pad, pad, *prompt])
    mask = left_padded != pad
    records = records_from_arrays(
        prompts=[left_padded[mask]],
        responses=[torch.tensor([5, 6])],
        entropies=[torch.ones(2)],
        outcomes=[1.0],
        groups=["u"],
        reward_models=[{"ground_truth": 59}],
        extra_infos=[{"reference_steps": ["23+45=68"]}],
    )
    assert records[0].prompt_ids.tolist() == prompt
    assert records[0].ground_truth == "59" and records[0].reference_steps == ["23+45=68"]


@pytest.mark.parametrize("source, candidates", [("exit_probe", "both"), ("reference_continuation", "group")])
def test_values_do_not_depend_on_how_the_batch_is_split_across_ranks(model_and_tokenizer, source, candidates):
    # verl's _balance_batch reorders the batch by length and DP_COMPUTE_PROTO hands each rank a contiguous chunk, so
    # a group's traces land on different ranks. Planning reads whole groups on the driver; ranks only score.
    model, tokenizer = model_and_tokenizer
    texts = [(reference_response(PROBLEM), 1.0), (WRONG, 0.0), (WRONG.replace("58", "57"), 0.0)]
    traces = [_record(tokenizer, text, outcome, group=group) for group in ("a", "b") for text, outcome in texts]
    settings = dataclasses.replace(_settings(source), candidates=CandidateSettings(source=candidates))
    plans = plan_traces(traces, settings, tokenizer, ARITHMETIC)
    _, whole, _ = score_plans(model, plans, max_segments=8)
    assert not whole[:, 0].isnan().any()

    shards = [[4, 1, 2], [0, 5, 3]]  # each group's correct trace on the other rank than its wrong ones
    split = torch.full_like(whole, float("nan"))
    for shard in shards:
        split[shard] = score_plans(model, [plans[i] for i in shard], max_segments=8)[1]
    torch.testing.assert_close(split, whole, equal_nan=True)

    # Planning a shard on its own, without its groups' other answers and correct traces, gives other values (no
    # reference at all for the group-only bank): the whole-batch plan is what makes the split safe.
    shard = shards[0]
    _, alone, _ = compute_segment_values(model, tokenizer, [traces[i] for i in shard], settings, task=ARITHMETIC)
    assert not torch.allclose(alone, whole[shard], equal_nan=True)
