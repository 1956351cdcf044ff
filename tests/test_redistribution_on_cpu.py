"""Reward redistribution: GRPO equivalence against the real verl, telescoping, credit placement, fallbacks."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from redistribution_reference import redistribute_trace
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

from rredcot_verl.core.outcomes import group_outcome_advantage
from rredcot_verl.core.redistribution import (
    RedistributionSettings,
    anchor_values,
    redistribute,
    segment_rewards,
)
from rredcot_verl.core.redistribution_rule import token_advantages

torch.set_num_threads(1)
NAN = float("nan")


def _config(**settings) -> RedistributionSettings:
    """The redistribution's mechanics with the value gate open (tests/test_value_gate_on_cpu.py tests the gate): the
    hand-made and random values of these tests would close it."""
    return RedistributionSettings(**{"min_value_concordance": 0.0, **settings})
PROPERTY_SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def batches(draw, width: int = 12, max_segments: int = 5, any_float_scores: bool = True):
    """A verl-like batch: interleaved groups (singletons included), right-padded masks, segment data and values.

    Without ``any_float_scores`` scores are multiples of 1/8: group sums are then exact in any order, and no two
    different scores are so close that the group std (and so Â) explodes.
    """
    group_sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4), label="group sizes")
    index = draw(st.permutations([f"uid{g}" for g, n in enumerate(group_sizes) for _ in range(n)]), label="index")
    bsz = len(index)
    score = st.integers(0, 8).map(lambda k: k / 8)
    if any_float_scores:
        score = score | st.floats(0.0, 1.0, width=32)
    scores = torch.tensor(draw(st.lists(score, min_size=bsz, max_size=bsz), label="scores"), dtype=torch.float32)
    lengths = draw(st.lists(st.integers(0, width), min_size=bsz, max_size=bsz), label="lengths")
    mask_dtype = draw(st.sampled_from([torch.int64, torch.float32]), label="mask dtype")
    mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).to(mask_dtype)
    ends = torch.full((bsz, max_segments), -1, dtype=torch.int64)
    raw = torch.full((bsz, max_segments + 1), NAN)
    for i, length in enumerate(lengths):
        if length == 0 or draw(st.integers(0, 9), label="drop segment data") == 0:
            continue
        cut = st.integers(1, length - 1) if length > 1 else st.nothing()
        inner = draw(st.sets(cut, max_size=min(max_segments, length) - 1), label="cuts")
        row = sorted(inner) + [length]
        ends[i, : len(row)] = torch.tensor(row)
        probe = st.floats(0.0, 1.0, width=32)
        raw[i, : len(row) + 1] = torch.tensor(draw(st.lists(probe, min_size=len(row) + 1, max_size=len(row) + 1)))
    return scores, mask, np.array(index, dtype=object), ends, raw


def _verl_grpo(scores, mask, index, epsilon=1e-6, norm_adv_by_std=True):
    """verl's own GRPO advantage, with each trace's score placed on its last response token as verl does."""
    rewards = torch.zeros(mask.shape, dtype=scores.dtype)
    last = (mask.sum(1).long() - 1).clamp(min=0)
    rewards[torch.arange(len(scores)), last] = scores
    assert torch.equal(rewards.sum(-1), scores)
    advantages, returns = compute_grpo_outcome_advantage(rewards, mask, index, epsilon, norm_adv_by_std)
    return advantages, returns


def _batch(scores, lengths, groups, ends_rows, raw_rows, width=None):
    width = width or max(lengths)
    mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).long()
    max_segments = max(len(r) for r in ends_rows)
    ends = torch.full((len(scores), max_segments), -1, dtype=torch.int64)
    raw = torch.full((len(scores), max_segments + 1), NAN, dtype=torch.float64)
    for i, (row, values) in enumerate(zip(ends_rows, raw_rows)):
        ends[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
        raw[i, : len(values)] = torch.tensor(values, dtype=torch.float64)
    return torch.tensor(scores, dtype=torch.float32), mask, np.array(groups, dtype=object), ends, raw


# ---------------------------------------------------------------------------------------------- GRPO equivalence


@PROPERTY_SETTINGS
@given(batch=batches(), norm=st.booleans(), epsilon=st.sampled_from([1e-6, 1e-3]))
def test_group_outcome_advantage_is_verl_bit_for_bit(batch, norm, epsilon):
    scores, mask, index, _, _ = batch
    adv, group_mean = group_outcome_advantage(scores, index, epsilon, norm)
    expected, _ = _verl_grpo(scores, mask, index, epsilon, norm)
    assert torch.equal(adv.unsqueeze(-1) * mask, expected)
    for uid in set(index):
        rows = torch.tensor(index == uid)
        assert torch.allclose(group_mean[rows], scores[rows].mean().expand(int(rows.sum())))


@PROPERTY_SETTINGS
@given(batch=batches(), norm=st.booleans())
def test_mix_zero_is_verl_grpo_bit_for_bit(batch, norm):
    scores, mask, index, ends, raw = batch
    result = redistribute(scores, mask, index, ends, raw, _config(mix=0.0, norm_adv_by_std=norm))
    expected, expected_returns = _verl_grpo(scores, mask, index, norm_adv_by_std=norm)
    assert torch.equal(result.advantages, expected)
    assert torch.equal(result.returns, expected_returns)


@PROPERTY_SETTINGS
@given(batch=batches(any_float_scores=False), mix=st.sampled_from([0.5, 1.0]), anchored=st.booleans())
def test_token_mean_of_advantage_is_grpo_advantage(batch, mix, anchored):
    """Σ_k σ_k = 1 (clipped or not), so Σ_t A_t = L_i · Â_i on every trace, redistributed or not."""
    scores, mask, index, ends, raw = batch
    result = redistribute(scores, mask, index, ends, raw, _config(mix=mix, anchored=anchored))
    grpo, _ = _verl_grpo(scores, mask, index)
    assert torch.allclose(result.advantages.double().sum(1), grpo.double().sum(1), rtol=1e-5, atol=1e-4)
    assert torch.equal(result.advantages[result.fallback], grpo[result.fallback])
    assert torch.all(result.advantages[mask == 0] == 0)
    assert torch.isfinite(result.advantages).all()


@PROPERTY_SETTINGS
@given(batch=batches(any_float_scores=False), data=st.data())
def test_permuting_traces_permutes_outputs(batch, data):
    scores, mask, index, ends, raw = batch
    order = torch.tensor(data.draw(st.permutations(range(len(scores))), label="permutation"))
    cfg = _config()
    result = redistribute(scores, mask, index, ends, raw, cfg)
    permuted = redistribute(scores[order], mask[order], index[order.numpy()], ends[order], raw[order], cfg)
    assert torch.equal(permuted.fallback, result.fallback[order])
    # The group std may round differently when a group's members are summed in another order.
    assert torch.allclose(permuted.advantages, result.advantages[order], atol=1e-5)
    assert torch.allclose(permuted.values, result.values[order], atol=1e-5, equal_nan=True)
    assert torch.allclose(permuted.segment_rewards, result.segment_rewards[order], atol=1e-5, equal_nan=True)
    assert permuted.metrics.keys() == result.metrics.keys()
    for key, value in result.metrics.items():
        assert math.isclose(permuted.metrics[key], value, abs_tol=1e-6), key


def test_values_linear_in_token_position_give_grpo():
    """v̂ growing linearly with the number of tokens read means no segment is special: σ_k = n_k / L, A = GRPO."""
    lengths, cuts = [10, 10, 7, 10], [[2, 5, 10], [4, 10], [1, 3, 7], [10]]
    scores = [1.0, 0.0, 1.0, 0.0]
    raw_rows = []
    for zeta, length, row, start in zip(scores, lengths, cuts, [0.2, 0.7, 0.5, 0.3]):
        raw_rows.append([start] + [start + (zeta - start) * end / length for end in row])
    batch = _batch(scores, lengths, ["q"] * 4, cuts, raw_rows)
    # The affine map keeps probes that are linear in tokens linear in tokens, now from V_0 = 0.5 to ζ.
    result = redistribute(*batch, _config())
    grpo, _ = _verl_grpo(batch[0], batch[1], batch[2])
    assert not result.fallback.any()
    assert torch.allclose(result.advantages, grpo, atol=1e-6)


# ---------------------------------------------------------------------------------------------- values and rewards


@PROPERTY_SETTINGS
@given(
    values=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=12),
    outcome=st.sampled_from([0.0, 1.0]),
    group_mean=st.floats(0.0, 1.0),
    anchored=st.booleans(),
    value_mapping=st.sampled_from(["affine", "raw"]),
)
def test_segment_rewards_telescope(values, outcome, group_mean, anchored, value_mapping):
    cfg = _config(anchored=anchored, value_mapping=value_mapping)
    anchored_values = anchor_values(torch.tensor(values, dtype=torch.float64), outcome, group_mean, cfg)
    rewards = segment_rewards(anchored_values)
    assert rewards.shape == (len(values) - 1,)
    start = group_mean if anchored else values[0]
    assert anchored_values[0].item() == start and anchored_values[-1].item() == outcome
    assert math.isclose(rewards.sum().item(), outcome - start, abs_tol=1e-12)
    assert ((anchored_values >= 0) & (anchored_values <= 1)).all()


def test_anchor_values_mappings():
    raw = torch.tensor([0.2, 0.6, 0.4, 0.9], dtype=torch.float64)  # last entry is replaced by ζ
    affine = anchor_values(raw, 1.0, 0.5, _config())
    # The affine map sends 0.2 -> 0.5 and 1 -> 1: v -> 1 + (v - 1) * 0.5 / 0.8.
    assert torch.allclose(affine, torch.tensor([0.5, 0.75, 0.625, 1.0], dtype=torch.float64))
    assert torch.equal(anchor_values(raw, 1.0, 0.5, _config(value_mapping="raw")),
                       torch.tensor([0.5, 0.6, 0.4, 1.0], dtype=torch.float64))  # fmt: skip
    assert torch.equal(anchor_values(raw, 0.0, 0.5, _config(anchored=False)),
                       torch.tensor([0.2, 0.6, 0.4, 0.0], dtype=torch.float64))  # fmt: skip
    # Stretching (0.9 -> 0.25, 1 -> 1 is a factor 7.5) can leave [0, 1]: 1 + (0 - 1) * 7.5 = -6.5 is clamped to 0.
    clamped = anchor_values(torch.tensor([0.9, 0.0, 0.5], dtype=torch.float64), 1.0, 0.25, _config())
    assert clamped.tolist() == [0.25, 0.0, 1.0]
    # ζ == v̂_0: the affine map is undefined, values interpolate in token position from V_0 to ζ (equally long
    # segments when no ends are given).
    probes = torch.tensor([1.0, 0.3, 0.8, 0.0], dtype=torch.float64)
    flat = anchor_values(probes, 1.0, 0.4, _config())
    assert torch.allclose(flat, torch.tensor([0.4, 0.6, 0.8, 1.0], dtype=torch.float64))
    by_tokens = anchor_values(probes, 1.0, 0.4, _config(), segment_ends=torch.tensor([1, 4, 10]))
    assert torch.allclose(by_tokens, torch.tensor([0.4, 0.46, 0.64, 1.0], dtype=torch.float64))


def test_anchor_values_rejects_bad_input():
    cfg = _config()
    with pytest.raises(ValueError, match="NaN or inf"):
        anchor_values(torch.tensor([0.2, NAN, 0.3]), 1.0, 0.5, cfg)
    with pytest.raises(ValueError, match="probabilities"):
        anchor_values(torch.tensor([0.2, 1.5, 0.3]), 1.0, 0.5, cfg)
    with pytest.raises(ValueError, match="K\\+1 >= 2"):
        anchor_values(torch.tensor([0.2]), 1.0, 0.5, cfg)


# ---------------------------------------------------------------------------------------------- credit placement


def test_credit_lands_where_the_value_moves():
    # One group, 4 traces: two correct, two wrong (mean 0.5, Â = ±0.866). Segments of 4 tokens each.
    cuts = [[4, 8, 12, 16]] * 4
    raw = [
        [0.5, 0.5, 0.9, 0.9, NAN],  # correct, the 2nd segment found the way
        [0.5, 0.6, 0.7, 0.1, NAN],  # wrong, the 3rd segment went astray after two good ones
        [0.5, 0.5, 0.5, 0.5, NAN],  # correct, everything happened in the last segment
        [0.5, 0.5, 0.5, 0.5, NAN],  # wrong, likewise
    ]
    batch = _batch([1.0, 0.0, 1.0, 0.0], [16] * 4, ["q"] * 4, cuts, raw)
    result = redistribute(*batch, _config(value_mapping="raw"))
    per_segment = result.advantages.view(4, 4, 4)[:, :, 0]  # uniform within a segment
    assert torch.equal(result.advantages.view(4, 4, 4), per_segment.unsqueeze(-1).expand(4, 4, 4))
    correct, wrong = per_segment[0], per_segment[1]
    assert correct.argmax() == 1 and correct[1] > 0
    assert wrong.argmin() == 2 and wrong[2] < 0  # the drop carries the blame
    assert wrong[0] > 0 and wrong[1] > 0  # steps "on the right track" are pushed up even in a wrong trace
    assert torch.allclose(per_segment[2], torch.tensor([0.0, 0.0, 0.0, 4 * 0.8660254]), atol=1e-5)
    assert torch.allclose(result.segment_rewards[1].float(), torch.tensor([0.1, 0.1, -0.6, -0.1]), atol=1e-6)
    assert result.metrics["negative_coef_frac"] == pytest.approx(2 / 16)  # σ of the wrong trace: [-.2, -.2, 1.2, .2]


def test_clipping_bounds_coefficients_and_keeps_their_sum():
    cuts = [[2, 4, 6, 8, 10]] * 2
    # σ = [0, 0, 0, 0, 1] (all credit in the last segment) and [.1, .1, .1, .1, .6].
    raw = [[0.5, 0.5, 0.5, 0.5, 0.5, NAN], [0.5, 0.45, 0.4, 0.35, 0.3, NAN]]
    batch = _batch([1.0, 0.0], [10, 10], ["q", "q"], cuts, raw)
    grpo, _ = _verl_grpo(batch[0], batch[1], batch[2])
    for clip, clipped_frac in [(2.0, 1.0), (4.0, 0.5), (5.0, 0.0)]:
        result = redistribute(*batch, _config(value_mapping="raw", clip=clip))
        # σ_k = A_t · n_k / (L · Â) with L = 10, n_k = 2; K = 5.
        sigma = (result.advantages[:, ::2] / grpo[:, :1] * 2 / 10).double()
        assert torch.allclose(sigma.sum(1), torch.ones(2, dtype=torch.float64), atol=1e-6)
        assert (5 * sigma.abs() <= clip + 1e-5).all()
        assert result.metrics["clipped_trace_frac"] == clipped_frac
        if clipped_frac == 0.0:
            assert torch.allclose(sigma[0], torch.tensor([0, 0, 0, 0, 1.0], dtype=torch.float64), atol=1e-6)
        assert (sigma[:, :-1] <= sigma[:, -1:]).all()  # the order of coefficients is kept


def test_mix_interpolates_between_grpo_and_full_redistribution():
    cuts = [[3, 5, 9]] * 3
    raw = [[0.4, 0.7, 0.2, NAN], [0.4, 0.1, 0.3, NAN], [0.5, 0.6, 0.6, NAN]]
    batch = _batch([1.0, 0.0, 1.0], [9, 9, 9], ["q"] * 3, cuts, raw)
    full = redistribute(*batch, _config(mix=1.0)).advantages
    none = redistribute(*batch, _config(mix=0.0)).advantages
    half = redistribute(*batch, _config(mix=0.5)).advantages
    assert torch.allclose(half, (full + none) / 2, atol=1e-6)
    assert not torch.allclose(full, none)


# ---------------------------------------------------------------------------------------------- fallbacks


def test_all_correct_and_all_wrong_groups_give_zero():
    cuts = [[3, 6]] * 4
    raw = [[0.2, 0.9, NAN]] * 4
    batch = _batch([1.0, 1.0, 0.0, 0.0], [6] * 4, ["a", "a", "b", "b"], cuts, raw)
    result = redistribute(*batch, _config())
    assert torch.all(result.advantages == 0)
    assert result.fallback.all()
    assert result.metrics["degenerate_groups"] == 2.0
    assert result.metrics["degenerate_groups_with_signal"] == 0.0
    assert result.metrics["fallback/zero_return"] == 4.0
    assert result.metrics["redistributed_frac"] == 0.0
    assert "segments_per_trace" not in result.metrics  # no redistributed trace to average over
    assert torch.isnan(result.values).all() and torch.isnan(result.segment_rewards).all()


def test_fallback_reasons_are_counted_and_keep_grpo():
    # Group "q": 6 traces with mixed outcomes; group "solo": one trace.
    scores = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    lengths = [6, 6, 6, 6, 6, 0, 6]
    cuts = [[3, 6], [3, 6], [], [3, 5], [3, 6], [], [3, 6]]
    raw = [
        [0.3, 0.8, NAN],  # fine
        [0.3, NAN, NAN],  # NaN probe value
        [],  # no segment data
        [0.3, 0.2, NAN],  # last end 5 != length 6
        [0.3, float("inf"), NAN],  # inf probe value
        [],  # empty response
        [0.3, 0.8, NAN],  # group of one
    ]
    batch = _batch(scores, lengths, ["q"] * 6 + ["solo"], cuts, raw)
    result = redistribute(*batch, _config())
    grpo, _ = _verl_grpo(batch[0], batch[1], batch[2])
    assert result.fallback.tolist() == [False, True, True, True, True, True, True]
    assert torch.equal(result.advantages[1:], grpo[1:])
    assert not torch.equal(result.advantages[0], grpo[0])
    assert torch.all(result.advantages[5] == 0)
    counts = {k: v for k, v in result.metrics.items() if k.startswith("fallback/")}
    assert counts == {
        "fallback/empty": 1.0,
        "fallback/singleton_group": 1.0,
        "fallback/outside_reward_range": 0.0,
        "fallback/zero_return": 0.0,
        "fallback/missing_segments": 2.0,
        "fallback/nonfinite": 2.0,
        "fallback/low_value_concordance": 0.0,
    }
    assert result.metrics["redistributed_frac"] == pytest.approx(1 / 7)
    assert result.metrics["segments_per_trace"] == 2.0
    assert torch.isfinite(result.values[0, :3]).all() and torch.isnan(result.values[1:]).all()


def test_unanchored_falls_back_when_outcome_equals_first_value():
    cuts = [[2, 4]] * 3
    raw = [[1.0, 0.5, NAN], [0.3, 0.1, NAN], [0.6, 0.9, NAN]]
    batch = _batch([1.0, 0.0, 1.0], [4, 4, 4], ["q"] * 3, cuts, raw)
    result = redistribute(*batch, _config(anchored=False))
    assert result.fallback.tolist() == [True, False, False]
    assert result.metrics["fallback/zero_return"] == 1.0
    assert result.values[2].tolist()[:3] == pytest.approx([0.6, 0.9, 1.0])  # V_0 = v̂_0, V_K = ζ
    # Trace 1 (wrong, Â < 0): R = [-0.2, -0.1], σ = [2/3, 1/3]; A_t = Â · L · σ_k / n_k = Â · 2σ_k.
    grpo, _ = _verl_grpo(batch[0], batch[1], batch[2])
    expected = grpo[1, 0].double() * torch.tensor([4 / 3, 4 / 3, 2 / 3, 2 / 3], dtype=torch.float64)
    assert torch.allclose(result.advantages[1].double(), expected, atol=1e-6)


# ---------------------------------------------------------------------------------------------- validation


def _valid_batch():
    return _batch([1.0, 0.0], [4, 3], ["q", "q"], [[2, 4], [3]], [[0.2, 0.5, NAN], [0.2, NAN]])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b: (b[0].unsqueeze(1), *b[1:]), "scores must be a 1-D float"),
        (lambda b: (b[0], b[1][:1], *b[2:]), "response_mask must have shape"),
        (lambda b: (*b[:2], b[2][:1], *b[3:]), "index has 1 entries"),
        (lambda b: (*b[:3], b[3].int(), b[4]), "segment_ends must be int64"),
        (lambda b: (*b[:4], b[4][:, :2]), "raw_values must be float of shape"),
        (lambda b: (*b[:4], b[4] + 1.0), "raw_values must be probabilities"),
        (lambda b: (b[0], torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]]), *b[2:]), "right-padded"),
        (lambda b: (b[0], b[1] * 2, *b[2:]), "only 0 and 1"),
        (lambda b: (*b[:3], torch.tensor([[2, 5], [3, -1]]), b[4]), "segment end beyond response length"),
        (lambda b: (*b[:3], torch.tensor([[3, 2], [3, -1]]), b[4]), "strictly increasing"),
        (lambda b: (*b[:3], torch.tensor([[0, 4], [3, -1]]), b[4]), "positive and strictly increasing"),
        (lambda b: (*b[:3], torch.tensor([[-1, 4], [3, -1]]), b[4]), "padding must come after"),
        (lambda b: (*b[:3], torch.tensor([[2, 4], [-3, -1]]), b[4]), "use -1 for padding"),
    ],
)
def test_bad_batches_raise(change, message):
    redistribute(*_valid_batch(), _config())  # the unchanged batch is fine
    with pytest.raises(ValueError, match=message):
        redistribute(*change(_valid_batch()), _config())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mix=1.5), "mix"),
        (dict(mix=-0.1), "mix"),
        (dict(value_mapping="minmax"), "value_mapping"),
        (dict(clip=0.5), "clip must be >= 1"),
        (dict(epsilon=0.0), "epsilon"),
        (dict(anchored=1), "anchored must be a bool"),
        (dict(max_token_advantage_ratio=0.9), "max_token_advantage_ratio must be >= 1"),
        (dict(max_affine_gain=0.0), "max_affine_gain must be > 0"),
        (dict(degenerate_groups="zero"), "degenerate_groups must be one of"),
        (dict(min_value_concordance=1.5), "min_value_concordance must lie in"),
        (dict(min_value_concordance=-0.1), "min_value_concordance must lie in"),
        (dict(concordance_window=0), "concordance_window must be an integer >= 1"),
        (dict(concordance_window=2.5), "concordance_window must be an integer >= 1"),
        (dict(concordance_window=True), "concordance_window must be an integer >= 1"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RedistributionSettings(**kwargs)


def test_log_affine_mapping_spreads_credit_and_blames_the_collapse():
    """Reference-continuation values: rising log-probability on a correct trace, a collapse after a wrong step."""
    cfg = _config(value_mapping="log_affine")
    start = math.exp(-4.0)
    correct = anchor_values(torch.tensor([start, math.exp(-3.0), math.exp(-2.0), math.exp(-1.0), 0.0]), 1.0, 0.5, cfg)
    expected = [0.5, 0.5 + 0.5 * 0.25, 0.5 + 0.5 * 0.5, 0.5 + 0.5 * 0.75, 1.0]
    assert torch.allclose(correct.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6)
    wrong = anchor_values(torch.tensor([start, math.exp(-3.0), math.exp(-9.0), math.exp(-9.5), 0.0]), 0.0, 0.5, cfg)
    rewards = segment_rewards(wrong)
    assert rewards[0] > 0 and int(rewards.argmin()) == 1
    assert float(rewards.sum()) == pytest.approx(0.0 - 0.5, abs=1e-6)
    flat = anchor_values(torch.tensor([0.0, 0.2, 0.4, 0.0]), 1.0, 0.25, cfg)
    assert torch.allclose(flat.double(), torch.tensor([0.25, 0.5, 0.75, 1.0], dtype=torch.float64), atol=1e-6)


# ---------------------------------------------------------------------------------------------- uninformative values


def test_flat_values_give_verls_grpo_exactly_whatever_the_segment_lengths():
    """A wrong trace whose probes sit at its outcome (v̂ ≈ 0) says nothing about its segments: GRPO, not the same
    total per segment (which gave −23.4 per token on its 32-token segment and −0.77 on the 968-token one)."""
    batch = _batch([0.0, 1.0, 0.0, 1.0], [1000] * 4, ["q"] * 4, [[32, 1000]] * 4,
                   [[0.0, 0.0, NAN], [0.4, 0.8, NAN], [0.3, 0.1, NAN], [0.5, 0.7, NAN]])  # fmt: skip
    grpo, _ = _verl_grpo(batch[0], batch[1], batch[2])
    result = redistribute(*batch, _config())
    assert not result.fallback.any() and result.metrics["affine_flat_traces"] == 1.0
    # torch.equal, not allclose: the interpolated trace takes GRPO's own row, so any difference is a bug.
    assert torch.equal(result.advantages[0], grpo[0])
    assert not torch.equal(result.advantages[1], grpo[1])  # the informative traces are redistributed
    # V(b) = V_0 + (ζ − V_0)·b/L with V_0 = 0.5, ζ = 0.
    assert torch.allclose(result.values[0], torch.tensor([0.5, 0.5 - 0.5 * 32 / 1000, 0.0], dtype=torch.float64))
    # Same with λ < 1 and for log_affine's undefined case (v̂_0 = 0).
    for cfg in (_config(mix=0.5), _config(value_mapping="log_affine")):
        assert torch.equal(redistribute(*batch, cfg).advantages[0], grpo[0])


def test_affine_gain_beyond_the_bound_interpolates_in_token_position():
    # Self-normalised probes that barely move on a correct trace, group mean 0.75: gain (1 − .75)/(1 − .995) = 50.
    probes = torch.tensor([0.995, 0.990, 0.985, 0.999, NAN], dtype=torch.float64)
    ends = torch.tensor([10, 20, 30, 100])
    loose = anchor_values(probes, 1.0, 0.75, _config(max_affine_gain=100.0), segment_ends=ends)
    assert torch.allclose(loose, torch.tensor([0.75, 0.5, 0.25, 0.95, 1.0], dtype=torch.float64))  # noise amplified
    guarded = anchor_values(probes, 1.0, 0.75, _config(), segment_ends=ends)
    assert torch.allclose(guarded, torch.tensor([0.75, 0.775, 0.8, 0.825, 1.0], dtype=torch.float64))

    others = [[0.5, 0.4, 0.1, 0.1, NAN], [0.5, 0.6, 0.2, 0.1, NAN], [0.5, 0.6, 0.7, 0.8, NAN]]
    batch = _batch([1.0, 0.0, 0.0, 1.0], [100] * 4, ["q"] * 4, [[10, 20, 30, 100]] * 4, [probes.tolist()] + others)
    grpo, _ = _verl_grpo(batch[0], batch[1], batch[2])
    result = redistribute(*batch, _config())
    assert result.metrics["affine_gain_traces"] == 1.0 and result.metrics["affine_flat_traces"] == 0.0
    assert torch.equal(result.advantages[0], grpo[0])
    assert not result.fallback[0]
    assert not torch.equal(result.advantages[1], grpo[1])
    loose = redistribute(*batch, _config(max_affine_gain=1000.0))  # this group's gain is 100
    assert loose.metrics["affine_gain_traces"] == 0.0 and not torch.equal(loose.advantages[0], grpo[0])


def test_negative_affine_gain_from_partial_credit_interpolates():
    # ζ = 0.5 between v̂_0 = 0.6 and the group mean 1/3: the affine map would reverse the probes' order.
    batch = _batch([0.5, 0.0, 0.5], [6] * 3, ["q"] * 3, [[3, 6]] * 3,
                   [[0.6, 0.9, NAN], [0.5, 0.2, NAN], [0.2, 0.4, NAN]])  # fmt: skip
    result = redistribute(*batch, _config())
    grpo, _ = _verl_grpo(batch[0], batch[1], batch[2])
    assert result.metrics["affine_gain_traces"] == 1.0
    assert torch.equal(result.advantages[0], grpo[0])


# ---------------------------------------------------------------------------------------------- token bound


def test_token_bound_caps_a_short_segment_at_the_clip_and_keeps_the_token_sum():
    """L ≈ 25k, K = 40, all credit on a 32-token segment: the clip leaves 97.6·Â per token there."""
    ends = torch.tensor(np.cumsum([640] * 39 + [32])).tolist()
    length = ends[-1]
    raw = [[0.5] * 40 + [NAN], [0.5] * 40 + [NAN]]  # flat probes: everything happens in the last segment
    batch = _batch([1.0, 0.0], [length] * 2, ["q", "q"], [ends] * 2, raw)
    grpo, _ = _verl_grpo(batch[0], batch[1], batch[2])
    unbounded = redistribute(*batch, _config(value_mapping="raw", max_token_advantage_ratio=math.inf))
    ratio = unbounded.advantages.double() / grpo.double()
    assert ratio.max().item() == pytest.approx(length * (5 / 40) / 32, rel=1e-5)  # 97.6
    assert unbounded.metrics["token_bound_trace_frac"] == 0.0
    result = redistribute(*batch, _config(value_mapping="raw"))  # default bound 10
    ratio = result.advantages.double() / grpo.double()
    assert ratio.abs().max().item() == pytest.approx(10.0, rel=1e-6)
    assert torch.allclose(result.advantages.double().sum(1), grpo.double().sum(1), rtol=1e-6)
    assert (ratio[:, -1] > ratio[:, 0]).all()  # the short segment keeps the most credit per token
    assert result.metrics["token_bound_trace_frac"] == 1.0


@PROPERTY_SETTINGS
@given(
    batch=batches(any_float_scores=False),
    bound=st.sampled_from([1.0, 1.5, 3.0]),
    mix=st.sampled_from([0.5, 1.0]),
    mapping=st.sampled_from(["affine", "raw"]),
)
def test_token_bound_holds_on_every_token_and_keeps_the_token_sum(batch, bound, mix, mapping):
    scores, mask, index, ends, raw = batch
    cfg = _config(mix=mix, value_mapping=mapping, max_token_advantage_ratio=bound)
    result = redistribute(scores, mask, index, ends, raw, cfg)
    grpo, _ = _verl_grpo(scores, mask, index)
    assert torch.isfinite(result.advantages).all()
    assert (result.advantages.double().abs() <= bound * grpo.double().abs() * (1 + 1e-5) + 1e-6).all()
    assert torch.allclose(result.advantages.double().sum(1), grpo.double().sum(1), rtol=1e-5, atol=1e-4)
    if bound == 1.0:  # the only allowed factors are 1: GRPO
        assert torch.allclose(result.advantages, grpo, atol=1e-5)


# ---------------------------------------------------------------------------------------------- degenerate groups


def _all_wrong_group():
    # 4 wrong traces of 16 tokens, 4 segments of 4: trace 0 was on track, then collapsed in its 3rd segment.
    raw = [[0.6, 0.7, 0.8, 0.1, NAN], [0.2, 0.2, 0.1, 0.1, NAN], [0.0, 0.0, 0.0, 0.0, NAN], [0.3, 0.2, 0.2, 0.1, NAN]]
    return _batch([0.0] * 4 + [1.0], [16] * 5, ["w"] * 4 + ["solo"], [[4, 8, 12, 16]] * 5, raw + [[0.5] * 4 + [NAN]])


def test_value_differences_blame_the_collapse_in_an_all_wrong_group():
    batch = _all_wrong_group()
    grpo, _ = _verl_grpo(batch[0], batch[1], batch[2])
    plain = redistribute(*batch, _config())
    assert torch.equal(plain.advantages, grpo)  # default: GRPO's zeros (and the singleton's score)
    assert plain.metrics["degenerate_groups_with_signal"] == 0.0

    result = redistribute(*batch, _config(degenerate_groups="value_differences"))
    per_segment = result.advantages[0].view(4, 4)[:, 0]
    assert int(per_segment.argmin()) == 2 and per_segment[2] < 0  # the collapse carries the blame
    assert per_segment[0] > 0 and per_segment[1] > 0  # the rises before it are pushed up
    # A_t = R_k · (L / n_k) / s with s = 0.5 (GRPO normalisation): R = [.1, .1, -.7, -.1], L / n_k = 4.
    assert torch.allclose(per_segment.double(), torch.tensor([0.8, 0.8, -5.6, -0.8], dtype=torch.float64), atol=1e-6)
    assert torch.allclose(result.segment_rewards[0], torch.tensor([0.1, 0.1, -0.7, -0.1], dtype=torch.float64))
    assert torch.all(result.advantages[2] == 0)  # probes at the outcome throughout: nothing to learn
    assert torch.equal(result.advantages[4], grpo[4])  # a group of one keeps GRPO
    assert result.metrics["degenerate_groups"] == 1.0 and result.metrics["degenerate_groups_with_signal"] == 1.0
    assert result.fallback.tolist() == [False, False, False, False, True]
    dr_grpo = redistribute(*batch, _config(degenerate_groups="value_differences", norm_adv_by_std=False))
    assert torch.allclose(dr_grpo.advantages[0], result.advantages[0] / 2, atol=1e-6)  # s = 1 without the std
    assert torch.equal(redistribute(*batch, _config(degenerate_groups="value_differences", mix=0.0))
                       .advantages, grpo)  # fmt: skip


def test_value_differences_respect_the_token_bound():
    batch = _all_wrong_group()
    result = redistribute(
        *batch, _config(degenerate_groups="value_differences", max_token_advantage_ratio=3.0)
    )
    # The bound on |A_t| is B times the advantage unit (1 here, a 50/50 group's |Â|), at an unchanged token sum.
    assert result.advantages[:4].abs().max().item() == pytest.approx(3.0, rel=1e-6)
    assert result.advantages[0].double().sum().item() == pytest.approx(16 * (0.0 - 0.6) / 0.5, rel=1e-6)
    assert result.metrics["token_bound_trace_frac"] == pytest.approx(1 / 4)


@PROPERTY_SETTINGS
@given(batch=batches(any_float_scores=False), mix=st.sampled_from([0.5, 1.0]), norm=st.booleans())
def test_value_differences_are_finite_bounded_and_leave_mixed_groups_alone(batch, mix, norm):
    scores, mask, index, ends, raw = batch
    cfg = _config(mix=mix, norm_adv_by_std=norm)
    plain = redistribute(scores, mask, index, ends, raw, cfg)
    result = redistribute(scores, mask, index, ends, raw, _config(
        mix=mix, norm_adv_by_std=norm, degenerate_groups="value_differences"))  # fmt: skip
    assert torch.isfinite(result.advantages).all() and torch.all(result.advantages[mask == 0] == 0)
    degenerate = torch.tensor([
        bool((index == uid).sum() > 1) and bool((scores[torch.tensor(index == uid)] == scores[i]).all())
        for i, uid in enumerate(index)
    ])  # fmt: skip
    assert torch.equal(result.advantages[~degenerate], plain.advantages[~degenerate])
    unit = 1.0 if norm else 0.5
    assert (result.advantages[degenerate].abs() <= 10.0 * unit + 1e-5).all()
    live = degenerate & ~result.fallback
    telescoped = result.segment_rewards[live].double().nan_to_num(0.0).sum(1)
    assert torch.allclose(telescoped, scores[live].double() - result.values[live, 0].double(), atol=1e-6)
    if mix == 1.0:  # bound 10 >= 2 always leaves room for the token sum L · (ζ − v̂_0) / s
        expected = mask[live].sum(1).double() * telescoped / 0.5 * unit
        assert torch.allclose(result.advantages[live].double().sum(1), expected, rtol=1e-5, atol=1e-4)


@st.composite
def one_trace_cases(draw):
    """A trace with segment data in a mixed group (the case the one-trace reference covers), and settings."""
    low, high = draw(st.sampled_from([(0.0, 1.0), (-1.0, 1.0)]))
    size = draw(st.integers(2, 5))
    outcomes = [draw(st.sampled_from([low, high])) for _ in range(size)]
    if len(set(outcomes)) == 1:
        outcomes[1] = high if outcomes[0] == low else low
    tokens = draw(st.lists(st.integers(1, 9), min_size=1, max_size=6))
    ends = [int(end) for end in np.cumsum(tokens)]
    raw = draw(st.lists(st.floats(0.0, 1.0, allow_nan=False), min_size=len(ends), max_size=len(ends)))
    options = {
        "mix": draw(st.sampled_from([0.0, 0.4, 1.0])),
        "anchored": draw(st.booleans()),
        "value_mapping": draw(st.sampled_from(["affine", "log_affine", "raw"])),
        "clip": draw(st.sampled_from([1.0, 1.5, 5.0])),
        "max_token_advantage_ratio": draw(st.sampled_from([1.0, 2.0, 10.0])),
        "max_affine_gain": draw(st.sampled_from([2.0, 10.0])),
        "epsilon": 1e-6,
        "norm_adv_by_std": draw(st.booleans()),
        "credit_traces": draw(st.sampled_from(["all", "incorrect", "correct"])),
    }
    shaped = None
    if draw(st.booleans()):  # IBPO's shaping R' = R + λφ(high − R), λ = 0.6, on the incorrect traces
        shaped = [o if o == high else o + 0.6 * draw(st.sampled_from([0.0, 1 / 6, 0.5])) * (high - o) for o in outcomes]
    return outcomes, ends, raw, options, (low, high), shaped


@PROPERTY_SETTINGS
@given(case=one_trace_cases())
def test_batched_redistribution_equals_the_one_trace_reference(case):
    """``redistribute`` on a batch whose first trace is the case (its group mates carry one segment each) gives that
    trace the token advantages of ``redistribution_reference.redistribute_trace``."""
    _assert_equals_the_one_trace_reference(case, holes=[0] * case[1][-1])


def _assert_equals_the_one_trace_reference(case, holes: list[int]):
    """The case's trace first in a batch, with ``holes[t]`` context tokens after its model token t."""
    outcomes, ends, raw, options, reward_range, shaped = case
    size = len(outcomes)
    row_mask, _, full_ends = _open_holes(ends, ends[-1], holes)
    mask = torch.zeros(size, max(len(row_mask), 4))
    mask[0, : len(row_mask)] = torch.tensor(row_mask, dtype=torch.float32)
    mask[1:, :4] = 1
    seg_ends = torch.full((size, len(ends)), -1, dtype=torch.int64)
    seg_ends[0] = torch.tensor(full_ends)
    seg_ends[1:, 0] = 4
    raw_values = torch.full((size, len(ends) + 1), float("nan"))
    raw_values[0, : len(ends)] = torch.tensor(raw, dtype=torch.float32)
    raw_values[1:, 0] = 0.5
    result = redistribute(torch.tensor(outcomes), mask, ["g"] * size, seg_ends, raw_values, _config(**options),
                          reward_range=reward_range, shaped_scores=None if shaped is None else torch.tensor(shaped))
    expected = redistribute_trace(
        outcomes[0], outcomes, full_ends, [float(v) for v in raw_values[0, : len(ends)]], reward_range=reward_range,
        shaped_outcome=None if shaped is None else shaped[0], shaped_group_outcomes=shaped, response_mask=row_mask,
        **options,
    )  # fmt: skip
    assert all(expected[p] == 0.0 for p, trained in enumerate(row_mask) if not trained)
    torch.testing.assert_close(
        result.advantages[0, : len(row_mask)].double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-5
    )

