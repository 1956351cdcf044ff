"""Probe planning for chat reasoning models: profiles, joining probe text to the prefix, answer closings, task seam.

The tokenizer is built here, Qwen-style: byte-level BPE with Qwen2's pre-tokenizer regex (so ``}$``, ``.\\n``,
``\\n\\n`` are single pieces), ``<|im_start|>``/``<|im_end|>``/``<|endoftext|>`` special and ``<think>``/``</think>``
added tokens, with a Qwen3-like chat template (the response opens thinking) and an R1-distill-like one (the prompt
ends with ``<think>\\n``). Every probe is checked against the tokenizer's encoding of the same text written in full.
"""

import dataclasses
import logging
import random

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from rredcot_verl.core.planning import bank_metrics, continuation_text, plan_traces
from rredcot_verl.core.probes import KIND_CORRECT, KIND_INCORRECT, ProbeSettings
from rredcot_verl.core.profiles import PROFILE_PRESETS, ProbeTokenizer
from rredcot_verl.core.segmentation import SegmentationSettings
from rredcot_verl.core.settings import CandidateSettings, RRedCoTSettings, settings_from_config
from rredcot_verl.core.traces import TraceRecord
from rredcot_verl.tasks.arithmetic import ArithmeticProblem, reference_response, reference_steps
from rredcot_verl.tasks.base import ARITHMETIC, BOXED_MATH, PARAGRAPHS, resolve_task
from rredcot_verl.tasks.model import build_tokenizer, chat_prompt_ids, response_ids, train_qwen2_style_bpe

torch.set_num_threads(1)

QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
R1_TEMPLATE = QWEN3_TEMPLATE.replace("assistant\n{% endif %}", "assistant\n<think>\n{% endif %}")
QUESTION = "What is 23+45-17+8?"
# Thinking in paragraphs, some of several lines; the answers close as chat models write them ("}$.", "}$", "}.").
PARAGRAPHS_OK = [
    "Okay, let me add the first two numbers.\n23+45=68.",
    "Then subtract:\n68-17=51.\nThat looks right.",
    "Wait, one more term: 51+8=59.",
]
PARAGRAPHS_BAD = ["Okay, let me add the first two numbers.\n23+45=68.", "Then subtract:\n68-17=50.", "So 50+8=58."]


def _qwen3_response(paragraphs, answer, closing="$."):
    return "<think>\n" + "\n\n".join(paragraphs) + "\n</think>\n\nThe answer is $\\boxed{" + answer + "}" + closing


def _corpus():
    rng = random.Random(0)
    docs = []
    for _ in range(400):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        closing = rng.choice(["}$.", "}$", "}.", "}\n", "}\n\n", "},", "}"])
        docs.append(
            f"<think>\nOkay, let me add {a} and {b}.\n{a}+{b}={a + b}.\n\nWait, check it again:\n"
            f"{a + b}-{b}={a}.\n</think>\n\n**Final Answer**\nThe answer is $\\boxed{{{a + b}{closing}"
        )
    return docs


@pytest.fixture(scope="module")
def qwen_tokenizer():
    tok = train_qwen2_style_bpe(
        _corpus(), 700, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ["<think>", "</think>"]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        clean_up_tokenization_spaces=False)
    # The pieces this test is about are single tokens, as in Qwen's vocabulary.
    for piece in ("}$", "}$.", ".\n", ".\n\n"):
        assert len(tokenizer.encode(piece, add_special_tokens=False)) == 1, piece
    return tokenizer


def _encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def _prompt(tokenizer, template):
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                         tokenize=False, chat_template=template)
    return torch.tensor(_encode(tokenizer, text))


def _record(tokenizer, prompt, text, outcome, truth="59", steps=None, eos=True):
    ids = _encode(tokenizer, text) + ([tokenizer.eos_token_id] if eos else [])
    response = torch.tensor(ids, dtype=torch.long)
    # Entropy high after every newline token, so the hybrid strategy cuts at each line.
    entropy = torch.tensor([2.0 if i and "\n" in tokenizer.decode([ids[i - 1]]) else 0.1 for i in range(len(ids))])
    return TraceRecord(prompt, response, entropy, outcome, "g", truth, steps)


