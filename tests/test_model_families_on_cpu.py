"""Model families through the value pass: each either gives the model's own log-probs (its logit scaling, softcap and
output bias included) or is refused, by the one predicate (``core.model_support.value_pass_refusal``) that both the
launch (from the model folder's config, before Ray) and the value pass (before scoring) ask. Tiny models of each
family, built from their transformers configs (``benchmarks.model_families``), random weights."""

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.model_families import tiny_model
from benchmarks.reference_scorers import score_probes_naive
from composing import compose_recipe
from rredcot_verl.core import scoring
from rredcot_verl.core.model_support import LogitTransform, logit_transform, value_pass_refusal
from rredcot_verl.core.probes import Probe
from rredcot_verl.integration.estimators import ESTIMATORS
from rredcot_verl.integration.launcher import LaunchError, check

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 64
# family -> what makes it more than a plain decoder for the value pass
SCORED = {
    "qwen2": "plain", "qwen3": "q/k norms", "llama": "plain", "mistral": "no window",
    "cohere": "logit_scale", "granite": "multipliers and logits_scaling", "phi3": "fused projections",
    "phi": "an output-layer bias", "gemma2_full_attention": "final_logit_softcapping",
}  # fmt: skip
# family -> the key its refusal names
REFUSED = {"gemma2": "layer_types with sliding_attention layers (sliding_window=16)",
           "qwen3_next": "layer_types with linear_attention layers",
           "qwen2_vl": "vision_config (a multimodal model"}  # fmt: skip


def _model(name: str):
    """The family's tiny model with weights spread wide enough (std 0.3) that its logits are far from uniform: a
    missed scale or cap then moves log-probs by far more than the tolerance."""
    model = tiny_model(name, VOCAB)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
        head = model.get_output_embeddings()
        if head.bias is not None:
            head.bias.copy_(torch.randn(head.bias.shape, generator=generator))
    return model


def _trace(seed: int = 0):
    rng = random.Random(seed)
    prompt = torch.tensor([rng.randrange(2, VOCAB) for _ in range(5)])
    response = torch.tensor([rng.randrange(2, VOCAB) for _ in range(40)])
    probes = [Probe(boundary, [3, 4], [5, 6, 7], value_index=k) for k, boundary in enumerate((0, 13, 27, 40))]
    return prompt, response, probes


def _own_log_probs(model, prompt, response, temperature):
    """What verl's log-prob pass computes: the model's own logits over the response, divided by the temperature."""
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0, prompt.numel() - 1 : -1].float()
    log_probs = (logits / temperature).log_softmax(-1)
    return log_probs.gather(-1, response[:, None])[:, 0], -(log_probs.exp() * log_probs).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("family", sorted(SCORED))
