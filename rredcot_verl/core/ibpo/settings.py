"""IBPO settings: :class:`IBPOSettings`, the frozen dataclass behind ``algorithm.rredcot.ibpo``, and its validation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

__all__ = ["IBPOSettings"]

AGGREGATES = ("mean", "max")
REPAIR_OPERATORS = ("resume", "rewrite")


@dataclass(frozen=True)
class IBPOSettings:
    """IBPO settings.

    Attributes:
        repair_operator: how a repair is asked for. ``resume`` (default): the repair continues the failed trace
            from where it diverges from its reference (their longest common token prefix), under the rollout's own
            prompt, with what the response budget has left there (``max_response_length`` minus the kept prefix);
            its request is never longer than a rollout's, so it fits every engine that serves the rollouts, and a
            verified repair is an ordinary sample of the policy that shares the trace's prefix. ``rewrite``: the
            revision prompt quotes the question, the trace and the reference (``revision_template``) and asks for
            the whole corrected trace (``revision_length_factor``, ``revision_slack_tokens``); it needs
            ``max_prompt_length + 2·max_response_length`` plus the repair's budget of engine context, which a
            40,960-position model cannot give past ~12k-token responses. docs/choices.md, "IBPO at any length".
        shaping_weight: λ in ``R' = R + λφ(high − R)`` (0.6, transcribed from the paper). 0 turns shaping off.
        repair_bonus: ρ, the comparison signal Δ of one successful repair (0.5, transcribed). ``λ·ρ < 1`` is
            required so that a repaired incorrect trace always stays below a correct one.
        num_references: K−1, sibling references (hence revisions) per incorrect trace (3).
        max_edit_ratio: δ, bound on ``edit distance / |trace|``. A verified repair is a *rewrite*, not a local
            repair, when its edit ratio exceeds δ **and** it did not keep the trace's prefix (``min_kept_prefix``).
            0.5; ``math.inf`` disables the guard. The guard is this project's addition: a repair that copies the
            reference says nothing about how close the trace was.
        min_kept_prefix: π. A repair that reproduces at least ``π·|trace|`` leading tokens of the trace verbatim
            (before its first edit) kept the trace's prefix and is a local repair whatever its edit ratio (0.25).
            Why both: at length a faithful repair keeps the trace up to its first wrong step and rewrites the rest,
            so its edit ratio says where the error was (an error at 30% of a 10k-token trace gives a ratio near
            0.7), not whether it is a repair; what a copy of the reference or a fresh solve cannot do is reproduce
            a long verbatim prefix (two samples of one prompt share only their opening, a few dozen tokens), so a
            kept prefix of a quarter of the trace tells them apart from 2k tokens on. A value above 1 leaves only
            the edit-ratio test.
        rewrite_counts_as_repair: False (default): a verified rewrite earns no Δ and gives no localisation,
            because copying the reference says nothing about how close the trace was. True: a verified rewrite
            earns Δ for φ; it still never provides a token mask (a rewrite's mask covers nearly everything).
        use_mask: True: mask variant (credit on edited tokens). False: shaping only, advantages broadcast.
        aggregate: how Δ is aggregated over a trace's references: "mean" (φ ∈ [0, ρ] graded) or "max".
        max_revisions: cap on revision generations per training step, or None (default) for none: every incorrect
            trace gets ``num_references`` revisions. A cap is shared round-robin (:func:`plan_revisions`): every
            incorrect trace gets one revision before any gets a second, and what the cap dropped is counted.
        revision_length_factor, revision_slack_tokens: ``rewrite`` only: a repair of an ``L``-token trace may
            have ``ceil(factor·L) + slack`` tokens (1.2 and 128: a repair restates the trace with a fix, so it is
            about as long; 20% room for an added step, and a slack for short or cut-off traces).
            Longer or truncated repairs are failures. (A resumed repair may fill the response budget.)
        epsilon: added to the group std, as in verl's GRPO (1e-6).
        norm_adv_by_std: divide by the group std (GRPO) or only centre (Dr.GRPO), as verl's
            ``norm_adv_by_std_in_grpo``.
        revision_template: ``rewrite`` only (refused with ``resume``, which sends the rollout's own prompt): the
            compare-and-correct prompt with ``{question}``, ``{trace}`` and ``{reference}`` fields; None uses
            ``DEFAULT_REVISION_TEMPLATE`` (chat models); the embedded task's recipes use ``EMBEDDED_TASK_TEMPLATE``.
        revision_temperature: sampling temperature of the repairs (1.0).
    """

    repair_operator: str = "resume"
    shaping_weight: float = 0.6
    repair_bonus: float = 0.5
    num_references: int = 3
    max_edit_ratio: float = 0.5
    min_kept_prefix: float = 0.25
    rewrite_counts_as_repair: bool = False
    use_mask: bool = True
    aggregate: str = "mean"
    max_revisions: Optional[int] = None
    revision_length_factor: float = 1.2
    revision_slack_tokens: int = 128
    epsilon: float = 1e-6
    norm_adv_by_std: bool = True
    revision_template: Optional[str] = None
    revision_temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.repair_operator not in REPAIR_OPERATORS:
            raise ValueError(
                f"IBPOSettings.repair_operator must be one of {REPAIR_OPERATORS}, got {self.repair_operator!r}"
            )
        if self.repair_operator == "resume" and self.revision_template is not None:
            raise ValueError(
                "IBPOSettings.revision_template is the rewrite operator's prompt; repair_operator='resume' continues "
                "the rollout's own prompt: set repair_operator to 'rewrite' or leave revision_template null"
            )
        for name in ("shaping_weight", "repair_bonus"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"IBPOSettings.{name} must be a finite number >= 0, got {value!r}")
        if self.shaping_weight * self.repair_bonus >= 1:
            raise ValueError(
                f"IBPOSettings needs shaping_weight * repair_bonus < 1 (got {self.shaping_weight} * "
                f"{self.repair_bonus}); otherwise a repaired incorrect trace can match or outrank a correct one"
            )
        for name in ("num_references", "revision_slack_tokens"):
            _check_positive_int(name, getattr(self, name))
        if self.max_revisions is not None:
            _check_positive_int("max_revisions", self.max_revisions)
        if math.isnan(self.max_edit_ratio) or self.max_edit_ratio <= 0:
            raise ValueError(
                f"IBPOSettings.max_edit_ratio must be > 0 (math.inf disables the rewrite guard), got {self.max_edit_ratio!r}"
            )
        if math.isnan(self.min_kept_prefix) or self.min_kept_prefix < 0:
            raise ValueError(f"IBPOSettings.min_kept_prefix must be >= 0, got {self.min_kept_prefix!r}")
        if not (math.isfinite(self.revision_length_factor) and self.revision_length_factor >= 1):
            raise ValueError(
                "IBPOSettings.revision_length_factor must be a finite number >= 1 (a repair restates the whole trace), "
                f"got {self.revision_length_factor!r}"
            )
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"IBPOSettings.aggregate must be one of {AGGREGATES}, got {self.aggregate!r}")
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError(f"IBPOSettings.epsilon must be a finite number > 0, got {self.epsilon!r}")


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"IBPOSettings.{name} must be an integer >= 1, got {value!r}")
