"""Probe profiles: how a model family writes its thinking and its answer, and how probe text is tokenized after a prefix.

A profile (``algorithm.rredcot.probe.profile``) fixes the text a probe forces and scores:

- ``think_start`` / ``think_end``: the thinking markers (single tokens of the tokenizer); ``think_end`` also fixes the
  segmentation's answer segment.
- ``think_opener``: what a probe writes first when thinking is not open yet at its boundary. Qwen3's chat template
  ends the prompt with ``<|im_start|>assistant\\n`` and the model writes ``<think>\\n`` itself, so S_0 (and any
  boundary before ``<think>``) is probed with ``<think>\\n`` + exit text, i.e. Qwen3's own empty thinking block
  ``<think>\\n\\n</think>\\n\\n``. R1-distill's template ends the prompt with ``<think>\\n``: thinking is then open
  from the prompt and no opener is written. Which case holds is read from the tokens (``think_start`` in the response
  prefix, or at the end of the prompt followed only by whitespace), so one profile serves both template versions.
- ``exit_text``: forced after the prefix to leave thinking, ending where the answer starts (``\\boxed``).
- ``answer_prefix``: written before the answer string (``{``).
- ``answer_closings`` / ``answer_eos``: where the scored answer ends (below).

Where the answer ends. Chat models rarely end a response right after ``\\boxed{59}``: they write ``}$.``, ``}\\n``,
``}.`` and Qwen2's pre-tokenizer makes ``}`` plus the following punctuation or newlines one piece (``}$`` is one
token), so scoring ``{59}`` + EOS measures a sequence the model almost never writes. The probe scores the answer up
to its closing brace, and the token that closes it is matched partially: each text of ``answer_closings`` (``}``,
``}$``, ``}.``, ...) becomes one alternative, tokenized with the answer, and the alternatives' probabilities are
summed (they are separate probes of the same value; sequences having another alternative as a token prefix are
dropped, so the events are disjoint and the sum is a probability). With a tokenizer that keeps ``}`` a separate token
every longer closing starts with the ``}`` token and is dropped: the probe then scores exactly ``{59}``. The sum is a
lower bound on p(answer closed) because closings outside the list are not counted; the same list serves every
candidate, so self-normalisation divides most of that common factor out. Summing over every vocabulary token that
starts with ``}`` would be exact but adds hundreds of probe leaves per answer and boundary. ``answer_eos`` appends
the EOS token (the embedded task's responses end right after ``}``).

Joining a probe to its prefix. Probe tokens must be those the tokenizer produces for the prefix text followed by the
probe text written in one piece (a token split the model never sees distorts its probabilities).
``ProbeTokenizer.continuation`` first drops from the start of an exit text the whitespace the prefix already ends with:
hybrid boundaries fall after a newline (``.\\n``) and the exit text starts with one, whose only role is to put
``</think>`` on a line of its own; keeping both would write a blank line the model does not write before ``</think>``
(and only where the vocabulary happens to lack the merged newline token). It then tokenizes the last tokens of the
prefix together with the text and keeps the tokens after them, checking that the prefix tokens come out unchanged. When
a merge still crosses the boundary (a mid-line boundary after ``.`` followed by ``\\n``: written in one piece that is
``.\\n``, a token the trace does not hold), the text is tokenized on its own: the trace's tokens are fixed, so the probe
uses a split the tokenizer would not produce; such joins are counted (``ProbeTokenizer.split_joins``) and
``plan_traces`` logs a warning.
Imports nothing from verl, ray or the tasks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

__all__ = ["PROFILE_PRESETS", "ProbeProfile", "ProbeTokenizer", "resolve_profile"]

# Closing texts chat models write right after a boxed answer, as the Qwen2 pre-tokenizer cuts them (inline math
# ``}$``, end of sentence ``}.``/``}$.``, display math or a line end ``}\n``/``}\n\n``, a bare ``}``).
_CHAT_CLOSINGS = ("}", "}$", "}$.", "}.", "}\n", "}\n\n")
_FINAL_ANSWER_EXIT = "\n</think>\n\n**Final Answer**\n\\boxed"


@dataclass(frozen=True)
class ProbeProfile:
    """Concrete probe text of a model family (see the module docstring for each key)."""

    think_start: str
    think_end: str
    think_opener: str
    exit_text: str
    answer_prefix: str
    answer_closings: tuple[str, ...]
    answer_eos: bool

    def __post_init__(self) -> None:
        for name in ("think_start", "think_end", "exit_text"):
            if not getattr(self, name):
                raise ValueError(f"probe.{name} must be a non-empty string")
        if not self.think_opener.startswith(self.think_start):
            raise ValueError(
                f"probe.think_opener must start with think_start {self.think_start!r}, got {self.think_opener!r}"
            )
        closings = self.answer_closings
        if isinstance(closings, str) or not closings or not all(isinstance(c, str) and c for c in closings):
            raise ValueError(f"probe.answer_closings must be a non-empty list of non-empty strings, got {closings!r}")
        object.__setattr__(self, "answer_closings", tuple(closings))
        if not isinstance(self.answer_eos, bool):
            raise ValueError(f"probe.answer_eos must be true or false, got {self.answer_eos!r}")


PROFILE_PRESETS: dict[str, ProbeProfile] = {
    # Qwen3 thinking mode: the response opens with "<think>\n"; the answer follows "</think>\n\n".
    "qwen3": ProbeProfile("<think>", "</think>", "<think>\n", _FINAL_ANSWER_EXIT, "{", _CHAT_CLOSINGS, False),
    # DeepSeek-R1-Distill-Qwen: the prompt ends with "<think>\n" (opener only for older templates that do not);
    # display answers "\[\boxed{..}\]" close with "}\".
    "r1_distill": ProbeProfile(
        "<think>", "</think>", "<think>\n", _FINAL_ANSWER_EXIT, "{", (*_CHAT_CLOSINGS, "}\\"), False
    ),
    # The embedded arithmetic task (tasks/arithmetic.py): "<think>\n<steps>\n</think>\n\boxed{59}" then EOS.
    "embedded": ProbeProfile("<think>", "</think>", "<think>", "\n</think>\n\\boxed", "{", ("}",), True),
}
PROFILE_KEYS = tuple(f.name for f in fields(ProbeProfile))


def resolve_profile(preset: str, overrides: dict) -> ProbeProfile:
    """The preset's values with every non-None entry of ``overrides`` (keys of ``ProbeProfile``) replacing its own."""
    if preset not in PROFILE_PRESETS:
        raise ValueError(f"probe.profile must be one of {sorted(PROFILE_PRESETS)}, got {preset!r}")
    unknown = sorted(set(overrides) - set(PROFILE_KEYS))
    if unknown:
        raise ValueError(f"unknown profile key(s) {unknown}; accepted: {list(PROFILE_KEYS)}")
    base = PROFILE_PRESETS[preset]
    values = {name: getattr(base, name) for name in PROFILE_KEYS}
    values.update({name: value for name, value in overrides.items() if value is not None})
    return ProbeProfile(**values)


