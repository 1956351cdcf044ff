"""Do a batch's segment values carry information about the outcome? A check that needs no ground truth.

Under the rollout policy a trace's outcome ζ is a one-sample Monte-Carlo estimate of the value of every state on the
trace (E[ζ | s] = V(s)). Values that are informative therefore order the traces of one prompt by their outcomes
wherever the outcome is already partly decided; values that are noise order them at random. The statistic compares,
within each group, every pair of traces whose outcomes differ, at equal shares of their responses
(``CONCORDANCE_PROGRESS``: 10%, 20%, ..., 90% of the tokens). The state at share p of a trace is its last boundary at
or before p·L (value v̂_k with k ≥ 1: v̂_0, the prompt alone, is the same for every trace of the group). A comparison
counts 1 when the trace with the better outcome has the higher value, ½ on a tie and 0 otherwise; the concordance is
their mean: 0.5 for values unrelated to the outcome, 1 for values that order every pair. Comparing at equal shares of
the tokens weighs the states as the redistribution weighs them (its advantages are spread over tokens).

``ConcordanceWindow`` pools the counts of recent batches, so that a decision taken on them rests on more comparisons
than one batch holds. Imports only torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "CONCORDANCE_PROGRESS", "ConcordanceCounts", "ConcordanceWindow", "gate_is_open", "value_outcome_concordance"
]

CONCORDANCE_PROGRESS = tuple(j / 10 for j in range(1, 10))


@dataclass(frozen=True)
class ConcordanceCounts:
    """Summed comparison scores (1, ½ or 0 each) and the number of comparisons."""

    concordant: float = 0.0
    comparisons: int = 0

    def __add__(self, other: "ConcordanceCounts") -> "ConcordanceCounts":
        return ConcordanceCounts(self.concordant + other.concordant, self.comparisons + other.comparisons)

    @property
    def concordance(self) -> float | None:
        """concordant / comparisons, None without comparisons."""
        return self.concordant / self.comparisons if self.comparisons else None


def value_outcome_concordance(
    raw_values: torch.Tensor,
    segment_ends: torch.Tensor,
    lengths: torch.Tensor,
    outcome: torch.Tensor,
    index: Sequence[Hashable],
    eligible: torch.Tensor,
    tie: float = 0.0,
) -> ConcordanceCounts:
    """Within-group concordance of boundary values with outcomes at equal shares of the responses (module docstring).

    Args:
        raw_values: (bs, Kmax + 1) probe values v̂_0..v̂_K, NaN-padded; column K (the outcome's place) is never read.
        segment_ends: (bs, Kmax) int64 exclusive segment ends b_1..b_K (b_K = L), padded with -1 at the end.
        lengths: (bs,) int response lengths L.
        outcome: (bs,) float outcomes, any scale: only their order within a group is used.
        index: (bs,) group (prompt) id of each trace.
        eligible: (bs,) bool, traces whose values may be compared (segment data present, values finite).
        tie: outcome differences of at most this count as equal (the pair is not compared).

    Returns:
        The batch's counts; no comparisons when no group has two eligible traces with different outcomes.
    """
    bsz = raw_values.shape[0]
    if bsz == 0:
        return ConcordanceCounts()
    progress = torch.tensor(CONCORDANCE_PROGRESS, dtype=torch.float64)
    position = lengths.double().unsqueeze(1) * progress  # (bs, P)
    # Boundaries at or before each position (padding ends sort last); the state there is v̂ of that count.
    ends = segment_ends.where(segment_ends >= 0, torch.iinfo(torch.int64).max).double().contiguous()
    boundary = torch.searchsorted(ends, position.contiguous(), right=True)
    states = raw_values.double().gather(1, boundary.clamp(max=raw_values.shape[1] - 1))
    num_segments = (segment_ends >= 0).sum(1, keepdim=True)
    readable = (boundary >= 1) & (boundary < num_segments) & eligible.unsqueeze(1) & torch.isfinite(states)
    states = states.where(readable, float("nan"))

    groups: dict[Hashable, list[int]] = {}
    for i in range(bsz):
        groups.setdefault(index[i], []).append(i)
    concordant, comparisons = 0.0, 0
    scores = outcome.double()
    for rows in groups.values():
        if len(rows) < 2:
            continue
        rows_t = torch.tensor(rows)
        group_states, group_scores = states[rows_t], scores[rows_t]
        better = (group_scores.unsqueeze(1) - group_scores.unsqueeze(0)) > tie  # (n, n): row's outcome is better
        higher, lower = group_states.unsqueeze(1), group_states.unsqueeze(0)  # (n, 1, P), (1, n, P)
        compared = better.unsqueeze(2) & torch.isfinite(higher) & torch.isfinite(lower)
        score = (higher > lower).double() + 0.5 * (higher == lower).double()
        concordant += float(score.where(compared, 0.0).sum())
        comparisons += int(compared.sum())
    return ConcordanceCounts(concordant, comparisons)


def gate_is_open(pooled: ConcordanceCounts, threshold: float) -> bool:
    """The value gate's rule: open when the pooled concordance reaches ``threshold``; closed without comparisons
    (no evidence that the values are informative); always open at threshold 0."""
    return threshold == 0.0 or (pooled.concordance is not None and pooled.concordance >= threshold)


class ConcordanceWindow:
    """Counts of the last ``steps − 1`` batches; with the current batch's they make a window of ``steps`` batches.

    The trainer keeps one per run and saves it with verl's checkpoints (``state_dict``), so a resumed run decides as
    the uninterrupted run would have.
    """

    def __init__(self, steps: int):
        if steps < 1:
            raise ValueError(f"a concordance window holds at least 1 step, got {steps}")
        self._previous: deque[ConcordanceCounts] = deque(maxlen=steps - 1)

    def pooled(self) -> ConcordanceCounts:
        """Sum of the previous batches' counts."""
        return sum(self._previous, ConcordanceCounts())

    def push(self, counts: ConcordanceCounts) -> None:
        self._previous.append(counts)

    def state_dict(self) -> list[list[float]]:
        return [[counts.concordant, counts.comparisons] for counts in self._previous]

    def load_state_dict(self, state: list[list[float]]) -> None:
        self._previous.clear()
        for concordant, comparisons in state:
            self._previous.append(ConcordanceCounts(float(concordant), int(comparisons)))
