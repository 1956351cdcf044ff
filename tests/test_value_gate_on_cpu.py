"""The value gate: value-outcome concordance counted exactly, the gate's decision and its window, GRPO bit for bit
while it is closed."""

import numpy as np
import pytest
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

from rredcot_verl.core.concordance import ConcordanceCounts, ConcordanceWindow, value_outcome_concordance
from rredcot_verl.core.redistribution import RedistributionSettings, redistribute

torch.set_num_threads(1)
NAN = float("nan")


def _traces(outcomes, lengths, groups, ends_rows, raw_rows):
    """(raw_values, segment_ends, lengths, outcome, index) as ``redistribute`` takes them, NaN/-1 padded."""
    width = max(len(row) for row in ends_rows)
    ends = torch.full((len(outcomes), width), -1, dtype=torch.int64)
    raw = torch.full((len(outcomes), width + 1), NAN, dtype=torch.float64)
    for i, (row, values) in enumerate(zip(ends_rows, raw_rows)):
        ends[i, : len(row)] = torch.tensor(row)
        raw[i, : len(values)] = torch.tensor(values, dtype=torch.float64)
    return raw, ends, torch.tensor(lengths), torch.tensor(outcomes, dtype=torch.float32), np.array(groups, dtype=object)


def _concordance(outcomes, lengths, groups, ends_rows, raw_rows, eligible=None, tie=0.0):
    raw, ends, lengths, outcome, index = _traces(outcomes, lengths, groups, ends_rows, raw_rows)
    eligible = torch.ones(len(index), dtype=torch.bool) if eligible is None else torch.tensor(eligible)
    return value_outcome_concordance(raw, ends, lengths, outcome, index, eligible, tie=tie)


# Two traces of 10 tokens with one interior boundary at token 5: the states at 50%..90% of the response are v̂_1
# (5 comparisons); at 10%..40% only v̂_0, the prompt, is behind them, which is not compared.
PAIR = dict(lengths=[10, 10], ends_rows=[[5, 10], [5, 10]])


@pytest.mark.parametrize(
    "correct_value, wrong_value, expected",
    [(0.8, 0.2, ConcordanceCounts(5.0, 5)), (0.2, 0.8, ConcordanceCounts(0.0, 5)), (0.4, 0.4, ConcordanceCounts(2.5, 5))],
)
def test_concordance_counts_each_share_of_the_response_once(correct_value, wrong_value, expected):
    counts = _concordance([1.0, 0.0], groups=["q", "q"], raw_rows=[[0.5, correct_value], [0.5, wrong_value]], **PAIR)
    assert counts == expected


def test_concordance_compares_traces_of_different_lengths_at_equal_shares():
    # Trace 0 (10 tokens) passes its boundary at 20%, trace 1 (20 tokens) at 50%: compared at 50%, 60%, ..., 90%.
    counts = _concordance([1.0, 0.0], [10, 20], ["q", "q"], [[2, 10], [10, 20]], [[0.5, 0.9], [0.5, 0.1]])
    assert counts == ConcordanceCounts(5.0, 5)


def test_concordance_reads_the_last_boundary_before_each_share():
    # Boundaries at 3 and 7 of 10 tokens: shares 30%..60% read v̂_1, 70%..90% v̂_2. The correct trace is ahead at v̂_2
    # only: 3 of 7 comparisons.
    raw_rows = [[0.5, 0.3, 0.9], [0.5, 0.6, 0.1]]
    counts = _concordance([1.0, 0.0], [10, 10], ["q", "q"], [[3, 7, 10]] * 2, raw_rows)
    assert counts == ConcordanceCounts(3.0, 7)


def test_concordance_compares_within_groups_only_and_skips_ties_and_ineligible_traces():
    raw_rows = [[0.5, 0.8], [0.5, 0.2]]
    assert _concordance([1.0, 0.0], groups=["q", "r"], raw_rows=raw_rows, **PAIR) == ConcordanceCounts()
    assert _concordance([1.0, 1.0], groups=["q", "q"], raw_rows=raw_rows, **PAIR) == ConcordanceCounts()
    assert _concordance([1.0, 0.9], groups=["q", "q"], raw_rows=raw_rows, tie=0.2, **PAIR) == ConcordanceCounts()
    assert _concordance([1.0, 0.0], groups=["q", "q"], raw_rows=raw_rows, eligible=[True, False], **PAIR) == (
        ConcordanceCounts()
    )
    assert ConcordanceCounts().concordance is None


def test_concordance_uses_only_the_order_of_outcomes_on_any_scale():
    raw_rows = [[0.5, 0.8], [0.5, 0.2], [0.5, 0.5]]
    three = dict(lengths=[10] * 3, groups=["q"] * 3, ends_rows=[[5, 10]] * 3, raw_rows=raw_rows)
    zero_one = _concordance([1.0, 0.0, 0.5], **three)  # partial credit between: every pair ordered
    assert zero_one == ConcordanceCounts(15.0, 15)
    assert _concordance([5.0, -5.0, 0.0], **three) == zero_one


