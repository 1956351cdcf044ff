"""``segment_mc``: Monte-Carlo values of the same boundaries (K continuations per prefix through the rollout engine,
``monte_carlo_values``), then ``rredcot``'s redistribution: the expensive reference the others are measured
against."""

from __future__ import annotations

import functools

import torch

from rredcot_verl.core import montecarlo
from rredcot_verl.core.profiles import decode_batch
from rredcot_verl.core.segmentation import segment_response
from rredcot_verl.integration import rollouts
from rredcot_verl.integration.estimators.base import (
    EngineUse, EstimatorSpec, Stage, StepContext, StepTraces,
)
from rredcot_verl.integration.estimators.rredcot import SEGMENT_INPUTS, redistributed_advantage


def monte_carlo_values(ctx: StepContext, traces: StepTraces) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Values of S_0..S_{K-1} as the mean reward of K sampled continuations from each boundary prefix; the boundaries
    come from the log-prob pass's entropies.

    A continuation may fill ``data.max_prompt_length + data.max_response_length`` (the length a training rollout may
    have), so a state whose prefix leaves no room gets no continuations and a NaN value; a truncated continuation
    scores 0. Rewards are read on the probability scale, ``(reward − low) / (high − low)`` of ``reward_range``.

    Args:
        ctx: generation, reward, tokenizer, boundary tables, settings (``segment_mc``, ``segmentation``,
            ``reward_range``).
        traces: the step's traces, with the log-prob pass's entropies.

    Returns:
        ``segment_ends`` and ``raw_values`` (``AdvantageBatch``; see ``montecarlo.values_from_continuations``) and
        metrics.
    """
    mc, tokenizer, vocab = ctx.settings.segment_mc, ctx.tokenizer, ctx.boundary_vocab
    records = traces.records
    ends = [
        segment_response(
            record.response_ids, record.entropy.float(), vocab, ctx.settings.segmentation,
            response_mask=record.response_mask,
        )  # fmt: skip
        if record.response_ids.numel()
        else []
        for record in records
    ]
    prompts = [record.prompt_ids.tolist() for record in records]
    responses = [record.response_ids.tolist() for record in records]

    def judge(i: int, response_ids: list[int]) -> float:
        # On the probability scale of the other value sources: 1 = the top of the reward range.
        truth, extra, source = rollouts.reward_inputs(records[i])
        reward = ctx.score(source, decode_batch(tokenizer, [response_ids], skip_special_tokens=True)[0], truth, extra)
        return ctx.settings.success_probability(reward)

    # Requested and judged a chunk of traces at a time (MonteCarloSettings.max_prefix_tokens_per_call).
    tally = montecarlo.ContinuationTally(len(records), montecarlo.max_k(ends, ctx.settings.segmentation.max_segments))
    for requests in montecarlo.continuation_chunks(
        prompts, responses, ends, mc, ctx.max_prompt_length + ctx.max_response_length
    ):
        outputs = ctx.generate(
            [(list(r.prefix_ids), {"temperature": mc.temperature, "top_p": 1.0, "max_tokens": r.max_tokens})
             for r in requests]
        )  # fmt: skip
        if len(outputs) != len(requests):
            raise ValueError(f"generate returned {len(outputs)} outputs for {len(requests)} continuation requests")
        continuations = [
            montecarlo.Continuation(
                tuple(o.token_ids), rollouts.generation_truncated(o, r.max_tokens, tokenizer.eos_token_id)
            )
            for r, o in zip(requests, outputs)
        ]
        tally.add(responses, requests, continuations, judge)
    seg_ends, raw_values, metrics = tally.values(ends, [record.outcome for record in records])
    return {"segment_ends": seg_ends, "raw_values": raw_values}, metrics


# Its boundaries need the pass's entropies: the engine is woken after the pass.
CONTINUATION_STAGE = Stage(monte_carlo_values, EngineUse.AFTER_LOG_PROB_PASS)

SPEC = EstimatorSpec(
    name="segment_mc",
    inputs=SEGMENT_INPUTS,
    stages=lambda settings: (CONTINUATION_STAGE,),
    # Monte-Carlo segment values (K continuations per boundary) through the same redistribution as ``rredcot``.
    advantage=functools.partial(redistributed_advantage, "segment_mc"),
    uses_value_pass=False,
    whole_traces_per_rank=True,
)
