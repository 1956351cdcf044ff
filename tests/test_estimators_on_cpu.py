"""The estimators' advantage functions on one ``AdvantageBatch`` (the function the trainer calls), against verl's GRPO;
the trainer's advantage step around them, against verl's own; and what verl's registration of their names does."""


import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from transfer_queue import KVBatchMeta
from verl import DataProto
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, compute_grpo_outcome_advantage
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.trainer.ppo.v1 import trainer_base

import rredcot_verl.integration.plugin  # noqa: F401  (registers the estimators)
from rredcot_verl.core.concordance import ConcordanceCounts
from rredcot_verl.core.settings import settings_from_config
from rredcot_verl.integration.estimators import ESTIMATORS, AdvantageBatch
from rredcot_verl.integration.estimators.ibpo import ibpo_advantage
from rredcot_verl.integration.estimators.rredcot import rredcot_advantage
from rredcot_verl.integration.estimators.rredcot_ibpo import rredcot_ibpo_advantage

UID = np.array(["a", "a", "a", "a", "b", "b"], dtype=object)
LENGTHS = [6, 8, 5, 7, 4, 6]
OUTCOMES = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]


def _rewards_and_mask():
    """verl's token_level_rewards (the outcome on the last response token) and response_mask."""
    mask = torch.zeros(len(LENGTHS), 8)
    rewards = torch.zeros(len(LENGTHS), 8)
    for i, (length, outcome) in enumerate(zip(LENGTHS, OUTCOMES)):
        mask[i, :length] = 1
        rewards[i, length - 1] = outcome
    return rewards, mask


def _segments() -> dict:
    ends = torch.full((len(LENGTHS), 3), -1, dtype=torch.long)
    values = torch.full((len(LENGTHS), 4), float("nan"))
    for i, length in enumerate(LENGTHS):
        ends[i, :2] = torch.tensor([length // 2, length])
        values[i, :3] = torch.tensor([0.5, 0.9 if OUTCOMES[i] else 0.1, OUTCOMES[i]])
    return {"segment_ends": ends, "raw_values": values}


def _batch(prior_concordance=ConcordanceCounts(), **inputs) -> AdvantageBatch:
    rewards, mask = _rewards_and_mask()
    return AdvantageBatch(scores=rewards.sum(-1), response_mask=mask, index=UID.copy(),
                          prior_concordance=prior_concordance, **inputs)  # fmt: skip


def _settings(**rredcot):
    return settings_from_config({"norm_adv_by_std_in_grpo": True, "rredcot": rredcot})


def _grpo() -> torch.Tensor:
    return compute_grpo_outcome_advantage(*_rewards_and_mask(), UID)[0]


def test_import_registers_every_estimator_and_reimport_is_harmless():
    import importlib

    importlib.reload(rredcot_verl.integration.estimators)
    for name in ("rredcot", "ibpo", "segment_mc", "rredcot_ibpo"):
        assert name in ADV_ESTIMATOR_REGISTRY


@pytest.mark.parametrize("estimator", ["rredcot", "ibpo", "segment_mc", "rredcot_ibpo"])
def test_verls_own_advantage_step_refuses_these_estimators_naming_the_launcher(estimator):
    """Stock verl (``python -m verl.trainer.main_ppo``) calls the registered name with rewards, mask and uids only."""
    rewards, mask = _rewards_and_mask()
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask},
                               non_tensors={"uid": UID.copy()})  # fmt: skip
    with pytest.raises(RuntimeError, match=r"python -m rredcot_verl.main"):
        compute_advantage(data, adv_estimator=estimator, config=OmegaConf.create({"adv_estimator": estimator}))


def test_rredcot_at_mix_zero_is_verls_grpo():
    result = rredcot_advantage(_batch(**_segments()), _settings(redistribution={"mix": 0.0}))
    assert torch.equal(result.advantages, _grpo())


