"""The ``algorithm.rredcot`` settings: the core modules' dataclasses behind one strict omegaconf reader.

Every section maps onto the frozen dataclass of the module that uses it, so defaults and validation live in one place
(the dataclass) and an unknown key anywhere in the section is an error naming the key and the accepted ones.
"""

from __future__ import annotations

import copy
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
        source: ``"both"`` (the dataclass default; a config's is ``"auto"``, chosen at launch from the training
            data: ``AUTO_RULES``), ``"group"`` (distinct answers / traces of the group's correct rollouts),
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
            ``core.traces.TraceRecord``, planned, in the order of the snapshot's traces, which
            ``core.values.score_plans`` re-scores offline). How often and how much: ``snapshot_freq``,
            ``snapshot_max_traces``.
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


# ------------------------------------------------------------------------------------------ auto: chosen at launch

AUTO = "auto"
# The keys whose configuration default is ``auto``: the value source and what goes with it, chosen at launch from
# what the training data offers and the estimator, by the best measured configuration (README, "Which to choose").
# The dataclasses keep a fixed default for code that builds settings itself.
AUTO_KEYS = ("probe.value_source", "candidates.source", "redistribution.value_mapping",
             "redistribution.degenerate_groups")
AUTO_RULES = (
    "`auto` (the default in a config): chosen by `python -m rredcot_verl.main` before Ray starts, from the training "
    "rows and the estimator, by the best measured configuration (README, \"Which to choose\"), and named in one "
    "launch line; any value set explicitly wins. `rredcot`: training rows with worked solutions "
    "(`extra_info.reference_steps`, or the task's `dataset_steps`) give row A (`reference_continuation`, "
    "`ground_truth`, `log_affine`, `grpo`); rows without them, or files the launcher cannot read, give row C "
    "(`reference_continuation`, `group_and_repairs`, `log_affine`, `value_differences`); multi-turn rollouts "
    "give the exit probe (`exit_probe`, `both`, `affine`, `grpo`). `rredcot_ibpo`: row D (`reference_continuation`, "
    "`group_and_repairs`, `log_affine`, `grpo`). `segment_mc`: `affine`, `grpo`. An explicit `probe.value_source` "
    "sets the others as its measured row did: `exit_probe` with `both` and `affine`, a continuation with "
    "`log_affine`. Estimators that do not read a key get the dataclass default"
)


@dataclass(frozen=True)
class DataOffer:
    """What the launcher read of a run before choosing the ``auto`` keys.

    Attributes:
        worked_solutions: whether the sampled training rows carry worked solutions (``extra_info.reference_steps``
            or the task's ``dataset_steps``); None when the files could not be read (remote URIs).
        multi_turn: rollouts are multi-turn (verl's tool agent loop), where only exit probes value a trajectory.
    """

    worked_solutions: bool | None
    multi_turn: bool = False


@dataclass(frozen=True)
class AutoChoice:
    """``choose_auto``'s answer: ``values`` maps each key that was ``auto`` (dotted under ``algorithm.rredcot``) to
    its value; ``reason`` is the launch line's why, None where the estimator reads none of the keys."""

    values: dict[str, str]
    reason: str | None


def _section_value(section: dict, dotted: str) -> Any:
    node: Any = section
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _dataclass_default(dotted: str) -> str:
    sub, name = dotted.split(".")
    return getattr(_SECTIONS[sub](), name)


# README "Which to choose": estimator -> {(value_source, candidates.source, value_mapping, degenerate_groups): row}
MEASURED_ROWS = {
    "rredcot": {("reference_continuation", "ground_truth", "log_affine", "grpo"): "A",
                ("reference_continuation", "group_and_repairs", "log_affine", "value_differences"): "C",
                ("exit_probe", "both", "affine", "grpo"): "E"},
    "rredcot_ibpo": {("reference_continuation", "group_and_repairs", "log_affine", "grpo"): "D"},
}