def test_the_value_pass_gives_each_accepted_familys_own_log_probs(family, temperature):
    torch.set_num_threads(1)
    model = _model(family)
    assert value_pass_refusal(model.config, model) is None and value_pass_refusal(model.config) is None
    prompt, response, probes = _trace()
    scores = scoring.score_batch_packed(model, [prompt], [response], [probes], temperature=temperature)[0]
    own, own_entropy = _own_log_probs(model, prompt, response, temperature)
    torch.testing.assert_close(scores.trace_log_probs, own, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(scores.trace_entropy, own_entropy, rtol=1e-5, atol=2e-5)
    naive = score_probes_naive(model, prompt, response, probes, temperature=temperature)
    torch.testing.assert_close(scores.probe_logp, naive, rtol=1e-5, atol=2e-5)


def test_the_value_pass_scores_a_lora_adapted_model_as_it_samples():
    """verl's LoRA actor is a peft model (``model.lora_rank`` > 0): the value pass scores it with its adapters, as
    its own forward does (adapters set non-zero, so that they move the log-probs)."""
    from peft import LoraConfig, get_peft_model

    torch.set_num_threads(1)
    model = get_peft_model(_model("qwen2"), LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: the adapted model would equal the base one
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    assert value_pass_refusal(model.config, model) is None
    prompt, response, probes = _trace()
    scores = scoring.score_batch_packed(model, [prompt], [response], [probes], temperature=0.7)[0]
    own, _ = _own_log_probs(model, prompt, response, 0.7)
    torch.testing.assert_close(scores.trace_log_probs, own, rtol=1e-5, atol=2e-5)
    with model.disable_adapter():
        base, _ = _own_log_probs(model, prompt, response, 0.7)
    assert (base - own).abs().max() > 0.05


@pytest.mark.parametrize("family", ["cohere", "granite", "gemma2_full_attention", "phi"])
def test_the_logit_changes_reproduced_are_ones_that_matter(family):
    """The output layer's projection alone (as the value pass computed it before) is far from these families' own
    log-probs: the equality above is not a coincidence of tiny logits."""
    model = _model(family)
    prompt, response, _ = _trace()
    ids = torch.cat([prompt, response])[None]
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0, prompt.numel() - 1 : -1]
        head = model.get_output_embeddings()
        temperature = 0.7
        # Before: h / T through the head, bias included (a bias at T != 1 was refused), no scale, no cap.
        projected = head(hidden / temperature).float().log_softmax(-1).gather(-1, response[:, None])[:, 0]
    own, _ = _own_log_probs(model, prompt, response, temperature)
    assert (projected - own).abs().max() > 0.05
    if family != "phi":
        assert logit_transform(model.config) != LogitTransform()


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_families_the_value_pass_cannot_score_are_refused_before_scoring(family):
    model = tiny_model(family, VOCAB)
    refusal = value_pass_refusal(model.config, model)
    assert refusal is not None and REFUSED[family] in str(refusal)
    prompt, response, probes = _trace()
    with pytest.raises(ValueError, match="^" + re.escape(f"the value pass cannot score this model exactly: {str(refusal)[:40]}")):
        scoring.score_batch_packed(model, [prompt], [response], [probes])


def test_scoring_gemma2s_sliding_softcapped_layers_anyway_would_be_wrong(monkeypatch):
    """Why Gemma2 as published is refused: past its window (16 tokens here) and with softcapped attention scores, the
    value pass's full sdpa attention gives other log-probs than the model's own."""
    model = _model("gemma2")
    monkeypatch.setattr(scoring, "value_pass_refusal", lambda config, model=None: None)
    prompt, response, probes = _trace()
    scores = scoring.score_batch_packed(model, [prompt], [response], [probes])[0]
    own, _ = _own_log_probs(model, prompt, response, 1.0)
    assert (scores.trace_log_probs - own).abs().max() > 1e-3


def _family_folder(build: Path, family: str) -> None:
    """``build/model`` replaced by the family's tiny model with the embedded tokenizer (what the launch reads)."""
    import json

    vocab = json.loads((build / "model" / "config.json").read_text())["vocab_size"]
    (build / "model" / "model.safetensors").unlink()
    tiny_model(family, vocab).save_pretrained(build / "model")


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_the_launch_refuses_them_from_the_model_folder_naming_the_key(build, monkeypatch, family):
    monkeypatch.setenv("RREDCOT_CPU", "1")
    _family_folder(build, family)
    for estimator in ("rredcot", "rredcot_ibpo"):
        with pytest.raises(LaunchError) as error:
            check(compose_recipe(str(ROOT / "recipes" / "tiny_cpu"), estimator))
        message = str(error.value)
        assert message.startswith(f"actor_rollout_ref.model.path is a {tiny_model(family, VOCAB).config.model_type} "
                                  f"model with {REFUSED[family]}") and "\n" not in message  # fmt: skip
        assert f"algorithm.adv_estimator={estimator} cannot score it exactly" in message
    for estimator in ("grpo", "ibpo", "segment_mc"):  # no value pass: the family is verl's and vLLM's to run
        check(compose_recipe(str(ROOT / "recipes" / "tiny_cpu"), estimator))


@pytest.mark.parametrize("family", ["cohere", "granite", "phi"])
def test_the_launch_accepts_the_families_the_value_pass_reproduces(build, monkeypatch, family):
    monkeypatch.setenv("RREDCOT_CPU", "1")
    _family_folder(build, family)
    assert check(compose_recipe(str(ROOT / "recipes" / "tiny_cpu"), "rredcot")) == []


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_the_trainer_refuses_them_before_its_workers_start(build, make_trainer, family):
    """The launch reads the model's config only where it is on its machine (a hub model not yet downloaded is named
    as skipped); the trainer asks the same predicate of the config verl's driver has fetched, before the workers are
    built and before any rollout. verl's own estimators and IBPO, which need no value pass, are left to verl."""
    from rredcot_verl.integration.trainer import SegmentActorRolloutRefWorker

    _family_folder(build, family)
    for estimator in ("rredcot", "rredcot_ibpo", "ibpo", "grpo"):
        trainer = make_trainer(f"algorithm.adv_estimator={estimator}")
        trainer.config.actor_rollout_ref.model.path = str(build / "model")
        if ESTIMATORS.get(estimator) is not None and ESTIMATORS[estimator].uses_value_pass:
            with pytest.raises(ValueError) as error:
                trainer._init_resource_pool_mgr()
            assert str(error.value).startswith(f"actor_rollout_ref.model.path is a "
                                               f"{tiny_model(family, VOCAB).config.model_type} model with "
                                               f"{REFUSED[family]}")  # fmt: skip
            assert not hasattr(trainer, "role_worker_mapping")
        else:
            trainer._init_resource_pool_mgr()
            workers = [getattr(cls, "__ray_actor_class__", None) for cls in trainer.role_worker_mapping.values()]
            assert SegmentActorRolloutRefWorker in workers


def test_check_only_refuses_a_hybrid_model_folder_in_one_line_and_writes_nothing(build, tmp_path):
    """The command a user runs: exit 2, one line naming the key, no hydra output folder in the working directory."""
    _family_folder(build, "qwen3_next")
    work = tmp_path / "cwd"
    work.mkdir()
    env = {**os.environ, "RREDCOT_CPU": "1"}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        [sys.executable, "-m", "rredcot_verl.main", "--check-only", "--config-dir", str(ROOT / "recipes/tiny_cpu"),
         "--config-name", "rredcot"],
        capture_output=True, text=True, env=env, timeout=300, cwd=work,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    refusal = [line for line in result.stderr.splitlines() if line.startswith("rredcot_verl:")]
    assert refusal == [result.stderr.strip().splitlines()[-1]] and "Traceback" not in result.stderr
    assert refusal[0].startswith(
        "rredcot_verl: actor_rollout_ref.model.path is a qwen3_next model with layer_types with linear_attention layers"
    )
    assert list(work.iterdir()) == []



def test_the_usage_doc_shows_the_survey_of_this_transformers():
    """docs/usage.md's "Model families" table is the survey's output; on another transformers (verl's pinned one) the
    survey differs and the doc names the version it was made on."""
    import re

    import transformers

    from benchmarks.model_families import survey

    doc = (ROOT / "docs" / "usage.md").read_text()
    surveyed = re.search(r"Surveyed on transformers (\S+) ", doc).group(1)
    if surveyed != transformers.__version__:
        pytest.skip(f"the doc's survey was made on transformers {surveyed}, this is {transformers.__version__}")
    assert survey() in doc
