"""The batched value pass (``score_batch_packed`` / ``score_plans``) against the naive per-probe reference, on real
(tiny, random) Qwen2 models: micro-batching, mixed lengths, empty responses, plans without probes, skipped probes,
chunked log-probs, and every attention backend the model may be configured with."""

import dataclasses
import math
import random

import pytest
import torch
from transformers import AttentionInterface, Qwen2Config, Qwen2ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rredcot_verl.core import scoring as scoring_module
from rredcot_verl.core.traces import TraceRecord
from rredcot_verl.core.probes import Probe, build_exit_probes, own_continuation_values, values_from_probe_logp
from rredcot_verl.core.scoring import (
    ValuePassSettings,
    MIN_MICRO_BATCH_FILL,
    plan_micro_batches,
    score_batch_packed,
    score_batch_packed_with_stats,
)
from benchmarks.reference_scorers import score_probes_naive
from rredcot_verl.core.values import score_plans

VOCAB = 64
REL_TOL = 1e-5


def make_model(attn_implementation="sdpa", seed=0):
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation=attn_implementation,
    )
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return make_model()


def random_ids(rng, length):
    return torch.tensor([rng.randrange(VOCAB) for _ in range(length)], dtype=torch.long)


def random_probes(rng, response_len, count):
    """Boundaries include 0 and L; probes with and without forced ids, sharing leading tokens at a boundary."""
    shared_forced = [rng.randrange(VOCAB) for _ in range(3)]
    boundaries = [0, response_len] + [rng.randint(0, response_len) for _ in range(count)]
    out = []
    for index in range(count):
        forced = rng.choice([[], shared_forced, [rng.randrange(VOCAB)]])
        scored = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))]
        out.append(Probe(boundaries[index % len(boundaries)], forced, scored, value_index=index % 4))
    return out


def relative_error(actual, expected):
    both_nan = actual.isnan() & expected.isnan()
    assert (actual.isnan() == expected.isnan()).all()
    error = (actual - expected).abs() / expected.abs().clamp_min(1e-12)
    return error.masked_fill(both_nan, 0.0).max().item() if error.numel() else 0.0


def full_forward_log_probs(model, prompt, response):
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0, prompt.numel() - 1 : -1]
    log_probs = logits.float().log_softmax(-1)
    return log_probs.gather(-1, response[:, None])[:, 0], -(log_probs.exp() * log_probs).sum(-1)


def mixed_batch(seed, count=7):
    """Traces of mixed lengths, an empty response, one trace without probes, one with only 1-token probes."""
    rng = random.Random(seed)
    prompts, responses, probe_lists = [], [], []
    for index in range(count):
        prompt, response = random_ids(rng, rng.randint(1, 9)), random_ids(rng, rng.choice([0, 3, 17, 40, 61]))
        trace_probes = random_probes(rng, response.numel(), rng.randint(1, 10))
        if index == 1:
            response, trace_probes = response[:0], [Probe(0, [], [5], value_index=0), Probe(0, [7, 8], [9, 1], value_index=1)]
        if index == 2:
            trace_probes = []
        if index == 3:
            trace_probes = [Probe(b, [], [rng.randrange(VOCAB)], value_index=0) for b in (0, response.numel())]
        prompts.append(prompt), responses.append(response), probe_lists.append(trace_probes)
    return prompts, responses, probe_lists


