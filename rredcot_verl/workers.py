"""Actor-worker extension: segment boundaries and values computed on the actor, with the old (rollout) weights.

``SegmentActorRolloutRefWorker`` is verl's ``ActorRolloutRefWorker`` plus one method, ``compute_segment_data``, called
by ``trainer.py`` right after verl's own log-prob pass and before the actor update, so the weights are the ones that
produced ``old_log_probs``. All algorithm work is in ``rredcot_verl.values``; this file only unpacks verl's batch.

Batch contract (the one place it is written down). Input ``DataProto`` fields, padded as verl pads them:

=====================  ===========================  ==========================================================
key                    shape / kind                 meaning
=====================  ===========================  ==========================================================
``prompts``            (bs, P) int64, left-padded    prompt ids
``responses``          (bs, R) int64, right-padded   response ids
``prompt_mask``        (bs, P) int64                 1 on real prompt tokens
``response_mask``      (bs, R) int64                 1 on real response tokens
``entropy``            (bs, R) float                 old policy entropies from verl's log-prob pass
``outcome``            (bs,) float                   verified reward ζ (sum of ``rm_scores``)
``uid``                non-tensor (bs,)              group id
``reward_model``       non-tensor (bs,), optional    dicts with ``ground_truth``
``extra_info``         non-tensor (bs,), optional    dicts with ``reference_steps``
=====================  ===========================  ==========================================================

Output ``DataProto`` fields (written to verl's TransferQueue by the trainer under the same names, and read by the
``rredcot``/``segment_mc`` estimators): ``seg_ends`` (bs, Kmax) int64, exclusive segment ends into the response,
-1 padded; ``seg_raw_values`` (bs, Kmax+1) float32, v̂_0..v̂_K with column K = ζ, NaN padded. ``meta_info['metrics']``
carries the pass's diagnostics. These two keys exist only when ``algorithm.adv_estimator`` is ``rredcot`` or
``segment_mc``; ``require_keys`` names the switch when they are missing.
"""

from __future__ import annotations

import torch
from verl import DataProto
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker

from rredcot_verl.config import RRedCoTSettings
from rredcot_verl.segmentation import BoundaryVocab
from rredcot_verl.values import compute_segment_values, records_from_arrays

SEGMENT_KEYS = ("seg_ends", "seg_raw_values")
INPUT_KEYS = ("prompts", "responses", "prompt_mask", "response_mask", "entropy", "outcome")


def require_keys(available, keys, producer: str) -> None:
    """Raise a clear error naming the missing batch keys and the config switch that produces them."""
    missing = [key for key in keys if key not in available]
    if missing:
        raise KeyError(
            f"batch is missing {missing}; they are produced by {producer} "
            "(set algorithm.adv_estimator to rredcot or segment_mc and launch through `python -m rredcot_verl.main`, "
            "which selects trainer.v1.trainer_mode=rredcot)"
        )


class SegmentActorRolloutRefWorker(ActorRolloutRefWorker):
    _segment_vocab: BoundaryVocab | None = None

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_segment_data(self, data: DataProto) -> DataProto:
        require_keys(data.batch.keys(), INPUT_KEYS, "the rredcot trainer's old-log-prob step")
        settings: RRedCoTSettings = data.meta_info["settings"]
        tokenizer = self.actor.model_config.tokenizer
        if self._segment_vocab is None:
            self._segment_vocab = BoundaryVocab.from_tokenizer(tokenizer, settings.segmentation)
        batch = data.batch
        prompt_mask = batch["prompt_mask"].bool()
        response_mask = batch["response_mask"].bool()
        records = records_from_arrays(
            prompts=[batch["prompts"][i][prompt_mask[i]] for i in range(len(data))],
            responses=[batch["responses"][i][response_mask[i]] for i in range(len(data))],
            entropies=[batch["entropy"][i][response_mask[i]].float() for i in range(len(data))],
            outcomes=batch["outcome"].tolist(),
            groups=list(data.non_tensor_batch["uid"]),
            reward_models=data.non_tensor_batch.get("reward_model"),
            extra_infos=data.non_tensor_batch.get("extra_info"),
        )
        engine = self.actor.engine
        with engine.eval_mode():
            model = engine.module
            values = compute_segment_values(
                model,
                tokenizer,
                records,
                settings,
                vocab=self._segment_vocab,
                max_positions=getattr(model.config, "max_position_embeddings", None),
            )
        output = DataProto.from_dict(
            tensors={"seg_ends": values.segment_ends, "seg_raw_values": values.raw_values},
            meta_info={"metrics": values.metrics},
        )
        return output
