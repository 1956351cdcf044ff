"""IBPO core: alignment, repair signal, shaped advantages (vs verl's real GRPO), references, prompts."""

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

from rredcot_verl.core.ibpo import (
    DEFAULT_REVISION_TEMPLATE,
    EMBEDDED_TASK_TEMPLATE,
    IBPOSettings,
    align_tokens,
    build_revision_prompt,
    divergence_point,
    engine_context_need,
    evaluate_repair,
    fits_engine,
    localisation_mask,
    plan_revisions,
    repair_metrics,
    repair_signal,
    revision_budget,
    select_references,
    shaped_advantages,
    stack_edited_masks,
)
from rredcot_verl.core.outcomes import correct_outcomes
from rredcot_verl.core.settings import settings_from_config
from rredcot_verl.integration.estimators import AdvantageBatch
from rredcot_verl.integration.estimators.ibpo import ibpo_advantage

torch.set_num_threads(1)


def ids(text: str) -> list[int]:
    """Character-level token ids: one token per character, as the embedded task's digits are."""
    return [ord(c) for c in text]


# ------------------------------------------------------------------ config


def test_config_defaults_are_the_transcribed_values():
    cfg = IBPOSettings()
    assert (cfg.shaping_weight, cfg.repair_bonus, cfg.num_references, cfg.max_edit_ratio) == (0.6, 0.5, 3, 0.5)
    assert cfg.rewrite_counts_as_repair is False and cfg.use_mask is True and cfg.aggregate == "mean"
    # length defaults: uncapped revisions, a repair budget that grows with the trace, the kept-prefix guard
    assert cfg.max_revisions is None and cfg.min_kept_prefix == 0.25
    assert (cfg.revision_length_factor, cfg.revision_slack_tokens) == (1.2, 128)
    assert IBPOSettings(max_edit_ratio=math.inf).max_edit_ratio == math.inf


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"aggregate": "median"}, "aggregate"),
        ({"shaping_weight": 2.0, "repair_bonus": 0.5}, "outrank"),
        ({"shaping_weight": -0.1}, "shaping_weight"),
        ({"repair_bonus": float("nan")}, "repair_bonus"),
        ({"num_references": 0}, "num_references"),
        ({"max_revisions": True}, "max_revisions"),
        ({"max_revisions": 0}, "max_revisions"),
        ({"revision_slack_tokens": 1.5}, "revision_slack_tokens"),
        ({"revision_length_factor": 0.9}, "revision_length_factor"),
        ({"revision_length_factor": float("inf")}, "revision_length_factor"),
        ({"min_kept_prefix": -0.1}, "min_kept_prefix"),
        ({"max_edit_ratio": 0.0}, "max_edit_ratio"),
        ({"max_edit_ratio": float("nan")}, "max_edit_ratio"),
        ({"epsilon": 0.0}, "epsilon"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        IBPOSettings(**kwargs)


# ------------------------------------------------------------------ alignment


@pytest.mark.parametrize(
    "trace, repair, edited, distance",
    [
        ([1, 2, 3, 4], [1, 2, 3, 4], [0, 0, 0, 0], 0),  # identical
        ([1, 2, 3, 4], [1, 9, 3, 4], [0, 1, 0, 0], 1),  # substitution
        ([1, 2, 3, 4], [1, 3, 4], [0, 1, 0, 0], 1),  # deletion
        ([1, 2, 3, 4], [1, 2, 7, 3, 4], [0, 0, 1, 0], 1),  # insertion between y_2 and y_3 marks y_3
        ([1, 2, 3], [0, 1, 2, 3], [1, 0, 0], 1),  # insertion before the first token marks it
        ([1, 2, 3], [1, 2, 3, 5, 6], [0, 0, 1], 2),  # appended at the end marks the last token
        ([1, 2, 3], [4, 5, 6, 7, 8], [1, 1, 1], 5),  # disjoint
        ([1, 2], [], [1, 1], 2),  # empty repair deletes everything
    ],
)
def test_align_tokens_on_crafted_sequences(trace, repair, edited, distance):
    result = align_tokens(trace, repair)
    assert result.edited_mask.dtype == torch.bool
    assert result.edited_mask.tolist() == [bool(x) for x in edited]
    assert result.distance == distance
    assert result.edit_ratio == pytest.approx(distance / len(trace))


def test_align_tokens_empty_trace_rule():
    both_empty = align_tokens([], [])
    assert both_empty.edited_mask.shape == (0,) and both_empty.distance == 0 and both_empty.edit_ratio == 0.0
    from_nothing = align_tokens([], [5, 6, 7])
    assert from_nothing.edited_mask.shape == (0,)
    assert from_nothing.distance == 3 and from_nothing.edit_ratio == 3.0  # a complete rewrite: ratio >= 1


def test_align_tokens_accepts_tensors_and_rejects_matrices():
    as_list = align_tokens([3, 1, 4, 1, 5], [3, 1, 5, 9])
    as_tensor = align_tokens(torch.tensor([3, 1, 4, 1, 5]), torch.tensor([3, 1, 5, 9]))
    assert torch.equal(as_list.edited_mask, as_tensor.edited_mask) and as_list.distance == as_tensor.distance
    with pytest.raises(ValueError, match="1-D"):
        align_tokens(torch.zeros(2, 3, dtype=torch.long), [1])


def test_alignment_localises_the_wrong_step_of_an_arithmetic_trace():
    # A correct re-solve of the embedded task repeats the trace's correct line and fixes the first wrong result
    # and what follows from it; the mask must sit on exactly those digits.
    trace = "<think>\n23+45=68\n68-17=52\n52+8=60\n</think>\n\\boxed{60}"
    repair = "<think>\n23+45=68\n68-17=51\n51+8=59\n</think>\n\\boxed{59}"
    result = align_tokens(ids(trace), ids(repair))
    assert result.edited_mask.tolist() == [a != b for a, b in zip(trace, repair)]  # substitutions only
    assert "".join(c for c, e in zip(trace, result.edited_mask.tolist()) if e) == "226060"
    assert not result.edited_mask[: trace.index("68-17=") + len("68-17=")].any()  # the correct prefix keeps credit
    assert result.distance == 6 and result.edit_ratio == pytest.approx(6 / len(trace))


def _levenshtein_reference(a: list[int], b: list[int]) -> int:
    # Test-only textbook DP, to check rapidfuzz's distance on integer sequences.
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def _is_subsequence(needle: list[int], haystack: list[int]) -> bool:
    it = iter(haystack)
    return all(any(x == y for y in it) for x in needle)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 4), max_size=12),
    st.lists(st.integers(0, 4), max_size=12),
)
def test_alignment_properties(trace, repair):
    result = align_tokens(trace, repair)
    assert result.distance == _levenshtein_reference(trace, repair)
    kept = [t for t, e in zip(trace, result.edited_mask.tolist()) if not e]
    assert _is_subsequence(kept, repair)  # unchanged tokens are really matched, in order
    assert bool(result.edited_mask.any()) == (result.distance > 0 and len(trace) > 0)
    assert int(result.edited_mask.sum()) <= result.distance


