"""Probe scoring: the packed path (trace KV cache + one probe-tree pass) against the naive per-probe reference,
with a real (tiny, random) Qwen2 model; value reducers and builders against direct computations."""

import math
import random

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rredcot_verl.core.probes import (
    KIND_CORRECT,
    KIND_INCORRECT,
    Probe,
    ProbeSettings,
    build_exit_probes,
    build_reference_probes,
    own_continuation_values,
    values_from_probe_logp,
)
from rredcot_verl.core.scoring import build_probe_mask, score_batch_packed, score_probes_packed
from benchmarks.reference_scorers import score_probes_naive, trace_log_probs_and_entropy

VOCAB = 64
REL_TOL = 1e-4


def make_model(attn_implementation="sdpa", num_key_value_heads=2, seed=0):
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=256,
        attn_implementation=attn_implementation,
    )
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return make_model()


def random_ids(rng, length):
    return torch.tensor([rng.randrange(VOCAB) for _ in range(length)], dtype=torch.long)


def random_probes(rng, response_len, count):
    """Boundaries include 0 and L; about half the probes have forced ids; some share forced and scored prefixes
    (so the packed path's token tree merges them)."""
    shared_forced = [rng.randrange(VOCAB) for _ in range(3)]
    boundaries = [0, response_len] + [rng.randint(0, response_len) for _ in range(count)]
    probes = []
    for index in range(count):
        boundary = boundaries[index % len(boundaries)]
        forced = rng.choice([[], shared_forced, [rng.randrange(VOCAB)]])
        scored = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))]
        probes.append(Probe(boundary, forced, scored, value_index=index % 5))
        if rng.random() < 0.3:  # sibling with the same first scored token, different tail
            probes.append(Probe(boundary, forced, scored[:1] + [rng.randrange(VOCAB)], value_index=index % 5))
    return probes


def relative_error(actual, expected):
    return ((actual - expected).abs() / expected.abs().clamp_min(1e-12)).max().item()


def full_forward_stats(model, prompt, response):
    tokens = torch.cat([prompt, response])[None]
    with torch.no_grad():
        log_probs = model(input_ids=tokens).logits[0, prompt.numel() - 1 : -1].float().log_softmax(-1)
    token_log_probs = log_probs.gather(-1, response[:, None])[:, 0]
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return token_log_probs, entropy


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_packed_matches_naive_and_trace_stats_match_full_forward(model, seed):
    rng = random.Random(seed)
    prompt = random_ids(rng, rng.randint(1, 8))
    response = random_ids(rng, rng.randint(5, 40))
    probes = random_probes(rng, response.numel(), 12)

    naive = score_probes_naive(model, prompt, response, probes)
    packed = score_probes_packed(model, prompt, response, probes)

    assert packed.num_skipped == 0
    assert torch.isfinite(naive).all() and (naive < 0).all()
    assert relative_error(packed.probe_logp, naive) < REL_TOL
    expected_log_probs, expected_entropy = full_forward_stats(model, prompt, response)
    assert packed.trace_log_probs.shape == packed.trace_entropy.shape == (response.numel(),)
    torch.testing.assert_close(packed.trace_log_probs, expected_log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.trace_entropy, expected_entropy, rtol=1e-5, atol=1e-5)
    plain_log_probs, plain_entropy = trace_log_probs_and_entropy(model, prompt, response)
    torch.testing.assert_close(plain_log_probs, packed.trace_log_probs)
    torch.testing.assert_close(plain_entropy, packed.trace_entropy)
    # Without trace stats, only the needed trace logits are computed; the probe scores are the same.
    scores_only = score_probes_packed(model, prompt, response, probes, return_trace_stats=False)
    assert scores_only.trace_log_probs is None and scores_only.trace_entropy is None
    assert relative_error(scores_only.probe_logp, naive) < REL_TOL


@pytest.mark.parametrize("num_key_value_heads", [2, 1])
def test_eager_and_sdpa_agree(num_key_value_heads):
    rng = random.Random(7)
    sdpa_model = make_model("sdpa", num_key_value_heads)
    eager_model = make_model("eager", num_key_value_heads)
    assert eager_model.config._attn_implementation == "eager"
    prompt, response = random_ids(rng, 5), random_ids(rng, 30)
    probes = random_probes(rng, response.numel(), 10)

    eager = score_probes_packed(eager_model, prompt, response, probes)
    sdpa = score_probes_packed(sdpa_model, prompt, response, probes)

    assert relative_error(sdpa.probe_logp, eager.probe_logp) < REL_TOL
    assert relative_error(eager.probe_logp, score_probes_naive(eager_model, prompt, response, probes)) < REL_TOL
    torch.testing.assert_close(sdpa.trace_log_probs, eager.trace_log_probs, rtol=1e-5, atol=1e-5)