def _settings(profile, source="exit_probe", **probe):
    return RRedCoTSettings(
        segmentation=SegmentationSettings(max_segments=12, min_segment_len=2),
        probe=ProbeSettings(value_source=source, profile=profile, **probe),
    )


def _assert_canonical(tokenizer, plan):
    """Every probe is the tokenizer's own encoding of prefix + forced + scored written out as one text."""
    prompt, response = plan.prompt_ids.tolist(), plan.response_ids.tolist()
    assert plan.probes
    for probe in plan.probes:
        full = prompt + response[: probe.boundary] + list(probe.forced_ids) + list(probe.scored_ids)
        text = tokenizer.decode(full, skip_special_tokens=False)
        assert _encode(tokenizer, text) == full, (probe.boundary, text[-80:])


def _text(tokenizer, ids):
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def test_qwen3_exit_probes_are_canonical_open_thinking_and_close_the_answer_as_the_model_does(qwen_tokenizer, caplog):
    tok = qwen_tokenizer
    prompt = _prompt(tok, QWEN3_TEMPLATE)
    traces = [
        _record(tok, prompt, _qwen3_response(PARAGRAPHS_OK, "59"), 1.0),
        _record(tok, prompt, _qwen3_response(PARAGRAPHS_BAD, "58", closing="$"), 0.0),
    ]
    with caplog.at_level(logging.WARNING):
        plans = plan_traces(traces, _settings("qwen3"), tok, PARAGRAPHS, temperature=0.7)
    assert not caplog.records  # every probe joined its prefix as the tokenizer writes it
    exit_text = PROFILE_PRESETS["qwen3"].exit_text
    for plan in plans:
        assert plan.temperature == 0.7 and plan.value_rule == "self_normalized"
        assert len(plan.segment_ends) > 4
        _assert_canonical(tok, plan)
        forced = {p.boundary: _text(tok, p.forced_ids) for p in plan.probes}
        # S_0: the response has not opened thinking: Qwen3's empty thinking block, then the exit.
        assert forced[0] == "<think>\n" + exit_text
        # After a newline boundary the exit starts with </think> on its own line (no doubled newline).
        later = [b for b in forced if b > 0]
        assert later and all(forced[b] == exit_text.lstrip("\n") for b in later)
    probes = plans[0].probes
    scored = {(p.kind, _text(tok, p.scored_ids)) for p in probes if p.boundary == 0}
    # No EOS; both answers with every closing that is a token of its own, prefix-free ("}$." and "}$" are both
    # single tokens: distinct next tokens, disjoint events).
    assert (KIND_CORRECT, "{59}$.") in scored and (KIND_CORRECT, "{59}$") in scored
    assert (KIND_INCORRECT, "{58}$") in scored and not any("<|im_end|>" in text for _, text in scored)
    at_zero = [p.scored_ids for p in probes if p.boundary == 0]
    assert not any(a != b and b[: len(a)] == a for a in at_zero for b in at_zero)


def test_r1_distill_prompt_opens_thinking_and_probes_stay_canonical(qwen_tokenizer):
    tok = qwen_tokenizer
    prompt = _prompt(tok, R1_TEMPLATE)
    assert _text(tok, prompt.tolist()).endswith("<think>\n")
    body = "\n\n".join(PARAGRAPHS_OK) + "\n</think>\n\n**Final Answer**\n\\[\n\\boxed{59}\n\\]"
    plans = plan_traces([_record(tok, prompt, body, 1.0)], _settings("r1_distill"), tok, BOXED_MATH)
    plan = plans[0]
    _assert_canonical(tok, plan)
    forced = {p.boundary: _text(tok, p.forced_ids) for p in plan.probes}
    assert not any("<think>" in text for text in forced.values())  # the prompt opened thinking
    assert forced[0] == PROFILE_PRESETS["r1_distill"].exit_text.lstrip("\n")
    assert plan.temperature == 1.0