# ------------------------------------------------------------------ repair evaluation and φ


def test_evaluate_repair_failures_and_rewrites():
    cfg = IBPOSettings(revision_slack_tokens=1, max_edit_ratio=0.5)  # budget for 4 tokens: ceil(4.8) + 1 = 6
    trace = [1, 2, 3, 4]
    local = evaluate_repair(trace, [1, 2, 9, 4], verified_correct=True, truncated=False, cfg=cfg)
    assert local.correct and not local.rewrite and local.failure is None
    assert local.alignment.edited_mask.tolist() == [False, False, True, False]
    rewrite = evaluate_repair(trace, [7, 8, 9, 4], verified_correct=True, truncated=False, cfg=cfg)
    assert rewrite.correct and rewrite.rewrite and align_tokens(trace, [7, 8, 9, 4]).edit_ratio == 0.75
    # a rewrite is not aligned (nothing reads its mask), its kept prefix is known all the same
    assert rewrite.alignment is None and rewrite.kept_prefix == 0 and rewrite.trace_length == 4
    assert local.alignment.kept_prefix == local.kept_prefix == 2
    assert evaluate_repair(trace, [1] * 6, True, False, cfg).failure is None  # exactly the budget is allowed
    failed = []
    for repair, truncated, failure in [([], False, "empty"), ([1, 2, 9, 4], True, "truncated"), ([1] * 7, False, "too_long")]:
        failed.append(evaluate_repair(trace, repair, verified_correct=True, truncated=truncated, cfg=cfg))
        assert failed[-1].failure == failure and not failed[-1].correct
    # a trace whose repairs all failed that way gets no bonus, even though the verifier accepted them
    assert repair_signal(False, failed, cfg) == 0.0
    wrong = evaluate_repair(trace, [1, 2, 8, 4], verified_correct=False, truncated=False, cfg=cfg)
    assert not wrong.correct and wrong.failure is None
    # only a correct repair is aligned (nothing reads the others' alignment) or judged a rewrite
    assert all(e.alignment is None and not e.rewrite for e in [*failed, wrong])
    assert not evaluate_repair(trace, [7, 8, 9, 4], False, False, cfg).rewrite


def test_repair_signal_aggregation_and_rewrite_switch():
    cfg = IBPOSettings()  # ρ = 0.5, δ = 0.5, π = 0.25
    trace = [1, 2, 3, 4, 5, 6, 7, 8]
    local_ok = evaluate_repair(trace, [1, 2, 3, 4, 5, 6, 7, 9], True, False, cfg)
    wrong = evaluate_repair(trace, [1, 2, 3, 4, 5, 6, 7, 0], False, False, cfg)
    rewrite_ok = evaluate_repair(trace, [9, 9, 9, 9, 9, 9, 7, 8], True, False, cfg)  # ratio 0.75, no kept prefix
    assert not local_ok.rewrite and rewrite_ok.rewrite
    assert repair_signal(True, [local_ok, local_ok], cfg) == 0.0  # correct traces are never shaped
    assert repair_signal(False, [], cfg) == 0.0  # no revision generated: GRPO treatment
    assert repair_signal(False, [local_ok, wrong, local_ok], cfg) == pytest.approx(0.5 * 2 / 3)
    assert repair_signal(False, [local_ok, wrong, wrong], IBPOSettings(aggregate="max")) == 0.5
    # the third repair is a verified rewrite: no credit by default, credit with the switch
    assert repair_signal(False, [local_ok, wrong, rewrite_ok], cfg) == pytest.approx(0.5 / 3)
    switched = IBPOSettings(rewrite_counts_as_repair=True)
    assert repair_signal(False, [local_ok, wrong, rewrite_ok], switched) == pytest.approx(1.0 / 3)


def test_localisation_mask_prefers_the_most_local_successful_repair():
    cfg = IBPOSettings(rewrite_counts_as_repair=True)
    trace = [1, 2, 3, 4, 5, 6]
    evaluations = [
        evaluate_repair(trace, [1, 9, 9, 4, 5, 6], True, False, cfg),  # 2 edits
        evaluate_repair(trace, [1, 2, 3, 4, 5, 7], False, False, cfg),  # 1 edit but wrong
        evaluate_repair(trace, [1, 2, 3, 4, 9, 6], True, False, cfg),  # 1 edit, correct: the winner
        evaluate_repair(trace, [9, 9, 9, 9, 9, 6], True, False, cfg),  # rewrite: never localises
    ]
    assert localisation_mask(evaluations, len(trace)).tolist() == [False] * 4 + [True, False]
    assert not localisation_mask([evaluations[1], evaluations[3]], len(trace)).any()
    assert localisation_mask([], 3).tolist() == [False] * 3
    with pytest.raises(ValueError, match="expected 5"):
        localisation_mask(evaluations, 5)


