"""``rredcot``: the policy values each segment boundary (probes scored on the actor, no generation), and the outcome
is redistributed as differences of consecutive values (``core.redistribution``). With ``candidates.source:
group_and_repairs`` IBPO's repairs are generated first (``ibpo.REPAIR_STAGE``) and the verified ones fill the
reference bank of every group without a correct trace."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch
from verl import DataProto
from verl.utils.metric import reduce_metrics

from rredcot_verl.core.planning import bank_metrics, plan_traces
from rredcot_verl.core.redistribution import redistribute
from rredcot_verl.core.settings import RRedCoTSettings
from rredcot_verl.integration.estimators.base import (
    EngineUse,
    EstimatorSpec,
    Stage,
    StepContext,
    StepInputs,
    StepRecord,
    StepTraces,
    object_array,
    settings_for,
    step_inputs,
)
from rredcot_verl.integration.estimators.ibpo import REPAIR_STAGE, VERIFIED_REPAIRS


@dataclass(frozen=True)
class SegmentInputs(StepInputs):
    """Segment values, written by the actor's value pass (``workers.py``) or by ``segment_mc``'s continuations and
    read by the redistribution, under batch keys ``seg_ends`` and ``seg_raw_values``.

    Attributes:
        ends: (bs, Kmax) int64, each trace's segment ends in positions of the full response (a multi-turn one's
            tool output included), padded past its K.
        raw_values: (bs, Kmax + 1) float32, the values of S_0..S_K, padded past them.
    """

    PREFIX = "seg_"
    ends: torch.Tensor
    raw_values: torch.Tensor



def segment_values(ctx: StepContext, traces: StepTraces) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Probes planned here from the whole batch (groups intact, whatever rank a trace lands on), scored by the actor
    workers with the old weights.

    Args:
        traces: the step's traces, with the log-prob pass's entropies.
    """
    plans = plan_traces(
        traces.records, ctx.settings, ctx.tokenizer, ctx.task, vocab=ctx.boundary_vocab, temperature=ctx.temperature,
        repairs=ctx.carry.get(VERIFIED_REPAIRS),
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
    return SegmentInputs.from_batch(output.batch).to_batch(), metrics


VALUE_STAGE = Stage(segment_values, EngineUse.NONE)


def value_stages(settings: RRedCoTSettings) -> tuple[Stage, ...]:
    """The value pass, after IBPO's repairs when they fill the bank."""
    return (REPAIR_STAGE, VALUE_STAGE) if settings.candidates.uses_repairs else (VALUE_STAGE,)


def redistributed_advantage(name: str, token_level_rewards, response_mask, index, config):
    """Segment values (``SegmentInputs``) redistributed into token advantages; metrics and details to the record."""
    record = step_inputs(name, (SegmentInputs,), index)
    segments = SegmentInputs.from_batch(record.tensors)
    settings, redistribution = settings_for(config)
    result = redistribute(
        token_level_rewards.sum(dim=-1),
        response_mask,
        index,
        segments.ends,
        segments.raw_values,
        redistribution,
        reward_range=settings.reward_range,
        prior_concordance=record.prior_concordance,
    )
    record_redistribution(name, record, result, result.metrics)
    return result.advantages, result.returns


def record_redistribution(name: str, record: StepRecord, result, metrics: dict[str, float]) -> None:
    """A redistribution's metrics (under ``name/``) and per-trace details (the credit report, the value gate's
    window) into the step record."""
    record.metrics.update({f"{name}/{k}": v for k, v in metrics.items()})
    record.details.update(
        values=result.values, segment_rewards=result.segment_rewards, fallback=result.fallback,
        concordance=result.concordance,
    )  # fmt: skip


def compute_rredcot_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index=None, config: Any = None, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """RREDCoT: exit-probe (or reference-continuation) segment values redistributed into token advantages.

    Args:
        token_level_rewards: (bs, T); response_mask: (bs, T); index: (bs,) uids; config: verl's ``algorithm``.
    Returns:
        advantages (bs, T), returns (bs, T).
    """
    return redistributed_advantage("rredcot", token_level_rewards, response_mask, index, config)


SPEC = EstimatorSpec(
    name="rredcot",
    inputs=(SegmentInputs,),
    stages=value_stages,
    advantage=compute_rredcot_advantage,
    uses_value_pass=True,
    whole_traces_per_rank=True,
)