def test_rredcot_redistributes_within_traces():
    result = rredcot_advantage(_batch(**_segments()), _settings(redistribution={"mix": 1.0}))
    advantages, grpo = result.advantages, _grpo()
    for i, length in enumerate(LENGTHS[:4]):  # group "a" is mixed; group "b" is all correct (zero advantage)
        first, second = advantages[i, 0], advantages[i, length - 1]
        assert first != second
        assert advantages[i, :length].sum() == pytest.approx(float(grpo[i, :length].sum()), rel=1e-5)
    assert torch.all(advantages[4:] == 0)
    assert result.metrics["rredcot/degenerate_groups"] == 1.0


def test_a_window_of_uninformative_values_closes_the_gate_to_verls_grpo():
    # This batch's values order group "a" perfectly (4 pairs, each readable at the shares 50%..90% past the first
    # boundary: 20 comparisons, all concordant), but the trainer's window of previous batches holds 200 comparisons
    # at chance: (20 + 100) / 220 < 0.6.
    result = rredcot_advantage(_batch(ConcordanceCounts(100.0, 200), **_segments()), _settings())
    assert torch.equal(result.advantages, _grpo())
    assert result.metrics["rredcot/value_gate_open"] == 0.0
    assert result.metrics["rredcot/fallback/low_value_concordance"] == 4.0  # group "b" counts as degenerate
    assert result.concordance == ConcordanceCounts(20.0, 20)
    assert result.metrics["rredcot/value_concordance_pooled"] == pytest.approx(120 / 220)


def test_missing_inputs_are_named():
    with pytest.raises(ValueError, match=r"adv_estimator='rredcot' needs the batch's \['segment_ends', 'raw_values'\]"):
        rredcot_advantage(_batch(), _settings())


def test_inputs_keep_their_batch_keys():
    # The keys are verl batch fields and the snapshot's row keys (report.py reads them): renaming a field moves both.
    assert AdvantageBatch.BATCH_KEYS == {"segment_ends": "seg_ends", "raw_values": "seg_raw_values",
                                         "phi": "ibpo_phi", "edited_mask": "ibpo_edited_mask"}  # fmt: skip
    assert ESTIMATORS["rredcot_ibpo"].batch_keys == ("ibpo_phi", "ibpo_edited_mask", "seg_ends", "seg_raw_values")
    assert ESTIMATORS["segment_mc"].batch_keys == ESTIMATORS["rredcot"].batch_keys == ("seg_ends", "seg_raw_values")


def test_ibpo_gives_all_wrong_groups_a_gradient():
    edited = torch.zeros(4, 5, dtype=torch.bool)
    edited[0, 3] = True
    batch = AdvantageBatch(scores=torch.zeros(4), response_mask=torch.ones(4, 5),
                           index=np.array(["q"] * 4, dtype=object), phi=torch.tensor([0.5, 0.0, 0.0, 0.0]),
                           edited_mask=edited)  # fmt: skip
    advantages = ibpo_advantage(batch, _settings()).advantages
    assert advantages.abs().sum() > 0  # plain GRPO gives all zeros here
    assert torch.all(advantages[1:] < 0)


def test_rredcot_ibpo_localises_an_all_wrong_groups_gradient():
    """Group "w": four failures, one repaired (φ, edited tokens 3..4); the values of the others fall in their first
    half. verl's GRPO gives the group nothing; the fused estimator shapes it (IBPO) and puts the blame where the
    values fell."""
    edited = torch.zeros(4, 5, dtype=torch.bool)
    edited[0, 3:] = True
    batch = AdvantageBatch(
        scores=torch.zeros(4), response_mask=torch.ones(4, 5), index=np.array(["w"] * 4, dtype=object),
        phi=torch.tensor([0.5, 0.0, 0.0, 0.0]), edited_mask=edited, segment_ends=torch.tensor([[2, 5]] * 4),
        raw_values=torch.tensor([[0.7, 0.6, 0.0], [0.7, 0.05, 0.0], [0.7, 0.1, 0.0], [0.7, 0.02, 0.0]]),
    )  # fmt: skip
    result = rredcot_ibpo_advantage(batch, _settings(redistribution={"min_value_concordance": 0.0}))
    advantages = result.advantages
    assert torch.all(advantages[0, :3] > 0) and torch.all(advantages[0, 3:] == 0)  # never reinforce the edits
    assert torch.all(advantages[1:, :2].mean(1) < 3 * advantages[1:, 2:].mean(1))  # blame where the values fell
    assert result.metrics["rredcot_ibpo/credit_from_values_frac"] == 0.75
    assert result.metrics["rredcot_ibpo/fallback/against_shaped_advantage"] == 1.0
    assert result.metrics["ibpo/all_wrong_groups_with_signal_frac"] == 1.0
    assert result.segment_rewards.shape == (4, 2)


