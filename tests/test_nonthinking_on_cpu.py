"""Models without thinking markers (Qwen2.5-Instruct, Llama, Mistral): the ``plain`` probe profile, the ``auto``
profile read from the tokenizer, verl's GSM8K task and the dataset check that refuses a task reading no answer.

The tokenizer is built here as in tests/test_planning_on_cpu.py (byte-level BPE with Qwen2's pre-tokenizer, so
``.\\n`` and ``####`` are single pieces), once without ``<think>``/``</think>`` (Qwen2.5) and once with them; the chat
templates are the shipped assets (Qwen2.5, Qwen3, R1-distill). Every probe is checked against the tokenizer's own
encoding of the same text written in full.
"""

import os
import random

import pandas as pd
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from rredcot_verl.core.planning import plan_traces
from rredcot_verl.core.probes import KIND_CORRECT, KIND_INCORRECT, ProbeSettings
from rredcot_verl.core.profiles import (
    PROFILE_PRESETS,
    ProbeProfile,
    answer_region_start,
    detect_family,
    preset,
    resolve_profile,
)
from rredcot_verl.core.segmentation import BoundaryVocab, SegmentationSettings
from rredcot_verl.core.settings import RRedCoTSettings, settings_from_config
from rredcot_verl.core.traces import TraceRecord
from rredcot_verl.tasks import math_data
from rredcot_verl.tasks.base import (
    BOXED_MATH,
    GSM8K,
    TASKS,
    check_dataset_rows,
    check_task_reads_answers,
    gsm8k_solution_steps,
)
from rredcot_verl.tasks.miniature import ASSETS, GSM8K_INSTRUCTION, gsm8k_rows, load_problems
from rredcot_verl.tasks.model import train_qwen2_style_bpe

torch.set_num_threads(1)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QUESTION = "Tom has 3 boxes with 12 pencils in each box. He gives away 9 pencils. How many are left?"
STEPS_OK = ["Tom starts with 3 * 12 = 36 pencils.", "After giving away 9 he has 36 - 9 = 27 pencils."]
STEPS_BAD = ["Tom starts with 3 * 12 = 36 pencils.", "After giving away 9 he has 36 - 9 = 25 pencils."]


def _template(name: str) -> str:
    with open(os.path.join(ASSETS, "chat_templates", name), encoding="utf-8") as f:
        return f.read()


def _corpus():
    rng = random.Random(0)
    docs = ["system\nuser\nassistant\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."]
    for _ in range(300):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        docs.append(f"{QUESTION} {GSM8K_INSTRUCTION}\nFirst {a} * {b} = {a * b} pencils.\nThen {a * b} - {b} = "
                    f"{a * b - b} pencils.\n#### {a * b - b}\n\n**Final Answer**\n\\boxed{{{a * b - b}}}.")
    return docs


def _tokenizer(added, template):
    tok = train_qwen2_style_bpe(_corpus(), 600, SPECIAL, added)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"], chat_template=template,
                                   clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def qwen25():
    tokenizer = _tokenizer([], _template("qwen2_5.jinja"))
    for piece in (".\n", "####"):  # the pieces this test is about are single tokens, as in Qwen's vocabulary
        assert len(tokenizer.encode(piece, add_special_tokens=False)) == 1, piece
    return tokenizer


@pytest.fixture(scope="module")
def thinking_vocab():
    return train_qwen2_style_bpe(_corpus(), 600, SPECIAL, ["<think>", "</think>"])


def _with_template(tok, template):
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=template, clean_up_tokenization_spaces=False)


def _encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def _prompt(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"{QUESTION} {GSM8K_INSTRUCTION}"}],
                                         add_generation_prompt=True, tokenize=False)
    return torch.tensor(_encode(tokenizer, text))


def _record(tokenizer, text, outcome, truth="27", steps=None, group="g"):
    ids = _encode(tokenizer, text) + [tokenizer.eos_token_id]
    # Entropy high after every newline token, so the hybrid strategy cuts at each line.
    entropy = torch.tensor([2.0 if i and "\n" in tokenizer.decode([ids[i - 1]]) else 0.1 for i in range(len(ids))])
    return TraceRecord(_prompt(tokenizer), torch.tensor(ids), entropy, outcome, group, truth, steps)


