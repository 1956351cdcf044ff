"""Segment values -> segment rewards -> token advantages (RREDCoT §4.2), on top of verl's GRPO advantage.

Outcomes ζ lie on a declared scale [low, high] (``reward_range``, high = correct; (0, 1) by default). Probe values
v̂ ∈ [0, 1] are probabilities of success; on the outcome scale a probe value stands for the expectation
low + (high − low)·v̂. For trace i with outcome ζ_i, GRPO advantage Â_i, L_i response tokens and segments
k = 1..K of n_k tokens (boundary b_k = end of segment k, b_0 = 0, b_K = L_i):

1. values V_0..V_K from the probe values v̂_0..v̂_K (``anchor_values``). Anchored: V_0 = group mean of ζ, V_K = ζ_i,
   so the redistribution sums to what GRPO's baseline already credits.
2. segment rewards R_k = V_k − V_{k−1} (``segment_rewards``); they telescope: Σ_k R_k = V_K − V_0.
3. coefficients σ_k = R_k / Σ_k' R_k' (Σ σ = 1), with K·σ_k kept in [−c, c] (see ``_clip_coefficients``).
4. token advantage A_t = Â_i · f_t, f_t = (1 − λ) + λ · L_i · σ_k / n_k for t in segment k, then |f_t| kept within
   ``max_token_advantage_ratio`` at constant Σ_t f_t = L_i (see ``_bound_token_factors``). Uniform σ_k = n_k / L_i,
   or λ = 0, gives GRPO; for any σ the trace's token mean of A is Â_i.
   ``advantage_form="signed"`` replaces steps 3-4 by A_t = (1 − λ)·Â_i + λ·R_k / s_i, s_i the group's std + ε
   (VinePPO's and SPO's signed step advantage; see ``RedistributionSettings``).

Where the values carry no usable information about the trace (the affine map is undefined, or its gain is out of
bounds) they are interpolated in token position, V(b) = V_0 + (ζ_i − V_0)·b / L_i; then σ_k = n_k / L_i and the trace
gets exactly its GRPO advantage. Traces where the redistribution is undefined keep their GRPO advantage and are
counted (``RedistributionResult.metrics``); all-correct and all-wrong groups can optionally learn from unanchored
value differences instead (``degenerate_groups``). A whole batch keeps GRPO's advantage while its values (pooled with
recent batches') do not order the traces of a prompt by their outcomes (``min_value_concordance``,
``core.concordance``).
Imports only torch; GRPO's advantage is ``outcomes.group_outcome_advantage``, verl's arithmetic bit for bit.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from rredcot_verl.core.concordance import ConcordanceCounts, gate_is_open, value_outcome_concordance
from rredcot_verl.core.outcomes import (
    check_outcome_batch,
    check_reward_range,
    correct_outcomes,
    group_outcome_advantage,
)

__all__ = [
    "RedistributionSettings",
    "RedistributionResult",
    "group_outcome_advantage",
    "anchor_values",
    "segment_rewards",
    "redistribute",
]

VALUE_MAPPINGS = ("affine", "log_affine", "raw")
DEGENERATE_GROUPS = ("grpo", "value_differences")
CREDIT_TRACES = ("all", "incorrect", "correct")
ADVANTAGE_FORMS = ("sigma", "signed")
# Slack for probabilities that should lie in [0, 1] but come out of float sums of probabilities (and for outcomes,
# as a share of the reward range).
_PROBABILITY_SLACK = 1e-4
# Bisection steps for the clipping shifts; float64 intervals shrink to rounding level well before this.
_BISECTION_STEPS = 100
# Segment positions whose mean |R_k| is logged, plus the last segment.
_LOGGED_POSITIONS = 4


@dataclass(frozen=True)
class RedistributionSettings:
    """Settings of the redistribution (the outcome scale is ``algorithm.rredcot.reward_range``, passed separately).

    Attributes:
        mix: λ ∈ [0, 1], weight of the redistributed token advantage against GRPO's uniform one. 0 returns verl's
            GRPO advantage tensor unchanged. Default 1.0.
        anchored: pin V_0 to the group mean outcome and V_K to the trace's outcome (default True). False uses the
            probe values as they are (as expectations on the outcome scale), with V_K = ζ (RUDDER's literal reading).
        value_mapping: how anchored runs treat intermediate probe values (a config's default is ``"auto"``, chosen
            at launch: ``log_affine`` for continuation values, ``affine`` for exit probes). ``"affine"`` (the
            dataclass default) maps v̂ by the
            affine map sending v̂_0 to V_0 and ζ to ζ (on the probability scale), then clamps into the reward range;
            if |ζ − v̂_0| < epsilon that map is undefined, and if its gain is out of bounds (``max_affine_gain``) it
            would amplify probe noise: in both cases the values are interpolated in token position from V_0 to ζ,
            which gives the trace exactly its GRPO advantage. ``"log_affine"`` maps log v̂ affinely, log v̂_0 to V_0
            and log 1 to the top of the range, then clamps (for values that are products over many tokens, such as
            reference continuations; the same interpolation when v̂_0 is 0 or 1). ``"raw"`` keeps them as they are.
            Ignored when ``anchored`` is False.
        clip: c, bound on |K·σ_k| (σ_k = 1/K is a uniform share). Default 5.0. At least 1, or no coefficients in
            [−c/K, c/K] could sum to 1.
        max_token_advantage_ratio: B, bound on |A_t| / |Â| (|f_t| above), applied after ``clip`` by a shift that
            keeps Σ_t A_t = L·Â. The clip alone bounds a segment's share, not its tokens': at L = 25k, K = 40, a
            32-token segment at the clip gets 97.7·Â per token. Default 10.0: a segment half the average length
            (L/2K) at the default clip reaches it exactly, so the bound only binds on segments shorter than that.
            At least 1 (f_t = 1 everywhere, GRPO, must be allowed).
        max_affine_gain: bound on the gain g = (ζ − V_0)/(ζ − v̂_0) of the ``affine`` map. A large gain means the
            probes moved little over the trace compared with the outcome gap, so their noise would decide the
            credit split (probes [.995, .990, .985, .999] on a correct trace, V_0 = .75: g = 50, V = [.75, .5, .25,
            .95]). A negative gain (possible with partial credit: ζ between v̂_0 and V_0) would reverse the order of
            the values. Outside [0, max_affine_gain] the values are interpolated in token position (GRPO for that
            trace), counted in ``affine_gain_traces``. Default 10.0: the probes must move at least a tenth of the
            outcome gap. Used only by anchored ``affine`` runs; must be > 0.
        degenerate_groups: all-correct and all-wrong groups (every outcome equal, Â = 0); a config's default is
            ``"auto"``, chosen at launch (``value_differences`` for ``rredcot`` on the ``group_and_repairs`` bank, as
            README row C, else ``grpo``). ``"grpo"`` (the dataclass default):
            they keep GRPO's zero advantage. ``"value_differences"``: their traces get unanchored value differences
            R_k = v̂_k − v̂_{k−1} (v̂_K = ζ, on the outcome scale), spread as for mixed groups:
            A_t = λ · R_k · (L / n_k) / s, bounded by B·(high − low)/2 / s as above. s = (high − low)/2 with
            ``norm_adv_by_std`` (the std a group split evenly between low and high would have: a mixed group's
            A_t is the same expression with s = its std), 1 without it (Dr.GRPO, where Â is ζ − mean itself). A
            fixed s keeps these magnitudes those of a 50/50 group's traces, whatever the rest of the batch holds.
            Their token sum is L·λ·(ζ − v̂_0)/s, the push of a baseline at the probe's start value. Groups of one
            keep GRPO's advantage either way.
        min_value_concordance: the value gate. The redistribution applies only while the concordance of the values
            with the outcomes (``core.concordance``: how often, within a group, the trace with the better outcome
            has the higher value at the same share of its response; 0.5 for values unrelated to the outcome),
            pooled over the last ``concordance_window`` batches, is at least this; otherwise every trace of the
            batch keeps its GRPO advantage, counted in ``fallback/low_value_concordance``. It needs no ground truth
            and guards against value sources that do not work on the model at hand (how the default was set:
            docs/choices.md, "Value gate"). Default 0.6; 0 never closes the gate.
        concordance_window: batches whose comparisons the gate pools, the current one included (the trainer keeps
            the previous ones and saves them with its checkpoints). One 8 × 4 batch gives about 130 comparisons
            and a concordance with a standard deviation of about 0.06; ten pool them to about 0.02. Default 10.
        credit_traces: which traces the values place credit on: ``"all"`` (default, the published method),
            ``"incorrect"`` (traces whose outcome falls short of the top of ``reward_range``: the values decide where
            the blame of a failure lands, while correct traces keep GRPO's uniform row, as IBPO leaves them) or
            ``"correct"`` (the converse, for the ablation). A trace outside the chosen kind keeps GRPO's row bit for
            bit, counted in ``uncredited_traces`` (a choice, not a fallback); its values still count in the value
            gate. Why it exists: docs/choices.md, "Credit on wrong traces only".
        advantage_form: how segment rewards become token advantages. ``"sigma"`` (default, the published method):
            each trace keeps its GRPO advantage as its token mean and the values only decide where it lands,
            A_t = Â·f_t with f_t = (1 − λ) + λ·L·σ_k / n_k (steps 3-4 of the module docstring). ``"signed"``: each
            token of segment k gets the segment's own value difference, A_t = (1 − λ)·Â + λ·R_k / s, with s the
            group's std + ε as in Â (1 without ``norm_adv_by_std``), as VinePPO and SPO credit steps: a segment
            that raised the value is pushed up and one that lowered it is pushed down, on correct and wrong traces
            alike, without the division by Σ R (so no ``clip`` or token bound is needed: |R_k| is at most the
            reward range). Anchored, Σ_k R_k / s = Â, so a trace whose values only move in its last segment gets
            GRPO's advantage on that segment and 0 elsewhere. All-equal groups follow ``degenerate_groups`` and
            then get R_k / s per token (s as there). Why it exists: docs/choices.md, "Signed segment advantages".
        epsilon: added to the group std as in verl, and the threshold below which an outcome gap counts as zero
            (as a share of the reward range). Default 1e-6.
        norm_adv_by_std: divide the GRPO advantage by the group std (GRPO) or not (Dr.GRPO). Default True.
    """

    mix: float = 1.0
    anchored: bool = True
    value_mapping: str = "affine"
    clip: float = 5.0
    max_token_advantage_ratio: float = 10.0
    max_affine_gain: float = 10.0
    degenerate_groups: str = "grpo"
    min_value_concordance: float = 0.6
    concordance_window: int = 10
    credit_traces: str = "all"
    advantage_form: str = "sigma"
    epsilon: float = 1e-6
    norm_adv_by_std: bool = True

    def __post_init__(self):
        if not 0.0 <= self.mix <= 1.0:
            raise ValueError(f"mix (lambda) must lie in [0, 1], got {self.mix}")
        if self.value_mapping not in VALUE_MAPPINGS:
            raise ValueError(f"value_mapping must be one of {VALUE_MAPPINGS}, got {self.value_mapping!r}")
        if not self.clip >= 1.0:
            raise ValueError(
                f"clip must be >= 1 (K coefficients bounded by clip/K must be able to sum to 1), got {self.clip}"
            )
        if not self.max_token_advantage_ratio >= 1.0:
            raise ValueError(
                "max_token_advantage_ratio must be >= 1 (GRPO's uniform advantage has ratio 1), "
                f"got {self.max_token_advantage_ratio}"
            )
        if not self.max_affine_gain > 0.0:
            raise ValueError(f"max_affine_gain must be > 0, got {self.max_affine_gain}")
        if self.degenerate_groups not in DEGENERATE_GROUPS:
            raise ValueError(f"degenerate_groups must be one of {DEGENERATE_GROUPS}, got {self.degenerate_groups!r}")
        if self.credit_traces not in CREDIT_TRACES:
            raise ValueError(f"credit_traces must be one of {CREDIT_TRACES}, got {self.credit_traces!r}")
        if self.advantage_form not in ADVANTAGE_FORMS:
            raise ValueError(f"advantage_form must be one of {ADVANTAGE_FORMS}, got {self.advantage_form!r}")
        if not 0.0 <= self.min_value_concordance <= 1.0:
            raise ValueError(f"min_value_concordance must lie in [0, 1], got {self.min_value_concordance}")
        if isinstance(self.concordance_window, bool) or not (
            isinstance(self.concordance_window, int) and self.concordance_window >= 1
        ):
            raise ValueError(f"concordance_window must be an integer >= 1, got {self.concordance_window!r}")
        if not self.epsilon > 0.0:
            raise ValueError(f"epsilon must be > 0, got {self.epsilon}")
        for name in ("anchored", "norm_adv_by_std"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


@dataclass
class RedistributionResult:
    """Output of ``redistribute``.

    Attributes:
        advantages: (bs, T) token advantages, zero on padding.
        returns: (bs, T) the same tensor, as verl's GRPO returns it.
        values: (bs, Kmax + 1) V_0..V_K per trace on the outcome scale, NaN beyond K and on traces that fell back.
        segment_rewards: (bs, Kmax) R_1..R_K per trace, NaN beyond K and on traces that fell back.
        fallback: (bs,) bool, the redistribution was not applicable and the trace kept its GRPO advantage.
        interpolated: (bs,) bool, redistributed traces whose values were interpolated in token position (the map
            was undefined or its gain out of bounds): they too got exactly their GRPO advantage.
        metrics: scalar diagnostics, see ``redistribute``.
        concordance: this batch's value-outcome comparisons, for the caller's ``ConcordanceWindow``.
    """

    advantages: torch.Tensor
    returns: torch.Tensor
    values: torch.Tensor
    segment_rewards: torch.Tensor
    fallback: torch.Tensor
    interpolated: torch.Tensor
    metrics: dict[str, float]
    concordance: ConcordanceCounts


def anchor_values(
    raw_values: torch.Tensor,
    outcome: float,
    group_mean: float,
    cfg: RedistributionSettings,
    segment_ends: torch.Tensor | None = None,
    reward_range: tuple[float, float] = (0.0, 1.0),
) -> torch.Tensor:
    """Values V_0..V_K of one trace from its probe values (see ``RedistributionSettings``).

    Args:
        raw_values: (K+1,) probe values v̂_0..v̂_K, probabilities in [0, 1]. v̂_K is replaced by the outcome and
            not read.
        outcome: ζ in ``reward_range``, the trace's terminal outcome.
        group_mean: mean outcome of the trace's group, V_0 when anchored.
        cfg: settings (``anchored``, ``value_mapping``, ``max_affine_gain``, ``epsilon``).
        segment_ends: (K,) int exclusive segment ends (the last is the response length), where the token-position
            interpolation puts the values; None treats the segments as equally long.
        reward_range: (low, high), the outcome scale; v̂ stands for low + (high − low)·v̂.

    Returns:
        (K+1,) values on the outcome scale, V_K = ζ; V_0 = group_mean when anchored, the expectation of v̂_0
        otherwise.
    """
    low, high = check_reward_range(reward_range)
    if raw_values.dim() != 1 or raw_values.numel() < 2 or not raw_values.is_floating_point():
        raise ValueError(
            f"raw_values must be a 1-D float tensor of K+1 >= 2 values, got shape {tuple(raw_values.shape)}"
        )
    num_segments = raw_values.numel() - 1
    used = raw_values[:-1].double()
    if not torch.isfinite(used).all():
        raise ValueError(f"raw_values contain NaN or inf: {raw_values.tolist()}")
    _check_probabilities("raw_values", used)
    ends = torch.tensor([float(outcome), float(group_mean)], dtype=torch.float64)
    if not ((ends >= low) & (ends <= high)).all():
        raise ValueError(f"outcome and group_mean must lie in reward_range {reward_range}; got {ends.tolist()}")
    if segment_ends is None:
        fraction = torch.arange(num_segments + 1, dtype=torch.float64) / num_segments
    else:
        bounds = torch.cat([torch.zeros(1, dtype=torch.int64), segment_ends.long()])
        if bounds.shape != (num_segments + 1,) or not (bounds[1:] > bounds[:-1]).all():
            raise ValueError(
                f"segment_ends must hold K = {num_segments} positive, strictly increasing ends, "
                f"got {segment_ends.tolist()}"
            )
        fraction = bounds.double() / float(bounds[-1])
    width = high - low
    values, _, _ = _map_values(
        raw_values.double().unsqueeze(0),
        fraction.unsqueeze(0),
        torch.tensor([(float(outcome) - low) / width], dtype=torch.float64),
        torch.tensor([(float(group_mean) - low) / width], dtype=torch.float64),
        cfg,
    )
    values = low + width * values[0]
    values[-1] = float(outcome)  # exact endpoints: the rewards telescope to ζ − V_0 without a rescaling error
    if cfg.anchored:
        values[0] = float(group_mean)
    return values.to(raw_values.dtype)


def segment_rewards(values: torch.Tensor) -> torch.Tensor:
    """R_k = V_k − V_{k−1}.

    Args:
        values: (..., K+1) values; NaN padding stays NaN.

    Returns:
        (..., K) segment rewards.
    """
    return values[..., 1:] - values[..., :-1]


def redistribute(
    scores: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    segment_ends: torch.Tensor,
    raw_values: torch.Tensor,
    cfg: RedistributionSettings,
    reward_range: tuple[float, float] = (0.0, 1.0),
    prior_concordance: ConcordanceCounts = ConcordanceCounts(),
    shaped_scores: torch.Tensor | None = None,
) -> RedistributionResult:
    """Token advantages from outcome scores and per-segment probe values.

    The steps (``redistribution_reference.redistribute_trace`` does the same for one trace in plain Python), each a
    function of the batch's per-trace quantities (``_TraceQuantities``):
    1. ``_degenerate_groups``: all-equal groups, and whether they learn from value differences;
    2. values V_0..V_K on the outcome scale, ``_anchored_values`` for mixed groups and ``_difference_values`` for
       all-equal ones that learn from them, then ``segment_rewards`` R_k;
    3. ``_undefined``: the traces where the redistribution is undefined, each with its reason;
    4. ``_anchored_redistribution`` of mixed groups: σ_k = R_k / Σ R with K·σ_k within [−c, c]
       (``_coefficients``), f_k = (1 − λ) + λ·L·σ_k / n_k within the token bound B, A_k = Â·f_k;
    5. ``_value_differences`` of all-equal groups: f_k = λ·(R_k / s)·L / n_k within B, A_k = unit·f_k;
    6. ``_token_rows``: each token's advantage, its segment's A_k;
    7. shaped scores: a trace whose values sum against its shaped advantage keeps GRPO's row;
    8. ``_value_gate``, then the final choice: the redistributed row where no reason holds and the trace is of the
       kind ``credit_traces`` names, GRPO's elsewhere.

    Args:
        scores: (bs,) float outcome ζ per trace, on ``reward_range``.
        response_mask: (bs, T) 0/1, 1 on the model's tokens from column 0; 0 on right padding and, in multi-turn
            responses (verl's tool agent loop), on the tool output and template tokens between turns. Those holes
            get advantage 0 and count in no segment: L and n_k below count the model's tokens only, so the
            per-trace telescoping Σ_k R_k = V_K − V_0 holds whatever the number of turns.
        index: (bs,) hashables, group (prompt) id of each trace.
        segment_ends: (bs, Kmax) int64 exclusive segment ends in positions of the full response, strictly
            increasing, padded with -1 at the end; every segment starts on a 1 of ``response_mask``. A trace has
            segment data when its last end is one past its last 1.
        raw_values: (bs, Kmax + 1) float probe values v̂_0..v̂_K in [0, 1] (column K is replaced by ζ and not read),
            NaN-padded.
        cfg: settings.
        reward_range: (low, high) with low < high, the scale of the outcomes (high = correct). Default (0, 1).
        prior_concordance: the value-outcome comparisons of the previous ``cfg.concordance_window − 1`` batches
            (``ConcordanceWindow.pooled``); the gate decides on them plus this batch's.
        shaped_scores: (bs,) outcomes after reward shaping (IBPO's R', on ``reward_range``), or None. When given,
            GRPO's advantage, the anchor V_0 and the degenerate-group test come from them, while the values still
            end at the verified outcome V_K = ζ (a state's value is the chance of a correct answer from it; the
            shaping bonus judges the whole trace): the trace's token mean stays its shaped advantage Â' and the
            values decide where it lands. A trace whose values sum against Â' (Σ R = ζ − V_0 of the other sign: a
            repaired failure above its group's mean) keeps GRPO's row, counted under
            ``fallback/against_shaped_advantage``.

    Returns:
        ``RedistributionResult``. With ``cfg.mix == 0`` its advantages are verl's GRPO tensor unchanged; the
        diagnostics are computed all the same, so a λ = 0 run logs what the redistribution would have done.

    A trace keeps its GRPO advantage (``fallback``) when its response is empty, its group has one trace, its outcome
    lies outside ``reward_range`` (a reward function that breaks its declared scale mid-run must not stop training),
    its outcome equals the anchor (|Σ R| < epsilon; this includes all-correct and all-wrong groups, where Â = 0,
    unless ``degenerate_groups="value_differences"``), it has no segment data, its values or result hold NaN/inf,
    or the value gate is closed for the batch (``min_value_concordance``; closed too when neither this batch nor the
    window has a comparison).
    Metrics (floats): ``redistributed_frac`` (traces that got the redistributed row); ``uncredited_traces``
    (traces outside ``credit_traces`` that kept GRPO's row by that choice); ``fallback/{empty,singleton_group,outside_reward_range,zero_return,
    missing_segments,nonfinite,against_shaped_advantage,low_value_concordance}`` (trace counts, each trace counted
    under its first reason in that order, except that a non-finite result counts under ``nonfinite`` only when no
    other reason holds; ``against_shaped_advantage`` only with ``shaped_scores``);
    ``value_gate_open`` (1 or 0), ``value_concordance_comparisons`` (this batch's) and, when there are comparisons,
    ``value_concordance`` (this batch) and ``value_concordance_pooled`` (the window's);
    ``degenerate_groups`` (groups of two or more where every outcome equals the mean);
    ``degenerate_groups_with_signal`` (of those, groups where some trace got a nonzero advantage from value
    differences); ``affine_flat_traces`` / ``affine_gain_traces`` (redistributed traces whose values were
    interpolated in token position because ζ ≈ v̂_0 / the affine gain was out of bounds); over traces with
    redistributed advantages, when there are any: ``token_bound_trace_frac`` (share where
    ``max_token_advantage_ratio`` bound); over redistributed traces of mixed groups, when there are any:
    ``segments_per_trace``, ``negative_coef_frac`` (share of σ_k < 0), ``clipped_trace_frac`` and
    ``abs_segment_reward/pos_{k}`` (mean |R_{k+1}|, for k < 4 where some trace has that segment) and
    ``abs_segment_reward/last``.

    Raises:
        ValueError: on shape or dtype mismatches, masks that are not 0/1 or start with a 0, segment ends that are not
            strictly increasing and positive, that exceed the response, start a segment on a 0 of the mask or have
            padding before data, finite
            probe values outside [0, 1], and a reward range that is not two finite numbers low < high.
    """
    low, high = check_reward_range(reward_range)
    lengths, num_segments, policy_ends = _check_batch(scores, response_mask, index, segment_ends, raw_values)
    baseline = scores if shaped_scores is None else _check_shaped(shaped_scores, scores)
    advantage, group_mean = group_outcome_advantage(baseline, index, cfg.epsilon, cfg.norm_adv_by_std)
    traces = _TraceQuantities(
        index=index, scores=scores.double(), baseline=baseline.double(), group_mean=group_mean.double(),
        advantage=advantage, grpo=advantage.unsqueeze(-1) * response_mask, lengths=lengths,
        num_segments=num_segments, segment_ends=policy_ends, raw_values=raw_values, low=low, high=high,
        in_response=response_mask != 0,
    )  # fmt: skip

    # 1. all-equal groups (of the shaped scores when given: their Â' is 0)
    traces.degenerate, traces.differences = _degenerate_groups(traces, cfg)
    # 2. values and segment rewards
    values, traces.flat, traces.steep = _anchored_values(traces, cfg)
    values = torch.where(traces.differences.unsqueeze(1), _difference_values(traces), values)
    traces.rewards = segment_rewards(values)
    traces.total = traces.rewards.where(traces.in_segment, 0.0).sum(1)
    # 3. where the redistribution is undefined
    reasons = _undefined(traces, cfg)
    defined = ~_first_reasons(reasons)[0]
    # 4. anchored redistribution (mixed groups)
    mixed = defined & ~traces.differences
    traces.sigma, traces.clipped = _coefficients(traces, mixed, cfg)
    if cfg.advantage_form == "signed":
        anchored, anchored_bounded = _signed_differences(traces, mixed, cfg), torch.zeros_like(mixed)
    else:
        anchored, anchored_bounded = _anchored_redistribution(traces, mixed, cfg)
    # 5. value differences (all-equal groups)
    differences, differences_bounded = _value_differences(traces, defined & traces.differences, cfg)
    traces.bounded = anchored_bounded | differences_bounded
    # 6. token rows
    rows = _token_rows(traces, torch.where(traces.differences.unsqueeze(1), differences, anchored))
    # 7. shaped scores
    if shaped_scores is not None:  # not undefined: these values are fine in themselves, the gate compares them
        against = (traces.total * traces.advantage.double() < 0) & ~traces.differences
        reasons.append(("against_shaped_advantage", against))
    # 8. the value gate and the final choice
    gate_open, concordance, gate_metrics = _value_gate(traces, defined, prior_concordance, cfg)
    reasons.append(("low_value_concordance", torch.full(lengths.shape, not gate_open)))
    reasons.append(("nonfinite", ~(torch.isfinite(rows) | ~traces.in_response).all(1)))  # rows that overflowed
    fallback, counts = _first_reasons(reasons)
    interpolated = traces.interpolated & ~fallback  # f_t = 1 is GRPO's row: they keep it, bit for bit
    uncredited = ~fallback & ~_credited(traces, cfg)  # outside credit_traces: GRPO's row by choice, not a fallback
    write = (~fallback & ~interpolated & ~uncredited).unsqueeze(1) & traces.in_response  # padding keeps GRPO's Â · 0
    advantages = torch.where(write, rows, traces.grpo) if cfg.mix > 0 else traces.grpo  # λ = 0: verl's tensor

    kept = ~fallback.unsqueeze(1)
    values = values.where(kept, float("nan")).to(raw_values.dtype)
    rewards = traces.rewards.where(kept, float("nan")).to(raw_values.dtype)
    metrics = {**_metrics(traces, rows, fallback | uncredited, counts), **gate_metrics,
               "uncredited_traces": float(uncredited.sum())}
    return RedistributionResult(advantages, advantages, values, rewards, fallback, interpolated, metrics, concordance)


@dataclass
class _TraceQuantities:
    """The per-trace quantities of one batch: bs traces of T tokens, M = Kmax segment columns. Outcomes are on the
    outcome scale [low, high]; ``probability`` maps one onto the probes' scale [0, 1], where the values are mapped.

    Attributes:
        index: (bs,) group ids.
        scores: (bs,) float64 verified outcomes ζ, where the values end.
        baseline: (bs,) float64 the outcomes GRPO normalises: ζ, or the shaped scores.
        group_mean: (bs,) float64 mean of ``baseline`` over the trace's group: V_0 when anchored.
        advantage: (bs,) GRPO's Â in the scores' dtype; grpo: (bs, T) verl's GRPO token advantages Â · mask.
        lengths, num_segments: (bs,) int64 L and K; segment_ends: (bs, M) int64 b_1..b_K, -1 padded.
        raw_values: (bs, M+1) probe values v̂_0..v̂_K, NaN padded.
        in_response: (bs, T) bool, the policy's tokens (``response_mask``).
        L, b_k and n_k count the policy's tokens only: a multi-turn response's tool output and template tokens are
        left out, so every formula reads as on a response without them (``_token_rows`` puts them back).
        Set by the steps of ``redistribute``:
        degenerate, differences: (bs,) bool, traces of all-equal groups and those of them that learn from value
            differences (step 1).
        rewards: (bs, M) float64 R_k, NaN beyond K; total: (bs,) Σ_k R_k; flat, steep: (bs,) bool, traces of mixed
            groups whose values were interpolated in token position (step 2).
        sigma: (bs, M) float64 σ_k; clipped, bounded: (bs,) bool, traces whose σ_k / f_k were projected onto their
            bounds (steps 4 and 5).
    """

    index: Sequence[Hashable]
    scores: torch.Tensor
    baseline: torch.Tensor
    group_mean: torch.Tensor
    advantage: torch.Tensor
    grpo: torch.Tensor
    lengths: torch.Tensor
    num_segments: torch.Tensor
    segment_ends: torch.Tensor
    raw_values: torch.Tensor
    low: float
    high: float
    in_response: torch.Tensor
    # Step 1.
    degenerate: torch.Tensor = field(init=False)
    differences: torch.Tensor = field(init=False)
    # Step 2.
    rewards: torch.Tensor = field(init=False)
    total: torch.Tensor = field(init=False)
    flat: torch.Tensor = field(init=False)
    steep: torch.Tensor = field(init=False)
    # Steps 4 and 5.
    sigma: torch.Tensor = field(init=False)
    clipped: torch.Tensor = field(init=False)
    bounded: torch.Tensor = field(init=False)

    @cached_property
    def groups(self) -> dict[Hashable, list[int]]:
        """The rows of each group id, in batch order."""
        groups = defaultdict(list)
        for i, group in enumerate(self.index):
            groups[group].append(i)
        return groups

    @cached_property
    def in_segment(self) -> torch.Tensor:
        """(bs, M) bool, k < K."""
        return torch.arange(self.segment_ends.shape[1]) < self.num_segments.unsqueeze(1)

    @cached_property
    def tokens(self) -> torch.Tensor:
        """(bs, M) int64 n_k, meaningless beyond K."""
        first_starts = torch.zeros(self.segment_ends.shape[0], 1, dtype=torch.int64)
        return self.segment_ends - torch.cat([first_starts, self.segment_ends[:, :-1]], dim=1)

    @property
    def width(self) -> float:
        return self.high - self.low

    @property
    def interpolated(self) -> torch.Tensor:
        """(bs,) bool, values interpolated in token position (``flat`` or ``steep``): σ_k = n_k / L, GRPO's row."""
        return self.flat | self.steep

    def at_mean(self, epsilon: float) -> torch.Tensor:
        """(bs,) bool, the baseline at its group's mean (within ``epsilon`` on the probability scale)."""
        return (self.probability(self.baseline) - self.probability(self.group_mean)).abs() < epsilon

    def probability(self, outcomes: torch.Tensor) -> torch.Tensor:
        """Outcomes on the probes' scale: 0 at ``low``, 1 at ``high``."""
        return (outcomes - self.low) / self.width

    def outcome(self, probabilities: torch.Tensor) -> torch.Tensor:
        """Probabilities as expectations on the outcome scale."""
        return self.low + self.width * probabilities

    def ending_at_outcome(self, values: torch.Tensor) -> torch.Tensor:
        """(bs, M+1) values with V_K = ζ exactly, so that Σ_k R_k = ζ − V_0 holds up to the summation's own rounding
        on any scale, and NaN beyond K."""
        position = torch.arange(values.shape[1])
        k = self.num_segments.unsqueeze(1)
        return torch.where(position == k, self.scores.unsqueeze(1), values).where(position <= k, float("nan"))


def _degenerate_groups(traces: _TraceQuantities, cfg: RedistributionSettings) -> tuple[torch.Tensor, ...]:
    """Step 1. Which groups are all-equal (every outcome at the mean: Â = 0), and which of those learn from value
    differences (``degenerate_groups="value_differences"``).

    Returns:
        degenerate (bs,), differences (bs,), both bool.
    """
    at_mean = traces.at_mean(cfg.epsilon)
    groups = traces.groups
    degenerate = torch.tensor(
        [len(groups[group]) > 1 and bool(at_mean[groups[group]].all()) for group in traces.index], dtype=torch.bool
    )
    return degenerate, degenerate & (cfg.degenerate_groups == "value_differences")


def _anchored_values(traces: _TraceQuantities, cfg: RedistributionSettings) -> tuple[torch.Tensor, ...]:
    """Step 2, mixed groups. Values mapped from the probe values (``_map_values``) with the exact ends V_K = ζ and,
    anchored, V_0 = the group mean.

    Returns:
        values (bs, M+1) float64, NaN beyond K; flat, steep (bs,) bool: traces of mixed groups interpolated in token
        position because the map is undefined / its gain is out of bounds.
    """
    bsz = traces.segment_ends.shape[0]
    boundaries = torch.cat([torch.zeros(bsz, 1, dtype=torch.int64), traces.segment_ends], dim=1)  # b_0 = 0, b_k
    fraction = boundaries.double() / traces.lengths.clamp(min=1).double().unsqueeze(1)
    outcome, start = traces.probability(traces.scores), traces.probability(traces.group_mean)
    values, flat, steep = _map_values(traces.raw_values.double(), fraction, outcome, start, cfg)
    values = traces.ending_at_outcome(traces.outcome(values))
    if cfg.anchored:
        values[:, 0] = traces.group_mean
    return values, flat & ~traces.differences, steep & ~traces.differences


def _difference_values(traces: _TraceQuantities) -> torch.Tensor:
    """Step 2, all-equal groups that learn from value differences: the probe values as they are, as expectations on
    the outcome scale, ending at V_K = ζ. (bs, M+1) float64, NaN beyond K."""
    return traces.ending_at_outcome(traces.outcome(traces.raw_values.double()))


def _undefined(traces: _TraceQuantities, cfg: RedistributionSettings) -> list[tuple[str, torch.Tensor]]:
    """Step 3. The traces where the redistribution is undefined: (reason, (bs,) bool) pairs, in the order in which
    ``fallback/{reason}`` counts each trace under its first reason."""
    bsz, max_segments = traces.segment_ends.shape
    outcome = traces.probability(traces.scores)
    in_range = (outcome >= -_PROBABILITY_SLACK) & (outcome <= 1.0 + _PROBABILITY_SLACK)  # False for NaN
    last_end = torch.cat([torch.full((bsz, 1), -1), traces.segment_ends], dim=1).amax(1)  # ends increase; -1 if none
    has_segments = (traces.num_segments > 0) & (last_end == traces.lengths)
    read = torch.arange(max_segments + 1) < traces.num_segments.unsqueeze(1)  # entries v̂_0..v̂_{K-1}
    finite_raw = ~(read & ~torch.isfinite(traces.raw_values)).any(1)
    _check_probabilities("raw_values", traces.raw_values.double()[read & torch.isfinite(traces.raw_values)])
    singleton = torch.tensor([len(traces.groups[group]) == 1 for group in traces.index], dtype=torch.bool)
    # The outcome equals the anchor: at the group mean, or values that sum to nothing (unanchored: ζ == v̂_0).
    empty_sum = has_segments & finite_raw & (traces.total.abs() < cfg.epsilon * traces.width)
    return [
        ("empty", traces.lengths == 0),
        ("singleton_group", singleton),
        ("outside_reward_range", ~in_range),
        ("zero_return", (traces.at_mean(cfg.epsilon) | empty_sum) & ~traces.differences),
        ("missing_segments", ~has_segments),
        ("nonfinite", ~finite_raw),
    ]


def _coefficients(
    traces: _TraceQuantities, live: torch.Tensor, cfg: RedistributionSettings
) -> tuple[torch.Tensor, ...]:
    """Step 4. σ_k = R_k / Σ R, with K·σ_k within [−c, c] (``_clip_coefficients``) on the ``live`` (bs,) traces whose
    values were not interpolated. Returns sigma (bs, M) float64 and clipped (bs,) bool."""
    active = traces.in_segment & (live & ~traces.interpolated).unsqueeze(1)
    return _clip_coefficients(traces.rewards / traces.total.unsqueeze(1), active, traces.num_segments, cfg.clip)


def _anchored_redistribution(traces: _TraceQuantities, live: torch.Tensor, cfg: RedistributionSettings):
    """Step 4. Each segment's token advantage A_k = Â·f_k, f_k = (1 − λ) + λ·L·σ_k / n_k (f = 1 where the values
    were interpolated), |f_k| kept within B at Σ_t f_t = L (``_bound_token_factors``), on the ``live`` (bs,) traces.

    Returns:
        advantages (bs, M) float64; bounded (bs,) bool.
    """
    lengths = traces.lengths.double()
    factor = (1.0 - cfg.mix) + cfg.mix * lengths.unsqueeze(1) * traces.sigma / traces.tokens
    factor = factor.where(~traces.interpolated.unsqueeze(1), 1.0)
    active = traces.in_segment & live.unsqueeze(1)
    factor, bounded = _bound_token_factors(factor, traces.tokens, active, lengths, cfg.max_token_advantage_ratio)
    return traces.advantage.double().unsqueeze(1) * factor, bounded


def _signed_differences(traces: _TraceQuantities, live: torch.Tensor, cfg: RedistributionSettings) -> torch.Tensor:
    """Step 4, ``advantage_form="signed"``. Each segment's token advantage A_k = (1 − λ)·Â + λ·R_k / s, s = Â's own
    scale (ζ − V_0) / Â: the group std + ε, or 1 without ``norm_adv_by_std`` (traces whose values were interpolated
    keep GRPO's row, as in the sigma form). (bs, M) float64 on the ``live`` traces (mixed groups: Â ≠ 0 there)."""
    gap = traces.baseline - traces.group_mean
    scale = (gap / traces.advantage.double()).where(live & (traces.advantage != 0), 1.0)
    signed = (1.0 - cfg.mix) * traces.advantage.double().unsqueeze(1) + cfg.mix * traces.rewards / scale.unsqueeze(1)
    return signed.where(traces.in_segment & live.unsqueeze(1), 0.0)


def _value_differences(traces: _TraceQuantities, live: torch.Tensor, cfg: RedistributionSettings):
    """Step 5. Each segment's token advantage A_k = unit·f_k, f_k = λ·(R_k / s)·L / n_k, |f_k| kept within B at
    Σ_t f_t = λ·L·Σ_k R_k / s, on the ``live`` (bs,) traces; f_k = λ·R_k / s, unbounded, with
    ``advantage_form="signed"``. s is half the reward range; the unit is 1 with
    ``norm_adv_by_std`` and s without it, which makes A_t the advantage of a trace of a 50/50 group (see
    ``degenerate_groups``) and the bound B·unit that of mixed groups.

    Returns:
        advantages (bs, M) float64; bounded (bs,) bool.
    """
    lengths = traces.lengths.double()
    half_range = traces.width / 2.0
    unit = 1.0 if cfg.norm_adv_by_std else half_range
    active = traces.in_segment & live.unsqueeze(1)
    if cfg.advantage_form == "signed":  # R_k / s on each token of segment k: bounded by the range itself
        return unit * (cfg.mix * traces.rewards / half_range).where(active, 0.0), torch.zeros_like(live)
    factor = cfg.mix * (traces.rewards / half_range) * (lengths.unsqueeze(1) / traces.tokens)
    target = cfg.mix * lengths * traces.total / half_range
    factor, bounded = _bound_token_factors(factor, traces.tokens, active, target, cfg.max_token_advantage_ratio)
    return unit * factor, bounded


def _token_rows(traces: _TraceQuantities, advantages: torch.Tensor) -> torch.Tensor:
    """Step 6. (bs, T) in GRPO's dtype: each token's advantage is its segment's (``advantages``, (bs, M)); read only
    on the policy's tokens (``in_response``)."""
    bsz, max_segments = traces.segment_ends.shape
    if max_segments == 0:  # no trace has segment data
        return torch.zeros_like(traces.grpo)
    horizon = traces.grpo.shape[1]
    # Each policy token's place among the policy's tokens (t itself on a right-padded row).
    policy_position = (traces.in_response.long().cumsum(1) - 1).clamp(min=0).contiguous()
    # Segment of each token: the number of ends at or before it (padding ends sort last).
    sorted_ends = traces.segment_ends.where(traces.segment_ends >= 0, horizon + 1).contiguous()
    token_segment = torch.searchsorted(sorted_ends, policy_position, right=True).clamp(max=max_segments - 1)
    return advantages.gather(1, token_segment).to(traces.grpo.dtype)


def _credited(traces: _TraceQuantities, cfg: RedistributionSettings) -> torch.Tensor:
    """(bs,) bool, the traces of the kind ``credit_traces`` names (correct: the outcome reaches the top of the
    reward range, as ``outcomes.correct_outcomes`` judges it)."""
    if cfg.credit_traces == "all":
        return torch.ones_like(traces.lengths, dtype=torch.bool)
    correct = correct_outcomes(traces.scores, (traces.low, traces.high))
    return correct if cfg.credit_traces == "correct" else ~correct


def _value_gate(
    traces: _TraceQuantities, defined: torch.Tensor, prior: ConcordanceCounts, cfg: RedistributionSettings
):
    """Step 8. The value gate: open while the concordance of the ``defined`` (bs,) traces' values with their
    outcomes, pooled with the ``prior`` window's, reaches ``min_value_concordance``.

    Returns:
        whether it is open, this batch's ``ConcordanceCounts`` and the gate's metrics.
    """
    concordance = value_outcome_concordance(
        traces.raw_values, traces.segment_ends, traces.lengths, traces.scores, traces.index, defined,
        tie=cfg.epsilon * traces.width,
    )  # fmt: skip
    pooled = prior + concordance
    gate_open = gate_is_open(pooled, cfg.min_value_concordance)
    metrics = {"value_gate_open": float(gate_open), "value_concordance_comparisons": float(concordance.comparisons)}
    if concordance.concordance is not None:
        metrics["value_concordance"] = concordance.concordance
    if pooled.concordance is not None:
        metrics["value_concordance_pooled"] = pooled.concordance
    return gate_open, concordance, metrics


def _check_probabilities(name: str, values: torch.Tensor):
    outside = (values < -_PROBABILITY_SLACK) | (values > 1.0 + _PROBABILITY_SLACK)
    if outside.any():
        raise ValueError(f"{name} must be probabilities in [0, 1]; found {values[outside][:5].tolist()}")


def _check_shaped(shaped_scores: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    if shaped_scores.shape != scores.shape or not shaped_scores.is_floating_point():
        raise ValueError(f"shaped_scores must be float of shape {tuple(scores.shape)}, got {tuple(shaped_scores.shape)}")
    if not torch.isfinite(shaped_scores).all():
        raise ValueError(f"shaped_scores must be finite, got {shaped_scores.tolist()}")
    return shaped_scores.to(scores.dtype)


def _check_batch(scores, response_mask, index, segment_ends, raw_values) -> tuple[torch.Tensor, ...]:
    """Validate a batch; returns the policy tokens per response (bs,), the segment counts (bs,) and the segment ends
    counted in policy tokens (bs, Kmax), -1 padded, all int64."""
    bsz = check_outcome_batch(scores, response_mask, index)
    if segment_ends.dim() != 2 or segment_ends.shape[0] != bsz or segment_ends.dtype != torch.int64:
        raise ValueError(
            f"segment_ends must be int64 of shape (bs={bsz}, Kmax), "
            f"got {tuple(segment_ends.shape)} {segment_ends.dtype}"
        )
    expected = (bsz, segment_ends.shape[1] + 1)
    if tuple(raw_values.shape) != expected or not raw_values.is_floating_point():
        raise ValueError(
            f"raw_values must be float of shape (bs, Kmax + 1) = {expected}, got {tuple(raw_values.shape)} "
            f"{raw_values.dtype}"
        )

    trained = response_mask != 0
    if not ((response_mask == 0) | (response_mask == 1)).all():
        raise ValueError("response_mask must hold only 0 and 1")
    lengths = trained.sum(1)
    late_start = (lengths > 0) & ~trained[:, :1].any(1)
    if late_start.any():
        raise ValueError(
            "response_mask must be right-padded, holes between turns allowed (the model's tokens from column 0); "
            f"row {_first_row(late_start.unsqueeze(1))} starts with a 0"
        )
    no_token = torch.zeros(bsz, 1, dtype=torch.int64)
    # Policy tokens before each position: position b of the full response is position rank[b] of the policy's
    # tokens alone, where the redistribution is computed.
    rank = torch.cat([no_token, trained.long().cumsum(1)], dim=1)
    # One past the last policy token: where the last segment ends.
    extent = torch.cat([no_token, torch.where(trained, torch.arange(1, trained.shape[1] + 1), 0)], dim=1).amax(1)

    present = segment_ends != -1
    if (segment_ends < -1).any():
        raise ValueError(f"segment_ends: use -1 for padding; row {_first_row(segment_ends < -1)} has other negatives")
    data_after_padding = present[:, 1:] & ~present[:, :-1]
    if data_after_padding.any():
        raise ValueError(f"segment_ends: -1 padding must come after all ends; row {_first_row(data_after_padding)}")
    previous_end = torch.cat([torch.zeros(bsz, 1, dtype=torch.int64), segment_ends[:, :-1]], dim=1)
    not_increasing = present & (segment_ends <= previous_end)
    if not_increasing.any():
        row = _first_row(not_increasing)
        raise ValueError(
            f"segment_ends must be positive and strictly increasing; row {row}: {segment_ends[row].tolist()}"
        )
    beyond = present & (segment_ends > extent.unsqueeze(1))
    if beyond.any():
        row = _first_row(beyond)
        raise ValueError(
            f"segment end beyond response length in row {row}: ends {segment_ends[row].tolist()}, "
            f"length {int(extent[row])}"
        )
    # A segment starts on a policy token (b_0 = 0 is one, checked above), so it holds at least one.
    inner_end = present & torch.cat([present[:, 1:], torch.zeros(bsz, 1, dtype=torch.bool)], dim=1)
    trained_or_end = torch.cat([trained, torch.zeros(bsz, 1, dtype=torch.bool)], dim=1)  # ends <= T index it
    starts_on_hole = inner_end & ~trained_or_end.gather(1, segment_ends.clamp(min=0))
    if starts_on_hole.any():
        row = _first_row(starts_on_hole)
        raise ValueError(
            f"segment start on a 0 of response_mask (tool output or template) in row {row}: "
            f"ends {segment_ends[row].tolist()}"
        )
    policy_ends = torch.where(present, rank.gather(1, segment_ends.clamp(min=0)), segment_ends)
    return lengths, present.sum(1), policy_ends


def _first_row(mask: torch.Tensor) -> int:
    return int(mask.any(1).nonzero()[0, 0])


def _map_values(raw, fraction, outcome, mean_outcome, cfg) -> tuple[torch.Tensor, ...]:
    """Values from padded probe values, on the probability scale, in float64.

    Args:
        raw: (n, M+1) probe values. fraction: (n, M+1) b_k / L, the share of the response read at boundary k (0 at
            k = 0, 1 at k = K). outcome: (n,) ζ. mean_outcome: (n,) group mean, V_0 when anchored. Both on the
            probability scale.

    Returns:
        values (n, M+1), every column mapped (the caller sets V_K = ζ); flat (n,) bool, rows interpolated because the
        map is undefined; steep (n,) bool, rows interpolated because the affine gain is out of [0, max_affine_gain].
    """
    zeta, start = outcome.unsqueeze(1), mean_outcome.unsqueeze(1)
    flat = torch.zeros_like(outcome, dtype=torch.bool)
    steep = torch.zeros_like(flat)
    values = raw.clone()
    # Values proportional to the tokens read: σ_k = n_k / L, the GRPO advantage (see the module docstring).
    linear = start + (zeta - start) * fraction
    if cfg.anchored and cfg.value_mapping == "affine":
        gap = outcome - raw[:, 0]
        flat = gap.abs() < cfg.epsilon
        gain = (outcome - mean_outcome) / gap.where(~flat, 1.0)
        steep = ~flat & ((gain < 0) | (gain > cfg.max_affine_gain))
        affine = (zeta + (raw - zeta) * gain.unsqueeze(1)).clamp(0.0, 1.0)
        values = torch.where((flat | steep).unsqueeze(1), linear, affine)
    elif cfg.anchored and cfg.value_mapping == "log_affine":
        # Log-probabilities of long continuations span orders of magnitude: map log v̂ affinely, v̂_0 -> V_0 and
        # certainty (log 1 = 0) -> 1; states less likely than the start fall towards 0.
        log_raw = raw.clamp(min=1e-30).log()
        log_start = log_raw[:, :1]
        flat = (log_start[:, 0].abs() < cfg.epsilon) | (raw[:, 0] <= 0.0)
        progress = (log_raw - log_start) / (-log_start).where(~flat.unsqueeze(1), 1.0)
        mapped = (start + (1.0 - start) * progress).clamp(0.0, 1.0)
        values = torch.where(flat.unsqueeze(1), linear, mapped)
    if cfg.anchored:
        values[:, 0] = mean_outcome
    return values, flat, steep


def _first_reasons(reasons) -> tuple[torch.Tensor, dict[str, float]]:
    """OR of the reason masks, and per reason the number of traces for which it is the first that holds."""
    fallback = torch.zeros_like(reasons[0][1])
    counts = {}
    for name, mask in reasons:
        counts[name] = counts.get(name, 0.0) + float((mask & ~fallback).sum())
        fallback = fallback | mask
    return fallback, counts


def _shifted_clamp(rows, weights, mask, limit, target) -> torch.Tensor:
    """x ← clamp(x − τ, −limit, limit) with τ found by bisection so that Σ weights · x = target over ``mask``.

    This is the (weighted) Euclidean projection onto {|x| <= limit, Σ w·x = target}; it keeps the order of the
    entries. When |target| > limit · Σ w no shift reaches it and every entry ends at ±limit.

    Args:
        rows: (n, M) float64. weights: (n, M) positive. mask: (n, M) bool. limit: (n, 1). target: (n,).
    """
    # At τ = min x − limit every entry sits at +limit (the largest total); at τ = max x + limit at −limit.
    low = rows.where(mask, float("inf")).amin(1) - limit.squeeze(1)
    high = rows.where(mask, float("-inf")).amax(1) + limit.squeeze(1)
    for _ in range(_BISECTION_STEPS):
        middle = (low + high) / 2
        total = (weights * (rows - middle.unsqueeze(1)).clamp(-limit, limit)).where(mask, 0.0).sum(1)
        above = total > target
        low, high = middle.where(above, low), high.where(above, middle)
    return (rows - ((low + high) / 2).unsqueeze(1)).clamp(-limit, limit)


def _clip_coefficients(sigma, active, num_segments, clip) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep K·σ_k within [−clip, clip] while Σ_k σ_k stays 1.

    Rows within the bound are returned unchanged. For the others, σ_k ← clamp(σ_k − τ, −clip/K, clip/K) with the
    shift τ found by bisection so the sum is 1 (the Euclidean projection onto the allowed set). Clamping and then
    dividing by the sum instead could divide by a sum near zero or flip every sign.

    Args:
        sigma: (n, M) coefficients summing to 1 over active entries. active: (n, M) bool.
        num_segments: (n,) K. clip: c >= 1.

    Returns:
        sigma (n, M), and clipped (n,) bool: rows that were changed.
    """
    bound = (clip / num_segments.clamp(min=1).double()).unsqueeze(1)
    clipped = (active & (sigma.abs() > bound)).any(1)
    if not clipped.any():
        return sigma, clipped
    rows, mask = sigma[clipped], active[clipped]
    projected = _shifted_clamp(rows, torch.ones_like(rows), mask, bound[clipped], torch.ones(rows.shape[0]).double())
    sigma = sigma.clone()
    sigma[clipped] = projected.where(mask, rows)
    return sigma, clipped


def _bound_token_factors(factor, tokens, active, target, bound) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep every token's |f_t| within ``bound`` while Σ_t f_t = Σ_k n_k f_k stays ``target``.

    The projection of ``_clip_coefficients`` with each segment weighted by its token count, so it acts per token.
    Rows within the bound are returned unchanged.

    Args:
        factor: (n, M) per-segment token factors f_k (A_t = unit · f_k). tokens: (n, M) n_k. active: (n, M) bool.
        target: (n,) token sum to keep: L for mixed groups, λ·L·Σ_k R_k / s for degenerate ones. bound: B >= 1.

    Returns:
        factor (n, M), and bounded (n,) bool: rows that were changed.
    """
    bounded = (active & (factor.abs() > bound)).any(1)
    if not bounded.any():
        return factor, bounded
    rows, mask = factor[bounded], active[bounded]
    limit = torch.full((rows.shape[0], 1), float(bound), dtype=torch.float64)
    projected = _shifted_clamp(rows, tokens[bounded].double(), mask, limit, target[bounded])
    factor = factor.clone()
    factor[bounded] = projected.where(mask, rows)
    return factor, bounded


def _metrics(traces: _TraceQuantities, rows: torch.Tensor, fallback: torch.Tensor, counts: dict[str, float]) -> dict:
    """Scalar diagnostics (see ``redistribute``) from the traces, their redistributed ``rows`` (bs, T) and the
    traces that kept GRPO's row instead (``fallback``, (bs,) bool; ``counts`` per reason)."""
    bsz = fallback.numel()
    live = ~fallback
    metrics = {f"fallback/{name}": count for name, count in counts.items()}
    metrics["redistributed_frac"] = float(live.sum()) / bsz if bsz else 0.0
    # Degenerate-group traces that got a nonzero advantage.
    signal = traces.differences & live & (rows.where(traces.in_response, 0.0) != 0).any(1)
    groups = traces.groups.values()
    metrics["degenerate_groups"] = float(sum(bool(traces.degenerate[members[0]]) for members in groups))
    metrics["degenerate_groups_with_signal"] = float(sum(bool(signal[members].any()) for members in groups))
    metrics["affine_flat_traces"] = float((traces.flat & live).sum())  # all False unless anchored affine / log_affine
    metrics["affine_gain_traces"] = float((traces.steep & live).sum())
    if live.any():
        metrics["token_bound_trace_frac"] = float(traces.bounded[live].double().mean())
    mixed = live & ~traces.differences
    if not mixed.any():
        return metrics
    num_segments = traces.num_segments
    metrics["segments_per_trace"] = float(num_segments[mixed].double().mean())
    metrics["negative_coef_frac"] = float((traces.sigma[traces.in_segment & mixed.unsqueeze(1)] < 0).double().mean())
    metrics["clipped_trace_frac"] = float(traces.clipped[mixed].double().mean())
    magnitude = traces.rewards.to(traces.raw_values.dtype).double().abs()  # as reported: in the probe values' dtype
    for k in range(min(_LOGGED_POSITIONS, traces.sigma.shape[1])):
        has_k = mixed & (num_segments > k)
        if has_k.any():
            metrics[f"abs_segment_reward/pos_{k}"] = float(magnitude[has_k, k].mean())
    last = magnitude.gather(1, (num_segments - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    metrics["abs_segment_reward/last"] = float(last[mixed].mean())
    return metrics