class ProbeTokenizer:
    """Tokenizes probe text as a continuation of a prefix (module docstring, "Joining"), with a cache.

    Args:
        tokenizer: a Hugging Face tokenizer (``encode``, ``decode``).
        tail_lengths: prefix tokens re-tokenized with the text, longest first; the first whose decoded text encodes
            back to the same tokens is used (a tail starting inside a character or a pre-token piece does not).
    """

    def __init__(self, tokenizer, tail_lengths: Sequence[int] = (6, 3, 1)):
        self.tokenizer = tokenizer
        self.tail_lengths = tuple(tail_lengths)
        self.split_joins = 0  # continuations that fell back to tokenizing the text on its own
        self._cache: dict[tuple[tuple[int, ...], str, bool], tuple[int, ...]] = {}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def continuation(self, context_ids: Sequence[int], text: str, *, exit_line: bool = False) -> tuple[int, ...]:
        """Tokens of ``text`` written right after ``context_ids``.

        ``exit_line``: the text starts with the exit text, whose leading whitespace is dropped where the context
        already ends with it (module docstring); other text (a step separator a continuation completes) is kept.
        """
        tail = self._tail(context_ids)
        key = (tail, text, exit_line)
        if key not in self._cache:
            self._cache[key] = self._join(tail, text, exit_line)
        return self._cache[key]

    def _tail(self, context_ids: Sequence[int]) -> tuple[int, ...]:
        for length in self.tail_lengths:
            tail = tuple(int(t) for t in context_ids[-length:])
            if tail and tuple(self.encode(self.decode(tail))) == tail:
                return tail
        return ()

    def _join(self, tail: tuple[int, ...], text: str, exit_line: bool) -> tuple[int, ...]:
        if not tail:
            return tuple(self.encode(text))
        tail_text = self.decode(tail)
        if exit_line:
            text = text[_whitespace_overlap(tail_text, text) :]
        joint = self.encode(tail_text + text)
        if tuple(joint[: len(tail)]) == tail:
            return tuple(joint[len(tail) :])
        self.split_joins += 1
        return tuple(self.encode(text))


def _whitespace_overlap(before: str, text: str) -> int:
    """Length of the longest whitespace run that starts ``text`` and ends ``before``."""
    run = len(text) - len(text.lstrip())
    for length in range(run, 0, -1):
        if before.endswith(text[:length]):
            return length
    return 0
