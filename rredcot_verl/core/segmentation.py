"""Segment boundaries for chain-of-thought traces (RREDCoT §2).

A response of L tokens is cut into K segments, given as exclusive ends ``b_1 < ... < b_K = L``; segment k covers
``response[b_{k-1}:b_k]`` with ``b_0 = 0``. Four strategies:

- ``fixed``: equal-length pieces.
- ``keyword``: cuts right after a newline whose next line starts with a discourse keyword ("Wait", "So", ...),
  spaced left to right and thinned evenly to the budget.
- ``entropy``: cuts before the highest-entropy tokens (decision points), anywhere.
- ``hybrid`` (default): cuts after newlines, keeping the ones followed by the highest entropy (every newline is a
  candidate; the keyword list belongs to the ``keyword`` strategy).

Common rules: only the thinking part is cut. If the response contains ``</think>``, a boundary sits at its index and
everything from ``</think>`` to the end (the answer) is one final segment. Position 0 is never a boundary. With no
usable candidate the response is one segment ``[L]``.

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

import torch

__all__ = ["DEFAULT_KEYWORDS", "STRATEGIES", "SegmentationSettings", "BoundaryVocab", "segment_response"]

STRATEGIES = ("fixed", "keyword", "entropy", "hybrid")

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
            makes two.
        min_segment_len: fewest tokens in a segment, in tokens. Default 8. Only segments bounded on both sides by
            fixed boundaries (start, ``</think>``, end) can be shorter.
        keywords: line openers for the ``keyword`` strategy. A keyword matches when the line, after leading spaces
            and tabs, starts with it and the next character is not a letter or digit ("So," matches, "Some" does
            not). Default ``DEFAULT_KEYWORDS``.
        entropy_window: a candidate boundary at position b is scored by the mean entropy of tokens
            ``b .. b + entropy_window - 1``, the first tokens of the segment it opens. Default 1.

    The end-of-thinking marker is not a key here: it belongs to the probe profile (``probe.think_end``), which the
    probes and the segmentation must agree on, and reaches the segmentation through ``BoundaryVocab.from_tokenizer``.
    """

    strategy: str = "hybrid"
    max_segments: int = 40
    min_segment_len: int = 8
    keywords: tuple[str, ...] = DEFAULT_KEYWORDS
    entropy_window: int = 1

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"segmentation strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.max_segments < 2:
            raise ValueError(f"max_segments must be >= 2 (a </think> cut alone makes two), got {self.max_segments}")
        if self.min_segment_len < 1:
            raise ValueError(f"min_segment_len must be >= 1, got {self.min_segment_len}")
        if self.entropy_window < 1:
            raise ValueError(f"entropy_window must be >= 1, got {self.entropy_window}")
        if isinstance(self.keywords, str) or not all(isinstance(k, str) and k for k in self.keywords):
            raise ValueError(f"keywords must be a tuple of non-empty strings, got {self.keywords!r}")
        if self.strategy == "keyword" and not self.keywords:
            raise ValueError("the keyword strategy needs at least one keyword")
        if any("\n" in k for k in self.keywords):
            raise ValueError(f"keywords are matched within one line and cannot contain a newline: {self.keywords!r}")
        object.__setattr__(self, "keywords", tuple(self.keywords))


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
) -> list[int]:
    """Cut one response into segments.

    Args:
        response_ids: (L,) int64, the response tokens only (no prompt, no padding).
        entropies: (L,) float, per-token entropy of the policy at each response position; required by the
            ``entropy`` and ``hybrid`` strategies, ignored by the others.
        vocab: tables from ``BoundaryVocab.from_tokenizer`` built with the same ``keywords``.
        cfg: segmentation settings.

    Returns:
        Exclusive segment ends, strictly increasing, the last equal to L; ``[]`` when L == 0.
    """
    response_ids = response_ids.cpu()  # the vocab tables live on the CPU; .tolist() syncs anyway
    entropies = None if entropies is None else entropies.cpu()
    _check_inputs(response_ids, entropies, vocab, cfg)
    length = response_ids.numel()
    if length == 0:
        return []
    ids = response_ids.tolist()
    think_end = _think_end_index(ids, vocab)
    # The thinking part [0, think_end) is what gets cut; [think_end, L) is one answer segment.
    thinking_len = length if think_end is None else think_end
    fixed_ends = [e for e in (think_end, length) if e]  # 0 is never a boundary
    budget = cfg.max_segments - len(fixed_ends)  # free boundaries allowed inside the thinking part

    if thinking_len == 0:
        free = []
    elif cfg.strategy == "fixed":
        free = _fixed_boundaries(thinking_len, budget, cfg.min_segment_len)
    elif cfg.strategy == "keyword":
        candidates = _newline_candidates(response_ids, thinking_len, vocab)
        free = _keyword_boundaries(ids, candidates, thinking_len, budget, vocab, cfg)
    elif cfg.strategy == "entropy":
        candidates = list(range(1, thinking_len))
        free = _by_score(candidates, _boundary_scores(entropies, candidates, cfg), thinking_len, budget, cfg)
    else:  # hybrid
        candidates = _newline_candidates(response_ids, thinking_len, vocab)
        free = _by_score(candidates, _boundary_scores(entropies, candidates, cfg), thinking_len, budget, cfg)
    return sorted(free) + fixed_ends