def test_repair_metrics_counts():
    cfg = IBPOSettings()
    trace = [1, 2, 3, 4]
    evaluations = [
        evaluate_repair(trace, [1, 2, 9, 4], True, False, cfg),  # local success, ratio 0.25
        evaluate_repair(trace, [7, 8, 9, 4], True, False, cfg),  # verified rewrite, ratio 0.75
        evaluate_repair(trace, [1, 2, 8, 4], False, False, cfg),
        evaluate_repair(trace, [], True, False, cfg),
        evaluate_repair(trace, [1, 2, 9, 4], True, True, cfg),
    ]
    metrics = repair_metrics(evaluations)
    assert metrics["ibpo/revisions"] == 5.0
    assert metrics["ibpo/repair_success_rate"] == pytest.approx(2 / 5)
    assert metrics["ibpo/local_repair_rate"] == pytest.approx(1 / 5)
    assert metrics["ibpo/rewrite_frac"] == pytest.approx(0.5)
    assert metrics["ibpo/local_edit_ratio_mean"] == pytest.approx(0.25)  # the rewrite's ratio is not computed
    assert metrics["ibpo/kept_prefix_frac_mean"] == pytest.approx((2 / 4 + 0) / 2)
    assert (metrics["ibpo/failed_empty"], metrics["ibpo/failed_truncated"], metrics["ibpo/failed_too_long"]) == (1, 1, 0)
    assert all(v == 0.0 for k, v in repair_metrics([]).items())


# ------------------------------------------------------------------ shaped advantages


def _group_of_four(lengths=(4, 4, 4, 4), T=5):
    response_mask = torch.zeros(4, T)
    for row, n in enumerate(lengths):
        response_mask[row, :n] = 1
    return response_mask, np.array(["q"] * 4, dtype=object)