# ---------------------------------------------------------------------------------------------- multi-turn responses
# verl's tool agent loop writes a multi-turn response as the model's turns (response_mask 1) with the tool output and
# the chat template's tokens between them (0: the separator after <|im_end|>, the tool message, the next header),
# then right padding. Segments start on a model token; a hole sits at the tail of the segment before it.


def _open_holes(ends_row: list[int], length: int, holes: list[int]) -> tuple[list[int], list[int], list[int]]:
    """A right-padded trace of ``length`` model tokens with ``holes[t]`` context tokens after model token t.

    Returns:
        its mask row (no padding), the full position of each model token, and ``ends_row`` (in model tokens) as
        positions of the full response.
    """
    mask, positions = [], []
    for t in range(length):
        positions.append(len(mask))
        mask += [1] + [0] * holes[t]
    full_ends = [positions[end] if end < length else positions[-1] + 1 for end in ends_row]
    return mask, positions, full_ends


@PROPERTY_SETTINGS
@given(batch=batches(), data=st.data(), mix=st.sampled_from([0.0, 0.5, 1.0]), mapping=st.sampled_from(["affine", "raw"]))
def test_holes_get_zero_and_change_nothing_else(batch, data, mix, mapping):
    """The same batch with tool output between its tokens: every model token keeps its advantage bit for bit, every
    hole gets exactly 0, and values, segment rewards (so the per-trace telescoping) and fallbacks are the same."""
    scores, mask, index, ends, raw = batch
    lengths = mask.sum(1).long().tolist()
    rows = []
    for i, length in enumerate(lengths):
        holes = data.draw(st.lists(st.sampled_from([0, 0, 0, 1, 3]), min_size=length, max_size=length), label="holes")
        present = [int(e) for e in ends[i] if e >= 0]
        rows.append(_open_holes(present, length, holes))
    width = max([len(row_mask) for row_mask, _, _ in rows] + [1])
    holed_mask = torch.zeros(len(rows), width, dtype=mask.dtype)
    holed_ends = ends.clone()
    for i, (row_mask, _, full_ends) in enumerate(rows):
        holed_mask[i, : len(row_mask)] = torch.tensor(row_mask, dtype=mask.dtype)
        holed_ends[i, : len(full_ends)] = torch.tensor(full_ends, dtype=torch.int64)
    cfg = _config(mix=mix, value_mapping=mapping)
    plain = redistribute(scores, mask, index, ends, raw, cfg)
    holed = redistribute(scores, holed_mask, index, holed_ends, raw, cfg)
    assert torch.all(holed.advantages[holed_mask == 0] == 0)
    for i, (_, positions, _) in enumerate(rows):
        assert torch.equal(holed.advantages[i, positions], plain.advantages[i, : lengths[i]])
    torch.testing.assert_close(holed.values, plain.values, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(holed.segment_rewards, plain.segment_rewards, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(holed.fallback, plain.fallback)
    assert holed.metrics == pytest.approx(plain.metrics, nan_ok=True)


def _tool_trajectory(turn_tokens: list[int], hole: int) -> tuple[list[int], list[int]]:
    """Mask row and per-turn segment ends (full positions) of turns of ``turn_tokens`` model tokens, each but the
    last followed by ``hole`` context tokens, one segment per turn."""
    mask, ends = [], []
    for j, tokens in enumerate(turn_tokens):
        mask += [1] * tokens
        if j + 1 < len(turn_tokens):
            mask += [0] * hole
        ends.append(len(mask))
    return mask, ends


@pytest.mark.parametrize("turns", [1, 2, 5])
def test_telescoping_per_trace_whatever_the_turn_count(turns):
    """A group whose traces took 1, 2 and 5 turns: each trace's segment rewards sum to its outcome minus the group
    mean, its advantage sums to L·Â over its own model tokens (its token mean is its GRPO advantage, so the number
    of turns biases nothing), each turn's share lands on that turn's tokens only, and tool output gets 0."""
    layouts = [[7] * turns, [5, 9], [4, 6, 3, 8, 5], [11]]  # the trace under test, then its group mates
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    hole = 6  # "\n" + the tool message + "<|im_start|>assistant\n"
    rows = [_tool_trajectory(turn_tokens, hole) for turn_tokens in layouts]
    width = max(len(row_mask) for row_mask, _ in rows) + 3  # right padding
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    ends = torch.full((len(rows), 5), -1, dtype=torch.int64)
    raw = torch.full((len(rows), 6), NAN, dtype=torch.float64)
    generator = torch.Generator().manual_seed(turns)
    for i, (row_mask, row_ends) in enumerate(rows):
        mask[i, : len(row_mask)] = torch.tensor(row_mask)
        ends[i, : len(row_ends)] = torch.tensor(row_ends)
        raw[i, : len(row_ends)] = 0.3 + 0.4 * torch.rand(len(row_ends), generator=generator, dtype=torch.float64)
    result = redistribute(scores, mask, ["g"] * len(rows), ends, raw, _config(value_mapping="raw", clip=50.0,
                                                                              max_token_advantage_ratio=100.0))
    grpo, _ = group_outcome_advantage(scores, ["g"] * len(rows), 1e-6, True)
    assert not result.fallback.any()
    assert torch.all(result.advantages[mask == 0] == 0)
    for i, (row_mask, row_ends) in enumerate(rows):
        rewards = result.segment_rewards[i, : len(row_ends)].double()
        torch.testing.assert_close(rewards.sum(), scores[i].double() - 0.5)
        model_tokens = sum(row_mask)
        torch.testing.assert_close(result.advantages[i].double().sum(), model_tokens * grpo[i].double())
        for k, (start, end) in enumerate(zip([0, *row_ends[:-1]], row_ends)):  # turn k's share, on turn k only
            share = model_tokens * float(grpo[i]) * float(rewards[k] / rewards.sum())
            torch.testing.assert_close(result.advantages[i, start:end].double().sum(), torch.tensor(share).double())


def test_a_segment_starting_on_tool_output_is_refused():
    scores, _, index, _, raw = _valid_batch()
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0]])
    redistribute(scores, mask, index, torch.tensor([[4, 6], [3, -1]]), raw, _config())  # the turn start: fine
    with pytest.raises(ValueError, match="segment start on a 0 of response_mask"):
        redistribute(scores, mask, index, torch.tensor([[2, 6], [3, -1]]), raw, _config())
    with pytest.raises(ValueError, match="segment end beyond response length"):
        redistribute(scores, mask, index, torch.tensor([[4, 6], [5, -1]]), raw, _config())


