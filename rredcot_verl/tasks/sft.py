"""Supervised warm start of the tiny model on reference solutions (plain torch, CPU).

Recipe measured when the embedded task was designed (docs/choices.md, "Embedded task"): AdamW (lr 2e-3, betas 0.9/0.98, weight decay 0.01), 30 warmup
steps then cosine decay to 0.1x, gradient clipping at 1.0, batches of 64 fresh random problems, loss on the
response tokens only (``<think>`` ... eos). Here one cosine spans ``max_steps``; the committed warm start reached
57% greedy / 33% sampled accuracy after 1,600 steps (batch 64, one torch thread), where it stopped in the band.

The run stops at ``max_steps``, at ``budget_s`` seconds of wall time, or as soon as a checkpoint's sampled (T=1)
accuracy lies inside ``target_band``; the cosine follows whichever budget is closer to running out, so it ends at
the deadline. Checkpoints are evaluated every ``eval_every_steps`` with HF ``generate`` (greedy and sampled) on a
held-out set, and the one whose sampled accuracy is nearest the band (inside it if any) is kept: RL needs a policy
that is right often enough to get signal and wrong often enough to have something to learn.

``python -m rredcot_verl.tasks.build`` runs it (``--sft-steps``, ``--sft-budget-s``, ``--threads``).
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass

from rredcot_verl.tasks.arithmetic import (
    ArithmeticProblem,
    ArithmeticTaskConfig,
    make_problem,
    reference_response,
)
from rredcot_verl.tasks.model import chat_prompt_ids, response_ids
from rredcot_verl.tasks.reward import compute_score

WARMSTART_RECORD = "warmstart.json"


@dataclass(frozen=True)
class SFTConfig:
    """Warm-start settings (defaults: the measured recipe, with room to reach the 30-50% sampled band).

    Attributes:
        max_steps: optimizer steps at most.
        budget_s: wall-clock seconds at most, evaluation included. A cap for slow or shared machines: with the
            defaults the step budget (or the target band) ends the run first on one free core.
        batch_size: problems per step, each freshly drawn.
        lr: peak learning rate after warmup.
        min_lr_ratio: the cosine ends at ``lr * min_lr_ratio``.
        warmup_steps: linear warmup steps.
        beta1, beta2, weight_decay: AdamW.
        grad_clip: max global gradient norm.
        eval_every_steps: checkpoint evaluation interval (also evaluated at the end).
        n_eval: held-out problems per evaluation, from a stream no training batch uses.
        eval_max_new_tokens: generation limit (reference responses are at most about 70 tokens).
        target_band: (low, high) sampled accuracy the kept checkpoint should have; reaching it stops the run.
        seed: seed of the training problem stream and of the sampling in evaluation.
    """

    max_steps: int = 3000
    budget_s: float = 5400.0
    batch_size: int = 64
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    beta1: float = 0.9
    beta2: float = 0.98
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_every_steps: int = 200
    n_eval: int = 300
    eval_max_new_tokens: int = 96
    target_band: tuple[float, float] = (0.30, 0.50)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_steps < 1 or self.batch_size < 1 or self.eval_every_steps < 1 or self.n_eval < 1:
            raise ValueError(f"max_steps, batch_size, eval_every_steps and n_eval must be >= 1: {self}")
        if not self.budget_s > 0:
            raise ValueError(f"budget_s must be > 0, got {self.budget_s}")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1 and self.warmup_steps >= 0):
            raise ValueError(f"need lr > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0: {self}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and self.weight_decay >= 0 and self.grad_clip > 0):
            raise ValueError(f"invalid AdamW/clipping settings: {self}")
        low, high = self.target_band
        if not 0 <= low <= high <= 1:
            raise ValueError(f"target_band must satisfy 0 <= low <= high <= 1, got {self.target_band}")

    def lr_at(self, step: int, progress: float) -> float:
        """Learning rate for 0-based ``step`` at budget ``progress`` in [0, 1]."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)


def make_batch(tokenizer, problems: list[ArithmeticProblem]):
    """Right-padded ``(input_ids, attention_mask, labels)``, each (batch, max_len); labels -100 outside responses."""
    sequences = [(chat_prompt_ids(tokenizer, problem.prompt), response_ids(tokenizer, reference_response(problem)))
                 for problem in problems]
    return pad_for_sft(tokenizer.pad_token_id, sequences)


