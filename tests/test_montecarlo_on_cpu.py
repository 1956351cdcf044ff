"""core/montecarlo.py: continuation planning and values, with a fake generator and judge on plain token ids."""

import math

import pytest
import torch

from rredcot_verl.core.montecarlo import (
    Continuation,
    ContinuationTally,
    MonteCarloSettings,
    continuation_chunks,
    values_from_continuations,
    plan_continuations,
)

CORRECT, WRONG, EOS = 7, 8, 0


def fake_generate(requests, correct_per_state, length=2):
    """Continuation j of a state is ``[CORRECT or WRONG] * (length - 1) + [EOS]``, correct for the first
    ``correct_per_state[(trace, state)]`` of its K draws, cut (truncated) at ``max_tokens`` like an engine."""
    drawn = {}
    out = []
    for r in requests:
        j = drawn[(r.trace, r.state)] = drawn.get((r.trace, r.state), -1) + 1
        token = CORRECT if j < correct_per_state[(r.trace, r.state)] else WRONG
        ids = [token] * (length - 1) + [EOS]
        cut = ids[: r.max_tokens]
        out.append(Continuation(tuple(cut), truncated=len(ids) > r.max_tokens))
    return out


def judge(trace, full_response):
    # the last non-eos token decides, as a boxed answer at the end would
    body = [t for t in full_response if t != EOS]
    return 1.0 if body and body[-1] == CORRECT else 0.0


def test_plan_continuations_k_per_state_with_room():
    cfg = MonteCarloSettings(num_continuations=3, max_tokens=10)
    prompts = [[1, 2, 3], [4]]
    responses = [[10, 11, 12, 13, 14, 15], [20, 21]]
    ends = [[2, 4, 6], [2]]
    requests = plan_continuations(prompts, responses, ends, cfg, max_total_length=100)
    assert [(r.trace, r.state, r.start) for r in requests] == (
        [(0, 0, 0)] * 3 + [(0, 1, 2)] * 3 + [(0, 2, 4)] * 3 + [(1, 0, 0)] * 3
    )
    assert requests[3].prefix_ids == (1, 2, 3, 10, 11) and requests[-1].prefix_ids == (4,)
    assert all(r.max_tokens == 10 for r in requests)

    # a tight engine: room = total − prompt − start; states without room get no request
    tight = plan_continuations(prompts, responses, ends, cfg, max_total_length=8)
    assert sorted({(r.state, r.max_tokens) for r in tight if r.trace == 0}) == [(0, 5), (1, 3), (2, 1)]
    tighter = plan_continuations(prompts, responses, ends, cfg, max_total_length=6)
    assert {r.state for r in tighter if r.trace == 0} == {0, 1}

    assert plan_continuations([[1]], [[]], [[]], cfg, 100) == []  # empty response: nothing to value


def test_default_budget_is_the_rollouts_room_from_each_prefix():
    """No cap by default: a continuation from mid-thinking may run as long as the rollout could have from there."""
    requests = plan_continuations([[1, 2]], [list(range(10, 40))], [[10, 20, 30]], MonteCarloSettings(), 100)
    assert sorted({(r.start, r.max_tokens) for r in requests}) == [(0, 98), (10, 88), (20, 78)]


def test_chunks_bound_the_prefix_tokens_and_tally_to_the_same_values():
    """Chunks hold whole traces and at most ``max_prefix_tokens_per_call`` distinct prefix tokens (a larger trace
    alone); judging chunk by chunk gives the values of judging everything at once."""
    cfg = MonteCarloSettings(num_continuations=3, max_tokens=10, max_prefix_tokens_per_call=12)
    prompts = [[1, 2, 3], [4], [5, 6], [7]]
    responses = [[10, 11, 12, 13, 14, 15], [20, 21], [30, 31, 32, 33], list(range(40, 60))]
    ends = [[2, 4, 6], [2], [2, 4], [5, 10, 15, 20]]
    chunks = list(continuation_chunks(prompts, responses, ends, cfg, max_total_length=100))
    assert [r for chunk in chunks for r in chunk] == plan_continuations(prompts, responses, ends, cfg, 100)
    assert len(chunks) == 3
    for chunk in chunks:
        traces = {r.trace for r in chunk}
        distinct = {(r.trace, r.state): len(r.prefix_ids) for r in chunk}
        assert sum(distinct.values()) <= cfg.max_prefix_tokens_per_call or len(traces) == 1
    correct = {(r.trace, r.state): (r.trace + r.state) % 4 for chunk in chunks for r in chunk}
    outcomes = [1.0, 0.0, 1.0, 0.0]
    everything = [r for chunk in chunks for r in chunk]
    continuations = fake_generate(everything, correct)
    expected = values_from_continuations(responses, ends, outcomes, everything, continuations, judge, 4)
    tally = ContinuationTally(len(responses), 4)
    for chunk in chunks:
        tally.add(responses, chunk, fake_generate(chunk, correct), judge)
    seg_ends, raw_values, metrics = tally.values(ends, outcomes)
    assert torch.equal(seg_ends, expected[0]) and metrics == expected[2]
    torch.testing.assert_close(raw_values, expected[1], equal_nan=True)


