"""The driver's fast paths give what the straightforward ones gave: IBPO's rewrite guard without a full alignment and
a step's repairs judged together, batched decoding, probe planning's per-turn thinking end, short probe contexts,
cached tails and repair banks decoded only where read, segmentation's vectorised layout.

Real inputs are `benchmarks/driver_share.py`'s step: the shipped problems' solutions tokenised by the miniature
Qwen3-family tokenizer, resumed repairs that leave the trace at its divergence point (the benchmark's stand-in
engine), local repairs that keep most of it. Each oracle below is the code the fast path replaced, kept here only;
for repairs judged together, the one-at-a-time ``evaluate_repair`` (which now delegates to ``evaluate_repairs``) and
its own former body, and for decoding the tokenizer's own ``decode``.
"""

import dataclasses
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from benchmarks import driver_share
from rredcot_verl.core.ibpo import (
    IBPOSettings,
    RepairEvaluation,
    align_tokens,
    distance_exceeds,
    divergence_point,
    evaluate_repair,
    evaluate_repairs,
    localisation_mask,
    repair_metrics,
    repair_signal,
    kept_prefix_length,
    repair_failure,
    revision_budget,
)
from rredcot_verl.core.ibpo.evaluation import _keeps_prefix, _rewrite_bound
from rredcot_verl.core.planning import (
    BANK_FROM_REPAIRS,
    _group_banks,
    _opened_and_bodies,
    _Planner,
    _thinking_text,
    _value_rule,
    plan_traces,
)
from rredcot_verl.core import profiles
from rredcot_verl.core.profiles import decode_batch
from rredcot_verl.core.segmentation import _Layout, segment_response, turn_spans
from rredcot_verl.core.settings import settings_from_config
from rredcot_verl.core.traces import TraceRecord
from rredcot_verl.tasks import miniature, resolve_task

torch.set_num_threads(1)


# ------------------------------------------------------------------ oracles: the replaced code
def judged_by_full_alignment(trace, repair, verified, truncated, cfg, max_repair_tokens=None):
    """(correct, rewrite, failure, alignment) as evaluate_repair judged before its guard was cut off at its bound:
    every correct repair aligned in full and the guard read from the alignment."""
    limit = revision_budget(len(trace), cfg) if max_repair_tokens is None else max_repair_tokens
    failure = "empty" if not repair else "truncated" if truncated else "too_long" if len(repair) > limit else None
    if not (verified and failure is None):
        return False, False, failure, None
    alignment = align_tokens(trace, repair)
    kept = alignment.kept_prefix > 0 and alignment.kept_prefix >= cfg.min_kept_prefix * len(trace)
    return True, alignment.edit_ratio > cfg.max_edit_ratio and not kept, None, alignment


def judged_alone(trace, repair, verified, truncated, cfg, max_repair_tokens=None):
    """``evaluate_repair`` as it judged before it delegated to ``evaluate_repairs``: its own distance, cut off at its
    own bound (``distance_exceeds``), never a batch's."""
    failure = repair_failure(len(trace), len(repair), truncated, cfg, max_repair_tokens)
    if not (verified and failure is None):
        return RepairEvaluation(correct=False, rewrite=False, failure=failure, alignment=None, trace_length=len(trace))
    kept = kept_prefix_length(trace, repair)
    bound = _rewrite_bound(len(trace), cfg)
    rewrite = not _keeps_prefix(kept, len(trace), cfg) and bound is not None and distance_exceeds(trace, repair, bound)
    return RepairEvaluation(correct=True, rewrite=rewrite, failure=None,
                            alignment=None if rewrite else align_tokens(trace, repair), kept_prefix=kept,
                            trace_length=len(trace))


def thinking_end_per_state(think_end_id, response, turns, start):
    """The thinking end a state's probe was given, computed at every state."""
    turn_start, turn_stop = next(((a, b) for a, b in turns if a <= start < b), (start, len(response)))
    if think_end_id is not None and think_end_id in response[turn_start:turn_stop]:
        return response.index(think_end_id, turn_start, turn_stop)
    return len(response)


def turn_spans_by_loop(trained):
    turns, start = [], None
    for p, is_trained in enumerate([*trained, False]):
        if is_trained and start is None:
            start = p
        elif not is_trained and start is not None:
            turns.append((start, p))
            start = None
    return turns


def assert_same_judgement(evaluation, oracle, trace_length):
    correct, rewrite, failure, alignment = oracle
    assert (evaluation.correct, evaluation.rewrite, evaluation.failure) == (correct, rewrite, failure)
    assert evaluation.trace_length == trace_length
    if not correct:
        assert evaluation.alignment is None and evaluation.kept_prefix is None
        return
    assert evaluation.kept_prefix == alignment.kept_prefix
    if rewrite:
        assert evaluation.alignment is None  # nothing reads a rewrite's mask
    else:
        assert evaluation.alignment.distance == alignment.distance
        assert evaluation.alignment.edit_ratio == alignment.edit_ratio
        assert evaluation.alignment.kept_prefix == alignment.kept_prefix
        assert torch.equal(evaluation.alignment.edited_mask, alignment.edited_mask)