@PROPERTY_SETTINGS
@given(case=one_trace_cases(), data=st.data())
def test_batched_redistribution_equals_the_one_trace_reference_with_holes(case, data):
    """As above, the trace's model tokens with tool output between them (after any token, the last included)."""
    length = case[1][-1]
    holes = data.draw(st.lists(st.sampled_from([0, 0, 1, 4]), min_size=length, max_size=length), label="holes")
    _assert_equals_the_one_trace_reference(case, holes)


# ------------------------------------------------------------------------------------------- credit on one kind only


def _mixed_batch():
    """Two groups of three: outcomes 1, 0, 0 and 0, 1, 1; three segments each, values that move."""
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    mask = torch.ones(6, 9)
    ends = torch.tensor([[3, 6, 9]] * 6)
    raw = torch.tensor([[0.5, 0.8, 0.9, float("nan")], [0.5, 0.2, 0.1, float("nan")], [0.4, 0.6, 0.1, float("nan")],
                        [0.3, 0.1, 0.2, float("nan")], [0.3, 0.5, 0.9, float("nan")], [0.4, 0.3, 0.8, float("nan")]])
    return scores, mask, ["a"] * 3 + ["b"] * 3, ends, raw


@pytest.mark.parametrize("credit", ["incorrect", "correct"])
def test_credit_on_one_kind_leaves_the_other_at_grpo_bit_for_bit(credit):
    """With ``credit_traces`` set, the other kind's rows are verl's GRPO rows exactly, this kind's rows are those
    of ``"all"`` exactly, and the kept traces are counted as uncredited, not as fallbacks."""
    scores, mask, index, ends, raw = _mixed_batch()
    everything = redistribute(scores, mask, index, ends, raw, _config())
    plain = redistribute(scores, mask, index, ends, raw, _config(mix=0.0))
    result = redistribute(scores, mask, index, ends, raw, _config(credit_traces=credit))
    credited = scores == 1.0 if credit == "correct" else scores == 0.0
    assert torch.equal(result.advantages[~credited], plain.advantages[~credited])
    assert torch.equal(result.advantages[credited], everything.advantages[credited])
    assert not torch.equal(everything.advantages[~credited], plain.advantages[~credited])  # "all" did move them
    assert result.metrics["uncredited_traces"] == float((~credited).sum())
    assert everything.metrics["uncredited_traces"] == 0.0
    assert result.metrics["redistributed_frac"] == pytest.approx(float(credited.sum()) / 6)
    assert not any(v for k, v in result.metrics.items() if k.startswith("fallback/"))


