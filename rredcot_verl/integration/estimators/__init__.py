"""The estimators this package adds to verl, one module each: ``rredcot``, ``segment_mc``, ``ibpo``, ``rredcot_ibpo``.

An estimator is a function of one batch, ``advantage(batch: base.AdvantageBatch, settings) -> base.AdvantageResult``,
fed by stages that write the batch's per-trace inputs. Each module defines ``SPEC`` (``base.EstimatorSpec``): the
``AdvantageBatch`` inputs its stages write and its advantage function reads, its stages (the producers a training
step runs for it, given a ``base.StepContext``, each with when it runs and whether it uses the rollout engine), and
the advantage function. The trainer calls that function on the step's batch; the benchmarks and tests call it on
theirs. A producer that generates lives in its estimator's module and takes its engine and reward from the
``StepContext`` (built by ``integration.rollouts``). The trainer, the launcher and the workers read ``ESTIMATORS``;
importing this package registers each name with verl (``base.register``: verl accepts the name, runs it inside the
rredcot trainer's ``advantage_step`` and refuses to run it anywhere else).

Adding an estimator: a module with its advantage function and ``SPEC`` (inputs beyond ``AdvantageBatch``'s present
fields need a field there, with its batch key), and the module in the tuple below.
"""

from rredcot_verl.integration.estimators import ibpo, rredcot, rredcot_ibpo, segment_mc
from rredcot_verl.integration.estimators.base import (
    AdvantageBatch, AdvantageResult, EngineUse, EstimatorSpec, Stage, StepContext, StepTraces, advantage_step,
    generates, register,
)

ESTIMATORS: dict[str, EstimatorSpec] = {
    module.SPEC.name: module.SPEC for module in (rredcot, segment_mc, ibpo, rredcot_ibpo)
}
for _spec in ESTIMATORS.values():
    register(_spec)

__all__ = [
    "ESTIMATORS", "AdvantageBatch", "AdvantageResult", "EngineUse", "EstimatorSpec", "Stage", "StepContext",
    "StepTraces", "advantage_step", "generates", "register",
]