def pad_for_sft(pad_token_id: int, sequences: list[tuple[list[int], list[int]]]):
    """(prompt ids, response ids) pairs as right-padded ``(input_ids, attention_mask, labels)``, each
    (batch, max_len); labels -100 on the prompt and the padding, so the loss is on the responses only."""
    return pad_masked(pad_token_id, [(prompt + response, [0] * len(prompt) + [1] * len(response))
                                     for prompt, response in sequences])


def pad_masked(pad_token_id: int, sequences: list[tuple[list[int], list[int]]]):
    """(token ids, loss mask) pairs as right-padded ``(input_ids, attention_mask, labels)``, each (batch, max_len);
    labels -100 where the mask is 0 and on the padding (a multi-turn conversation learns its assistant turns only)."""
    import torch

    max_len = max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), max_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), max_len), dtype=torch.long)
    labels = torch.full((len(sequences), max_len), -100, dtype=torch.long)
    for row, (ids, mask) in enumerate(sequences):
        if len(mask) != len(ids):
            raise ValueError(f"sequence {row}: {len(ids)} tokens but a loss mask of {len(mask)}")
        tokens = torch.tensor(ids)
        input_ids[row, : len(ids)] = tokens
        attention_mask[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), tokens, -100)
    return input_ids, attention_mask, labels


def short_sft_step(model, optimizer, sequences: list[tuple[list[int], list[int]]], pad_token_id: int, peak_lr: float,
                   step: int, warmup_steps: int, total_steps: int):
    """One step of the miniature builds' short warm start (linear warmup, then a cosine from 1.0x to 0.1x of
    ``peak_lr``, clipping at 1.0) on one batch of (prompt ids, response ids); returns the loss tensor."""
    return short_sft_update(model, optimizer, pad_for_sft(pad_token_id, sequences), peak_lr, step, warmup_steps,
                            total_steps)


def short_sft_update(model, optimizer, batch, peak_lr: float, step: int, warmup_steps: int, total_steps: int):
    """``short_sft_step`` on a padded ``(input_ids, attention_mask, labels)`` batch; returns the loss tensor."""
    import torch

    progress = max(0, step - warmup_steps) / max(1, total_steps - warmup_steps)
    scale = min(1.0, (step + 1) / warmup_steps) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
    for group in optimizer.param_groups:
        group["lr"] = peak_lr * scale
    input_ids, attention_mask, labels = batch
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss


def eval_problems(n: int, task: ArithmeticTaskConfig) -> list[ArithmeticProblem]:
    """The held-out evaluation set: its own stream, disjoint from training batches by construction of the seed."""
    rng = random.Random("sft-eval")
    return [make_problem(rng, task) for _ in range(n)]


