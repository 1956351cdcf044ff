"""Tiny models of the model families the support matrix launches and the value-pass tests score.

    python -m benchmarks.model_families --family cohere --out DIR
    python -m benchmarks.model_families --embedded-task --data-source math_dapo --out DIR
    python -m benchmarks.model_families --embedded-task --agent-name tool_agent --out DIR
    python -m benchmarks.model_families --survey

The first writes ``DIR/model`` (the family's config at a tiny size, random weights, the embedded task's tokenizer and
chat template) and ``DIR/data`` (a few rows of the embedded task), the folder ``recipes/tiny_cpu`` reads from
``$RREDCOT_BUILD``. The weights are random: a launch shows whether verl, vLLM and the value pass run the family, not
what it learns. Each family keeps the quirk it is here for (Cohere's ``logit_scale``, Granite's multipliers and
``logits_scaling``, Gemma2's softcapping and sliding layers, Qwen3-Next's linear-attention layers). The second writes
the embedded task's own build (its trained warm start) with the rows' ``data_source`` changed, for verl's scorers, or
with an ``agent_name`` column, which makes verl run that agent loop for each row.

The last prints the survey docs/usage.md shows ("Model families"): every model type transformers maps to a causal
LM, at its default config, sorted by what ``core.model_support`` makes of it (scored as is, with the logit scaling or
softcapping reproduced, or refused, by kind).
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
WARM_START = ROOT / "rredcot_verl" / "tasks" / "assets" / "warmstart"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
# The embedded tokenizer's special ids (warm start's config.json): bos = eos = <|endoftext|>, pad = <|pad|>.
SPECIAL_IDS = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}
# Heads of 32: vLLM's CPU attention takes head sizes of 32 and more (a launch with 16 died at its first request).
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 512}  # fmt: skip


@dataclass(frozen=True)
class Family:
    """A transformers model family at a tiny size: its config class (by name) and what it sets beyond ``TINY``."""

    config_class: str
    settings: dict = field(default_factory=dict)
    vision: dict | None = None  # a vision-language model: its vision tower's settings (the text ones in text_config)

    def config(self, vocab_size: int):
        settings = {**TINY, **SPECIAL_IDS, "vocab_size": vocab_size, **self.settings}
        if self.vision is not None:
            return getattr(transformers, self.config_class)(text_config=settings, vision_config=self.vision)
        return getattr(transformers, self.config_class)(**settings)


FAMILIES = {
    "qwen2": Family("Qwen2Config"),
    "qwen3": Family("Qwen3Config", {"head_dim": 32}),
    "llama": Family("LlamaConfig"),
    "mistral": Family("MistralConfig", {"sliding_window": None}),
    "cohere": Family("CohereConfig", {"logit_scale": 0.25}),
    # Granite 3's multipliers: embeddings x 12, residual branches x 0.22, attention scale 1/128, logits / 8.
    "granite": Family("GraniteConfig", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                        "attention_multiplier": 0.0078125, "logits_scaling": 8.0}),
    "phi3": Family("Phi3Config"),
    # Phi-2's output layer has a bias.
    "phi": Family("PhiConfig"),
    # Gemma2 as published: sliding and full layers alternate, attention scores and logits are softcapped. A window
    # shorter than the traces, so that it acts.
    "gemma2": Family("Gemma2Config", {"head_dim": 32, "sliding_window": 16}),
    # Gemma2 with full attention only and no attention softcap: its logits softcap alone.
    "gemma2_full_attention": Family("Gemma2Config", {"head_dim": 32, "layer_types": ["full_attention"] * 2,
                                                     "attn_logit_softcapping": None, "final_logit_softcapping": 5.0}),
    # Hybrid attention: Gated-DeltaNet linear-attention layers and full-attention layers, as Qwen3.5 has them
    # (linear heads of 64: vLLM's CPU Gated-DeltaNet kernel takes head dims 64 and 128 only).
    "qwen3_next": Family("Qwen3NextConfig", {"head_dim": 32, "layer_types": ["linear_attention", "full_attention"],
                                             "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                             "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                                             "num_experts": 4, "num_experts_per_tok": 2,
                                             "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}),
    # A vision-language model: Qwen2-VL's language model (multimodal rotary sections over its heads of 32) and a
    # one-block vision tower.
    "qwen2_vl": Family("Qwen2VLConfig", {"rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]}},
                       vision={"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2}),
}  # fmt: skip


def tiny_model(name: str, vocab_size: int, seed: int = 0):
    """A family's tiny causal LM (or vision-language model) with random weights (fp32, eval mode)."""
    family = FAMILIES[name]
    torch.manual_seed(seed)
    auto = transformers.AutoModelForCausalLM if family.vision is None else transformers.AutoModelForImageTextToText
    return auto.from_config(family.config(vocab_size)).eval()