def test_credit_on_incorrect_traces_learns_from_value_differences_in_all_wrong_groups_only():
    """With ``degenerate_groups: value_differences``, an all-wrong group's traces get value-difference credit under
    ``credit_traces: incorrect`` and an all-correct group's keep GRPO's zero row."""
    mask, ends = torch.ones(4, 6), torch.tensor([[3, 6]] * 4)
    scores = torch.tensor([0.0, 0.0, 1.0, 1.0])
    raw = torch.tensor([[0.5, 0.2, float("nan")], [0.3, 0.4, float("nan")], [0.6, 0.9, float("nan")],
                        [0.5, 0.7, float("nan")]])
    result = redistribute(scores, mask, ["w", "w", "c", "c"], ends, raw,
                          _config(degenerate_groups="value_differences", credit_traces="incorrect"))
    assert (result.advantages[:2] != 0).any(1).all()
    assert torch.equal(result.advantages[2:], torch.zeros(2, 6))
    assert result.metrics["uncredited_traces"] == 2.0


def test_unknown_credit_traces_is_refused():
    with pytest.raises(ValueError, match="credit_traces must be one of"):
        RedistributionSettings(credit_traces="wrong")


# ------------------------------------------------------------------------------------------ signed advantage form


def test_signed_form_gives_each_token_its_segments_value_difference():
    # A correct and a wrong trace of 12 tokens in 3 segments of 4 (raw values, anchored: V_0 = group mean 0.5).
    batch = _batch([1.0, 0.0], [12, 12], ["g", "g"], [[4, 8, 12]] * 2, [[0.5, 0.9, 0.8, NAN], [0.5, 0.6, 0.1, NAN]])
    result = redistribute(*batch, _config(value_mapping="raw", advantage_form="signed"))
    # s = std + ε of {1, 0} = 0.7071...: R = [.4, -.1, .2] and [.1, -.5, -.1], per token R_k / s.
    scale = math.sqrt(0.5) + 1e-6
    expected = torch.tensor([[0.4, -0.1, 0.2], [0.1, -0.5, -0.1]], dtype=torch.float64) / scale
    assert torch.allclose(result.advantages.view(2, 3, 4).double(), expected.unsqueeze(-1).expand(2, 3, 4), atol=1e-6)
    # sigma spreads Â by the shares R_k / Σ R = [.8, -.2, .4] (L / n_k = 3): the same signs, other magnitudes.
    sigma = redistribute(*batch, _config(value_mapping="raw"))
    advantage = 1.0 / scale * 0.5
    assert torch.allclose(sigma.advantages[0].view(3, 4)[:, 0].double(),
                          advantage * 3 * torch.tensor([0.8, -0.2, 0.4], dtype=torch.float64), atol=1e-5)


