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

``python -m rredcot_verl.tasks.build`` runs it (``--setting``, ``--threads``, ``--retrain``).
"""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import asdict, dataclass

from rredcot_verl.tasks.arithmetic import (
    THINK_CLOSE,
    THINK_OPEN,
    ArithmeticProblem,
    ArithmeticTaskConfig,
    make_problem,
    reference_response,
    slipped_steps,
)
from rredcot_verl.tasks.model import chat_prompt_ids, response_ids
from rredcot_verl.tasks.reward import compute_score


# What the exit probe of the embedded profile forces after a step line (core/profiles.py, "embedded"), the text the
# reference writes between its last line and the answer.
EXIT_TEXT = THINK_CLOSE + "\n\\boxed"


@dataclass(frozen=True)
class ExitExamples:
    """Answer-early examples mixed into the warm start (the ``early`` setting; docs/choices.md, "Answer-early setting").

    A share of each batch is not a whole reference but the reference cut after k of its n step lines, followed by the
    exit text the exit probe forces (``EXIT_TEXT``) and the final answer. The exit text carries no loss: the model
    learns to answer when an exit is forced, not to exit early of its own accord (with a loss there, an early design
    learned to stop thinking: docs/choices.md, "Embedded task and warm start"). A share of the cut examples carry one
    slipped line (``arithmetic.slipped_steps``: a result one digit off, later lines going on from it), and their answer
    is the one the slipped lines lead to: after a wrong line the forced answer should follow the written total, so
    that the probe's value falls there, instead of the right answer read off the prompt.

    Attributes:
        fraction: share of each batch's problems written as cut examples, in [0, 1].
        steps_left_weights: relative weights of cutting with 1, 2, 3, ... steps left (n − k); the last weight applies
            to every larger count. n steps left is the immediate exit, no line kept.
        slip_fraction: share of the cut examples with at least one line kept that carry one slipped line, in [0, 1].
            The slipped line carries no loss (the model must not learn to slip); the lines after it and the answer do.
    """

    fraction: float = 0.4
    steps_left_weights: tuple[float, ...] = (1.0,)
    slip_fraction: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps_left_weights", tuple(self.steps_left_weights))
        if not (0 <= self.fraction <= 1 and 0 <= self.slip_fraction <= 1):
            raise ValueError(f"fraction and slip_fraction must lie in [0, 1]: {self}")
        if not self.steps_left_weights or min(self.steps_left_weights) <= 0:
            raise ValueError(f"steps_left_weights must be positive numbers, got {self.steps_left_weights}")


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
        exit_examples: answer-early examples mixed into the batches (``ExitExamples``), None for whole references
            only. With them, each checkpoint's record also holds the greedy exit accuracy (``exit_accuracy``).
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
    exit_examples: ExitExamples | None = None

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


def slip_delta(total: int, rng: random.Random) -> int:
    """How far a slip moves ``total``: one of its digits one up or one down (a carry or a borrow dropped or added,
    the slip sampled step lines make most), never a leading digit to 0; the sign kept."""
    digits = [int(d) for d in str(abs(total))]
    place = rng.randrange(len(digits))
    lowest = 1 if place == 0 and len(digits) > 1 else 0
    moves = [move for move in (-1, 1) if lowest <= digits[place] + move <= 9]
    delta = rng.choice(moves) * 10 ** (len(digits) - 1 - place)
    return delta * (-1 if total < 0 else 1)


def exit_example(tokenizer, problem: ArithmeticProblem, kept_steps: int, slip_step: int = 0,
                 delta: int = 0) -> tuple[list[int], list[int]]:
    """(response ids, loss mask) of the reference cut after ``kept_steps`` lines, ``EXIT_TEXT`` and the boxed answer
    those lines lead to, then eos: ``format_response`` of the kept lines. With ``slip_step`` (1-based, at most
    ``kept_steps``; 0 for none) that line's result is ``delta`` off and the answer is the one the slipped lines
    lead to (``slipped_steps``, ``slipped_answer``). The mask is 0 on the exit text and on the slipped line, 1 elsewhere."""
    if not 0 <= kept_steps < problem.num_steps:
        raise ValueError(f"kept_steps must be in 0..{problem.num_steps - 1}, got {kept_steps}")
    if not (0 <= slip_step <= kept_steps and (slip_step == 0) == (delta == 0)):
        raise ValueError(f"need 0 <= slip_step <= kept_steps and a nonzero delta exactly when slip_step is set, got "
                         f"slip_step={slip_step}, delta={delta}, kept_steps={kept_steps}")
    lines = slipped_steps(problem, max(slip_step, 1), delta)[:kept_steps]
    pieces = [(THINK_OPEN + "\n", 1), *((line + "\n", int(k != slip_step)) for k, line in enumerate(lines, 1)),
              (EXIT_TEXT, 0), ("{" + f"{problem.slipped_answer(slip_step, delta)}" + "}", 1)]
    ids, mask = [], []
    for text, weight in pieces:
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        mask += [weight] * len(piece)
    return ids + [tokenizer.eos_token_id], mask + [1]


def make_training_batch(tokenizer, problems: list[ArithmeticProblem], rng: random.Random,
                        exit_examples: ExitExamples | None):
    """``make_batch`` of the problems, with a share written as cut examples (``ExitExamples``; ``rng`` draws which,
    where they are cut and their slips). Without ``exit_examples`` it is ``make_batch`` and draws nothing."""
    if exit_examples is None:
        return make_batch(tokenizer, problems)
    sequences = []
    for problem in problems:
        prompt = chat_prompt_ids(tokenizer, problem.prompt)
        if rng.random() >= exit_examples.fraction:
            response = response_ids(tokenizer, reference_response(problem))
            sequences.append((prompt + response, [0] * len(prompt) + [1] * len(response)))
            continue
        weights = exit_examples.steps_left_weights
        steps_left = rng.choices(range(1, problem.num_steps + 1),
                                 weights=[weights[min(left, len(weights)) - 1] for left in range(1, problem.num_steps + 1)])[0]
        kept = problem.num_steps - steps_left
        slip_step, delta = 0, 0
        if kept and rng.random() < exit_examples.slip_fraction:
            slip_step = rng.randint(1, kept)
            delta = slip_delta(problem.running_totals()[slip_step - 1], rng)
        response, mask = exit_example(tokenizer, problem, kept, slip_step, delta)
        sequences.append((prompt + response, [0] * len(prompt) + mask))
    return pad_masked(tokenizer.pad_token_id, sequences)


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
    return generate_after(model, tokenizer, [chat_prompt_ids(tokenizer, problem.prompt) for problem in problems],
                          do_sample, max_new_tokens, seed, batch_size)


def generate_after(model, tokenizer, sequences: list[list[int]], do_sample: bool, max_new_tokens: int, seed: int = 0,
                   batch_size: int = 256) -> list[str]:
    """``generate_responses`` after given token sequences (prompts, or prompts with a response prefix)."""
    import torch

    responses = []
    generator_state, padding_side, was_training = torch.random.get_rng_state(), tokenizer.padding_side, model.training
    torch.manual_seed(seed)
    tokenizer.padding_side = "left"
    model.eval()
    try:
        for start in range(0, len(sequences), batch_size):
            prompts = sequences[start:start + batch_size]
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


def exit_accuracy(model, tokenizer, problems: list[ArithmeticProblem], max_new_tokens: int | None = None) -> dict:
    """Greedy accuracy of the answer written right after a forced exit on the reference cut after each of its lines
    (``exit_example``'s text up to the answer): ``{"by_steps_left": {steps left: accuracy}, "immediate": accuracy
    of the exit before any line, "last_step": accuracy with one step left}``. What the exit probe reads from a right
    prefix, as accuracy: the warm start can answer early where it is high, and the task is still a reasoning task
    where the immediate exit is well below the sampled accuracy of whole traces."""
    sequences, keys = [], []
    longest_answer = max(len(tokenizer.encode("{" + f"{problem.answer}" + "}", add_special_tokens=False))
                         for problem in problems)
    for problem in problems:
        prompt = chat_prompt_ids(tokenizer, problem.prompt)
        answer_length = len(tokenizer.encode("{" + f"{problem.answer}" + "}", add_special_tokens=False)) + 1
        for kept in range(problem.num_steps):
            sequences.append(prompt + exit_example(tokenizer, problem, kept)[0][:-answer_length])
            keys.append((problem, problem.num_steps - kept))
    texts = generate_after(model, tokenizer, sequences, False, max_new_tokens or longest_answer + 2)
    by_left: dict[int, list[float]] = {}
    immediate = []
    for (problem, left), text in zip(keys, texts):
        score = compute_score(None, "\\boxed" + text, problem.answer)
        by_left.setdefault(left, []).append(score)
        if left == problem.num_steps:
            immediate.append(score)
    return {"by_steps_left": {k: sum(v) / len(v) for k, v in sorted(by_left.items())},
            "immediate": sum(immediate) / len(immediate), "last_step": sum(by_left[1]) / len(by_left[1])}


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
        input_ids, attention_mask, labels = make_training_batch(
            tokenizer, [make_problem(rng, task) for _ in range(config.batch_size)], rng, config.exit_examples
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
        "task_config": task.as_dict(),
    }


def _evaluate(model, tokenizer, problems, config: SFTConfig, step: int, seconds: float, loss_ema) -> dict:
    greedy = generate_responses(model, tokenizer, problems, False, config.eval_max_new_tokens)
    sampled = generate_responses(model, tokenizer, problems, True, config.eval_max_new_tokens, seed=config.seed)
    checkpoint = {
        "step": step,
        "seconds": round(seconds, 1),
        "train_loss_ema": None if loss_ema is None else round(loss_ema, 4),
        "greedy": accuracy_report(problems, greedy),
        "sampled": accuracy_report(problems, sampled),
    }
    if config.exit_examples is not None:
        checkpoint["exit"] = exit_accuracy(model, tokenizer, problems)
    return checkpoint
