"""Leave-one-out and gradient × input attribution on a tiny random Qwen2, against independent computations."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from benchmarks.attribution import gradient_times_input_attribution, leave_one_out_attribution

VOCAB = 50


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def inputs():
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (5,), generator=generator)
    response = torch.randint(0, VOCAB, (12,), generator=generator)
    return prompt, response, [3, 3, 7, 10], [7, 8], [9, 10, 11]  # ends (one empty segment; 2 tokens stay after)


def answer_log_prob(model, tokens: torch.Tensor, num_answer: int) -> float:
    log_probs = model(input_ids=tokens[None]).logits[0].float().log_softmax(-1)
    positions = torch.arange(tokens.numel() - num_answer, tokens.numel())
    return float(log_probs[positions - 1, tokens[positions]].sum())


def test_leave_one_out_matches_unbatched_forwards(model, inputs):
    prompt, response, ends, exit_ids, answer = inputs
    tail = torch.tensor(exit_ids + answer)
    with torch.no_grad():
        full = answer_log_prob(model, torch.cat([prompt, response, tail]), len(answer))
        starts = [0, *ends[:-1]]
        expected = [full - answer_log_prob(model, torch.cat([prompt, response[:s], response[e:], tail]), len(answer))
                    if e > s else 0.0 for s, e in zip(starts, ends)]
    attribution = leave_one_out_attribution(model, prompt, response, ends, exit_ids, answer)
    assert attribution.shape == (len(ends),)
    assert attribution[1] == 0.0  # the empty segment
    torch.testing.assert_close(attribution, torch.tensor(expected), atol=1e-4, rtol=1e-4)
    assert attribution.abs().max() > 1e-3  # removing real tokens changes a random model's answer log-prob


def test_gradient_times_input_is_the_derivative_along_segment_scaling(model, inputs):
    """Σ_t ∇e_t · e_t over segment k = d/dα log p(answer), segment k's embeddings scaled by α, at α = 1."""
    prompt, response, ends, exit_ids, answer = inputs
    attribution = gradient_times_input_attribution(model, prompt, response, ends, exit_ids, answer)
    assert attribution.shape == (len(ends),)
    assert all(parameter.grad is None for parameter in model.parameters())

    tokens = torch.cat([prompt, response, torch.tensor(exit_ids + answer)])
    embeddings = model.get_input_embeddings()(tokens).detach().double()
    model_64 = model.double()
    try:
        def scaled_log_prob(start: int, end: int, alpha: float) -> float:
            scaled = embeddings.clone()
            scaled[prompt.numel() + start: prompt.numel() + end] *= alpha
            with torch.no_grad():
                log_probs = model_64(inputs_embeds=scaled[None]).logits[0].log_softmax(-1)
            positions = torch.arange(tokens.numel() - len(answer), tokens.numel())
            return float(log_probs[positions - 1, tokens[positions]].sum())

        step = 1e-4
        derivatives = [(scaled_log_prob(s, e, 1 + step) - scaled_log_prob(s, e, 1 - step)) / (2 * step)
                       for s, e in zip([0, *ends[:-1]], ends)]
    finally:
        model.float()
    assert attribution[1] == 0.0
    torch.testing.assert_close(attribution, torch.tensor(derivatives, dtype=torch.float32), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("attribute", [leave_one_out_attribution, gradient_times_input_attribution])
def test_bad_inputs_raise_clear_errors(model, inputs, attribute):
    prompt, response, _, exit_ids, answer = inputs
    with pytest.raises(ValueError, match="non-decreasing"):
        attribute(model, prompt, response, [5, 3], exit_ids, answer)
    with pytest.raises(ValueError, match="exceeds the response length"):
        attribute(model, prompt, response, [4, 13], exit_ids, answer)
    with pytest.raises(ValueError, match="answer_ids must be non-empty"):
        attribute(model, prompt, response, [4, 12], exit_ids, [])
    with pytest.raises(ValueError, match="at least one segment"):
        attribute(model, prompt, response, [], exit_ids, answer)
    with pytest.raises(ValueError, match="prompt_ids must be non-empty"):
        attribute(model, prompt[:0], response, [4, 12], exit_ids, answer)
