"""Reference scorers, slow and simple, that the packed scoring (``rredcot_verl.core.scoring``) is tested and
benchmarked against: one forward per probe, and verl's plain log-prob pass over one trace; and the Qwen3 shapes and
synthetic trace sizes of the value-pass benchmarks (``value_pass.py`` scale and gpu).

Imports torch and the package's core only (``benchmarks/value_pass.py gpu`` runs where verl is not installed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rredcot_verl.core.probes import Probe
from rredcot_verl.core.scoring import check_inputs, probe_fits

# A synthetic trace of the value-pass benchmarks: a prompt, exit probes at NUM_BOUNDARIES boundaries, NUM_CANDIDATES
# answers (one correct, two incorrect: self-normalised values), exit text and answers of a few tokens.
PROMPT_LENGTH, NUM_BOUNDARIES, NUM_CANDIDATES, EXIT_LENGTH, ANSWER_LENGTH = 128, 40, 3, 4, 4
# name → Qwen3Config fields (real widths and vocabulary; the depth is the benchmark's choice).
MODELS = {
    "qwen3-0.6b": dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, tie_word_embeddings=True, rope_theta=1_000_000.0,
    ),
    "qwen3-4b": dict(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, tie_word_embeddings=True, rope_theta=1_000_000.0,
    ),
    "smoke": dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, tie_word_embeddings=True,
    ),
}


def _log_probs_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, V) logits, (L,) targets → per-token log-prob and entropy (L,), fp32 (what verl's log-prob pass gives)."""
    logits = logits.float()
    log_norm = logits.logsumexp(-1)
    log_probs = logits.gather(-1, targets[:, None])[:, 0] - log_norm
    entropy = log_norm - (logits.softmax(-1) * logits).sum(-1)
    return log_probs, entropy


@torch.no_grad()
def score_probes_naive(
    model,
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    probes: Sequence[Probe],
    *,
    max_positions: int | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Score each probe with its own forward pass over ``prompt + response[:b] + forced + scored``.

    Args:
        model: a causal LM returning ``.logits`` (B, T, V).
        prompt_ids: (P,) token ids, P ≥ 1.
        response_ids: (L,) token ids, L ≥ 0.
        probes: n_probes probes with 0 ≤ boundary ≤ L.
        max_positions: position budget (the model's max_position_embeddings); longer probes are skipped.
        temperature: log-probs under softmax(logits / temperature).

    Returns:
        (n_probes,) fp32: Σ log π(scored tokens | everything before); NaN for skipped probes.
    """
    check_inputs(prompt_ids, response_ids, probes)
    device = model.get_input_embeddings().weight.device
    prompt_len = prompt_ids.numel()
    scores = torch.full((len(probes),), float("nan"), dtype=torch.float32)
    for index, probe in enumerate(probes):
        if not probe_fits(probe, prompt_len, max_positions):
            continue
        tokens = torch.cat(
            [prompt_ids.long(), response_ids[: probe.boundary].long(), torch.tensor(probe.tokens, dtype=torch.long)]
        ).to(device)
        log_probs = (model(input_ids=tokens[None]).logits[0].float() / temperature).log_softmax(-1)
        first_scored = tokens.numel() - len(probe.scored_ids)
        positions = torch.arange(first_scored, tokens.numel(), device=device)
        scores[index] = log_probs[positions - 1, tokens[positions]].sum().cpu()
    return scores


@torch.no_grad()
def trace_log_probs_and_entropy(
    model, prompt_ids: torch.Tensor, response_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain log-prob pass over one trace, as verl runs it (full logits at the response positions, no cache):
    the baseline the probe cost is measured against.

    Returns:
        log_probs (L,), entropy (L,), fp32.
    """
    check_inputs(prompt_ids, response_ids, ())
    device = model.get_input_embeddings().weight.device
    tokens = torch.cat([prompt_ids.long(), response_ids.long()]).to(device)
    logits = model(input_ids=tokens[None], use_cache=False, logits_to_keep=response_ids.numel() + 1).logits[0]
    log_probs, entropy = _log_probs_and_entropy(logits[:-1], response_ids.long().to(device))
    return log_probs.cpu(), entropy.cpu()
