"""core/montecarlo.py: continuation planning and values, with a fake generator and judge on plain token ids."""

import math

import pytest
import torch

from rredcot_verl.core.montecarlo import (
    Continuation,
    MonteCarloSettings,
    monte_carlo_values,
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


def test_monte_carlo_values_are_fractions_of_correct_continuations():
    cfg = MonteCarloSettings(num_continuations=4, max_tokens=10)
    prompts, responses, ends = [[1, 2], [3]], [[10, 11, 12, 13], [20, 21, 22]], [[1, 3, 4], [3]]
    outcomes = [1.0, 0.0]
    requests = plan_continuations(prompts, responses, ends, cfg, max_total_length=100)
    correct = {(0, 0): 4, (0, 1): 1, (0, 2): 3, (1, 0): 0}
    seg_ends, values, metrics = monte_carlo_values(
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
    _, values, metrics = monte_carlo_values(responses, ends, [0.0], requests, continuations, judge, max_segments=3)
    assert values[0, 0] == 1.0
    assert values[0, 1] == 0.0  # [CORRECT, CORRECT] would be judged right, but it never finished
    assert math.isnan(values[0, 2]) and values[0, 3] == 0.0
    assert metrics["segment_mc/truncated_continuations"] == 2.0


def test_width_grows_past_max_segments_and_mismatches_fail():
    cfg = MonteCarloSettings(num_continuations=1, max_tokens=4)
    responses, ends = [[1, 2, 3, 4, 5]], [[1, 2, 3, 4, 5]]
    requests = plan_continuations([[9]], responses, ends, cfg, max_total_length=100)
    correct = {(0, k): 1 for k in range(5)}
    seg_ends, values, _ = monte_carlo_values(
        responses, ends, [1.0], requests, fake_generate(requests, correct), judge, max_segments=2
    )
    assert seg_ends.shape == (1, 5) and values.shape == (1, 6) and values[0].tolist() == [1.0] * 6
    with pytest.raises(ValueError, match="continuations for"):
        monte_carlo_values(responses, ends, [1.0], requests, [], judge, max_segments=2)


@pytest.mark.parametrize("kwargs", [{"num_continuations": 0}, {"max_tokens": 0}])
def test_settings_reject_bad_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        MonteCarloSettings(**kwargs)
