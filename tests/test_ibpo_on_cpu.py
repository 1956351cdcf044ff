"""IBPO core: alignment, repair signal, shaped advantages (vs verl's real GRPO), references, prompts."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

from rredcot_verl.ibpo import (
    DEFAULT_REVISION_TEMPLATE,
    EMBEDDED_TASK_TEMPLATE,
    IBPOConfig,
    align_tokens,
    build_revision_prompt,
    evaluate_repair,
    fits_prompt_budget,
    localisation_mask,
    plan_revisions,
    repair_metrics,
    repair_signal,
    select_references,
    shaped_advantages,
    stack_edited_masks,
)

torch.set_num_threads(1)


def ids(text: str) -> list[int]:
    """Character-level token ids: one token per character, as the embedded task's digits are."""
    return [ord(c) for c in text]


# ------------------------------------------------------------------ config


def test_config_defaults_are_the_transcribed_values():
    cfg = IBPOConfig()
    assert (cfg.shaping_weight, cfg.repair_bonus, cfg.num_references, cfg.max_edit_ratio) == (0.6, 0.5, 3, 0.5)
    assert cfg.rewrite_counts_as_repair is False and cfg.use_mask is True and cfg.aggregate == "mean"
    assert IBPOConfig(max_edit_ratio=math.inf).max_edit_ratio == math.inf


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"aggregate": "median"}, "aggregate"),
        ({"shaping_weight": 2.0, "repair_bonus": 0.5}, "outrank"),
        ({"shaping_weight": -0.1}, "shaping_weight"),
        ({"repair_bonus": float("nan")}, "repair_bonus"),
        ({"num_references": 0}, "num_references"),
        ({"max_revisions": True}, "max_revisions"),
        ({"max_revision_tokens": 1.5}, "max_revision_tokens"),
        ({"max_edit_ratio": 0.0}, "max_edit_ratio"),
        ({"max_edit_ratio": float("nan")}, "max_edit_ratio"),
        ({"epsilon": 0.0}, "epsilon"),
    ],
)
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        IBPOConfig(**kwargs)


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
    cfg = IBPOConfig(max_revision_tokens=6, max_edit_ratio=0.5)
    trace = [1, 2, 3, 4]
    local = evaluate_repair(trace, [1, 2, 9, 4], verified_correct=True, truncated=False, cfg=cfg)
    assert local.correct and not local.rewrite and local.failure is None
    assert local.alignment.edited_mask.tolist() == [False, False, True, False]
    rewrite = evaluate_repair(trace, [7, 8, 9, 4], verified_correct=True, truncated=False, cfg=cfg)
    assert rewrite.correct and rewrite.rewrite and rewrite.alignment.edit_ratio == 0.75
    failed = []
    for repair, truncated, failure in [([], False, "empty"), ([1, 2, 9, 4], True, "truncated"), ([1] * 7, False, "too_long")]:
        failed.append(evaluate_repair(trace, repair, verified_correct=True, truncated=truncated, cfg=cfg))
        assert failed[-1].failure == failure and not failed[-1].correct
    # a trace whose repairs all failed that way gets no bonus, even though the verifier accepted them
    assert repair_signal(False, [e.correct for e in failed], [e.alignment.edit_ratio for e in failed], cfg) == 0.0
    wrong = evaluate_repair(trace, [1, 2, 8, 4], verified_correct=False, truncated=False, cfg=cfg)
    assert not wrong.correct and wrong.failure is None


def test_repair_signal_aggregation_and_rewrite_switch():
    cfg = IBPOConfig()  # ρ = 0.5, δ = 0.5
    assert repair_signal(True, [True, True], [0.1, 0.1], cfg) == 0.0  # correct traces are never shaped
    assert repair_signal(False, [], [], cfg) == 0.0  # no revision generated: GRPO treatment
    assert repair_signal(False, [True, False, True], [0.1, 0.2, 0.3], cfg) == pytest.approx(0.5 * 2 / 3)
    assert repair_signal(False, [True, False, False], [0.1, 0.2, 0.3], IBPOConfig(aggregate="max")) == 0.5
    # the third repair is a verified rewrite (ratio 0.9 > δ): no credit by default, credit with the switch
    assert repair_signal(False, [True, False, True], [0.1, 0.0, 0.9], cfg) == pytest.approx(0.5 / 3)
    switched = IBPOConfig(rewrite_counts_as_repair=True)
    assert repair_signal(False, [True, False, True], [0.1, 0.0, 0.9], switched) == pytest.approx(1.0 / 3)
    with pytest.raises(ValueError, match="entries"):
        repair_signal(False, [True], [0.1, 0.2], cfg)
    with pytest.raises(ValueError, match="NaN"):
        repair_signal(False, [True], [float("nan")], cfg)


def test_localisation_mask_prefers_the_most_local_successful_repair():
    cfg = IBPOConfig(rewrite_counts_as_repair=True)
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
    cfg = IBPOConfig(max_revision_tokens=8)
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
    assert metrics["ibpo/edit_ratio_mean"] == pytest.approx(0.5)
    assert (metrics["ibpo/failed_empty"], metrics["ibpo/failed_truncated"], metrics["ibpo/failed_too_long"]) == (1, 1, 0)
    assert all(v == 0.0 for k, v in repair_metrics([]).items())