def _gate_batch(correct_value, wrong_value):
    """Groups "a" and "b", each one correct and one wrong trace of 10 tokens, boundary at token 5."""
    raw, ends, lengths, outcome, index = _traces(
        [1.0, 0.0, 1.0, 0.0], [10] * 4, ["a", "a", "b", "b"], [[5, 10]] * 4,
        [[0.5, correct_value], [0.5, wrong_value], [0.5, correct_value], [0.5, wrong_value]],
    )  # fmt: skip
    mask = (torch.arange(10) < lengths.unsqueeze(1)).long()
    return outcome, mask, index, ends, raw


def _verl_grpo(outcome, mask, index):
    rewards = torch.zeros(mask.shape)
    rewards[torch.arange(len(outcome)), mask.sum(1) - 1] = outcome
    return compute_grpo_outcome_advantage(rewards, mask, index)[0]


def test_closed_gate_keeps_verls_grpo_advantage_bit_for_bit_and_counts_the_batch():
    batch = _gate_batch(correct_value=0.2, wrong_value=0.8)  # values that rank every pair the wrong way
    result = redistribute(*batch, RedistributionSettings())
    assert torch.equal(result.advantages, _verl_grpo(*batch[:3]))
    assert result.fallback.all()
    assert result.metrics["value_gate_open"] == 0.0
    assert result.metrics["fallback/low_value_concordance"] == 4.0
    assert result.metrics["value_concordance"] == 0.0 and result.metrics["value_concordance_comparisons"] == 10.0
    assert result.concordance == ConcordanceCounts(0.0, 10)
    ungated = redistribute(*batch, RedistributionSettings(min_value_concordance=0.0))
    assert ungated.metrics["value_gate_open"] == 1.0 and not ungated.fallback.any()
    assert not torch.equal(ungated.advantages, result.advantages)


def test_open_gate_redistributes_and_reports_the_concordance():
    batch = _gate_batch(correct_value=0.8, wrong_value=0.2)
    result = redistribute(*batch, RedistributionSettings())
    assert result.metrics["value_gate_open"] == 1.0 and result.metrics["value_concordance_pooled"] == 1.0
    assert result.metrics["fallback/low_value_concordance"] == 0.0 and not result.fallback.any()
    assert not torch.equal(result.advantages, _verl_grpo(*batch[:3]))


@pytest.mark.parametrize(
    "values, prior, is_open",
    [
        ((0.8, 0.2), ConcordanceCounts(0.0, 100), False),  # a good batch after a long run of bad ones
        ((0.2, 0.8), ConcordanceCounts(100.0, 100), True),  # a bad batch after a long run of good ones
        ((0.4, 0.4), ConcordanceCounts(6.5, 10), False),  # (5 + 6.5) / 20 = 0.575: below the threshold...
        ((0.4, 0.4), ConcordanceCounts(7.0, 10), True),  # ... (5 + 7) / 20 = 0.6: at it, which opens the gate
    ],
)
def test_gate_decides_on_the_window_pooled_with_this_batch(values, prior, is_open):
    result = redistribute(*_gate_batch(*values), RedistributionSettings(), prior_concordance=prior)
    assert result.metrics["value_gate_open"] == float(is_open)
    assert result.concordance == _concordance(
        [1.0, 0.0, 1.0, 0.0], [10] * 4, ["a", "a", "b", "b"], [[5, 10]] * 4,
        [[0.5, values[0]], [0.5, values[1]], [0.5, values[0]], [0.5, values[1]]],
    )  # fmt: skip


def test_gate_without_any_comparison_stays_closed_unless_switched_off():
    # One all-wrong group: nothing to compare, in the batch or the window.
    outcome, mask, index, ends, raw = _gate_batch(0.8, 0.2)
    outcome = torch.zeros(4)
    for degenerate_groups in ("grpo", "value_differences"):
        cfg = RedistributionSettings(degenerate_groups=degenerate_groups)
        result = redistribute(outcome, mask, index, ends, raw, cfg)
        assert result.metrics["value_gate_open"] == 0.0 and "value_concordance" not in result.metrics
        assert torch.equal(result.advantages, torch.zeros_like(result.advantages))
    ungated = redistribute(outcome, mask, index, ends, raw, RedistributionSettings(
        degenerate_groups="value_differences", min_value_concordance=0.0))  # fmt: skip
    assert ungated.metrics["value_gate_open"] == 1.0 and ungated.advantages.abs().sum() > 0


def test_window_pools_the_previous_steps_and_round_trips_through_its_state():
    window = ConcordanceWindow(steps=3)  # two previous batches + the current one
    for counts in (ConcordanceCounts(1.0, 2), ConcordanceCounts(3.0, 4), ConcordanceCounts(5.0, 6)):
        window.push(counts)
    assert window.pooled() == ConcordanceCounts(8.0, 10)  # the oldest has left
    restored = ConcordanceWindow(steps=3)
    restored.load_state_dict(window.state_dict())
    assert restored.pooled() == window.pooled()
    single = ConcordanceWindow(steps=1)
    single.push(ConcordanceCounts(1.0, 1))
    assert single.pooled() == ConcordanceCounts()
    with pytest.raises(ValueError, match="at least 1 step"):
        ConcordanceWindow(steps=0)