def test_degenerate_groups_setting_reaches_the_estimator():
    settings = _settings(redistribution={"degenerate_groups": "value_differences"})
    result = rredcot_advantage(_batch(**_segments()), settings)
    advantages = result.advantages
    # Group "b" is all correct; its probes rise 0.5 -> 0.9 -> 1, so the first half of each trace gets the most.
    for i, length in ((4, 4), (5, 6)):
        assert advantages[i, 0] > advantages[i, length - 1] > 0
    assert result.metrics["rredcot/degenerate_groups_with_signal"] == 1.0
    assert torch.isfinite(advantages).all()


def test_verls_norm_flag_reaches_every_estimator():
    """``algorithm.norm_adv_by_std_in_grpo=false`` (Dr.GRPO): the settings the trainer reads carry it to both the
    redistribution and IBPO, and λ = 0 is verl's unnormalised GRPO."""
    settings = settings_from_config({"norm_adv_by_std_in_grpo": False, "rredcot": {"redistribution": {"mix": 0.0}}})
    assert not settings.redistribution.norm_adv_by_std and not settings.ibpo.norm_adv_by_std
    expected = compute_grpo_outcome_advantage(*_rewards_and_mask(), UID, norm_adv_by_std_in_grpo=False)[0]
    assert torch.equal(rredcot_advantage(_batch(**_segments()), settings).advantages, expected)


def test_bad_reward_range_is_a_settings_error_naming_the_key():
    with pytest.raises(ValueError, match="reward_range"):
        _settings(reward_range=[1.0, -1.0])


def test_an_estimator_is_one_spec_that_verl_the_launcher_and_the_trainer_read(monkeypatch):
    """Every spec's name is registered with verl; a new spec in ``ESTIMATORS`` is all the launcher and the trainer
    need (no name lists elsewhere)."""
    import dataclasses

    from rredcot_verl.integration.estimators import ESTIMATORS, register  # the reloaded module's (first test)
    from rredcot_verl.integration.launcher import LaunchError, check_estimator, check_value_pass_parallelism

    for name, spec in ESTIMATORS.items():
        assert spec.name == name and name in ADV_ESTIMATOR_REGISTRY
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


def test_a_spec_names_only_advantage_batch_inputs():
    import dataclasses

    with pytest.raises(ValueError, match=r"inputs \['values'\] are not AdvantageBatch inputs"):
        dataclasses.replace(ESTIMATORS["rredcot"], inputs=("segment_ends", "values"))


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
    inputs = {"segment_ends": torch.tensor([[5, 7], [5, 8], [2, 4], [3, 5]]),  # a second turn starts a segment
              "raw_values": torch.tensor([[0.5, 0.9, 1.0], [0.5, 0.2, 0.0], [0.5, 0.7, 1.0], [0.5, 0.1, 0.0]])}
    if estimator == "rredcot_ibpo":
        inputs.update(phi=torch.zeros(4), edited_mask=torch.zeros(4, 8, dtype=torch.bool))
    batch = AdvantageBatch(scores=rewards.sum(-1), response_mask=mask, index=uid, **inputs)
    advantages = ESTIMATORS[estimator].advantage(batch, _settings(redistribution={"min_value_concordance": 0.0}))
    advantages = advantages.advantages
    grpo, _ = compute_grpo_outcome_advantage(rewards, mask, uid)
    assert torch.all(advantages[mask == 0] == 0)
    torch.testing.assert_close(advantages.sum(1), grpo.sum(1))
    assert advantages[0, 0] != advantages[0, 5]  # the turns of a trace get different credit