def _settings(source="exit_probe", **probe):
    return RRedCoTSettings(segmentation=SegmentationSettings(max_segments=12, min_segment_len=2),
                           probe=ProbeSettings(value_source=source, **probe))


def _text(tokenizer, ids):
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def _assert_canonical(tokenizer, plan):
    """Every probe is the tokenizer's own encoding of prefix + forced + scored written out as one text."""
    prompt, response = plan.prompt_ids.tolist(), plan.response_ids.tolist()
    assert plan.probes
    for probe in plan.probes:
        full = prompt + response[: probe.boundary] + list(probe.forced_ids) + list(probe.scored_ids)
        assert _encode(tokenizer, _text(tokenizer, full)) == full, (probe.boundary, _text(tokenizer, full)[-80:])


# ------------------------------------------------------------------------------------------------------ profiles


def test_plain_profiles_have_no_markers_and_follow_the_answer_style():
    boxed, gsm8k = preset("plain"), preset("plain", "gsm8k")
    assert not boxed.thinks and boxed.think_start == boxed.think_end == boxed.think_opener == ""
    assert boxed.exit_text == "\n\n**Final Answer**\n\\boxed" and boxed.answer_prefix == "{"
    assert boxed.answer_markers == ("**Final Answer**\n\\boxed", "\\boxed")
    # verl's GSM8K convention: "#### 27" then EOS; a closing "." would read "27." which verl's reward scores 0.
    assert (gsm8k.exit_text, gsm8k.answer_prefix, gsm8k.answer_closings, gsm8k.answer_eos) == (
        "\n####", " ", ("", "\n"), True)
    assert gsm8k.answer_markers == ("####",)
    # The thinking families keep their boxed text and gain the GSM8K one after </think>.
    assert PROFILE_PRESETS["qwen3"].exit_text == "\n</think>\n\n**Final Answer**\n\\boxed"
    assert preset("qwen3", "gsm8k").exit_text == "\n</think>\n\n####"
    assert preset("qwen3", "gsm8k").answer_markers == ("####",)
    with pytest.raises(ValueError, match="has no 'gsm8k' answer text"):
        preset("embedded", "gsm8k")


def test_profile_validation_for_optional_markers():
    with pytest.raises(ValueError, match="must all be set or all be empty"):
        ProbeProfile("<think>", "", "<think>", "\n\\boxed", "{", ("}",), False)
    with pytest.raises(ValueError, match="an empty one only with answer_eos"):
        ProbeProfile("", "", "", "\n####", " ", ("",), False)
    with pytest.raises(ValueError, match="non-blank"):
        ProbeProfile("", "", "", "\n\n", "{", ("}",), False)
    # auto accepts overrides that suit one of the families it may pick, and is resolved only with a tokenizer.
    settings = settings_from_config({"rredcot": {"probe": {"think_opener": "<think>"}}})
    assert settings.probe.profile == "auto"
    with pytest.raises(ValueError, match="resolved from the tokenizer"):
        settings.probe.profile_values
    with pytest.raises(ValueError, match="must all be set or all be empty"):
        resolve_profile("plain", {"think_opener": "<think>"})


