"""Tokenizer and tiny Qwen2 model for the embedded task, built from scratch (no model hub).

Tokenizer: byte-level BPE trained on task text, with every digit pre-split into its own token, wrapped as a
``PreTrainedTokenizerFast`` with a ChatML chat template. Byte-level (not a character vocabulary) because it round
trips any text exactly, which verl, vLLM and the probes rely on. It is trained with exactly the normalizer and
pre-tokenizer of transformers' ``Qwen2Tokenizer`` (NFC, Qwen's split regex, which isolates every digit, then
ByteLevel): ``AutoTokenizer`` ignores the saved tokenizer class for ``model_type=qwen2`` folders and rebuilds those
stages from its own code, so any other choice would be silently replaced when verl or vLLM load the folder.
``<think>``/``</think>`` are added tokens that are *not* special, so ``decode(..., skip_special_tokens=True)`` (what
verl hands the reward function) keeps them; ``<|endoftext|>`` ends every response and is the eos that stops generation.

Model: ``Qwen2ForCausalLM`` (hidden 128, 4 heads of 32, 3 layers, about 0.7M parameters), a shape verl and vLLM
serve as they would any Qwen2 checkpoint.
"""

from __future__ import annotations

import glob
import os
import random
from dataclasses import asdict, dataclass

from rredcot_verl.tasks.arithmetic import (
    THINK_CLOSE,
    THINK_OPEN,
    ArithmeticTaskConfig,
    make_problem,
    reference_response,
)

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# vLLM's CPU attention kernels exist only for these head sizes (a head_dim of 16 fails at engine start).
VLLM_CPU_HEAD_DIMS = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})


@dataclass(frozen=True)
class TinyModelConfig:
    """Shape of the tokenizer and model.

    Attributes:
        vocab_size: BPE target; training stops earlier (about 300) because digits are pre-split and few pairs remain.
        tokenizer_corpus_size: number of generated problems (prompt + reference response) the BPE is trained on.
        tokenizer_seed: seed of that corpus.
        hidden_size, num_attention_heads, num_key_value_heads, num_hidden_layers, intermediate_size: Qwen2 shape;
            head_dim = hidden_size / num_attention_heads must be one that vLLM's CPU attention supports.
        max_position_embeddings: longest prompt + response (task sequences are under 100 tokens).
        rope_theta: rotary base.
    """

    vocab_size: int = 350
    tokenizer_corpus_size: int = 20_000
    tokenizer_seed: int = 0
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    num_hidden_layers: int = 3
    intermediate_size: int = 384
    max_position_embeddings: int = 512
    rope_theta: float = 1e4

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}"
            )
        check_vllm_head_dim(self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if min(self.vocab_size, self.tokenizer_corpus_size, self.num_hidden_layers, self.intermediate_size) < 1:
            raise ValueError(f"sizes must be positive: {self}")

    def as_dict(self) -> dict:
        return asdict(self)


def check_vllm_head_dim(head_dim: int) -> None:
    """Raise ValueError unless vLLM's CPU attention supports ``head_dim``."""
    if head_dim not in VLLM_CPU_HEAD_DIMS:
        raise ValueError(f"head_dim={head_dim} is not supported by vLLM's CPU attention; use one of "
                         f"{sorted(VLLM_CPU_HEAD_DIMS)}")


def _tokenizer_corpus(config: TinyModelConfig, task: ArithmeticTaskConfig) -> list[str]:
    # Special tokens are split off before the BPE sees text, so the chat framing needs only its words.
    rng = random.Random(config.tokenizer_seed)
    corpus = []
    for _ in range(config.tokenizer_corpus_size):
        problem = make_problem(rng, task)
        corpus.append(f"user\n{problem.prompt}\nassistant\n{reference_response(problem)}")
    return corpus


def train_qwen2_style_bpe(corpus, vocab_size: int, special_tokens, added_tokens):
    """A byte-level BPE with Qwen2's normalizer and pre-tokenizer (digits split one by one, ``}$``-style punctuation
    pieces as Qwen's vocabulary has them) trained on ``corpus``; returns a ``tokenizers.Tokenizer``. Deterministic.

    Args:
        special_tokens: single tokens that decoding with ``skip_special_tokens`` drops (eos, pad, chat markers).
        added_tokens: single tokens added after training, kept on decode (thinking markers): tokens added before
            training are dropped by the trainer.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, so no text is ever unknown
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in added_tokens])
    return tokenizer


def build_tokenizer(config: TinyModelConfig = TinyModelConfig(), task: ArithmeticTaskConfig = ArithmeticTaskConfig()):
    """Train the byte-level BPE on generated task text; returns a ``PreTrainedTokenizerFast``. Deterministic."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = train_qwen2_style_bpe(
        _tokenizer_corpus(config, task), config.vocab_size, SPECIAL_TOKENS, (THINK_OPEN, THINK_CLOSE)
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=config.max_position_embeddings,
    )


