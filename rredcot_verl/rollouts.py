"""Extra generation through the running rollout engine: IBPO repairs and Monte-Carlo continuations (thin).

Both run in the trainer process after verl's old-log-prob pass, with the same vLLM servers (and weights) that produced
the step's rollouts, through verl's ``LLMServerClient``; scoring uses the step's own reward function
(``reward.custom_reward_function``). Token accounting is returned as metrics so the cost can be compared with GRPO.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import numpy as np
import torch
from verl import DataProto
from verl.utils.import_utils import load_extern_object

from rredcot_verl import ibpo
from rredcot_verl.segmentation import BoundaryVocab, segment_response


def reward_function(config):
    """The step's rule reward (``compute_score(data_source, solution_str, ground_truth, extra_info)``)."""
    custom = config.reward.get("custom_reward_function", {}) or {}
    path = custom.get("path")
    if not path:
        raise ValueError(
            f"adv_estimator={config.algorithm.adv_estimator!r} scores its extra rollouts with the rule reward: set "
            "reward.custom_reward_function.path (and .name, default compute_score)"
        )
    return load_extern_object(path, custom.get("name") or "compute_score")


async def _generate_all(client, requests: list[tuple[list[int], dict]]) -> list[Any]:
    return await asyncio.gather(
        *[client.generate(uuid.uuid4().hex, prompt_ids=ids, sampling_params=dict(params)) for ids, params in requests]
    )


def generate(trainer, requests: list[tuple[list[int], dict]]) -> list[Any]:
    """Generate every (prompt ids, sampling params) request concurrently; returns verl ``TokenOutput``s."""
    if not requests:
        return []
    return asyncio.run(_generate_all(trainer.get_llm_client(), requests))


def _truncated(output, max_tokens: int, eos_id: int) -> bool:
    return len(output.token_ids) >= max_tokens and (not output.token_ids or output.token_ids[-1] != eos_id)


def _rows(traces: DataProto):
    """Per trace: (prompt ids, response ids) without padding."""
    batch = traces.batch
    for i in range(len(traces)):
        yield (
            batch["prompts"][i][batch["prompt_mask"][i].bool()].tolist(),
            batch["responses"][i][batch["response_mask"][i].bool()].tolist(),
        )


def _dataset_fields(traces: DataProto, i: int) -> tuple[Any, Any, Any]:
    nt = traces.non_tensor_batch
    reward_model = nt["reward_model"][i] if "reward_model" in nt else None
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if truth is None:
        raise ValueError("extra rollouts need reward_model.ground_truth in the dataset (verl's rule-reward format)")
    extra = nt["extra_info"][i] if "extra_info" in nt else None
    source = nt["data_source"][i] if "data_source" in nt else None
    return truth, extra, source


def _question(traces: DataProto, i: int) -> str:
    """The last user message of the dataset's chat prompt (verl's ``raw_prompt``)."""
    messages = traces.non_tensor_batch["raw_prompt"][i]
    user = [m["content"] for m in messages if m.get("role") == "user"]
    if not user:
        raise ValueError(f"trace {i}: raw_prompt has no user message to build a revision prompt from")
    return str(user[-1])


