"""Segment boundaries for chain-of-thought traces (RREDCoT §2).

A response of L tokens is cut into K segments, given as exclusive ends ``b_1 < ... < b_K = L``; segment k covers
``response[b_{k-1}:b_k]`` with ``b_0 = 0``. Five strategies:

- ``fixed``: equal-length pieces.
- ``keyword``: cuts right after a newline whose next line starts with a discourse keyword ("Wait", "So", ...),
  spaced left to right and thinned evenly to the budget.
- ``entropy``: cuts before the highest-entropy tokens (decision points), anywhere.
- ``hybrid`` (default): cuts after newlines, keeping the ones followed by the highest entropy (every newline is a
  candidate; the keyword list belongs to the ``keyword`` strategy).
- ``turns``: for multi-turn tool agents, every assistant turn is a segment, cut further inside by
  ``turn_strategy`` (``none``: not at all).

Common rules: only the thinking part is cut. If the response contains ``</think>``, a boundary sits at its index and
everything from ``</think>`` to the end (the answer) is one final segment. Position 0 is never a boundary. With no
usable candidate the response is one segment ``[L]``.

Multi-turn responses (verl's tool agent loop): the response is the model's turns with the tool output and the chat
template's tokens between them, marked 0 in ``response_mask``. Positions stay those of the full response, lengths
count the model's tokens only, and no boundary falls on a 0: every segment starts at a model token, so no segment is
a hole alone, and a boundary at a turn's start leaves the hole before it at the tail of the previous segment.
``</think>`` is found in each turn: each turn's answer (its ``</think>`` up to the next turn's start) is one segment,
and one past the last model token is the last boundary. Without ``turns`` a segment may still span a turn boundary
where no ``</think>`` forces a cut.

Entropy ranking is non-maximum suppression: candidates are taken in decreasing order of score (mean entropy of
the tokens that open the next segment), and one closer than ``min_segment_len`` tokens to an already kept boundary
(the start, ``</think>`` and the end included) is dropped, until ``max_segments`` is reached. It does in one pass
what "delete the lowest-scored candidate until at most ``max_segments`` remain, then merge every too-short segment
across its lower-scored boundary" does, but spends the budget only on cuts that satisfy the length rule, where
delete-then-merge can end far below ``max_segments``.

Imports only torch; the tokenizer is used once, in ``BoundaryVocab.from_tokenizer``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

__all__ = [
    "DEFAULT_KEYWORDS", "STRATEGIES", "TURN_STRATEGIES", "SegmentationSettings", "BoundaryVocab", "segment_response",
    "turn_spans",
]  # fmt: skip

STRATEGIES = ("fixed", "keyword", "entropy", "hybrid", "turns")
# How ``turns`` cuts inside each turn: not at all, or by one of the single-response strategies.
TURN_STRATEGIES = ("none", "fixed", "keyword", "entropy", "hybrid")

# Discourse and reflection openers that start a new reasoning move in long CoT; matched case-sensitively at the start of a line.
DEFAULT_KEYWORDS = (
    "Wait", "But", "Alternatively", "Hmm", "So", "Therefore", "Let me", "Let's", "Now", "Okay", "First", "Next",
    "Then", "Hence", "Thus", "Actually", "Hold on", "Maybe", "I think", "Double-check", "To verify", "Step",
)  # fmt: skip

_LINE_INDENT = " \t"


@dataclass(frozen=True)
class SegmentationSettings:
    """How to cut a response into segments.

    Attributes:
        strategy: one of ``STRATEGIES``. Default ``"hybrid"``.
        max_segments: most segments per response, the ``</think>`` answer segment included. Default 40 (the
            granularity of the paper's Monte-Carlo analysis). At least 2, because a ``</think>`` cut always
            makes two. Turn starts and each turn's ``</think>`` are always cut, even past it.
        min_segment_len: fewest tokens in a segment, in tokens. Default 8. Only segments bounded on both sides by
            fixed boundaries (start, ``</think>``, end) can be shorter.
        keywords: line openers for the ``keyword`` strategy. A keyword matches when the line, after leading spaces
            and tabs, starts with it and the next character is not a letter or digit ("So," matches, "Some" does
            not). Default ``DEFAULT_KEYWORDS``.
        entropy_window: a candidate boundary at position b is scored by the mean entropy of tokens
            ``b .. b + entropy_window - 1``, the first tokens of the segment it opens. Default 1.
        turn_strategy: with ``strategy: turns``, how each assistant turn is cut further: ``none`` (default: one
            segment per turn, two when it writes ``</think>``) or one of the other strategies, inside each turn.
            Must stay ``none`` with any other strategy.

    The end-of-thinking marker is not a key here: it belongs to the probe profile (``probe.think_end``), which the
    probes and the segmentation must agree on, and reaches the segmentation through ``BoundaryVocab.from_tokenizer``.
    """

    strategy: str = "hybrid"
    max_segments: int = 40
    min_segment_len: int = 8
    keywords: tuple[str, ...] = DEFAULT_KEYWORDS
    entropy_window: int = 1
    turn_strategy: str = "none"

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"segmentation strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.turn_strategy not in TURN_STRATEGIES:
            raise ValueError(f"turn_strategy must be one of {TURN_STRATEGIES}, got {self.turn_strategy!r}")
        if self.strategy != "turns" and self.turn_strategy != "none":
            raise ValueError(f"turn_strategy {self.turn_strategy!r} needs strategy 'turns', got {self.strategy!r}")
        if self.max_segments < 2:
            raise ValueError(f"max_segments must be >= 2 (a </think> cut alone makes two), got {self.max_segments}")
        if self.min_segment_len < 1:
            raise ValueError(f"min_segment_len must be >= 1, got {self.min_segment_len}")
        if self.entropy_window < 1:
            raise ValueError(f"entropy_window must be >= 1, got {self.entropy_window}")
        if isinstance(self.keywords, str) or not all(isinstance(k, str) and k for k in self.keywords):
            raise ValueError(f"keywords must be a tuple of non-empty strings, got {self.keywords!r}")
        if self.cut_strategy == "keyword" and not self.keywords:
            raise ValueError("the keyword strategy needs at least one keyword")
        if any("\n" in k for k in self.keywords):
            raise ValueError(f"keywords are matched within one line and cannot contain a newline: {self.keywords!r}")
        object.__setattr__(self, "keywords", tuple(self.keywords))

    @property
    def cut_strategy(self) -> str:
        """The strategy that places the free cuts: ``turn_strategy`` under ``turns``, else ``strategy``."""
        return self.turn_strategy if self.strategy == "turns" else self.strategy


@dataclass(frozen=True, eq=False)  # tensor fields: compare by identity
class BoundaryVocab:
    """Per-tokenizer tables for boundary detection; build once with ``from_tokenizer``.

    Attributes:
        has_newline: (V,) bool, the token's text contains "\\n" (covers merged tokens such as "\\n\\n", ".\\n").
        line_tails: text after the last "\\n" of each newline token (e.g. the indentation in "\\n   "), by id.
        pieces: text each token adds when it follows a newline, by id. Decoding in that context keeps the leading
            space that SentencePiece-style decoders strip from a lone token.
        think_end_id: id of ``think_end`` if the tokenizer has it as one token, else None.
        keywords: the keywords the tables were built for; think_end: the end-of-thinking marker they hold.
    """

    has_newline: torch.Tensor
    line_tails: dict[int, str]
    pieces: tuple[str, ...]
    think_end_id: int | None
    keywords: tuple[str, ...]
    think_end: str

    @classmethod
    def from_tokenizer(cls, tokenizer, cfg: SegmentationSettings, *, think_end: str) -> BoundaryVocab:
        """Decode every token id once (in one batched call) and record newline and ``think_end`` ids.

        Args:
            tokenizer: any Hugging Face tokenizer (``decode``/``batch_decode``/``encode``, ``len()``).
            cfg: the segmentation settings (``keywords`` are baked in).
            think_end: the end-of-thinking marker (``settings.probe.profile_for(tokenizer).think_end``); honoured
                when the tokenizer has it as a single token. Empty: the model writes no thinking block (the whole
                response is cut as reasoning).
        """
        if not isinstance(think_end, str):
            raise ValueError(f"think_end must be a string, got {think_end!r}")
        vocab_size = len(tokenizer)
        decode_kwargs = dict(skip_special_tokens=False, clean_up_tokenization_spaces=False)
        lone = tokenizer.batch_decode([[i] for i in range(vocab_size)], **decode_kwargs)
        has_newline = torch.tensor(["\n" in text for text in lone], dtype=torch.bool)
        line_tails = {i: text.rsplit("\n", 1)[1] for i, text in enumerate(lone) if "\n" in text}

        pieces = lone
        newline_id = next((i for i, text in enumerate(lone) if text == "\n"), None)
        if newline_id is not None:
            in_context = tokenizer.batch_decode([[newline_id, i] for i in range(vocab_size)], **decode_kwargs)
            pieces = [ctx[1:] if ctx.startswith("\n") else alone for ctx, alone in zip(in_context, lone)]

        think_ids = tokenizer.encode(think_end, add_special_tokens=False) if think_end else []
        think_end_id = think_ids[0] if len(think_ids) == 1 and lone[think_ids[0]] == think_end else None
        return cls(
            has_newline=has_newline,
            line_tails=line_tails,
            pieces=tuple(pieces),
            think_end_id=think_end_id,
            keywords=cfg.keywords,
            think_end=think_end,
        )

    @property
    def vocab_size(self) -> int:
        return self.has_newline.numel()


def segment_response(
    response_ids: torch.Tensor,
    entropies: torch.Tensor | None,
    vocab: BoundaryVocab,
    cfg: SegmentationSettings,
    response_mask: torch.Tensor | None = None,
) -> list[int]:
    """Cut one response into segments.

    Args:
        response_ids: (L,) int64, the response tokens only (no prompt, no padding). A multi-turn response is the
            full interleaved one: assistant turns with the tool output and template tokens between them.
        entropies: (L,) float, per-token entropy of the policy at each response position; required by the
            ``entropy`` and ``hybrid`` strategies (and ``turns`` cut by them), ignored by the others.
        vocab: tables from ``BoundaryVocab.from_tokenizer`` built with the same ``keywords``.
        cfg: segmentation settings.
        response_mask: (L,) 0/1, 1 on the policy's own tokens (verl's ``response_mask``); None: all of them. The
            0-runs between turns are context, never a segment's start nor counted in its length.

    Returns:
        Exclusive segment ends in positions of the full response, strictly increasing, every end but the last at a
        policy token, the last one past the last policy token; ``[]`` when there is none.
    """
    response_ids = response_ids.cpu()  # the vocab tables live on the CPU; .tolist() syncs anyway
    entropies = None if entropies is None else entropies.cpu()
    if response_mask is not None:
        response_mask = response_mask.cpu()
    _check_inputs(response_ids, entropies, vocab, cfg, response_mask)
    trained = torch.ones(response_ids.numel(), dtype=torch.bool) if response_mask is None else response_mask.bool()
    if not trained.any():
        return []
    layout = _Layout(response_ids.tolist(), trained, vocab, cfg)
    budget = max(0, cfg.max_segments - len(layout.fixed))  # free boundaries allowed in the thinking regions
    strategy = cfg.cut_strategy
    if not layout.regions or strategy == "none":
        free = []
    elif strategy == "fixed":
        free = _fixed_boundaries(layout, budget, cfg.min_segment_len)
    elif strategy == "keyword":
        candidates = _newline_candidates(response_ids, layout, vocab)
        free = _keyword_boundaries(layout, candidates, budget, vocab, cfg)
    elif strategy == "entropy":
        candidates = [p for start, stop in layout.regions for p in range(start + 1, stop) if layout.trained[p]]
        free = _by_score(candidates, _boundary_scores(entropies, layout, candidates, cfg), layout, budget, cfg)
    else:  # hybrid
        candidates = _newline_candidates(response_ids, layout, vocab)
        free = _by_score(candidates, _boundary_scores(entropies, layout, candidates, cfg), layout, budget, cfg)
    return sorted(set(free) | layout.fixed)


class _Layout:
    """Where a response may be cut: its turns (maximal runs of policy tokens), its fixed boundaries and the thinking
    regions between them. Lengths are counted in policy tokens (``rank``), so a hole never counts towards
    ``min_segment_len``; positions are the full response's.

    Attributes:
        ids: the token ids; trained: per position, a policy token (``trained_mask``: the same as a tensor).
        rank: (L + 1) policy tokens before each position (``rank_tensor``: the same as a tensor).
        policy_positions: the positions of the policy tokens, in order (``policy_positions[rank[p]] == p`` for them).
        ``trained``, ``rank`` and ``policy_positions`` are Python lists of a 25k-token response's length, built on first
        use: the default strategy reads none of them.
        turns: (start, stop) of each turn.
        fixed: boundaries every strategy keeps: each turn's ``</think>`` and the start of the turn after its answer
            (the answer is one segment, as the single-turn rule has it), every turn start with ``turns``, and the
            end of the last turn; never 0.
        regions: (start, stop) spans between consecutive fixed boundaries (0 included) that are thinking, not an
            answer; free cuts go strictly inside them.
    """

    def __init__(self, ids: list[int], trained: torch.Tensor, vocab: BoundaryVocab, cfg: SegmentationSettings):
        self.ids, self.trained_mask = ids, trained
        self.rank_tensor = torch.cat([trained.new_zeros(1, dtype=torch.int64), trained.cumsum(0)])
        self.turns = turn_spans(trained)
        fixed, answer_starts = {self.turns[-1][1]}, set()
        for j, (start, stop) in enumerate(self.turns):
            think_end = _think_end_index(ids, start, stop, vocab)
            if think_end is not None:
                answer_starts.add(think_end)
                fixed.add(think_end)
                if j + 1 < len(self.turns):
                    fixed.add(self.turns[j + 1][0])
            if cfg.strategy == "turns" and j > 0:
                fixed.add(start)
        fixed.discard(0)  # 0 is never a boundary
        self.fixed = fixed
        edges = [0, *sorted(fixed)]
        self.regions = [(a, b) for a, b in zip(edges, edges[1:]) if a not in answer_starts]

    @cached_property
    def trained(self) -> list[bool]:
        return self.trained_mask.tolist()

    @cached_property
    def rank(self) -> list[int]:
        return self.rank_tensor.tolist()

    @cached_property
    def policy_positions(self) -> list[int]:
        return torch.nonzero(self.trained_mask).flatten().tolist()

    def tokens(self, start: int, stop: int) -> int:
        """Policy tokens in [start, stop)."""
        return self.rank[stop] - self.rank[start]

    def rank_at(self, positions: Sequence[int]) -> dict[int, int]:
        """``rank`` at a few positions, read from the tensor (no list of the response's length)."""
        positions = list(positions)
        if not positions:
            return {}
        return dict(zip(positions, self.rank_tensor[torch.tensor(positions, dtype=torch.int64)].tolist()))


def turn_spans(trained: Sequence[bool] | torch.Tensor) -> list[tuple[int, int]]:
    """(start, stop) of each assistant turn: each maximal run of policy tokens (truthy entries of a response mask,
    a sequence or a 1-D tensor)."""
    flags = torch.as_tensor(trained).bool()
    padded = torch.zeros(flags.numel() + 2, dtype=torch.int8)
    padded[1:-1] = flags
    edges = torch.diff(padded)  # +1 where a run starts, -1 one past where it stops
    return list(zip(torch.nonzero(edges == 1).flatten().tolist(), torch.nonzero(edges == -1).flatten().tolist()))


def _check_inputs(response_ids, entropies, vocab, cfg, response_mask):
    if response_ids.dim() != 1 or response_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"response_ids must be a 1-D int64/int32 tensor, got shape {tuple(response_ids.shape)} "
            f"dtype {response_ids.dtype}"
        )
    if response_ids.numel() and (response_ids.min() < 0 or response_ids.max() >= vocab.vocab_size):
        raise ValueError(
            f"response_ids hold ids outside the tokenizer vocabulary [0, {vocab.vocab_size}): "
            f"min {int(response_ids.min())}, max {int(response_ids.max())}; pass only the unpadded response"
        )
    if response_mask is not None and (
        response_mask.shape != response_ids.shape or not ((response_mask == 0) | (response_mask == 1)).all()
    ):
        raise ValueError(
            f"response_mask must hold 0/1 in the shape of response_ids {tuple(response_ids.shape)}, "
            f"got shape {tuple(response_mask.shape)}"
        )
    if vocab.keywords != cfg.keywords:
        raise ValueError("BoundaryVocab was built for other keywords than this SegmentationSettings")
    if cfg.cut_strategy in ("entropy", "hybrid"):
        if entropies is None:
            raise ValueError(f"segmentation strategy {cfg.cut_strategy!r} needs token entropies, got None")
        if entropies.shape != response_ids.shape:
            raise ValueError(
                f"entropies shape {tuple(entropies.shape)} must equal response_ids shape {tuple(response_ids.shape)}"
            )
        if not torch.isfinite(entropies).all():
            raise ValueError("entropies contain NaN or inf")


