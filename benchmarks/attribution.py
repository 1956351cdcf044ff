"""Attribution baselines for segment credit: leave-one-out and gradient × input (the analysis baselines the RREDCoT paper compares its values against).

Both score how much each segment of a response supports a target answer text after a forced exit from thinking
(the exit-probe setting): the input is ``prompt + response + exit + answer`` and the score is
log p(answer | prompt, response, exit), summed over the answer tokens.

* ``leave_one_out_attribution``: a_k = log p(answer | full response) − log p(answer | response without segment k).
  One batched forward of K + 1 sequences.
* ``gradient_times_input_attribution``: a_k = Σ_{t ∈ segment k} ∇_{e_t} log p(answer) · e_t over the input
  embeddings e_t. One forward and one backward; no parameter gradients are accumulated.

Positive a_k: the segment makes the answer more likely. Segments are given by exclusive ends into the response
(as ``segmentation.segment_response`` returns them); tokens after the last end always stay in the input.

This module imports neither verl nor ray.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rredcot_verl.core.scoring import check_inputs


def _check_inputs(prompt_ids, response_ids, segment_ends, exit_ids, answer_ids) -> list[int]:
    check_inputs(prompt_ids, response_ids, [])  # the token ids, as the value pass checks them
    if len(answer_ids) == 0:
        raise ValueError("answer_ids must be non-empty: the attributed score is log p(answer)")
    ends = [int(e) for e in segment_ends]
    if not ends:
        raise ValueError("segment_ends must hold at least one segment end")
    if any(end < previous for previous, end in zip([0, *ends], ends)):
        raise ValueError(f"segment_ends must be non-decreasing and >= 0, got {ends}")
    if ends[-1] > response_ids.numel():
        raise ValueError(f"segment_ends[-1]={ends[-1]} exceeds the response length {response_ids.numel()}")
    return ends


def _segment_starts(ends: list[int]) -> list[int]:
    return [0, *ends[:-1]]


def _device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


@torch.no_grad()
def leave_one_out_attribution(
    model,
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    segment_ends: Sequence[int],
    exit_ids: Sequence[int],
    answer_ids: Sequence[int],
) -> torch.Tensor:
    """Drop in log p(answer) when segment k's tokens are removed from the response.

    Args:
        model: causal LM returning ``.logits`` (B, T, V); right padding with an attention mask must be supported.
        prompt_ids: (P,) token ids, P ≥ 1.
        response_ids: (L,) token ids.
        segment_ends: (K,) exclusive ends, non-decreasing, last ≤ L; segment k is [ends[k-1], ends[k]), ends[-1] := 0.
        exit_ids: forced text after the response (conditioning only, may be empty).
        answer_ids: scored tokens (non-empty).

    Returns:
        (K,) fp32: log p(answer | full) − log p(answer | without segment k); exactly 0 for an empty segment.
    """
    ends = _check_inputs(prompt_ids, response_ids, segment_ends, exit_ids, answer_ids)
    device = _device(model)
    prompt, response = prompt_ids.long().cpu(), response_ids.long().cpu()
    tail = torch.tensor([*exit_ids, *answer_ids], dtype=torch.long)
    variants = [response] + [torch.cat([response[:start], response[end:]])
                             for start, end in zip(_segment_starts(ends), ends)]
    sequences = [torch.cat([prompt, variant, tail]) for variant in variants]
    lengths = torch.tensor([s.numel() for s in sequences])
    width = int(lengths.max())
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    attention_mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, : sequence.numel()] = sequence
        attention_mask[row, : sequence.numel()] = 1
    # Right padding: real tokens keep positions 0..T-1 and never attend to the padding after them.
    logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits.float()
    log_probs = logits.log_softmax(-1).cpu()
    num_answer = len(answer_ids)
    answer = torch.tensor(list(answer_ids), dtype=torch.long)
    scores = torch.empty(len(sequences))
    for row, length in enumerate(lengths.tolist()):
        positions = torch.arange(length - num_answer, length)
        scores[row] = log_probs[row, positions - 1, answer].sum()
    drops = scores[0] - scores[1:]
    empty = torch.tensor([end == start for start, end in zip(_segment_starts(ends), ends)])
    return drops.masked_fill(empty, 0.0)


def gradient_times_input_attribution(
    model,
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    segment_ends: Sequence[int],
    exit_ids: Sequence[int],
    answer_ids: Sequence[int],
) -> torch.Tensor:
    """Σ over segment k's tokens of ∇_{e_t} log p(answer | prompt, response, exit) · e_t.

    Args: as ``leave_one_out_attribution``.

    Returns:
        (K,) fp32; 0 for an empty segment.
    """
    ends = _check_inputs(prompt_ids, response_ids, segment_ends, exit_ids, answer_ids)
    device = _device(model)
    prompt_len = prompt_ids.numel()
    tokens = torch.cat(
        [prompt_ids.long().cpu(), response_ids.long().cpu(), torch.tensor([*exit_ids, *answer_ids], dtype=torch.long)]
    ).to(device)
    embeddings = model.get_input_embeddings()(tokens).detach().requires_grad_(True)
    with torch.enable_grad():
        logits = model(inputs_embeds=embeddings[None]).logits[0].float()
        first_answer = tokens.numel() - len(answer_ids)
        positions = torch.arange(first_answer, tokens.numel(), device=device)
        answer_logp = logits.log_softmax(-1)[positions - 1, tokens[positions]].sum()
        (gradient,) = torch.autograd.grad(answer_logp, embeddings)
    per_token = (gradient * embeddings.detach()).sum(-1).float().cpu()[prompt_len: prompt_len + response_ids.numel()]
    return torch.stack([per_token[start:end].sum() for start, end in zip(_segment_starts(ends), ends)])
