"""The rewritten redistribution against a frozen copy of the module before the rewrite (``_redistribution_before``):
the same results bit for bit on random batches across every setting. Temporary: removed with the frozen copy."""

import os

import numpy as np
import pytest
import torch
from _redistribution_before import redistribute as redistribute_before
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_redistribution_on_cpu import _open_holes, batches

from rredcot_verl.core.concordance import ConcordanceCounts
from rredcot_verl.core.redistribution import RedistributionSettings, redistribute

torch.set_num_threads(1)
EXAMPLES = int(os.environ.get("REDISTRIBUTION_EQUIVALENCE_EXAMPLES", "200"))
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bool: torch.bool}


def _same_bits(new: torch.Tensor, old: torch.Tensor) -> bool:
    """Equal dtype, shape and bits (NaN padding and the sign of zero included)."""
    if new.dtype != old.dtype or new.shape != old.shape:
        return False
    return torch.equal(new.contiguous().view(_BITS[new.dtype]), old.contiguous().view(_BITS[old.dtype]))


@st.composite
def settings_combinations(draw):
    return RedistributionSettings(
        mix=draw(st.sampled_from([0.0, 0.3, 1.0])),
        anchored=draw(st.booleans()),
        value_mapping=draw(st.sampled_from(["affine", "log_affine", "raw"])),
        clip=draw(st.sampled_from([1.0, 1.5, 5.0])),
        max_token_advantage_ratio=draw(st.sampled_from([1.0, 2.0, 10.0, float("inf")])),
        max_affine_gain=draw(st.sampled_from([0.5, 2.0, 10.0])),
        degenerate_groups=draw(st.sampled_from(["grpo", "value_differences"])),
        min_value_concordance=draw(st.sampled_from([0.0, 0.6, 1.0])),
        credit_traces=draw(st.sampled_from(["all", "incorrect", "correct"])),
        advantage_form=draw(st.sampled_from(["sigma", "signed"])),
        epsilon=draw(st.sampled_from([1e-6, 1e-3])),
        norm_adv_by_std=draw(st.booleans()),
    )


@st.composite
def redistribution_calls(draw):
    """Arguments of ``redistribute``: a random batch (tool-output holes, any reward range, outcomes outside it,
    all-equal groups, shaped scores, a prior concordance window) and settings."""
    width, max_segments = draw(st.sampled_from([(12, 5), (40, 12)]))
    scores, mask, index, ends, raw = draw(batches(width, max_segments, any_float_scores=draw(st.booleans())))
    if draw(st.booleans()):  # binary outcomes: all-correct and all-wrong groups are common
        scores = (scores > 0.5).to(scores.dtype)
    for i in range(len(scores)):
        present = int((ends[i] >= 0).sum())
        damage = draw(st.integers(0, 14))
        if present and damage == 0:  # a probe value the redistribution cannot read
            raw[i, draw(st.integers(0, present - 1))] = draw(st.sampled_from([float("nan"), float("inf")]))
        elif present and damage == 1 and ends[i, present - 1] > (ends[i, present - 2] if present > 1 else 0) + 1:
            ends[i, present - 1] -= 1  # the segments stop short of the response's end
    if draw(st.booleans()):
        lengths = mask.sum(1).long().tolist()
        rows = []
        for i, length in enumerate(lengths):
            holes = draw(st.lists(st.sampled_from([0, 0, 1, 3]), min_size=length, max_size=length))
            rows.append(_open_holes([int(e) for e in ends[i] if e >= 0], length, holes))
        holed = torch.zeros(len(rows), max([len(row) for row, _, _ in rows] + [1]), dtype=mask.dtype)
        for i, (row, _, full_ends) in enumerate(rows):
            holed[i, : len(row)] = torch.tensor(row, dtype=mask.dtype)
            ends[i, : len(full_ends)] = torch.tensor(full_ends, dtype=torch.int64)
        mask = holed
    low, high = draw(st.sampled_from([(0.0, 1.0), (-1.0, 1.0), (0.0, 10.0), (-5.0, -2.0)]))
    scores = low + (high - low) * scores
    if draw(st.integers(0, 9)) == 0:
        outside = draw(st.sampled_from([high + (high - low) / 2, float("nan")]))
        scores[draw(st.integers(0, len(scores) - 1))] = outside
    scores = scores.to(draw(st.sampled_from([torch.float32, torch.float64])))
    raw = raw.to(draw(st.sampled_from([torch.float32, torch.float64])))
    shaped = None
    if draw(st.booleans()):
        bonus = torch.tensor(draw(st.lists(st.sampled_from([0.0, 1 / 6, 0.5]), min_size=len(scores),
                                           max_size=len(scores))), dtype=scores.dtype)  # fmt: skip
        shaped = (scores + 0.6 * bonus * (high - scores)).clamp(low, high)
    comparisons = draw(st.integers(0, 200))
    prior = ConcordanceCounts(draw(st.integers(0, 2 * comparisons)) / 2, comparisons)
    return (scores, mask, index, ends, raw), dict(reward_range=(low, high), prior_concordance=prior,
                                                  shaped_scores=shaped)  # fmt: skip


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=redistribution_calls(), cfg=settings_combinations())
def test_rewritten_redistribution_equals_the_module_before_bit_for_bit(call, cfg):
    args, kwargs = call
    try:
        before = redistribute_before(*args, cfg, **kwargs)
    except ValueError as error:
        event("ValueError")
        with pytest.raises(ValueError) as raised:
            redistribute(*args, cfg, **kwargs)
        assert str(raised.value) == str(error)
        return
    after = redistribute(*args, cfg, **kwargs)
    for name in ("advantages", "returns", "values", "segment_rewards", "fallback", "interpolated"):
        assert _same_bits(getattr(after, name), getattr(before, name)), name
    assert list(after.metrics.items()) == list(before.metrics.items())
    assert after.concordance == before.concordance
    for name, value in after.metrics.items():  # what the examples reached (--hypothesis-show-statistics)
        if value and name.startswith(("fallback/", "affine_", "degenerate_groups_with", "uncredited")):
            event(name)
    event(f"value gate open: {after.metrics['value_gate_open']}")
    event(f"token bound bound: {after.metrics.get('token_bound_trace_frac', 0) > 0}")
    event(f"clip bound: {after.metrics.get('clipped_trace_frac', 0) > 0}")


def test_bad_probe_values_raise_the_same_error():
    scores, mask, index = torch.tensor([1.0, 0.0]), torch.ones(2, 4), np.array(["q", "q"], dtype=object)
    ends, raw = torch.tensor([[2, 4], [4, -1]]), torch.tensor([[0.2, 1.5, float("nan")], [0.3, 0.1, float("nan")]])
    cfg = RedistributionSettings()
    with pytest.raises(ValueError) as before:
        redistribute_before(scores, mask, index, ends, raw, cfg)
    with pytest.raises(ValueError) as after:
        redistribute(scores, mask, index, ends, raw, cfg)
    assert str(after.value) == str(before.value)
