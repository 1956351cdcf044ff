"""The ``algorithm.rredcot`` settings: the core modules' dataclasses behind one strict omegaconf reader.

Every section maps onto the frozen dataclass of the module that uses it, so defaults and validation live in one place
(the dataclass) and an unknown key anywhere in the section is an error naming the key and the accepted ones.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Hashable, Sequence

from rredcot_verl.core import outcomes
from rredcot_verl.core.fused import FusedSettings
from rredcot_verl.core.ibpo import IBPOSettings
from rredcot_verl.core.montecarlo import MonteCarloSettings
from rredcot_verl.core.probes import ProbeSettings
from rredcot_verl.core.scoring import ValuePassSettings
from rredcot_verl.core.redistribution import RedistributionSettings
from rredcot_verl.core.segmentation import BoundaryVocab, SegmentationSettings

CANDIDATE_SOURCES = ("both", "group", "ground_truth", "group_and_repairs")


@dataclass(frozen=True)
class CandidateSettings:
    """Where exit-probe answers and reference continuations come from (how they are written: ``probe.profile``).

    Attributes:
        source: ``"both"`` (default), ``"group"`` (distinct answers / traces of the group's correct rollouts),
            ``"ground_truth"`` (the dataset's ``reward_model.ground_truth`` and ``extra_info.reference_steps``) or
            ``"group_and_repairs"`` (the group's correct rollouts; a group without one takes the verified IBPO
            repairs of its traces, generated through the rollout engine before the log-prob pass: no reference
            solutions needed, at the cost of the repairs).
    """

    source: str = "both"

    def __post_init__(self):
        if self.source not in CANDIDATE_SOURCES:
            raise ValueError(f"candidates.source must be one of {CANDIDATE_SOURCES}, got {self.source!r}")

    @property
    def uses_group(self) -> bool:
        return self.source in ("both", "group", "group_and_repairs")

    @property
    def uses_dataset(self) -> bool:
        return self.source in ("both", "ground_truth")

    @property
    def uses_repairs(self) -> bool:
        return self.source == "group_and_repairs"

@dataclass(frozen=True)
class RRedCoTSettings:
    """``algorithm.rredcot``.

    Attributes:
        snapshot_dir: when set, a step's traces with their segment data and token advantages are written there as
            ``step_XXXXX.json`` (input of ``python -m rredcot_verl.report``); for ``rredcot`` also the step's
            probe plans, ``step_XXXXX_plans.pt`` (``torch.load(..., weights_only=False)``: a list of
            ``core.planning.TracePlan`` in the order of the snapshot's traces, which ``core.values.score_plans``
            re-scores offline). How often and how much: ``snapshot_freq``, ``snapshot_max_traces``.
        snapshot_freq: write a snapshot at the training steps divisible by this (1, default: every step; 10: steps
            10, 20, ...), as verl's ``trainer.test_freq`` counts. At least 1.
        snapshot_max_traces: the most traces one snapshot holds: whole prompt groups in batch order, as many as fit
            (the first group's first traces alone if one group is larger), so the report's group baselines stay
            those of the step. Default 64 (a tiny-recipe step of 32 traces is kept whole; a paper-scale step of 512
            traces of 25k tokens would write several hundred MB a step). None keeps every trace. At least 1.
        task: how answers are read and solutions cut into steps: a name of ``rredcot_verl.tasks.TASKS``
            (``boxed_math``, default: last ``\\boxed{}`` compared with math-verify, blank-line paragraphs;
            ``arithmetic``: the embedded task, one step per line; ``paragraphs``: exact boxed answers, paragraphs)
            or ``module:attr`` of an object with the same functions. Resolved by the trainer
            (``tasks.resolve_task``): the core receives the task, it does not import it.
        reward_range: ``[low, high]``, the scale of the verified outcome; ``high`` means correct. Probe values are
            mapped onto it, IBPO's correctness test and shaping use it; a trace whose outcome lies outside it keeps
            its GRPO advantage.
        max_failed_group_share: the largest share of a step's prompt groups that may lose traces to exceptions in
            verl's agent loop (a reward function that raises, a failed generation) before the trainer stops the run
            with the first error; the count is logged every step as ``rollout/failed_groups``.
    """

    snapshot_dir: str | None = None
    snapshot_freq: int = 1
    snapshot_max_traces: int | None = 64
    task: str = "boxed_math"
    max_failed_group_share: float = 0.1
    reward_range: tuple[float, float] = (0.0, 1.0)
    segmentation: SegmentationSettings = field(default_factory=SegmentationSettings)
    probe: ProbeSettings = field(default_factory=ProbeSettings)
    candidates: CandidateSettings = field(default_factory=CandidateSettings)
    redistribution: RedistributionSettings = field(default_factory=RedistributionSettings)
    ibpo: IBPOSettings = field(default_factory=IBPOSettings)
    rredcot_ibpo: FusedSettings = field(default_factory=FusedSettings)
    segment_mc: MonteCarloSettings = field(default_factory=MonteCarloSettings)
    value_pass: ValuePassSettings = field(default_factory=ValuePassSettings)

    def __post_init__(self):
        if not isinstance(self.task, str) or not self.task.strip():
            raise ValueError(f"task must be a task name or 'module:attr', got {self.task!r}")
        if isinstance(self.snapshot_freq, bool) or not isinstance(self.snapshot_freq, int) or self.snapshot_freq < 1:
            raise ValueError(f"snapshot_freq must be an integer >= 1, got {self.snapshot_freq!r}")
        bound = self.snapshot_max_traces
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 1):
            raise ValueError(f"snapshot_max_traces must be an integer >= 1 or null, got {bound!r}")
        if not 0.0 <= float(self.max_failed_group_share) <= 1.0:
            raise ValueError(f"max_failed_group_share must lie in [0, 1], got {self.max_failed_group_share}")
        object.__setattr__(self, "reward_range", outcomes.check_reward_range(self.reward_range))

    def snapshot_due(self, step: int) -> bool:
        """Whether training step ``step`` writes a snapshot (``snapshot_dir`` set and the step a multiple of
        ``snapshot_freq``)."""
        return bool(self.snapshot_dir) and int(step) % self.snapshot_freq == 0

    def snapshot_rows(self, groups: Sequence[Hashable]) -> list[int]:
        """Batch indices of the traces a snapshot keeps, given each trace's prompt group (verl's ``uid``) in batch
        order: whole groups in the order they first appear while they fit ``snapshot_max_traces``."""
        bound = self.snapshot_max_traces
        if bound is None or len(groups) <= bound:
            return list(range(len(groups)))
        members: dict[Hashable, list[int]] = {}
        for index, group in enumerate(groups):
            members.setdefault(group, []).append(index)
        kept: list[int] = []
        for indices in members.values():
            if len(kept) + len(indices) > bound:
                break
            kept += indices
        return sorted(kept) if kept else next(iter(members.values()))[:bound]

    def success_probability(self, outcome: float) -> float:
        """An outcome on the probability scale of the value sources: 0 at the bottom of ``reward_range``, 1 at the top."""
        return outcomes.success_probability(outcome, self.reward_range)

    def is_correct(self, outcome: float) -> bool:
        """A trace is correct when its outcome reaches the top of ``reward_range`` (partial credit is not correct)."""
        return outcomes.is_correct(outcome, self.reward_range)

    def boundary_vocab(self, tokenizer) -> BoundaryVocab:
        """The segmentation's token tables, with the profile's end-of-thinking marker (its one source; ``auto`` is
        resolved from this tokenizer, and a model without thinking has none)."""
        think_end = self.probe.profile_for(tokenizer).think_end
        return BoundaryVocab.from_tokenizer(tokenizer, self.segmentation, think_end=think_end)

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

# Sections are the dataclass-typed fields of RRedCoTSettings.
_SECTIONS = {
    f.name: type(f.default_factory())
    for f in dataclasses.fields(RRedCoTSettings)
    if f.default_factory is not dataclasses.MISSING
}
# Keys that mirror a verl setting (algorithm.norm_adv_by_std_in_grpo) and are not accepted in algorithm.rredcot.
_VERL_OWNED = ("norm_adv_by_std",)
DEFAULTS_FILE = Path(__file__).resolve().parents[1] / "conf" / "rredcot_defaults.yaml"


def settings_from_config(algorithm_config: Any) -> RRedCoTSettings:
    """Read ``algorithm.rredcot`` (omegaconf node, dict or None) strictly, with verl's
    ``algorithm.norm_adv_by_std_in_grpo`` (default True) as ``norm_adv_by_std`` of its redistribution and IBPO
    sections: the settings an estimator runs with."""
    section = algorithm_config.get("rredcot", None) if algorithm_config is not None else None
    if section is not None and not isinstance(section, dict):
        from omegaconf import OmegaConf

        section = OmegaConf.to_container(section, resolve=True)
    settings = _build(RRedCoTSettings, section, "algorithm.rredcot")
    norm = bool(algorithm_config.get("norm_adv_by_std_in_grpo", True)) if algorithm_config is not None else True
    return dataclasses.replace(
        settings,
        redistribution=dataclasses.replace(settings.redistribution, norm_adv_by_std=norm),
        ibpo=dataclasses.replace(settings.ibpo, norm_adv_by_std=norm),
    )


def default_section() -> dict:
    """The ``algorithm.rredcot`` defaults as plain data (tuples as lists), without the keys verl owns."""

    def plain(value):
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items() if k not in _VERL_OWNED}
        return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value

    return plain(dataclasses.asdict(RRedCoTSettings()))


def defaults_yaml() -> str:
    """Text of ``conf/rredcot_defaults.yaml``: verl's ppo_trainer plus the dataclass defaults (their one source)."""
    from omegaconf import OmegaConf

    body = OmegaConf.to_yaml(OmegaConf.create({"algorithm": {"rredcot": default_section()}}))
    return (
        "# GENERATED from the dataclasses in rredcot_verl/core (python -m rredcot_verl.core.settings); do not edit.\n"
        "# verl's PPO trainer config plus the algorithm.rredcot section; keys not listed here are rejected at start-up.\n"
        "# Nothing else of verl's is changed (a recipe relying on verl's trainer.logger default keeps its tracker).\n"
        "defaults:\n  - ppo_trainer\n  - _self_\n\n" + body
    )


REFERENCE_FILE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
_ATTRIBUTE = re.compile(r"^    (\w+(?:, \w+)*): (.*)$")


def attribute_docs(cls) -> dict[str, str]:
    """The ``Attributes:`` section of a dataclass's docstring as {field: text}; a line naming several fields
    (``a, b: ...``) documents each of them."""
    doc = inspect.getdoc(cls) or ""
    if "Attributes:" not in doc:
        return {}
    docs: dict[str, str] = {}
    names: list[str] = []
    for line in doc.split("Attributes:", 1)[1].splitlines():
        match = _ATTRIBUTE.match(line)
        if match:
            names = match.group(1).split(", ")
            for name in names:
                docs[name] = match.group(2).strip()
        elif line.startswith("        ") and names:
            for name in names:
                docs[name] += " " + line.strip()
        elif line.strip():
            names = []  # text after the section
    return docs


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def configuration_reference() -> str:
    """Text of ``docs/configuration.md``: every ``algorithm.rredcot`` key with its default and its docstring."""
    lines = [
        "# `algorithm.rredcot`: every key",
        "",
        "GENERATED from the dataclasses' docstrings in `rredcot_verl/core` (`python -m rredcot_verl.core.settings`);",
        "do not edit. Defaults are also in `rredcot_verl/conf/rredcot_defaults.yaml`; an unknown key stops the launch.",
        "`norm_adv_by_std` is not a key here: it follows verl's `algorithm.norm_adv_by_std_in_grpo`.",
    ]
    defaults = default_section()

    def table(cls, prefix: str, values: dict) -> list[str]:
        docs = attribute_docs(cls)
        rows = ["", "| key | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            if f.name in _SECTIONS and cls is RRedCoTSettings or f.name in _VERL_OWNED:
                continue
            if f.name not in docs:
                raise ValueError(f"{cls.__name__}.{f.name} has no entry in the docstring's Attributes section")
            default = values[f.name] if isinstance(values[f.name], str) else json.dumps(values[f.name])
            rows.append(f"| `{prefix}{f.name}` | `{_cell(default)}` | {_cell(docs[f.name])} |")
        return rows

    lines += ["", "## Top level", *table(RRedCoTSettings, "", defaults)]
    for name, cls in _SECTIONS.items():
        lines += ["", f"## `{name}` ({cls.__name__})", *table(cls, f"{name}.", defaults[name])]
    return "\n".join(lines) + "\n"


GENERATED = {DEFAULTS_FILE: defaults_yaml, REFERENCE_FILE: configuration_reference}

if __name__ == "__main__":
    # Regenerates the yaml and the reference (or, with --check, exits 1 when either is stale).
    stale = [path for path, text in GENERATED.items() if not path.is_file() or path.read_text() != text()]
    if "--check" in sys.argv[1:]:
        sys.exit(1 if stale else 0)
    for path, text in GENERATED.items():
        path.write_text(text())
