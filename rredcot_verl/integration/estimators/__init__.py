"""The estimators this package adds to verl, one module each: ``rredcot``, ``segment_mc``, ``ibpo``, ``rredcot_ibpo``.

Each module defines ``SPEC`` (``base.EstimatorSpec``): the per-trace inputs its stages write and its advantage
function reads (``base.StepInputs`` dataclasses, whose field names make the batch keys), its stages (the producers a
training step runs for it, given a ``base.StepContext``, each with when it runs and whether it uses the rollout
engine), and the advantage function that verl's ``compute_advantage`` calls by name. A producer that generates lives
in its estimator's module and takes its engine and reward plumbing from ``integration.rollouts``.
The trainer, the launcher and the workers read ``ESTIMATORS``; importing this package registers every advantage
function with verl (``register_adv_est``). Adding an estimator: a module with its ``SPEC``, and its name in the tuple
below.
"""

from rredcot_verl.integration.estimators import ibpo, rredcot, rredcot_ibpo, segment_mc
from rredcot_verl.integration.estimators.base import (
    EngineUse,
    EstimatorSpec,
    Stage,
    StepContext,
    StepTraces,
    estimator_inputs,
    register,
)

ESTIMATORS: dict[str, EstimatorSpec] = {
    module.SPEC.name: module.SPEC for module in (rredcot, segment_mc, ibpo, rredcot_ibpo)
}
for _spec in ESTIMATORS.values():
    register(_spec)

__all__ = [
    "ESTIMATORS", "EngineUse", "EstimatorSpec", "Stage", "StepContext", "StepTraces", "estimator_inputs", "register",
]