def test_reference_continuation_aligns_multi_line_steps(qwen_tokenizer):
    """A trace following the reference paragraphs: each state's continuation is exactly the reference text that
    remains after it, also inside a multi-line paragraph, whatever the number of lines per step."""
    tok = qwen_tokenizer
    prompt = _prompt(tok, QWEN3_TEMPLATE)
    reference = _qwen3_response(PARAGRAPHS_OK, "59", closing="")
    trace = _record(tok, prompt, reference + "$.", 1.0, steps=PARAGRAPHS_OK)
    settings = RRedCoTSettings(
        segmentation=SegmentationSettings(max_segments=12, min_segment_len=2),
        probe=ProbeSettings(value_source="reference_continuation", profile="qwen3"),
        candidates=CandidateSettings(source="ground_truth"),
    )
    plan = plan_traces([trace], settings, tok, PARAGRAPHS)[0]
    _assert_canonical(tok, plan)
    response = trace.response_ids.tolist()
    thinking_end = reference.index("\n</think>")
    checked = 0
    for probe in plan.probes:
        prefix = _text(tok, response[: probe.boundary])
        if not prefix or "</think>" in prefix:
            continue
        continuation = _text(tok, probe.scored_ids)
        # Up to the answer, the prefix and its continuation spell the reference (the exit's leading newline is
        # dropped when the prefix already ends a line).
        stem = reference[len(prefix): thinking_end]
        expected = stem + "\n</think>" if not prefix.endswith("\n") or stem else "</think>"
        assert continuation.startswith(expected), (prefix[-30:], continuation[:60])
        checked += 1
    inside = [p for p in plan.probes if _text(tok, response[: p.boundary]).endswith("Then subtract:\n")]
    assert inside and _text(tok, inside[0].scored_ids).startswith("68-17=51.\nThat looks right.\n\nWait")
    assert checked >= 5


def test_continuation_text_resumes_at_the_step_the_prefix_reached():
    steps = ["Add:\n23+45=68.", "Subtract:\n68-17=51.", "Add:\n51+8=59."]
    # A completed paragraph: the next one follows.
    assert continuation_text("\nAdd:\n23+45=68.\n\n", steps, PARAGRAPHS) == "Subtract:\n68-17=51.\n\nAdd:\n51+8=59."
    # Inside a paragraph that matches the entry: finish it.
    assert continuation_text("\nAdd:\n23+45=68.\n\nSubtract:\n", steps, PARAGRAPHS) == "68-17=51.\n\nAdd:\n51+8=59."
    # Inside a paragraph that diverged: close it, continue with the next step.
    assert continuation_text("\nAdd:\n23+45=68.\n\nSubtract:\n68-17=50.\n", steps, PARAGRAPHS) == "\nAdd:\n51+8=59."
    # Nothing written yet: the first step on a new line.
    assert continuation_text("", steps, PARAGRAPHS) == "\n" + "\n\n".join(steps)
    assert continuation_text("\n", steps, PARAGRAPHS) == "\n\n".join(steps)
    # Lines (arithmetic): a partial line that matches is finished; every step done leaves nothing.
    lines = ["23+45=68", "68-17=51", "51+8=59"]
    assert continuation_text("\n23+45=68\n68-1", lines, ARITHMETIC) == "7=51\n51+8=59"
    assert continuation_text("\n23+45=68\n68-17=51\n51+8=59\n", lines, ARITHMETIC) == ""