# ------------------------------------------------------------------ IBPO: randomized cases
@settings(max_examples=400, deadline=None)
@given(
    trace=st.lists(st.integers(0, 3), max_size=30),
    repair=st.lists(st.integers(0, 3), max_size=36),
    shared=st.integers(0, 30),
    max_edit_ratio=st.sampled_from([0.05, 0.25, 0.5, 1 / 3, 0.7, 1.0, 2.0, math.inf, "exact"]),
    min_kept_prefix=st.sampled_from([0.0, 0.1, 0.25, 0.9, 2.0]),
    verified=st.booleans(),
    truncated=st.booleans(),
)
def test_the_rewrite_guard_without_alignment_judges_as_the_full_alignment(trace, repair, shared, max_edit_ratio,
                                                                          min_kept_prefix, verified, truncated):
    # A small vocabulary makes many equally cheap alignments; "exact": δ equal to the repair's own edit ratio, the
    # bound's edge, where the distance must not count as above it.
    repair = trace[:shared] + repair
    if max_edit_ratio == "exact":
        max_edit_ratio = max(align_tokens(trace, repair).edit_ratio, 1e-9)
    cfg = IBPOSettings(max_edit_ratio=max_edit_ratio, min_kept_prefix=min_kept_prefix)
    evaluation = evaluate_repair(trace, repair, verified, truncated and verified, cfg, max_repair_tokens=60)
    oracle = judged_by_full_alignment(trace, repair, verified, truncated and verified, cfg, max_repair_tokens=60)
    assert_same_judgement(evaluation, oracle, len(trace))


# ------------------------------------------------------------------ IBPO and planning: driver_share's step
@pytest.fixture(scope="module")
def step():
    recipe = OmegaConf.load(driver_share.PAPER_RECIPE)
    tokenizer, problems = driver_share.qwen3_tokenizer()
    shape = driver_share.recipe_shape(recipe, 8, 3000)
    return tokenizer, driver_share.synthetic_step(tokenizer, problems, shape, seed=0), settings_from_config(
        recipe.algorithm)


def repairs_of(traces, i, rng):
    """A trace's repairs of the kinds a step holds: resumed at the divergence point from each sibling with another
    trace's body (a fresh solve), a deep local edit, a cut-short continuation, a copy of a sibling, the trace
    extended."""
    trace = traces[i]["response"]
    siblings = [t for j, t in enumerate(traces) if t["group"] == traces[i]["group"] and j != i]
    others = [t for t in traces if t["group"] != traces[i]["group"]]
    repairs = []
    for sibling in siblings:
        k = divergence_point(trace, sibling["response"])
        repairs.append(trace[:k] + rng.choice(others)["body"][k:])
        repairs.append(sibling["response"])
    for cut in (0.1, 0.3, 0.6, 0.95):
        k = int(cut * len(trace))
        edited = list(trace)
        for position in rng.sample(range(k, len(trace)), 5):
            edited[position] = rng.randrange(1000)
        repairs.append(edited)
        repairs.append(trace[:k] + rng.choice(others)["body"][: len(trace) - k])
    repairs.append(trace + trace[-20:])
    return repairs


@pytest.mark.parametrize("cfg", [IBPOSettings(), IBPOSettings(max_edit_ratio=0.05, min_kept_prefix=0.5),
                                 IBPOSettings(max_edit_ratio=math.inf), IBPOSettings(rewrite_counts_as_repair=True)])
def test_repairs_of_real_traces_are_judged_as_by_full_alignment(step, cfg):
    _, traces, _ = step
    rng = random.Random(0)
    wrong = [i for i, t in enumerate(traces) if not t["outcome"]]
    fast, oracle = [], []
    for i in wrong:
        trace = traces[i]["response"]
        evaluations, oracles = [], []
        for n, repair in enumerate(repairs_of(traces, i, rng)):
            verified = n % 5 != 4  # some wrong answers among them
            evaluations.append(evaluate_repair(trace, repair, verified, False, cfg, max_repair_tokens=25_000))
            oracles.append(judged_by_full_alignment(trace, repair, verified, False, cfg, max_repair_tokens=25_000))
            assert_same_judgement(evaluations[-1], oracles[-1], len(trace))
        # φ and the mask, from judgements that agree field by field, are the same as the oracle's.
        oracle_local = [o for o in oracles if o[0] and not o[1]]
        oracle_mask = (min(oracle_local, key=lambda o: o[3].distance)[3].edited_mask if oracle_local
                       else torch.zeros(len(trace), dtype=torch.bool))
        assert torch.equal(localisation_mask(evaluations, len(trace)), oracle_mask)
        deltas = [cfg.repair_bonus if o[0] and (cfg.rewrite_counts_as_repair or not o[1]) else 0.0 for o in oracles]
        assert repair_signal(False, evaluations, cfg) == pytest.approx(sum(deltas) / len(deltas))
        fast += evaluations
        oracle += oracles
    # The step has both kinds, so both paths ran.
    assert any(o[0] and o[1] for o in oracle) and any(o[0] and not o[1] for o in oracle) or cfg.max_edit_ratio == math.inf
    metrics = repair_metrics(fast)
    verified = [o for o in oracle if o[0]]
    assert metrics["ibpo/kept_prefix_frac_mean"] == pytest.approx(
        sum(o[3].kept_prefix / o[3].edited_mask.numel() for o in verified) / len(verified))
    assert metrics["ibpo/rewrite_frac"] == pytest.approx(sum(o[1] for o in verified) / len(verified))