def test_auto_detects_the_three_template_kinds(qwen25, thinking_vocab):
    assert detect_family(qwen25) == "plain"
    qwen3 = _with_template(thinking_vocab, _template("qwen3.jinja"))
    assert detect_family(qwen3) == "qwen3"
    r1 = _with_template(thinking_vocab, _template("r1_distill.jinja").replace("bos_token + ", ""))
    assert detect_family(r1) == "r1_distill"
    # <think> in the vocabulary is not enough: a template that never opens thinking (a non-thinking sibling of a
    # thinking family) and a tokenizer without a template are plain.
    assert detect_family(_with_template(thinking_vocab, _template("qwen2_5.jinja"))) == "plain"
    assert detect_family(_with_template(thinking_vocab, None)) == "plain"
    # A template whose generation prompt closes thinking itself: the model answers without it.
    closed = _template("qwen2_5.jinja").replace(
        "'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n'")
    assert closed != _template("qwen2_5.jinja")
    assert detect_family(_with_template(thinking_vocab, closed)) == "plain"
    # The default setting resolves per tokenizer; a named profile is kept.
    probe = ProbeSettings()
    assert probe.profile_for(qwen3) == PROFILE_PRESETS["qwen3"]
    assert probe.profile_for(r1, "gsm8k") == preset("r1_distill", "gsm8k")
    assert probe.profile_for(qwen25, "gsm8k") == preset("plain", "gsm8k")
    assert ProbeSettings(profile="qwen3").profile_for(qwen25) == PROFILE_PRESETS["qwen3"]
    # The segmentation of a model without thinking has no end-of-thinking token.
    vocab = RRedCoTSettings().boundary_vocab(qwen25)
    assert isinstance(vocab, BoundaryVocab) and vocab.think_end == "" and vocab.think_end_id is None
    assert RRedCoTSettings().boundary_vocab(qwen3).think_end_id == qwen3.convert_tokens_to_ids("</think>")


# ------------------------------------------------------------------------------------------------------ planning


def _gsm8k_traces(tok, with_wrong_only_group=False):
    ok = "\n".join(STEPS_OK) + "\n#### 27"
    bad = "\n".join(STEPS_BAD) + "\n#### 25\nDone."  # a line after the answer: a state inside the answer region
    traces = [_record(tok, ok, 1.0), _record(tok, bad, 0.0)]
    if with_wrong_only_group:
        traces += [_record(tok, bad, 0.0, group="h", steps=STEPS_OK), _record(tok, bad + ".", 0.0, group="h",
                                                                             steps=STEPS_OK)]
    return traces


def test_exit_probes_without_thinking_markers_on_verl_gsm8k_answers(qwen25):
    tok = qwen25
    traces = _gsm8k_traces(tok)
    plans = plan_traces(traces, _settings(), tok, GSM8K)
    for plan, trace in zip(plans, traces):
        _assert_canonical(tok, plan)
        assert sorted({p.value_index for p in plan.probes}) == list(range(plan.num_values))  # every state valued
        response = trace.response_ids.tolist()
        text = _text(tok, response)
        answer_start = max(b for b in range(len(response) + 1) if len(_text(tok, response[:b])) <= text.rfind("####"))
        for probe in plan.probes:
            start = plan.starts[probe.value_index]
            # States inside the answer line are probed from its start, never after "#### 2".
            assert probe.boundary == min(start, answer_start)
            forced = _text(tok, probe.forced_ids)
            prefix = _text(tok, response[: probe.boundary])
            # After a finished line the exit text's newline is dropped (the prefix ends with it), and so it is
            # where the response starts (after the template's "assistant\n"): "####".
            line_start = prefix.endswith("\n") or probe.boundary == 0
            assert forced == ("####" if line_start else "\n####"), (prefix[-20:], forced)
            scored = _text(tok, probe.scored_ids)
            assert scored in (" 27<|im_end|>", " 27\n<|im_end|>", " 25<|im_end|>", " 25\n<|im_end|>")
            assert (probe.kind == KIND_CORRECT) == ("27" in scored)
        assert {p.kind for p in plan.probes} == {KIND_CORRECT, KIND_INCORRECT}
    assert plans[0].starts[0] == 0 and any(s > answer_start for s in plans[1].starts)