@pytest.mark.parametrize(
    "max_token_len, min_fill", [(16384, 0.0), (16384, MIN_MICRO_BATCH_FILL), (60, MIN_MICRO_BATCH_FILL), (1, 0.0)]
)
def test_batched_pass_equals_naive_and_per_trace(model, monkeypatch, max_token_len, min_fill):
    # min_fill 0 puts every row of mixed width into one padded forward; the default fill splits them.
    monkeypatch.setattr(scoring_module, "MIN_MICRO_BATCH_FILL", min_fill)
    prompts, responses, probe_lists = mixed_batch(0)
    batch, stats = score_batch_packed_with_stats(
        model, prompts, responses, probe_lists, max_token_len=max_token_len, max_positions=45
    )
    # The trace without probes and without trace stats costs no forward; every other trace is in a micro-batch.
    assert stats.dummy_forwards == 0
    active = len(prompts) - 1
    if min_fill == 0.0:
        assert stats.micro_batches == (1 if max_token_len == 16384 else active)
    elif max_token_len == 16384:
        assert 2 <= stats.micro_batches < active  # the fill rule splits, but rows of similar shape still share
    else:
        assert stats.micro_batches >= 3
    skipped = 0
    for scores, prompt, response, trace_probes in zip(batch, prompts, responses, probe_lists):
        naive = score_probes_naive(model, prompt, response, trace_probes, max_positions=45)
        assert relative_error(scores.probe_logp, naive) < REL_TOL
        single = score_batch_packed(model, [prompt], [response], [trace_probes], max_positions=45)[0]
        assert relative_error(scores.probe_logp, single.probe_logp) < REL_TOL
        expected_log_probs, expected_entropy = full_forward_log_probs(model, prompt, response)
        torch.testing.assert_close(scores.trace_log_probs, expected_log_probs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(scores.trace_entropy, expected_entropy, rtol=1e-5, atol=1e-5)
        assert scores.num_skipped == int(naive.isnan().sum())
        skipped += scores.num_skipped
    assert skipped > 0  # max_positions=45 skips some probes of the long traces


def test_log_probs_come_from_bounded_chunks_and_the_head_projects_one_position(model, monkeypatch):
    prompts, responses, probe_lists = mixed_batch(1)
    reference = score_batch_packed(model, prompts, responses, probe_lists)
    monkeypatch.setattr(scoring_module, "LOGIT_CHUNK_ELEMENTS", 3 * VOCAB)  # 3 rows of logits at a time
    head_outputs = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, a, out: head_outputs.append(out.shape))
    try:
        chunked = score_batch_packed(model, prompts, responses, probe_lists, max_token_len=100)
    finally:
        handle.remove()
    assert head_outputs and all(shape[1:] == (1, VOCAB) for shape in head_outputs)
    for a, b in zip(chunked, reference):
        assert relative_error(a.probe_logp, b.probe_logp) < REL_TOL
        torch.testing.assert_close(a.trace_log_probs, b.trace_log_probs, rtol=1e-5, atol=1e-5)


def test_micro_batches_respect_the_token_budget_and_bound_padding():
    # (trace tokens, probe-tree tokens): a row pads to the batch's longest trace plus its largest tree.
    shapes = [(5, 0), (30, 10), (8, 4), (4, 8), (20, 10), (7, 0), (90, 10), (6, 1)]
    batches = plan_micro_batches(shapes, max_token_len=48)
    assert sorted(i for batch in batches for i in batch) == list(range(len(shapes)))
    for batch in batches:
        padded = len(batch) * (max(shapes[i][0] for i in batch) + max(shapes[i][1] for i in batch))
        real = sum(sum(shapes[i]) for i in batch)
        assert len(batch) == 1 or (padded <= 48 and real >= MIN_MICRO_BATCH_FILL * padded)
    assert [6] in batches  # wider than the budget: alone
    # (8, 4) and (4, 8) have the same width but pad to 16 tokens each together: 75% real, so they do not share.
    assert not any({2, 3} <= set(batch) for batch in batches)
    assert [5, 7] in batches  # (7, 0) and (6, 1): 14 real of 16 padded
    assert plan_micro_batches([], 10) == []
    with pytest.raises(ValueError, match="max_token_len"):
        ValuePassSettings(max_token_len=0)


def _plans(seed):
    """Plans of every value rule, with an empty response and a plan whose group had no candidate."""
    rng = random.Random(seed)
    plans = []
    for rule in ("raw", "self_normalized", "own_continuation", "raw", "self_normalized"):
        prompt, response = random_ids(rng, rng.randint(2, 8)), random_ids(rng, rng.randint(12, 50))
        ends = sorted(rng.sample(range(1, response.numel()), 3)) + [response.numel()]
        outcome = rng.choice([0.0, 1.0])
        plan = TraceRecord(prompt, response, None, outcome, "g", segment_ends=ends, value_rule=rule, success=outcome)
        if rule != "own_continuation":
            correct, wrong = [[1, 2], [3]], [[4, 5]]
            plan.probes = build_exit_probes(
                plan.starts, [9, 10], correct, thinking_length=response.numel(), all_answers=correct + wrong
            )
        plans.append(plan)
    plans[3].probes, plans[3].no_candidates = [], True
    plans.append(TraceRecord(random_ids(rng, 4), torch.zeros(0, dtype=torch.long), None, 1.0, "g"))
    return plans