def test_probe_contexts_and_thinking_ends_are_those_of_the_whole_trace(step):
    tokenizer, traces, recipe_settings = step
    planner = _Planner(recipe_settings, tokenizer, resolve_task(recipe_settings.task))
    rng = random.Random(1)
    exit_text = planner.profile.exit_text
    for trace in traces:
        prompt, response = list(trace["prompt"]), list(trace["response"])
        turns = [(0, len(response))]
        for start in [0, 1, 5, 6, 7, *rng.sample(range(len(response)), 30), len(response)]:
            whole = planner.probe_tokenizer.continuation(prompt + response[:start], exit_text, exit_line=True)
            short = planner.probe_tokenizer.continuation(planner.context(prompt, response, start), exit_text,
                                                         exit_line=True)
            assert short == whole
            span = next(((a, b) for a, b in turns if a <= start < b), (start, len(response)))
            assert planner.thinking_end(response, span) == thinking_end_per_state(
                planner.think_end_id, response, turns, start)
    # several turns: a state's thinking ends in its own turn
    response = [5] * 10 + [planner.think_end_id] + [6] * 9 + [7] * 10 + [planner.think_end_id] + [8] * 5
    turns = [(0, 20), (25, 36)]
    for start in range(len(response)):
        span = next(((a, b) for a, b in turns if a <= start < b), (start, len(response)))
        assert planner.thinking_end(response, span) == thinking_end_per_state(
            planner.think_end_id, response, turns, start)


# ------------------------------------------------------------------ segmentation's layout
@settings(max_examples=200, deadline=None)
@given(trained=st.lists(st.booleans(), max_size=60))
def test_vectorised_turns_and_layout_match_the_loops(trained):
    assert turn_spans(trained) == turn_spans(torch.tensor(trained, dtype=torch.bool)) == turn_spans_by_loop(trained)
    if not any(trained):
        return
    recipe_settings = settings_from_config(OmegaConf.load(driver_share.PAPER_RECIPE).algorithm)
    vocab = dataclasses.make_dataclass("Vocab", ["think_end_id"])(None)
    layout = _Layout([1] * len(trained), torch.tensor(trained, dtype=torch.bool), vocab, recipe_settings.segmentation)
    rank = [0]
    for is_trained in trained:
        rank.append(rank[-1] + is_trained)
    assert layout.rank == rank and layout.rank_tensor.tolist() == rank
    assert layout.policy_positions == [p for p, is_trained in enumerate(trained) if is_trained]
    assert layout.trained == trained and layout.turns == turn_spans_by_loop(trained)


def test_the_rewrite_bound_is_the_ratio_test_in_float_arithmetic():
    # floor(δ·L) misses by one where δ·L rounds below an integer (δ = 15/11: (15/11)·11 < 15); the guard's bound is
    # the largest distance d with d / L <= δ as the full alignment's ratio test computes it.
    from rredcot_verl.core.ibpo.evaluation import _rewrite_bound

    for length in range(1, 120):
        for distance in range(0, 3 * length):
            cfg = IBPOSettings(max_edit_ratio=max(distance / length, 1e-9))
            bound = _rewrite_bound(length, cfg)
            assert bound / length <= cfg.max_edit_ratio < (bound + 1) / length
    assert _rewrite_bound(10, IBPOSettings(max_edit_ratio=math.inf)) is None
    assert _rewrite_bound(0, IBPOSettings(max_edit_ratio=0.5)) == 0  # an empty trace: ratio = distance