def _check_inputs(response_ids, entropies, vocab, cfg):
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
    if vocab.keywords != cfg.keywords:
        raise ValueError("BoundaryVocab was built for other keywords than this SegmentationSettings")
    if cfg.strategy in ("entropy", "hybrid"):
        if entropies is None:
            raise ValueError(f"segmentation strategy {cfg.strategy!r} needs token entropies, got None")
        if entropies.shape != response_ids.shape:
            raise ValueError(
                f"entropies shape {tuple(entropies.shape)} must equal response_ids shape {tuple(response_ids.shape)}"
            )
        if not torch.isfinite(entropies).all():
            raise ValueError("entropies contain NaN or inf")


def _think_end_index(ids: list[int], vocab: BoundaryVocab) -> int | None:
    if vocab.think_end_id is None or vocab.think_end_id not in ids:
        return None
    return ids.index(vocab.think_end_id)


def _newline_candidates(response_ids: torch.Tensor, thinking_len: int, vocab: BoundaryVocab) -> list[int]:
    """Positions p in [1, thinking_len) right after a newline-bearing token, ascending."""
    after_newline = vocab.has_newline[response_ids[: thinking_len - 1]]
    return (torch.nonzero(after_newline).flatten() + 1).tolist()


def _boundary_scores(entropies: torch.Tensor, candidates: list[int], cfg: SegmentationSettings) -> list[float]:
    """Mean entropy of the first ``entropy_window`` tokens after each candidate (fewer at the response end)."""
    if not candidates:
        return []
    prefix = torch.cat([entropies.new_zeros(1, dtype=torch.float64), entropies.double().cumsum(0)])
    starts = torch.tensor(candidates)
    stops = (starts + cfg.entropy_window).clamp(max=entropies.numel())
    return ((prefix[stops] - prefix[starts]) / (stops - starts)).tolist()


def _by_score(candidates, scores, thinking_len, budget, cfg) -> list[int]:
    """Keep the highest-scored candidates, at most ``budget``, each ``min_segment_len`` from any kept boundary.

    Ties go to the earlier position. The start 0 and ``thinking_len`` act as kept boundaries.
    """
    gap = cfg.min_segment_len
    order = sorted(range(len(candidates)), key=lambda j: (-scores[j], candidates[j]))
    kept = [0, thinking_len]  # sorted
    for j in order:
        if len(kept) - 2 == budget:
            break
        position = candidates[j]
        slot = bisect.bisect_left(kept, position)
        if position - kept[slot - 1] >= gap and kept[slot] - position >= gap:
            kept.insert(slot, position)
    return kept[1:-1]


def _fixed_boundaries(thinking_len: int, budget: int, min_len: int) -> list[int]:
    # floor, not ceil: every piece then has at least min_len tokens.
    pieces = max(1, min(budget + 1, thinking_len // min_len))
    return [k * thinking_len // pieces for k in range(1, pieces)]


def _keyword_boundaries(ids, candidates, thinking_len, budget, vocab, cfg) -> list[int]:
    """Newline candidates whose next line opens with a keyword, spaced left to right, then evenly thinned.

    No scores here, so the budget is spent uniformly over the trace rather than on its first lines.
    """
    spaced, last = [], 0
    for position in candidates:
        if (
            position - last >= cfg.min_segment_len
            and thinking_len - position >= cfg.min_segment_len
            and _opens_keyword_line(ids, position, thinking_len, vocab, cfg.keywords)
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
