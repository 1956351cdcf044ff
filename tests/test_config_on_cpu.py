"""algorithm.rredcot: strict reading, yaml defaults equal to the dataclass defaults, recipes compose."""

from itertools import product
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rredcot_verl.core.settings import (
    AUTO,
    AUTO_KEYS,
    DataOffer,
    RRedCoTSettings,
    choose_auto,
    default_section,
    defaults_yaml,
    settings_from_config,
)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "rredcot_verl" / "conf"


def test_defaults_yaml_is_generated_from_the_dataclasses():
    # One source of defaults: the yaml hydra composes is the dataclasses' output (regenerate it when this fails).
    assert (CONF / "rredcot_defaults.yaml").read_text() == defaults_yaml()
    section = OmegaConf.to_container(OmegaConf.load(CONF / "rredcot_defaults.yaml").algorithm.rredcot)
    assert settings_from_config({"rredcot": section}) == RRedCoTSettings()


def test_configuration_reference_is_generated_from_the_dataclasses():
    """docs/configuration.md lists every key with its default and its docstring (regenerate it when this fails; a
    field without an Attributes entry fails the generator)."""
    from rredcot_verl.core.settings import REFERENCE_FILE, configuration_reference

    text = configuration_reference()
    assert REFERENCE_FILE.read_text() == text
    for key in ("`probe.value_source`", "`redistribution.min_value_concordance`", "`segment_mc.max_tokens` | `null`"):
        assert key in text


@pytest.mark.parametrize(
    "section, message",
    [
        ({"redistribution": {"mixx": 0.5}}, "unknown key(s) ['mixx'] in algorithm.rredcot.redistribution"),
        ({"probes": {}}, "unknown key(s) ['probes'] in algorithm.rredcot"),
        ({"redistribution": {"mix": 2.0}}, "mix (lambda) must lie in [0, 1]"),
        ({"probe": {"value_source": "oracle"}}, "value_source must be one of"),
        ({"redistribution": {"norm_adv_by_std": False}}, "norm_adv_by_std_in_grpo"),
        ({"segmentation": 3}, "algorithm.rredcot.segmentation must be a mapping"),
        ({"task": ""}, "task must be a task name or 'module:attr'"),
        ({"reward_range": [1.0, -1.0]}, "reward_range must be (low, high) with low < high"),
    ],
)
def test_bad_settings_are_rejected_with_the_key_named(section, message):
    with pytest.raises(ValueError) as error:
        settings_from_config({"rredcot": section})
    assert message in str(error.value)


def test_missing_section_gives_defaults():
    assert settings_from_config({}) == RRedCoTSettings()
    assert settings_from_config(None) == RRedCoTSettings()


def _compose(config_dir: Path, name: str, overrides=()):
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


@pytest.mark.parametrize("recipe", ["grpo", "rredcot", "ibpo", "segment_mc"])
def test_tiny_cpu_recipes_compose_with_verls_config(recipe, monkeypatch):
    monkeypatch.setenv("RREDCOT_BUILD", "/build")
    monkeypatch.setenv("RREDCOT_REWARD_FILE", "/reward.py")
    config = _compose(ROOT / "recipes" / "tiny_cpu", recipe)
    assert config.algorithm.adv_estimator == recipe
    assert config.actor_rollout_ref.model.path == "/build/model"
    assert config.actor_rollout_ref.rollout.n == 4
    settings_from_config(config.algorithm)


def test_cli_typo_in_rredcot_section_is_a_hydra_error(monkeypatch):
    monkeypatch.setenv("RREDCOT_BUILD", "/build")
    monkeypatch.setenv("RREDCOT_REWARD_FILE", "/reward.py")
    with pytest.raises(Exception) as error:
        _compose(ROOT / "recipes" / "tiny_cpu", "rredcot", ["algorithm.rredcot.redistribution.mixx=0.5"])
    assert "mixx" in str(error.value)