def expected_values(model, plan, max_positions=None):
    if plan.value_rule == "own_continuation":
        log_probs, _ = full_forward_log_probs(model, plan.prompt_ids, plan.response_ids)
        return own_continuation_values(log_probs, plan.starts, plan.success)
    if not plan.probes:
        return torch.full((plan.num_values,), float("nan"))
    naive = score_probes_naive(
        model, plan.prompt_ids, plan.response_ids, plan.probes, max_positions=max_positions,
        temperature=plan.temperature,
    )
    return values_from_probe_logp(naive, plan.probes, plan.num_values, plan.value_rule)


@pytest.mark.parametrize("max_token_len", [16384, 64])
def test_score_plans_equals_naive_values(model, monkeypatch, max_token_len):
    monkeypatch.setattr(scoring_module, "MIN_MICRO_BATCH_FILL", 0.0)  # rows of every width share the forwards
    plans = _plans(2)
    segment_ends, raw_values, metrics = score_plans(model, plans, max_segments=6, max_positions=45,
                                                   max_token_len=max_token_len)
    assert raw_values.shape == (len(plans), 7) and segment_ends.shape == (len(plans), 6)
    for i, plan in enumerate(plans):
        expected = expected_values(model, plan, max_positions=45)
        actual = raw_values[i, : plan.num_values]
        assert relative_error(actual, expected) < REL_TOL, (i, plan.value_rule)
        if plan.num_values:
            assert raw_values[i, plan.num_values] == plan.outcome
    assert torch.isnan(raw_values[3, :4]).all() and (segment_ends[5] == -1).all()
    assert metrics["rredcot/value_dummy_forwards"] == 0
    assert metrics["rredcot/value_micro_batches"] == (1 if max_token_len == 16384 else 4)
    assert metrics["rredcot/probes_skipped_too_long"] > 0
    assert metrics["rredcot/traces_without_candidates"] == 1


def test_score_plans_scores_at_the_rollout_temperature(model):
    # Probes must read the distribution the traces were sampled from: softmax(logits / T).
    plans = [plan for plan in _plans(3) if plan.value_rule != "own_continuation"]
    for plan in plans:
        plan.temperature = 0.7
    _, values, _ = score_plans(model, plans, max_segments=6)
    _, at_one, _ = score_plans(model, [dataclasses.replace(p, temperature=1.0) for p in plans], max_segments=6)
    for i, plan in enumerate(plans):
        if plan.probes:
            assert relative_error(values[i, : plan.num_values], expected_values(model, plan)) < REL_TOL
            assert not torch.allclose(values[i, : plan.num_values], at_one[i, : plan.num_values])
    plans[0].temperature = 1.0
    with pytest.raises(ValueError, match="share the rollout temperature"):
        score_plans(model, plans, max_segments=6)


def test_score_plans_of_an_empty_shard_makes_no_forward(model):
    calls = []
    handle = model.register_forward_hook(lambda *args: calls.append(1))
    try:
        _, raw_values, _ = score_plans(model, [], max_segments=4)
    finally:
        handle.remove()
    assert raw_values.shape == (0, 5) and not calls


def _flex_attention_runs() -> str | None:
    """None when flex_attention runs here, else why not."""
    try:
        with torch.no_grad():
            make_model("flex_attention")(input_ids=torch.tensor([[1, 2, 3]]))
    except Exception as error:  # noqa: BLE001 (the reason is reported in the skip)
        return f"{type(error).__name__}: {error}"
    return None


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex_attention"])
def test_every_backend_gives_the_naive_values(backend):
    if backend == "flex_attention" and (reason := _flex_attention_runs()) is not None:
        pytest.skip(f"flex_attention does not run on this machine: {reason}")
    model = make_model(backend)
    assert model.config._attn_implementation == backend
    rng = random.Random(3)
    prompt, response = random_ids(rng, 5), random_ids(rng, 30)
    trace_probes = [
        Probe(0, [7, 8], [9, 1], value_index=0), Probe(12, [7, 8], [9, 2], value_index=1), Probe(30, [], [4, 5], value_index=2)
    ]

    naive = score_probes_naive(model, prompt, response, trace_probes)  # runs with the configured backend
    packed = score_batch_packed(model, [prompt, random_ids(rng, 3)], [response, random_ids(rng, 9)],
                                [trace_probes, trace_probes[:1]])[0]

    assert relative_error(packed.probe_logp, naive) < REL_TOL
    assert model.config._attn_implementation == backend  # restored after the value pass


