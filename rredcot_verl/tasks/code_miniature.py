"""The ``code`` task in miniature: generated function-writing problems judged by ``assert`` tests in the sandbox, and
a tiny Qwen3-family model warm-started to pass them some of the time, built from code on CPU.

    python -m rredcot_verl.tasks.build --setting code --out DIR [--problems N] [--threads T]

writes what ``recipes/tiny_cpu/code.yaml`` reads (``RREDCOT_BUILD=DIR``):

- ``DIR/data/{train,val}.parquet``: problems such as "Write a Python function g(x) that multiplies x by 3, then adds
  2, and returns the result." (one to three operations, operands 2-9, a few function names), shuffled and split 4:1;
  ``reward_model.ground_truth`` is ``{"assert_case": ["assert g(4) == 14", ...]}`` as a JSON string (the form of
  verl's prime_code rows), data_source ``miniature/code``, ``extra_info.reference_solution`` the SFT target.
- ``DIR/model/``: the ``qwen3`` miniature family (``tasks/miniature.py``: byte-level BPE, Qwen3 chat template,
  two-layer ``Qwen3ForCausalLM``), warm-started by SFT on the training problems answered as a thinking model does:
  ``<think>`` one line per operation ``</think>`` then the program in a ```` ```python ```` block, then eos. The SFT
  memorises: it is stopped at the first checkpoint whose sampled (T=1) pass rate on training prompts, judged by
  ``tasks/code_reward.py``, lies in ``TARGET_BAND``, so RL sees groups with both outcomes.
- ``DIR/build.json``: the build record (``tasks/build.py``: fingerprint, pass rates, token lengths).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Callable

from rredcot_verl.tasks import code_reward, miniature, model as model_module
from rredcot_verl.tasks.miniature import ASSETS, FAMILIES, THINK_CLOSE, THINK_OPEN, MathRow, MiniatureConfig
from rredcot_verl.tasks.model import chat_prompt_ids, load_model_dir, response_ids
from rredcot_verl.tasks.sft import band_distance

DATA_SOURCE = "miniature/code"
FAMILY = "qwen3"
NAMES = ("f", "g", "h", "calc", "step", "apply")
# operation -> (prompt clause, thinking line, statement), formatted with the operand ``a`` and what it acts on ``v``
OPERATIONS = {
    "add": ("adds {a} to {v}", "Add {a}.", "y = y + {a}"),
    "subtract": ("subtracts {a} from {v}", "Subtract {a}.", "y = y - {a}"),
    "multiply": ("multiplies {v} by {a}", "Multiply by {a}.", "y = y * {a}"),
}
TEST_INPUTS = tuple(range(-3, 10))
N_TESTS = 3
TARGET_BAND = (0.35, 0.65)


@dataclass(frozen=True)
class CodeProblem:
    """``name(x)`` applies ``operations`` ((operation, operand) pairs, keys of ``OPERATIONS``) to x in order."""

    name: str
    operations: tuple[tuple[str, int], ...]

    @property
    def prompt(self) -> str:
        clauses = [OPERATIONS[op][0].format(a=a, v="it" if i else "x") for i, (op, a) in enumerate(self.operations)]
        return f"Write a Python function {self.name}(x) that {', then '.join(clauses)}, and returns the result."

    def value(self, x: int) -> int:
        for op, a in self.operations:
            x = x + a if op == "add" else x - a if op == "subtract" else x * a
        return x

    def program(self) -> str:
        lines = [f"def {self.name}(x):", "    y = x"]
        lines += ["    " + OPERATIONS[op][2].format(a=a) for op, a in self.operations]
        return "\n".join(lines + ["    return y"])

    def thinking(self) -> str:
        return "\n".join(OPERATIONS[op][1].format(a=a) for op, a in self.operations)

    def response(self) -> str:
        """The SFT target: thinking (one line per operation), then the program; the model opens ``<think>``."""
        return f"{THINK_OPEN}\n{self.thinking()}\n{THINK_CLOSE}\n\n```python\n{self.program()}\n```"

    def tests(self, rng: random.Random) -> list[str]:
        return [f"assert {self.name}({x}) == {self.value(x)}" for x in sorted(rng.sample(TEST_INPUTS, N_TESTS))]


@dataclass(frozen=True)
class CodeSFTConfig:
    """Warm start: AdamW on random batches of training sequences, linear warmup then cosine decay to 0.1x over
    ``max_steps``; from ``first_eval`` on, every ``eval_every`` steps the sampled pass rate on ``n_eval`` training
    prompts is measured and training stops inside ``TARGET_BAND`` (else the checkpoint nearest it is kept)."""

    max_steps: int = 400
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 20
    first_eval: int = 100
    eval_every: int = 20
    n_eval: int = 32
    seed: int = 0


def make_problems(n: int, seed: int) -> list[tuple[CodeProblem, list[str]]]:
    """``n`` distinct problems with their assert tests, deterministic in ``seed``."""
    rng = random.Random(f"code-miniature:{seed}")
    seen, problems = set(), []
    while len(problems) < n:
        operations = tuple((rng.choice(sorted(OPERATIONS)), rng.randint(2, 9)) for _ in range(rng.randint(1, 3)))
        problem = CodeProblem(rng.choice(NAMES), operations)
        if problem.prompt not in seen:
            seen.add(problem.prompt)
            problems.append((problem, problem.tests(rng)))
    return problems


def write_data(problems: list[tuple[CodeProblem, list[str]]], data_dir: str,
               seed: int) -> tuple[list[tuple[CodeProblem, str]], list[tuple[CodeProblem, str]]]:
    """Shuffle, split 4:1, write ``train.parquet`` / ``val.parquet``; returns (problem, ground truth) per split."""
    import pandas as pd

    order = list(problems)
    random.Random(seed).shuffle(order)
    n_val = max(1, len(order) // 5)
    os.makedirs(data_dir, exist_ok=True)
    splits = []
    for split, rows in (("train", order[n_val:]), ("val", order[:n_val])):
        records = [{
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": problem.prompt}],
            "ability": "code",
            "reward_model": {"style": "rule", "ground_truth": json.dumps({"assert_case": tests})},
            "extra_info": {"split": split, "index": index, "reference_solution": problem.response()},
        } for index, (problem, tests) in enumerate(rows)]
        pd.DataFrame(records).to_parquet(os.path.join(data_dir, f"{split}.parquet"))
        splits.append([(record_problem, record["reward_model"]["ground_truth"])
                       for (record_problem, _), record in zip(rows, records)])
    return splits[0], splits[1]


def build_tokenizer(problems: list[CodeProblem], config: MiniatureConfig):
    """The qwen3 family's tokenizer trained on these problems. ``miniature.build_tokenizer`` writes each row as a
    thinking response with a boxed answer; given the thinking lines and the fenced program as that answer, its
    corpus holds every word the responses use (plus the unused ``**Final Answer**`` scaffolding)."""
    rows = [MathRow(p.prompt, f"```python\n{p.program()}\n```", p.thinking()) for p in problems]
    return miniature.build_tokenizer(FAMILIES[FAMILY], rows, config)


def pass_rate(model, tokenizer, rows: list[tuple[CodeProblem, str]], do_sample: bool, max_new_tokens: int,
              seed: int) -> tuple[float, str]:
    """Share of ``rows`` whose generated response passes its tests (``code_reward.compute_score``, i.e. the
    sandbox), and the first response."""
    from rredcot_verl.tasks.sft import generate_responses

    responses = generate_responses(model, tokenizer, [problem for problem, _ in rows], do_sample, max_new_tokens,
                                   seed=seed)
    with ThreadPoolExecutor(max_workers=4) as pool:  # each score waits on its own sandbox process
        scores = list(pool.map(lambda r: code_reward.compute_score(DATA_SOURCE, r[1], r[0][1]), zip(rows, responses)))
    return sum(scores) / len(scores), responses[0]


def warm_start(model, tokenizer, train: list[tuple[CodeProblem, str]], config: CodeSFTConfig, max_new_tokens: int,
               log: Callable[[str], None]) -> dict:
    """SFT in place, loss on response tokens (and eos) only, stopped in ``TARGET_BAND`` (``CodeSFTConfig``); the
    model ends with the kept checkpoint's weights. Returns the record: checkpoints and the kept one."""
    import copy

    import torch

    from rredcot_verl.tasks.sft import short_sft_step

    sequences = [(chat_prompt_ids(tokenizer, p.prompt), response_ids(tokenizer, p.response())) for p, _ in train]
    eval_rows = train[: config.n_eval]
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.98), weight_decay=0.01)
    rng = random.Random(config.seed)
    checkpoints, states = [], []
    model.train()
    for step in range(config.max_steps):
        batch = rng.sample(sequences, min(config.batch_size, len(sequences)))
        loss = short_sft_step(model, optimizer, batch, tokenizer.pad_token_id, config.lr, step, config.warmup_steps,
                              config.max_steps)
        done = step + 1
        if done < config.first_eval or ((done - config.first_eval) % config.eval_every and done != config.max_steps):
            continue
        rate, _ = pass_rate(model, tokenizer, eval_rows, True, max_new_tokens, config.seed)
        model.train()
        checkpoints.append({"step": done, "loss": round(loss.item(), 4), "sampled_pass_rate": rate})
        states.append(copy.deepcopy(model.state_dict()))
        log(f"code miniature: SFT step {done}, loss {loss.item():.3f}, sampled pass rate {rate:.0%}")
        if band_distance(rate, TARGET_BAND) == 0.0:
            break
    kept = min(range(len(checkpoints)),
               key=lambda i: (band_distance(checkpoints[i]["sampled_pass_rate"], TARGET_BAND), -i))
    model.load_state_dict(states[kept])
    model.eval()
    return {"kept": checkpoints[kept], "checkpoints": checkpoints, "config": asdict(config)}


