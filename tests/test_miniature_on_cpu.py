"""Miniature paper families (tasks/miniature.py, built by tasks/build.py): parquet in prepare_math_data's format, the
family's chat template and single-token thinking markers, a warm start that writes boxed answers, the math-verify
reward on the shipped problems, and the family's probe profile on the built tokenizer. One build per family (about
15 s each)."""

import importlib.util
import threading
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from miniature_launch import shared_build_folder
from rredcot_verl.core.profiles import ProbeTokenizer
from rredcot_verl.core.settings import settings_from_config
from rredcot_verl.tasks import math_data
from rredcot_verl.tasks.math_reward import compute_score
from rredcot_verl.tasks.build import build
from rredcot_verl.tasks.build import testbed as named_testbed  # a name pytest would collect as a test
from rredcot_verl.tasks.miniature import DATA_SOURCE, FAMILIES, MathRow, load_problems
from rredcot_verl.tasks.model import load_model_dir
from rredcot_verl.tasks.reward import extract_boxed_answer
from rredcot_verl.tasks.sft import generate_responses

ROOT = Path(__file__).resolve().parents[1]
PROMPT_ENDS = {"qwen3": "<|im_start|>assistant\n", "r1_distill": "<｜Assistant｜><think>\n"}
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def built(request, tmp_path_factory):
    """(family, output folder, build record) with the default settings, built on two threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with shared_build_folder(f"miniature_{request.param}", tmp_path_factory) as out:
            record = build(named_testbed(request.param), str(out))
        yield request.param, out, record
    finally:
        torch.set_num_threads(threads)


def _tokenizer(out):
    return load_model_dir(str(out / "model"), with_model=False)[1]


def test_data_is_what_prepare_math_data_writes(built):
    _, out, record = built
    spec = importlib.util.spec_from_file_location("prepare_math_data", ROOT / "recipes/paper/prepare_math_data.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.convert is math_data.convert  # the recipe script and the package share one converter
    reference = pa.Table.from_pandas(math_data.convert(load_problems(1), DATA_SOURCE, "train")).schema
    problems = {p["problem"] for p in load_problems()}
    for split, size in (("train", record["n_train"]), ("test", record["n_test"])):
        path = out / "data" / f"{split}.parquet"
        assert pq.read_schema(path).remove_metadata() == reference.remove_metadata()
        frame = pd.read_parquet(path)
        assert len(frame) == size and set(frame["data_source"]) == {DATA_SOURCE} and set(frame["ability"]) == {"math"}
        for prompt, reward, info in zip(frame["prompt"], frame["reward_model"], frame["extra_info"]):
            assert len(prompt) == 1 and prompt[0]["role"] == "user"
            problem, instruction = prompt[0]["content"].rsplit("\n", 1)
            assert problem in problems and instruction == math_data.INSTRUCTION
            assert reward["style"] == "rule" and reward["ground_truth"].strip()
            assert extract_boxed_answer(info["reference_solution"]) == reward["ground_truth"]
            assert info["split"] == split
    assert (record["n_train"], record["n_test"]) == (64, 16)


def test_chat_template_and_thinking_tokens(built):
    family, out, _ = built
    tokenizer = _tokenizer(out)  # as verl and vLLM load it (AutoTokenizer)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith(PROMPT_ENDS[family])
    if family == "qwen3":
        assert prompt == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
        no_think = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False,
                                                 enable_thinking=False)
        assert no_think == prompt + "<think>\n\n</think>\n\n"
    else:
        assert prompt == "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>\n"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == prompt
    for marker in ("<think>", "</think>"):
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1, marker
    response = "<think>\nok\n</think>\n\n**Final Answer**\n\\boxed{4}"
    ids = tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == response  # what verl hands the reward keeps the markers
    assert [tokenizer.decode([i]) for i in tokenizer.encode("\\boxed{12}", add_special_tokens=False)] == [
        "\\boxed", "{", "1", "2", "}"]


def test_vllm_reads_the_model_folder(built):
    family, out, _ = built
    from vllm.tokenizers import get_tokenizer
    from vllm.transformers_utils.config import get_config

    config = get_config(str(out / "model"), trust_remote_code=False)
    assert config.model_type == FAMILIES[family].model_type
    assert config.head_dim in (32, 64, 128) and config.tie_word_embeddings == FAMILIES[family].tie_word_embeddings
    tokenizer = get_tokenizer(str(out / "model"))
    assert len(tokenizer) == config.vocab_size and tokenizer.eos_token == FAMILIES[family].eos_token


def test_warm_start_writes_boxed_answers(built):
    family, out, record = built
    sampled = record["warm_start"]["eval"]["sampled"]
    assert sampled["boxed_rate"] >= 0.5 and sampled["accuracy"] > 0, sampled
    # The saved weights are the warm-started ones: sample again from the folder.
    model, tokenizer = load_model_dir(str(out / "model"))
    frame = pd.read_parquet(out / "data" / "train.parquet").head(8)
    rows = [MathRow(p[0]["content"], r["ground_truth"], "") for p, r in zip(frame["prompt"], frame["reward_model"])]
    responses = generate_responses(model, tokenizer, rows, True, record["max_reference_response_tokens"] + 32, seed=1)
    assert sum(extract_boxed_answer(r) is not None for r in responses) >= 4, responses
    if family == "qwen3":  # Qwen3 opens thinking itself; R1's prompt already did
        assert all(r.startswith("<think>\n") for r in responses), responses
    assert all("</think>" in r for r in responses), responses


def test_a_second_build_is_cached(built):
    family, out, record = built
    messages = []
    assert build(named_testbed(family), str(out), log=messages.append) == record
    assert messages == [f"{family}: reusing {out} (settings unchanged)"]


def test_reward_scores_shipped_solutions_in_any_thread():
    problems = [p for p in load_problems() if any(k in p["solution"] for k in ("frac{1}", "0.45", "{27}"))][:4]
    cases = []
    for problem in problems:
        truth = extract_boxed_answer(problem["solution"])
        wrong = problem["solution"].replace(f"\\boxed{{{truth}}}", "\\boxed{1000}")
        cases += [(problem["solution"], truth, 1.0), (wrong, truth, 0.0)]
    cases += [("so $\\boxed{0.5}$.", "\\frac{1}{2}", 1.0), ("no answer", "3", 0.0)]
    assert [compute_score(DATA_SOURCE, text, truth) for text, truth, _ in cases] == [s for *_, s in cases]
    results = []
    worker = threading.Thread(target=lambda: results.extend(compute_score(DATA_SOURCE, t, g) for t, g, _ in cases))
    worker.start()
    worker.join()
    assert results == [s for *_, s in cases]  # verl's reward workers call it off the main thread


def test_family_probe_profile_tokenizes_on_the_built_tokenizer(built):
    family, out, _ = built
    tokenizer = _tokenizer(out)
    profile = settings_from_config({"rredcot": {"probe": {"profile": family}}}).probe.profile_values
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    opener = "" if family == "r1_distill" else profile.think_opener
    prefix = prompt + opener + "First, 2+2=4.\n"
    writer = ProbeTokenizer(tokenizer)
    context = tokenizer.encode(prefix, add_special_tokens=False)
    exit_ids = writer.continuation(context, profile.exit_text, exit_line=True)
    # the prefix ends the line, so the exit text's leading newline is dropped; the join is the tokenizer's own
    assert writer.decode(exit_ids) == profile.exit_text.lstrip("\n")
    assert context + list(exit_ids) == tokenizer.encode(prefix + profile.exit_text.lstrip("\n"),
                                                        add_special_tokens=False)
    assert writer.split_joins == 0
    answer_ids = writer.continuation(context + list(exit_ids), profile.answer_prefix + "4}")
    assert writer.decode(answer_ids) == "{4}"
