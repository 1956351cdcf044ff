"""The ``algorithm.rredcot`` settings: the core modules' dataclasses behind one strict omegaconf reader.

Every section maps onto the frozen dataclass of the module that uses it, so defaults and validation live in one place
(the dataclass) and an unknown key anywhere in the section is an error naming the key and the accepted ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rredcot_verl.ibpo import IBPOConfig
from rredcot_verl.probes import ProbeSettings
from rredcot_verl.redistribution import RedistributionConfig
from rredcot_verl.segmentation import SegmentationConfig

@dataclass(frozen=True)
class CandidateSettings:
    """Where exit-probe answers and reference continuations come from.

    Attributes:
        source: ``"both"`` (default), ``"group"`` (distinct answers / traces of the group's correct rollouts) or
            ``"ground_truth"`` (the dataset's ``reward_model.ground_truth`` and ``extra_info.reference_steps``).
        answer_prefix / answer_suffix: text around an answer string when it is scored after the exit text
            (``\\boxed`` + ``{59}``); the tokenizer's EOS is appended.
        think_start / think_end: the thinking markers of the model family.
    """

    source: str = "both"
    answer_prefix: str = "{"
    answer_suffix: str = "}"
    think_start: str = "<think>"
    think_end: str = "</think>"

    def __post_init__(self):
        if self.source not in ("both", "group", "ground_truth"):
            raise ValueError(f"candidates.source must be 'both', 'group' or 'ground_truth', got {self.source!r}")

@dataclass(frozen=True)
class MonteCarloSettings:
    """``segment_mc``: values from K continuations per boundary prefix through the rollout engine.

    Attributes:
        num_continuations: K per boundary (default 9, VinePPO's choice).
        max_tokens: length cap of a continuation; a truncated continuation counts as a failure.
        temperature: sampling temperature of the continuations.
    """

    num_continuations: int = 9
    max_tokens: int = 128
    temperature: float = 1.0

    def __post_init__(self):
        if self.num_continuations < 1:
            raise ValueError(f"segment_mc.num_continuations must be >= 1, got {self.num_continuations}")
        if self.max_tokens < 1:
            raise ValueError(f"segment_mc.max_tokens must be >= 1, got {self.max_tokens}")

@dataclass(frozen=True)
class RRedCoTSettings:
    """``algorithm.rredcot``. ``snapshot_dir``: when set, every step's traces with their segment data and token
    advantages are written there as ``step_XXXXX.json`` (input of ``python -m rredcot_verl.report``)."""

    snapshot_dir: str | None = None
    segmentation: SegmentationConfig = field(default_factory=SegmentationConfig)
    probe: ProbeSettings = field(default_factory=ProbeSettings)
    candidates: CandidateSettings = field(default_factory=CandidateSettings)
    redistribution: RedistributionConfig = field(default_factory=RedistributionConfig)
    ibpo: IBPOConfig = field(default_factory=IBPOConfig)
    segment_mc: MonteCarloSettings = field(default_factory=MonteCarloSettings)

def _build(cls, values: Any, where: str):
    if values is None:
        return cls()
    if not isinstance(values, dict):
        raise ValueError(f"{where} must be a mapping, got {type(values).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {where}; accepted: {sorted(known)}")
    kwargs = {}
    for name, value in values.items():
        sub_cls = _SECTIONS.get(name) if cls is RRedCoTSettings else None
        if sub_cls is not None:
            kwargs[name] = _build(sub_cls, value, f"{where}.{name}")
        elif isinstance(value, list):
            kwargs[name] = tuple(value)
        else:
            kwargs[name] = value
    if "norm_adv_by_std" in kwargs:
        raise ValueError(f"{where}.norm_adv_by_std is set by verl's algorithm.norm_adv_by_std_in_grpo; remove it here")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"invalid {where}: {error}") from error

_SECTIONS = {
    "segmentation": SegmentationConfig,
    "probe": ProbeSettings,
    "candidates": CandidateSettings,
    "redistribution": RedistributionConfig,
    "ibpo": IBPOConfig,
    "segment_mc": MonteCarloSettings,
}

def settings_from_config(algorithm_config: Any) -> RRedCoTSettings:
    """Read ``algorithm.rredcot`` (omegaconf node, dict or None) strictly."""
    section = algorithm_config.get("rredcot", None) if algorithm_config is not None else None
    if section is not None and not isinstance(section, dict):
        from omegaconf import OmegaConf

        section = OmegaConf.to_container(section, resolve=True)
    return _build(RRedCoTSettings, section, "algorithm.rredcot")
