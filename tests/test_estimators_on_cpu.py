"""The registered estimators called through verl's own compute_advantage with a real DataProto."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, compute_grpo_outcome_advantage
from verl.trainer.ppo.ray_trainer import compute_advantage

import rredcot_verl.integration.plugin
from rredcot_verl.core.concordance import ConcordanceCounts
from rredcot_verl.integration.estimators import ESTIMATORS, estimator_inputs
from rredcot_verl.integration.estimators.ibpo import IBPOInputs
from rredcot_verl.integration.estimators.rredcot import SegmentInputs

UID = np.array(["a", "a", "a", "a", "b", "b"], dtype=object)
LENGTHS = [6, 8, 5, 7, 4, 6]
OUTCOMES = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]


def _batch() -> DataProto:
    mask = torch.zeros(len(LENGTHS), 8)
    rewards = torch.zeros(len(LENGTHS), 8)
    for i, (length, outcome) in enumerate(zip(LENGTHS, OUTCOMES)):
        mask[i, :length] = 1
        rewards[i, length - 1] = outcome
    return DataProto.from_dict(
        tensors={"token_level_rewards": rewards, "response_mask": mask}, non_tensors={"uid": UID.copy()}
    )


def _segments():
    ends = torch.full((len(LENGTHS), 3), -1, dtype=torch.long)
    values = torch.full((len(LENGTHS), 4), float("nan"))
    for i, length in enumerate(LENGTHS):
        ends[i, :2] = torch.tensor([length // 2, length])
        values[i, :3] = torch.tensor([0.5, 0.9 if OUTCOMES[i] else 0.1, OUTCOMES[i]])
    return SegmentInputs(ends, values).to_batch()


def _algorithm(mix: float):
    return OmegaConf.create(
        {"adv_estimator": "rredcot", "norm_adv_by_std_in_grpo": True, "rredcot": {"redistribution": {"mix": mix}}}
    )


def test_import_registers_every_estimator_and_reimport_is_harmless():
    import importlib

    importlib.reload(rredcot_verl.integration.estimators)
    for name in ("rredcot", "ibpo", "segment_mc", "rredcot_ibpo"):
        assert name in ADV_ESTIMATOR_REGISTRY


def test_rredcot_at_mix_zero_is_verls_grpo_through_compute_advantage():
    data = _batch()
    with estimator_inputs(UID, _segments()):
        out = compute_advantage(data, adv_estimator="rredcot", config=_algorithm(0.0))
    expected, _ = compute_grpo_outcome_advantage(_batch().batch["token_level_rewards"], _batch().batch["response_mask"], UID)
    assert torch.equal(out.batch["advantages"], expected)


def test_rredcot_redistributes_within_traces_through_compute_advantage():
    data = _batch()
    with estimator_inputs(UID, _segments()) as record:
        out = compute_advantage(data, adv_estimator="rredcot", config=_algorithm(1.0))
    advantages = out.batch["advantages"]
    grpo, _ = compute_grpo_outcome_advantage(_batch().batch["token_level_rewards"], _batch().batch["response_mask"], UID)
    for i, length in enumerate(LENGTHS[:4]):  # group "a" is mixed; group "b" is all correct (zero advantage)
        first, second = advantages[i, 0], advantages[i, length - 1]
        assert first != second
        assert advantages[i, :length].sum() == pytest.approx(float(grpo[i, :length].sum()), rel=1e-5)
    assert torch.all(advantages[4:] == 0)
    assert record.metrics["rredcot/degenerate_groups"] == 1.0


def test_a_window_of_uninformative_values_closes_the_gate_to_verls_grpo():
    # This batch's values order group "a" perfectly (4 pairs, each readable at the shares 50%..90% past the first
    # boundary: 20 comparisons, all concordant), but the trainer's window of previous batches holds 200 comparisons
    # at chance: (20 + 100) / 220 < 0.6.
    with estimator_inputs(UID, _segments(), prior_concordance=ConcordanceCounts(100.0, 200)) as record:
        out = compute_advantage(_batch(), adv_estimator="rredcot", config=_algorithm(1.0))
    expected, _ = compute_grpo_outcome_advantage(_batch().batch["token_level_rewards"], _batch().batch["response_mask"], UID)
    assert torch.equal(out.batch["advantages"], expected)
    assert record.metrics["rredcot/value_gate_open"] == 0.0
    assert record.metrics["rredcot/fallback/low_value_concordance"] == 4.0  # group "b" counts as degenerate
    assert record.details["concordance"] == ConcordanceCounts(20.0, 20)
    assert record.metrics["rredcot/value_concordance_pooled"] == pytest.approx(120 / 220)


def test_missing_segment_data_names_the_switch():
    with pytest.raises(KeyError, match="rredcot_verl.main"):
        compute_advantage(_batch(), adv_estimator="rredcot", config=_algorithm(1.0))


def test_step_inputs_keep_their_batch_keys():
    # The keys are verl batch fields and the snapshot's row keys (report.py reads them): renaming a field moves both.
    assert IBPOInputs.keys() == ("ibpo_phi", "ibpo_edited_mask")
    assert SegmentInputs.keys() == ("seg_ends", "seg_raw_values")
    assert ESTIMATORS["rredcot_ibpo"].fields == ("ibpo_phi", "ibpo_edited_mask", "seg_ends", "seg_raw_values")
    phi, mask = torch.tensor([0.5]), torch.tensor([[True]])
    read = IBPOInputs.from_batch(IBPOInputs(phi, mask).to_batch())
    assert read.phi is phi and read.edited_mask is mask


def test_misaligned_rows_are_rejected():
    with estimator_inputs(UID[::-1].copy(), _segments()):
        with pytest.raises(ValueError, match="uid order"):
            compute_advantage(_batch(), adv_estimator="rredcot", config=_algorithm(1.0))


def test_ibpo_through_compute_advantage_gives_all_wrong_groups_a_gradient():
    outcomes = torch.zeros(4, 5)
    mask = torch.ones(4, 5)
    uid = np.array(["q"] * 4, dtype=object)
    data = DataProto.from_dict(tensors={"token_level_rewards": outcomes, "response_mask": mask}, non_tensors={"uid": uid})
    phi = torch.tensor([0.5, 0.0, 0.0, 0.0])
    edited = torch.zeros(4, 5, dtype=torch.bool)
    edited[0, 3] = True
    config = OmegaConf.create({"adv_estimator": "ibpo", "norm_adv_by_std_in_grpo": True, "rredcot": {}})
    with estimator_inputs(uid, IBPOInputs(phi, edited).to_batch()):
        out = compute_advantage(data, adv_estimator="ibpo", config=config)
    advantages = out.batch["advantages"]
    assert advantages.abs().sum() > 0  # plain GRPO gives all zeros here
    assert torch.all(advantages[1:] < 0)


def test_rredcot_ibpo_through_compute_advantage_localises_an_all_wrong_groups_gradient():
    """Group "w": four failures, one repaired (φ, edited tokens 3..4); the values of the others fall in their first
    half. verl's GRPO gives the group nothing; the fused estimator shapes it (IBPO) and puts the blame where the
    values fell."""
    uid = np.array(["w"] * 4, dtype=object)
    mask = torch.ones(4, 5)
    data = DataProto.from_dict(tensors={"token_level_rewards": torch.zeros(4, 5), "response_mask": mask},
                               non_tensors={"uid": uid.copy()})
    edited = torch.zeros(4, 5, dtype=torch.bool)
    edited[0, 3:] = True
    tensors = {
        **IBPOInputs(phi=torch.tensor([0.5, 0.0, 0.0, 0.0]), edited_mask=edited).to_batch(),
        **SegmentInputs(
            ends=torch.tensor([[2, 5]] * 4),
            raw_values=torch.tensor([[0.7, 0.6, 0.0], [0.7, 0.05, 0.0], [0.7, 0.1, 0.0], [0.7, 0.02, 0.0]]),
        ).to_batch(),
    }
    config = OmegaConf.create({"adv_estimator": "rredcot_ibpo", "norm_adv_by_std_in_grpo": True,
                               "rredcot": {"redistribution": {"min_value_concordance": 0.0}}})
    with estimator_inputs(uid, tensors) as record:
        advantages = compute_advantage(data, adv_estimator="rredcot_ibpo", config=config).batch["advantages"]
    assert torch.all(advantages[0, :3] > 0) and torch.all(advantages[0, 3:] == 0)  # never reinforce the edits
    assert torch.all(advantages[1:, :2].mean(1) < 3 * advantages[1:, 2:].mean(1))  # blame where the values fell
    metrics = record.metrics
    assert metrics["rredcot_ibpo/credit_from_values_frac"] == 0.75
    assert metrics["rredcot_ibpo/fallback/against_shaped_advantage"] == 1.0
    assert metrics["ibpo/all_wrong_groups_with_signal_frac"] == 1.0
    assert record.details["segment_rewards"].shape == (4, 2)


def test_degenerate_groups_setting_reaches_the_estimator():
    config = OmegaConf.create(
        {
            "adv_estimator": "rredcot",
            "norm_adv_by_std_in_grpo": True,
            "rredcot": {"redistribution": {"degenerate_groups": "value_differences"}},
        }
    )
    with estimator_inputs(UID, _segments()) as record:
        out = compute_advantage(_batch(), adv_estimator="rredcot", config=config)
    advantages = out.batch["advantages"]
    # Group "b" is all correct; its probes rise 0.5 -> 0.9 -> 1, so the first half of each trace gets the most.
    for i, length in ((4, 4), (5, 6)):
        assert advantages[i, 0] > advantages[i, length - 1] > 0
    assert record.metrics["rredcot/degenerate_groups_with_signal"] == 1.0
    assert torch.isfinite(advantages).all()


def test_bad_reward_range_is_a_settings_error_naming_the_key():
    config = OmegaConf.create({"adv_estimator": "rredcot", "rredcot": {"reward_range": [1.0, -1.0]}})
    with estimator_inputs(UID, _segments()):
        with pytest.raises(ValueError, match="reward_range"):
            compute_advantage(_batch(), adv_estimator="rredcot", config=config)


def test_an_estimator_is_one_spec_that_verl_the_launcher_and_the_trainer_read(monkeypatch):
    """Every spec is registered with verl under its name; a new spec in ``ESTIMATORS`` is all the launcher and the
    trainer need (no name lists elsewhere)."""
    import dataclasses

    from omegaconf import OmegaConf

    from rredcot_verl.integration.estimators import ESTIMATORS, register
    from rredcot_verl.integration.launcher import LaunchError, check_estimator, check_value_pass_parallelism

    for name, spec in ESTIMATORS.items():
        assert spec.name == name and ADV_ESTIMATOR_REGISTRY[name] is spec.advantage
    new = dataclasses.replace(ESTIMATORS["rredcot"], name="rredcot_unit_test_copy")
    monkeypatch.setitem(ESTIMATORS, new.name, new)
    register(new)
    try:
        check_estimator(new.name)
        config = OmegaConf.create({"actor_rollout_ref": {"actor": {"ulysses_sequence_parallel_size": 2}}})
        with pytest.raises(LaunchError, match="rredcot_unit_test_copy"):
            check_value_pass_parallelism(config, new.name)
    finally:
        ADV_ESTIMATOR_REGISTRY.pop(new.name, None)


@pytest.mark.parametrize("estimator", ["rredcot", "segment_mc", "rredcot_ibpo"])
def test_tool_output_gets_no_advantage_from_any_value_estimator(estimator):
    """verl's multi-turn response_mask (model turns, a hole of tool output and template tokens, right padding) and
    segment ends in its positions, as the value pass writes them: the holes get nothing, each trace's model tokens
    carry its GRPO credit, moved by the values."""
    uid = np.array(["t"] * 4, dtype=object)
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0],
                         [1, 1, 0, 1, 1, 0, 0, 0]], dtype=torch.float32)  # fmt: skip
    outcomes = [1.0, 0.0, 1.0, 0.0]
    rewards = torch.zeros(4, 8)
    for i, outcome in enumerate(outcomes):
        rewards[i, int(mask[i].nonzero()[-1])] = outcome
    ends = torch.tensor([[5, 7], [5, 8], [2, 4], [3, 5]])  # a second turn starts a segment; a hole ends one
    values = torch.tensor([[0.5, 0.9, 1.0], [0.5, 0.2, 0.0], [0.5, 0.7, 1.0], [0.5, 0.1, 0.0]])
    tensors = SegmentInputs(ends, values).to_batch()
    if estimator == "rredcot_ibpo":
        tensors.update(IBPOInputs(phi=torch.zeros(4), edited_mask=torch.zeros(4, 8, dtype=torch.bool)).to_batch())
    config = OmegaConf.create({"adv_estimator": estimator, "norm_adv_by_std_in_grpo": True,
                               "rredcot": {"redistribution": {"min_value_concordance": 0.0}}})
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask},
                               non_tensors={"uid": uid.copy()})
    with estimator_inputs(uid, tensors):
        advantages = compute_advantage(data, adv_estimator=estimator, config=config).batch["advantages"]
    grpo, _ = compute_grpo_outcome_advantage(rewards, mask, uid)
    assert torch.all(advantages[mask == 0] == 0)
    torch.testing.assert_close(advantages.sum(1), grpo.sum(1))
    assert advantages[0, 0] != advantages[0, 5]  # the turns of a trace get different credit
