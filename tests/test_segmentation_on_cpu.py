"""Segmentation strategies on a real byte-level BPE tokenizer trained here (Qwen2-style pre-tokenizer, so newlines
merge with neighbours: "\\n\\n", ".\\n", ":\\n")."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rredcot_verl.core.segmentation import (
    STRATEGIES,
    TURN_STRATEGIES,
    BoundaryVocab,
    SegmentationSettings,
    segment_response,
)

torch.set_num_threads(1)

# Qwen2's pre-tokenizer split: punctuation keeps its trailing newlines (".\n"), newline runs stay together ("\n\n").
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
OPENERS = ["Wait,", "So", "Then", "Let me", "Hmm,", "Some", "Now", "We", "Thus", "Alternatively,", "First", "Next"]


def _corpus(lines: int = 300) -> list[str]:
    rng = random.Random(0)
    words = "the sum is we add carry check answer value of and then step number result".split()
    docs = []
    for _ in range(lines // 6):
        body = []
        for _ in range(6):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            sentence = f"{rng.choice(OPENERS)} {' '.join(rng.sample(words, 4))} {a}+{b}={a + b}"
            body.append(sentence + rng.choice([".\n", "\n\n", ":\n", "\n", ".\n\n"]))
        docs.append("".join(body) + "</think>The answer is 42.")
    return docs


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "</think>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return BoundaryVocab.from_tokenizer(tokenizer, SegmentationSettings(), think_end="</think>")


def _encode(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)


def _line_starts(tokenizer, text: str) -> list[int]:
    """Token indices where a new line of ``text`` begins, found from character offsets (not from the module)."""
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    char_starts = {i + 1 for i, ch in enumerate(text) if ch == "\n"}
    return [p for p, (start, _) in enumerate(encoding["offset_mapping"]) if p > 0 and start in char_starts]


def _assert_contract(ends: list[int], length: int, cfg: SegmentationSettings, fixed: set[int]):
    assert ends[-1] == length
    assert all(a < b for a, b in zip(ends, ends[1:])), ends
    assert ends[0] > 0
    assert len(ends) <= cfg.max_segments
    starts = [0] + ends[:-1]
    for start, end in zip(starts, ends):
        if not ({start, end} <= fixed):  # only segments between two fixed boundaries may be short
            assert end - start >= cfg.min_segment_len, (start, end, ends)


THINKING = (
    "First we add 12 and 30.\n"
    "So the sum is 42.\n\n"
    "Wait, check the carry again:\n"
    "Some more words about the value of the sum and then the check.\n"
    "  Hmm, the value is fine.\n"
    "Let me verify: 12+30=42.\n"
    "Thus the result is 42.\n"
)
RESPONSE = THINKING + "</think>The answer is 42."


def test_tokenizer_merges_newlines_with_neighbours(tokenizer, vocab):
    pieces = [tokenizer.decode([i]) for i in _encode(tokenizer, RESPONSE).tolist()]
    merged = [p for p in pieces if "\n" in p and p != "\n"]
    assert {".\n", ".\n\n", ":\n"} <= set(merged), pieces
    ids = _encode(tokenizer, RESPONSE).tolist()
    newline_ids = {i for i, p in zip(ids, pieces) if "\n" in p}
    assert newline_ids and all(vocab.has_newline[i] for i in newline_ids)
    assert not any(vocab.has_newline[i] for i in set(ids) - newline_ids)
    assert vocab.think_end_id == tokenizer.convert_tokens_to_ids("</think>")


def test_vocab_without_single_token_think_end(tokenizer):
    vocab = BoundaryVocab.from_tokenizer(tokenizer, SegmentationSettings(), think_end="<answer>")
    assert vocab.think_end_id is None
    cfg = SegmentationSettings(strategy="fixed")
    ids = _encode(tokenizer, "<answer>" + THINKING)
    ends = segment_response(ids, None, vocab, cfg)
    pieces = len(ids) // cfg.min_segment_len  # no marker recognised: the whole text is split evenly
    assert ends == [k * len(ids) // pieces for k in range(1, pieces + 1)]


def test_empty_response(vocab):
    for strategy in STRATEGIES:
        cfg = SegmentationSettings(strategy=strategy)
        assert segment_response(torch.zeros(0, dtype=torch.long), torch.zeros(0), vocab, cfg) == []


def test_hybrid_keeps_highest_entropy_newlines_and_think_end(tokenizer, vocab):
    ids = _encode(tokenizer, RESPONSE)
    think = ids.tolist().index(vocab.think_end_id)
    starts = [p for p in _line_starts(tokenizer, RESPONSE) if p < think]
    assert len(starts) == 6  # 7 lines; the first starts at 0
    entropies = torch.full((len(ids),), 0.1)
    # Rank the line starts by entropy: 3rd > 5th > 1st > others; the tokens after them are low.
    for rank, line in enumerate([2, 4, 0, 1, 3, 5]):
        entropies[starts[line]] = 3.0 - 0.4 * rank
    cfg = SegmentationSettings(max_segments=5, min_segment_len=1)
    ends = segment_response(ids, entropies, vocab, cfg)
    # 5 segments = 3 free cuts + the thinking end + the answer segment.
    assert ends == sorted([starts[2], starts[4], starts[0]]) + [think, len(ids)]
    _assert_contract(ends, len(ids), cfg, {0, think, len(ids)})


def test_hybrid_min_segment_len_drops_the_lower_scored_neighbour(tokenizer, vocab):
    text = (
        "We add the value of the number and the sum.\n"
        "So 1.\n"
        "Then the sum of the value is the number and the result.\n"
        "Now we check the answer again.\n"
    )
    ids = _encode(tokenizer, text + "</think>42")
    think = ids.tolist().index(vocab.think_end_id)
    a, b, c = _line_starts(tokenizer, text)[:3]
    assert b - a < 8 <= c - b  # the "So 1." line is short
    entropies = torch.full((len(ids),), 0.1)
    entropies[a], entropies[b], entropies[c] = 2.0, 2.5, 1.0
    cfg = SegmentationSettings(min_segment_len=8)
    ends = segment_response(ids, entropies, vocab, cfg)
    assert b in ends and a not in ends  # a and b are too close: the lower-scored a goes
    _assert_contract(ends, len(ids), cfg, {0, think, len(ids)})
    entropies[a] = 3.0
    ends = segment_response(ids, entropies, vocab, cfg)
    assert a in ends and b not in ends


def test_no_newline_gives_one_segment_or_think_split(tokenizer, vocab):
    cfg = SegmentationSettings()
    ids = _encode(tokenizer, "We add the value and the number then check the answer")
    assert segment_response(ids, torch.rand(len(ids)), vocab, cfg) == [len(ids)]
    ids = _encode(tokenizer, "We add the value and the number</think>The answer is 42.\nDone.\nYes.")
    think = ids.tolist().index(vocab.think_end_id)
    # Newlines after </think> are in the answer, which is never cut.
    assert segment_response(ids, torch.rand(len(ids)), vocab, cfg) == [think, len(ids)]


def test_think_end_at_position_zero_is_not_a_boundary(tokenizer, vocab):
    ids = _encode(tokenizer, "</think>The answer is 42.\nSo it is 42.\n")
    assert ids[0] == vocab.think_end_id
    for strategy in STRATEGIES:
        cfg = SegmentationSettings(strategy=strategy, min_segment_len=1)
        assert segment_response(ids, torch.rand(len(ids)), vocab, cfg) == [len(ids)]


def test_leading_newline_never_yields_position_zero(tokenizer, vocab):
    ids = _encode(tokenizer, "\n\nWait, we add.\nSo the sum.\n")
    entropies = torch.zeros(len(ids))
    entropies[0] = 10.0
    for strategy in STRATEGIES:
        ends = segment_response(ids, entropies, vocab, SegmentationSettings(strategy=strategy, min_segment_len=1))
        assert ends[0] > 0 and ends[-1] == len(ids)


def test_keyword_strategy_cuts_only_before_keyword_lines(tokenizer, vocab):
    text = (
        "We add the numbers.\n"
        "Some words about the sum.\n"  # "Some" is not "So"
        "So the sum is 42.\n"
        "  Hmm, indented.\n"
        "the value of the result.\n"
        "Let me check: 42.\n"  # two-token keyword
        "Sofa is not a keyword.\n"
        "Wait\n"
    )
    ids = _encode(tokenizer, text)
    starts = _line_starts(tokenizer, text)
    cfg = SegmentationSettings(strategy="keyword", min_segment_len=1)
    ends = segment_response(ids, None, vocab, cfg)
    # starts[j] opens line j + 1: "So", "  Hmm", "Let me" and "Wait" lines match; "Some", "Sofa" do not.
    assert ends == [starts[1], starts[2], starts[4], starts[6], len(ids)]
    # A budget below the matches spreads the kept cuts over the trace instead of taking the first ones.
    few = SegmentationSettings(strategy="keyword", min_segment_len=1, max_segments=3)
    thinned = segment_response(ids, None, vocab, few)
    assert thinned == [starts[2], starts[6], len(ids)]


def test_fixed_strategy_splits_evenly_without_short_pieces(tokenizer, vocab):
    ids = torch.tensor(tokenizer.encode("we add the value " * 20, add_special_tokens=False)[:50])
    ends = segment_response(ids, None, vocab, SegmentationSettings(strategy="fixed", min_segment_len=8))
    assert ends == [8, 16, 25, 33, 41, 50]  # floor(50 / 8) = 6 pieces
    ends = segment_response(ids, None, vocab, SegmentationSettings(strategy="fixed", max_segments=3))
    assert ends == [16, 33, 50]
    with_think = torch.cat([ids[:30], torch.tensor([vocab.think_end_id]), ids[:9]])
    ends = segment_response(with_think, None, vocab, SegmentationSettings(strategy="fixed", min_segment_len=10))
    assert ends == [10, 20, 30, 40]  # the thinking part in 3, then the answer in one


def test_entropy_strategy_takes_peaks_with_min_gap(tokenizer, vocab):
    ids = torch.tensor(tokenizer.encode("we add the value " * 20, add_special_tokens=False)[:60])
    entropies = torch.full((60,), 0.5)
    entropies[[10, 13, 30, 55, 0]] = torch.tensor([2.0, 3.0, 2.5, 4.0, 9.0])
    cfg = SegmentationSettings(strategy="entropy", min_segment_len=8, max_segments=3)
    # 13 beats its neighbour 10; 55 is within 8 of the end; 0 is never a boundary.
    assert segment_response(ids, entropies, vocab, cfg) == [13, 30, 60]
    # A larger budget is filled with the next-best positions, still 8 apart.
    roomy = SegmentationSettings(strategy="entropy", min_segment_len=8, max_segments=40)
    ends = segment_response(ids, entropies, vocab, roomy)
    assert {13, 30} <= set(ends) and 10 not in ends and len(ends) == 6
    _assert_contract(ends, 60, roomy, {0, 60})
    window = SegmentationSettings(strategy="entropy", min_segment_len=8, entropy_window=4, max_segments=2)
    entropies = torch.full((60,), 0.5)
    entropies[20], entropies[40:44] = 3.0, 2.0  # mean over 4 tokens: 1.125 at 20, 2.0 at 40
    assert segment_response(ids, entropies, vocab, window) == [40, 60]


def test_entropy_strategies_need_entropies(tokenizer, vocab):
    ids = _encode(tokenizer, RESPONSE)
    for strategy in ("entropy", "hybrid"):
        with pytest.raises(ValueError, match=strategy):
            segment_response(ids, None, vocab, SegmentationSettings(strategy=strategy))
    with pytest.raises(ValueError, match="entropies shape"):
        segment_response(ids, torch.zeros(3), vocab, SegmentationSettings())
    with pytest.raises(ValueError, match="NaN"):
        segment_response(ids, torch.full((len(ids),), float("nan")), vocab, SegmentationSettings())


def test_bad_inputs_raise(tokenizer, vocab):
    with pytest.raises(ValueError, match="outside the tokenizer vocabulary"):
        segment_response(torch.tensor([1, vocab.vocab_size]), None, vocab, SegmentationSettings(strategy="fixed"))
    with pytest.raises(ValueError, match="1-D"):
        segment_response(torch.zeros(2, 3, dtype=torch.long), None, vocab, SegmentationSettings(strategy="fixed"))
    with pytest.raises(ValueError, match="other keywords"):
        segment_response(torch.tensor([1]), None, vocab, SegmentationSettings(strategy="keyword", keywords=("Wait",)))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(strategy="random"), "strategy"),
        (dict(max_segments=1), "max_segments"),
        (dict(min_segment_len=0), "min_segment_len"),
        (dict(entropy_window=0), "entropy_window"),
        (dict(keywords="Wait"), "keywords"),
        (dict(strategy="keyword", keywords=()), "at least one keyword"),
        (dict(keywords=("a\nb",)), "newline"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SegmentationSettings(**kwargs)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    strategy=st.sampled_from(STRATEGIES),
    max_segments=st.integers(2, 6),
    min_segment_len=st.integers(1, 6),
    entropy_window=st.integers(1, 3),
)
def test_contract_on_random_token_sequences(
    tokenizer, vocab, data, strategy, max_segments, min_segment_len, entropy_window
):
    newline_ids = torch.nonzero(vocab.has_newline).flatten().tolist()
    pool = newline_ids + list(range(vocab.vocab_size))  # plenty of newlines
    ids = data.draw(st.lists(st.sampled_from(pool), max_size=80), label="ids")
    if data.draw(st.booleans(), label="with </think>") and ids:
        ids.insert(data.draw(st.integers(0, len(ids) - 1), label="think at"), vocab.think_end_id)
    ids = torch.tensor(ids, dtype=torch.long)
    entropies = torch.tensor(data.draw(st.lists(st.floats(0, 5), min_size=len(ids), max_size=len(ids)), label="H"))
    cfg = SegmentationSettings(strategy, max_segments, min_segment_len, entropy_window=entropy_window)
    ends = segment_response(ids, entropies, vocab, cfg)
    if len(ids) == 0:
        assert ends == []
        return
    fixed = {0, len(ids)}
    if vocab.think_end_id in ids.tolist():
        think = ids.tolist().index(vocab.think_end_id)
        fixed.add(think)
        assert think == 0 or think in ends
        assert all(e <= think for e in ends[:-1])  # the answer is one segment
    _assert_contract(ends, len(ids), cfg, fixed)
    if strategy in ("hybrid", "keyword"):
        assert all(vocab.has_newline[ids[e - 1]] for e in ends if e not in fixed)


# ---------------------------------------------------------------------------------------------- multi-turn responses


def _tool_loop_response(tokenizer, turns: list[str], tool_outputs: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """A response laid out as verl's tool agent loop writes it (ChatML builder): each assistant turn ends with the
    end-of-turn token (here the tokenizer's EOS) and has mask 1; after it the builder's separator "\\n" and the tool
    message with the next assistant header, mask 0. A tool output after the last turn is a response cut at
    ``response_length`` there."""
    ids, mask = [], []
    for j, turn in enumerate(turns):
        turn_ids = tokenizer.encode(turn, add_special_tokens=False) + [tokenizer.eos_token_id]
        ids, mask = ids + turn_ids, mask + [1] * len(turn_ids)
        if j < len(tool_outputs):
            context = tokenizer.encode(f"\nuser\n<tool_response>\n{tool_outputs[j]}\n</tool_response>\nassistant\n",
                                       add_special_tokens=False)
            ids, mask = ids + context, mask + [0] * len(context)
    return torch.tensor(ids), torch.tensor(mask)


def _turn_spans(mask: torch.Tensor) -> list[tuple[int, int]]:
    """(start, stop) of each run of ones, computed here independently of the module."""
    padded = torch.cat([torch.zeros(1, dtype=torch.long), mask.long(), torch.zeros(1, dtype=torch.long)])
    steps = padded[1:] - padded[:-1]
    return list(zip(torch.nonzero(steps == 1).flatten().tolist(), torch.nonzero(steps == -1).flatten().tolist()))


TOOL_TURNS = [
    "First we add 12 and 30.\nSo the sum is 42.\n\nWait, check the carry again:\n",
    "Let me verify: 12+30=42.\nThus the result is 42.\n",
    "Some more words about the value of the sum and then the check.\nThe answer is 42.",
]


def test_turns_make_each_assistant_turn_a_segment(tokenizer, vocab):
    ids, mask = _tool_loop_response(tokenizer, TOOL_TURNS, ["42", "ok", "truncated out"])
    spans = _turn_spans(mask)
    assert len(spans) == 3 and mask[-1] == 0  # the trailing tool output is context too
    ends = segment_response(ids, None, vocab, SegmentationSettings(strategy="turns"), response_mask=mask)
    assert ends == [spans[1][0], spans[2][0], spans[2][1]]  # starts of turns 2 and 3, then the last model token + 1


def test_turns_cut_further_inside_each_turn_only(tokenizer, vocab):
    ids, mask = _tool_loop_response(tokenizer, TOOL_TURNS, ["42", "ok"])
    spans = _turn_spans(mask)
    entropies = torch.rand(len(ids), generator=torch.Generator().manual_seed(0))
    cfg = SegmentationSettings(strategy="turns", turn_strategy="hybrid", min_segment_len=3)
    ends = segment_response(ids, entropies, vocab, cfg, response_mask=mask)
    assert {spans[1][0], spans[2][0]} <= set(ends) and len(ends) > 3  # the turn starts, and cuts inside turns
    for start, end in zip([0, *ends[:-1]], ends):
        assert mask[start] == 1  # a segment starts on a model token
        assert sum(start < s < end for s, _ in spans) == 0  # and never spans two turns


def test_think_end_is_found_in_every_turn(tokenizer, vocab):
    """A thinking model writes <think>...</think> then its tool call in every turn: each turn's answer is one
    segment, for ``turns`` and for the single-response strategies alike (before, only the first </think> counted)."""
    turns = [f"{thinking}</think>call add(12, 30)" for thinking in TOOL_TURNS]
    ids, mask = _tool_loop_response(tokenizer, turns, ["42", "ok"])
    spans = _turn_spans(mask)
    think_ends = [p for p, token in enumerate(ids.tolist()) if token == vocab.think_end_id]
    assert len(think_ends) == 3
    answers = {think_ends[0], spans[1][0], think_ends[1], spans[2][0], think_ends[2], spans[2][1]}
    ends = segment_response(ids, None, vocab, SegmentationSettings(strategy="turns"), response_mask=mask)
    assert ends == sorted(answers)
    entropies = torch.rand(len(ids), generator=torch.Generator().manual_seed(1))
    for strategy in ("hybrid", "fixed", "keyword", "entropy"):
        cfg = SegmentationSettings(strategy=strategy, min_segment_len=2)
        ends = segment_response(ids, entropies, vocab, cfg, response_mask=mask)
        assert answers <= set(ends), strategy
        for think_end in think_ends:  # nothing cuts an answer: the next end is its turn's end
            following = ends[ends.index(think_end) + 1]
            assert following in (spans[1][0], spans[2][0], spans[2][1]), (strategy, ends)


def test_turn_strategy_needs_the_turns_strategy():
    with pytest.raises(ValueError, match="needs strategy 'turns'"):
        SegmentationSettings(strategy="hybrid", turn_strategy="fixed")
    with pytest.raises(ValueError, match="turn_strategy must be one of"):
        SegmentationSettings(strategy="turns", turn_strategy="turns")
    with pytest.raises(ValueError, match="needs token entropies"):
        segment_response(torch.tensor([1, 2]), None, _any_vocab(), SegmentationSettings("turns", turn_strategy="entropy"))


def _any_vocab() -> BoundaryVocab:
    return BoundaryVocab(torch.zeros(4, dtype=torch.bool), {}, ("",) * 4, None, SegmentationSettings().keywords, "")


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    strategy=st.sampled_from([*STRATEGIES, *(f"turns/{inner}" for inner in TURN_STRATEGIES)]),
    max_segments=st.integers(2, 6),
    min_segment_len=st.integers(1, 6),
)
def test_contract_with_holes_on_random_token_sequences(tokenizer, vocab, data, strategy, max_segments, min_segment_len):
    """Random turns and holes: the last end is one past the last model token, every segment starts on a model
    token and holds at least ``min_segment_len`` of them unless both its ends are fixed (0, a turn start under
    ``turns``, a </think> or the start of the turn after it, the end); with no hole the mask changes nothing."""
    newline_ids = torch.nonzero(vocab.has_newline).flatten().tolist()
    pool = newline_ids + list(range(vocab.vocab_size)) + [vocab.think_end_id] * 20
    ids = torch.tensor(data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=80), label="ids"))
    mask = torch.tensor(data.draw(st.lists(st.sampled_from([1, 1, 1, 0]), min_size=len(ids), max_size=len(ids))))
    mask[0] = 1
    entropies = torch.tensor(data.draw(st.lists(st.floats(0, 5), min_size=len(ids), max_size=len(ids)), label="H"))
    name, _, inner = strategy.partition("/")
    cfg = SegmentationSettings(name, max_segments, min_segment_len, turn_strategy=inner or "none")
    ends = segment_response(ids, entropies, vocab, cfg, response_mask=mask)
    spans = _turn_spans(mask)
    assert ends[-1] == spans[-1][1]
    assert all(a < b for a, b in zip(ends, ends[1:]))
    fixed = {0, spans[-1][1]}
    for j, (start, stop) in enumerate(spans):
        turn = ids[start:stop].tolist()
        if name == "turns":
            fixed.add(start)
        if vocab.think_end_id in turn:
            fixed.add(start + turn.index(vocab.think_end_id))
            fixed |= {spans[j + 1][0]} if j + 1 < len(spans) else set()
    assert fixed - {0} <= set(ends)
    assert len(set(ends) - fixed) <= max(0, max_segments - len(fixed - {0}))  # free cuts within the budget
    for start, end in zip([0, *ends[:-1]], ends):
        assert mask[start] == 1
        if not {start, end} <= fixed:
            assert int(mask[start:end].sum()) >= min_segment_len, (start, end, ends)
    if bool(mask.all()):
        assert ends == segment_response(ids, entropies, vocab, cfg)