def fingerprint(n_problems: int, config: MiniatureConfig, sft: CodeSFTConfig) -> dict:
    """What a build depends on: sizes, settings, and the bytes of this module, the miniature family code, the
    tokenizer code, the template and the reward (the pass rates that choose the checkpoint)."""
    digest = hashlib.sha256()
    template = os.path.join(ASSETS, "chat_templates", FAMILIES[FAMILY].template)
    for path in (os.path.abspath(__file__), miniature.__file__, model_module.__file__, template,
                 code_reward.__file__):
        with open(path, "rb") as f:
            digest.update(f.read())
    return json.loads(json.dumps({"family": FAMILY, "problems": n_problems, "config": asdict(config),
                                  "sft": asdict(sft), "band": TARGET_BAND, "sources_sha256": digest.hexdigest()}))


def write_problems(n_problems: int, seed: int, data_dir: str) -> tuple[list, list]:
    """``n_problems`` generated problems written by ``write_data``."""
    return write_data(make_problems(n_problems, seed), data_dir, seed)


def token_lengths(tokenizer, rows: list[tuple[CodeProblem, str]]) -> dict:
    """Longest chat prompt and SFT target in tokens (for verl's max_prompt_length / max_response_length)."""
    return {"max_prompt_tokens": max(len(chat_prompt_ids(tokenizer, p.prompt)) for p, _ in rows),
            "max_reference_response_tokens": max(len(response_ids(tokenizer, p.response())) for p, _ in rows)}


