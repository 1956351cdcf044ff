"""Probe profiles: how a model family writes its thinking and its answer, and how probe text is tokenized after a prefix.

A profile (``algorithm.rredcot.probe.profile``) fixes the text a probe forces and scores:

- ``think_start`` / ``think_end``: the thinking markers (single tokens of the tokenizer); ``think_end`` also fixes the
  segmentation's answer segment. Both empty (with ``think_opener``): a model that reasons without a thinking block
  (Qwen2.5-Instruct, Llama, Mistral): the whole response is the reasoning, every state is probed as if thinking were
  open, and the answer region starts where the response writes the exit text (or the final answer marker, the exit
  text's last line such as ``\\boxed`` or ``####``); states inside it are probed from its start (``planning``).
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
Answer styles and presets. The exit text ends with the answer's lead, which belongs to the task's answer format
(``Task.answer_style``): ``boxed`` (``**Final Answer**\\n\\boxed`` then ``{answer}`` and a closing) or ``gsm8k``
(verl's GSM8K convention, a last line ``#### 42`` then EOS: ``####`` then `` 42``, closed by EOS alone or by a newline
before it, since a bare ``42`` also starts ``420``). A preset name is a model family; ``preset(name,
answer_style)`` gives its profile for the style (``PROFILE_PRESETS`` holds the ``boxed`` ones). ``plain`` is the family
without thinking markers.

``auto`` (``detect_family``): the family read from the tokenizer, where one exists (the planner, the workers):
``r1_distill`` when the generation prompt ends by opening thinking (``<think>\\n``: DeepSeek-R1-Distill, QwQ,
Qwen3-*-Thinking-2507); ``qwen3`` when the vocabulary has ``<think>``/``</think>`` as single tokens and the template
has Qwen3's thinking switch (``enable_thinking=false`` closes an empty thinking block in the prompt, the default
leaves the model to open it); ``plain`` otherwise (no markers, no template, or a template that never opens thinking).
Imports nothing from verl, ray or the tasks.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np

__all__ = ["ANSWER_STYLES", "AUTO", "PROFILE_PRESETS", "ProbeProfile", "ProbeTokenizer", "answer_region_start",
           "decode_batch", "detect_family", "preset", "resolve_profile"]

# Closing texts chat models write right after a boxed answer, as the Qwen2 pre-tokenizer cuts them (inline math
# ``}$``, end of sentence ``}.``/``}$.``, display math or a line end ``}\n``/``}\n\n``, a bare ``}``).
_CHAT_CLOSINGS = ("}", "}$", "}$.", "}.", "}\n", "}\n\n")


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
        if not self.exit_text or not self.exit_text.strip():
            raise ValueError(f"probe.exit_text must be a non-blank string, got {self.exit_text!r}")
        markers = (self.think_start, self.think_end, self.think_opener)
        if any(markers) and not all(markers):
            # Half a thinking block cannot be probed: either the family thinks (all three) or it does not (none).
            raise ValueError(f"probe.think_start, think_end and think_opener must all be set or all be empty "
                             f"(a model without thinking), got {markers}")
        if not self.think_opener.startswith(self.think_start):
            raise ValueError(
                f"probe.think_opener must start with think_start {self.think_start!r}, got {self.think_opener!r}"
            )
        if not isinstance(self.answer_eos, bool):
            raise ValueError(f"probe.answer_eos must be true or false, got {self.answer_eos!r}")
        closings = self.answer_closings
        # An empty closing is the answer followed directly by EOS: only meaningful when EOS is appended.
        if isinstance(closings, str) or not closings or not all(
            isinstance(c, str) and (c or self.answer_eos) for c in closings
        ):
            raise ValueError(f"probe.answer_closings must be a non-empty list of non-empty strings (an empty one only "
                             f"with answer_eos), got {closings!r}")
        object.__setattr__(self, "answer_closings", tuple(closings))

    @property
    def thinks(self) -> bool:
        """The family writes a thinking block (False: the whole response is the reasoning)."""
        return bool(self.think_start)

    @property
    def answer_markers(self) -> tuple[str, ...]:
        """Texts whose last occurrence starts a response's answer region: the exit text without its leading
        whitespace and thinking marker, then its last line (``\\boxed``, ``####``)."""
        lead = self.exit_text
        if self.think_end and self.think_end in lead:
            lead = lead.split(self.think_end, 1)[1]
        lead = lead.strip()
        last_line = lead.split("\n")[-1].strip()
        return tuple(dict.fromkeys(m for m in (lead, last_line) if m))


PROFILE_KEYS = tuple(f.name for f in fields(ProbeProfile))
ANSWER_STYLES = ("boxed", "gsm8k")
AUTO = "auto"
AUTO_FAMILIES = ("qwen3", "r1_distill", "plain")  # what detect_family may pick
# verl's GSM8K convention (examples/data_preprocess/gsm8k.py, utils/reward_score/gsm8k.py): "#### 42" ends the
# response. The space is the answer's prefix so that the exit text ends with its own pre-token ("####"). No "."
# closing: verl's reward reads "#### 42." as "42." and scores it 0.
_GSM8K_CLOSINGS = ("", "\n")
_FAMILIES = {
    # family: (think_start, think_end, think_opener, text before the answer lead, extra boxed closings)
    "qwen3": ("<think>", "</think>", "<think>\n", "\n</think>\n\n", ()),
    "r1_distill": ("<think>", "</think>", "<think>\n", "\n</think>\n\n", ("}\\",)),
    # No thinking block: the answer follows the reasoning after a blank line (boxed) or on its own line (gsm8k).
    "plain": ("", "", "", "\n\n", ()),
}


def _family_profile(family: str, style: str) -> ProbeProfile:
    start, end, opener, before, closings = _FAMILIES[family]
    if style == "gsm8k":
        before = before.replace("\n\n", "\n") if family == "plain" else before
        return ProbeProfile(start, end, opener, before + "####", " ", _GSM8K_CLOSINGS, True)
    return ProbeProfile(start, end, opener, before + "**Final Answer**\n\\boxed", "{", (*_CHAT_CLOSINGS, *closings),
                        False)


_STYLED: dict[tuple[str, str], ProbeProfile] = {
    (family, style): _family_profile(family, style) for family in _FAMILIES for style in ANSWER_STYLES
}
# The embedded arithmetic task (tasks/arithmetic.py): "<think>\n<steps>\n</think>\n\boxed{59}" then EOS.
_STYLED["embedded", "boxed"] = ProbeProfile("<think>", "</think>", "<think>", "\n</think>\n\\boxed", "{", ("}",), True)
# Qwen3 thinking mode: the response opens with "<think>\n"; the answer follows "</think>\n\n". DeepSeek-R1-Distill-Qwen:
# the prompt ends with "<think>\n" (opener only for older templates that do not); display answers "\[\boxed{..}\]"
# close with "}\". plain: no thinking block (Qwen2.5-Instruct, Llama, Mistral).
PROFILE_PRESETS: dict[str, ProbeProfile] = {family: _STYLED[family, "boxed"] for family in (*_FAMILIES, "embedded")}


def preset(name: str, answer_style: str = "boxed") -> ProbeProfile:
    """The family ``name``'s profile for the task's answer style (``ANSWER_STYLES``)."""
    if answer_style not in ANSWER_STYLES:
        raise ValueError(f"answer style must be one of {ANSWER_STYLES}, got {answer_style!r}")
    if name not in PROFILE_PRESETS:
        raise ValueError(f"probe.profile must be one of {sorted([AUTO, *PROFILE_PRESETS])}, got {name!r}")
    if (name, answer_style) not in _STYLED:
        raise ValueError(f"probe.profile {name!r} has no {answer_style!r} answer text: set probe.exit_text, "
                         "answer_prefix, answer_closings and answer_eos, or use another profile")
    return _STYLED[name, answer_style]


def resolve_profile(name: str, overrides: dict, answer_style: str = "boxed", tokenizer=None) -> ProbeProfile:
    """The preset's values for ``answer_style`` with every non-None entry of ``overrides`` (keys of ``ProbeProfile``)
    replacing its own. ``name`` ``auto`` needs ``tokenizer`` (``detect_family``)."""
    unknown = sorted(set(overrides) - set(PROFILE_KEYS))
    if unknown:
        raise ValueError(f"unknown profile key(s) {unknown}; accepted: {list(PROFILE_KEYS)}")
    if name == AUTO:
        if tokenizer is None:
            raise ValueError("probe.profile=auto is resolved from the tokenizer; none was given")
        name = detect_family(tokenizer)
    base = preset(name, answer_style)
    values = {key: getattr(base, key) for key in PROFILE_KEYS}
    values.update({key: value for key, value in overrides.items() if value is not None})
    return ProbeProfile(**values)


def _single_token_id(tokenizer, text: str) -> int | None:
    try:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    except Exception:  # noqa: BLE001 - a tokenizer without this text is simply without the marker
        return None
    return ids[0] if len(ids) == 1 else None


def _generation_prompt(tokenizer, **kwargs) -> str | None:
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        return tokenizer.apply_chat_template([{"role": "user", "content": "1 + 1 = ?"}], tokenize=False,
                                             add_generation_prompt=True, **kwargs)
    except Exception:  # noqa: BLE001 - a template that cannot render a plain user turn opens no thinking either
        return None


def detect_family(tokenizer) -> str:
    """``qwen3``, ``r1_distill`` or ``plain`` from a Hugging Face tokenizer's vocabulary and chat template (rule in
    the module docstring, "auto"; why this rule: docs/choices.md)."""
    start, end = _FAMILIES["qwen3"][:2]
    if _single_token_id(tokenizer, start) is None or _single_token_id(tokenizer, end) is None:
        return "plain"
    prompt = _generation_prompt(tokenizer)
    if prompt is None:
        return "plain"
    tail = prompt.rstrip()
    if tail.endswith(start):
        return "r1_distill"
    if tail.endswith(end):  # the template closes thinking itself: the model answers without it
        return "plain"
    switched_off = _generation_prompt(tokenizer, enable_thinking=False)
    if switched_off is not None and switched_off != prompt and switched_off.rstrip().endswith(end):
        return "qwen3"
    return "plain"


def answer_region_start(text: str, profile: ProbeProfile) -> int:
    """Character offset where a response of a model without thinking starts its final answer: the last occurrence
    of the first of ``profile.answer_markers`` it holds, else ``len(text)`` (no answer written)."""
    for marker in profile.answer_markers:
        found = text.rfind(marker)
        if found >= 0:
            return found
    return len(text)


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
        self._tails: dict[tuple[int, ...], tuple[int, ...]] = {}  # by the context's last ``context_needed`` tokens

    @property
    def context_needed(self) -> int:
        """The last tokens of a context that :meth:`continuation` reads (its longest tail)."""
        return max(self.tail_lengths, default=0)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """The tokenizer's ``decode`` (special tokens kept, no clean-up), through :func:`decode_batch`'s table where
        there is one: planning decodes prefixes of a trace many times (a model without thinking markers: about 15
        per trace to find its answer region)."""
        return decode_batch(self.tokenizer, [ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)[0]

    def decode_batch(self, sequences: Sequence) -> list[str]:
        """:meth:`decode` of each sequence (lists or 1-D tensors), in one call (:func:`decode_batch`)."""
        return decode_batch(self.tokenizer, sequences, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def prefix_lengths(self, ids: Sequence[int]) -> np.ndarray | None:
        """``len(self.decode(ids[:m]))`` for every m = 0 .. len(ids), in one pass where the tokenizer decodes by
        table (:func:`decode_batch`) and the text is valid UTF-8; None otherwise (decode the prefixes)."""
        ids = np.asarray(ids, dtype=np.int64)
        table = _ByteLevelTable.serving(self.tokenizer, [ids])
        return None if table is None else table.prefix_lengths(ids)

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
        # The tail depends on the last ``context_needed`` tokens alone; boundaries repeat them (".\n\n", ...).
        key = tuple(int(t) for t in context_ids[max(len(context_ids) - self.context_needed, 0):])
        if key not in self._tails:
            self._tails[key] = self._first_clean_tail(key)
        return self._tails[key]

    def _first_clean_tail(self, context_ids: tuple[int, ...]) -> tuple[int, ...]:
        for length in self.tail_lengths:
            tail = context_ids[-length:]
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


def decode_batch(tokenizer, sequences: Sequence, *, skip_special_tokens: bool,
                 clean_up_tokenization_spaces: bool | None = None) -> list[str]:
    """``tokenizer.batch_decode(sequences, ...)``, the same texts, faster for long sequences.

    A step's repairs and traces are hundreds of 25k-token sequences, decoded on the driver while the GPUs wait. A fast
    tokenizer whose decode adds nothing to its Rust backend's (no clean-up of tokenization spaces) decodes them:
    - with a byte-level decoder and nothing else (GPT-2, Qwen, Llama 3): by joining each token's bytes from a table
      and decoding the UTF-8 once (:class:`_ByteLevelTable`, the backend's own rule), several times less CPU than
      the backend;
    - otherwise in the backend's ``decode_batch``, which spreads the batch over the cores (the tokenizers library's
      thread pool; ``TOKENIZERS_PARALLELISM=false`` keeps it on one) and skips transformers' per-sequence Python.
    Any other tokenizer decodes through ``batch_decode``, lists passed as arrays (a tokenizer checks a list's ids one
    by one in Python before decoding it, an array's not at all).
    """
    if not sequences:  # a tokenizer would decode an empty batch as one empty sequence
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    clean_up = (getattr(tokenizer, "clean_up_tokenization_spaces", False) if clean_up_tokenization_spaces is None
                else clean_up_tokenization_spaces)
    if backend is not None and not clean_up:
        arrays = [np.asarray(s, dtype=np.int64) for s in sequences]
        table = _ByteLevelTable.serving(tokenizer, arrays)
        if table is not None:
            return [table.decode(ids, skip_special_tokens) for ids in arrays]
        return backend.decode_batch([ids.tolist() for ids in arrays], skip_special_tokens=skip_special_tokens)
    return tokenizer.batch_decode([np.asarray(s, dtype=np.int64) if isinstance(s, (list, tuple)) else s
                                   for s in sequences],
                                  skip_special_tokens=skip_special_tokens,
                                  clean_up_tokenization_spaces=clean_up_tokenization_spaces)


class _ByteLevelTable:
    """Each token's bytes, as a tokenizers ``ByteLevel`` decoder writes them, for decoding by table.

    The backend's rule (tokenizers' ``ByteLevel::decode_chain``): a token whose characters are all byte-level
    characters is those bytes, any other (an added token such as ``<|im_end|>`` spelled with other characters) its
    UTF-8; the tokens' bytes are joined and decoded once, an invalid sequence becoming U+FFFD (Rust's
    ``from_utf8_lossy`` and Python's ``errors="replace"`` replace the same maximal invalid parts). Ids the vocabulary
    lacks are dropped, as the backend drops them; special added tokens are dropped under ``skip_special_tokens``.
    Built once per tokenizer (one loop over its vocabulary), only for a decoder that is ``ByteLevel`` alone.
    """

    _built: "weakref.WeakKeyDictionary[object, _ByteLevelTable | None]" = weakref.WeakKeyDictionary()

    def __init__(self, backend):
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        byte_of = {character: byte for byte, character in bytes_to_unicode().items()}
        self.size = backend.get_vocab_size(True)
        added = backend.get_added_tokens_decoder()
        pieces: list[bytes] = []
        for token_id in range(max([self.size, *(i + 1 for i in added)])):
            token = backend.id_to_token(token_id)
            if token is None:
                pieces.append(b"")
            elif all(character in byte_of for character in token):
                pieces.append(bytes(byte_of[character] for character in token))
            else:
                pieces.append(token.encode("utf-8"))
        without_special = [b"" if token_id in added and added[token_id].special else piece
                           for token_id, piece in enumerate(pieces)]
        # object arrays: a sequence's pieces are gathered in one indexing, not a Python loop over its ids
        self.pieces, self.without_special = np.array(pieces, dtype=object), np.array(without_special, dtype=object)
        self.piece_bytes = np.array([len(piece) for piece in pieces], dtype=np.int64)

    @classmethod
    def of(cls, tokenizer) -> "_ByteLevelTable | None":
        """The table of ``tokenizer``'s backend (built once, dropped with the tokenizer: some tokenizers versions'
        backends take no weak reference), or None if its decoder is not a lone ``ByteLevel``."""
        from tokenizers.decoders import ByteLevel

        backend = tokenizer.backend_tokenizer
        table = cls._built.get(tokenizer)
        if tokenizer not in cls._built or (table is not None and table.size != backend.get_vocab_size(True)):
            # rebuilt after tokens were added to the tokenizer
            table = cls(backend) if isinstance(backend.decoder, ByteLevel) else None
            cls._built[tokenizer] = table
        return table

    @classmethod
    def serving(cls, tokenizer, arrays: list[np.ndarray]) -> "_ByteLevelTable | None":
        """The table that decodes ``arrays`` for ``tokenizer``: None for a tokenizer without a Rust backend or a
        byte-level decoder, or ids outside its vocabulary (the backend then decodes)."""
        if getattr(tokenizer, "backend_tokenizer", None) is None:
            return None
        table = cls.of(tokenizer)
        return table if table is not None and table.covers(arrays) else None

    def covers(self, arrays: list[np.ndarray]) -> bool:
        """Every id is in the table (an id outside it, negative included, is left to the backend to judge)."""
        return all(ids.size == 0 or (ids.min() >= 0 and ids.max() < len(self.pieces)) for ids in arrays)

    def decode(self, ids: np.ndarray, skip_special_tokens: bool) -> str:
        pieces = self.without_special if skip_special_tokens else self.pieces
        return b"".join(pieces[ids].tolist()).decode("utf-8", errors="replace")

    def prefix_lengths(self, ids: np.ndarray) -> np.ndarray | None:
        """``len(decode(ids[:m]))`` for m = 0 .. len(ids) (special tokens kept), or None where the sequence's bytes
        are not valid UTF-8. In valid UTF-8 every character has one lead byte (any byte but a continuation
        ``10xxxxxx``), and a prefix cut inside a character decodes that character as one U+FFFD: a prefix's length is
        the lead bytes among its bytes."""
        joined = b"".join(self.pieces[ids].tolist())
        try:
            joined.decode("utf-8")
        except UnicodeDecodeError:
            return None
        leads = np.concatenate(([0], np.cumsum((np.frombuffer(joined, dtype=np.uint8) & 0xC0) != 0x80)))
        return leads[np.concatenate(([0], np.cumsum(self.piece_bytes[ids])))]


def _whitespace_overlap(before: str, text: str) -> int:
    """Length of the longest whitespace run that starts ``text`` and ends ``before``."""
    run = len(text) - len(text.lstrip())
    for length in range(run, 0, -1):
        if before.endswith(text[:length]):
            return length
    return 0
