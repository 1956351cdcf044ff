"""What protects the value pass on the GPU paths a paper-scale run takes, checked with the real pieces on CPU:
verl's fused-kernel forward patch, bf16 read logits at Qwen3's vocabulary, and FSDP2 offload's device split."""

import random

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from rredcot_verl.core.scoring import _chunked_head, execution_device, score_batch_packed
from test_probes_on_cpu import random_ids, random_probes
from test_value_pass_on_cpu import continuation_batch

QWEN3_VOCAB = 151_936


def _tiny_qwen3(seed=0):
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen3ForCausalLM(config).eval()


def _batch(seed=1, traces=3):
    rng = random.Random(seed)
    prompts = [random_ids(rng, rng.randrange(3, 8)) % 96 for _ in range(traces)]
    responses = [random_ids(rng, rng.randrange(10, 30)) % 96 for _ in range(traces)]
    probes = [random_probes(rng, response.numel(), 6) for response in responses]
    for trace_probes in probes:  # the shared helper draws ids from a 64-token vocabulary: valid here too
        assert all(max(p.tokens) < 96 for p in trace_probes)
    return prompts, responses, probes


@pytest.fixture()
def fused_kernel_patch():
    """verl's own monkey patch (as its FSDP engine applies it for ``use_fused_kernels=True``); undone afterwards,
    since it replaces the model class's forward for the whole process."""
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    original = Qwen3ForCausalLM.forward

    def apply(model):
        apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True, fused_kernels_backend="torch")
        assert Qwen3ForCausalLM.forward is not original, "verl no longer patches the class forward: revisit the test"

    yield apply
    Qwen3ForCausalLM.forward = original


def test_value_pass_under_verls_fused_kernel_forward_matches_the_plain_model(fused_kernel_patch):
    model = _tiny_qwen3()
    prompts, responses, probes = _batch()
    with torch.no_grad():
        plain = score_batch_packed(model, prompts, responses, probes, return_trace_stats=True)
        fused_kernel_patch(model)
        # The patched forward refuses return_dict=False and reads lm_head.weight without calling lm_head.
        with pytest.raises(NotImplementedError):
            model(input_ids=prompts[0][None], return_dict=False)
        fused = score_batch_packed(model, prompts, responses, probes, return_trace_stats=True)
    for a, b in zip(plain, fused):
        torch.testing.assert_close(b.probe_logp, a.probe_logp, rtol=0, atol=1e-5, equal_nan=True)
        torch.testing.assert_close(b.trace_log_probs, a.trace_log_probs, rtol=0, atol=1e-5)
        assert torch.isfinite(a.probe_logp[~a.probe_logp.isnan()]).all() and (~a.probe_logp.isnan()).any()


def test_continuations_attend_block_by_block_under_verls_fused_kernel_forward(fused_kernel_patch,
                                                                              blocked_attention_calls):
    """verl's fused-kernel forward calls the decoder with its named arguments only, so the value pass hands the probe
    blocks to that call itself: continuations still attend block by block there, with the dense mask's log-probs."""
    model = _tiny_qwen3()
    prompts, responses, probes = continuation_batch(1)
    blocked_calls = blocked_attention_calls
    with torch.no_grad():
        # 0: never block by block; 1: wherever the trees cut into blocks
        dense = score_batch_packed(model, prompts, responses, probes, blocked_attention_share=0.0)
        assert not blocked_calls
        fused_kernel_patch(model)
        fused = score_batch_packed(model, prompts, responses, probes, blocked_attention_share=1.0)
    assert blocked_calls
    for a, b in zip(dense, fused):
        torch.testing.assert_close(b.probe_logp, a.probe_logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.trace_log_probs, a.trace_log_probs, rtol=0, atol=1e-5)


class _Head(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None


def test_bf16_read_logits_are_projected_in_fp32_at_qwen3s_vocabulary():
    """Hidden states and head weight in bf16 as the actor holds them, logits of magnitude 16-32 as a trained
    model's top tokens have: the read log-probs equal the float64 projection of the same bf16 numbers; a bf16
    matmul would round each logit to 0.125."""
    generator = torch.Generator().manual_seed(0)
    width, rows = 64, 24
    weight = (torch.randn(QWEN3_VOCAB, width, generator=generator) * 0.5).to(torch.bfloat16)
    targets = torch.randint(0, QWEN3_VOCAB, (rows,), generator=generator)
    hidden = torch.randn(rows, width, generator=generator)
    # Point each hidden state at its target so the scored logit is large (≈ 16-32), as for a confident model.
    hidden = hidden + weight[targets].float() * torch.linspace(0.5, 1.0, rows, dtype=torch.float32)[:, None]
    hidden = hidden.to(torch.bfloat16)
    exact_logits = hidden.double() @ weight.double().T
    exact = exact_logits.gather(-1, targets[:, None])[:, 0] - exact_logits.logsumexp(-1)
    assert exact_logits.gather(-1, targets[:, None]).abs().max() > 16
    log_probs, entropy = _chunked_head(_Head(weight), hidden, targets, entropy=True)
    assert log_probs.dtype == torch.float32
    torch.testing.assert_close(log_probs.double(), exact, rtol=0, atol=2e-4)
    exact_entropy = exact_logits.logsumexp(-1) - (exact_logits.softmax(-1) * exact_logits).sum(-1)
    torch.testing.assert_close(entropy.double(), exact_entropy, rtol=0, atol=2e-4)
    # What rounding the logits to bf16 would have cost on the same rows.
    rounded = (hidden @ weight.T).double()
    bf16_error = (rounded.gather(-1, targets[:, None])[:, 0] - rounded.logsumexp(-1) - exact).abs().max()
    assert bf16_error > 10 * (log_probs.double() - exact).abs().max()


def test_execution_device_follows_buffers_not_offloaded_parameters():
    """FSDP2's CPU offload keeps sharded parameters on the CPU while buffers and activations are on the GPU: the
    value pass puts its inputs where the buffers are (here a parameter on the meta device stands for the offloaded
    one), and its reads on the hidden states' device."""
    model = _tiny_qwen3()
    assert execution_device(model) == torch.device("cpu")
    model.model.embed_tokens.to("meta")
    assert execution_device(model) == torch.device("cpu")