def train(config: MiniatureConfig, sft: CodeSFTConfig, data, model_dir: str, log: Callable[[str], None]) -> dict:
    """The qwen3 family's tokenizer and model, warm-started into ``TARGET_BAND`` and saved to ``model_dir``; returns
    the warm start's record and the kept model's sampled and greedy pass rates on training prompts."""
    train_rows, val_rows = data
    tokenizer = build_tokenizer([p for p, _ in train_rows + val_rows], config)
    model = miniature.build_model(FAMILIES[FAMILY], tokenizer, config)
    max_new_tokens = token_lengths(tokenizer, train_rows + val_rows)["max_reference_response_tokens"] + 32
    warm = warm_start(model, tokenizer, train_rows, sft, max_new_tokens, log)
    miniature.save_checked(model, tokenizer, model_dir)
    greedy, example = pass_rate(model, tokenizer, train_rows[: sft.n_eval], False, max_new_tokens, sft.seed)
    log(f"code miniature: on {min(sft.n_eval, len(train_rows))} training prompts sampled pass rate "
        f"{warm['kept']['sampled_pass_rate']:.0%} (step {warm['kept']['step']}), greedy {greedy:.0%}")
    return {"sft": warm, "sampled_pass_rate": warm["kept"]["sampled_pass_rate"], "greedy_pass_rate": greedy,
            "greedy_example": example}


def measure(data, model_dir: str) -> dict:
    _, tokenizer = load_model_dir(model_dir, with_model=False)
    return {"family": FAMILY, "n_train": len(data[0]), "n_val": len(data[1]),
            **token_lengths(tokenizer, data[0] + data[1]), "vocab_size": len(tokenizer)}