def generate_responses(model, tokenizer, problems: list[ArithmeticProblem], do_sample: bool, max_new_tokens: int,
                       seed: int = 0, batch_size: int = 256) -> list[str]:
    """Decoded responses (special tokens skipped, as verl hands them to the reward), left-padded batched generate.

    Sampling is plain temperature 1 (no top-k/top-p), the distribution the RL rollout samples from.
    """
    import torch

    responses = []
    generator_state, padding_side, was_training = torch.random.get_rng_state(), tokenizer.padding_side, model.training
    torch.manual_seed(seed)
    tokenizer.padding_side = "left"
    model.eval()
    try:
        for start in range(0, len(problems), batch_size):
            chunk = problems[start:start + batch_size]
            prompts = [chat_prompt_ids(tokenizer, problem.prompt) for problem in chunk]
            batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
            sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if do_sample else {
                "do_sample": False}
            with torch.no_grad():
                output = model.generate(
                    input_ids=batch["input_ids"],
                    attention_mask=batch["attention_mask"],
                    max_new_tokens=max_new_tokens,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                    **sampling,
                )
            responses += tokenizer.batch_decode(output[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    finally:
        model.train(was_training)
        tokenizer.padding_side = padding_side
        torch.random.set_rng_state(generator_state)
    return responses


def accuracy_report(problems: list[ArithmeticProblem], responses: list[str]) -> dict:
    """``{"accuracy": float, "by_num_steps": {num_steps: accuracy}}`` under the task reward."""
    scores = [compute_score(None, response, problem.answer) for problem, response in zip(problems, responses)]
    by_steps: dict[int, list[float]] = {}
    for problem, score in zip(problems, scores):
        by_steps.setdefault(problem.num_steps, []).append(score)
    return {
        "accuracy": sum(scores) / len(scores),
        "by_num_steps": {k: sum(v) / len(v) for k, v in sorted(by_steps.items())},
    }


def band_distance(accuracy: float, band: tuple[float, float]) -> float:
    """0 inside ``band``, else the distance to its nearest edge."""
    return max(band[0] - accuracy, accuracy - band[1], 0.0)


def train_warm_start(model, tokenizer, task: ArithmeticTaskConfig, config: SFTConfig, progress_bar: bool = True):
    """Run the warm start in place; ``model`` ends with the kept checkpoint's weights. Returns the record dict.

    The record holds the settings, every checkpoint (step, seconds, loss, greedy and sampled accuracy overall and
    by number of steps), the kept one, and why training stopped.
    """
    import torch
    from tqdm import tqdm

    rng = random.Random(f"sft-train:{config.seed}")
    held_out = eval_problems(config.n_eval, task)
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        (no_decay if parameter.ndim < 2 or "norm" in name else decay).append(parameter)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(config.beta1, config.beta2),
    )
    checkpoints, states = [], []
    loss_ema, stopped_because = None, "max_steps"
    start = time.monotonic()
    model.train()
    bar = tqdm(total=config.max_steps, desc="warm start", unit="step", disable=not progress_bar)
    for step in range(config.max_steps):
        elapsed = time.monotonic() - start
        progress = max(step / config.max_steps, elapsed / config.budget_s)
        if elapsed >= config.budget_s:
            stopped_because = "budget_s"
            break
        lr = config.lr_at(step, progress)
        for group in optimizer.param_groups:
            group["lr"] = lr
        input_ids, attention_mask, labels = make_batch(
            tokenizer, [make_problem(rng, task) for _ in range(config.batch_size)]
        )
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        if not torch.isfinite(loss):
            raise FloatingPointError(f"warm-start loss became {loss.item()} at step {step}; lower the learning rate")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{loss_ema:.3f}", lr=f"{lr:.1e}")
        done = step + 1
        last = done == config.max_steps or time.monotonic() - start >= config.budget_s
        if done % config.eval_every_steps and not last:
            continue
        checkpoint = _evaluate(model, tokenizer, held_out, config, done, time.monotonic() - start, loss_ema)
        checkpoints.append(checkpoint)
        states.append(copy.deepcopy(model.state_dict()))
        bar.write(
            f"step {done} ({checkpoint['seconds']:.0f} s): loss {loss_ema:.3f}, greedy "
            f"{checkpoint['greedy']['accuracy']:.1%}, sampled {checkpoint['sampled']['accuracy']:.1%}"
        )
        if band_distance(checkpoint["sampled"]["accuracy"], config.target_band) == 0.0:
            stopped_because = "in_target_band"
            break
    bar.close()
    if not checkpoints:  # the budget ran out before the first step finished
        checkpoints.append(_evaluate(model, tokenizer, held_out, config, 0, time.monotonic() - start, loss_ema))
        states.append(copy.deepcopy(model.state_dict()))
    # nearest the band; among equals the later (more trained) checkpoint
    kept = min(range(len(checkpoints)),
               key=lambda i: (band_distance(checkpoints[i]["sampled"]["accuracy"], config.target_band), -i))
    model.load_state_dict(states[kept])
    return {
        "kept": checkpoints[kept],
        "in_target_band": band_distance(checkpoints[kept]["sampled"]["accuracy"], config.target_band) == 0.0,
        "stopped_because": stopped_because,
        "total_steps": checkpoints[-1]["step"],
        "total_seconds": round(time.monotonic() - start, 1),
        "torch_threads": torch.get_num_threads(),
        "checkpoints": checkpoints,
        "sft_config": asdict(config),
        "task_config": asdict(task),
    }


def _evaluate(model, tokenizer, problems, config: SFTConfig, step: int, seconds: float, loss_ema) -> dict:
    greedy = generate_responses(model, tokenizer, problems, False, config.eval_max_new_tokens)
    sampled = generate_responses(model, tokenizer, problems, True, config.eval_max_new_tokens, seed=config.seed)
    return {
        "step": step,
        "seconds": round(seconds, 1),
        "train_loss_ema": None if loss_ema is None else round(loss_ema, 4),
        "greedy": accuracy_report(problems, greedy),
        "sampled": accuracy_report(problems, sampled),
    }


def write_record(record: dict, model_dir: str) -> str:
    path = os.path.join(model_dir, WARMSTART_RECORD)
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    return path
