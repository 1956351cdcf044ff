"""``ibpo``: repairs of incorrect traces, generated through the rollout engine and aligned token by token
(``ibpo_repairs``), shape the reward and decide where blame lands (``core.ibpo.shaped_advantages``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rredcot_verl.core import ibpo as core_ibpo
from rredcot_verl.core import outcomes
from rredcot_verl.core.ibpo import shaped_advantages
from rredcot_verl.core.profiles import decode_batch
from rredcot_verl.core.settings import RRedCoTSettings
from rredcot_verl.core.traces import TraceRecord
from rredcot_verl.integration import rollouts
from rredcot_verl.integration.estimators.base import (
    AdvantageBatch, AdvantageResult, EngineUse, EstimatorSpec, Stage, StepContext, StepTraces,
)

# The AdvantageBatch inputs the repairs fill.
REPAIR_INPUTS = ("phi", "edited_mask")


def _question(record: TraceRecord, i: int) -> str:
    """The last user message of the dataset's chat prompt (verl's ``raw_prompt``)."""
    if record.question is None:
        raise ValueError(f"trace {i}: raw_prompt has no user message to build a revision prompt from")
    return record.question


@dataclass(frozen=True)
class _RepairRequest:
    """One repair to generate: the prompt ids, the trace tokens the repair keeps verbatim before the generated ones,
    and the generation budget."""

    prompt_ids: list[int]
    kept: int
    max_new_tokens: int


def ibpo_repairs(ctx: StepContext, traces: StepTraces) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """For each incorrect trace, repairs guided by sibling references, judged and aligned against the trace. Repairs
    need only the traces and their outcomes: generated while the engine is still awake from the rollouts.

    A trace is incorrect, and a repair verified, when its outcome falls short of / reaches the top of
    ``settings.reward_range``. Requests by ``ibpo.repair_operator``:

    - ``resume``: the rollout's own prompt ids followed by the trace's first ``k = ibpo.divergence_point(trace,
      reference)`` tokens, generating at most ``max_response_length − k`` tokens; the repair is the kept prefix
      followed by the generation (ids reused, nothing decoded and re-encoded, so the prefix is the trace's exactly).
    - ``rewrite``: the revision template's user message rendered as the rollouts' prompts are, with trace and
      reference texts decoded without special tokens (an end-of-sequence or chat marker copied into the user message
      would close the turn early), generating at most ``ibpo.revision_budget(L)`` tokens.

    A request that does not fit ``ctx.engine_length()`` (or, resumed, leaves no response budget) is skipped and the
    trace's next reference tried. Every incorrect trace is accounted for in the metrics: revised, without a sibling,
    without a reference that fits, or dropped by ``max_revisions``.

    Args:
        ctx: generation, reward, tokenizer, settings and the engine's context length.
        traces: the step's traces (each record's tokens, outcome, prompt group, question and reward inputs).

    Returns:
        ``phi`` and ``edited_mask`` (``AdvantageBatch``; the mask R wide, the batch's response width) and metrics.
        Per prompt group, the token ids of its verified repairs (rewrites included: a correct solution of the
        prompt, whatever it kept of the trace) are left in ``ctx.verified_repairs``, for a later stage's
        reference bank (``candidates.source: group_and_repairs``).
    """
    cfg = ctx.settings.ibpo
    tokenizer, reward_range = ctx.tokenizer, ctx.settings.reward_range
    records = traces.records
    responses = [record.response_ids.tolist() for record in records]
    correct = outcomes.correct_outcomes(traces.outcomes, reward_range).tolist()
    template = cfg.revision_template or core_ibpo.DEFAULT_REVISION_TEMPLATE
    engine_length = ctx.engine_length()

    texts: dict[int, str] = {}
    requests_by_pair: dict[tuple[int, int], _RepairRequest] = {}

    def text(i: int) -> str:
        if i not in texts:
            texts[i] = decode_batch(tokenizer, [responses[i]], skip_special_tokens=True)[0]
        return texts[i]

    def request(i: int, j: int) -> _RepairRequest:
        if cfg.repair_operator == "resume":
            kept = core_ibpo.divergence_point(responses[i], responses[j])
            prompt = records[i].prompt_ids.tolist() + responses[i][:kept]
            return _RepairRequest(prompt, kept, ctx.max_response_length - kept)
        user = core_ibpo.build_revision_prompt(_question(records[i], i), text(i), text(j), template)
        prompt = ctx.chat_prompt_ids([{"role": "user", "content": user}])
        return _RepairRequest(prompt, 0, core_ibpo.revision_budget(len(responses[i]), cfg))

    def fits(i: int, j: int) -> bool:
        requests_by_pair[(i, j)] = planned = request(i, j)
        return core_ibpo.fits_engine(len(planned.prompt_ids), planned.max_new_tokens, engine_length)

    plan = core_ibpo.plan_revisions(
        correct, [record.group for record in records], cfg, np.random.default_rng(ctx.step), responses, usable=fits
    )
    planned = [requests_by_pair[pair] for pair in plan.pairs]
    outputs = ctx.generate(
        [(r.prompt_ids, {"temperature": cfg.revision_temperature, "top_p": 1.0, "max_tokens": r.max_new_tokens})
         for r in planned]
    )  # fmt: skip
    if len(outputs) != len(planned):
        raise ValueError(f"generate returned {len(outputs)} outputs for {len(planned)} revision requests")
    per_trace: dict[int, list[core_ibpo.RepairEvaluation]] = {}
    verified: dict[Any, list[list[int]]] = {}
    generated_tokens = 0
    repairs, truncations, judged, reward_inputs = [], [], [], []
    for (i, _), r, output in zip(plan.pairs, planned, outputs):
        reward_inputs.append(rollouts.reward_inputs(records[i]))
        generated = list(output.token_ids)
        generated_tokens += len(generated)
        repairs.append(responses[i][: r.kept] + generated)
        truncations.append(rollouts.generation_truncated(output, r.max_new_tokens, tokenizer.eos_token_id))
        # A repair that fails (empty, truncated, too long) counts for nothing whatever its answer: not judged.
        failure = core_ibpo.repair_failure(len(responses[i]), len(repairs[-1]), truncations[-1], cfg,
                                           r.kept + r.max_new_tokens)
        judged.append(failure is None)
    to_judge = [repair for repair, judge in zip(repairs, judged) if judge]
    texts_to_judge = iter(decode_batch(tokenizer, to_judge, skip_special_tokens=True))
    verified_correct = []
    for judge, (truth, extra, source) in zip(judged, reward_inputs):
        reward = ctx.score(source, next(texts_to_judge), truth, extra) if judge else None
        verified_correct.append(judge and outcomes.is_correct(reward, reward_range))
    evaluations = core_ibpo.evaluate_repairs(
        [responses[i] for i, _ in plan.pairs], repairs, verified_correct, truncations, cfg,
        [r.kept + r.max_new_tokens for r in planned],
    )  # fmt: skip
    for (i, _), repair, evaluation in zip(plan.pairs, repairs, evaluations):
        per_trace.setdefault(i, []).append(evaluation)
        if evaluation.correct:
            verified.setdefault(records[i].group, []).append(repair)
    width = traces.response_width
    phi = torch.zeros(len(responses), dtype=torch.float32)
    masks = []
    for i, response in enumerate(responses):
        evaluations = per_trace.get(i, [])
        phi[i] = core_ibpo.repair_signal(bool(correct[i]), evaluations, cfg)
        masks.append(core_ibpo.localisation_mask(evaluations, len(response)))
    metrics = core_ibpo.repair_metrics([e for es in per_trace.values() for e in es])
    metrics.update(
        {
            "ibpo/incorrect_traces": float(plan.incorrect_traces),
            "ibpo/incorrect_traces_revised": float(len(per_trace)),
            "ibpo/traces_without_reference": float(plan.traces_without_reference),
            "ibpo/traces_without_fitting_reference": float(plan.traces_without_usable_reference),
            "ibpo/traces_skipped_by_cap": float(plan.traces_skipped_by_cap),
            "ibpo/revisions_skipped_by_cap": float(plan.skipped_by_cap),
            "ibpo/revisions_skipped_no_room": float(plan.rejected_pairs),
            "ibpo/extra_prompt_tokens": float(sum(len(r.prompt_ids) for r in planned)),
            "ibpo/extra_generated_tokens": float(generated_tokens),
        }
    )
    if cfg.repair_operator == "resume":
        # How far into the trace the repairs start: near 0, they are fresh solves (the rewrite guard's business).
        kept_fracs = [r.kept / max(len(responses[i]), 1) for (i, _), r in zip(plan.pairs, planned)]
        metrics["ibpo/resume_kept_frac_mean"] = sum(kept_fracs) / len(kept_fracs) if kept_fracs else 0.0
    ctx.verified_repairs = verified
    return {"phi": phi, "edited_mask": core_ibpo.stack_edited_masks(masks, width)}, metrics


REPAIR_STAGE = Stage(ibpo_repairs, EngineUse.BEFORE_LOG_PROB_PASS)


def ibpo_advantage(batch: AdvantageBatch, settings: RRedCoTSettings) -> AdvantageResult:
    """IBPO: repair-shaped reward R + λφ(high − R) before group normalisation, advantage masked to the edited
    tokens. ``high`` and the correctness threshold come from ``algorithm.rredcot.reward_range``, the scale the repairs
    were judged on."""
    phi, edited_mask = batch.require("ibpo", *REPAIR_INPUTS)
    cfg = settings.ibpo
    result = shaped_advantages(
        batch.scores, batch.response_mask, batch.index, phi, edited_mask.bool() if cfg.use_mask else None, cfg,
        reward_range=settings.reward_range,
    )  # fmt: skip
    return AdvantageResult(advantages=result.advantages, returns=result.advantages, metrics=result.metrics)


SPEC = EstimatorSpec(
    name="ibpo",
    inputs=REPAIR_INPUTS,
    stages=lambda settings: (REPAIR_STAGE,),
    advantage=ibpo_advantage,
    uses_value_pass=False,
    whole_traces_per_rank=False,
)
