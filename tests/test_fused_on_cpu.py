"""``rredcot_ibpo`` (core.fused): IBPO's shaped outcome placed on segments by values; IBPO's row where values say
nothing. Exact equivalences at the edges (λ = 0 is IBPO, no repair is rredcot), the token-mean invariant, the
all-wrong group it exists for, the value gate and the ``wrong_trace_credit`` switch."""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rredcot_verl.core.concordance import ConcordanceCounts
from rredcot_verl.core.fused import FusedSettings, fused_advantages
from rredcot_verl.core.ibpo import IBPOSettings, shaped_advantages
from rredcot_verl.core.redistribution import RedistributionSettings, redistribute

torch.set_num_threads(1)
NAN = float("nan")
OPEN_GATE = RedistributionSettings(min_value_concordance=0.0)
PROPERTY_SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def repaired_batches(draw, width: int = 10, max_segments: int = 4):
    """Interleaved groups of 0/1 outcomes with segment data and probe values; incorrect traces may carry a repair
    signal φ and an edited-token mask, as IBPO's repairs give them."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    index = draw(st.permutations([f"g{g}" for g, n in enumerate(sizes) for _ in range(n)]))
    bsz = len(index)
    scores = torch.tensor(draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=bsz, max_size=bsz)))
    lengths = draw(st.lists(st.integers(1, width), min_size=bsz, max_size=bsz))
    mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).float()
    ends = torch.full((bsz, max_segments), -1, dtype=torch.int64)
    raw = torch.full((bsz, max_segments + 1), NAN)
    phi = torch.zeros(bsz)
    edited = torch.zeros(bsz, width, dtype=torch.bool)
    for i, length in enumerate(lengths):
        cuts = draw(st.sets(st.integers(1, length - 1), max_size=max_segments - 1)) if length > 1 else set()
        row = sorted(cuts) + [length]
        ends[i, : len(row)] = torch.tensor(row)
        raw[i, : len(row) + 1] = torch.tensor(draw(st.lists(st.floats(0.0, 1.0, width=32), min_size=len(row) + 1,
                                                             max_size=len(row) + 1)))  # fmt: skip
        if scores[i] == 0.0 and draw(st.booleans()):
            phi[i] = draw(st.sampled_from([1 / 6, 0.25, 0.5]))
            start = draw(st.integers(0, length - 1))
            edited[i, start:length] = True
    return scores, mask, np.array(index, dtype=object), ends, raw, phi, edited


def _fused(batch, redistribution=OPEN_GATE, cfg=FusedSettings(), ibpo=IBPOSettings(), **kwargs):
    scores, mask, index, ends, raw, phi, edited = batch
    return fused_advantages(scores, mask, index, ends, raw, phi, edited, ibpo, redistribution, cfg, **kwargs)


@PROPERTY_SETTINGS
@given(batch=repaired_batches())
def test_mix_zero_is_ibpo_bit_for_bit(batch):
    scores, mask, index, _, _, phi, edited = batch
    result = _fused(batch, dataclasses.replace(OPEN_GATE, mix=0.0))
    expected = shaped_advantages(scores, mask, index, phi, edited, IBPOSettings()).advantages
    assert torch.equal(result.advantages, expected)
    assert not result.from_values.any()


@PROPERTY_SETTINGS
@given(batch=repaired_batches(), mix=st.sampled_from([0.5, 1.0]))
def test_without_repairs_it_is_rredcot_bit_for_bit(batch, mix):
    scores, mask, index, ends, raw, _, _ = batch
    cfg = dataclasses.replace(OPEN_GATE, mix=mix)
    result = _fused((scores, mask, index, ends, raw, torch.zeros_like(scores), None), cfg)
    assert torch.equal(result.advantages, redistribute(scores, mask, index, ends, raw, cfg).advantages)
    assert result.metrics["fallback/against_shaped_advantage"] == 0.0


@PROPERTY_SETTINGS
@given(batch=repaired_batches(), mix=st.sampled_from([0.5, 1.0]))
def test_a_redistributed_trace_keeps_its_shaped_advantage_as_token_mean(batch, mix):
    scores, mask, index, _, _, phi, edited = batch
    result = _fused(batch, dataclasses.replace(OPEN_GATE, mix=mix))
    shaped = shaped_advantages(scores, mask, index, phi, None, IBPOSettings(use_mask=False)).advantages
    rows = result.from_values
    torch.testing.assert_close(result.advantages[rows].sum(1), shaped[rows].sum(1), rtol=1e-4, atol=1e-4)
    assert torch.isfinite(result.advantages).all()


def _all_wrong_group():
    """Four incorrect traces of one prompt, three 2-token segments each. Trace 0 was repaired (its last two tokens
    edited); the values (from its repair in the bank) fall in segment 1 for trace 1 and in segment 3 for trace 2."""
    scores = torch.zeros(4)
    mask = torch.ones(4, 6)
    index = np.array(["q"] * 4, dtype=object)
    ends = torch.tensor([[2, 4, 6]] * 4)
    raw = torch.tensor([[0.6, 0.6, 0.05, 0.0], [0.6, 0.05, 0.01, 0.0], [0.6, 0.6, 0.6, 0.0], [0.6, 0.4, 0.2, 0.0]])
    phi = torch.tensor([0.5, 0.0, 0.0, 0.0])
    edited = torch.zeros(4, 6, dtype=torch.bool)
    edited[0, 4:] = True
    return scores, mask, index, ends, raw, phi, edited


def test_an_all_wrong_group_learns_where_each_trace_went_wrong():
    """GRPO gives this group nothing; IBPO blames every token of the unrepaired traces alike; the fused estimator
    puts each one's blame on the segment where its value fell, and never reinforces what trace 0's repair changed."""
    batch = _all_wrong_group()
    result = _fused(batch)
    advantages = result.advantages
    assert torch.equal(result.from_values, torch.tensor([False, True, True, True]))
    # trace 0: above the group's shaped mean, its values against it: IBPO's row, credit on the kept tokens only
    assert torch.all(advantages[0, :4] > 0) and torch.all(advantages[0, 4:] == 0)
    assert result.metrics["fallback/against_shaped_advantage"] == 1.0
    # traces 1 and 2: the most blame on the segment whose value fell
    assert int(advantages[1].argmin()) in (0, 1) and advantages[1, :2].sum() < 5 * advantages[1, 2:].sum()
    assert int(advantages[2].argmin()) in (4, 5) and advantages[2, 4:].sum() < 5 * advantages[2, :4].sum()
    ibpo = shaped_advantages(*batch[:3], batch[5], batch[6], IBPOSettings()).advantages
    for i in (1, 2, 3):  # same total blame as IBPO's broadcast
        assert float(advantages[i].sum()) == pytest.approx(float(ibpo[i].sum()), rel=1e-5)
        assert float(ibpo[i].std()) == 0.0


def test_a_closed_value_gate_gives_ibpo_rows():
    batch = _all_wrong_group()
    scores, mask, index, _, _, phi, edited = batch
    closed = dataclasses.replace(OPEN_GATE, min_value_concordance=0.6)
    result = _fused(batch, closed, prior_concordance=ConcordanceCounts(10.0, 40))
    assert torch.equal(result.advantages, shaped_advantages(scores, mask, index, phi, edited, IBPOSettings()).advantages)
    assert result.metrics["value_gate_open"] == 0.0 and result.metrics["credit_from_values_frac"] == 0.0


def test_edit_mask_credit_keeps_ibpo_rows_on_wrong_traces_with_a_localised_repair():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    mask = torch.ones(4, 6)
    index = np.array(["q"] * 4, dtype=object)
    ends = torch.tensor([[2, 4, 6]] * 4)
    raw = torch.tensor([[0.5, 0.7, 0.9, 1.0], [0.5, 0.1, 0.1, 0.0], [0.5, 0.5, 0.1, 0.0], [0.5, 0.6, 0.8, 1.0]])
    phi = torch.tensor([0.0, 0.5, 0.0, 0.0])
    edited = torch.zeros(4, 6, dtype=torch.bool)
    edited[1, 2:] = True
    batch = (scores, mask, index, ends, raw, phi, edited)
    ibpo = shaped_advantages(scores, mask, index, phi, edited, IBPOSettings()).advantages
    by_values = _fused(batch)
    by_mask = _fused(batch, cfg=FusedSettings(wrong_trace_credit="edit_mask"))
    assert by_values.from_values.all()
    assert torch.equal(by_mask.from_values, torch.tensor([True, False, True, True]))
    assert torch.equal(by_mask.advantages[1], ibpo[1]) and torch.all(by_mask.advantages[1, :2] == 0)
    assert torch.equal(by_mask.advantages[[0, 2, 3]], by_values.advantages[[0, 2, 3]])
    # by the values, trace 1's blame sits where its value fell (segment 1), before the repair's first edit
    assert by_values.advantages[1, :2].mean() < by_values.advantages[1, 2:].mean()


def test_shaped_scores_must_match_the_batch():
    scores, mask, index, ends, raw, _, _ = _all_wrong_group()
    with pytest.raises(ValueError, match="shaped_scores"):
        redistribute(scores, mask, index, ends, raw, OPEN_GATE, shaped_scores=torch.zeros(3))
    with pytest.raises(ValueError, match="shaped_scores must be finite"):
        redistribute(scores, mask, index, ends, raw, OPEN_GATE, shaped_scores=torch.tensor([0.0, NAN, 0.0, 0.0]))


def test_settings_refuse_an_unknown_credit_rule():
    with pytest.raises(ValueError, match="wrong_trace_credit"):
        FusedSettings(wrong_trace_credit="both")