def test_reference_continuation_without_thinking_markers(qwen25):
    tok = qwen25
    traces = _gsm8k_traces(tok, with_wrong_only_group=True)
    plans = plan_traces(traces, _settings("reference_continuation"), tok, GSM8K)
    for plan in plans:
        _assert_canonical(tok, plan)
        assert sorted({p.value_index for p in plan.probes}) == list(range(plan.num_values))
    # From the empty response, group g's bank entry is its correct trace: its lines then "#### 27" and EOS (the
    # answer line is not a step of the entry, so it is not written twice).
    first = [p for p in plans[1].probes if p.value_index == 0]
    texts = {_text(tok, p.scored_ids) for p in first}
    assert "\n".join(STEPS_OK) + "\n#### 27<|im_end|>" in texts
    assert all(t.count("####") == 1 for t in texts)
    # Group h has no correct trace: its bank is the dataset's reference steps, continued from each state.
    last = plans[2].probes[-1]
    assert _text(tok, last.scored_ids).startswith("####") or _text(tok, last.scored_ids).startswith("\n####")
    assert plans[2].bank_sources == frozenset({"dataset"})


def test_boxed_answers_without_thinking_markers(qwen25):
    tok = qwen25
    ok = "\n\n".join(STEPS_OK) + "\n\n**Final Answer**\n\\boxed{27}."
    bad = "\n\n".join(STEPS_BAD) + " So the answer is $\\boxed{25}$."
    assert answer_region_start(ok, preset("plain")) == ok.index("**Final")
    assert answer_region_start(bad, preset("plain")) == bad.index("\\boxed")
    traces = [_record(tok, ok, 1.0), _record(tok, bad, 0.0)]
    for source in ("exit_probe", "reference_continuation"):
        plans = plan_traces(traces, _settings(source, profile="plain"), tok, BOXED_MATH)
        for plan in plans:
            _assert_canonical(tok, plan)
            assert sorted({p.value_index for p in plan.probes}) == list(range(plan.num_values))
    exit_plan = plan_traces(traces, _settings(profile="plain"), tok, BOXED_MATH)[0]
    assert exit_plan.probes[0].boundary == 0
    assert _text(tok, exit_plan.probes[0].forced_ids) == "**Final Answer**\n\\boxed"
    assert {_text(tok, p.forced_ids) for p in exit_plan.probes} <= {
        "**Final Answer**\n\\boxed", "\n**Final Answer**\n\\boxed", "\n\n**Final Answer**\n\\boxed"}
    assert {_text(tok, p.scored_ids) for p in exit_plan.probes if p.kind == KIND_CORRECT} >= {"{27}", "{27}."}


