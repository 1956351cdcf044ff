"""Outcomes on any declared scale (``algorithm.rredcot.reward_range``): −1/+1 and partial credit, through the
estimators' advantage functions (the ones the trainer calls), against verl's GRPO."""

from pathlib import Path

import numpy as np
import pytest
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

from rredcot_verl.core.settings import settings_from_config
from rredcot_verl.integration.estimators import ESTIMATORS, AdvantageBatch
from rredcot_verl.integration.reward_scale import SCORER_ROUTES

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
REWARD_FILE = ROOT / "rredcot_verl" / "tasks" / "reward.py"
NAN = float("nan")
UID = np.array(["a"] * 4 + ["b"] * 3 + ["c"] * 2, dtype=object)
LENGTHS = [6, 8, 5, 7, 4, 6, 8, 5, 6]
# Probe values (probabilities of success) per trace, v̂_0..v̂_{K-1}; segments end at L // 3, 2L // 3, L.
PROBES = [
    [0.5, 0.8, 0.9], [0.5, 0.3, 0.1], [0.4, 0.4, 0.7], [0.6, 0.7, 0.2],
    [0.3, 0.5, 0.6], [0.3, 0.2, 0.4], [0.3, 0.6, 0.1],
    [0.5, 0.6, 0.7], [0.5, 0.5, 0.5],
]  # fmt: skip


def _rewards_and_mask(outcomes):
    mask = torch.zeros(len(LENGTHS), 8)
    rewards = torch.zeros(len(LENGTHS), 8)
    for i, (length, outcome) in enumerate(zip(LENGTHS, outcomes)):
        mask[i, :length] = 1
        rewards[i, length - 1] = outcome
    return rewards, mask