# ------------------------------------------------------------------ IBPO: a step's repairs judged together
def assert_same_evaluations(batched, one_by_one):
    assert len(batched) == len(one_by_one)
    for fast, oracle in zip(batched, one_by_one):
        assert (fast.correct, fast.rewrite, fast.failure, fast.kept_prefix, fast.trace_length) == (
            oracle.correct, oracle.rewrite, oracle.failure, oracle.kept_prefix, oracle.trace_length)
        assert (fast.alignment is None) == (oracle.alignment is None)
        if oracle.alignment is not None:
            assert fast.alignment.distance == oracle.alignment.distance
            assert torch.equal(fast.alignment.edited_mask, oracle.alignment.edited_mask)


@settings(max_examples=300, deadline=None)
@given(
    cases=st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=30), st.lists(st.integers(0, 3), max_size=36),
                             st.integers(0, 30), st.booleans(), st.booleans(), st.sampled_from([None, 20, 60])),
                   max_size=8),
    max_edit_ratio=st.sampled_from([0.05, 0.25, 0.5, 1 / 3, 0.7, 1.0, 2.0, math.inf]),
    min_kept_prefix=st.sampled_from([0.0, 0.1, 0.25, 0.9, 2.0]),
    workers=st.sampled_from([1, 2, -1]),
)
def test_repairs_judged_together_are_judged_as_one_at_a_time(cases, max_edit_ratio, min_kept_prefix, workers):
    # Traces of different lengths in one batch: the shared cutoff is the largest bound, not each repair's own.
    cfg = IBPOSettings(max_edit_ratio=max_edit_ratio, min_kept_prefix=min_kept_prefix)
    traces = [trace for trace, *_ in cases]
    repairs = [trace[:shared] + repair for trace, repair, shared, *_ in cases]
    verified = [ok for *_, ok, _, _ in cases]
    truncated = [cut and ok for *_, ok, cut, _ in cases]
    limits = [limit for *_, limit in cases]
    batched = evaluate_repairs(traces, repairs, verified, truncated, cfg, limits, workers=workers)
    one_by_one = [evaluate_repair(t, r, ok, cut, cfg, max_repair_tokens=limit)
                  for t, r, ok, cut, limit in zip(traces, repairs, verified, truncated, limits)]
    assert_same_evaluations(batched, one_by_one)
    assert_same_evaluations(one_by_one, [judged_alone(t, r, ok, cut, cfg, max_repair_tokens=limit)
                                         for t, r, ok, cut, limit in zip(traces, repairs, verified, truncated, limits)])


@pytest.mark.parametrize("cfg", [IBPOSettings(), IBPOSettings(max_edit_ratio=0.05, min_kept_prefix=0.5),
                                 IBPOSettings(max_edit_ratio=math.inf)])