def test_reference_alignment_resumes_a_reference_of_another_length_or_route():
    """When trace and bank entry differ in step count or route, ``steps`` resumes by count, ``proportional`` at the
    same fraction of the entry, ``content`` after the entry step the prefix's last step reads like."""
    reference = ["7-1=6 +5+9-8", "6+5=11 +9-8", "11+9=20 -8", "20-8=12"]
    # A trace that merged the first two steps: it has completed one line that reads like the entry's second.
    merged = "\n7-1+5=11 +9-8\n"
    assert continuation_text(merged, reference, ARITHMETIC) == "\n".join(reference[1:])
    assert continuation_text(merged, reference, ARITHMETIC, "content") == "\n".join(reference[2:])
    # Proportional: 1 of the trace's 3 steps done stands for round(4/3) = 1 entry step; 2 of 3 for 3 of 4.
    assert continuation_text(merged, reference, ARITHMETIC, "proportional", 3) == "\n".join(reference[1:])
    two = merged + "11+9=20 -8\n"
    assert continuation_text(two, reference, ARITHMETIC, "proportional", 3) == reference[3]
    assert continuation_text(two, reference, ARITHMETIC, "content") == reference[3]
    # A long trace against a short solution: 10 of 20 paragraphs done resumes half way through the 4 steps.
    long_body = "\n" + "".join(f"Thought {i}.\n\n" for i in range(10))
    assert continuation_text(long_body, reference, PARAGRAPHS, "proportional", 20) == "\n\n".join(reference[2:])
    # A partial step is finished when the aligned entry step starts with it, under every alignment.
    for alignment in ("steps", "proportional", "content"):
        assert continuation_text("\n7-1=6 +5+9-8\n6+", reference, ARITHMETIC, alignment, 4).startswith("5=11 +9-8\n")
    with pytest.raises(ValueError, match="reference_alignment"):
        ProbeSettings(reference_alignment="nearest")


def test_embedded_profile_reproduces_the_task_format():
    """On the embedded task the S_0 reference continuation is exactly the reference response + EOS, and exit
    probes after a step line force "</think>\\n\\boxed" and score "{answer}" + EOS."""
    tok = build_tokenizer()
    problem = ArithmeticProblem((23, 45, 17, 8), ("+", "-", "+"))
    prompt = torch.tensor(chat_prompt_ids(tok, problem.prompt))
    ids = torch.tensor(response_ids(tok, reference_response(problem)))
    trace = TraceRecord(prompt, ids, torch.ones(ids.numel()), 1.0, "g", "59", reference_steps(problem))
    settings = RRedCoTSettings(segmentation=SegmentationSettings(max_segments=8, min_segment_len=2),
                               probe=ProbeSettings(value_source="reference_continuation", profile="embedded"))
    plan = plan_traces([trace], settings, tok, ARITHMETIC)[0]
    first = next(p for p in plan.probes if p.boundary == 0)
    assert list(first.scored_ids) == ids.tolist()
    _assert_canonical(tok, plan)
    exits = plan_traces([trace], settings.__class__(segmentation=settings.segmentation,
                                                    probe=ProbeSettings(profile="embedded")), tok, ARITHMETIC)[0]
    _assert_canonical(tok, exits)
    later = [p for p in exits.probes if p.boundary > 0]
    assert later and all(_text(tok, p.forced_ids) == "</think>\n\\boxed" for p in later)
    assert {_text(tok, p.scored_ids) for p in later} == {"{59}<|endoftext|>"}


def test_profiles_presets_overrides_and_errors():
    settings = settings_from_config({"rredcot": {"probe": {"profile": "r1_distill", "exit_text": "\n</think>\n\\boxed",
                                                           "answer_closings": ["}"]}}})
    profile = settings.probe.profile_values
    assert profile.exit_text == "\n</think>\n\\boxed" and profile.answer_closings == ("}",)
    assert profile.think_opener == PROFILE_PRESETS["r1_distill"].think_opener
    for probe, message in (({"profile": "llama"}, "probe.profile must be one of"),
                           ({"answer_closings": []}, "answer_closings must be a non-empty list"),
                           ({"think_opener": "<reasoning>"}, "think_opener must start with think_start")):
        with pytest.raises(ValueError, match=message):
            settings_from_config({"rredcot": {"probe": probe}})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['think_end'\] in algorithm.rredcot.segmentation"):
        settings_from_config({"rredcot": {"segmentation": {"think_end": "</think>"}}})
    with pytest.raises(ValueError, match="temperature must be > 0"):
        plan_traces([], RRedCoTSettings(), None, PARAGRAPHS, temperature=0.0)