# ---------------------------------------------------------------------------------------------------------- IBPO
def ibpo_repairs(trainer, traces: DataProto) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """For each incorrect trace, repairs guided by sibling references; returns φ (bs,) and edited masks (bs, R)."""
    cfg = trainer.settings.ibpo
    tokenizer, config = trainer.tokenizer, trainer.config
    score = reward_function(config)
    rows = list(_rows(traces))
    outcomes = traces.batch["outcome"]
    uid = traces.non_tensor_batch["uid"]
    correct = (outcomes > 0).tolist()
    plan = ibpo.plan_revisions(correct, uid, cfg, np.random.default_rng(trainer.global_steps), [r for _, r in rows])
    template = cfg.revision_template or ibpo.DEFAULT_REVISION_TEMPLATE
    budget = int(config.data.max_prompt_length)
    requests, kept_pairs, over_budget = [], [], 0
    for i, j in plan.pairs:
        response = rows[i][1]
        text = ibpo.build_revision_prompt(
            _question(traces, i), tokenizer.decode(response), tokenizer.decode(rows[j][1]), template
        )
        ids = list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        if not ibpo.fits_prompt_budget(len(ids), budget):
            over_budget += 1
            continue
        params = {"temperature": cfg.revision_temperature, "top_p": 1.0, "max_tokens": cfg.max_revision_tokens}
        requests.append((ids, params))
        kept_pairs.append((i, j))
    outputs = generate(trainer, requests)
    per_trace: dict[int, list[ibpo.RepairEvaluation]] = {}
    generated_tokens = 0
    for (i, _), output in zip(kept_pairs, outputs):
        truth, extra, source = _dataset_fields(traces, i)
        repair = list(output.token_ids)
        generated_tokens += len(repair)
        verdict = score(source, tokenizer.decode(repair, skip_special_tokens=True), truth, extra) > 0
        truncated = _truncated(output, cfg.max_revision_tokens, tokenizer.eos_token_id)
        per_trace.setdefault(i, []).append(ibpo.evaluate_repair(rows[i][1], repair, verdict, truncated, cfg))
    width = traces.batch["responses"].size(1)
    phi = torch.zeros(len(rows), dtype=torch.float32)
    masks = []
    for i, (_, response) in enumerate(rows):
        evaluations = per_trace.get(i, [])
        phi[i] = ibpo.repair_signal(
            bool(correct[i]), [e.correct for e in evaluations], [e.alignment.edit_ratio for e in evaluations], cfg
        )
        masks.append(ibpo.localisation_mask(evaluations, len(response)))
    metrics = ibpo.repair_metrics([e for es in per_trace.values() for e in es])
    metrics.update(
        {
            "ibpo/revisions": float(len(kept_pairs)),
            "ibpo/revisions_skipped_by_cap": float(plan.skipped_by_cap),
            "ibpo/revisions_skipped_prompt_too_long": float(over_budget),
            "ibpo/traces_without_reference": float(plan.traces_without_reference),
            "ibpo/extra_generated_tokens": float(generated_tokens),
        }
    )
    return {"ibpo_phi": phi, "ibpo_edited_mask": ibpo.stack_edited_masks(masks, width)}, metrics


# ------------------------------------------------------------------------------------------------- segment MC
def monte_carlo_values(trainer, traces: DataProto) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Values of S_0..S_{K-1} as the mean reward of K sampled continuations from each boundary prefix."""
    mc = trainer.settings.segment_mc
    tokenizer, config = trainer.tokenizer, trainer.config
    score = reward_function(config)
    vocab = BoundaryVocab.from_tokenizer(tokenizer, trainer.settings.segmentation)
    rows = list(_rows(traces))
    entropy = traces.batch["entropy"]
    mask = traces.batch["response_mask"].bool()
    max_len = int(config.data.max_prompt_length) + int(config.data.max_response_length)
    requests, owners, all_ends = [], [], []
    for i, (prompt_ids, response) in enumerate(rows):
        ends = segment_response(torch.tensor(response), entropy[i][mask[i]].float(), vocab, trainer.settings.segmentation)
        all_ends.append(ends)
        for k, start in enumerate([0, *ends[:-1]]):
            room = min(mc.max_tokens, max_len - len(prompt_ids) - start)
            if room < 1:
                continue
            params = {"temperature": mc.temperature, "top_p": 1.0, "max_tokens": room}
            for _ in range(mc.num_continuations):
                requests.append((prompt_ids + response[:start], params))
                owners.append((i, k, start, room))
    outputs = generate(trainer, requests)
    k_max = max([trainer.settings.segmentation.max_segments, *(len(e) for e in all_ends)])
    sums = torch.zeros(len(rows), k_max + 1)
    counts = torch.zeros(len(rows), k_max + 1)
    truncated = generated = 0
    for (i, k, start, room), output in zip(owners, outputs):
        truth, extra, source = _dataset_fields(traces, i)
        generated += len(output.token_ids)
        if _truncated(output, room, tokenizer.eos_token_id):
            truncated += 1
            counts[i, k] += 1
            continue
        text = tokenizer.decode(rows[i][1][:start] + list(output.token_ids), skip_special_tokens=True)
        sums[i, k] += float(score(source, text, truth, extra) > 0)
        counts[i, k] += 1
    seg_ends = torch.full((len(rows), k_max), -1, dtype=torch.int64)
    raw_values = torch.full((len(rows), k_max + 1), float("nan"))
    for i, ends in enumerate(all_ends):
        if not ends:
            continue
        seg_ends[i, : len(ends)] = torch.tensor(ends)
        k = len(ends)
        raw_values[i, :k] = sums[i, :k] / counts[i, :k]  # 0/0 = NaN where a prefix had no room: GRPO fallback
        raw_values[i, k] = float(traces.batch["outcome"][i])
    metrics = {
        "segment_mc/continuations": float(len(requests)),
        "segment_mc/truncated_continuations": float(truncated),
        "segment_mc/extra_generated_tokens": float(generated),
    }
    return {"seg_ends": seg_ends, "seg_raw_values": raw_values}, metrics
