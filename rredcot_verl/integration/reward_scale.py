"""The outcome scale of verl's own scorers, read at launch (thin).

Without ``reward.custom_reward_function`` (or with it naming verl's ``default_compute_score``), verl 0.9.1 scores each
row by its ``data_source`` (``verl/utils/reward_score/__init__.py``): ``math_dapo`` gives a wrong answer -1, the
others 0. The launcher reads the training rows' data sources, finds the scale of the scorer each goes to, and uses it
for ``algorithm.rredcot.reward_range`` where the recipe left the default (``launcher.adopt_scorer_reward_range``). A
reward function of the user's own has a scale only its author knows: the first batch's outcomes check it
(``core.outcomes.first_batch_scale_refusal``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# verl's default scorer, named as a custom reward function (verl's own GSM8K recipe here does so).
DEFAULT_SCORER_PATHS = ("pkg://verl.utils.reward_score", "pkg://verl/utils/reward_score")
DEFAULT_SCORER_NAME = "default_compute_score"


@dataclass(frozen=True)
class ScorerRoute:
    """One branch of verl's ``default_compute_score``: the data sources it takes, its scorer and the scale that scorer
    returns (a wrong answer at the bottom, a right one at the top; tests/test_reward_scale_on_cpu.py scores both
    through verl for every route)."""

    scorer: str
    takes: Callable[[str], bool]
    scale: tuple[float, float]


SCORER_ROUTES = (
    ScorerRoute("math_dapo", lambda source: source in ("math_dapo", "math", "math_dapo_reasoning")
                or source.startswith("aime"), (-1.0, 1.0)),
    ScorerRoute("gsm8k", lambda source: source == "openai/gsm8k", (0.0, 1.0)),
    ScorerRoute("math_reward", lambda source: source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                                                         "HuggingFaceH4/MATH-500"), (0.0, 1.0)),
    ScorerRoute("prime_math", lambda source: source in ("numina_aops_forum", "numina_synthetic_math",
                                                        "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
                                                        "numina_olympiads"), (0.0, 1.0)),
    ScorerRoute("search_r1_like_qa_em", lambda source: source.startswith("searchR1_"), (0.0, 1.0)),
)  # fmt: skip


def scorer_route(data_source: str) -> ScorerRoute | None:
    """The route verl's ``default_compute_score`` takes for ``data_source``; None for the ones this package has not
    checked (code through a sandbox, geometry3k's mathruler) and those verl has no scorer for."""
    return next((route for route in SCORER_ROUTES if route.takes(str(data_source))), None)


def uses_default_scorer(config) -> bool:
    """Whether verl scores the rollouts with its ``default_compute_score``: no custom reward function (in
    ``reward.custom_reward_function`` or verl's legacy top-level ``custom_reward_function``), or one naming it."""
    custom = config.reward.get("custom_reward_function", None) or {}
    legacy = config.get("custom_reward_function", None) or {}
    if legacy.get("path"):  # verl moves a legacy setting over the new one (experimental/reward_loop/reward_loop.py)
        custom = legacy
    path = custom.get("path")
    return not path or (str(path) in DEFAULT_SCORER_PATHS and custom.get("name") == DEFAULT_SCORER_NAME)


def train_data_sources(config) -> list[str]:
    """The distinct ``data_source`` values of the local training files (empty where a file is remote or has none)."""
    from rredcot_verl.integration import dataset_files

    files = config.data.train_files
    sources: set[str] = set()
    for file in [files] if isinstance(files, str) else list(files):
        if "://" in str(file) or "data_source" not in dataset_files.column_names(file):
            return []
        sources.update(str(value) for value in dataset_files.read_column(file, "data_source"))
    return sorted(sources)


def scorer_reward_range(config) -> tuple[tuple[float, float], str] | None:
    """(scale, which scorer) of the training rows as verl will score them, where every row goes to a route of
    ``SCORER_ROUTES``; None otherwise (a reward function of the user's own, data sources not checked here).

    Raises:
        ValueError: the rows go to scorers of different scales (one ``reward_range`` cannot hold them).
    """
    if not uses_default_scorer(config):
        return None
    sources = train_data_sources(config)
    routes = {source: scorer_route(source) for source in sources}
    if not routes or any(route is None for route in routes.values()):
        return None
    scales = {route.scale for route in routes.values()}
    if len(scales) > 1:
        named = "; ".join(f"{source}: {route.scorer} {list(route.scale)}" for source, route in routes.items())
        raise ValueError(
            f"data.train_files holds data sources that verl's scorers score on different scales ({named}), and "
            "algorithm.rredcot.reward_range is one scale: train on one kind, or score every row with one "
            "reward.custom_reward_function"
        )
    scorers = sorted({route.scorer for route in routes.values()})
    return scales.pop(), f"verl's {' and '.join(scorers)} scorer for data_source {', '.join(sources)}"
