"""The redistribution's settings (``algorithm.rredcot.redistribution``); ``core.redistribution`` re-exports them, and
the module docstring their docstring refers to is that module's, where the steps are numbered. Imports nothing."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RedistributionSettings", "VALUE_MAPPINGS", "DEGENERATE_GROUPS", "CREDIT_TRACES", "ADVANTAGE_FORMS"]

VALUE_MAPPINGS = ("affine", "log_affine", "raw")
DEGENERATE_GROUPS = ("grpo", "value_differences")
CREDIT_TRACES = ("all", "incorrect", "correct")
ADVANTAGE_FORMS = ("sigma", "signed")


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