# ------------------------------------------------------------------ shaped advantages


def _group_of_four(lengths=(4, 4, 4, 4), T=5):
    response_mask = torch.zeros(4, T)
    for row, n in enumerate(lengths):
        response_mask[row, :n] = 1
    return response_mask, np.array(["q"] * 4, dtype=object)


def test_all_wrong_group_with_two_repairs_hand_computed():
    cfg = IBPOConfig()  # λ = 0.6, ρ = 0.5
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
    grpo = shaped_advantages(scores, response_mask, index, phi, edited, IBPOConfig(shaping_weight=0.0))
    assert not grpo.advantages.any() and grpo.metrics["ibpo/all_wrong_groups_with_signal_frac"] == 0.0


def test_mask_sign_rule_in_a_mixed_group():
    cfg = IBPOConfig()
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

    shaping_only = shaped_advantages(scores, response_mask, index, phi, edited, IBPOConfig(use_mask=False))
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
    phi = torch.tensor(rng.uniform(0, 0.5, size=bs), dtype=torch.float32)
    edited = torch.tensor(rng.random((bs, T)) < 0.4) & response_mask.bool()
    scores = token_level_rewards.sum(dim=-1)
    for cfg, masks in [
        (IBPOConfig(shaping_weight=0.0, epsilon=epsilon, norm_adv_by_std=norm_by_std, use_mask=False), edited),
        (IBPOConfig(shaping_weight=0.0, epsilon=epsilon, norm_adv_by_std=norm_by_std), None),
    ]:
        ours = shaped_advantages(scores, response_mask, index, phi, masks, cfg).advantages
        assert ours.dtype == verl_adv.dtype and torch.equal(ours, verl_adv)

    # with λ > 0 and no mask, IBPO is verl's GRPO run on the shaped rewards R' = R + λφ
    shaping = IBPOConfig(epsilon=epsilon, norm_adv_by_std=norm_by_std, use_mask=False)
    result = shaped_advantages(scores, response_mask, index, phi, None, shaping)
    shaped_token_rewards = token_level_rewards.clone()
    shaped_token_rewards[:, 0] += shaping.shaping_weight * phi  # verl sums rows; any single slot carries R'
    verl_shaped, _ = compute_grpo_outcome_advantage(
        shaped_token_rewards, response_mask, index, epsilon=epsilon, norm_adv_by_std_in_grpo=norm_by_std
    )
    torch.testing.assert_close(result.advantages, verl_shaped, rtol=0, atol=1e-6)


def test_groups_of_one_fall_back_to_grpo_and_are_counted():
    cfg = IBPOConfig()
    response_mask = torch.ones(2, 3)
    index = np.array(["a", "b"], dtype=object)
    result = shaped_advantages(torch.tensor([0.0, 1.0]), response_mask, index, torch.zeros(2), None, cfg)
    # verl's rule for a lone trace: mean 0, std 1, so the advantage is R / (1 + ε)
    torch.testing.assert_close(result.advantages, torch.tensor([[0.0] * 3, [1 / (1 + 1e-6)] * 3]))
    assert result.metrics["ibpo/singleton_groups"] == 2.0
    assert all(math.isfinite(v) for v in result.metrics.values())


def test_shaped_advantages_rejects_bad_input():
    cfg = IBPOConfig()
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
    full = plan_revisions(correct, index, IBPOConfig(num_references=2), np.random.default_rng(0))
    assert full.traces_without_reference == 1 and full.skipped_by_cap == 0
    assert len(full.pairs) == 5  # traces 0 and 1 get two references each, trace 3 has one sibling
    assert {(0, 2), (1, 2), (3, 4)} <= set(full.pairs[:3])  # every first reference (a correct one) comes first
    assert all(index[t] == index[r] and t != r and not correct[t] for t, r in full.pairs)

    capped = plan_revisions(correct, index, IBPOConfig(num_references=2, max_revisions=3), np.random.default_rng(0))
    assert sorted(capped.pairs) == [(0, 2), (1, 2), (3, 4)] and capped.skipped_by_cap == 2
    with pytest.raises(ValueError, match="index"):
        plan_revisions(correct, index[:2], IBPOConfig(), np.random.default_rng(0))


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
    assert fits_prompt_budget(512, 512) and not fits_prompt_budget(513, 512)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        fits_prompt_budget(1, 0)


# ------------------------------------------------------------------ one step end to end


def test_one_step_from_repairs_to_token_credit():
    """Four wrong traces of one arithmetic problem; two are repaired locally, one only by a rewrite."""
    cfg = IBPOConfig()
    traces = [
        "23+45=68\n68-17=52\n\\boxed{52}",  # wrong in the second result
        "23+45=69\n69-17=52\n\\boxed{52}",  # wrong in the first result
        "23+45=60\n\\boxed{60}",  # gave up early: only a rewrite fixes it
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
        phi.append(repair_signal(False, [e.correct for e in evals], [e.alignment.edit_ratio for e in evals], cfg))
        masks.append(localisation_mask(evals, len(trace)))
    assert phi == [0.5, 0.25, 0.0, 0.0]  # trace 2's success is a rewrite (ratio > 0.5), so it earns nothing
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
