"""Helpers shared by the benchmarks: offline Monte-Carlo values, trace sampling on the embedded task, statistics.

Monte-Carlo value of a prefix (prompt + response[:b]): the mean task reward of N sampled continuations (temperature
sampling, no top-k/top-p) under the same response-length budget as training; a continuation that does not end with
EOS inside the budget is truncated and counts as a failure, as in ``segment_mc``.
"""

from __future__ import annotations

import json
import math
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers

from rredcot_verl.tasks.build import build
from rredcot_verl.tasks.reward import compute_score

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def build_task(out: Path) -> Path:
    """The task build under ``out`` (data + the committed warm start; reused when cached); returns ``out``."""
    build(str(out), log=lambda *args, **kwargs: None)
    return out


@dataclass
class MonteCarloResult:
    """values: (n,) fp32 in [0, 1]; generated_tokens: continuation tokens sampled in all (EOS included)."""

    values: torch.Tensor
    generated_tokens: int


@torch.no_grad()
def monte_carlo_values(
    model,
    tokenizer,
    prompts: list[list[int]],
    prefixes: list[list[int]],
    ground_truths: list[str],
    *,
    num_samples: int,
    max_response_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    batch_size: int = 512,
) -> MonteCarloResult:
    """Mean reward of ``num_samples`` sampled continuations of each prefix.

    Args:
        model, tokenizer: a causal LM and its tokenizer (``eos_token_id`` and ``pad_token_id`` set).
        prompts: n prompt token lists.
        prefixes: n response-prefix token lists (the response tokens before the boundary).
        ground_truths: n answers for ``compute_score``.
        num_samples: N continuations per prefix.
        max_response_tokens: response budget; a continuation may add ``max_response_tokens − len(prefix)`` tokens
            including its EOS, and fails if it has not ended by then.
        temperature: sampling temperature.
        seed: torch seed for the sampling (the global RNG state is restored afterwards).

    Returns:
        ``MonteCarloResult``.
    """
    if not len(prompts) == len(prefixes) == len(ground_truths):
        raise ValueError(f"got {len(prompts)} prompts, {len(prefixes)} prefixes, {len(ground_truths)} ground truths")
    if num_samples < 1 or temperature <= 0:
        raise ValueError(f"need num_samples >= 1 and temperature > 0, got {num_samples} and {temperature}")
    too_long = [i for i, prefix in enumerate(prefixes) if len(prefix) >= max_response_tokens]
    if too_long:
        raise ValueError(f"prefixes {too_long[:5]} leave no room under max_response_tokens={max_response_tokens}")
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    device = model.get_input_embeddings().weight.device
    jobs = [(i, list(prompts[i]) + list(prefixes[i])) for i in range(len(prompts)) for _ in range(num_samples)]
    successes = torch.zeros(len(prompts))
    generated = 0
    rng_state, was_training = torch.random.get_rng_state(), model.training
    torch.manual_seed(seed)
    model.eval()
    try:
        # Similar lengths together: less left padding, and one generate length per batch.
        jobs.sort(key=lambda job: len(prefixes[job[0]]))
        for start in range(0, len(jobs), batch_size):
            chunk = jobs[start:start + batch_size]
            width = max(len(ids) for _, ids in chunk)
            input_ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, (_, ids) in enumerate(chunk):
                input_ids[row, width - len(ids):] = torch.tensor(ids)
                attention_mask[row, width - len(ids):] = 1
            budget = max(max_response_tokens - len(prefixes[i]) for i, _ in chunk)
            output = model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), max_new_tokens=budget,
                do_sample=True, temperature=temperature, top_k=0, top_p=1.0, eos_token_id=eos, pad_token_id=pad,
            )[:, width:].cpu()
            for row, (i, _) in enumerate(chunk):
                room = max_response_tokens - len(prefixes[i])
                continuation = output[row, :room].tolist()
                if eos not in continuation:
                    generated += len(continuation)
                    continue  # truncated: a failure
                generated += continuation.index(eos) + 1
                continuation = continuation[: continuation.index(eos)]
                text = tokenizer.decode(list(prefixes[i]) + continuation, skip_special_tokens=True)
                successes[i] += compute_score(None, text, ground_truths[i])
    finally:
        torch.random.set_rng_state(rng_state)
        model.train(was_training)
    return MonteCarloResult(successes / num_samples, generated)


@torch.no_grad()
def exact_success_probability_two_tokens(model, tokenizer, prompt: list[int], prefix: list[int], ground_truth: str,
                                         temperature: float = 1.0) -> float:
    """Exact P(success) of ``monte_carlo_values`` with a budget of two continuation tokens (``len(prefix) + 2``).

    With two tokens, success needs EOS as the second token after a first token t whose text makes the reward 1
    (EOS as the first token ends the response at the prefix itself). So p = Σ_t p(t) · p(EOS | t) · [reward(t) = 1]
    + p(EOS) · [reward(prefix) = 1], from exact softmaxes at ``temperature``.
    """
    eos = tokenizer.eos_token_id
    context = torch.tensor([list(prompt) + list(prefix)])
    first = (model(input_ids=context).logits[0, -1].float() / temperature).softmax(-1)
    probability = float(first[eos]) * compute_score(None, tokenizer.decode(prefix, skip_special_tokens=True),
                                                    ground_truth)
    for token in range(first.numel()):
        if token == eos:
            continue
        text = tokenizer.decode(list(prefix) + [token], skip_special_tokens=True)
        if compute_score(None, text, ground_truth) == 0.0:
            continue
        extended = torch.cat([context, torch.tensor([[token]])], dim=1)
        second = (model(input_ids=extended).logits[0, -1].float() / temperature).softmax(-1)
        probability += float(first[token]) * float(second[eos])
    return probability


def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties given their average rank."""
    order = np.argsort(values, kind="mergesort")
    ranks = np.empty(len(values))
    sorted_values = values[order]
    start = 0
    while start < len(values):
        end = start
        while end + 1 < len(values) and sorted_values[end + 1] == sorted_values[start]:
            end += 1
        ranks[order[start:end + 1]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def pearson(x, y) -> float | None:
    """Pearson correlation; None when fewer than 3 points or either series is constant."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def spearman(x, y) -> float | None:
    """Spearman correlation (Pearson of average ranks); None as for ``pearson``."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return pearson(average_ranks(x), average_ranks(y))


def binomial_tolerance(p: float, n: int, sigmas: float = 4.0) -> float:
    return sigmas * math.sqrt(max(p * (1 - p), 0.0) / n)


def machine_meta() -> dict:
    return {"torch": torch.__version__, "transformers": transformers.__version__, "machine": platform.machine(),
            "python": platform.python_version()}


def relative_to_repository(value):
    """``value`` with every absolute path inside the repository written relative to it (recursively through dicts
    and lists): a committed result must not carry the paths of the machine that ran it."""
    if isinstance(value, dict):
        return {key: relative_to_repository(item) for key, item in value.items()}
    if isinstance(value, list):
        return [relative_to_repository(item) for item in value]
    if isinstance(value, str) and value.startswith("/"):
        path = Path(value)
        return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else value
    return value


def write_result(result: dict, out: Path) -> dict:
    """Write a benchmark's JSON to ``out`` (folders made; paths inside the repository made relative to it), say
    where, and return the result with its path."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(relative_to_repository(result), indent=2) + "\n")
    print(f"wrote {out}")
    return {**result, "out": str(out)}


def fmt(value, width: int = 8, digits: int = 2) -> str:
    """A number right-aligned, or '-' for None."""
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"