@PROPERTY_SETTINGS
@given(batch=batches(any_float_scores=False), norm=st.booleans())
def test_signed_form_telescopes_to_grpo_and_is_grpo_at_mix_zero(batch, norm):
    """Anchored, Σ_k R_k / s = (ζ − mean) / s = Â: a redistributed trace's segment advantages sum to its Â; at λ = 0
    the tensor is verl's GRPO bit for bit; fallbacks keep GRPO's row."""
    scores, mask, index, ends, raw = batch
    cfg = _config(value_mapping="raw", advantage_form="signed", norm_adv_by_std=norm)
    result = redistribute(scores, mask, index, ends, raw, cfg)
    grpo, _ = _verl_grpo(scores, mask, index, norm_adv_by_std=norm)
    assert torch.isfinite(result.advantages).all() and torch.all(result.advantages[mask == 0] == 0)
    assert torch.equal(result.advantages[result.fallback], grpo[result.fallback])
    for i in torch.nonzero(~result.fallback & ~result.interpolated).flatten().tolist():
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), ends[i][ends[i] >= 0][:-1]])
        per_segment = result.advantages[i, starts].double().sum()
        assert per_segment.item() == pytest.approx(grpo[i, 0].item(), rel=1e-4, abs=1e-4)
    zero = redistribute(scores, mask, index, ends, raw, _config(mix=0.0, advantage_form="signed", norm_adv_by_std=norm))
    assert torch.equal(zero.advantages, grpo)