def test_all_wrong_group_with_two_repairs_hand_computed():
    cfg = IBPOSettings()  # λ = 0.6, ρ = 0.5
    response_mask, index = _group_of_four(lengths=(4, 3, 4, 2))
    scores = torch.zeros(4, dtype=torch.float64)
    phi = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)  # traces 0 and 1: every repair succeeded
    edited = torch.zeros(4, 5, dtype=torch.bool)
    edited[0, 2] = True  # trace 0's repair changed token 2; trace 1 has no mask (say, only rewrites succeeded)

    result = shaped_advantages(scores, response_mask, index, phi, edited, cfg)

    # R' = (0.3, 0.3, 0, 0); mean 0.15; unbiased std sqrt(4 * 0.15² / 3) = sqrt(0.03)
    assert result.shaped_rewards.tolist() == pytest.approx([0.3, 0.3, 0.0, 0.0])
    a = 0.15 / (math.sqrt(0.03) + 1e-6)
    expected = torch.tensor(
        [
            [a, a, 0.0, a, 0.0],  # Â' > 0 on an incorrect trace: only its unchanged tokens get it
            [a, a, a, 0.0, 0.0],  # repaired but no localisation: broadcast
            [-a, -a, -a, -a, 0.0],  # unrepairable: broadcast
            [-a, -a, 0.0, 0.0, 0.0],
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(result.advantages, expected, rtol=0, atol=1e-12)
    assert result.metrics["ibpo/all_wrong_groups"] == 1.0
    assert result.metrics["ibpo/all_wrong_groups_with_signal_frac"] == 1.0
    assert result.metrics["ibpo/incorrect_repaired_frac"] == 0.5
    assert result.metrics["ibpo/masked_traces"] == 1.0 and result.metrics["ibpo/masked_positive_traces"] == 1.0
    assert result.metrics["ibpo/broadcast_repaired_traces"] == 1.0
    assert result.metrics["ibpo/masked_token_frac"] == pytest.approx(3 / 4)

    # plain GRPO (λ = 0) has nothing to say about the same group
    grpo = shaped_advantages(scores, response_mask, index, phi, edited, IBPOSettings(shaping_weight=0.0))
    assert not grpo.advantages.any() and grpo.metrics["ibpo/all_wrong_groups_with_signal_frac"] == 0.0


def test_mask_sign_rule_in_a_mixed_group():
    cfg = IBPOSettings()
    response_mask, index = _group_of_four()
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    phi = torch.tensor([0.0, 0.5, 0.0, 0.0], dtype=torch.float64)
    edited = torch.zeros(4, 5, dtype=torch.bool)
    edited[0, 0] = True  # a mask on a correct trace is ignored: correct traces keep the broadcast
    edited[1, 1:3] = True
    result = shaped_advantages(scores, response_mask, index, phi, edited, cfg)

    shaped = [1.0, 0.3, 0.0, 0.0]
    mean = sum(shaped) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in shaped) / 3)
    norm = [(r - mean) / (std + 1e-6) for r in shaped]
    assert norm[1] < 0  # the repaired failure still sits below the group mean
    expected = torch.tensor(
        [
            [norm[0]] * 4 + [0.0],
            [0.0, norm[1], norm[1], 0.0, 0.0],  # Â' < 0: only on the tokens the repair had to change
            [norm[2]] * 4 + [0.0],
            [norm[3]] * 4 + [0.0],
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(result.advantages, expected, rtol=0, atol=1e-12)
    assert result.metrics["ibpo/masked_traces"] == 1.0 and result.metrics["ibpo/masked_positive_traces"] == 0.0

    shaping_only = shaped_advantages(scores, response_mask, index, phi, edited, IBPOSettings(use_mask=False))
    torch.testing.assert_close(shaping_only.advantages, torch.tensor(norm, dtype=torch.float64)[:, None] * response_mask)
    assert shaping_only.metrics["ibpo/broadcast_repaired_traces"] == 1.0


def _random_batch(rng: np.random.Generator):
    n_groups = int(rng.integers(1, 6))
    sizes = rng.integers(1, 6, size=n_groups)  # includes groups of one
    index = np.array([f"uid-{g}" for g, size in enumerate(sizes) for _ in range(size)], dtype=object)
    rng.shuffle(index)  # verl does not promise contiguous groups
    bs, T = len(index), int(rng.integers(1, 9))
    lengths = rng.integers(1, T + 1, size=bs)
    response_mask = torch.tensor(np.arange(T)[None, :] < lengths[:, None], dtype=torch.float32)
    if rng.random() < 0.5:
        outcome = torch.tensor(rng.integers(0, 2, size=bs), dtype=torch.float32)
    else:
        outcome = torch.tensor(rng.normal(size=bs), dtype=torch.float32)
    # verl sums a token-level reward placed on the last response token
    token_level_rewards = torch.zeros(bs, T)
    token_level_rewards[torch.arange(bs), torch.tensor(lengths - 1)] = outcome
    return index, response_mask, token_level_rewards


@pytest.mark.parametrize("seed", range(40))
def test_lambda_zero_matches_verl_grpo_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    index, response_mask, token_level_rewards = _random_batch(rng)
    bs, T = response_mask.shape
    norm_by_std = bool(seed % 2)
    epsilon = float(rng.choice([1e-6, 1e-3]))
    verl_adv, _ = compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon=epsilon, norm_adv_by_std_in_grpo=norm_by_std
    )
    scores = token_level_rewards.sum(dim=-1)
    # repairs exist only for incorrect traces (outcome below 1, the top of the default reward range)
    phi = torch.tensor(rng.uniform(0, 0.5, size=bs), dtype=torch.float32) * ~correct_outcomes(scores)
    edited = torch.tensor(rng.random((bs, T)) < 0.4) & response_mask.bool()
    for cfg, masks in [
        (IBPOSettings(shaping_weight=0.0, epsilon=epsilon, norm_adv_by_std=norm_by_std, use_mask=False), edited),
        (IBPOSettings(shaping_weight=0.0, epsilon=epsilon, norm_adv_by_std=norm_by_std), None),
    ]:
        ours = shaped_advantages(scores, response_mask, index, phi, masks, cfg).advantages
        assert ours.dtype == verl_adv.dtype and torch.equal(ours, verl_adv)

    # with λ > 0 and no mask, IBPO is verl's GRPO run on the shaped rewards R' = R + λφ(1 − R)
    shaping = IBPOSettings(epsilon=epsilon, norm_adv_by_std=norm_by_std, use_mask=False)
    result = shaped_advantages(scores, response_mask, index, phi, None, shaping)
    shaped_token_rewards = token_level_rewards.clone()
    shaped_token_rewards[:, 0] += shaping.shaping_weight * phi * (1 - scores)  # verl sums rows; any slot carries R'
    verl_shaped, _ = compute_grpo_outcome_advantage(
        shaped_token_rewards, response_mask, index, epsilon=epsilon, norm_adv_by_std_in_grpo=norm_by_std
    )
    torch.testing.assert_close(result.advantages, verl_shaped, rtol=0, atol=1e-6)


def test_groups_of_one_fall_back_to_grpo_and_are_counted():
    cfg = IBPOSettings()
    response_mask = torch.ones(2, 3)
    index = np.array(["a", "b"], dtype=object)
    result = shaped_advantages(torch.tensor([0.0, 1.0]), response_mask, index, torch.zeros(2), None, cfg)
    # verl's rule for a lone trace: mean 0, std 1, so the advantage is R / (1 + ε)
    torch.testing.assert_close(result.advantages, torch.tensor([[0.0] * 3, [1 / (1 + 1e-6)] * 3]))
    assert result.metrics["ibpo/singleton_groups"] == 2.0
    assert all(math.isfinite(v) for v in result.metrics.values())


def test_shaped_advantages_rejects_bad_input():
    cfg = IBPOSettings()
    mask = torch.ones(2, 3)
    index = np.array(["a", "a"], dtype=object)
    phi = torch.zeros(2)
    with pytest.raises(ValueError, match=r"non-finite outcome rewards at batch rows \[1\]"):
        shaped_advantages(torch.tensor([0.0, float("nan")]), mask, index, phi, None, cfg)
    with pytest.raises(ValueError, match="float"):
        shaped_advantages(torch.tensor([0, 1]), mask, index, phi, None, cfg)
    with pytest.raises(ValueError, match="phi"):
        shaped_advantages(torch.zeros(2), mask, index, torch.tensor([0.0, -0.1]), None, cfg)
    with pytest.raises(ValueError, match="phi"):
        shaped_advantages(torch.zeros(2), mask, index, torch.tensor([float("nan"), 0.0]), None, cfg)
    with pytest.raises(ValueError, match=r"correct traces .* rows \[1\]"):
        shaped_advantages(torch.tensor([0.0, 1.0]), mask, index, torch.tensor([0.5, 0.5]), None, cfg)
    with pytest.raises(ValueError, match="reward_range"):
        shaped_advantages(torch.zeros(2), mask, index, phi, None, cfg, reward_range=(1.0, 1.0))
    with pytest.raises(ValueError, match="index"):
        shaped_advantages(torch.zeros(2), mask, index[:1], phi, None, cfg)
    with pytest.raises(ValueError, match="bool"):
        shaped_advantages(torch.zeros(2), mask, index, phi, torch.zeros(2, 3), cfg)
    short = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    outside = torch.zeros(2, 3, dtype=torch.bool)
    outside[0, 2] = True
    with pytest.raises(ValueError, match="outside response_mask"):
        shaped_advantages(torch.zeros(2), short, index, phi, outside, cfg)


def test_stack_edited_masks_pads_right():
    stacked = stack_edited_masks([torch.tensor([True, False]), torch.zeros(0, dtype=torch.bool)], 3)
    assert stacked.tolist() == [[True, False, False], [False, False, False]]
    with pytest.raises(ValueError, match="at most 3"):
        stack_edited_masks([torch.ones(4, dtype=torch.bool)], 3)


# ------------------------------------------------------------------ references and planning


def test_select_references_order_and_edge_cases():
    outcomes = [False, True, False, True, False]
    for seed in range(20):
        refs = select_references(outcomes, 0, 3, np.random.default_rng(seed))
        assert 0 not in refs and len(refs) == 3
        assert set(refs[:2]) == {1, 3} and refs[2] in {2, 4}  # correct siblings first
    firsts = {select_references(outcomes, 0, 1, np.random.default_rng(seed))[0] for seed in range(20)}
    assert firsts == {1, 3}  # ties are broken at random, not by position
    assert select_references([False], 0, 3, np.random.default_rng(0)) == []
    assert sorted(select_references(torch.tensor([0, 0, 0]), 1, 5, np.random.default_rng(0))) == [0, 2]
    responses = [[1, 2], [1, 2], [3], [1, 2]]
    assert select_references([False, True, False, True], 0, 3, np.random.default_rng(0), responses) == [2]
    with pytest.raises(ValueError, match="outside the group"):
        select_references(outcomes, 5, 1, np.random.default_rng(0))


def test_plan_revisions_round_robin_cap_and_fallbacks():
    correct = [False, False, True, False, True, False]
    index = np.array(["a", "a", "a", "b", "b", "lone"], dtype=object)
    full = plan_revisions(correct, index, IBPOSettings(num_references=2), np.random.default_rng(0))
    assert full.incorrect_traces == 4 and full.traces_without_reference == 1
    assert full.skipped_by_cap == 0 and full.traces_skipped_by_cap == 0
    assert len(full.pairs) == 5  # traces 0 and 1 get two references each, trace 3 has one sibling
    assert {(0, 2), (1, 2), (3, 4)} == set(full.pairs[:3])  # every first reference (a correct one) comes first
    assert all(index[t] == index[r] and t != r and not correct[t] for t, r in full.pairs)

    capped = plan_revisions(correct, index, IBPOSettings(num_references=2, max_revisions=3), np.random.default_rng(0))
    assert sorted(capped.pairs) == [(0, 2), (1, 2), (3, 4)] and capped.skipped_by_cap == 2
    assert capped.traces_skipped_by_cap == 0  # the cap cost second references only
    with pytest.raises(ValueError, match="index"):
        plan_revisions(correct, index[:2], IBPOSettings(), np.random.default_rng(0))


def test_a_tight_cap_reaches_every_group_over_seeds_and_reports_what_it_skipped():
    # 12 groups of 4 with one correct trace: 36 incorrect traces, 108 candidate revisions, cap 20
    index = np.array([f"g{g}" for g in range(12) for _ in range(4)], dtype=object)
    correct = [k % 4 == 0 for k in range(48)]
    cfg = IBPOSettings(max_revisions=20)
    revised_groups = set()
    for seed in range(10):
        plan = plan_revisions(correct, index, cfg, np.random.default_rng(seed))
        traces = [t for t, _ in plan.pairs]
        assert len(plan.pairs) == 20 and len(set(traces)) == 20  # no trace gets a second before all get a first
        assert all(correct[r] for _, r in plan.pairs)  # first references are the correct siblings
        assert plan.skipped_by_cap == 108 - 20 and plan.traces_skipped_by_cap == 36 - 20
        revised_groups |= {index[t] for t in traces}
    assert revised_groups == set(index)  # random order within a rank: late groups are not always dropped


def test_plan_revisions_replaces_references_whose_prompt_does_not_fit():
    correct = [False, True, False, False, False]
    index = np.array(["a", "a", "a", "a", "b"], dtype=object)
    long_reference = 1  # say, a 20k-token correct sibling that cannot fit beside the trace
    calls = []

    def usable(trace, reference):
        calls.append((trace, reference))
        return reference != long_reference

    plan = plan_revisions(correct, index, IBPOSettings(num_references=2), np.random.default_rng(0), usable=usable)
    assert all(r != long_reference for _, r in plan.pairs)
    assert sorted(t for t, _ in plan.pairs) == [0, 0, 2, 2, 3, 3]  # each still gets two references
    assert plan.rejected_pairs == 3 and plan.traces_without_usable_reference == 0
    assert plan.traces_without_reference == 1  # trace 4 is alone
    assert all(c[0] in (0, 2, 3) for c in calls)  # usable is asked about incorrect traces only
    nothing_fits = plan_revisions(correct, index, IBPOSettings(), np.random.default_rng(0), usable=lambda t, r: False)
    assert nothing_fits.pairs == [] and nothing_fits.traces_without_usable_reference == 3


# ------------------------------------------------------------------ prompts


def test_default_revision_prompt_contains_the_parts_in_order():
    prompt = build_revision_prompt("What is {x}+1?", "A says 3 {braces}", "B says 4")
    positions = [prompt.index(part) for part in ("What is {x}+1?", "A says 3 {braces}", "B says 4")]
    assert positions == sorted(positions)
    assert "minimal local fixes" in prompt and prompt.startswith(DEFAULT_REVISION_TEMPLATE[:40])


def test_embedded_template_is_the_bare_question_and_bad_templates_fail():
    assert build_revision_prompt("Compute 23+45\n", "t", "r", EMBEDDED_TASK_TEMPLATE) == "Compute 23+45\n"
    with pytest.raises(ValueError, match="question"):
        build_revision_prompt("q", "t", "r", "fix {trace}")
    with pytest.raises(ValueError, match="unknown placeholder"):
        build_revision_prompt("q", "t", "r", "{question} {answer}")



def test_revision_budget_grows_with_the_trace_and_bounds_the_prompt():
    cfg = IBPOSettings()
    assert revision_budget(0, cfg) == 128 and revision_budget(2000, cfg) == 2528
    assert revision_budget(25_000, cfg) == 30_128
    # the prompt budget is the engine's context minus the repair budget, not data.max_prompt_length
    budget = revision_budget(2000, cfg)
    assert fits_engine(32_768 - 2528, budget, 32_768) and not fits_engine(32_768 - 2527, budget, 32_768)
    assert not fits_engine(0, revision_budget(25_000, cfg), 16_384)  # the repair alone does not fit the engine
    assert not fits_engine(10, 0, 16_384)  # no room to generate: a resumed trace that used its whole budget
    with pytest.raises(ValueError, match="max_model_length"):
        fits_engine(1, 1, 0)
    with pytest.raises(ValueError, match="trace_length"):
        revision_budget(-1, cfg)


# ------------------------------------------------------------------ repair operators


def test_repair_operator_defaults_to_resume_and_refuses_unknown_values_and_a_template():
    assert IBPOSettings().repair_operator == "resume"
    with pytest.raises(ValueError, match=r"repair_operator must be one of \('resume', 'rewrite'\), got 'resum'"):
        IBPOSettings(repair_operator="resum")
    # the template is the rewrite's prompt: with resume it would be silently unused
    with pytest.raises(ValueError, match="revision_template is the rewrite operator's prompt"):
        IBPOSettings(revision_template=EMBEDDED_TASK_TEMPLATE)
    assert IBPOSettings(repair_operator="rewrite", revision_template=EMBEDDED_TASK_TEMPLATE).revision_template


@pytest.mark.parametrize(
    "trace, reference, point",
    [
        ([1, 2, 3, 4], [1, 2, 9, 4], 2),  # the first differing token
        ([1, 2, 3, 4], [7, 2, 3, 4], 0),  # nothing shared: a fresh solve
        ([1, 2], [1, 2, 3, 4], 2),  # the trace is a prefix of the reference: all of it is kept
        ([1, 2, 3, 4], [1, 2], 2),
        ([], [1], 0),
    ],
)
def test_divergence_point_is_the_longest_common_prefix(trace, reference, point):
    assert divergence_point(trace, reference) == point


@pytest.mark.parametrize("operator, need", [("resume", 1024 + 25_000), ("rewrite", 1024 + 2 * 25_000 + 30_128)])
def test_engine_context_need_per_operator(operator, need):
    assert engine_context_need(1024, 25_000, IBPOSettings(repair_operator=operator)) == need


def test_a_resumed_repair_edits_nothing_before_its_divergence_point():
    """The embedded task's traces at character level: a correct sibling shares every correct line of the failed
    trace, so the repair resumes at the first wrong digit, and the mask, φ and advantage start there."""
    cfg = IBPOSettings()
    trace = ids("23+45=68\n68-17=52\n\\boxed{52}")  # wrong in the second result
    reference = ids("23+45=68\n68-17=51\n\\boxed{51}")
    k = divergence_point(trace, reference)
    assert k == 16  # "23+45=68\n68-17=5" kept: it resumes at the wrong "2"
    continuation = ids("1\n\\boxed{51}")
    evaluation = evaluate_repair(trace, trace[:k] + continuation, True, False, cfg, max_repair_tokens=len(trace) + 8)
    assert evaluation.correct and not evaluation.rewrite and evaluation.alignment.kept_prefix == k
    edited = torch.nonzero(evaluation.alignment.edited_mask).flatten().tolist()
    assert edited[0] == k and [chr(trace[i]) for i in edited] == ["2", "2"]  # the wrong digit and its copy
    assert repair_signal(False, [evaluation], cfg) == 0.5
    # in a group with a correct sibling the repaired failure is below the mean: blame on the edited tokens only
    T = len(trace)
    result = shaped_advantages(
        torch.tensor([0.0, 1.0]), torch.ones(2, T), np.array(["q", "q"], dtype=object), torch.tensor([0.5, 0.0]),
        stack_edited_masks([localisation_mask([evaluation], T), torch.zeros(T, dtype=torch.bool)], T), cfg,
    )  # fmt: skip
    assert torch.nonzero(result.advantages[0]).flatten().tolist() == edited and (result.advantages[0, edited] < 0).all()
    # a repair past the response budget (kept prefix + continuation) fails whatever the verifier says
    assert evaluate_repair(trace, trace[:k] + continuation, True, False, cfg, max_repair_tokens=k + 3).failure == (
        "too_long"
    )


@settings(max_examples=300, deadline=None)
@given(
    trace=st.lists(st.integers(0, 2), min_size=1, max_size=40),
    continuation=st.lists(st.integers(0, 2), max_size=40),
    cut=st.integers(0, 40),
)
def test_a_resumed_repair_keeps_its_prefix_whatever_the_continuation(trace, continuation, cut):
    # A three-token vocabulary makes many equally cheap alignments; none may place an edit in the kept prefix (an
    # insertion after a fully kept trace marks its last token, the documented end-of-trace rule).
    k = min(cut, len(trace))
    assume(k + len(continuation) > 0)  # an empty repair is a failure, not aligned
    alignment = align_tokens(trace, trace[:k] + continuation)
    kept = k if k < len(trace) else k - 1
    assert not alignment.edited_mask[:kept].any() and alignment.kept_prefix >= kept
    evaluation = evaluate_repair(trace, trace[:k] + continuation, True, False, IBPOSettings(), 10**6)
    assert evaluation.kept_prefix == alignment.kept_prefix  # the rewrite guard's, read without aligning


def test_a_resumed_repair_from_the_opening_is_judged_a_fresh_solve_at_length():
    # Two free-form samples share only their opening: resumed from there, a verified repair rewrites the rest and
    # says nothing about how close the trace was (the rewrite guard); resumed from 40% of the trace it is local.
    rng = np.random.default_rng(4)
    opening = _long_trace(rng, 40)
    trace, reference = opening + _long_trace(rng, 1960), opening + _long_trace(rng, 2100)
    cfg = IBPOSettings()
    k = divergence_point(trace, reference)
    fresh = evaluate_repair(trace, trace[:k] + _long_trace(rng, 1800), True, False, cfg, max_repair_tokens=25_000)
    assert k == 40 and fresh.correct and fresh.rewrite and repair_signal(False, [fresh], cfg) == 0.0
    local = evaluate_repair(trace, trace[:800] + _long_trace(rng, 1300), True, False, cfg, max_repair_tokens=25_000)
    assert not local.rewrite and not local.alignment.edited_mask[:800].any()
    assert localisation_mask([local], 2000)[800:].any()


# ------------------------------------------------------------------ one step end to end


def test_one_step_from_repairs_to_token_credit():
    """Four wrong traces of one arithmetic problem; two are repaired locally, one only by a rewrite."""
    cfg = IBPOSettings()
    traces = [
        "23+45=68\n68-17=52\n\\boxed{52}",  # wrong in the second result
        "23+45=69\n69-17=52\n\\boxed{52}",  # wrong in the first result
        "no idea\n\\boxed{60}",  # nothing to keep: only a rewrite fixes it
        "23+45=68\n68-17=50\n\\boxed{50}",  # no repair succeeds
    ]
    solution = "23+45=68\n68-17=51\n\\boxed{51}"
    attempts = {0: [(solution, True)], 1: [(solution, True), ("23+45=68\n68-17=52\n\\boxed{52}", False)],
                2: [(solution, True)], 3: [("23+45=68\n68-17=49\n\\boxed{49}", False)]}
    T = max(len(t) for t in traces)
    phi, masks, all_evals = [], [], []
    for i, trace in enumerate(traces):
        evals = [evaluate_repair(ids(trace), ids(text), ok, False, cfg) for text, ok in attempts[i]]
        all_evals += evals
        phi.append(repair_signal(False, evals, cfg))
        masks.append(localisation_mask(evals, len(trace)))
    # trace 2's success is a rewrite (ratio > 0.5 and no kept prefix), so it earns nothing
    assert phi == [0.5, 0.25, 0.0, 0.0]
    response_mask = torch.tensor([[1.0] * len(t) + [0.0] * (T - len(t)) for t in traces])
    result = shaped_advantages(
        torch.zeros(4), response_mask, np.array(["q"] * 4, dtype=object), torch.tensor(phi), stack_edited_masks(masks, T), cfg
    )
    adv = result.advantages
    # trace 0 sits above the group mean: credit on its unchanged tokens, never on the wrong digit '2' or its copy
    wrong_positions = [i for i, e in enumerate(masks[0].tolist()) if e]
    assert [traces[0][i] for i in wrong_positions] == ["2", "2"]
    assert (adv[0, wrong_positions] == 0).all() and (adv[0, : len(traces[0])].sum() > 0)
    # traces 2 and 3 are below the mean with no localisation: negative on every token
    assert (adv[2, : len(traces[2])] < 0).all() and (adv[3, : len(traces[3])] < 0).all()
    assert repair_metrics(all_evals)["ibpo/rewrite_frac"] == pytest.approx(1 / 3)


def test_stopping_after_a_wrong_first_result_is_repaired_locally():
    # Changed with the kept-prefix guard: the repair keeps "23+45=6" (7 of 19 tokens, over π = 0.25) and continues
    # from the wrong digit, so it is a repair of that digit even though it edits more than half of the trace.
    trace, repair = ids("23+45=60\n\\boxed{60}"), ids("23+45=68\n68-17=51\n\\boxed{51}")
    evaluation = evaluate_repair(trace, repair, True, False, IBPOSettings())
    assert evaluation.alignment.edit_ratio > 0.5 and evaluation.alignment.kept_prefix == 7
    assert not evaluation.rewrite and evaluation.alignment.edited_mask[7]  # the wrong digit carries the blame
    assert not evaluation.alignment.edited_mask[:7].any()
    assert evaluate_repair(trace, repair, True, False, IBPOSettings(min_kept_prefix=2.0)).rewrite  # ratio test only


# ------------------------------------------------------------------ traces at length


def _long_trace(rng: np.random.Generator, length: int = 2000, vocab: int = 5000) -> list[int]:
    return rng.integers(10, vocab, size=length).tolist()


def test_a_local_edit_of_a_2k_token_trace_is_a_localised_repair():
    """Before the length-aware budget (a fixed 128-token cap) this repair was a failure ("too_long"/truncated), and
    any repair of a trace over 256 tokens that fitted the cap was a rewrite: IBPO degraded to GRPO at length."""
    rng = np.random.default_rng(0)
    trace = _long_trace(rng)
    repair = list(trace)
    repair[1200:1212] = rng.integers(5000, 6000, size=15).tolist()  # a 12-token step rewritten as 15 tokens
    cfg = IBPOSettings()
    evaluation = evaluate_repair(trace, repair, True, False, cfg)
    assert evaluation.failure is None and evaluation.correct and not evaluation.rewrite
    assert evaluation.alignment.kept_prefix == 1200
    edited = torch.nonzero(evaluation.alignment.edited_mask).flatten().tolist()
    assert edited[0] == 1200 and edited[-1] <= 1212 and len(edited) >= 12  # only the rewritten step
    assert repair_signal(False, [evaluation], cfg) == 0.5

    # through the estimator arithmetic: a repaired trace below its group mean is blamed on those tokens only
    T = 2000
    scores = torch.tensor([0.0, 1.0, 1.0, 0.0])
    phi = torch.tensor([0.5, 0.0, 0.0, 0.0])
    masks = stack_edited_masks([localisation_mask([evaluation], T)] + [torch.zeros(T, dtype=torch.bool)] * 3, T)
    result = shaped_advantages(scores, torch.ones(4, T), np.array(["q"] * 4, dtype=object), phi, masks, cfg)
    nonzero = torch.nonzero(result.advantages[0]).flatten().tolist()
    assert nonzero == edited and (result.advantages[0, edited] < 0).all()
    assert (result.advantages[3] < 0).all()  # the unrepaired failure keeps the broadcast


def test_a_repair_that_keeps_the_prefix_and_rewrites_the_tail_is_local_at_length():
    # A faithful repair of an error at 40% of a 2k trace: verbatim up to the error, a new tail after it. Its edit
    # ratio is far over δ = 0.5, yet it is the repair IBPO wants; the kept prefix (800 ≥ 0.25 · 2000) says so.
    rng = np.random.default_rng(1)
    trace = _long_trace(rng)
    repair = trace[:800] + _long_trace(rng, 1300)
    evaluation = evaluate_repair(trace, repair, True, False, IBPOSettings())
    assert evaluation.alignment.edit_ratio > 0.5 and evaluation.alignment.kept_prefix == 800
    assert not evaluation.rewrite and not evaluation.alignment.edited_mask[:800].any()
    assert evaluation.alignment.edited_mask[800:].float().mean() > 0.5


def test_a_copy_of_the_reference_is_a_rewrite_at_length():
    # Two samples of one prompt share their opening (here 40 tokens restating the problem) and little else; a
    # "repair" that copies the reference keeps no more of the trace than that, so it earns no φ and no mask.
    rng = np.random.default_rng(2)
    opening = _long_trace(rng, 40)
    trace = opening + _long_trace(rng, 1960)
    reference = opening + _long_trace(rng, 2100)
    cfg = IBPOSettings()
    copy = evaluate_repair(trace, reference, True, False, cfg)
    assert copy.correct and copy.rewrite and copy.kept_prefix == 40 and copy.alignment is None
    assert repair_signal(False, [copy], cfg) == 0.0 and not localisation_mask([copy], 2000).any()
    assert repair_signal(False, [copy], IBPOSettings(rewrite_counts_as_repair=True)) == 0.5


def test_a_repair_longer_than_its_budget_fails_at_length():
    rng = np.random.default_rng(3)
    trace = _long_trace(rng)
    cfg = IBPOSettings()
    too_long = trace + _long_trace(rng, revision_budget(2000, cfg) - 2000 + 1)
    assert evaluate_repair(trace, too_long, True, False, cfg).failure == "too_long"
    assert evaluate_repair(trace, too_long[:-1], True, False, cfg).failure is None
    assert evaluate_repair(trace, trace[:1500], True, True, cfg).failure == "truncated"


# ------------------------------------------------------- reward scales, through the estimator's advantage function


def _ibpo_advantage(outcomes, phi, edited, reward_range, use_mask=True):
    """``ibpo``'s advantage function (the one the trainer calls) on the settings verl's config gives."""
    bs, T = edited.shape
    settings = settings_from_config({"norm_adv_by_std_in_grpo": True,
                                     "rredcot": {"reward_range": list(reward_range), "ibpo": {"use_mask": use_mask}}})
    batch = AdvantageBatch(scores=torch.tensor(outcomes), response_mask=torch.ones(bs, T),
                           index=np.array(["q"] * bs, dtype=object), phi=torch.tensor(phi), edited_mask=edited)
    result = ibpo_advantage(batch, settings)
    return result.advantages, result.metrics


def _grpo_on(shaped, T):
    rewards = torch.zeros(len(shaped), T)
    rewards[:, -1] = torch.tensor(shaped)
    advantages, _ = compute_grpo_outcome_advantage(rewards, torch.ones(len(shaped), T), np.array(["q"] * len(shaped)))
    return advantages


def test_ibpo_reward_scale_plus_minus_one():
    # −1/+1: a wrong trace is −1; a repaired one moves by λφ(high − R) = 0.6 · 0.5 · 2 = 0.6, to −0.4 < +1
    outcomes, phi = [1.0, -1.0, -1.0, -1.0], [0.0, 0.5, 0.0, 0.0]
    edited = torch.zeros(4, 5, dtype=torch.bool)
    edited[1, 2] = True
    shaping_only, _ = _ibpo_advantage(outcomes, phi, edited, (-1.0, 1.0), use_mask=False)
    torch.testing.assert_close(shaping_only, _grpo_on([1.0, -0.4, -1.0, -1.0], 5))
    masked, metrics = _ibpo_advantage(outcomes, phi, edited, (-1.0, 1.0))
    assert masked[0, 0] > 0 > masked[1, 2] > masked[2, 0]  # correct > repaired > hopeless
    assert masked[1].ne(0).tolist() == [False, False, True, False, False]  # blame on the edited token only
    assert metrics["ibpo/incorrect_repaired_frac"] == pytest.approx(1 / 3)
    # on the 0/1 reading, −1 and +1 would both sit outside the scale and the +1 trace would be shaped: refused
    with pytest.raises(ValueError, match="correct traces"):
        _ibpo_advantage([1.0, -1.0], [0.5, 0.0], torch.zeros(2, 3, dtype=torch.bool), (-1.0, 1.0))


def test_ibpo_reward_scale_partial_credit():
    # {0, 0.5, 1}: partial credit is incorrect (below high), so it can be repaired, shaped and masked
    outcomes, phi = [1.0, 0.5, 0.5, 0.0], [0.0, 0.5, 0.0, 0.5]
    edited = torch.zeros(4, 5, dtype=torch.bool)
    edited[1, 1] = True
    shaped = [1.0, 0.5 + 0.3 * 0.5, 0.5, 0.0 + 0.3 * 1.0]  # R + λφ(1 − R)
    shaping_only, _ = _ibpo_advantage(outcomes, phi, edited, (0.0, 1.0), use_mask=False)
    torch.testing.assert_close(shaping_only, _grpo_on(shaped, 5))
    order = shaping_only[:, 0].tolist()
    assert order[0] > order[1] > order[2] > order[3]  # correct > repaired partial > partial > repaired wrong
    masked, metrics = _ibpo_advantage(outcomes, phi, edited, (0.0, 1.0))
    # the repaired partial trace sits above the group mean: credit only on the tokens its repair kept
    assert masked[1].ne(0).tolist() == [True, False, True, True, True] and masked[1, 0] > 0
    assert metrics["ibpo/masked_traces"] == 1.0 and metrics["ibpo/incorrect_repaired_frac"] == pytest.approx(2 / 3)


@settings(max_examples=200, deadline=None)
@given(
    st.floats(-10, 10),
    st.floats(0.01, 20),
    st.floats(0, 0.999),
    st.floats(0, 1),
)
def test_reward_scale_shaping_keeps_incorrect_below_correct(low, width, below, phi_share):
    # any scale, any incorrect outcome in it, any φ ≤ ρ: the shaped reward stays under the correct outcome
    high = low + width
    cfg = IBPOSettings()
    reward = low + below * width
    scores = torch.tensor([high, reward], dtype=torch.float64)
    if correct_outcomes(scores, (low, high))[1]:
        return  # within tolerance of high: correct, never shaped
    phi = torch.tensor([0.0, phi_share * cfg.repair_bonus], dtype=torch.float64)
    result = shaped_advantages(scores, torch.ones(2, 1), np.array(["q", "q"], dtype=object), phi, None, cfg, (low, high))
    assert result.shaped_rewards[1] < high and result.shaped_rewards[1] >= reward
    assert result.advantages[0, 0] > result.advantages[1, 0]


def test_correctness_is_reaching_the_top_of_the_scale():
    assert correct_outcomes(torch.tensor([1.0, 0.5, 0.0, 1.0 - 1e-9]), (0.0, 1.0)).tolist() == [True, False, False, True]
    assert correct_outcomes([1.0, -1.0, 0.0], (-1.0, 1.0)).tolist() == [True, False, False]
    with pytest.raises(ValueError, match="reward_range"):
        correct_outcomes([0.0], (1.0, 0.0))
