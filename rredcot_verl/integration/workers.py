"""Actor-worker extension: probe plans scored on the actor, with the old (rollout) weights.

``SegmentActorRolloutRefWorker`` is verl's ``ActorRolloutRefWorker`` plus one method, ``value_pass``, called by the
trainer (``rredcot``'s ``probe_values`` stage) right after verl's own log-prob pass and before the actor update, so the
weights are the ones that produced ``old_log_probs``. The plans (boundaries and probes of each trace) are built by the
trainer from the whole batch (``core.planning``), so a group split across ranks values the same; this worker only
scores (``core.values.score_plans``).

Batch contract (the one place it is written down). Input ``DataProto``:

=====================  ===========================  ==========================================================
key                    shape / kind                 meaning
=====================  ===========================  ==========================================================
``outcome``            (bs,) float                   verified reward ζ (sum of ``rm_scores``)
``plan``               non-tensor (bs,)              each trace's planned ``core.traces.TraceRecord``
``meta_info``          ``max_segments``              output width Kmax
``meta_info``          ``value_pass``                ``algorithm.rredcot.value_pass`` as a dict
=====================  ===========================  ==========================================================

Output ``DataProto`` tensors, named as the ``AdvantageBatch`` fields they become: ``segment_ends`` (bs, Kmax) int64,
exclusive segment ends into the response, -1 padded; ``raw_values`` (bs, Kmax+1) float32, v̂_0..v̂_K with column K =
ζ, NaN padded. ``meta_info['metrics']`` carries the pass's diagnostics. The trainer keeps them in verl's batch
(TransferQueue) under ``seg_ends`` / ``seg_raw_values`` (``AdvantageBatch.BATCH_KEYS``, with IBPO's ``ibpo_phi`` and
``ibpo_edited_mask``) until the advantage step reads them back into the step's ``AdvantageBatch``. These keys exist
only when ``algorithm.adv_estimator`` is one of this package's estimators whose stages write them;
``require_keys`` names the switch when the pass's inputs are missing.
"""

from __future__ import annotations

from verl import DataProto
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker

from rredcot_verl.core.scoring import ValuePassSettings
from rredcot_verl.core.values import score_plans
from rredcot_verl.integration.estimators import ESTIMATORS

INPUT_KEYS = ("outcome",)
# The estimators whose producer calls this worker's value pass.
VALUE_PASS_ESTIMATORS = tuple(name for name, spec in ESTIMATORS.items() if spec.uses_value_pass)


def require_keys(available, keys, producer: str) -> None:
    """Raise a clear error naming the missing batch keys and the config switch that produces them."""
    missing = [key for key in keys if key not in available]
    if missing:
        raise KeyError(
            f"batch is missing {missing}; they are produced by {producer} "
            f"(set algorithm.adv_estimator to {' or '.join(VALUE_PASS_ESTIMATORS)} and launch through "
            "`python -m rredcot_verl.main`, which selects the rredcot trainer)"
        )


class SegmentActorRolloutRefWorker(ActorRolloutRefWorker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def value_pass(self, data: DataProto) -> DataProto:
        require_keys(data.batch.keys(), INPUT_KEYS, "the rredcot trainer's old-log-prob step")
        require_keys(data.non_tensor_batch.keys(), ("plan",), "the rredcot trainer's old-log-prob step")
        value_pass = ValuePassSettings(**data.meta_info["value_pass"])
        engine = self.actor.engine
        with engine.eval_mode():
            model = engine.module
            # score_plans makes the same number of forwards on every rank (FSDP2 all-gathers in each), even for an
            # empty shard, and runs attention through its own backend whatever the actor was loaded with.
            segment_ends, raw_values, metrics = score_plans(
                model,
                list(data.non_tensor_batch["plan"]),
                max_segments=int(data.meta_info["max_segments"]),
                max_positions=getattr(model.config, "max_position_embeddings", None),
                max_token_len=value_pass.max_token_len,
            )
        return DataProto.from_dict(
            tensors={"segment_ends": segment_ends, "raw_values": raw_values}, meta_info={"metrics": metrics}
        )