def test_boxed_math_task_reads_and_compares_answers_with_math_verify():
    assert BOXED_MATH.extract_answer("so $\\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"
    assert BOXED_MATH.answer_text("$\\boxed{0.5}$") == "0.5"
    assert BOXED_MATH.equivalent("\\frac{1}{2}", "0.5") and not BOXED_MATH.equivalent("\\frac{1}{2}", "0.4")
    assert not PARAGRAPHS.equivalent("\\frac{1}{2}", "0.5")
    assert BOXED_MATH.split_steps("A\nstill A\n\n  \nB\n") == ["A\nstill A", "B"]
    assert resolve_task("arithmetic") is ARITHMETIC
    assert resolve_task("rredcot_verl.tasks.base:PARAGRAPHS") is PARAGRAPHS
    with pytest.raises(ValueError, match="unknown task 'maths'"):
        resolve_task("maths")


def test_an_equivalent_answer_of_an_incorrect_trace_is_a_correct_candidate(qwen_tokenizer):
    tok = qwen_tokenizer
    prompt = _prompt(tok, QWEN3_TEMPLATE)
    traces = [_record(tok, prompt, _qwen3_response(PARAGRAPHS_OK, "0.5"), 1.0, truth=None),
              _record(tok, prompt, _qwen3_response(PARAGRAPHS_OK, "\\frac{1}{2}"), 0.0, truth=None)]
    settings = _settings("qwen3")
    kinds = {p.kind for p in plan_traces(traces, settings, tok, BOXED_MATH)[0].probes}
    assert kinds == {KIND_CORRECT}
    kinds = {p.kind for p in plan_traces(traces, settings, tok, PARAGRAPHS)[0].probes}
    assert kinds == {KIND_CORRECT, KIND_INCORRECT}


def test_joining_falls_back_when_a_merge_crosses_the_boundary(qwen_tokenizer):
    tok = qwen_tokenizer
    writer = ProbeTokenizer(tok)
    context = _encode(tok, "so 23+45=68.")  # "." + "\n" would merge into ".\n": the trace's "." cannot change
    tokens = writer.continuation(context, "\n</think>", exit_line=True)
    assert _text(tok, tokens) == "\n</think>" and writer.split_joins == 1
    context = _encode(tok, "so 23+45=68.\n")  # the prefix already ends the line: no doubled newline before </think>
    assert _text(tok, writer.continuation(context, "\n</think>", exit_line=True)) == "</think>"
    # A step separator a continuation completes is text of its own: kept, and ".\n" + "\n" joined as ".\n\n"
    # would change the trace's token, so it is tokenized alone.
    assert _text(tok, writer.continuation(context, "\nWait")) == "\nWait" and writer.split_joins == 2


def test_verified_repairs_fill_the_bank_of_a_group_without_a_correct_trace(qwen_tokenizer):
    """``group_and_repairs``: a group whose traces all failed is valued along its verified repair (as a correct trace
    of the group would be); a group with a correct trace keeps its own bank; both are counted per step."""
    tok = qwen_tokenizer
    prompt = _prompt(tok, QWEN3_TEMPLATE)
    wrong = [dataclasses.replace(_record(tok, prompt, _qwen3_response(PARAGRAPHS_BAD, "58"), 0.0), group="g")
             for _ in range(2)]
    mixed = [dataclasses.replace(_record(tok, prompt, _qwen3_response(PARAGRAPHS_OK, "59"), 1.0), group="h"),
             dataclasses.replace(_record(tok, prompt, _qwen3_response(PARAGRAPHS_BAD, "58"), 0.0), group="h")]
    repair = _encode(tok, _qwen3_response(PARAGRAPHS_OK, "59")) + [tok.eos_token_id]
    other_repair = _encode(tok, _qwen3_response(["Just add them all: 23+45-17+8=59."], "59")) + [tok.eos_token_id]
    settings = dataclasses.replace(_settings("qwen3", source="reference_continuation"),
                                   candidates=CandidateSettings(source="group_and_repairs"))
    plans = plan_traces(wrong + mixed, settings, tok, PARAGRAPHS, repairs={"g": [repair], "h": [other_repair]})
    assert [plan.bank_sources for plan in plans] == [{"repairs"}, {"repairs"}, {"traces"}, {"traces"}]
    assert not any(plan.no_candidates for plan in plans)
    # The wrong trace's first state continues along the repair's paragraphs; group h never sees its repair.
    first = [p for p in plans[0].probes if p.value_index == 0]
    assert first and all("68-17=51.\nThat looks right." in _text(tok, p.scored_ids) for p in first)  # one per closing
    assert not any("Just add them all" in _text(tok, p.scored_ids) for plan in plans[2:] for p in plan.probes)
    assert bank_metrics(plans, ["g", "g", "h", "h"]) == {
        "rredcot/bank_groups_from_traces": 1.0, "rredcot/bank_groups_from_dataset": 0.0,
        "rredcot/bank_groups_from_repairs": 1.0, "rredcot/bank_groups_empty": 0.0,
    }  # fmt: skip

    group_only = dataclasses.replace(settings, candidates=CandidateSettings(source="group"))
    plans = plan_traces(wrong + mixed, group_only, tok, PARAGRAPHS, repairs={"g": [repair]})
    assert [plan.no_candidates for plan in plans] == [True, True, False, False]
    assert bank_metrics(plans, ["g", "g", "h", "h"])["rredcot/bank_groups_empty"] == 1.0
    with pytest.raises(ValueError, match="group_and_repairs needs the step's verified repairs"):
        plan_traces(wrong, settings, tok, PARAGRAPHS)


def _tool_agent_record(tokenizer, prompt, turns: list[str], tool_outputs: list[str], outcome: float) -> TraceRecord:
    """A multi-turn response as verl's tool agent loop lays it out with a ChatML builder: each assistant turn (mask
    1) ends with <|im_end|>; the builder's separator "\\n", the tool message and the next assistant header follow
    with mask 0."""
    ids, mask = [], []
    for j, turn in enumerate(turns):
        turn_ids = _encode(tokenizer, turn) + [tokenizer.eos_token_id]
        ids, mask = ids + turn_ids, mask + [1] * len(turn_ids)
        if j < len(tool_outputs):
            context = _encode(tokenizer, f"\n<|im_start|>user\n<tool_response>\n{tool_outputs[j]}\n</tool_response>"
                                         "<|im_end|>\n<|im_start|>assistant\n")
            ids, mask = ids + context, mask + [0] * len(context)
    entropy = torch.tensor([2.0 if i and "\n" in tokenizer.decode([ids[i - 1]]) else 0.1 for i in range(len(ids))])
    return TraceRecord(prompt, torch.tensor(ids), entropy, outcome, "g", "59", response_mask=torch.tensor(mask))


TOOL_TURNS = [
    "<think>\nOkay, let me add the first two numbers with the tool.\n</think>\n\n<tool_call>23+45</tool_call>",
    "<think>\nThen subtract:\n68-17=51.\n</think>\n\n<tool_call>51+8</tool_call>",
]


@pytest.mark.parametrize("strategy", ["turns", "hybrid"])
def test_tool_agent_trace_is_cut_and_probed_turn_by_turn(qwen_tokenizer, strategy):
    """A thinking model's tool trajectory: each turn's </think> ends its thinking, its tool call is one segment,
    no state sits on the tool output, and every state is probed as the policy saw it: a state at a later turn's
    start opens that turn's thinking anew (before, the first </think> ended the thinking of the whole response and
    later states got no probe)."""
    tok = qwen_tokenizer
    prompt = _prompt(tok, QWEN3_TEMPLATE)
    turns = [*TOOL_TURNS, _qwen3_response(PARAGRAPHS_OK[2:], "59")]
    traces = [_tool_agent_record(tok, prompt, turns, ["68", "59"], 1.0),
              _record(tok, prompt, _qwen3_response(PARAGRAPHS_BAD, "58"), 0.0)]
    settings = dataclasses.replace(
        _settings("qwen3"), segmentation=SegmentationSettings(strategy=strategy, max_segments=12, min_segment_len=2)
    )
    plan = plan_traces(traces, settings, tok, PARAGRAPHS)[0]
    response, mask = plan.response_ids.tolist(), traces[0].response_mask.tolist()
    think_end = tok.convert_tokens_to_ids("</think>")
    think_ends = [p for p, token in enumerate(response) if token == think_end]
    turn_starts = [p for p in range(1, len(mask)) if mask[p] and not mask[p - 1]]
    assert len(think_ends) == 3 and len(turn_starts) == 2
    assert {*think_ends, *turn_starts} <= set(plan.segment_ends)
    assert plan.segment_ends[-1] == len(response) and all(mask[start] for start in plan.starts)
    assert {p.value_index for p in plan.probes} == set(range(plan.num_values))  # every state has a value
    _assert_canonical(tok, plan)
    forced = {p.boundary: _text(tok, p.forced_ids) for p in plan.probes}
    exit_text = PROFILE_PRESETS["qwen3"].exit_text
    for start in [0, *turn_starts]:  # the turn has not opened its thinking yet
        assert forced[start] == "<think>\n" + exit_text
    assert all(not forced[b].startswith("<think>") for b in forced if b not in (0, *turn_starts))


def test_own_continuation_values_skip_the_tool_output(qwen_tokenizer):
    """``own_continuation``: a state's value is the probability of the policy's own remaining tokens; the tool output
    and template tokens in between are the environment's, so they leave the value as if they were not there."""
    from rredcot_verl.core.probes import own_continuation_values

    tok = qwen_tokenizer
    prompt = _prompt(tok, QWEN3_TEMPLATE)
    trace = _tool_agent_record(tok, prompt, TOOL_TURNS, ["68"], 1.0)
    settings = dataclasses.replace(_settings("qwen3", source="own_continuation"),
                                   segmentation=SegmentationSettings(strategy="turns"))
    plan = plan_traces([trace], settings, tok, PARAGRAPHS)[0]
    assert plan.response_mask is trace.response_mask and not plan.probes
    mask = trace.response_mask.bool()
    log_probs = -0.05 * torch.rand(mask.numel(), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    holed = own_continuation_values(log_probs, plan.starts, 1.0, plan.response_mask)
    rank = torch.cat([torch.zeros(1, dtype=torch.long), mask.long().cumsum(0)])
    plain = own_continuation_values(log_probs[mask], [int(rank[start]) for start in plan.starts], 1.0)
    torch.testing.assert_close(holed, plain)
    assert (holed[:2] > own_continuation_values(log_probs, plan.starts, 1.0)[:2]).all()  # states before the tool output


def test_answers_in_tool_output_are_not_the_models(qwen_tokenizer):
    """The group's answers (exit probes' candidates, the self-normalising denominator) are read from the model's
    tokens only: a tool that prints a boxed number has not answered for the policy."""
    tok = qwen_tokenizer
    prompt = _prompt(tok, QWEN3_TEMPLATE)
    unfinished = _tool_agent_record(tok, prompt, TOOL_TURNS, ["The answer is $\\boxed{68}$."], 0.0)
    traces = [_record(tok, prompt, _qwen3_response(PARAGRAPHS_OK, "59"), 1.0), unfinished]
    plans = plan_traces(traces, _settings("qwen3"), tok, PARAGRAPHS)
    scored = {_text(tok, probe.scored_ids) for plan in plans for probe in plan.probes}
    assert not any("68" in text for text in scored)
    assert {probe.kind for plan in plans for probe in plan.probes} == {KIND_CORRECT}