def _think_end_index(ids: list[int], start: int, stop: int, vocab: BoundaryVocab) -> int | None:
    """The first ``</think>`` of the turn [start, stop), or None."""
    if vocab.think_end_id is None:
        return None
    try:
        return ids.index(vocab.think_end_id, start, stop)
    except ValueError:
        return None


def _newline_candidates(response_ids: torch.Tensor, layout: _Layout, vocab: BoundaryVocab) -> list[int]:
    """Policy positions strictly inside a thinking region right after a newline-bearing token (a turn start after
    the template's newline included), ascending."""
    after_newline = torch.zeros(response_ids.numel(), dtype=torch.bool)
    after_newline[1:] = vocab.has_newline[response_ids[:-1]]
    inside = torch.zeros_like(after_newline)
    for start, stop in layout.regions:
        inside[start + 1 : stop] = True
    return torch.nonzero(after_newline & inside & layout.trained_mask).flatten().tolist()


def _boundary_scores(entropies: torch.Tensor, layout: _Layout, candidates: list[int], cfg) -> list[float]:
    """Mean entropy of the first ``entropy_window`` policy tokens from each candidate (fewer at the response end)."""
    if not candidates:
        return []
    policy_entropies = entropies[layout.trained_mask].double()
    prefix = torch.cat([policy_entropies.new_zeros(1), policy_entropies.cumsum(0)])
    starts = layout.rank_tensor[torch.tensor(candidates)]
    stops = (starts + cfg.entropy_window).clamp(max=policy_entropies.numel())
    return ((prefix[stops] - prefix[starts]) / (stops - starts)).tolist()