def build_model(tokenizer, config: TinyModelConfig = TinyModelConfig(), seed: int = 0):
    """Randomly initialised ``Qwen2ForCausalLM`` (fp32, sdpa, tied embeddings) sized to ``tokenizer``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    model_config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=eos_id,  # no bos is ever prepended; Qwen2 likewise points bos at <|endoftext|>
        eos_token_id=eos_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(model_config)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id
    )
    return model


def save_model_dir(model, tokenizer, path: str) -> None:
    """Write a model folder (config, safetensors weights, generation config, tokenizer) that verl and vLLM load."""
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def load_model_dir(path: str, with_model: bool = True):
    """Load ``(model, tokenizer)`` from a folder written by ``save_model_dir`` (model is None if not ``with_model``).

    Raises FileNotFoundError naming the folder when it, its ``config.json``, its safetensors weights or its
    tokenizer files are missing, and ValueError naming it when they do not load or do not fit together.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"model folder {path} does not exist; build it with `python -m rredcot_verl.tasks.build`"
        )
    missing = [
        name
        for name, present in (
            ("config.json", os.path.isfile(os.path.join(path, "config.json"))),
            ("*.safetensors weights", bool(glob.glob(os.path.join(path, "*.safetensors")))),
            ("tokenizer.json", os.path.isfile(os.path.join(path, "tokenizer.json"))),
            ("tokenizer_config.json", os.path.isfile(os.path.join(path, "tokenizer_config.json"))),
        )
        if not present
    ]
    if missing:
        raise FileNotFoundError(f"model folder {path} is incomplete, missing: {', '.join(missing)}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model_config = AutoConfig.from_pretrained(path)
    except Exception as exc:  # transformers raises many types for a corrupt file; the caller needs the folder
        raise ValueError(f"model folder {path} has an unreadable config or tokenizer: {exc}") from exc
    head_dim = model_config.hidden_size // model_config.num_attention_heads
    check_vllm_head_dim(head_dim)
    if len(tokenizer) > model_config.vocab_size:
        raise ValueError(
            f"model folder {path}: tokenizer has {len(tokenizer)} tokens but the model only {model_config.vocab_size}"
        )
    if not with_model:
        return None, tokenizer
    try:
        model, loading_info = AutoModelForCausalLM.from_pretrained(path, dtype="float32", output_loading_info=True)
    except Exception as exc:
        raise ValueError(f"model folder {path} has unreadable weights: {exc}") from exc
    if loading_info["missing_keys"] or loading_info["mismatched_keys"]:
        # transformers would otherwise leave these randomly initialised with only a warning
        raise ValueError(f"model folder {path} has weights that do not match its config: {loading_info}")
    return model, tokenizer


def chat_prompt_ids(tokenizer, user_text: str) -> list[int]:
    """Token ids of the chat prompt that ends with the assistant header, as verl's dataset builds them."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def response_ids(tokenizer, response_text: str) -> list[int]:
    """Token ids of a response as the policy generates it: the text, then eos."""
    return tokenizer.encode(response_text, add_special_tokens=False) + [tokenizer.eos_token_id]