@pytest.mark.parametrize(
    "recipe, model, budget, lr",
    [
        ("qwen3_4b_numina_rredcot", "Qwen/Qwen3-4B", 25000, 5e-7),
        ("qwen3_4b_numina_grpo", "Qwen/Qwen3-4B", 25000, 1e-6),
        ("r1_distill_1p5b_openrs_rredcot", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", 1024, 5e-7),
    ],
)
def test_paper_recipes_compose_and_validate(recipe, model, budget, lr, monkeypatch):
    """Composed with verl's own config and checked by verl's validate_config (not run: they need GPUs)."""
    from verl.utils.config import validate_config

    from verl.utils.import_utils import load_extern_object

    from rredcot_verl.tasks.math_reward import compute_score

    monkeypatch.setenv("DATA_DIR", "/data")
    config = _compose(ROOT / "recipes" / "paper", recipe)
    OmegaConf.resolve(config)
    assert config.actor_rollout_ref.model.path == model
    assert config.actor_rollout_ref.rollout.n == 4
    assert config.data.max_response_length == budget
    assert config.actor_rollout_ref.actor.optim.lr == lr
    # Named by module, so reward workers on any node import their installed copy (no path of the submitting machine).
    assert config.reward.custom_reward_function.path.startswith("pkg://")
    assert load_extern_object(config.reward.custom_reward_function.path, "compute_score") is compute_score
    settings_from_config(config.algorithm)
    validate_config(config=config, use_reference_policy=False, use_critic=False)


@pytest.mark.parametrize(
    "response, truth, expected",
    [("so \\boxed{\\frac{1}{2}}", "0.5", 1.0), ("\\boxed{3} then \\boxed{4}", "4", 1.0), ("no answer", "4", 0.0),
     ("\\boxed{5}", "4", 0.0)],
)
def test_math_reward_uses_math_verify_on_the_last_boxed(response, truth, expected):
    from rredcot_verl.tasks.math_reward import compute_score

    assert compute_score("numina", response, truth) == expected


# ------------------------------------------------------------------------------------- auto: chosen from the data
OFFERS = [DataOffer(worked_solutions=w, multi_turn=m) for w, m in product((True, False, None), (False, True))]


@pytest.mark.parametrize("estimator", ["rredcot", "rredcot_ibpo", "segment_mc", "ibpo", "grpo"])
@pytest.mark.parametrize("offer", OFFERS)
def test_every_auto_choice_is_a_configuration_the_settings_accept(estimator, offer):
    """Whatever the estimator and the data, ``auto`` resolves every key, to values the strict reader accepts; a line
    says why wherever the estimator reads them."""
    section = default_section()
    choice = choose_auto(section, estimator, offer)
    assert set(choice.values) == set(AUTO_KEYS) and AUTO not in choice.values.values()
    settings = settings_from_config({"adv_estimator": estimator, "rredcot": section}, offer)
    assert (settings.probe.value_source, settings.candidates.source) == (
        choice.values["probe.value_source"], choice.values["candidates.source"])
    assert (choice.reason is None) == (estimator in ("ibpo", "grpo"))


def test_auto_that_needs_the_data_is_refused_without_it_naming_the_key():
    with pytest.raises(ValueError, match=r"algorithm.rredcot.candidates.source=auto is chosen from the training data"):
        settings_from_config({"adv_estimator": "rredcot", "rredcot": default_section()})
    # An explicit bank leaves nothing to the data.
    section = default_section()
    section["candidates"]["source"] = "group_and_repairs"
    settings = settings_from_config({"adv_estimator": "rredcot", "rredcot": section})
    assert (settings.probe.value_source, settings.redistribution.degenerate_groups) == (
        "reference_continuation", "value_differences")


def test_rredcot_on_code_with_auto_names_what_applies():
    section = default_section()
    section["task"] = "code"
    with pytest.raises(ValueError, match="use adv_estimator=segment_mc or ibpo, or set probe.value_source=own_continuation"):
        choose_auto(section, "rredcot", DataOffer(worked_solutions=False))
