"""IBPO repairs and Monte-Carlo values through ``integration/rollouts.py`` with a fake generation client.

Everything but the generation is real: the embedded task's tokenizer, its reward (``tasks/reward.py``), the
``StepTraces`` as ``trainer._trace_batch`` builds them, the settings reader, the alignment and the segmentation.
The fake client answers each request deterministically from its prompt, caps the output at ``max_tokens`` as vLLM
does, and records what it was asked.
"""

import math
import re
from types import SimpleNamespace

import pytest
import torch

from rredcot_verl.core import ibpo
from rredcot_verl.core.traces import records_from_arrays
from rredcot_verl.core.settings import settings_from_config
from rredcot_verl.integration.estimators import StepContext, StepTraces
from rredcot_verl.integration.estimators.ibpo import ibpo_repairs
from rredcot_verl.integration.estimators.segment_mc import monte_carlo_values
from rredcot_verl.integration.rollouts import engine_max_model_length
from rredcot_verl.tasks.model import EOS_TOKEN, IM_END, IM_START, chat_prompt_ids, load_model_dir, response_ids
from rredcot_verl.tasks.reward import compute_score

torch.set_num_threads(1)

WARMSTART = "rredcot_verl/tasks/assets/warmstart"


def solution(steps: list[str], answer: int) -> str:
    return "<think>\n" + "".join(s + "\n" for s in steps) + "</think>\n\\boxed{" + str(answer) + "}"


A_RIGHT = solution(["23+45=68", "68-17=51", "51+8=59"], 59)
A_STEP2 = solution(["23+45=68", "68-17=52", "52+8=60"], 60)  # first wrong result in step 2
A_STEP1 = solution(["23+45=69", "69-17=52", "52+8=60"], 60)  # first wrong result in step 1
A_NOIDEA = "no idea\n\\boxed{3}"
B_RIGHT = solution(["12+30=42", "42-5=37"], 37)
B_WRONG1 = solution(["12+30=42", "42-5=36"], 36)
B_WRONG2 = solution(["12+30=42", "42-5=38"], 38)
C_WRONG = solution(["7+8=15", "15+9=25"], 25)