def choose_auto(section: dict | None, estimator: str | None, offer: DataOffer | None) -> AutoChoice:
    """The values of the ``AUTO_KEYS`` left at ``auto`` in ``section`` (plain ``algorithm.rredcot`` data), by
    ``AUTO_RULES``. Explicit values are kept and steer the rest (an explicit ``exit_probe`` takes ``both`` and
    ``affine``). Raises ``ValueError`` naming the key where the choice needs the training data and ``offer`` is
    None, and for ``rredcot`` on ``task: code``, where no measured value source applies."""
    section = section or {}
    chosen = {key: _section_value(section, key) for key in AUTO_KEYS}
    pending = [key for key in AUTO_KEYS if chosen[key] == AUTO]
    if not pending:
        return AutoChoice({}, None)
    if estimator not in ("rredcot", "rredcot_ibpo", "segment_mc"):  # ibpo and verl's estimators read none of them
        return AutoChoice({key: _dataclass_default(key) for key in pending}, None)
    facts = []
    if estimator == "segment_mc":  # reads only the redistribution's keys: its values are Monte-Carlo success rates
        fixed = {"probe.value_source": _dataclass_default("probe.value_source"),
                 "candidates.source": _dataclass_default("candidates.source"),
                 "redistribution.value_mapping": "affine", "redistribution.degenerate_groups": "grpo"}
        values = {key: fixed[key] for key in pending}
        chosen.update(values)
        row = "F" if (chosen["redistribution.value_mapping"], chosen["redistribution.degenerate_groups"]) == (
            "affine", "grpo") else None
        return AutoChoice(values, _reason(["Monte-Carlo values are success rates"], row))
    if chosen["probe.value_source"] == AUTO:
        if estimator == "rredcot" and str(section.get("task", "boxed_math")) == "code":
            raise ValueError(
                "algorithm.rredcot.probe.value_source=auto: no measured value source applies to "
                "algorithm.rredcot.task=code with algorithm.adv_estimator=rredcot (programs are judged by tests); use "
                "adv_estimator=segment_mc or ibpo, or set probe.value_source=own_continuation"
            )
        if offer is not None and offer.multi_turn:
            chosen["probe.value_source"] = "exit_probe"
            facts.append("multi-turn rollouts are valued by exit probes only")
        else:
            chosen["probe.value_source"] = "reference_continuation"
    source = chosen["probe.value_source"]
    if chosen["candidates.source"] == AUTO:
        if source != "reference_continuation":
            chosen["candidates.source"] = "both"
        elif estimator == "rredcot_ibpo":
            chosen["candidates.source"] = "group_and_repairs"
            facts.append("its repairs fill the bank")
        elif offer is None:
            raise ValueError(
                "algorithm.rredcot.candidates.source=auto is chosen from the training data by the launcher "
                "(python -m rredcot_verl.main); set it (ground_truth with worked solutions, group_and_repairs "
                "without) to read this config elsewhere"
            )
        elif offer.worked_solutions:
            chosen["candidates.source"] = "ground_truth"
            facts.append("the training rows carry worked solutions")
        else:
            chosen["candidates.source"] = "group_and_repairs"
            facts.append("the training rows carry no worked solutions" if offer.worked_solutions is False
                         else "the training files were not read here (remote), and this needs no worked solutions")
    if chosen["redistribution.value_mapping"] == AUTO:
        chosen["redistribution.value_mapping"] = "affine" if source == "exit_probe" else "log_affine"
    if chosen["redistribution.degenerate_groups"] == AUTO:
        repairs_bank = estimator == "rredcot" and chosen["candidates.source"] == "group_and_repairs"
        chosen["redistribution.degenerate_groups"] = "value_differences" if repairs_bank else "grpo"
    explicit = [f"{key}={chosen[key]} as set" for key in AUTO_KEYS if key not in pending]
    row = MEASURED_ROWS[estimator].get(tuple(str(chosen[key]) for key in AUTO_KEYS))
    return AutoChoice({key: str(chosen[key]) for key in pending}, _reason([*explicit, *facts], row))


def _reason(facts: list[str], row: str | None) -> str:
    measured = f'README "Which to choose" row {row}' if row else "a configuration the README's table did not measure"
    return "; ".join([*facts, measured])


def resolve_auto(section: dict | None, estimator: str | None, offer: DataOffer | None) -> tuple[dict, AutoChoice]:
    """``section`` with its ``auto`` keys replaced by ``choose_auto``'s values (a copy), and the choice."""
    choice = choose_auto(section, estimator, offer)
    if not choice.values:
        return section, choice
    resolved = copy.deepcopy(section)
    for dotted, value in choice.values.items():
        sub, name = dotted.split(".")
        resolved[sub][name] = value
    return resolved, choice


def settings_from_config(algorithm_config: Any, offer: DataOffer | None = None) -> RRedCoTSettings:
    """Read ``algorithm.rredcot`` (omegaconf node, dict or None) strictly. Keys left at ``auto`` are chosen by
    ``choose_auto`` from ``algorithm.adv_estimator`` and ``offer`` (the launcher writes its choice into the config, so
    the trainer's processes read concrete values). verl's ``algorithm.norm_adv_by_std_in_grpo`` (default True) becomes
    ``norm_adv_by_std`` of the redistribution and IBPO sections: the settings an estimator runs with."""
    section = algorithm_config.get("rredcot", None) if algorithm_config is not None else None
    if section is not None and not isinstance(section, dict):
        from omegaconf import OmegaConf

        section = OmegaConf.to_container(section, resolve=True)
    if isinstance(section, dict):
        estimator = algorithm_config.get("adv_estimator", None)
        section, _ = resolve_auto(section, None if estimator is None else str(estimator), offer)
    settings = _build(RRedCoTSettings, section, "algorithm.rredcot")
    norm = bool(algorithm_config.get("norm_adv_by_std_in_grpo", True)) if algorithm_config is not None else True
    return dataclasses.replace(
        settings,
        redistribution=dataclasses.replace(settings.redistribution, norm_adv_by_std=norm),
        ibpo=dataclasses.replace(settings.ibpo, norm_adv_by_std=norm),
    )


def default_section() -> dict:
    """The ``algorithm.rredcot`` defaults of a config as plain data (tuples as lists), without the keys verl owns:
    the dataclass defaults, and ``auto`` for ``AUTO_KEYS``."""

    def plain(value):
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items() if k not in _VERL_OWNED}
        return [plain(v) for v in value] if isinstance(value, (list, tuple)) else value

    section = plain(dataclasses.asdict(RRedCoTSettings()))
    for dotted in AUTO_KEYS:
        sub, name = dotted.split(".")
        section[sub][name] = AUTO
    return section


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
    keys = ", ".join(f"`{key}`" for key in AUTO_KEYS)
    lines += ["", "## `auto`", "", f"{keys}: {AUTO_RULES}."]
    return "\n".join(lines) + "\n"


GENERATED = {DEFAULTS_FILE: defaults_yaml, REFERENCE_FILE: configuration_reference}

if __name__ == "__main__":
    # Regenerates the yaml and the reference (or, with --check, exits 1 when either is stale).
    stale = [path for path, text in GENERATED.items() if not path.is_file() or path.read_text() != text()]
    if "--check" in sys.argv[1:]:
        sys.exit(1 if stale else 0)
    for path, text in GENERATED.items():
        path.write_text(text())