def test_monte_carlo_values_are_fractions_of_correct_continuations():
    cfg = MonteCarloSettings(num_continuations=4, max_tokens=10)
    prompts, responses, ends = [[1, 2], [3]], [[10, 11, 12, 13], [20, 21, 22]], [[1, 3, 4], [3]]
    outcomes = [1.0, 0.0]
    requests = plan_continuations(prompts, responses, ends, cfg, max_total_length=100)
    correct = {(0, 0): 4, (0, 1): 1, (0, 2): 3, (1, 0): 0}
    seg_ends, values, metrics = values_from_continuations(
        responses, ends, outcomes, requests, fake_generate(requests, correct), judge, max_segments=4
    )
    assert seg_ends.dtype == torch.int64 and seg_ends.tolist() == [[1, 3, 4, -1], [3, -1, -1, -1]]
    assert values.shape == (2, 5) and values.dtype == torch.float32
    assert values[0, :4].tolist() == [1.0, 0.25, 0.75, 1.0]  # v̂_0..v̂_2, then ζ
    assert values[1, :2].tolist() == [0.0, 0.0] and torch.isnan(values[1, 2:]).all()
    assert math.isnan(values[0, 4])
    assert metrics == {
        "segment_mc/continuations": 16.0,
        "segment_mc/truncated_continuations": 0.0,
        "segment_mc/extra_generated_tokens": 32.0,
    }


def test_no_room_is_nan_and_truncated_continuations_count_as_failures():
    cfg = MonteCarloSettings(num_continuations=2, max_tokens=10)
    prompts, responses, ends = [[1, 2, 3]], [[10, 11, 12, 13, 14]], [[2, 4, 5]]
    # total 7: state 0 has room 4, state 1 room 2, state 2 (start 4) none
    requests = plan_continuations(prompts, responses, ends, cfg, max_total_length=7)
    correct = {(0, 0): 2, (0, 1): 2}
    continuations = fake_generate(requests, correct, length=3)  # 3 tokens: state 1's room of 2 cuts them
    _, values, metrics = values_from_continuations(
        responses, ends, [0.0], requests, continuations, judge, max_segments=3
    )
    assert values[0, 0] == 1.0
    assert values[0, 1] == 0.0  # [CORRECT, CORRECT] would be judged right, but it never finished
    assert math.isnan(values[0, 2]) and values[0, 3] == 0.0
    assert metrics["segment_mc/truncated_continuations"] == 2.0


def test_width_grows_past_max_segments_and_mismatches_fail():
    cfg = MonteCarloSettings(num_continuations=1, max_tokens=4)
    responses, ends = [[1, 2, 3, 4, 5]], [[1, 2, 3, 4, 5]]
    requests = plan_continuations([[9]], responses, ends, cfg, max_total_length=100)
    correct = {(0, k): 1 for k in range(5)}
    seg_ends, values, _ = values_from_continuations(
        responses, ends, [1.0], requests, fake_generate(requests, correct), judge, max_segments=2
    )
    assert seg_ends.shape == (1, 5) and values.shape == (1, 6) and values[0].tolist() == [1.0] * 6
    with pytest.raises(ValueError, match="continuations for"):
        values_from_continuations(responses, ends, [1.0], requests, [], judge, max_segments=2)


@pytest.mark.parametrize("kwargs", [{"num_continuations": 0}, {"max_tokens": 0}])
def test_settings_reject_bad_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        MonteCarloSettings(**kwargs)
