"""``rredcot_ibpo``: IBPO's repair-shaped outcome, redistributed over segments by values from a bank its verified
repairs fill (``core.fused``). Two stages: IBPO's repairs through the rollout engine before the log-prob pass, then
the actor's value pass on the bank (``candidates.source``; ``group_and_repairs`` needs no reference solutions)."""

from __future__ import annotations

import dataclasses

from rredcot_verl.core.fused import fused_advantages
from rredcot_verl.core.settings import RRedCoTSettings
from rredcot_verl.integration.estimators.base import AdvantageBatch, AdvantageResult, EstimatorSpec
from rredcot_verl.integration.estimators.ibpo import REPAIR_INPUTS, REPAIR_STAGE
from rredcot_verl.integration.estimators.rredcot import SEGMENT_INPUTS, VALUE_STAGE, prefixed

NAME = "rredcot_ibpo"


def rredcot_ibpo_advantage(batch: AdvantageBatch, settings: RRedCoTSettings) -> AdvantageResult:
    """IBPO's shaped advantage per trace, placed on its segments by the values (IBPO's row where they decide
    nothing); IBPO's metrics under ``ibpo/``, the redistribution's under ``rredcot_ibpo/``."""
    phi, edited_mask, segment_ends, raw_values = batch.require(NAME, *REPAIR_INPUTS, *SEGMENT_INPUTS)
    result = fused_advantages(
        batch.scores, batch.response_mask, batch.index, segment_ends, raw_values, phi,
        edited_mask.bool() if settings.ibpo.use_mask else None, settings.ibpo, settings.redistribution,
        settings.rredcot_ibpo, reward_range=settings.reward_range, prior_concordance=batch.prior_concordance,
    )  # fmt: skip
    metrics = {**result.ibpo.metrics, **prefixed(NAME, result.metrics)}
    return dataclasses.replace(result.redistribution, advantages=result.advantages, returns=result.advantages,
                               metrics=metrics)


SPEC = EstimatorSpec(
    name=NAME,
    inputs=(*REPAIR_INPUTS, *SEGMENT_INPUTS),
    stages=lambda settings: (REPAIR_STAGE, VALUE_STAGE),
    advantage=rredcot_ibpo_advantage,
    uses_value_pass=True,
    whole_traces_per_rank=True,
    fallback_advantage="IBPO's advantage",
)
