"""IBPO: counterfactual repairs turned into a shaped reward and a token mask.

Method (Ding et al., arXiv 2605.16302). For every incorrect trace ``y_i`` of a group, the rollout policy is asked to
repair it given a sibling trace ``y_ref`` of the same prompt: by default (``repair_operator: resume``) it continues
``y_i`` from where ``y_i`` leaves ``y_ref``; with ``rewrite`` it reads both and writes ``y_i`` again, corrected. A repair that the verifier accepts earns ``Δ = ρ``;
``φ_i`` aggregates ``Δ`` over the trace's references (0 for correct traces). The outcome is shaped *before* group
normalisation, ``R'_i = R_i + λ φ_i (high − R_i)``, so repairable failures are punished less than hopeless ones and
all-wrong groups still give a gradient. In the mask variant, a token-level Levenshtein alignment of ``y_i`` against its
most local successful repair says which tokens had to change, and the advantage of an incorrect trace lands on those
tokens only (sign rule in :func:`shaped_advantages`).

One training step, as the rollout side drives it (this package does no generation and imports neither verl nor ray)::

    correct = correct_outcomes(scores, reward_range)
    plan = plan_revisions(correct, index, cfg, rng, responses=response_ids, usable=request_fits_engine)
    # resume: k = divergence_point(y_i, y_j); prompt = rollout prompt + y_i[:k]; max_tokens = max_response_length - k
    # rewrite: prompt = build_revision_prompt(q_i, text_i, text_j); max_tokens = revision_budget(len(y_i), cfg)
    ... generate one repair per request (a resumed repair is y_i[:k] + its continuation), verify it ...
    evals_i = [evaluate_repair(response_ids[i], repair_ids, verified, truncated, cfg, max_len) for each repair of i]
    phi[i] = repair_signal(correct[i], evals_i, cfg)
    masks[i] = localisation_mask(evals_i, len(response_ids[i]))
    result = shaped_advantages(scores, response_mask, index, phi, stack_edited_masks(masks, T), cfg, reward_range)

Conventions: outcomes lie on a declared scale ``reward_range = (low, high)`` (``algorithm.rredcot.reward_range``); a
trace is *correct* when its outcome reaches ``high`` (:func:`correct_outcomes`), so partial credit is not correct.
Token ids of a trace are its valid response tokens (``response_mask == 1``), right-padded to ``T`` in batches.

Length. Reasoning traces run to 2k–25k tokens, and nothing here may assume short ones: a resumed repair's request is
never longer than a rollout's (:func:`engine_context_need`), a rewrite's budget grows with the trace it repairs
(:func:`revision_budget`), every request is bounded by the engine's context (:func:`fits_engine`), and the rewrite
guard looks at the verbatim prefix a repair keeps as well as at its edit ratio (:func:`evaluate_repair`), because a
faithful repair of a long trace rewrites everything after the first wrong step.

One module per concern; every public name is re-exported here, so ``from rredcot_verl.core.ibpo import X`` works:

- :mod:`.settings`: :class:`IBPOSettings` and its validation;
- :mod:`.revisions`: which siblings serve as references, the batch's revision plan, where a resumed repair starts,
  a rewrite's token budget, whether a request fits the engine and what context each operator needs, the rewrite
  templates;
- :mod:`.alignment`: the token Levenshtein alignment of a trace against its repair (rapidfuzz);
- :mod:`.evaluation`: judging a repair (failures, rewrite guard), φ, the localisation mask, the repair metrics;
- :mod:`.advantage`: the shaped, group-normalised and masked advantages, with their metrics.
"""

# Each module's __all__ is exactly its public part, so the star imports re-export nothing else.
from rredcot_verl.core.ibpo import advantage, alignment, evaluation, revisions, settings
from rredcot_verl.core.ibpo.advantage import *  # noqa: F403
from rredcot_verl.core.ibpo.alignment import *  # noqa: F403
from rredcot_verl.core.ibpo.evaluation import *  # noqa: F403
from rredcot_verl.core.ibpo.revisions import *  # noqa: F403
from rredcot_verl.core.ibpo.settings import *  # noqa: F403
from rredcot_verl.core.outcomes import correct_outcomes

__all__ = [
    *settings.__all__,
    "correct_outcomes",
    *revisions.__all__,
    *alignment.__all__,
    *evaluation.__all__,
    *advantage.__all__,
]