def test_real_repairs_judged_together_are_judged_as_one_at_a_time(step, cfg):
    _, traces, _ = step
    rng = random.Random(2)
    pairs = []
    for i, t in enumerate(traces):
        if not t["outcome"]:
            # cut to different lengths, so the repairs' bounds differ within the batch
            cut = rng.randrange(len(t["response"]) // 3, len(t["response"]) + 1)
            pairs += [(t["response"][:cut], repair) for repair in repairs_of(traces, i, rng)]
    verified = [n % 5 != 4 for n in range(len(pairs))]
    batched = evaluate_repairs([t for t, _ in pairs], [r for _, r in pairs], verified, [False] * len(pairs), cfg,
                               [25_000] * len(pairs))
    one_by_one = [evaluate_repair(t, r, ok, False, cfg, max_repair_tokens=25_000)
                  for (t, r), ok in zip(pairs, verified)]
    assert_same_evaluations(batched, one_by_one)
    assert_same_evaluations(one_by_one, [judged_alone(t, r, ok, False, cfg, max_repair_tokens=25_000)
                                         for (t, r), ok in zip(pairs, verified)])
    # both kinds, so the guard's distances and the alignments both ran (no rewrite without a bound)
    assert any(e.correct and not e.rewrite for e in one_by_one)
    assert any(e.rewrite for e in one_by_one) == math.isfinite(cfg.max_edit_ratio)


# ------------------------------------------------------------------ decoding and planning: the step's texts
def test_batched_decoding_gives_the_tokenizers_texts(step):
    tokenizer, traces, _ = step
    rng = random.Random(3)
    specials = tokenizer.all_special_ids
    sequences = [t["response"] for t in traces] + [[]] + [
        [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(len(tokenizer)) for _ in range(500)]
        for _ in range(4)]
    for skip in (True, False):
        oracle = [tokenizer.decode(s, skip_special_tokens=skip) for s in sequences]
        assert decode_batch(tokenizer, sequences, skip_special_tokens=skip) == oracle
        as_tensors = [torch.tensor(s, dtype=torch.int64) for s in sequences]
        assert decode_batch(tokenizer, as_tensors, skip_special_tokens=skip) == oracle
        # a tokenizer that cleans up spaces decodes through its own batch_decode, clean-up included
        assert decode_batch(tokenizer, sequences, skip_special_tokens=skip, clean_up_tokenization_spaces=True) == [
            tokenizer.decode(s, skip_special_tokens=skip, clean_up_tokenization_spaces=True) for s in sequences]
    assert decode_batch(tokenizer, [], skip_special_tokens=True) == []


def random_ids(tokenizer, rng, length):
    """Ids the byte-level table must decode as the backend does: single bytes (UTF-8 cut mid-character), any token,
    every added token."""
    added = sorted(tokenizer.backend_tokenizer.get_added_tokens_decoder())
    return [rng.choice(added) if r < 0.1 else rng.randrange(300) if r < 0.6 else rng.randrange(len(tokenizer))
            for r in (rng.random() for _ in range(length))]


@pytest.mark.parametrize("family", ["qwen3", "r1_distill"])
def test_byte_level_tokenizers_decode_by_table_as_the_backend_does(family):
    """The table path (a lone ``ByteLevel`` decoder) on both kinds of added token: spelled with byte-level characters
    (``<|im_end|>``) and without (R1's ``<｜User｜>``); invalid UTF-8 replaced as the backend replaces it; an id the
    vocabulary lacks or a token added after the first decode left to the backend or a rebuilt table."""
    tokenizer = miniature.family_tokenizer(miniature.FAMILIES[family], ["the sum of 12 and 30 is 42\n\n"] * 4,
                                           miniature.MiniatureConfig(vocab_size=400))
    assert profiles._ByteLevelTable.of(tokenizer) is not None
    rng = random.Random(5)
    sequences = [random_ids(tokenizer, rng, 400) for _ in range(30)]
    for skip in (True, False):
        assert decode_batch(tokenizer, sequences, skip_special_tokens=skip) == [
            tokenizer.decode(s, skip_special_tokens=skip) for s in sequences]
    assert any("\ufffd" in tokenizer.decode(s) for s in sequences)
    outside = [sequences[0][:50] + [len(tokenizer) + 7] + sequences[0][50:100]]
    assert decode_batch(tokenizer, outside, skip_special_tokens=False) == [tokenizer.decode(outside[0])]
    tokenizer.add_tokens(["<|later|>"])
    later = [sequences[1][:20] + [len(tokenizer) - 1] + sequences[1][20:40]]
    assert "<|later|>" in decode_batch(tokenizer, later, skip_special_tokens=True)[0]
    assert decode_batch(tokenizer, later, skip_special_tokens=True) == [
        tokenizer.decode(later[0], skip_special_tokens=True)]


def test_tokenizers_without_a_byte_level_decoder_decode_in_the_backend():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "▁the": 1, "▁sum": 2, "▁is": 3, "▁42": 4}, unk_token="[UNK]"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=False)
    assert profiles._ByteLevelTable.of(tokenizer) is None
    sequences = [[1, 2, 3, 4], [4, 0, 1]]
    assert decode_batch(tokenizer, sequences, skip_special_tokens=False) == [tokenizer.decode(s) for s in sequences]
    assert decode_batch(tokenizer, sequences, skip_special_tokens=False)[0] == "the sum is 42"


def tokens_before_by_search(probe_tokenizer, response, offset):
    """``_Planner.tokens_before`` as it searched before every prefix's length came from one pass: a binary search over
    decoded prefixes."""
    low, high = 0, len(response)
    while low < high:
        middle = (low + high + 1) // 2
        if len(probe_tokenizer.tokenizer.decode(response[:middle], skip_special_tokens=False,
                                                clean_up_tokenization_spaces=False)) <= offset:
            low = middle
        else:
            high = middle - 1
    return low


