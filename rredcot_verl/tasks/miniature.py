"""Miniature stand-ins for the paper recipes (Qwen3-4B thinking, DeepSeek-R1-Distill-Qwen) and for verl's quickstart
(a Qwen2.5-Instruct model on GSM8K, no thinking), built from code on CPU.

    python -m rredcot_verl.tasks.build --setting {qwen3,r1_distill,qwen2_5,qwen3_gsm8k} --out DIR [--problems N]

writes what a paper recipe reads, at toy scale, so it can be launched in CI without the hub:

- ``DIR/data/{train,test}.parquet`` (the names verl's preprocessing writes): the word problems shipped in
  ``assets/math_problems.jsonl`` (solutions are blank-line paragraphs ending in ``\\boxed{}``), shuffled, split
  4:1 and converted by ``tasks/math_data.convert``, the converter of ``recipes/paper/prepare_math_data.py``.
- ``DIR/model/``: a byte-level BPE tokenizer with the family's special tokens and chat template
  (``assets/chat_templates/``), and a two-layer model of the family's class, warm-started by SFT on the training
  problems written as the family responds: ``<think>\\n{solution}\\n</think>\\n\\n**Final Answer**\\n\\boxed{a}``
  then eos (R1's prompt already ends with ``<think>\\n``). The SFT memorises rather than solves: it makes sampled
  responses carry a boxed answer (for the reward and the exit probe) that is sometimes right.
- ``qwen2_5`` (``GSM8K_FAMILIES``): verl's GSM8K row format instead (``examples/data_preprocess/gsm8k.py``:
  data_source ``openai/gsm8k``, the question then ``Let's think step by step and output the final answer after
  "####".``, ``reward_model.ground_truth`` the number, ``extra_info.answer`` the rationale ending ``#### 27``, plus
  ``extra_info.reference_steps``, its lines, for the reference continuation), from the shipped problems whose answer
  is a number (LaTeX written out as plain text); the model answers without a thinking block: the rationale lines,
  then ``#### 27``, then eos; the Qwen2.5 chat template (default system prompt, no ``<think>`` token).
  ``qwen3_gsm8k``: the same rows for a Qwen3 thinking model (the one-GPU recipe on verl's GSM8K): the rationale lines
  inside ``<think>...</think>``, then ``#### 27``, then eos.
- ``DIR/build.json``: the build record (``tasks/build.py``: fingerprint, boxed rate and accuracy on training prompts,
  token lengths for ``max_prompt_length`` / ``max_response_length``).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Callable

from rredcot_verl.tasks import base, math_data
from rredcot_verl.tasks.base import GSM8K, gsm8k_solution_steps
from rredcot_verl.tasks.math_data import convert
from rredcot_verl.tasks.model import (
    chat_prompt_ids,
    check_vllm_head_dim,
    load_model_dir,
    response_ids,
    save_model_dir,
    train_qwen2_style_bpe,
)
from rredcot_verl.tasks.reward import extract_boxed_answer

if TYPE_CHECKING:
    import pandas as pd


DATA_SOURCE = "miniature/math"
ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
PROBLEMS_PATH = os.path.join(ASSETS, "math_problems.jsonl")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Family:
    """Tokens, template and model class of one paper model family.

    Attributes:
        model_type: ``qwen3`` or ``qwen2`` (the transformers config class, hence what vLLM serves).
        template: chat template file under ``assets/chat_templates``.
        bos_token: written by the chat template (None: the family has no bos).
        config_bos_token: what the model config's ``bos_token_id`` names (Qwen3: ``<|endoftext|>``, though unused).
        stop_tokens: the generation config's eos ids (Qwen3 stops at ``<|im_end|>`` or ``<|endoftext|>``).
        special_tokens: single tokens that ``decode(..., skip_special_tokens=True)`` drops; bos/eos/pad among them.
        added_tokens: single tokens that decoding keeps (thinking markers, R1's role markers), as the real ones do.
        thinks_in_prompt: the generation prompt ends with ``<think>\\n``, so the response starts inside thinking.
        tie_word_embeddings: as the full-size checkpoint.
        answer_style: ``boxed`` (thinking, then ``**Final Answer**\\n\\boxed{a}``; the converter's rows) or ``gsm8k``
            (no thinking block: rationale lines, then ``#### a``; verl's GSM8K rows).
        system_prompt: the template's default system prompt, whose words join the BPE corpus.
    """

    model_type: str
    template: str
    bos_token: str | None
    eos_token: str
    pad_token: str
    config_bos_token: str
    stop_tokens: tuple[str, ...]
    special_tokens: tuple[str, ...]
    added_tokens: tuple[str, ...]
    thinks_in_prompt: bool
    tie_word_embeddings: bool
    answer_style: str = "boxed"
    system_prompt: str = ""


_R1_BOS, _R1_EOS, _R1_PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
FAMILIES: dict[str, Family] = {
    "qwen3": Family(
        model_type="qwen3", template="qwen3.jinja", bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        config_bos_token="<|endoftext|>", stop_tokens=("<|im_end|>", "<|endoftext|>"),
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), added_tokens=(THINK_OPEN, THINK_CLOSE),
        thinks_in_prompt=False, tie_word_embeddings=True,
    ),
    # The real tokenizer pads with eos; a distinct pad (DeepSeek's spelling) keeps eos out of padding masks.
    "r1_distill": Family(
        model_type="qwen2", template="r1_distill.jinja", bos_token=_R1_BOS, eos_token=_R1_EOS, pad_token=_R1_PAD,
        config_bos_token=_R1_BOS, stop_tokens=(_R1_EOS,), special_tokens=(_R1_BOS, _R1_EOS, _R1_PAD),
        added_tokens=("<｜User｜>", "<｜Assistant｜>", THINK_OPEN, THINK_CLOSE), thinks_in_prompt=True,
        tie_word_embeddings=False,
    ),
}
# Families whose data is verl's GSM8K format, kept apart from the paper families above (whose tests read the
# converter's rows and boxed answers).
GSM8K_FAMILIES: dict[str, Family] = {
    "qwen2_5": Family(
        model_type="qwen2", template="qwen2_5.jinja", bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        config_bos_token="<|endoftext|>", stop_tokens=("<|im_end|>", "<|endoftext|>"),
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), added_tokens=(), thinks_in_prompt=False,
        tie_word_embeddings=True, answer_style="gsm8k",
        system_prompt="\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
    ),
    "qwen3_gsm8k": replace(FAMILIES["qwen3"], answer_style="gsm8k"),
}
ALL_FAMILIES: dict[str, Family] = {**FAMILIES, **GSM8K_FAMILIES}
GSM8K_DATA_SOURCE = "openai/gsm8k"  # verl's default reward dispatches its GSM8K rule on this name
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


@dataclass(frozen=True)
class MiniatureConfig:
    """Sizes of the tokenizer, model and warm start (defaults: about 10 s per family on two idle cores).

    Attributes:
        vocab_size: BPE target, reached on the shipped text (digits stay single tokens: the pre-tokenizer splits them).
        hidden_size, num_attention_heads, num_key_value_heads, num_hidden_layers, intermediate_size: model shape;
            head_dim = hidden_size / num_attention_heads must be one vLLM's CPU attention supports.
        max_position_embeddings: longest prompt + response a miniature recipe may ask for.
        sft_steps, batch_size, lr, warmup_steps: AdamW steps on random batches of training sequences, linear warmup
            then cosine decay to 0.1x.
        n_eval: training prompts generated for (sampled at temperature 1, then greedy) to measure the warm start.
        seed: shuffle, initialisation, batches and sampling.
    """

    vocab_size: int = 1024
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_hidden_layers: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 2048
    sft_steps: int = 120
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 20
    n_eval: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        check_vllm_head_dim(self.hidden_size // self.num_attention_heads)
        if min(self.sft_steps, self.batch_size, self.warmup_steps, self.n_eval) < 1:
            raise ValueError(f"sft_steps, batch_size, warmup_steps and n_eval must be >= 1: {self}")


@dataclass(frozen=True)
class MathRow:
    """One training problem as the SFT and the evaluation see it (``prompt`` is the user message verl builds)."""

    prompt: str
    answer: str
    solution: str


def load_problems(n: int | None = None, path: str = PROBLEMS_PATH) -> list[dict]:
    """The first ``n`` (default all) ``{"problem", "solution"}`` records of the shipped problem file."""
    with open(path, encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return problems[:n]


_FRACTION = re.compile(r"\\(d?frac|binom)\{([^{}]*)\}\{([^{}]*)\}")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_PLAIN_WORDS = {"\\times": "*", "\\div": "/", "\\dots": "...", "$": ""}
_NUMBER = re.compile(r"-?[0-9][0-9.,]*")


def _plain_math(text: str) -> str:
    """A shipped solution's LaTeX as GSM8K writes rationales: ``a/b``, ``C(n, k)``, ``*``, no ``$``."""
    text = _FRACTION.sub(lambda m: f"C({m[2]}, {m[3]})" if m[1] == "binom" else f"{m[2]}/{m[3]}", text)
    text = _BOXED.sub(r"\1", text)
    for latex, plain in _PLAIN_WORDS.items():
        text = text.replace(latex, plain)
    return text


def gsm8k_rows(problems: list[dict], split: str) -> pd.DataFrame:
    """verl's GSM8K rows (module docstring) for the shipped problems whose answer is a number."""
    import pandas as pd

    records = []
    for index, problem in enumerate(problems):
        answer = extract_boxed_answer(problem["solution"])
        if answer is None or not _NUMBER.fullmatch(answer):
            continue
        rationale = "\n".join(line for line in _plain_math(problem["solution"]).split("\n") if line.strip())
        raw = f"{rationale}\n#### {answer}"
        records.append({
            "data_source": GSM8K_DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{problem['problem']} {GSM8K_INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index, "answer": raw, "question": problem["problem"],
                           "reference_steps": gsm8k_solution_steps(raw)},
        })
    return pd.DataFrame(records)


def write_data(problems: list[dict], data_dir: str, seed: int,
               answer_style: str = "boxed") -> tuple[list[MathRow], list[MathRow]]:
    """Shuffle, split 4:1 and write ``train.parquet`` / ``test.parquet`` (the converter's rows, or verl's GSM8K rows
    for the ``gsm8k`` answer style); returns the (train, test) rows."""
    if len(problems) < 2:
        raise ValueError(f"need at least 2 problems (one is held out for validation), got {len(problems)}")
    order = list(problems)
    random.Random(seed).shuffle(order)
    n_test = max(1, len(order) // 5)
    os.makedirs(data_dir, exist_ok=True)
    splits = []
    for split, rows in (("train", order[n_test:]), ("test", order[:n_test])):
        if answer_style == "gsm8k":
            frame = gsm8k_rows(rows, split)
            frame.to_parquet(os.path.join(data_dir, f"{split}.parquet"))
            splits.append([MathRow(p[0]["content"], r["ground_truth"], e["answer"])
                           for p, r, e in zip(frame["prompt"], frame["reward_model"], frame["extra_info"])])
            continue
        frame = convert(rows, DATA_SOURCE, split)
        frame.to_parquet(os.path.join(data_dir, f"{split}.parquet"))
        splits.append([MathRow(p[0]["content"], r["ground_truth"], e["reference_solution"])
                       for p, r, e in zip(frame["prompt"], frame["reward_model"], frame["extra_info"])])
    return splits[0], splits[1]


def response_text(family: Family, row: MathRow) -> str:
    """The SFT target: thinking (the solution's paragraphs), then the final answer, as the family writes it; a
    ``gsm8k`` family writes the GSM8K answer (rationale lines, then ``#### a``), the rationale inside the thinking
    block where the family thinks."""
    if family.answer_style == "gsm8k":
        if THINK_OPEN not in family.added_tokens:
            return row.solution
        rationale = row.solution.rpartition("####")[0].strip()
        return f"{THINK_OPEN}\n{rationale}\n{THINK_CLOSE}\n\n#### {row.answer}"
    thinking = f"{row.solution}\n{THINK_CLOSE}\n\n**Final Answer**\n\\boxed{{{row.answer}}}"
    return thinking if family.thinks_in_prompt else f"{THINK_OPEN}\n{thinking}"


def build_tokenizer(family: Family, rows: list[MathRow], config: MiniatureConfig):
    """Byte-level BPE with Qwen2's normalizer and pre-tokenizer (tasks/model.py says why), wrapped with the family's
    special tokens and chat template; returns a ``PreTrainedTokenizerFast``. Deterministic."""
    # Special and added tokens are split off before the BPE sees text, so the chat scaffolding needs only its words.
    corpus = ["system\nuser\nassistant\nYou are a helpful assistant." + family.system_prompt]
    corpus += [f"{row.prompt}\n{response_text(family, row)}" for row in rows]
    return family_tokenizer(family, corpus, config)


def family_tokenizer(family: Family, corpus: list[str], config: MiniatureConfig):
    """``build_tokenizer`` on any text ``corpus``: the byte-level BPE trained on it, with the family's special and
    added tokens and chat template. Deterministic."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = train_qwen2_style_bpe(corpus, config.vocab_size, family.special_tokens, family.added_tokens)
    named = {family.bos_token, family.eos_token, family.pad_token}
    # transformers rebuilds a qwen2 folder's tokenizer as Qwen2Tokenizer, whose unk defaults to <|endoftext|>: a token
    # the R1 vocabulary lacks, which loading would append. Naming eos as unk avoids it (byte-level BPE never emits unk).
    unk_token = family.eos_token if family.model_type == "qwen2" else None
    with open(os.path.join(ASSETS, "chat_templates", family.template), encoding="utf-8") as f:
        template = f.read()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=family.bos_token,
        eos_token=family.eos_token,
        pad_token=family.pad_token,
        unk_token=unk_token,
        additional_special_tokens=[t for t in family.special_tokens if t not in named],
        chat_template=template,
        clean_up_tokenization_spaces=False,
        model_max_length=config.max_position_embeddings,
    )


def build_model(family: Family, tokenizer, config: MiniatureConfig):
    """Randomly initialised fp32 model of the family's class, sized to ``tokenizer``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_class, model_class = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[
        family.model_type]
    bos_id, eos_id = tokenizer.convert_tokens_to_ids([family.config_bos_token, family.eos_token])
    pad_id, stop_ids = tokenizer.pad_token_id, tokenizer.convert_tokens_to_ids(list(family.stop_tokens))
    model_config = config_class(
        vocab_size=len(tokenizer), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.hidden_size // config.num_attention_heads,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=family.tie_word_embeddings,
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id, attn_implementation="sdpa", dtype="float32",
    )
    torch.manual_seed(config.seed)
    model = model_class(model_config)
    model.generation_config = GenerationConfig(bos_token_id=bos_id, eos_token_id=stop_ids, pad_token_id=pad_id)
    return model


def warm_start(model, tokenizer, family: Family, rows: list[MathRow], config: MiniatureConfig) -> dict:
    """Causal-LM SFT in place, loss on response tokens (and eos) only; returns ``{"steps", "final_loss"}``."""
    import torch

    from rredcot_verl.tasks.sft import short_sft_step

    sequences = [(chat_prompt_ids(tokenizer, row.prompt), response_ids(tokenizer, response_text(family, row)))
                 for row in rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.98), weight_decay=0.01)
    rng = random.Random(config.seed)
    model.train()
    for step in range(config.sft_steps):
        batch = rng.sample(sequences, min(config.batch_size, len(sequences)))
        loss = short_sft_step(model, optimizer, batch, tokenizer.pad_token_id, config.lr, step, config.warmup_steps,
                              config.sft_steps)
    model.eval()
    return {"steps": config.sft_steps, "final_loss": round(loss.item(), 4)}


def evaluate(model, tokenizer, rows: list[MathRow], max_new_tokens: int, seed: int,
             answer_style: str = "boxed") -> dict:
    """Share of responses with an answer (``boxed_rate``: a boxed one, or a ``####`` one for the gsm8k style) and
    share scored correct by the family's reward (math-verify; verl's GSM8K comparison), for temperature-1 samples
    and greedy decoding of ``rows``' prompts."""
    from rredcot_verl.tasks.math_reward import compute_score
    from rredcot_verl.tasks.sft import generate_responses

    def score(response: str, truth: str) -> float:
        if answer_style == "gsm8k":
            answer = GSM8K.extract_answer(response)
            return float(answer is not None and GSM8K.equivalent(answer, truth))
        return compute_score(DATA_SOURCE, response, truth)

    read = GSM8K.extract_answer if answer_style == "gsm8k" else extract_boxed_answer
    report = {}
    for mode, do_sample in (("sampled", True), ("greedy", False)):
        responses = generate_responses(model, tokenizer, rows, do_sample, max_new_tokens, seed=seed)
        boxed = [read(response) is not None for response in responses]
        scores = [score(response, row.answer) for row, response in zip(rows, responses)]
        report[mode] = {"boxed_rate": sum(boxed) / len(rows), "accuracy": sum(scores) / len(rows),
                        "example": responses[0]}
    return report


def fingerprint(family_name: str, n_problems: int | None, config: MiniatureConfig) -> dict:
    """What a build depends on: family, sizes, and the bytes of the problems, the template, this module, the
    converter and the tasks module (GSM8K steps); a rebuild takes seconds, so any edit to them invalidates a cached
    build rather than a version number."""
    digest = hashlib.sha256()
    template = os.path.join(ASSETS, "chat_templates", ALL_FAMILIES[family_name].template)
    for path in (PROBLEMS_PATH, template, os.path.abspath(__file__), math_data.__file__, base.__file__):
        with open(path, "rb") as f:
            digest.update(f.read())
    return {"family": family_name, "problems": n_problems, "config": asdict(config),
            "sources_sha256": digest.hexdigest()}


def save_checked(model, tokenizer, model_dir: str) -> None:
    """``save_model_dir``, then check that the folder's tokenizer loads back as the one trained (what verl and vLLM
    will load must be what was trained)."""
    save_model_dir(model, tokenizer, model_dir)
    _, loaded = load_model_dir(model_dir, with_model=False)
    if loaded.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"{model_dir}: the tokenizer loads back with a different vocabulary")


def write_family_data(family_name: str, n_problems: int | None, config: MiniatureConfig,
                      data_dir: str) -> tuple[list[MathRow], list[MathRow]]:
    """The family's data from the first ``n_problems`` shipped problems (``write_data``)."""
    return write_data(load_problems(n_problems), data_dir, config.seed, ALL_FAMILIES[family_name].answer_style)


def token_lengths(tokenizer, family: Family, rows: list[MathRow]) -> dict:
    """Longest chat prompt and SFT target in tokens (for verl's max_prompt_length / max_response_length)."""
    return {"max_prompt_tokens": max(len(chat_prompt_ids(tokenizer, row.prompt)) for row in rows),
            "max_reference_response_tokens": max(len(response_ids(tokenizer, response_text(family, row)))
                                                 for row in rows)}


def train(family_name: str, config: MiniatureConfig, data: tuple[list[MathRow], list[MathRow]], model_dir: str,
          log: Callable[[str], None]) -> dict:
    """The family's tokenizer and model, warm-started on the training rows and saved to ``model_dir``; returns the
    warm start's record (``sft``) and its evaluation on training prompts (``eval``)."""
    family, (train_rows, test_rows) = ALL_FAMILIES[family_name], data
    tokenizer = build_tokenizer(family, train_rows + test_rows, config)
    model = build_model(family, tokenizer, config)
    sft = warm_start(model, tokenizer, family, train_rows, config)
    save_checked(model, tokenizer, model_dir)
    longest = token_lengths(tokenizer, family, train_rows + test_rows)["max_reference_response_tokens"]
    evaluation = evaluate(model, tokenizer, train_rows[: config.n_eval], longest + 32, config.seed,
                          family.answer_style)
    sampled, greedy = evaluation["sampled"], evaluation["greedy"]
    wrote = "boxed" if family.answer_style == "boxed" else "answered"
    log(f"miniature {family_name}: on {min(config.n_eval, len(train_rows))} training prompts sampled {wrote} "
        f"{sampled['boxed_rate']:.0%} / correct {sampled['accuracy']:.0%}, greedy {wrote} {greedy['boxed_rate']:.0%} / "
        f"correct {greedy['accuracy']:.0%}")
    return {"sft": sft, "eval": evaluation}


def measure(family_name: str, data: tuple[list[MathRow], list[MathRow]], model_dir: str) -> dict:
    _, tokenizer = load_model_dir(model_dir, with_model=False)
    train_rows, test_rows = data
    return {"family": family_name, "n_train": len(train_rows), "n_test": len(test_rows),
            **token_lengths(tokenizer, ALL_FAMILIES[family_name], train_rows + test_rows),
            "vocab_size": len(tokenizer)}
