"""Which models the value pass scores exactly: one predicate, read by the launch and by the value pass.

The value pass (``core/scoring.py``) runs the actor's decoder with its own attention function (causal sdpa over the
trace, sdpa with the probe mask over the probe tokens) and projects the final hidden states with the output layer
itself. Its log-probs equal the model's own (``model(...).logits / temperature``) when every layer is full causal
attention dispatched through transformers' ``AttentionInterface`` and the logits are the output layer's, possibly
scaled or softcapped as :func:`logit_transform` reproduces. :func:`value_pass_refusal` names what breaks that, from a
transformers config (the launch reads the model folder's ``config.json`` before Ray starts) and, where given, the
model or its class (the value pass passes the loaded actor). docs/usage.md ("Model families") lists what a survey of
transformers 5.19's model configs found and how each is handled.

This module imports neither verl nor ray.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch

__all__ = [
    "LOGIT_SCALES",
    "REFUSAL_KINDS",
    "LogitTransform",
    "ModelRefusal",
    "logit_transform",
    "model_class_for",
    "value_pass_refusal",
]


@dataclass(frozen=True)
class LogitTransform:
    """What a model does to its output layer's result: ``logits = softcap · tanh(scale · z / softcap)`` with
    ``z = W h + b`` (no tanh where ``softcap`` is None)."""

    scale: float = 1.0
    softcap: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


# model_type -> (config key, whether the model multiplies its logits by it or divides them by it): the families whose
# CausalLM forward rescales the output layer's result (transformers 5.19's modeling files, after ``self.lm_head``).
LOGIT_SCALES = {
    **{name: ("logit_scale", "multiply") for name in ("cohere", "cohere2", "cohere2_moe", "cohere_compass_text")},
    **{name: ("logits_scaling", "divide") for name in ("granite", "granitemoe", "granitemoeshared", "granite_swa",
                                                        "granitemoe_swa", "granitemoehybrid")},
    "hyperclovax": ("logits_scaling", "multiply"),
    "falcon_h1": ("lm_head_multiplier", "multiply"),
}  # fmt: skip
# Gemma's family (and nanochat, vaultgemma, t5gemma) cap the logits after any scale: cap · tanh(logits / cap).
_FINAL_SOFTCAP = "final_logit_softcapping"
# Config keys that read like logit changes but act elsewhere: routers choose experts per token, generation keeps
# fewer logits.
_HARMLESS_LOGIT_KEYS = {"output_router_logits", "num_logits_to_keep", "router_logits", "moe_router_logit_softcapping"}
# Any other key of these shapes with a value that changes something is refused: a rescaling the value pass does not
# reproduce gives log-probs that are silently wrong.
_LOGIT_KEY = re.compile(r"logit|lm_head|output_multiplier|mup")
# Attention-score caps (softcapping), which torch's sdpa cannot apply.
_ATTENTION_CAPS = ("attn_logit_softcapping", "attention_logit_cap")
# Windowed or chunked attention declared for the whole model (configs with ``layer_types`` declare it per layer):
# the value pass attends to every earlier position.
_WINDOWS = ("sliding_window", "attention_window_size", "window_size", "sliding_window_size", "attention_chunk_size",
            "keep_window_size")  # fmt: skip
# Sub-configs of multimodal models: the value pass sees token ids only (no pixel or audio features, 1-D positions).
_MODALITIES = ("vision_config", "audio_config", "speech_config")
# Attention with terms transformers hands the attention function beyond the mask, which the value pass's sdpa calls
# drop: learned sinks (``s_aux``), and Doge's content-dependent mask (its ``keep_window_size`` dynamic mask).
_ATTENTION_EXTRAS = {
    **{name: "attention sinks" for name in ("gpt_oss", "granite_swa", "granitemoe_swa", "mimo_v2_flash", "deepseek_v4",
                                            "hy_v4", "openai_privacy_filter")},
    "doge": "a dynamic attention mask computed from the hidden states",
}  # fmt: skip


def _neutral(key: str, value) -> bool:
    """Whether a config value leaves the model as a plain one: unset, off, or a unit multiplier."""
    if value is None or value is False:
        return True
    is_factor = any(word in key for word in ("scale", "scaling", "multiplier"))
    return is_factor and isinstance(value, (int, float)) and float(value) == 1.0


def _text_config(config):
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


def _settings(config) -> dict:
    to_dict = getattr(config, "to_dict", None)
    return to_dict() if callable(to_dict) else dict(vars(config))


def model_class_for(config):
    """The class ``AutoModelForCausalLM`` loads for ``config`` (what verl's actor is), or None when transformers maps
    none (remote code, a model type this transformers does not know)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", None))
    return getattr(transformers, name, None) if isinstance(name, str) else None


def _window(config) -> tuple[str, int] | None:
    """The config's attention window (key, tokens), where one is shorter than the model's positions: a window at
    least that long never leaves a position out."""
    if getattr(config, "use_sliding_window", True) is False:
        return None
    reach = getattr(config, "max_position_embeddings", None)
    for key in _WINDOWS:
        window = getattr(config, key, None)
        is_length = isinstance(window, int) and not isinstance(window, bool) and window > 0
        if is_length and (reach is None or window < reach):
            return key, window
    return None


@dataclass(frozen=True)
class ModelRefusal:
    """Why the value pass cannot score a model exactly: ``kind`` (one of ``REFUSAL_KINDS``) and ``detail``, one
    phrase naming the config key (``str()`` gives the detail, for one-line messages)."""

    kind: str
    detail: str

    def __str__(self) -> str:
        return self.detail


REFUSAL_KINDS = {
    "multimodal": "a vision or audio sub-config: the value pass scores token ids without images, audio or their "
                  "positions",
    "layers": "layers other than full causal attention (sliding-window shorter than the positions, chunked, "
              "linear-attention, state-space or recurrent)",
    "window": "one attention window for the whole model, shorter than its positions",
    "attention_softcap": "softcapped attention scores, which torch's sdpa does not apply",
    "attention_terms": "attention terms the value pass's sdpa calls drop (sinks, a dynamic mask)",
    "attention_interface": "attention that does not dispatch through transformers' AttentionInterface",
    "logits_to_keep": "a forward without logits_to_keep",
    "logits": "a change of the logits the value pass does not reproduce",
}  # fmt: skip


def _layer_refusal(config) -> ModelRefusal | None:
    """Layers other than full causal attention: windowed, chunked, linear-attention or recurrent ones."""
    window = _window(config)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        other = sorted({str(kind) for kind in layer_types} - {"full_attention"})
        if not other or (other == ["sliding_attention"] and window is None):
            return None
        described = f" ({window[0]}={window[1]})" if window and "sliding_attention" in other else ""
        return ModelRefusal("layers", f"layer_types with {' and '.join(other)} layers{described}, not full causal "
                                      "attention")  # fmt: skip
    block_types = getattr(config, "block_types", None)
    if block_types and any(str(kind) != "attention" for kind in block_types):
        kinds = " and ".join(sorted(set(map(str, block_types)) - {"attention"}))
        return ModelRefusal("layers", f"block_types with {kinds} blocks, not full causal attention")
    return ModelRefusal("window", f"{window[0]}={window[1]} (windowed attention)") if window else None


def value_pass_refusal(config, model=None) -> ModelRefusal | None:
    """What the value pass cannot score exactly for a model with this transformers ``config``, or None.

    Args:
        config: the model's transformers config (``AutoConfig.from_pretrained`` of its folder, or ``model.config``).
        model: the loaded model, or its class; None: the class ``AutoModelForCausalLM`` maps the config to.

    Returns:
        A ``ModelRefusal`` whose ``str()`` is one phrase naming the config key and what it does (e.g.
        ``"attn_logit_softcapping=50.0 (softcapped attention scores, ...)"``), for the caller's one-line message;
        None where the value pass is exact.
    """
    for key in _MODALITIES:
        if getattr(config, key, None) is not None:
            return ModelRefusal("multimodal", f"{key} (a multimodal model: the value pass scores token ids without "
                                              "images, audio or their positions)")  # fmt: skip
    text = _text_config(config)
    layers = _layer_refusal(text)
    if layers:
        return layers
    for key in _ATTENTION_CAPS:
        value = getattr(text, key, None)
        if not _neutral(key, value):
            return ModelRefusal("attention_softcap", f"{key}={value} (softcapped attention scores, which torch's "
                                                     "sdpa does not apply)")  # fmt: skip
    extra = _ATTENTION_EXTRAS.get(getattr(text, "model_type", None))
    if extra:
        return ModelRefusal("attention_terms", f"model_type={text.model_type} ({extra}, which the value pass's "
                                               "attention does not apply)")  # fmt: skip
    model = model if model is not None else model_class_for(config)
    if model is not None:
        name = getattr(model, "__name__", type(model).__name__)
        if not getattr(model, "_supports_attention_backend", False):
            return ModelRefusal("attention_interface", f"{name} (its attention does not dispatch through "
                                                       "transformers' AttentionInterface, which the value pass's "
                                                       "probe mask needs)")  # fmt: skip
        parameters = inspect.signature(model.forward).parameters.values()
        if not any(p.name == "logits_to_keep" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            return ModelRefusal("logits_to_keep", f"{name}.forward without logits_to_keep")
    handled = {_FINAL_SOFTCAP, LOGIT_SCALES.get(getattr(text, "model_type", None), (None,))[0]}
    for key, value in sorted(_settings(text).items()):
        if _LOGIT_KEY.search(key) and key not in _HARMLESS_LOGIT_KEYS | handled | set(_ATTENTION_CAPS):
            if not _neutral(key, value):
                return ModelRefusal("logits", f"{key}={value} (a change of the logits the value pass does not "
                                              "reproduce)")  # fmt: skip
    return None


def logit_transform(config) -> LogitTransform:
    """How the model's forward turns the output layer's result into logits, for a config
    :func:`value_pass_refusal` accepts (``core/scoring.py`` applies it before the temperature, as the model's logits
    come before verl divides them by it)."""
    text = _text_config(config)
    scale = 1.0
    key, operation = LOGIT_SCALES.get(getattr(text, "model_type", None), (None, None))
    value = getattr(text, key, None) if key else None
    if value is not None:
        scale = float(value) if operation == "multiply" else 1.0 / float(value)
    softcap = getattr(text, _FINAL_SOFTCAP, None)
    return LogitTransform(scale=scale, softcap=None if softcap is None else float(softcap))
