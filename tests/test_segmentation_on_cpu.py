"""Segmentation strategies on a real byte-level BPE tokenizer trained here (Qwen2-style pre-tokenizer, so newlines
merge with neighbours: "\\n\\n", ".\\n", ":\\n")."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rredcot_verl.core.segmentation import STRATEGIES, BoundaryVocab, SegmentationSettings, segment_response

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