def test_empty_response_and_single_token_probes(model):
    rng = random.Random(3)
    prompt, response = random_ids(rng, 6), torch.zeros(0, dtype=torch.long)
    probes = [
        Probe(0, [], [5], value_index=0),  # read entirely from the trace pass
        Probe(0, [], [5, 9, 2], value_index=0),
        Probe(0, [1, 2], [7], value_index=1),
    ]
    packed = score_probes_packed(model, prompt, response, probes)
    assert packed.trace_log_probs.shape == (0,)
    assert relative_error(packed.probe_logp, score_probes_naive(model, prompt, response, probes)) < REL_TOL


def test_batch_equals_per_trace(model):
    rng = random.Random(4)
    prompts = [random_ids(rng, 3), random_ids(rng, 7)]
    responses = [random_ids(rng, 12), random_ids(rng, 0)]
    probes = [random_probes(rng, 12, 5), [Probe(0, [3], [4, 5], value_index=0)]]
    batch = score_batch_packed(model, prompts, responses, probes)
    for scores, prompt, response, trace_probes in zip(batch, prompts, responses, probes):
        single = score_probes_packed(model, prompt, response, trace_probes)
        torch.testing.assert_close(scores.probe_logp, single.probe_logp)
    with pytest.raises(ValueError, match="batch sizes differ"):
        score_batch_packed(model, prompts, responses[:1], probes)


def test_overlong_probes_are_skipped_and_counted(model):
    rng = random.Random(5)
    prompt, response = random_ids(rng, 4), random_ids(rng, 20)
    probes = [
        Probe(0, [1, 2], [3, 4], value_index=0),  # ends at position 8
        Probe(10, [1, 2], [3, 4], value_index=1),  # ends at 18: fits exactly
        Probe(11, [], [3], value_index=1),  # ends at 16
        Probe(15, [1, 2], [3, 4], value_index=2),  # ends at 23: skipped
        Probe(20, [], [3], value_index=3),  # ends at 25: skipped
    ]
    unlimited = score_probes_packed(model, prompt, response, probes)
    limited = score_probes_packed(model, prompt, response, probes, max_positions=18)

    assert limited.num_skipped == 2
    assert torch.isnan(limited.probe_logp).tolist() == [False, False, False, True, True]
    torch.testing.assert_close(limited.probe_logp[:3], unlimited.probe_logp[:3])
    naive = score_probes_naive(model, prompt, response, probes, max_positions=18)
    assert torch.isnan(naive).tolist() == [False, False, False, True, True]
    values = values_from_probe_logp(limited.probe_logp, probes, num_values=4, normalization="raw")
    assert torch.isfinite(values[:2]).all() and torch.isnan(values[2:]).all()
    for return_trace_stats in (True, False):
        everything_skipped = score_probes_packed(
            model, prompt, response, probes, max_positions=3, return_trace_stats=return_trace_stats
        )
        assert everything_skipped.num_skipped == len(probes) and torch.isnan(everything_skipped.probe_logp).all()
        assert (everything_skipped.trace_log_probs is not None) == return_trace_stats


def test_invalid_inputs_raise_clear_errors(model):
    prompt, response = torch.tensor([1, 2, 3]), torch.tensor([4, 5])
    with pytest.raises(ValueError, match="out of range"):
        score_probes_packed(model, prompt, response, [Probe(3, [], [1], value_index=0)])
    with pytest.raises(ValueError, match="scored_ids must be non-empty"):
        Probe(0, [1], [], value_index=0)
    with pytest.raises(ValueError, match="boundary must be >= 0"):
        Probe(-1, [], [1], value_index=0)
    with pytest.raises(ValueError, match="kind"):
        Probe(0, [], [1], value_index=0, kind="maybe")
    with pytest.raises(ValueError, match="prompt_ids must be a 1D tensor"):
        score_probes_packed(model, prompt[None], response, [])
    with pytest.raises(ValueError, match="response_ids must be a 1D tensor"):
        score_probes_naive(model, prompt, response[None], [])
    with pytest.raises(ValueError, match="prompt_ids must be non-empty"):
        score_probes_packed(model, prompt[:0], response, [])
    with pytest.raises(ValueError, match="integer token ids"):
        score_probes_packed(model, prompt.float(), response, [])
    with pytest.raises(ValueError, match="value_source"):
        ProbeSettings(value_source="oracle")
    with pytest.raises(ValueError, match="normalization"):
        ProbeSettings(normalization="softmax")


def test_probe_mask_follows_the_probe_tree():
    # Two trees: tokens 0 → 1 → {2, 3} at prefix 2, and token 4 alone at prefix 3; cache of 3 positions.
    mask = build_probe_mask(torch.tensor([2, 2, 2, 2, 3]), torch.tensor([-1, 0, 1, 1, -1]), 3, torch.float32)
    allowed = (mask[0, 0] == 0).int().tolist()
    assert mask.shape == (1, 1, 5, 8)
    assert allowed == [
        [1, 1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 1, 0, 0, 0],
        [1, 1, 0, 1, 1, 1, 0, 0],
        [1, 1, 0, 1, 1, 0, 1, 0],
        [1, 1, 1, 0, 0, 0, 0, 1],
    ]
    assert mask[0, 0, 0, 2].item() == torch.finfo(torch.float32).min