def test_a_flash_attention_model_never_receives_the_probe_mask(monkeypatch):
    masks = []

    def recording_flash(module, query, key, value, attention_mask, **kwargs):
        # Stands in for flash_attention_2 (not installed here): records the mask it is given and computes causal
        # attention, which is what flash-attn does with an unpadded batch.
        masks.append(attention_mask)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "flash_attention_2", recording_flash)
    model = make_model("sdpa")
    model.config._attn_implementation = "flash_attention_2"
    rng = random.Random(4)
    prompt, response = random_ids(rng, 4), random_ids(rng, 20)
    trace_probes = [Probe(b, [3, 4], [5, 6], value_index=k) for k, b in enumerate((0, 10, 20))]

    # The failure this guards against: a 4D mask given to a flash-configured model reaches the flash function.
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.zeros(1, 1, 3, 3))
    assert masks and masks[-1].dim() == 4
    masks.clear()
    naive = score_probes_naive(model, prompt, response, trace_probes)
    assert masks and all(mask is None or mask.dim() == 2 for mask in masks)
    masks.clear()

    scores = score_batch_packed(model, [prompt], [response], [trace_probes])[0]

    assert masks == []  # the value pass never called the configured backend
    assert model.config._attn_implementation == "flash_attention_2"
    assert relative_error(scores.probe_logp, naive) < REL_TOL


def test_models_that_cannot_take_the_value_pass_attention_are_refused(model, monkeypatch):
    monkeypatch.setattr(model.config, "attn_logit_softcapping", 50.0, raising=False)
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0"):
        score_batch_packed(model, [torch.tensor([1, 2])], [torch.tensor([3])], [[Probe(0, [], [4], value_index=0)]])
    monkeypatch.undo()
    with pytest.raises(ValueError, match="return_trace_stats has 2 entries"):
        score_batch_packed(model, [torch.tensor([1])], [torch.tensor([3])], [[]], return_trace_stats=[True, False])
    for share in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="blocked_attention_share must be in"):
            score_batch_packed(model, [torch.tensor([1])], [torch.tensor([3])], [[]], blocked_attention_share=share)
    assert math.isnan(
        score_batch_packed(model, [torch.tensor([1])], [torch.tensor([3])], [[Probe(1, [], [4], value_index=0)]],
                           max_positions=2)[0].probe_logp[0]
    )


def test_probes_of_a_multi_turn_trace_read_the_tool_output_the_policy_saw(model):
    # A response as verl's tool agent loop writes it: turn 1 (mask 1), tool output and template tokens (mask 0),
    # turn 2 (mask 1). The state after the tool call is scored with the tool output in its prefix, as the policy
    # read it when it wrote turn 2; a different tool answer gives that state (and only later ones) other values.
    rng = random.Random(5)
    prompt, turn_one, tool, turn_two = (random_ids(rng, n) for n in (6, 10, 7, 9))
    response = torch.cat([turn_one, tool, turn_two])
    mask = torch.tensor([1] * 10 + [0] * 7 + [1] * 9, dtype=torch.bool)
    ends = [5, 17, response.numel()]  # the second state starts turn 2, after the tool output

    def plan(response_ids):
        traced = TraceRecord(prompt, response_ids, None, 1.0, "g", response_mask=mask, segment_ends=ends,
                             value_rule="self_normalized", success=1.0)
        traced.probes = build_exit_probes(traced.starts, [9, 10], [[1, 2]], thinking_length=response_ids.numel(),
                                          all_answers=[[1, 2], [3]])
        return traced

    seen = plan(response)
    other_tool = plan(torch.cat([turn_one, random_ids(rng, 7), turn_two]))
    _, values, _ = score_plans(model, [seen, other_tool], max_segments=3)
    assert relative_error(values[0, :3], expected_values(model, seen)) < REL_TOL
    assert values[0, :2].tolist() == values[1, :2].tolist()  # states before the tool output
    assert values[0, 2] != values[1, 2]