def _by_score(candidates, scores, layout: _Layout, budget, cfg) -> list[int]:
    """Keep the highest-scored candidates, at most ``budget``, each ``min_segment_len`` policy tokens from any kept
    boundary.

    Ties go to the earlier position. The regions' ends act as kept boundaries.
    """
    gap = cfg.min_segment_len
    order = sorted(range(len(candidates)), key=lambda j: (-scores[j], candidates[j]))
    edges = {edge for region in layout.regions for edge in region}
    kept = sorted(edges)
    rank = layout.rank_at(set(candidates) | edges)  # every position kept can hold
    for j in order:
        if len(kept) - len(edges) == budget:
            break
        position = candidates[j]
        slot = bisect.bisect_left(kept, position)
        if rank[position] - rank[kept[slot - 1]] >= gap and rank[kept[slot]] - rank[position] >= gap:
            kept.insert(slot, position)
    return [position for position in kept if position not in edges]


def _fixed_boundaries(layout: _Layout, budget: int, min_len: int) -> list[int]:
    """Equal pieces of each region, in policy tokens; the budget is shared by the regions' policy tokens."""
    total = sum(layout.tokens(start, stop) for start, stop in layout.regions)
    cuts = []
    for start, stop in layout.regions:
        tokens = layout.tokens(start, stop)
        # floor, not ceil: every piece then has at least min_len tokens.
        pieces = max(1, min(budget * tokens // max(total, 1) + 1, tokens // min_len))
        first = layout.rank[start]
        cuts += [layout.policy_positions[first + k * tokens // pieces] for k in range(1, pieces)]
    return cuts


def _keyword_boundaries(layout: _Layout, candidates, budget, vocab, cfg) -> list[int]:
    """Newline candidates whose next line opens with a keyword, spaced left to right in each region, then evenly
    thinned.

    No scores here, so the budget is spent uniformly over the trace rather than on its first lines.
    """
    spaced = []
    for start, stop in layout.regions:
        last = start
        for position in candidates:
            if (
                start < position < stop
                and layout.tokens(last, position) >= cfg.min_segment_len
                and layout.tokens(position, stop) >= cfg.min_segment_len
                and _opens_keyword_line(layout.ids, position, stop, vocab, cfg.keywords)
            ):
                spaced.append(position)
                last = position
    if len(spaced) <= budget:
        return spaced
    return [spaced[(2 * i + 1) * len(spaced) // (2 * budget)] for i in range(budget)]


def _opens_keyword_line(ids, position, stop, vocab, keywords) -> bool:
    """Whether the line starting after token ``position - 1`` (a newline token) opens with a keyword.

    Reads the newline token's tail and then as few following tokens (before ``stop``) as needed to see the longest
    keyword plus one character.
    """
    needed = max(map(len, keywords)) + 1
    text = vocab.line_tails[ids[position - 1]]
    index = position
    while index < stop and "\n" not in text and len(text.lstrip(_LINE_INDENT)) < needed:
        text += vocab.pieces[ids[index]]
        index += 1
    line = text.split("\n", 1)[0].lstrip(_LINE_INDENT)
    return any(
        line.startswith(keyword) and (len(line) == len(keyword) or not line[len(keyword)].isalnum())
        for keyword in keywords
    )