def _segments() -> dict:
    ends = torch.full((len(LENGTHS), 3), -1, dtype=torch.long)
    values = torch.full((len(LENGTHS), 4), NAN)
    for i, length in enumerate(LENGTHS):
        ends[i] = torch.tensor([length // 3, 2 * length // 3, length])
        values[i, :3] = torch.tensor(PROBES[i])
    return {"segment_ends": ends, "raw_values": values}


def _run(estimator, outcomes, reward_range, **redistribution):
    settings = settings_from_config({"norm_adv_by_std_in_grpo": True,
                                     "rredcot": {"reward_range": list(reward_range), "redistribution": redistribution}})
    rewards, mask = _rewards_and_mask(outcomes)
    batch = AdvantageBatch(scores=rewards.sum(-1), response_mask=mask, index=UID.copy(), **_segments())
    result = ESTIMATORS[estimator].advantage(batch, settings)
    grpo, _ = compute_grpo_outcome_advantage(*_rewards_and_mask(outcomes), UID)
    return result.advantages, grpo, result


def _group_means(outcomes):
    return torch.tensor([np.mean([o for o, u in zip(outcomes, UID) if u == uid]) for uid in UID], dtype=torch.float64)


# Group a mixed, b mixed (b with partial credit where the scale allows it), c all correct.
PLUS_MINUS = [1.0, -1.0, 1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 1.0]
PARTIAL = [1.0, 0.0, 0.5, 0.0, 0.5, 0.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("estimator", ["rredcot", "segment_mc"])
@pytest.mark.parametrize(
    "outcomes, reward_range", [(PLUS_MINUS, (-1.0, 1.0)), (PARTIAL, (0.0, 1.0))], ids=["plus_minus_one", "partial"]
)
def test_reward_scale_telescopes_and_stays_finite(estimator, outcomes, reward_range):
    advantages, grpo, result = _run(estimator, outcomes, reward_range)
    assert torch.isfinite(advantages).all()
    assert result.metrics[f"{estimator}/fallback/outside_reward_range"] == 0.0
    live = ~result.fallback
    assert live[:7].sum() >= 5  # the mixed groups are redistributed (traces at their group mean fall back)
    values, rewards = result.values.double(), result.segment_rewards.double()
    # Anchored: V_0 = group mean, V_K = ζ, and Σ_k R_k = ζ − V_0 on the declared scale.
    outcome = torch.tensor(outcomes, dtype=torch.float64)
    assert torch.allclose(values[live, 0], _group_means(outcomes)[live])
    assert torch.equal(values[live, 3], outcome[live])
    assert torch.allclose(rewards[live].sum(1), outcome[live] - values[live, 0], atol=1e-6)
    low, high = reward_range
    assert ((values[live] >= low - 1e-6) & (values[live] <= high + 1e-6)).all()
    # Each trace's total push is GRPO's; the all-correct group keeps its zeros.
    assert torch.allclose(advantages.double().sum(1), grpo.double().sum(1), atol=1e-5)
    assert torch.all(advantages[7:] == 0)
    assert not torch.equal(advantages, grpo)


@pytest.mark.parametrize("outcomes, reward_range", [(PLUS_MINUS, (-1.0, 1.0)), (PARTIAL, (0.0, 1.0))])
def test_reward_scale_at_mix_zero_is_verls_grpo(outcomes, reward_range):
    advantages, grpo, _ = _run("rredcot", outcomes, reward_range, mix=0.0)
    assert torch.equal(advantages, grpo)


def test_reward_scale_plus_minus_one_redistributes_as_zero_one():
    """Probe values are probabilities; on [−1, 1] they stand for 2v̂ − 1. The coefficients do not depend on the
    scale, so the advantages match those of the same outcomes on [0, 1] (up to verl's ε in the std)."""
    plus_minus, _, result_pm = _run("rredcot", PLUS_MINUS, (-1.0, 1.0))
    zero_one, _, result_01 = _run("rredcot", [(o + 1) / 2 for o in PLUS_MINUS], (0.0, 1.0))
    assert torch.allclose(plus_minus, zero_one, atol=1e-5)
    values_pm, values_01 = result_pm.values.double(), result_01.values.double()
    assert torch.allclose(values_pm, 2 * values_01 - 1, atol=1e-6, equal_nan=True)


def test_reward_scale_outcome_outside_the_range_keeps_grpo_and_is_counted():
    outcomes = list(PLUS_MINUS)
    outcomes[0] = 1.5  # a reward function that breaks its declared [−1, 1] mid-run
    advantages, grpo, result = _run("rredcot", outcomes, (-1.0, 1.0))
    assert result.metrics["rredcot/fallback/outside_reward_range"] == 1.0
    assert torch.equal(advantages[0], grpo[0])
    assert torch.isfinite(advantages).all()
    assert not torch.equal(advantages[1], grpo[1])  # its group mates are still redistributed around the true mean
    assert torch.allclose(advantages.double().sum(1), grpo.double().sum(1), atol=1e-5)


def test_reward_scale_value_differences_in_degenerate_groups_are_on_the_scale():
    # Group c is all correct (+1): its traces get unanchored value differences, R in units of the declared scale.
    advantages, _, result = _run("rredcot", PLUS_MINUS, (-1.0, 1.0), degenerate_groups="value_differences")
    assert result.metrics["rredcot/degenerate_groups_with_signal"] == 1.0
    values = result.values[7].double()
    assert torch.allclose(values, torch.tensor([0.0, 0.2, 0.4, 1.0], dtype=torch.float64), atol=1e-6)  # 2v̂ − 1
    # A_t = R_k · (L / n_k) / s, s = (high − low) / 2 = 1: L = 5, segments of 1, 2, 2 tokens.
    expected = torch.tensor([0.2 * 5, 0.2 * 5 / 2, 0.2 * 5 / 2, 0.6 * 5 / 2, 0.6 * 5 / 2])
    assert torch.allclose(advantages[7, :5], expected, atol=1e-6)
    # Probes flat at v̂ = 0.5 (scale value 0) until the end: the whole rise to ζ = 1 lands on the last segment.
    assert torch.allclose(advantages[8, :6], torch.tensor([0.0, 0.0, 0.0, 0.0, 3.0, 3.0]), atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# The scale at launch (verl's own scorers) and at the first batch (any reward)


def test_a_first_batch_mostly_off_the_declared_scale_stops_the_run_naming_the_key():
    from rredcot_verl.core.outcomes import first_batch_scale_refusal

    dapo = [1.0, -1.0, -1.0, 1.0, -1.0, -1.0, -1.0, 1.0]  # math_dapo's outcomes against the default [0, 1]
    message = first_batch_scale_refusal(dapo, (0.0, 1.0))
    assert message == (
        "5 of 8 outcomes of the first batch lie outside algorithm.rredcot.reward_range=[0, 1] (they lie in [-1, 1]): "
        "set algorithm.rredcot.reward_range to the reward's scale (verl's math_dapo scores -1 / +1)"
    )
    assert first_batch_scale_refusal(dapo, (-1.0, 1.0)) is None
    assert first_batch_scale_refusal(torch.tensor(dapo), (-1.0, 1.0)) is None
    # A few outliers are a broken reward's, counted later as fallbacks: at most half outside does not stop the run.
    assert first_batch_scale_refusal([0.0, 1.0, 1.5, -0.5], (0.0, 1.0)) is None
    assert first_batch_scale_refusal([0.0, 1.0 + 1e-9, 1.0], (0.0, 1.0)) is None  # float32 rounding of the top
    assert "3 of 4 outcomes" in first_batch_scale_refusal([NAN, NAN, 2.0, 1.0], (0.0, 1.0))
    assert "none is finite" in first_batch_scale_refusal([NAN, NAN], (0.0, 1.0))
    assert first_batch_scale_refusal([], (0.0, 1.0)) is None


# route -> (a data source it takes, a right answer, a wrong answer, the ground truth)
ROUTE_CASES = {
    "math_dapo": [("math_dapo", "Answer: 5", "Answer: 3", "5"), ("aime2024", "so \\boxed{5}", "\\boxed{3}", "5")],
    "gsm8k": [("openai/gsm8k", "#### 5", "#### 3", "5")],
    "math_reward": [("HuggingFaceH4/MATH-500", "\\boxed{5}", "\\boxed{3}", "5")],
    "prime_math": [("numina_olympiads", "\\boxed{5}", "\\boxed{3}", "5")],
    "search_r1_like_qa_em": [("searchR1_nq", "<answer>5</answer>", "<answer>3</answer>", {"target": ["5"]})],
}


@pytest.mark.parametrize("route", [route.scorer for route in SCORER_ROUTES])
def test_each_scorer_route_scores_on_the_scale_listed_through_verls_scorer(route):
    from verl.utils.reward_score import default_compute_score

    from rredcot_verl.integration.reward_scale import scorer_route

    for source, right, wrong, truth in ROUTE_CASES[route]:
        listed = scorer_route(source)
        assert listed.scorer == route
        scores = [default_compute_score(source, answer, truth) for answer in (wrong, right)]
        assert tuple(s["score"] if isinstance(s, dict) else s for s in scores) == listed.scale, source
    assert scorer_route("rredcot_arithmetic") is None and scorer_route("codecontests") is None


def _recipe(build, data_sources, estimator="rredcot", overrides=()):
    import pandas as pd

    from composing import compose_recipe

    frame = pd.read_parquet(build / "data" / "train.parquet")
    frame["data_source"] = [data_sources[i % len(data_sources)] for i in range(len(frame))]
    frame.to_parquet(build / "data" / "train.parquet")
    verls_scorer = ["reward.custom_reward_function.path=pkg://verl.utils.reward_score",
                    "reward.custom_reward_function.name=default_compute_score"]  # fmt: skip
    return compose_recipe(str(ROOT / "recipes" / "tiny_cpu"), estimator, [*verls_scorer, *overrides])


def _our_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("rredcot_verl:")]


def test_the_launch_takes_math_dapos_scale_from_verls_scorer(build, monkeypatch, capsys):
    from rredcot_verl.integration.launcher import check

    monkeypatch.setenv("RREDCOT_CPU", "1")
    for estimator in ("rredcot", "ibpo", "segment_mc"):
        config = _recipe(build, ["math_dapo"], estimator)
        check(config)
        assert list(config.algorithm.rredcot.reward_range) == [-1.0, 1.0]
        assert _our_lines(capsys) == [
            "rredcot_verl: algorithm.rredcot.reward_range=[-1, 1]: the scale of verl's math_dapo scorer for "
            "data_source math_dapo"
        ]
    # named at its scale: kept, nothing said
    config = _recipe(build, ["math_dapo"], overrides=["algorithm.rredcot.reward_range=[-1,1]"])
    check(config)
    assert _our_lines(capsys) == []
    # verl's own estimators read no reward_range
    config = _recipe(build, ["math_dapo"], "grpo")
    check(config)
    assert list(config.algorithm.rredcot.reward_range) == [0.0, 1.0]


def test_a_range_against_the_scorer_and_rows_of_two_scales_are_refused(build, monkeypatch):
    from rredcot_verl.integration.launcher import LaunchError, check

    monkeypatch.setenv("RREDCOT_CPU", "1")
    with pytest.raises(LaunchError) as error:
        check(_recipe(build, ["math_dapo"], overrides=["algorithm.rredcot.reward_range=[0,2]"]))
    assert str(error.value) == (
        "algorithm.rredcot.reward_range=[0, 2] is not the scale of verl's math_dapo scorer for data_source math_dapo, "
        "[-1, 1]: set algorithm.rredcot.reward_range=[-1, 1], or leave it out"
    )
    with pytest.raises(LaunchError, match=r"^data.train_files holds data sources that verl's scorers score on "
                                          r"different scales \(math_dapo: math_dapo \[-1.0, 1.0\]; openai/gsm8k: "
                                          r"gsm8k \[0.0, 1.0\]\)"):  # fmt: skip
        check(_recipe(build, ["math_dapo", "openai/gsm8k"]))


def test_a_reward_of_ones_own_or_an_unchecked_source_keeps_the_declared_range(build, monkeypatch):
    """Its scale is its author's: the first batch checks it (first_batch_scale_refusal)."""
    from rredcot_verl.integration.launcher import check

    monkeypatch.setenv("RREDCOT_CPU", "1")
    own = _recipe(build, ["math_dapo"], overrides=[f"reward.custom_reward_function.path={REWARD_FILE}",
                                                   "reward.custom_reward_function.name=compute_score"])  # fmt: skip
    check(own)
    assert list(own.algorithm.rredcot.reward_range) == [0.0, 1.0]
    unchecked = _recipe(build, ["codecontests"])
    check(unchecked)
    assert list(unchecked.algorithm.rredcot.reward_range) == [0.0, 1.0]