def continuation_batch(seed, count=5):
    """Reference-continuation-like rows: at each of a few boundaries, long chains (a bank's continuations) scored
    from the boundary on, probes in boundary order as ``build_reference_probes`` lays them out; mixed lengths."""
    rng = random.Random(seed)
    prompts, responses, probe_lists = [], [], []
    for _ in range(count):
        response = random_ids(rng, rng.choice([12, 30, 47]))
        boundaries = sorted({0, *rng.sample(range(1, response.numel()), 3)})
        probes = [Probe(b, [], [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))], value_index=k)
                  for k, b in enumerate(boundaries) for _ in range(rng.randint(1, 3))]
        prompts.append(random_ids(rng, rng.randint(1, 9))), responses.append(response), probe_lists.append(probes)
    return prompts, responses, probe_lists


@pytest.mark.parametrize("batch", ["continuations", "mixed"])
def test_probe_attention_block_by_block_gives_the_dense_masks_log_probs(model, blocked_attention_calls, batch):
    prompts, responses, probe_lists = continuation_batch(1) if batch == "continuations" else mixed_batch(2)
    blocked_calls = blocked_attention_calls
    scores = {}
    for share in (0.0, 1.0):  # 0: never block by block; 1: wherever the trees cut into blocks
        scores[share] = score_batch_packed(model, prompts, responses, probe_lists, max_token_len=16384,
                                           blocked_attention_share=share)
        if share == 0.0:
            assert not blocked_calls
        elif batch == "continuations":  # mixed: only where a micro-batch's trees cut into blocks
            assert blocked_calls
    for dense, by_block, prompt, response, probes in zip(scores[0.0], scores[1.0], prompts, responses, probe_lists):
        assert relative_error(by_block.probe_logp, dense.probe_logp) < REL_TOL
        assert relative_error(by_block.probe_logp, score_probes_naive(model, prompt, response, probes)) < REL_TOL
        torch.testing.assert_close(by_block.trace_log_probs, dense.trace_log_probs, rtol=1e-5, atol=1e-5)


def test_a_forward_that_drops_the_probe_blocks_fails_instead_of_attending_densely(model):
    """The blocks reach the attention as a keyword of the model call; a forward that loses it on the way (as verl's
    fused-kernel forward would, were the blocks not handed to its decoder call) must not run the probe mask densely
    without saying so."""
    rng = random.Random(5)
    row = scoring_module._build_row(random_ids(rng, 4), random_ids(rng, 12), [Probe(6, [], [1, 2, 3], value_index=0)],
                                    None, False)
    trace_len, tree_len = row.tokens.numel(), len(row.tree_ids)
    allowed = scoring_module._probe_allowed(torch.tensor(row.tree_prefix_lengths), torch.tensor(row.tree_parents),
                                            trace_len)
    inputs = {"input_ids": torch.cat([row.tokens, torch.tensor(row.tree_ids)])[None],
              "position_ids": torch.cat([torch.arange(trace_len), torch.tensor(row.tree_positions)])[None],
              "attention_mask": allowed[None, None]}
    with torch.no_grad(), scoring_module.value_pass_attention(model):
        with pytest.raises(RuntimeError, match=scoring_module.PROBE_BLOCKS_ARGUMENT):
            model(**inputs)
        dense = model(**inputs, **{scoring_module.PROBE_BLOCKS_ARGUMENT: None}).logits
        blocks = scoring_module._probe_blocks([row], trace_len, tree_len, share=1.0)  # one probe: only so
        assert blocks is not None
        by_block = model(**inputs, **{scoring_module.PROBE_BLOCKS_ARGUMENT: blocks}).logits
    torch.testing.assert_close(by_block, dense, rtol=1e-5, atol=1e-5)


def test_reference_continuations_attend_block_by_block_and_exit_probes_densely():
    rng = random.Random(3)
    prompt, response = random_ids(rng, 20), random_ids(rng, 400)
    boundaries = list(range(0, 400, 50))
    continuations = [Probe(b, [], [rng.randrange(VOCAB) for _ in range(400 - b)], value_index=k)
                     for k, b in enumerate(boundaries) for _ in range(2)]
    row = scoring_module._build_row(prompt, response, continuations, None, False)
    blocks = scoring_module._probe_blocks([row], row.tokens.numel(), len(row.tree_ids))
    assert [keys for _, _, keys in blocks[0]] == [20 + b for b in boundaries]
    exits = build_exit_probes(list(range(0, 400, 10)), [1, 2, 3], [[4, 5], [6, 7]], thinking_length=400)
    row = scoring_module._build_row(prompt, response, exits, None, False)
    assert scoring_module._probe_blocks([row], row.tokens.numel(), len(row.tree_ids)) is None