@pytest.mark.parametrize("family", ["qwen3", "r1_distill"])
def test_prefix_lengths_are_the_decoded_prefixes(family):
    """Every prefix's decoded length from one pass over the bytes: prefixes cut inside a multi-byte character (one
    U+FFFD), added tokens; a sequence that is not valid UTF-8 gets None (its prefixes are decoded)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokenizer = miniature.family_tokenizer(miniature.FAMILIES[family], ["the sum of 12 and 30 is 42\n\n"] * 4,
                                           miniature.MiniatureConfig(vocab_size=400))
    probe_tokenizer = profiles.ProbeTokenizer(tokenizer)
    text = "Été: 12 + 30 = 42 — 数学 😀 <think>\nso 42</think>\n\n**Final Answer** \\boxed{42}<|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    prefixes = [tokenizer.decode(ids[:m], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                for m in range(len(ids) + 1)]
    assert probe_tokenizer.prefix_lengths(ids).tolist() == [len(prefix) for prefix in prefixes]
    assert any(prefix.endswith("\ufffd") for prefix in prefixes)
    lead_byte = tokenizer.convert_tokens_to_ids(bytes_to_unicode()[0xE4])
    broken = ids[:5] + [lead_byte] + ids[5:9]
    assert "\ufffd" in tokenizer.decode(broken) and probe_tokenizer.prefix_lengths(broken) is None


def test_answer_regions_found_in_one_pass_are_those_the_binary_search_found(step):
    tokenizer, traces, _ = step
    recipe = OmegaConf.load(driver_share.PAPER_RECIPE)
    recipe.algorithm.rredcot.probe.profile = "plain"
    plain = settings_from_config(recipe.algorithm)
    planner = _Planner(plain, tokenizer, resolve_task(plain.task))
    rng = random.Random(7)
    for trace in traces:
        response = trace["response"]
        length = len(planner.probe_tokenizer.decode(response))
        offsets = [0, 1, length - 1, length] + [rng.randrange(length) for _ in range(20)]
        assert [planner.tokens_before(response, o) for o in offsets] == [
            tokens_before_by_search(planner.probe_tokenizer, response, o) for o in offsets]
        text = planner.probe_tokenizer.decode(response)
        assert planner.answer_start(response, text) < len(response)  # the step's traces write an answer


def tail_by_scan(probe_tokenizer, context):
    """The tail ``ProbeTokenizer`` joined text to before it cached tails: the longest that decodes and encodes back."""
    for length in probe_tokenizer.tail_lengths:
        tail = tuple(int(t) for t in context[-length:])
        if tail and tuple(probe_tokenizer.encode(probe_tokenizer.decode(tail))) == tail:
            return tail
    return ()


def test_cached_tails_are_those_of_the_scan(step):
    tokenizer, traces, recipe_settings = step
    planner = _Planner(recipe_settings, tokenizer, resolve_task(recipe_settings.task))
    rng = random.Random(4)
    for trace in traces:
        prompt, response = list(trace["prompt"]), list(trace["response"])
        for start in [0, 1, 2, 5, *rng.sample(range(len(response)), 60)]:
            context = planner.context(prompt, response, start)
            assert planner.probe_tokenizer._tail(context) == tail_by_scan(planner.probe_tokenizer, context)
            assert planner.probe_tokenizer._tail(prompt + response[:start]) == tail_by_scan(
                planner.probe_tokenizer, prompt + response[:start])
    assert planner.probe_tokenizer._tail([]) == ()


def test_repair_banks_decoded_where_read_are_the_eager_banks(step):
    tokenizer, traces, recipe_settings = step
    bank_settings = dataclasses.replace(recipe_settings, candidates=dataclasses.replace(
        recipe_settings.candidates, source="group_and_repairs"))
    task = resolve_task(bank_settings.task)
    planner = _Planner(bank_settings, tokenizer, task)
    rng = random.Random(5)
    records = [TraceRecord(torch.tensor(t["prompt"]), torch.tensor(t["response"]), None, t["outcome"], t["group"],
                           t["truth"]) for t in traces]
    # every group gets repairs: the right answer closing another trace's body
    repairs = {t["group"]: [t["response"][:40] + rng.choice(traces)["body"][:300]
                            + driver_share.closing_ids(tokenizer, t["truth"])] for t in traces}
    texts = planner.probe_tokenizer.decode_batch([r.response_ids for r in records])
    opened = [planner.opened_by_prompt(r.prompt_ids.tolist()) for r in records]
    decoded = []

    def counting_decode(ids_of_group):
        decoded.append(len(ids_of_group))
        return planner.probe_tokenizer.decode_batch(ids_of_group)

    lazy = _group_banks(records, texts, opened, bank_settings, task, repairs, planner.profile, counting_decode)
    eager_texts = {group: [tokenizer.decode(r, skip_special_tokens=False) for r in ids] for group, ids in repairs.items()}
    eager = _group_banks(records, texts, opened, bank_settings, task, eager_texts, planner.profile, lambda texts: texts)
    assert lazy.keys() == eager.keys()
    for group in eager:
        assert dataclasses.asdict(lazy[group]) == dataclasses.asdict(eager[group])
    without_correct = {t["group"] for t in traces} - {t["group"] for t in traces if t["outcome"]}
    assert any(BANK_FROM_REPAIRS in eager[group].sources for group in without_correct)
    assert len(decoded) == len(without_correct) < len(repairs)  # only the groups that bank repairs are decoded


def test_exit_probe_banks_without_steps_hold_the_answers_of_banks_with_them(step):
    # Exit probes read a bank's answers and sources alone; the steps are split only for reference continuations.
    tokenizer, traces, recipe_settings = step
    task = resolve_task(recipe_settings.task)
    records = [TraceRecord(torch.tensor(t["prompt"]), torch.tensor(t["response"]), None, t["outcome"], t["group"],
                           t["truth"]) for t in traces]
    banks = {}
    for source in ("exit_probe", "reference_continuation"):
        use = dataclasses.replace(recipe_settings, probe=dataclasses.replace(recipe_settings.probe, value_source=source))
        planner = _Planner(use, tokenizer, task)
        texts = planner.probe_tokenizer.decode_batch([r.response_ids for r in records])
        opened = [planner.opened_by_prompt(r.prompt_ids.tolist()) for r in records]
        banks[source] = _group_banks(records, texts, opened, use, task, {}, planner.profile, None)
    assert banks["exit_probe"].keys() == banks["reference_continuation"].keys()
    assert any(bank.correct_steps for bank in banks["reference_continuation"].values())  # correct traces, split
    for group, bank in banks["reference_continuation"].items():
        fast = banks["exit_probe"][group]
        assert (fast.correct_answers, fast.all_answers, fast.sources) == (
            bank.correct_answers, bank.all_answers, bank.sources)


# ------------------------------------------------------------------ planning spread over worker processes
def plan_traces_in_one_loop(traces, settings, tokenizer, task, *, vocab=None, temperature=1.0, repairs=None):
    """``plan_traces`` before its per-trace part could run in worker processes: one loop over the traces, one
    planner."""
    vocab = vocab or settings.boundary_vocab(tokenizer)
    planner = _Planner(settings, tokenizer, task)
    texts = planner.probe_tokenizer.decode_batch([t.response_ids for t in traces])
    own_texts = [text if t.response_mask is None else planner.probe_tokenizer.decode(
        t.response_ids[t.response_mask.bool()].tolist()) for t, text in zip(traces, texts)]
    by_prompt = [planner.opened_by_prompt(t.prompt_ids.tolist()) for t in traces]
    banks = _group_banks(traces, own_texts, by_prompt, settings, task, repairs or {}, planner.profile,
                         planner.probe_tokenizer.decode_batch)
    rule = _value_rule(settings)
    source = settings.probe.value_source
    plans = []
    for trace, text, prompt_opened in zip(traces, texts, by_prompt):
        bank = banks[trace.group]
        plan = dataclasses.replace(trace, outcome=float(trace.outcome), segment_ends=[], probes=[], value_rule=rule,
                                   success=settings.success_probability(trace.outcome), temperature=float(temperature),
                                   bank_sources=frozenset(bank.sources))
        if trace.response_ids.numel() > 0:
            plan.segment_ends = segment_response(trace.response_ids, trace.entropy, vocab, settings.segmentation,
                                                 response_mask=trace.response_mask)
            if plan.segment_ends and rule != "own_continuation":
                if bank.correct_answers:
                    response = trace.response_ids.tolist()
                    reference = source == "reference_continuation"
                    starts = plan.starts
                    if not planner.profile.thinks:
                        answer_start = planner.answer_start(response, text)
                        starts = [min(start, answer_start) for start in starts]
                    opened, bodies = _opened_and_bodies(planner, trace, response, starts, prompt_opened, reference)
                    if reference:
                        trace_steps = len(task.split_steps(_thinking_text(text, planner.profile, prompt_opened)))
                        plan.probes = planner.reference_probes(trace, response, starts, bank, opened, bodies,
                                                               trace_steps)
                    else:
                        plan.probes = planner.exit_probes(trace, response, starts, bank, opened)
                else:
                    plan.no_candidates = True
        plans.append(plan)
    return plans


def assert_same_plans(plans, oracle):
    assert len(plans) == len(oracle)
    for plan, expected in zip(plans, oracle):
        for name in ("prompt_ids", "response_ids", "response_mask"):
            a, b = getattr(plan, name), getattr(expected, name)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
        assert (plan.outcome, plan.success, plan.segment_ends, plan.value_rule, plan.no_candidates, plan.temperature,
                plan.bank_sources) == (expected.outcome, expected.success, expected.segment_ends, expected.value_rule,
                                       expected.no_candidates, expected.temperature, expected.bank_sources)
        assert plan.probes == expected.probes


def planning_settings(recipe_settings, value_source="exit_probe", candidates=None, profile=None):
    probe = dataclasses.replace(recipe_settings.probe, value_source=value_source,
                                **({"profile": profile} if profile else {}))
    use = dataclasses.replace(recipe_settings, probe=probe)
    if candidates:
        use = dataclasses.replace(use, candidates=dataclasses.replace(use.candidates, source=candidates))
    return use


def step_records(tokenizer, traces, seed, multi_turn=False):
    """The step's traces as the planner reads them: entropies uniform noise; ``multi_turn``: every other trace has a
    tool's output (mask 0) inside its response."""
    generator = torch.Generator().manual_seed(seed)
    records = []
    for n, t in enumerate(traces):
        response = torch.tensor(t["response"])
        mask = None
        if multi_turn and n % 2:
            mask = torch.ones(response.numel(), dtype=torch.int64)
            mask[response.numel() // 3: response.numel() // 3 + 50] = 0
        records.append(TraceRecord(torch.tensor(t["prompt"]), response, 2 * torch.rand(response.numel(),
                                   generator=generator), t["outcome"], t["group"], t["truth"],
                                   response_mask=mask))
    return records


@pytest.fixture(scope="module")
def planning_step():
    """The step's traces at two lengths: 2,500 tokens, and 600 for reference continuations, whose banks hold the
    group's correct traces whole (each boundary tokenizes every one's rest: minutes at 2,500 tokens)."""
    recipe = OmegaConf.load(driver_share.PAPER_RECIPE)
    tokenizer, problems = driver_share.qwen3_tokenizer()
    steps = {length: driver_share.synthetic_step(tokenizer, problems, driver_share.recipe_shape(recipe, 16, length),
                                                 seed=1)
             for length in (600, 2500)}  # 16 traces: every kind of group, 0, 1, 2 and 3 correct of 4
    return tokenizer, steps, settings_from_config(recipe.algorithm)


@pytest.mark.parametrize("case", [
    {},  # the recipe: exit probes, banks from the group and the dataset
    {"candidates": "group"},  # all-wrong groups without a candidate
    {"candidates": "group_and_repairs"},
    {"value_source": "reference_continuation"},
    {"value_source": "own_continuation"},
    {"profile": "plain"},  # no thinking markers: the workers read each trace's text
    {"multi_turn": True},
    {"value_source": "reference_continuation", "multi_turn": True},
])
def test_plans_from_worker_processes_are_those_of_the_one_loop(planning_step, case):
    tokenizer, steps, recipe_settings = planning_step
    case = dict(case)
    traces = steps[600 if case.get("value_source") == "reference_continuation" else 2500]
    records = step_records(tokenizer, traces, seed=7, multi_turn=case.pop("multi_turn", False))
    use = planning_settings(recipe_settings, **case)
    task = resolve_task(use.task)
    rng = random.Random(8)
    repairs = {t["group"]: [t["response"][:30] + rng.choice(traces)["body"][:400]
                            + driver_share.closing_ids(tokenizer, t["truth"])] for t in traces}
    oracle = plan_traces_in_one_loop(records, use, tokenizer, task, temperature=0.7, repairs=repairs)
    assert any(plan.probes for plan in oracle) or use.probe.value_source == "own_continuation"
    for workers in (1, 2):  # one pool of two workers for the whole file: each starts in seconds (spawn)
        assert_same_plans(plan_traces(records, use, tokenizer, task, temperature=0.7, repairs=repairs,
                                      workers=workers), oracle)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 400), min_size=1, max_size=9),
    seed=st.integers(0, 2**16),
    value_source=st.sampled_from(["exit_probe", "reference_continuation"]),
    profile=st.sampled_from([None, "plain"]),
    workers=st.sampled_from([1, 2]),
)
def test_plans_of_random_traces_from_worker_processes_are_those_of_the_one_loop(planning_step, lengths, seed,
                                                                                 value_source, profile, workers):
    # Random token ids, thinking markers, boxed answers and special tokens among them; outcomes and groups at random.
    tokenizer, steps, recipe_settings = planning_step
    traces = steps[600]
    rng = random.Random(seed)
    use = planning_settings(recipe_settings, value_source, "both", profile)
    task = resolve_task(use.task)
    markers = tokenizer.encode("<think>\n</think>\n\n\\boxed{4}\n\n", add_special_tokens=False)
    vocabulary = [*range(len(tokenizer)), *markers * 20]
    records = []
    for n, length in enumerate(lengths):
        response = torch.tensor([rng.choice(vocabulary) for _ in range(length)], dtype=torch.int64)
        entropy = torch.tensor([rng.random() * 2 for _ in range(length)])
        records.append(TraceRecord(torch.tensor(traces[n % len(traces)]["prompt"]), response, entropy,
                                   float(rng.random() < 0.4), f"g{n % 3}", rng.choice(["4", "7", None])))
    oracle = plan_traces_in_one_loop(records, use, tokenizer, task)
    assert_same_plans(plan_traces(records, use, tokenizer, task, workers=workers), oracle)


def test_planning_workers_follow_the_tokens_and_the_cores():
    from rredcot_verl.core.planning import PLANNING_TOKENS_PER_WORKER, planning_workers

    def traces(count, length):
        return [TraceRecord(torch.zeros(1), torch.zeros(length, dtype=torch.int64), None, 0.0, "g")] * count

    assert planning_workers(traces(512, 25_000), cores=16) == 16  # the paper's step on a 16-core driver
    assert planning_workers(traces(512, 25_000), cores=1) == 1
    assert planning_workers(traces(64, 200), cores=16) == 1  # a CPU miniature's step: not worth a dispatch
    assert planning_workers(traces(4, PLANNING_TOKENS_PER_WORKER // 2), cores=16) == 2
