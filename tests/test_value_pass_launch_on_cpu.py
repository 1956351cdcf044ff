"""Launch-time refusal of configurations the value pass cannot serve: Ulysses sequence parallelism."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from rredcot_verl.integration.launcher import LaunchError, prepare

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def recipe_environment(monkeypatch):
    """The variables the tiny recipe reads (the launcher names a missing one before any other check), pointing
    nowhere: these refusals come before any file is read."""
    monkeypatch.setenv("RREDCOT_BUILD", "/nonexistent-build")
    monkeypatch.setenv("RREDCOT_REWARD_FILE", "/nonexistent-reward.py")


def _config(overrides):
    with initialize_config_dir(config_dir=str(ROOT / "recipes" / "tiny_cpu"), version_base=None):
        return compose(config_name="rredcot", overrides=list(overrides))


@pytest.mark.parametrize(
    "estimator, why",
    [("rredcot", "the segment value pass scores whole traces per rank"),
     ("rredcot_ibpo", "the segment value pass scores whole traces per rank"),
     # segment_mc runs no value pass: its refusal names what it does on whole traces
     ("segment_mc", "its segment boundaries are cut on whole traces from the entropies of verl's log-prob pass")],
)  # fmt: skip
def test_ulysses_with_a_whole_trace_estimator_is_refused_naming_the_key(estimator, why, monkeypatch):
    monkeypatch.setenv("RREDCOT_CPU", "1")
    overrides = [f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]
    with pytest.raises(LaunchError) as error:
        prepare(_config(overrides))
    assert str(error.value).startswith(
        f"actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 is not supported with algorithm.adv_estimator="
        f"{estimator}: {why}"
    )


def test_ulysses_without_a_value_pass_is_not_refused_by_this_check(monkeypatch):
    monkeypatch.setenv("RREDCOT_CPU", "1")
    config = _config(["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                      "actor_rollout_ref.model.path=/nonexistent"])
    # The launcher goes on to its next check, the model folder's (the data files' "does not exist" would not do).
    refusal = r"^model folder '/nonexistent' does not exist \(actor_rollout_ref\.model\.path\)"
    with pytest.raises(LaunchError, match=refusal):
        prepare(config)