def test_raw_values_equal_sum_of_naive_probabilities(model):
    rng = random.Random(6)
    prompt, response = random_ids(rng, 5), random_ids(rng, 24)
    boundaries = [0, 8, 16, 24]
    banks = [[[1, 2, 3], [1, 2, 4], [1, 2, 3]], [[5]], [], [[6, 7], [8]]]  # duplicate entry counted once
    probes = build_reference_probes(boundaries, banks)
    assert [p.value_index for p in probes] == [0, 0, 1, 3, 3]

    naive = score_probes_naive(model, prompt, response, probes)
    values = values_from_probe_logp(score_probes_packed(model, prompt, response, probes).probe_logp, probes, 4, "raw")

    groups = torch.tensor([p.value_index for p in probes])
    for k in (0, 1, 3):
        assert math.isclose(values[k].item(), naive[groups == k].exp().sum().item(), rel_tol=1e-4)
    assert torch.isnan(values[2])  # empty bank: no estimate


def test_exit_probe_values_self_normalized_within_unit_interval(model):
    rng = random.Random(8)
    prompt, response = random_ids(rng, 5), random_ids(rng, 30)
    exit_ids, correct, wrong = [10, 11, 12], [[20, 21], [22]], [[23, 21], [24]]
    boundaries = [0, 10, 20, 30]
    probes = build_exit_probes(boundaries, exit_ids, correct, thinking_length=20, all_answers=wrong + correct)
    # Boundary 30 lies after the thinking part: no probes; each other boundary scores 2 correct + 2 incorrect.
    assert [p.value_index for p in probes].count(3) == 0
    assert [p.kind for p in probes if p.value_index == 0] == [KIND_CORRECT] * 2 + [KIND_INCORRECT] * 2
    assert all(p.forced_ids == tuple(exit_ids) for p in probes)

    # Every probe has forced ids, so without trace stats the trace pass computes no logits at all.
    logp = score_probes_packed(model, prompt, response, probes, return_trace_stats=False).probe_logp
    assert relative_error(logp, score_probes_naive(model, prompt, response, probes)) < REL_TOL
    raw = values_from_probe_logp(logp, probes, 4, "raw")
    normalized = values_from_probe_logp(logp, probes, 4, "self_normalized")

    assert torch.isnan(raw[3]) and torch.isnan(normalized[3])
    assert ((normalized[:3] >= 0) & (normalized[:3] <= 1)).all()
    assert (raw[:3] < normalized[:3]).all()  # the raw sum is the smaller lower bound
    probabilities = logp.exp()
    is_correct = torch.tensor([p.kind == KIND_CORRECT for p in probes])
    for k in range(3):
        in_group = torch.tensor([p.value_index == k for p in probes])
        expected = probabilities[in_group & is_correct].sum() / probabilities[in_group].sum()
        assert math.isclose(normalized[k].item(), expected.item(), rel_tol=1e-5)
    # Extremely small probabilities still normalise correctly in log space.
    tiny = values_from_probe_logp(logp - 500.0, probes, 4, "self_normalized")
    torch.testing.assert_close(tiny[:3], normalized[:3])


def test_values_from_probe_logp_rejects_bad_arguments():
    probes = [Probe(0, [], [1], value_index=2)]
    with pytest.raises(ValueError, match="value_index"):
        values_from_probe_logp(torch.zeros(1), probes, 2, "raw")
    with pytest.raises(ValueError, match="shape"):
        values_from_probe_logp(torch.zeros(2), probes, 3, "raw")
    with pytest.raises(ValueError, match="normalization"):
        values_from_probe_logp(torch.zeros(1), probes, 3, "mean")
    with pytest.raises(ValueError, match="correct_answers"):
        build_exit_probes([0], [1], [], thinking_length=0)


def test_own_continuation_values():
    log_probs = torch.tensor([-0.5, -1.0, -0.25, -2.0])
    values = own_continuation_values(log_probs, [0, 2, 4], outcome=1.0)
    torch.testing.assert_close(values, torch.tensor([math.exp(-3.75), math.exp(-2.25), 1.0]))
    assert (own_continuation_values(log_probs, [0, 2, 4], outcome=0.0) == 0).all()
    with pytest.raises(ValueError, match="boundaries"):
        own_continuation_values(log_probs, [5], outcome=1.0)
    with pytest.raises(ValueError, match="outcome"):
        own_continuation_values(log_probs, [0], outcome=2.0)