# (uid, question, ground truth, response text) in batch order; groups are interleaved as verl may leave them.
ROWS = [
    ("a", "Compute 23+45-17+8", 59, A_RIGHT),
    ("a", "Compute 23+45-17+8", 59, A_STEP2),
    ("b", "Compute 12+30-5", 37, B_WRONG1),
    ("a", "Compute 23+45-17+8", 59, A_STEP1),
    ("a", "Compute 23+45-17+8", 59, A_NOIDEA),
    ("b", "Compute 12+30-5", 37, B_WRONG2),
    ("c", "Compute 7+8+9", 24, C_WRONG),
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_dir(WARMSTART, with_model=False)[1]


def trace_batch(tokenizer, rows=ROWS, score=compute_score) -> StepTraces:
    """The traces ``SegmentCreditTrainer._trace_batch`` hands the producers: tokens without padding, entropies, the
    outcome, the prompt group and the dataset's fields, and the batch's response width."""
    prompts = [torch.tensor(chat_prompt_ids(tokenizer, question)) for _, question, _, _ in rows]
    responses = [torch.tensor(response_ids(tokenizer, text), dtype=torch.long) for _, _, _, text in rows]
    generator = torch.Generator().manual_seed(0)
    records = records_from_arrays(
        prompts=prompts,
        responses=responses,
        entropies=[torch.rand(len(r), generator=generator) for r in responses],
        outcomes=[float(score("rredcot_arithmetic", text, str(truth))) for _, _, truth, text in rows],
        groups=[uid for uid, _, _, _ in rows],
        reward_models=[{"style": "rule", "ground_truth": str(t)} for _, _, t, _ in rows],
        extra_infos=[{"index": i} for i in range(len(rows))],
        raw_prompts=[[{"role": "user", "content": q}] for _, q, _, _ in rows],
        data_sources=["rredcot_arithmetic"] * len(rows),
    )
    return StepTraces(records, response_width=max(len(r) for r in responses))


class FakeEngine:
    """Deterministic stand-in for verl's server client: ``reply(prompt_ids, params) -> token ids`` (eos included
    when the answer is complete), cut at ``max_tokens`` like the engine does."""

    def __init__(self, reply):
        self.reply = reply
        self.requests = []

    def __call__(self, requests):
        self.requests.extend(requests)
        outputs = []
        for ids, params in requests:
            assert isinstance(ids, list) and all(isinstance(t, int) for t in ids)
            outputs.append(SimpleNamespace(token_ids=list(self.reply(ids, params))[: params["max_tokens"]]))
        return outputs


def context(tokenizer, engine, section=None, score=compute_score, max_model_length=2048, seed=0):
    """Settings as the tiny recipes set them (repairs by rewrite unless the section says otherwise); a 2048-token
    engine unless told (default-template prompts are about 600 tokens with this tokenizer, whose byte-level BPE was
    trained on task text only)."""
    section = dict(section or {})
    ibpo_section = {"repair_operator": "rewrite", **section.pop("ibpo", {})}
    section = {"task": "arithmetic", "probe": {"profile": "embedded"}, "ibpo": ibpo_section, **section}
    return StepContext(
        settings=settings_from_config({"rredcot": section}),
        tokenizer=tokenizer,
        step=seed,
        generate=engine,
        score=score,
        max_prompt_length=32,
        max_response_length=96,
        max_model_length=max_model_length,
    )


def repairs(ctx, batch):
    """``ibpo_repairs`` as its stage runs: the ``AdvantageBatch`` inputs, the metrics, and the verified repairs per
    group it leaves in the step's context."""
    inputs, metrics = ibpo_repairs(ctx, batch)
    return inputs, metrics, ctx.verified_repairs


# ---------------------------------------------------------------------------------------------------- IBPO

_SOLUTION_A = re.compile(r"### Solution A\n(.*)\n\n### Solution B\n(.*)\n\n### Corrected solution A\n", re.S)


def solutions_in(tokenizer, prompt_ids):
    """(A, B) texts of a default-template revision prompt."""
    match = _SOLUTION_A.search(tokenizer.decode(prompt_ids, skip_special_tokens=False))
    assert match, "revision prompt does not follow DEFAULT_REVISION_TEMPLATE"
    return match.group(1), match.group(2)


def scripted_repairs(tokenizer):
    """Repairs by trace (A): two local fixes, a rewrite, a correct but truncated one, the rest unchanged."""
    newline = tokenizer.encode("\n", add_special_tokens=False)

    def reply(ids, params):
        trace, _ = solutions_in(tokenizer, ids)
        if trace in (A_STEP2, A_STEP1, A_NOIDEA):
            return response_ids(tokenizer, A_RIGHT)
        if trace == B_WRONG1:
            return response_ids(tokenizer, B_RIGHT)
        if trace == B_WRONG2:
            # the right answer, then rambling until the budget runs out: the verifier would accept the text
            return tokenizer.encode(B_RIGHT, add_special_tokens=False) + newline * params["max_tokens"]
        return response_ids(tokenizer, trace)

    return reply


def test_ibpo_repairs_requests_prompts_phi_and_masks(tokenizer):
    batch = trace_batch(tokenizer)
    engine = FakeEngine(scripted_repairs(tokenizer))
    inputs, metrics, verified = repairs(context(tokenizer, engine), batch)
    texts = {i: text for i, (_, _, _, text) in enumerate(ROWS)}

    # Which traces were revised, against which references: incorrect traces with siblings, up to 3 references,
    # each trace's first reference is its correct sibling when the group has one.
    pairs = [solutions_in(tokenizer, ids) for ids, _ in engine.requests]
    revised = [a for a, _ in pairs]
    assert sorted(set(revised)) == sorted([A_STEP2, A_STEP1, A_NOIDEA, B_WRONG1, B_WRONG2])
    assert all(revised.count(t) == 3 for t in (A_STEP2, A_STEP1, A_NOIDEA))  # 3 siblings each
    assert revised.count(B_WRONG1) == revised.count(B_WRONG2) == 1  # a group of two has one reference
    for trace in (A_STEP2, A_STEP1, A_NOIDEA):
        references = [b for a, b in pairs if a == trace]
        assert references[0] == A_RIGHT and A_RIGHT not in references[1:]
        assert trace not in references
    assert C_WRONG not in revised and A_RIGHT not in revised  # group of one; correct trace

    # Prompts: the chat template's own markers only; no eos copied in from the decoded responses.
    for ids, params in engine.requests:
        assert tokenizer.eos_token_id not in ids
        assert ids.count(tokenizer.convert_tokens_to_ids(IM_START)) == 2
        assert ids.count(tokenizer.convert_tokens_to_ids(IM_END)) == 1
        assert EOS_TOKEN not in tokenizer.decode(ids, skip_special_tokens=False)
        trace, _ = solutions_in(tokenizer, ids)
        length = next(len(response_ids(tokenizer, t)) for t in texts.values() if t == trace)
        assert params["max_tokens"] == ibpo.revision_budget(length, ibpo.IBPOSettings(repair_operator="rewrite"))

    # φ: all 3 repairs of the two locally fixable traces succeed; the rewrite and the truncated repair earn nothing.
    phi = inputs["phi"].tolist()
    assert phi == pytest.approx([0.0, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0])

    # Masks: exactly the digits that differ from the right solution (the tokenizer splits every digit).
    mask = inputs["edited_mask"]
    assert mask.shape == (len(batch), batch.response_width) and mask.dtype == torch.bool
    right = response_ids(tokenizer, A_RIGHT)
    for row, text in ((1, A_STEP2), (3, A_STEP1), (2, B_WRONG1)):
        ids = response_ids(tokenizer, text)
        target = right if row != 2 else response_ids(tokenizer, B_RIGHT)
        assert len(ids) == len(target)
        assert mask[row, : len(ids)].tolist() == [a != b for a, b in zip(ids, target)]
        assert not mask[row, len(ids) :].any()
    edited_digits = "".join(tokenizer.decode([t]) for t, e in zip(response_ids(tokenizer, A_STEP2), mask[1]) if e)
    assert edited_digits == "226060"  # 52, 52, 60 and the boxed 60: the first wrong result and what follows
    for row in (0, 4, 5, 6):  # correct, rewrite-only, truncated-only, unrevised: no mask
        assert not mask[row].any()

    assert metrics["ibpo/revisions"] == 11.0 and metrics["ibpo/incorrect_traces"] == 6.0
    assert metrics["ibpo/incorrect_traces_revised"] == 5.0 and metrics["ibpo/traces_without_reference"] == 1.0
    assert metrics["ibpo/failed_truncated"] == 1.0
    assert metrics["ibpo/rewrite_frac"] == pytest.approx(3 / 10)  # 10 verified: 3+3 local, 3 rewrites, 1 local
    assert metrics["ibpo/revisions_skipped_by_cap"] == 0.0 and metrics["ibpo/traces_skipped_by_cap"] == 0.0
    assert metrics["ibpo/extra_generated_tokens"] > 0 and all(math.isfinite(v) for v in metrics.values())

    # Verified repairs by group, for a repair-filled value bank: the local fixes and the rewrites (a correct solution
    # all the same), not the truncated one.
    assert verified == {"a": [list(response_ids(tokenizer, A_RIGHT))] * 9, "b": [list(response_ids(tokenizer, B_RIGHT))]}


def resumed_solutions(tokenizer):
    """A policy that solves correctly from any correct prefix: the right solution's remaining tokens when the request's
    kept prefix (what follows the question's chat prompt) is a prefix of it; an unfinished line otherwise."""
    prompts = {tuple(chat_prompt_ids(tokenizer, q)): q for _, q, _, _ in ROWS}
    right = {"Compute 23+45-17+8": A_RIGHT, "Compute 12+30-5": B_RIGHT}

    def reply(ids, params):
        prompt = next(p for p in prompts if tuple(ids[: len(p)]) == p)
        kept, solution = ids[len(prompt):], response_ids(tokenizer, right[prompts[prompt]])
        if solution[: len(kept)] == kept:
            return solution[len(kept):]
        return tokenizer.encode("1", add_special_tokens=False)

    return reply


def test_resumed_repairs_continue_the_rollout_prompt_from_the_divergence_point(tokenizer):
    batch = trace_batch(tokenizer)
    engine = FakeEngine(resumed_solutions(tokenizer))
    resume = {"ibpo": {"repair_operator": "resume"}}
    inputs, metrics, verified = repairs(context(tokenizer, engine, resume), batch)
    responses = [record.response_ids.tolist() for record in batch.records]
    groups = [record.group for record in batch.records]

    # Every request is the rollout's own prompt ids followed by the trace's first k tokens, k its divergence point
    # from one of its siblings, and may generate what the 96-token response budget has left after them.
    assert len(engine.requests) == 11
    for ids, params in engine.requests:
        row = next(i for i, record in enumerate(batch.records)
                   if ids[: record.prompt_ids.numel()] == record.prompt_ids.tolist()
                   and responses[i][: len(ids) - record.prompt_ids.numel()] == ids[record.prompt_ids.numel():]
                   and not batch.outcomes[i])  # fmt: skip
        k = len(ids) - batch.records[row].prompt_ids.numel()
        siblings = [j for j in range(len(responses)) if groups[j] == groups[row] and j != row]
        assert k in {ibpo.divergence_point(responses[row], responses[j]) for j in siblings}
        assert params["max_tokens"] == 96 - k
    # the step-2 failure against its correct sibling resumes at the wrong digit, keeping "68-17=5"
    k = ibpo.divergence_point(responses[1], responses[0])
    assert tokenizer.decode(responses[1][:k]).endswith("68-17=5")

    # φ: the step-1 and step-2 failures (and both failures of group b, whose shared prefix "42-5=3" is right) are
    # recovered from every divergence point; "no idea" shares nothing with its siblings, so its repairs are fresh
    # solves, verified but rewrites.
    assert inputs["phi"].tolist() == pytest.approx([0.0, 0.5, 0.5, 0.5, 0.0, 0.5, 0.0])
    # Masks: the digits where the failure leaves the right solution, nothing in the kept prefix.
    mask = inputs["edited_mask"]
    right = response_ids(tokenizer, A_RIGHT)
    assert mask[1, : len(responses[1])].tolist() == [a != b for a, b in zip(responses[1], right)]
    assert not mask[1, :k].any() and mask[1, k]
    assert not mask[4].any() and not mask[0].any()
    # The verified repairs are whole solutions (kept prefix + continuation), for a repair-filled bank.
    assert verified == {"a": [list(right)] * 9, "b": [list(response_ids(tokenizer, B_RIGHT))] * 2}
    assert metrics["ibpo/rewrite_frac"] == pytest.approx(3 / 11) and metrics["ibpo/revisions_skipped_no_room"] == 0
    generated = sum(len(engine.reply(ids, p)) for ids, p in engine.requests)
    assert metrics["ibpo/extra_generated_tokens"] == generated  # the continuations, not the kept prefixes
    assert 0 < metrics["ibpo/resume_kept_frac_mean"] < 1

    # An engine shorter than a rollout (prompt + response budget) cannot serve a resumed repair: all skipped.
    short = FakeEngine(resumed_solutions(tokenizer))
    _, metrics, _ = repairs(context(tokenizer, short, resume, max_model_length=96), batch)
    assert short.requests == [] and metrics["ibpo/revisions_skipped_no_room"] == 11.0


def test_an_aborted_generation_is_a_failed_repair(tokenizer):
    def reply(ids, params):
        return response_ids(tokenizer, A_RIGHT if solutions_in(tokenizer, ids)[0] != B_WRONG1 else B_RIGHT)

    class Aborting(FakeEngine):
        def __call__(self, requests):
            outputs = super().__call__(requests)
            for output in outputs:
                output.stop_reason = "aborted"
            return outputs

    inputs, metrics, _ = repairs(context(tokenizer, Aborting(reply)), trace_batch(tokenizer))
    assert not inputs["phi"].any() and not inputs["edited_mask"].any()
    assert metrics["ibpo/failed_truncated"] == metrics["ibpo/revisions"] == 11.0


def test_ibpo_repairs_with_the_embedded_template_resolve_the_question(tokenizer):
    questions = {tuple(chat_prompt_ids(tokenizer, q)): q for _, q, _, _ in ROWS}
    answers = {"Compute 23+45-17+8": A_RIGHT, "Compute 12+30-5": B_RIGHT}
    engine = FakeEngine(lambda ids, params: response_ids(tokenizer, answers[questions[tuple(ids)]]))
    # recipes/tiny_cpu/ibpo.yaml: with the 128-token fallback context (32 + 96) the repairs need a small slack
    section = {"ibpo": {"revision_template": ibpo.EMBEDDED_TASK_TEMPLATE, "revision_slack_tokens": 16}}
    inputs, metrics, _ = repairs(context(tokenizer, engine, section, max_model_length=None), trace_batch(tokenizer))
    assert all(tuple(ids) in questions for ids, _ in engine.requests)  # the bare chat prompt of the question
    assert inputs["phi"].tolist() == pytest.approx([0.0, 0.5, 0.5, 0.5, 0.0, 0.5, 0.0])
    assert inputs["edited_mask"][5].any()  # B_WRONG2 now gets a complete fresh solve


def test_revision_prompts_are_bounded_by_the_engine_not_the_dataset_prompt_length(tokenizer):
    batch = trace_batch(tokenizer)
    engine = FakeEngine(scripted_repairs(tokenizer))
    # data.max_prompt_length is 32, yet every default-template prompt (about 600 tokens) is sent: the engine's
    # 1024-token context holds it and its repair budget
    _, metrics, _ = repairs(context(tokenizer, engine, max_model_length=1024), batch)
    assert metrics["ibpo/revisions"] == 11.0 and min(len(ids) for ids, _ in engine.requests) > 32
    assert all(len(ids) + p["max_tokens"] <= 1024 for ids, p in engine.requests)

    # a context that holds the repair budget but not the prompt: nothing is sent, and every skip is reported
    short = FakeEngine(scripted_repairs(tokenizer))
    inputs, metrics, _ = repairs(context(tokenizer, short, max_model_length=200), batch)
    assert short.requests == [] and not inputs["phi"].any()
    assert metrics["ibpo/traces_without_fitting_reference"] == 5.0
    assert metrics["ibpo/revisions_skipped_no_room"] == 11.0

    # without the engine's length, the context falls back to data.max_prompt_length + data.max_response_length
    fallback = context(tokenizer, FakeEngine(scripted_repairs(tokenizer)), max_model_length=None)
    assert fallback.engine_length() == 32 + 96


def test_a_cap_gives_every_incorrect_trace_one_revision_before_any_gets_a_second(tokenizer):
    batch = trace_batch(tokenizer)
    engine = FakeEngine(scripted_repairs(tokenizer))
    inputs, metrics, _ = repairs(context(tokenizer, engine, {"ibpo": {"max_revisions": 5}}), batch)
    revised = [solutions_in(tokenizer, ids)[0] for ids, _ in engine.requests]
    assert sorted(revised) == sorted([A_STEP2, A_STEP1, A_NOIDEA, B_WRONG1, B_WRONG2])
    assert metrics["ibpo/traces_skipped_by_cap"] == 0.0 and metrics["ibpo/revisions_skipped_by_cap"] == 6.0
    assert inputs["phi"].tolist() == pytest.approx([0.0, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0])

    tight = FakeEngine(scripted_repairs(tokenizer))
    _, metrics, _ = repairs(context(tokenizer, tight, {"ibpo": {"max_revisions": 3}}), batch)
    assert len(tight.requests) == 3 and len({solutions_in(tokenizer, ids)[0] for ids, _ in tight.requests}) == 3
    assert metrics["ibpo/traces_skipped_by_cap"] == 2.0 and metrics["ibpo/revisions_skipped_by_cap"] == 8.0


def test_ibpo_repairs_reward_scale_plus_minus_one(tokenizer):
    def plus_minus(source, text, truth, extra=None):
        return 2.0 * compute_score(source, text, truth, extra) - 1.0

    batch = trace_batch(tokenizer, score=plus_minus)
    assert sorted(set(batch.outcomes.tolist())) == [-1.0, 1.0]
    engine = FakeEngine(scripted_repairs(tokenizer))
    section = {"reward_range": [-1.0, 1.0]}
    inputs, metrics, _ = repairs(context(tokenizer, engine, section, score=plus_minus), batch)
    # the same verdicts as on the 0/1 scale: −1 traces are incorrect, repairs scoring +1 are verified
    assert inputs["phi"].tolist() == pytest.approx([0.0, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0])
    assert metrics["ibpo/incorrect_traces"] == 6.0


def test_ibpo_repairs_reward_scale_partial_credit(tokenizer):
    # 0.5 for the right chain of lines with a wrong last result, 1 for the right answer: partial credit is not
    # correct, so the step-2 trace is revised and its repair must reach 1 to be verified.
    def partial(source, text, truth, extra=None):
        if compute_score(source, text, truth, extra) == 1.0:
            return 1.0
        return 0.5 if "68-17=" in text and "\\boxed{" in text else 0.0

    batch = trace_batch(tokenizer, score=partial)
    assert batch.outcomes[1] == 0.5
    engine = FakeEngine(scripted_repairs(tokenizer))
    inputs, metrics, _ = repairs(context(tokenizer, engine, score=partial), batch)
    assert A_STEP2 in [solutions_in(tokenizer, ids)[0] for ids, _ in engine.requests]
    assert inputs["phi"][1] == pytest.approx(0.5) and inputs["edited_mask"][1].any()

    # a repair that only earns partial credit is not a verified repair
    half = FakeEngine(lambda ids, params: response_ids(tokenizer, solutions_in(tokenizer, ids)[0]))
    inputs, metrics, _ = repairs(context(tokenizer, half, score=partial), batch)
    assert not inputs["phi"].any() and metrics["ibpo/repair_success_rate"] == 0.0


def test_engine_max_model_length_reads_verls_setting_or_the_model(tokenizer):
    from omegaconf import OmegaConf

    def config(max_model_len):
        return OmegaConf.create(
            {"actor_rollout_ref": {"model": {"path": WARMSTART}, "rollout": {"max_model_len": max_model_len}}}
        )

    assert engine_max_model_length(config(300)) == 300
    assert engine_max_model_length(config(None)) == 512  # the warm start's max_position_embeddings


# --------------------------------------------------------------------------------------------- Monte Carlo

K = 3


def mc_context(tokenizer, engine, max_response_length=96):
    section = {
        "task": "arithmetic",
        "probe": {"profile": "embedded"},
        "segmentation": {"min_segment_len": 2},
        "segment_mc": {"num_continuations": K, "max_tokens": 40},
    }
    settings = settings_from_config({"rredcot": section})
    return StepContext(
        settings=settings,
        tokenizer=tokenizer,
        step=0,
        boundary_vocab=settings.boundary_vocab(tokenizer),
        generate=engine,
        score=compute_score,
        max_prompt_length=32,
        max_response_length=max_response_length,
    )


def finishing_engine(tokenizer):
    """From each prefix, continuation j closes the thinking and boxes the right answer for j < c(prefix), a wrong one
    otherwise, with c(prefix) = len(prefix) mod (K + 1). Returns the engine and c."""
    truths = {tuple(chat_prompt_ids(tokenizer, q)): t for _, q, t, _ in ROWS}
    seen = {}

    def correct_count(prefix_len: int) -> int:
        return prefix_len % (K + 1)

    def reply(ids, params):
        prompt = next(p for p in truths if tuple(ids[: len(p)]) == p)
        # K identical requests per state arrive together; traces of one prompt can share a prefix, hence mod K
        j = seen[tuple(ids)] = seen.get(tuple(ids), -1) + 1
        j %= K
        answer = truths[prompt] if j < correct_count(len(ids)) else truths[prompt] + 1
        return response_ids(tokenizer, "\n</think>\n\\boxed{" + str(answer) + "}")

    return FakeEngine(reply), correct_count


def test_monte_carlo_values_are_the_fraction_of_correct_continuations(tokenizer):
    batch = trace_batch(tokenizer)
    engine, correct_count = finishing_engine(tokenizer)
    inputs, metrics = monte_carlo_values(mc_context(tokenizer, engine), batch)
    seg_ends, values = inputs["segment_ends"], inputs["raw_values"]
    prompt_lengths = [len(record.prompt_ids) for record in batch.records]
    states = 0
    for i in range(len(ROWS)):
        ends = [e for e in seg_ends[i].tolist() if e >= 0]
        assert len(ends) >= 2 and ends[-1] == len(batch.records[i].response_ids)
        for k, start in enumerate([0, *ends[:-1]]):
            assert values[i, k] == pytest.approx(correct_count(prompt_lengths[i] + start) / K)
            states += 1
        assert values[i, len(ends)] == batch.outcomes[i]  # ζ closes the row
        assert torch.isnan(values[i, len(ends) + 1 :]).all()
    assert metrics["segment_mc/continuations"] == states * K == len(engine.requests)
    assert metrics["segment_mc/truncated_continuations"] == 0.0
    for ids, params in engine.requests:  # each request is the prompt plus a prefix of its trace
        assert params["max_tokens"] == min(40, 32 + 96 - len(ids))


def test_monte_carlo_values_are_nan_without_room_and_truncation_fails(tokenizer):
    batch = trace_batch(tokenizer)
    engine, correct_count = finishing_engine(tokenizer)
    # 32 + 16 = 48 tokens in all: late prefixes leave no room; others leave too little for the 13-token answer
    inputs, metrics = monte_carlo_values(mc_context(tokenizer, engine, max_response_length=16), batch)
    seg_ends, values = inputs["segment_ends"], inputs["raw_values"]
    prompt_lengths = [len(record.prompt_ids) for record in batch.records]
    finish = len(response_ids(tokenizer, "\n</think>\n\\boxed{59}"))
    nan_states = truncated_states = 0
    for i in range(len(ROWS)):
        ends = [e for e in seg_ends[i].tolist() if e >= 0]
        for k, start in enumerate([0, *ends[:-1]]):
            room = min(40, 48 - prompt_lengths[i] - start)
            if room < 1:
                assert math.isnan(values[i, k])
                nan_states += 1
            elif room < finish:  # cut before its eos: a failure, even when the boxed answer made it in
                assert values[i, k] == 0.0
                truncated_states += 1
    assert nan_states > 0 and truncated_states > 0
    assert metrics["segment_mc/truncated_continuations"] == truncated_states * K