def test_signed_form_in_an_all_wrong_group_gives_value_differences_per_token():
    batch = _all_wrong_group()
    result = redistribute(*batch, _config(degenerate_groups="value_differences", advantage_form="signed"))
    # R = [.1, .1, -.7, -.1] with s = half the range (0.5), per token: no L / n_k spreading, no token bound.
    per_segment = result.advantages[0].view(4, 4)
    assert torch.allclose(per_segment.double(), torch.tensor([0.2, 0.2, -1.4, -0.2], dtype=torch.float64)
                          .unsqueeze(1).expand(4, 4), atol=1e-6)  # fmt: skip
    assert result.metrics["token_bound_trace_frac"] == 0.0


def test_unknown_advantage_form_is_refused():
    with pytest.raises(ValueError, match="advantage_form must be one of"):
        RedistributionSettings(advantage_form="vine")


# ---------------------------------------------------------------------------------------------- the rule alone


def test_the_rule_alone_spreads_the_advantage_by_the_value_shares():
    """``token_advantages`` without the guard around it: A_t = Â·L·σ_k / n_k on a credited trace (λ = 1), 0 on the
    holes of its mask, and 0 on every token of a trace it is not asked to credit."""
    values = torch.tensor([[0.5, 0.9, 0.8, 1.0], [0.5, 0.6, 0.1, 0.0]], dtype=torch.float64)
    in_response = torch.tensor([[1, 1, 1, 1, 0, 0] + [1] * 8, [1] * 12 + [0, 0]]).bool()  # a hole after token 4
    no = torch.tensor([False, False])
    credit = token_advantages(
        values, torch.tensor([0.7, -0.7]), torch.tensor([0.5, -0.5], dtype=torch.float64),
        torch.tensor([[4, 8, 12], [4, 8, 12]]), in_response, credited=torch.tensor([True, False]), differences=no,
        interpolated=no, cfg=RedistributionSettings(), width=1.0,
    )  # fmt: skip
    # R = [.4, −.1, .2], σ = R / Σ R = [.8, −.2, .4], L / n_k = 12 / 4.
    expected = 0.7 * 3 * torch.tensor([0.8, -0.2, 0.4], dtype=torch.float64).repeat_interleave(4)
    assert torch.allclose(credit.advantages[0, in_response[0]], expected)
    assert torch.all(credit.advantages[0, ~in_response[0]] == 0) and torch.all(credit.advantages[1] == 0)
    assert torch.allclose(credit.sigma[0], torch.tensor([0.8, -0.2, 0.4], dtype=torch.float64))
    assert not credit.clipped.any() and not credit.bounded.any()