def build(name: str | None, out: Path, data_source: str | None = None, n_train: int = 8, n_val: int = 4,
          agent_name: str | None = None) -> Path:
    """``out/model`` and ``out/data`` for family ``name`` (see the module docstring; None: the embedded task's own
    warm start), the rows' ``data_source`` set to ``data_source`` where given (e.g. ``math_dapo``, which verl's
    default scorer judges -1 / +1) and an ``agent_name`` column (the agent loop verl runs for each row) where given;
    returns ``out``."""
    import pandas as pd

    from rredcot_verl.tasks.arithmetic import write_parquet

    model_dir = out / "model"
    if name is None:
        shutil.copytree(WARM_START, model_dir, dirs_exist_ok=True)
    else:
        model_dir.mkdir(parents=True, exist_ok=True)
        tiny_model(name, json.loads((WARM_START / "config.json").read_text())["vocab_size"]).save_pretrained(model_dir)
        for file in TOKENIZER_FILES:
            shutil.copy(WARM_START / file, model_dir / file)
    for path in write_parquet(str(out / "data"), n_train=n_train, n_val=n_val, seed=0):
        columns = {"data_source": data_source, "agent_name": agent_name}
        if any(value is not None for value in columns.values()):
            frame = pd.read_parquet(path)
            for column, value in columns.items():
                if value is not None:
                    frame[column] = value
            frame.to_parquet(path, index=False)
    return out


def survey() -> str:
    """The markdown table of docs/usage.md's "Model families": each causal-LM model type of the installed transformers
    at its default config, grouped by what the value pass makes of it."""
    import warnings

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from rredcot_verl.core.model_support import LOGIT_SCALES, REFUSAL_KINDS, logit_transform, value_pass_refusal

    groups: dict[str, list[str]] = {}
    transformers.logging.set_verbosity_error()
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                config = CONFIG_MAPPING[model_type]()
            except Exception as error:  # a config without defaults (e.g. one that needs its sub-configs named)
                groups.setdefault(f"not surveyed: no default config ({type(error).__name__})", []).append(model_type)
                continue
        refusal = value_pass_refusal(config)
        if refusal is not None:
            group = f"refused: {REFUSAL_KINDS[refusal.kind]}"
        else:
            group = ("scored exactly, the model's logit scale applied" if model_type in LOGIT_SCALES else
                     "scored exactly, the model's logit softcap applied" if logit_transform(config).softcap else
                     "scored exactly as is")  # fmt: skip
        groups.setdefault(group, []).append(model_type)
    lines = [f"Surveyed on transformers {transformers.__version__} (`python -m benchmarks.model_families --survey`):",
             "", "| value pass | model types (default config) |", "|---|---|"]  # fmt: skip
    for group in sorted(groups, key=lambda g: (not g.startswith("scored"), g.startswith("not"), g)):
        lines.append(f"| {group} | {', '.join(f'`{name}`' for name in groups[group])} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=sorted(FAMILIES))
    parser.add_argument("--embedded-task", action="store_true", help="the embedded task's own warm start instead")
    parser.add_argument("--data-source", default=None, help="the rows' data_source (default: the task's own)")
    parser.add_argument("--agent-name", default=None, help="an agent_name column: the agent loop verl runs per row")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--survey", action="store_true", help="print docs/usage.md's model-family survey and exit")
    return parser


def main(argv: list[str] | None = None) -> None:
    """The command line (``argv``: its arguments, default ``sys.argv``'s)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.survey:
        print(survey())
        return
    if (args.family is None) == (not args.embedded_task) or args.out is None:
        parser.error("--out and one of --family / --embedded-task are required (or --survey)")
    build(args.family, args.out, args.data_source, agent_name=args.agent_name)


if __name__ == "__main__":
    main()