# ------------------------------------------------------------------------------ the trainer's advantage step


def _ragged(rows) -> torch.Tensor:
    return torch.nested.nested_tensor(list(rows), layout=torch.jagged)


def _step_fields() -> dict:
    """TransferQueue's fields of a step as verl leaves them before its advantage step: ragged per-token fields
    (outcome on the last token, the rollout engine's and the actor's log-probs), uids; and the value stage's inputs
    (dense rows, as the trainer writes them)."""
    rewards, _ = _rewards_and_mask()
    generator = torch.Generator().manual_seed(0)
    old = [-torch.rand(length, generator=generator) for length in LENGTHS]
    return {
        "uid": list(UID),
        "response_mask": _ragged(torch.ones(length, dtype=torch.int64) for length in LENGTHS),
        "rm_scores": _ragged(rewards[i, :length] for i, length in enumerate(LENGTHS)),
        "old_log_probs": _ragged(old),
        "rollout_log_probs": _ragged(row + 0.05 * torch.randn(len(row), generator=generator) for row in old),
        **{AdvantageBatch.BATCH_KEYS[name]: tensor for name, tensor in _segments().items()},
    }


def _step_batch() -> KVBatchMeta:
    """The step's TransferQueue rows, keyed {uid}_{session}_{index}: one output per session, as a single-turn agent
    loop writes them."""
    return KVBatchMeta(partition_id="train", keys=[f"{uid}_{i}_0" for i, uid in enumerate(UID)], tags=[{}] * len(UID))


def test_the_trainers_step_at_mix_zero_writes_what_verls_own_grpo_step_writes(make_trainer):
    """λ = 0 through the trainer's advantage step (the estimator called on the step's batch, with verl's rollout
    correction before it) against verl's own ``PPOTrainer._compute_advantage`` with ``grpo`` on the same fields:
    the same advantages, returns, mask and importance weights, bit for bit, and the same correction metrics."""
    correction = ("algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.rollout.n=4")
    batch = _step_batch()
    ours = make_trainer("algorithm.adv_estimator=rredcot", "algorithm.rredcot.redistribution.mix=0.0", *correction,
                        store=_step_fields())
    ours_metrics = {}
    ours._compute_advantage(batch, ours_metrics)

    verls = make_trainer("algorithm.adv_estimator=grpo", *correction, store=_step_fields())
    verl_metrics = {}
    trainer_base.PPOTrainer._compute_advantage(verls, batch, verl_metrics)

    for key in ("advantages", "returns", "response_mask", "rollout_is_weights"):
        assert torch.equal(ours.store[key].to_padded_tensor(0.0), verls.store[key].to_padded_tensor(0.0)), key
    assert any(key.startswith("rollout_corr/") for key in verl_metrics)
    assert {key: ours_metrics[key] for key in verl_metrics} == verl_metrics
    assert ours_metrics["rredcot/redistributed_frac"] > 0  # the diagnostics of what λ = 1 would have done


def test_the_trainers_step_refuses_inputs_whose_rows_do_not_match_the_uids(make_trainer):
    store = _step_fields()
    trainer = make_trainer("algorithm.adv_estimator=rredcot", store=store)
    fetch = trainer._fetch
    # The estimator's inputs come back in another row order than the step's fields.
    trainer._fetch = lambda batch, fields: ({**fetch(batch, fields), "uid": list(UID[::-1])}
                                            if "seg_ends" in fields else fetch(batch, fields))  # fmt: skip
    with pytest.raises(ValueError, match="rows do not match the batch's uid order"):
        trainer._compute_advantage(_step_batch(), {})