def test_values_are_finite_for_every_state_with_a_real_model(qwen25):
    """The plans score: a random two-layer Qwen2 gives every state of every trace a finite value."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rredcot_verl.core.values import compute_segment_values

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(qwen25), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=512)).eval()
    traces = _gsm8k_traces(qwen25, with_wrong_only_group=True)
    for source in ("exit_probe", "reference_continuation"):
        segment_ends, raw_values, _ = compute_segment_values(model, qwen25, traces, _settings(source), task=GSM8K)
        for row, ends in zip(raw_values, segment_ends):
            k = int((ends >= 0).sum())
            assert k > 1 and torch.isfinite(row[: k + 1]).all(), (source, row)


# ---------------------------------------------------------------------------------------------------- gsm8k task


def test_gsm8k_task_reads_answers_as_verls_reward():
    from verl.utils.reward_score.gsm8k import compute_score, extract_solution

    texts = ["So 3 * 4 = 12.\n#### 12", "#### 1,200\n", "#### 3\nno wait\n#### -4.5.", "#### $5", "The answer is 7",
             "x" * 400 + "\n#### 8", "#### 9\n" + "y" * 400]
    for text in texts:
        read = GSM8K.extract_answer(text)
        verl = extract_solution(text)
        assert (read is None) == (verl is None), text[-40:]
        if read is not None:
            assert read.replace(",", "") == verl, (read, verl)
            assert compute_score(text, read.replace(",", "")) == 1.0
    assert GSM8K.extract_answer("#### 1,200") == "1,200"  # as written: the probe scores the written text
    assert GSM8K.equivalent("1,200", "1200") and not GSM8K.equivalent("42.0", "42")  # verl's reward: 42.0 scores 0
    assert GSM8K.answer_text(" 72 ") == "72" and GSM8K.answer_text("rationale\n#### 72") == "72"
    assert GSM8K.split_steps("a = 1.\n\n b = 2.\n") == ["a = 1.", "b = 2."] and GSM8K.step_separator == "\n"
    assert TASKS["gsm8k"] is GSM8K and GSM8K.answer_style == "gsm8k" and BOXED_MATH.answer_style == "boxed"
    raw = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
    assert gsm8k_solution_steps(raw) == ["Natalia sold 48/2 = 24 clips in May.", "Natalia sold 48+24 = 72 clips."]


def _verl_gsm8k_rows():
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    raw = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
    question = "Natalia sold clips to 48 of her friends in April, and half as many in May. How many in total?"
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": "72"},
             "extra_info": {"split": "train", "index": 0, "answer": raw, "question": question}}] * 3


def test_dataset_check_refuses_a_task_that_reads_no_answer(tmp_path):
    rows = _verl_gsm8k_rows()
    problem = check_dataset_rows("boxed_math", rows)
    assert problem.startswith("algorithm.rredcot.task=boxed_math reads no answer") and "gsm8k" in problem
    assert check_dataset_rows("gsm8k", rows) is None
    # Rows read back from parquet (numpy arrays for lists) are accepted as they come.
    pd.DataFrame(rows).to_parquet(tmp_path / "gsm8k.parquet")
    assert check_dataset_rows("boxed_math", pd.read_parquet(tmp_path / "gsm8k.parquet").to_dict("records"))
    # Without solutions, the prompt's instruction ("####") refuses the boxed task.
    problem = check_task_reads_answers(BOXED_MATH, ["72"], prompts=[rows[0]["prompt"][0]["content"]])
    assert "ask for gsm8k answers" in problem and "use task gsm8k" in problem
    # The converter's rows (boxed solutions; GSM8K rationales stripped of their answer) suit boxed_math only.
    converted = math_data.convert(load_problems(6), "math", "train").to_dict("records")
    assert check_dataset_rows("boxed_math", converted) is None
    assert "gsm8k" in check_dataset_rows("gsm8k", converted)
    gsm8k_converted = math_data.convert([{"question": "q", "answer": rows[0]["extra_info"]["answer"]}], "g", "train")
    assert check_dataset_rows("boxed_math", gsm8k_converted.to_dict("records")) is None
    # Ground truths the task cannot write and read back (a fraction for the GSM8K number).
    assert "cannot read any of the 1 sampled ground truths" in check_task_reads_answers(GSM8K, ["\\frac{1}{2}"])
    # The miniature qwen2_5 data is verl's GSM8K format.
    miniature = gsm8k_rows(load_problems(10), "train").to_dict("records")
    assert check_dataset_rows("gsm8k", miniature) is None and check_dataset_rows("boxed_math", miniature)


def test_verls_gsm8k_rows_give_the_bank_their_rationale_as_reference_steps(qwen25):
    """verl's own rows carry no extra_info.reference_steps: a group without a correct trace continues from the
    rationale in extra_info.answer instead of falling back for want of values."""
    tok = qwen25
    bad = "\n".join(STEPS_BAD) + "\n#### 25"
    traces = [_record(tok, bad, 0.0, group="h"), _record(tok, bad + ".", 0.0, group="h")]
    for trace in traces:
        trace.extra_info = {"answer": "\n".join(STEPS_OK) + "\n#### 27"}
    plans = plan_traces(traces, _settings("reference_continuation"), tok, GSM8K)
    assert plans[0].bank_sources == frozenset({"dataset"})
    texts = {_text(tok, p.scored_ids) for p in plans[0].probes if p.value_index == 0}
    assert "\n".join(STEPS_OK) + "\n#### 27<|im_end|>" in texts
    assert GSM8K.dataset_steps({"answer": "a = <<1+1=2>>2.\n#### 2"}) == ["a = 2."]
    assert GSM8K.dataset_steps({}) is None and GSM8K.dataset_steps(None) is None
