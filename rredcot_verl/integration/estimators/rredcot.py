"""``rredcot``: segment values from probes planned on the driver and scored by the actor workers (``probe_values``),
redistributed as differences of consecutive values (``core.redistribution``). With ``candidates.source:
group_and_repairs`` IBPO's repairs are generated first (``ibpo.REPAIR_STAGE``) and the verified ones fill the
reference bank of every group without a correct trace."""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
from verl import DataProto
from verl.utils.metric import reduce_metrics

from rredcot_verl.core.planning import bank_metrics, plan_traces, planning_workers
from rredcot_verl.core.redistribution import redistribute
from rredcot_verl.core.settings import RRedCoTSettings
from rredcot_verl.integration.estimators.base import (
    AdvantageBatch, AdvantageResult, EngineUse, EstimatorSpec, Stage, StepContext, StepTraces, object_array,
)
from rredcot_verl.integration.estimators.ibpo import REPAIR_STAGE

# The AdvantageBatch inputs segment values fill (the value pass's and segment_mc's).
SEGMENT_INPUTS = ("segment_ends", "raw_values")


def probe_values(ctx: StepContext, traces: StepTraces) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Probes planned here from the whole batch (groups intact, whatever rank a trace lands on), scored by the actor
    workers with the old weights (``workers.py``). The planning's per-trace part runs in worker processes on the
    driver's cores where the step is large enough (``planning_workers``).

    Args:
        traces: the step's traces, with the log-prob pass's entropies.
    Returns:
        ``segment_ends`` and ``raw_values`` (``AdvantageBatch``), and metrics.
    """
    plans = plan_traces(
        traces.records, ctx.settings, ctx.tokenizer, ctx.task, vocab=ctx.boundary_vocab, temperature=ctx.temperature,
        repairs=ctx.verified_repairs, workers=planning_workers(traces.records),
    )  # fmt: skip
    if ctx.settings.snapshot_due(ctx.step):
        # The exact inputs of this step's value pass, to re-score offline (any model, any number of processes): the
        # plans of the traces the step's snapshot keeps, in its order.
        kept = ctx.settings.snapshot_rows([record.group for record in traces.records])
        os.makedirs(ctx.settings.snapshot_dir, exist_ok=True)
        torch.save([plans[i] for i in kept], os.path.join(ctx.settings.snapshot_dir, f"step_{ctx.step:05d}_plans.pt"))
    request = DataProto.from_dict(
        tensors={"outcome": traces.outcomes},
        non_tensors={"plan": object_array(plans)},
        meta_info={
            # One width for every shard: turn starts and each turn's </think> are cut beyond max_segments.
            "max_segments": max([ctx.settings.segmentation.max_segments, *(plan.num_values for plan in plans)]),
            "value_pass": dataclasses.asdict(ctx.settings.value_pass),
        },
    )
    output = ctx.value_pass(request)
    # verl's concat turns each rank's metrics dict into a dict of lists; average over ranks.
    metrics = reduce_metrics(output.meta_info.get("metrics", {}))
    metrics.update(bank_metrics(plans, [record.group for record in traces.records]))
    return {name: output.batch[name] for name in SEGMENT_INPUTS}, metrics


VALUE_STAGE = Stage(probe_values, EngineUse.NONE)


def value_stages(settings: RRedCoTSettings) -> tuple[Stage, ...]:
    """The value pass, after IBPO's repairs when they fill the bank."""
    return (REPAIR_STAGE, VALUE_STAGE) if settings.candidates.uses_repairs else (VALUE_STAGE,)


def prefixed(name: str, metrics: dict[str, float]) -> dict[str, float]:
    return {f"{name}/{key}": value for key, value in metrics.items()}


def redistributed_advantage(name: str, batch: AdvantageBatch, settings: RRedCoTSettings) -> AdvantageResult:
    """The batch's segment values redistributed into token advantages (``core.redistribution.redistribute``)."""
    segment_ends, raw_values = batch.require(name, *SEGMENT_INPUTS)
    result = redistribute(
        batch.scores, batch.response_mask, batch.index, segment_ends, raw_values, settings.redistribution,
        reward_range=settings.reward_range, prior_concordance=batch.prior_concordance,
    )  # fmt: skip
    return dataclasses.replace(result, metrics=prefixed(name, result.metrics))


# RREDCoT: exit-probe (or reference-continuation) segment values redistributed into token advantages. A partial, not
# a forwarding function, so the trainer's call reaches the redistribution in one hop fewer.
rredcot_advantage = functools.partial(redistributed_advantage, "rredcot")


SPEC = EstimatorSpec(
    name="rredcot",
    inputs=SEGMENT_INPUTS,
    stages=value_stages,
    advantage=rredcot_advantage,
    uses_value_pass=True,
    whole_traces_per_rank=True,
)
