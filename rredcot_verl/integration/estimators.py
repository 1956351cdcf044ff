"""verl registrations of ``rredcot``, ``segment_mc`` and ``ibpo`` (thin: all arithmetic is in the core modules).

verl's ``compute_advantage`` passes a registered estimator only ``token_level_rewards``, ``response_mask``, ``index``
and ``config``; the per-trace segment or repair data that these estimators need travels beside that call in
``estimator_inputs`` (a context manager the trainer opens around verl's own ``_compute_advantage``). Rows are checked
against ``index`` so a reordering inside verl cannot silently misalign them. State that outlives a step (the value
gate's window of recent batches) stays with the trainer: it goes in as ``prior_concordance`` and this batch's counts
come back in the record's ``details``.
"""

from __future__ import annotations

import contextvars
import dataclasses
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, register_adv_est

from rredcot_verl.core.concordance import ConcordanceCounts
from rredcot_verl.core.settings import settings_from_config
from rredcot_verl.core.ibpo import shaped_advantages
from rredcot_verl.core.redistribution import redistribute

# Per-trace batch fields the trainer produces for these estimators (written once; the trainer's table names them).
SEGMENT_FIELDS = ("seg_ends", "seg_raw_values")
IBPO_FIELDS = ("ibpo_phi", "ibpo_edited_mask")

_INPUTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("rredcot_estimator_inputs", default=None)


@contextmanager
def estimator_inputs(
    uid: np.ndarray, tensors: dict[str, torch.Tensor], prior_concordance: ConcordanceCounts = ConcordanceCounts()
):
    """Make per-trace inputs (rows aligned with ``uid``) and the value gate's window (``prior_concordance``)
    visible to the estimators; collects their metrics and details."""
    record = {
        "uid": np.asarray(uid, dtype=object),
        "tensors": tensors,
        "prior_concordance": prior_concordance,
        "metrics": {},
        "details": {},
    }
    token = _INPUTS.set(record)
    try:
        yield record
    finally:
        _INPUTS.reset(token)


def _inputs(name: str, keys: tuple[str, ...], index) -> dict:
    record = _INPUTS.get()
    missing = list(keys) if record is None else [k for k in keys if k not in record["tensors"]]
    if missing:
        raise KeyError(
            f"adv_estimator={name!r} needs batch keys {missing}, which only the rredcot trainer provides: launch "
            "through `python -m rredcot_verl.main` (it sets trainer.v1.trainer_mode=rredcot)"
        )
    if index is not None and not np.array_equal(np.asarray(index, dtype=object), record["uid"]):
        raise ValueError(f"adv_estimator={name!r}: segment data rows do not match the batch's uid order")
    return record


def _settings(config):
    settings = settings_from_config(config)
    norm = config.get("norm_adv_by_std_in_grpo", True) if config is not None else True
    return settings, dataclasses.replace(settings.redistribution, norm_adv_by_std=bool(norm))


def _redistributed(name: str, token_level_rewards, response_mask, index, config):
    record = _inputs(name, SEGMENT_FIELDS, index)
    settings, redistribution = _settings(config)
    result = redistribute(
        token_level_rewards.sum(dim=-1),
        response_mask,
        index,
        record["tensors"]["seg_ends"],
        record["tensors"]["seg_raw_values"],
        redistribution,
        reward_range=settings.reward_range,
        prior_concordance=record["prior_concordance"],
    )
    record["metrics"].update({f"{name}/{k}": v for k, v in result.metrics.items()})
    record["details"].update(
        values=result.values, segment_rewards=result.segment_rewards, fallback=result.fallback,
        concordance=result.concordance,
    )  # fmt: skip
    return result.advantages, result.returns


def _register(name: str, fn) -> None:
    # Importing twice (e.g. the plugin hook and a user import) must not trip verl's duplicate-name check.
    if ADV_ESTIMATOR_REGISTRY.get(name) is None:
        register_adv_est(name)(fn)


def compute_rredcot_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index=None, config: Any = None, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """RREDCoT: exit-probe (or reference-continuation) segment values redistributed into token advantages.

    Args:
        token_level_rewards: (bs, T); response_mask: (bs, T); index: (bs,) uids; config: verl's ``algorithm``.
    Returns:
        advantages (bs, T), returns (bs, T).
    """
    return _redistributed("rredcot", token_level_rewards, response_mask, index, config)


def compute_segment_mc_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index=None, config: Any = None, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Monte-Carlo segment values (K continuations per boundary) through the same redistribution as ``rredcot``."""
    return _redistributed("segment_mc", token_level_rewards, response_mask, index, config)


def compute_ibpo_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index=None, config: Any = None, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """IBPO: repair-shaped reward R + λφ(high − R) before group normalisation, advantage masked to the edited tokens.

    ``high`` and the correctness threshold come from ``algorithm.rredcot.reward_range``, the scale the repairs were
    judged on. Args and returns as :func:`compute_rredcot_advantage`.
    """
    record = _inputs("ibpo", IBPO_FIELDS, index)
    settings, redistribution = _settings(config)
    cfg = dataclasses.replace(settings.ibpo, norm_adv_by_std=redistribution.norm_adv_by_std)
    result = shaped_advantages(
        token_level_rewards.sum(dim=-1),
        response_mask,
        index,
        record["tensors"]["ibpo_phi"],
        record["tensors"]["ibpo_edited_mask"].bool() if cfg.use_mask else None,
        cfg,
        reward_range=settings.reward_range,
    )
    record["metrics"].update(result.metrics)
    return result.advantages, result.advantages


_register("rredcot", compute_rredcot_advantage)
_register("segment_mc", compute_segment_mc_advantage)
_register("ibpo", compute_ibpo_advantage)
