"""One record per trace, from verl's batch to the value pass and back.

The trainer reads a step's traces into ``TraceRecord``s once (``records_from_arrays``); every stage takes them as
they are; planning (``planning.plan_traces``) returns each with its plan (segment ends, probes and how their log-probs
become values), and that planned record is what the actor's value pass scores (``values.score_plans``) and a step's
snapshot keeps (``step_XXXXX_plans.pt``). Imports neither verl nor ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

import torch

from rredcot_verl.core.probes import Probe
from rredcot_verl.core.segmentation import turn_spans


@dataclass
class TraceRecord:
    """One rollout, and once planned, how its states are valued.

    Attributes:
        prompt_ids: (P,) int64, no padding.
        response_ids: (L,) int64, no padding (L may be 0).
        entropy: (L,) float, the old policy's per-token entropy (from verl's log-prob pass); None before that pass
            and once planned (the segmentation is its only reader: the value pass is not sent it).
        outcome: ζ, the verified reward, the value of the terminal state.
        group: prompt id (verl's ``uid``).
        ground_truth: the dataset answer string, if any.
        reference_steps: the dataset's reference steps, if any (``extra_info.reference_steps``), in the task's
            ``split_steps`` sense (lines for ``arithmetic``, paragraphs for ``boxed_math``).
        question: the last user message of the dataset's chat prompt, if any (IBPO's revision prompts quote it).
        extra_info, data_source: the dataset's fields, passed to the rule reward as verl passes them.
        response_mask: (L,) 0/1, verl's ``response_mask`` without padding: 0 on the tool output and template tokens
            between a multi-turn response's assistant turns, which are context, never cut or probed into; None: the
            whole response is the model's.

    The plan (``planning.plan_traces``; empty before it):
        segment_ends: K exclusive segment ends into the response (empty for an empty response).
        probes: probes whose ``value_index`` indexes the values 0..K-1 (states S_0..S_{K-1}).
        success: ζ on the probability scale of the probes (``RRedCoTSettings.success_probability``).
        value_rule: one of ``planning.VALUE_RULES``: how probe log-probs become values.
        no_candidates: the trace's group had no candidate answer (its values are NaN: GRPO fallback).
        temperature: the rollout's sampling temperature; probe log-probs are taken from logits / temperature, the
            distribution the traces were sampled from.
        bank_sources: where the group's bank came from (``planning.BANK_FROM_*``; empty: no candidate).
    """

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    entropy: torch.Tensor | None
    outcome: float
    group: Hashable
    ground_truth: str | None = None
    reference_steps: Sequence[str] | None = None
    question: str | None = None
    extra_info: Any = None
    data_source: Any = None
    response_mask: torch.Tensor | None = None
    segment_ends: list[int] = field(default_factory=list)
    probes: list[Probe] = field(default_factory=list)
    success: float = 0.0
    value_rule: str = "raw"
    no_candidates: bool = False
    temperature: float = 1.0
    bank_sources: frozenset[str] = frozenset()

    def turns(self) -> list[tuple[int, int]]:
        """(start, stop) of each assistant turn; one turn over the whole response without a mask."""
        if self.response_mask is None:
            return [(0, self.response_ids.numel())] if self.response_ids.numel() else []
        return turn_spans(self.response_mask.bool())

    @property
    def num_values(self) -> int:
        """K, the values the plan estimates (states S_0..S_{K-1})."""
        return len(self.segment_ends)

    @property
    def starts(self) -> list[int]:
        """Boundaries of the valued states S_0..S_{K-1}."""
        return state_starts(self.segment_ends)


def state_starts(segment_ends: Sequence[int]) -> list[int]:
    """Boundaries of the valued states S_0..S_{K-1} of a trace cut at ``segment_ends``."""
    return [0, *segment_ends[:-1]]


def records_from_arrays(
    prompts: Sequence[torch.Tensor],
    responses: Sequence[torch.Tensor],
    entropies: Sequence[torch.Tensor] | None,
    outcomes: Sequence[float],
    groups: Sequence[Hashable],
    reward_models: Sequence[Any] | None = None,
    extra_infos: Sequence[Any] | None = None,
    raw_prompts: Sequence[Any] | None = None,
    data_sources: Sequence[Any] | None = None,
    response_masks: Sequence[torch.Tensor] | None = None,
) -> list[TraceRecord]:
    """Build records from per-trace arrays (``entropies`` None before the log-prob pass); ``reward_models[i]
    ['ground_truth']``, ``extra_infos[i]['reference_steps']`` and the last user message of ``raw_prompts[i]`` (chat
    messages) are read when present. ``response_masks``: each response's unpadded ``response_mask`` when its
    ``responses`` row is the full interleaved multi-turn response (``TraceRecord.response_mask``)."""

    def at(values, i):
        return values[i] if values is not None else None

    records = []
    for i in range(len(prompts)):
        reward_model, extra, messages = at(reward_models, i), at(extra_infos, i), at(raw_prompts, i)
        truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
        steps = extra.get("reference_steps") if isinstance(extra, dict) else None
        user = [m["content"] for m in messages if m.get("role") == "user"] if messages is not None else []
        records.append(
            TraceRecord(
                prompt_ids=prompts[i],
                response_ids=responses[i],
                entropy=at(entropies, i),
                outcome=float(outcomes[i]),
                group=groups[i],
                ground_truth=None if truth is None else str(truth),
                reference_steps=None if steps is None else [str(s) for s in steps],
                question=str(user[-1]) if user else None,
                extra_info=extra,
                data_source=at(data_sources, i),
                response_mask=at(response_masks, i),
            )
        )
    return records
