"""The embedded task: generator, reward, step checker, tokenizer, model folder, warm start and cached build."""

import dataclasses
import json
import os
import random
import shutil
from functools import partial

import pandas as pd
import pytest
import torch

from rredcot_verl.tasks import build as build_module
from rredcot_verl.tasks.arithmetic import (
    DATA_SOURCE,
    ArithmeticProblem,
    ArithmeticTaskConfig,
    ItemsProblem,
    first_wrong_step,
    format_response,
    make_problem,
    parse_prompt,
    problem_from_extra_info,
    problem_from_reference,
    reference_response,
    reference_steps,
    slipped_steps,
    write_parquet,
)
from rredcot_verl.tasks.model import (
    CHAT_TEMPLATE,
    TinyModelConfig,
    build_model,
    build_tokenizer,
    chat_prompt_ids,
    check_vllm_head_dim,
    load_model_dir,
    response_ids,
    save_model_dir,
)
from rredcot_verl.tasks.base import TASKS
from rredcot_verl.tasks.reward import compute_score, extract_boxed_answer
from rredcot_verl.tasks.sft import (
    EXIT_TEXT,
    ExitExamples,
    SFTConfig,
    band_distance,
    exit_accuracy,
    exit_example,
    make_batch,
    make_training_batch,
    slip_delta,
    train_warm_start,
)

torch.set_num_threads(1)

# 23+45=68, 68-17=51, 51+8=59
PROBLEM = ArithmeticProblem((23, 45, 17, 8), ("+", "-", "+"))
SMALL_MODEL = TinyModelConfig(tokenizer_corpus_size=1000)
TINY_SFT = SFTConfig(max_steps=3, batch_size=4, eval_every_steps=3, n_eval=4, eval_max_new_tokens=8, warmup_steps=1)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(SMALL_MODEL)


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("model"))
    save_model_dir(build_model(tokenizer, SMALL_MODEL), tokenizer, path)
    return path


# --- generator -------------------------------------------------------------------------------------------------


def test_reference_solution_of_a_known_problem():
    assert PROBLEM.prompt == "Compute 23+45-17+8"
    assert reference_steps(PROBLEM) == ["23+45=68", "68-17=51", "51+8=59"]
    assert PROBLEM.answer == 59
    assert reference_response(PROBLEM) == "<think>\n23+45=68\n68-17=51\n51+8=59\n</think>\n\\boxed{59}"


def test_negative_running_totals_are_written_with_their_sign():
    problem = ArithmeticProblem((5, 12, 3), ("-", "+"))
    assert reference_steps(problem) == ["5-12=-7", "-7+3=-4"]
    assert reference_response(problem).endswith("\\boxed{-4}")


def test_random_problems_follow_the_config_and_the_seed():
    config = ArithmeticTaskConfig()
    problems = [make_problem(random.Random(7), config) for _ in range(2)]
    assert problems[0] == problems[1]  # same seed, same problem
    rng = random.Random(0)
    problems = [make_problem(rng, config) for _ in range(2000)]
    assert {p.num_steps for p in problems} == {2, 3, 4, 5}
    assert {op for p in problems for op in p.ops} == {"+", "-"}
    operands = [x for p in problems for x in p.operands]
    assert min(operands) == 1 and max(operands) == 99
    for problem in problems[:200]:
        steps = reference_steps(problem)
        assert len(steps) == problem.num_steps
        assert [int(line.split("=")[1]) for line in steps] == problem.running_totals()
        assert eval(problem.expression) == problem.answer  # the prompt's own arithmetic
        assert parse_prompt(problem.prompt) == problem
        assert first_wrong_step(problem, reference_response(problem)) is None


def test_invalid_task_settings_are_rejected():
    with pytest.raises(ValueError, match="min_operand"):
        ArithmeticTaskConfig(min_operand=50, max_operand=10)
    with pytest.raises(ValueError, match="min_operands"):
        ArithmeticTaskConfig(min_operands=1)
    with pytest.raises(ValueError, match="ops"):
        ArithmeticProblem((1, 2), ("*",))
    with pytest.raises(ValueError, match="not an arithmetic prompt"):
        parse_prompt("What is 2+2?")


def test_parquet_has_verls_columns_and_types(tmp_path):
    train_path, val_path = write_parquet(str(tmp_path), n_train=20, n_val=10, seed=3)
    train, val = pd.read_parquet(train_path), pd.read_parquet(val_path)
    assert len(train) == 20 and len(val) == 10
    assert list(train.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    row = train.iloc[0]
    assert row["data_source"] == DATA_SOURCE
    assert row["prompt"][0]["role"] == "user" and len(row["prompt"]) == 1
    problem = parse_prompt(row["prompt"][0]["content"])
    assert row["reward_model"]["style"] == "rule"
    assert row["reward_model"]["ground_truth"] == str(problem.answer)
    info = row["extra_info"]
    assert info["split"] == "train" and info["index"] == 0
    assert list(info["operands"]) == list(problem.operands) and list(info["ops"]) == list(problem.ops)
    assert list(info["reference_steps"]) == reference_steps(problem)
    assert info["reference_response"] == reference_response(problem)
    assert compute_score(row["data_source"], info["reference_response"], row["reward_model"]["ground_truth"]) == 1.0
    # validation comes from its own stream; the same seed writes the same files
    assert set(train["extra_info"].map(lambda i: i["reference_response"])).isdisjoint(
        val["extra_info"].map(lambda i: i["reference_response"]))
    write_parquet(str(tmp_path / "again"), n_train=20, n_val=10, seed=3)
    again = pd.read_parquet(tmp_path / "again" / "train.parquet")
    assert again["prompt"].map(lambda m: m[0]["content"]).tolist() == train["prompt"].map(
        lambda m: m[0]["content"]).tolist()


# --- reward ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "solution, truth, score",
    [
        ("<think>\n23+45=68\n</think>\n\\boxed{59}", "59", 1.0),
        ("\\boxed{58}", "59", 0.0),
        ("the answer is 59", "59", 0.0),  # no boxed answer
        ("\\boxed{12} wait, no: \\boxed{59}", "59", 1.0),  # the last boxed answer counts
        ("\\boxed{59} wait, no: \\boxed{12}", "59", 0.0),
        ("\\boxed{-7}", "-7", 1.0),
        ("\\boxed{7}", "-7", 0.0),
        ("\\boxed{ +7 }", "7", 1.0),
        ("\\boxed{007}", "7", 1.0),
        ("\\boxed{7.5}", "7", 0.0),
        ("\\boxed{abc}", "7", 0.0),
        ("\\boxed{7", "7", 0.0),  # never closed
        ("\\boxed{}", "7", 0.0),
        ("\\boxed{\u0667}", "7", 0.0),  # an Arabic-Indic seven is not the ASCII answer
        ("\x00\ufffd garbage }{ \\boxed", "7", 0.0),
    ],
)
def test_reward(solution, truth, score):
    assert compute_score(DATA_SOURCE, solution, truth, extra_info={"index": 0}) == score


def test_verl_loads_the_reward_file_by_path():
    from verl.utils.import_utils import load_extern_object

    from rredcot_verl.tasks import reward

    score = load_extern_object(module_path=reward.__file__, object_name="compute_score")
    assert score(DATA_SOURCE, "<think>\n2+3=5\n</think>\n\\boxed{5}", "5", extra_info={"index": 0}) == 1.0


def test_boxed_extraction_matches_braces():
    assert extract_boxed_answer("\\boxed{{1}+{2}}") == "{1}+{2}"
    assert extract_boxed_answer("\\boxed{ 3 }") == "3"
    assert extract_boxed_answer("no answer") is None


def test_reward_rejects_a_non_integer_ground_truth():
    with pytest.raises(ValueError, match="ground_truth"):
        compute_score(DATA_SOURCE, "\\boxed{1}", "one")


# --- first wrong step ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "steps, expected",
    [
        (["23+45=68", "68-17=51", "51+8=59"], None),
        (["23+45=68", "68-17=52", "52+8=60"], 2),  # wrong arithmetic
        (["23+45=68", "67-17=50", "50+8=58"], 2),  # wrong carried operand
        (["23+45=68", "68+17=85", "85+8=93"], 2),  # wrong next operator
        (["23+45=68", "68-71=-3", "-3+8=5"], 2),  # wrong next operand
        (["24+45=69", "69-17=52", "52+8=60"], 1),  # first operand miscopied
        (["23+45=68", "68 minus 17 is 51", "51+8=59"], 2),  # unparsable
        (["23+45=68", "68-17=51"], 3),  # stopped early
        (["23+45=68", "68-17=51", "51+8=59", "59+0=59"], 4),  # extra line
        (["23+45=68", "", "68-17=51", "51+8=59"], None),  # blank lines are not steps
    ],
)
def test_first_wrong_step(steps, expected):
    assert first_wrong_step(PROBLEM, format_response(steps, 59)) == expected


def test_first_wrong_step_on_malformed_responses():
    assert first_wrong_step(PROBLEM, "\\boxed{59}") == 1  # no <think>
    assert first_wrong_step(PROBLEM, "") == 1
    assert first_wrong_step(PROBLEM, "<think>\n23+45=68\n68-1") == 2  # truncated mid-line
    assert first_wrong_step(PROBLEM, "<think>\n23+45=68\n68-17=51\n") == 3  # truncated before the last step
    # only the think block is judged: the reward catches a wrong final answer
    assert first_wrong_step(PROBLEM, format_response(reference_steps(PROBLEM), 60)) is None


RESTATED = ArithmeticProblem((23, 45, 17, 8), ("+", "-", "+"), restate_remaining_terms=True)


@pytest.mark.parametrize(
    "steps, expected",
    [
        (["23+45=68 -17+8", "68-17=51 +8", "51+8=59"], None),  # the long setting's format
        (["23+45=68", "68-17=51", "51+8=59"], None),  # lines without the restatement are judged by their step
        (["23+45=68 -17", "68-17=51", "51+8=59"], 1),  # a term dropped from the restatement
        (["23+45=68 -17+8", "68-17=51 -8", "51-8=43"], 2),  # a sign miscopied in it
        (["23+45=68 -17+8", "68-17=51 +8", "51+8=59 +8"], 3),  # a restatement after the last step
        (["23+45=68 -17+8", "68-17=52 +8", "52+8=60"], 2),  # the step itself wrong, restatement right
    ],
)
def test_first_wrong_step_judges_restated_terms(steps, expected):
    assert reference_steps(RESTATED) == ["23+45=68 -17+8", "68-17=51 +8", "51+8=59"]
    assert first_wrong_step(RESTATED, format_response(steps, 59)) == expected


def test_a_slipped_line_shifts_every_later_total_and_is_judged_where_it_slipped():
    assert slipped_steps(RESTATED, 1, 10) == ["23+45=78 -17+8", "78-17=61 +8", "61+8=69"]
    assert slipped_steps(RESTATED, 3, -2) == ["23+45=68 -17+8", "68-17=51 +8", "51+8=57"]
    assert slipped_steps(RESTATED, 2, 0) == reference_steps(RESTATED)
    rng = random.Random(3)
    for _ in range(50):
        problem = make_problem(rng, ArithmeticTaskConfig(restate_remaining_terms=True))
        step = rng.randint(1, problem.num_steps)
        delta = slip_delta(problem.running_totals()[step - 1], rng)
        lines = slipped_steps(problem, step, delta)
        assert first_wrong_step(problem, format_response(lines, problem.answer + delta)) == step
        assert int(lines[-1].split("=")[1]) == problem.answer + delta  # the later lines follow the slip
    with pytest.raises(ValueError, match="step"):
        slipped_steps(RESTATED, 4, 1)


@pytest.mark.parametrize("total", [0, 7, -7, 68, -68, 100, 205, -1234])
def test_a_slip_changes_one_digit_and_keeps_the_sign(total):
    rng = random.Random(total)
    for _ in range(30):
        slipped = total + slip_delta(total, rng)
        digits, new = str(abs(total)), str(abs(slipped))
        assert slipped != total and len(new) == len(digits)  # no leading zero, no digit dropped
        assert [abs(int(a) - int(b)) for a, b in zip(digits, new) if a != b] == [1]  # one digit, one up or down
        assert slipped == 0 or (slipped < 0) == (total < 0)


def test_an_exit_example_is_the_cut_reference_with_the_exit_unlearned(tokenizer):
    ids, mask = exit_example(tokenizer, RESTATED, 1)
    assert ids == response_ids(tokenizer, format_response(["23+45=68 -17+8"], 59))
    exit_ids = tokenizer.encode(EXIT_TEXT, add_special_tokens=False)
    assert [i for i, m in zip(ids, mask) if m == 0] == exit_ids  # only the forced exit carries no loss
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]).endswith("{59}<|endoftext|>")
    immediate, mask = exit_example(tokenizer, RESTATED, 0)
    assert immediate == response_ids(tokenizer, format_response([], 59))
    # after a slipped line: that line and the exit unlearned, the answer the slipped lines lead to
    ids, mask = exit_example(tokenizer, RESTATED, 2, slip_step=1, delta=10)
    assert ids == response_ids(tokenizer, format_response(["23+45=78 -17+8", "78-17=61 +8"], 69))
    unlearned = tokenizer.decode([i for i, m in zip(ids, mask) if m == 0])
    assert unlearned == "23+45=78 -17+8\n" + EXIT_TEXT
    for bad in ({"kept_steps": 3}, {"kept_steps": 1, "slip_step": 2, "delta": 1}, {"kept_steps": 1, "slip_step": 1}):
        with pytest.raises(ValueError):
            exit_example(tokenizer, RESTATED, **{"kept_steps": 1, **bad})


def test_training_batches_mix_exit_examples_as_configured(tokenizer):
    problems = [make_problem(random.Random(i), ArithmeticTaskConfig(restate_remaining_terms=True)) for i in range(32)]
    whole = make_batch(tokenizer, problems)
    for got, expected in zip(make_training_batch(tokenizer, problems, random.Random(0), None), whole):
        assert torch.equal(got, expected)  # no exit examples: the whole references, as before
    _, _, labels = make_training_batch(tokenizer, problems, random.Random(0), ExitExamples(fraction=1.0))
    boxed, close = tokenizer.convert_tokens_to_ids("\\boxed"), tokenizer.convert_tokens_to_ids("</think>")
    for row, problem in zip(labels, problems):
        learned = row[row != -100].tolist()
        assert boxed not in learned and close not in learned  # every row cut, none learns to exit
    rng = random.Random(1)
    cut = make_training_batch(tokenizer, problems * 8, rng, ExitExamples(0.5, (1.0,), 1.0))[2]
    exits = sum(close not in row[row != -100].tolist() for row in cut)
    assert 0.35 < exits / len(cut) < 0.65
    with pytest.raises(ValueError, match="fraction"):
        ExitExamples(fraction=1.5)
    with pytest.raises(ValueError, match="steps_left_weights"):
        ExitExamples(steps_left_weights=(1.0, 0.0))


# --- tokenizer and model folder --------------------------------------------------------------------------------


def test_tokenizer_round_trips_and_splits_digits(tokenizer):
    texts = [
        reference_response(PROBLEM),
        "Compute 1+2-3",
        "  two  spaces\n\n\nnewlines\tand\ttabs -12 {-3} =-4 \\boxed{-59}",
        "unicode ünï 🙂 and 1234567890",
        "",
    ]
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    digits = tokenizer.convert_ids_to_tokens(tokenizer.encode("1234567890", add_special_tokens=False))
    assert digits == list("1234567890")


def test_think_tags_and_eos(tokenizer):
    ids = response_ids(tokenizer, reference_response(PROBLEM))
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokens[0] == "<think>" and "</think>" in tokens
    assert ids[-1] == tokenizer.eos_token_id and tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.pad_token_id != tokenizer.eos_token_id
    # verl decodes responses with skip_special_tokens=True: the think tags must survive, eos must not
    assert tokenizer.decode(ids, skip_special_tokens=True) == reference_response(PROBLEM)


def test_chat_template_renders_the_generation_prompt(tokenizer):
    messages = [{"role": "user", "content": PROBLEM.prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nCompute 23+45-17+8<|im_end|>\n<|im_start|>assistant\n"
    ids = chat_prompt_ids(tokenizer, PROBLEM.prompt)
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_ids_to_tokens(ids)[0] == "<|im_start|>"


def test_model_folder_reloads_identically(model_dir, tokenizer):
    model, loaded_tokenizer = load_model_dir(model_dir)
    # AutoTokenizer picks its own class for qwen2 folders: it must still tokenize exactly like the built one
    rng = random.Random(1)
    for _ in range(50):
        problem = make_problem(rng)
        for text in (problem.prompt, reference_response(problem)):
            assert loaded_tokenizer.encode(text, add_special_tokens=False) == tokenizer.encode(
                text, add_special_tokens=False)
    assert loaded_tokenizer.chat_template == CHAT_TEMPLATE
    config = model.config
    assert config.hidden_size // config.num_attention_heads == 32
    assert config.eos_token_id == tokenizer.eos_token_id and config.tie_word_embeddings
    assert config.vocab_size == len(tokenizer)
    assert 0.6e6 < sum(p.numel() for p in model.parameters()) < 0.75e6
    fresh = build_model(tokenizer, SMALL_MODEL)
    input_ids = torch.tensor([chat_prompt_ids(tokenizer, PROBLEM.prompt)])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, fresh(input_ids).logits)  # same seed, same weights


def test_head_dim_must_suit_vllm_cpu():
    check_vllm_head_dim(32)
    with pytest.raises(ValueError, match="head_dim=16"):
        check_vllm_head_dim(16)
    with pytest.raises(ValueError, match="head_dim=16"):
        TinyModelConfig(hidden_size=64, num_attention_heads=4)


def test_loader_names_the_folder_when_it_is_missing_or_broken(model_dir, tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        load_model_dir(str(missing))
    for name, pattern in (("config.json", "config.json"), ("model.safetensors", "safetensors"),
                          ("tokenizer.json", "tokenizer.json")):
        broken = tmp_path / f"without_{name}"
        shutil.copytree(model_dir, broken)
        os.remove(broken / name)
        with pytest.raises(FileNotFoundError, match=pattern) as error:
            load_model_dir(str(broken))
        assert str(broken) in str(error.value)
    corrupt = tmp_path / "corrupt_weights"
    shutil.copytree(model_dir, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=str(corrupt)):
        load_model_dir(str(corrupt))


# --- warm start and build --------------------------------------------------------------------------------------


def test_batch_masks_everything_but_the_response(tokenizer):
    input_ids, attention_mask, labels = make_batch(tokenizer, [PROBLEM, ArithmeticProblem((1, 2, 3), ("+", "+"))])
    first = labels[0][labels[0] != -100].tolist()
    assert first == response_ids(tokenizer, reference_response(PROBLEM))
    assert (labels[1][attention_mask[1] == 0] == -100).all()  # padding never has a label
    assert (input_ids[1][attention_mask[1] == 0] == tokenizer.pad_token_id).all()


def test_a_short_warm_start_reduces_the_loss(tokenizer):
    model = build_model(tokenizer, SMALL_MODEL)
    probe = make_batch(tokenizer, [make_problem(random.Random(99)) for _ in range(16)])

    def probe_loss():
        with torch.no_grad():
            return model(input_ids=probe[0], attention_mask=probe[1], labels=probe[2]).loss.item()

    before = probe_loss()
    config = SFTConfig(max_steps=12, batch_size=16, eval_every_steps=6, n_eval=8, eval_max_new_tokens=8,
                       warmup_steps=2)
    record = train_warm_start(model, tokenizer, ArithmeticTaskConfig(), config, progress_bar=False)
    assert probe_loss() < before - 0.5
    assert [c["step"] for c in record["checkpoints"]] == [6, 12]
    assert record["stopped_because"] == "max_steps" and not record["in_target_band"]
    assert record["kept"]["step"] == 12  # both at 0% accuracy: the later checkpoint is kept
    assert set(record["kept"]["sampled"]["by_num_steps"]) <= {2, 3, 4, 5}


def test_sft_settings_and_schedule():
    config = SFTConfig()
    assert config.lr_at(0, 0.0) == pytest.approx(config.lr / config.warmup_steps)
    assert config.lr_at(config.warmup_steps, 0.0) == pytest.approx(config.lr)
    assert config.lr_at(10_000, 1.0) == pytest.approx(config.lr * config.min_lr_ratio)
    assert band_distance(0.4, (0.3, 0.5)) == 0.0 and band_distance(0.2, (0.3, 0.5)) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="target_band"):
        SFTConfig(target_band=(0.6, 0.5))
    with pytest.raises(ValueError, match="budget_s"):
        SFTConfig(budget_s=0)


def test_build_is_cached_and_prefers_the_committed_artefact(tmp_path):
    artefact = build_module.Artefact(str(tmp_path / "artefact"))
    preset = build_module.Preset(model=SMALL_MODEL, sft=TINY_SFT, artefact=artefact)
    bed = partial(build_module.arithmetic_testbed, "tiny", preset, n_val=4)

    def run(out, n_train=12, **kwargs):
        logs = []
        record = build_module.build(bed(n_train), str(tmp_path / out), log=logs.append, **kwargs)
        return record, "\n".join(logs)

    with pytest.raises(ValueError, match="retrain"):
        run("a", update_artefact=True)
    record, _ = run("a")  # no artefact yet: trained
    assert record["model_source"] == "trained" and record["warm_start"]["total_steps"] == 3
    assert os.path.isfile(tmp_path / "a" / "data" / "train.parquet")
    assert record["max_prompt_tokens"] > 5 and record["max_reference_response_tokens"] > 10

    assert run("a") == (record, f"tiny: reusing {tmp_path / 'a'} (settings unchanged)")
    record, log = run("a", n_train=13)  # new data, same model
    assert record["model_source"] == "cached" and f"tiny: wrote {tmp_path / 'a' / 'data'}" in log
    assert len(pd.read_parquet(tmp_path / "a" / "data" / "train.parquet")) == 13

    record, _ = run("b", retrain=True, update_artefact=True)
    shipped = json.loads((tmp_path / "artefact" / "warmstart.json").read_text())
    assert shipped == {"fingerprint": record["model_fingerprint"], **record["warm_start"]}
    assert build_module.shipped_warm_start(bed(12)) == shipped
    record, log = run("c")
    assert record["model_source"] == "artefact" and "copied the committed warm start" in log
    assert {"fingerprint": record["model_fingerprint"], **record["warm_start"]} == shipped
    load_model_dir(str(tmp_path / "c" / "model"))
    other = build_module.arithmetic_testbed("tiny", build_module.Preset(model=SMALL_MODEL, artefact=artefact), 12)
    assert build_module.shipped_warm_start(other) is None  # other warm-start settings: the artefact does not match


def test_a_curriculum_trains_its_stages_in_order_from_the_first_tasks_tokenizer(tmp_path):
    """A preset with a curriculum trains each earlier stage from the one before's kept checkpoint, then its own
    (task, sft); the tokenizer comes from the first stage's task, the record keeps the earlier stages' records, and
    the curriculum enters the model fingerprint (a preset without one keeps the fingerprint it always had)."""
    two_digit = ArithmeticTaskConfig(min_operand=1, max_operand=49, independent_items=3)
    three_digit = ArithmeticTaskConfig(min_operand=10, max_operand=999, independent_items=3, item_digits=3)
    first = dataclasses.replace(TINY_SFT, max_steps=2, eval_every_steps=2)
    preset = build_module.Preset(three_digit, SMALL_MODEL, TINY_SFT, build_module.Artefact(str(tmp_path / "none")),
                                 curriculum=(build_module.Stage(two_digit, first),))
    record = build_module.build(build_module.arithmetic_testbed("tiny", preset, 12, n_val=4), str(tmp_path / "b"),
                                log=lambda *_: None)
    warm_start = record["warm_start"]
    assert [stage["total_steps"] for stage in warm_start["curriculum"]] == [2] and warm_start["total_steps"] == 3
    assert warm_start["curriculum"][0]["task_config"] == two_digit.as_dict()
    assert warm_start["task_config"] == three_digit.as_dict()
    first_settings = {key: value for key, value in dataclasses.asdict(first).items() if key != "exit_examples"}
    assert record["model_fingerprint"]["curriculum"] == build_module._json(
        [{"task": two_digit.as_dict(), "sft": first_settings}])
    _, tokenizer = load_model_dir(record["model_dir"], with_model=False)
    assert tokenizer.get_vocab() == build_tokenizer(SMALL_MODEL, two_digit).get_vocab()
    plain = build_module.Preset(three_digit, SMALL_MODEL, TINY_SFT)
    assert "curriculum" not in build_module.arithmetic_testbed("tiny", plain).model_fingerprint


@pytest.mark.parametrize("setting", [s for s in build_module.SETTINGS if build_module.testbed(s).artefact])
def test_every_committed_artefact_matches_its_settings_fingerprint(setting):
    """build --setting S copies S's committed warm start only when the fingerprint it records is the one S computes
    and its model folder loads; a stale one is reproduced with build --setting S --retrain --update-artefact."""
    assert build_module.shipped_warm_start(build_module.testbed(setting)) is not None


def test_committed_default_artefact_samples_in_its_band_and_chats():
    record = build_module.shipped_warm_start(build_module.testbed("default"))
    assert 0.2 <= record["kept"]["sampled"]["accuracy"] <= 0.7
    model, tokenizer = load_model_dir(build_module.PRESETS["default"].artefact.model_dir)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "Compute 1+2"}], add_generation_prompt=True,
                                         tokenize=False).endswith("assistant\n")


def test_committed_long_artefact_samples_in_the_long_presets_band_with_its_positions():
    """build --setting long copies the committed long warm start: its kept checkpoint samples inside the preset's
    band, and its model has the preset's positions."""
    preset = build_module.PRESETS["long"]
    record = build_module.shipped_warm_start(build_module.testbed("long"))
    low, high = preset.sft.target_band
    assert low <= record["kept"]["sampled"]["accuracy"] <= high
    model, _ = load_model_dir(preset.artefact.model_dir)
    assert model.config.max_position_embeddings == preset.model.max_position_embeddings


def test_committed_early_artefact_answers_only_the_last_step_early():
    """build --setting early copies the committed answer-early warm start: it samples inside 20-50% (the issue's band;
    the preset aims at 30-50% and kept its last checkpoint), and after a forced exit it answers with one step left far
    more often than immediately (docs/choices.md, "Answer-early setting")."""
    record = build_module.shipped_warm_start(build_module.testbed("early"))
    assert 0.2 <= record["kept"]["sampled"]["accuracy"] <= 0.5
    exit_record = record["kept"]["exit"]
    assert exit_record["last_step"] >= exit_record["immediate"] + 0.2
    assert exit_record["immediate"] < record["kept"]["sampled"]["accuracy"] / 2


def test_long_setting_meets_its_length_bar_within_its_models_positions():
    """The long preset's task (build --setting long): reference traces of at least 16 steps and a median of at least
    300 response tokens, prompt + the longest reference within the positions of the preset's model."""
    preset = build_module.PRESETS["long"]
    tokenizer = build_tokenizer(dataclasses.replace(preset.model, tokenizer_corpus_size=500), preset.task)
    rng = random.Random(5)
    problems = [make_problem(rng, preset.task) for _ in range(200)]
    lengths = sorted(len(response_ids(tokenizer, reference_response(p))) for p in problems)
    assert min(p.num_steps for p in problems) >= 16 and lengths[len(lengths) // 2] >= 300
    prompts = max(len(chat_prompt_ids(tokenizer, p.prompt)) for p in problems)
    assert prompts + lengths[-1] <= preset.model.max_position_embeddings
    assert preset.sft.eval_max_new_tokens >= lengths[-1]  # the warm start is judged on whole traces
    assert build_module.PRESETS["default"] == build_module.Preset()  # the default build is unchanged


# --- the items family ----------------------------------------------------------------------------------------------
ITEMS = ItemsProblem((23, 38, 33, 9, 40, 17), ("+", "-", "+"))  # 61, 24, 57


def test_items_reference_answer_and_prompt_round_trip():
    """Independent items, one line each, the answer their two-digit results written one after another."""
    assert ITEMS.prompt == "Compute each 23+38, 33-9, 40+17" and ITEMS.answer == 612457
    assert reference_steps(ITEMS) == ["23+38=61", "33-9=24", "40+17=57"]
    assert parse_prompt(ITEMS.prompt) == ITEMS
    assert problem_from_reference(ITEMS.prompt, reference_steps(ITEMS)) == ITEMS
    assert compute_score(None, reference_response(ITEMS), str(ITEMS.answer)) == 1.0
    assert first_wrong_step(ITEMS, reference_response(ITEMS)) is None
    config = build_module.ITEMS_TASK
    problems = [make_problem(random.Random(i), config) for i in range(200)]
    assert all(p.num_steps == config.independent_items for p in problems)
    assert all(10 <= r <= 99 and 1 <= min(p.operands) and max(p.operands) <= config.max_operand
               for p in problems for r in p.running_totals())


@pytest.mark.parametrize("steps, expected", [
    (["23+38=61", "33-9=25", "40+17=57"], 2),  # a wrong result
    (["23+38=61", "40+17=57", "33-9=24"], 2),  # items out of order
    (["23+38=61", "33-9=24"], 3),  # one missing
    (["23+38=61", "33-9=24", "40+17=57", "1+1=2"], 4),  # one extra
    (["23+38=61 ", "33-9 = 24", "40+17=57"], 2),  # the line must read a±b=c (surrounding spaces are stripped)
])
def test_items_first_wrong_step(steps, expected):
    assert first_wrong_step(ITEMS, format_response(steps, 0)) == expected


def test_an_items_slip_changes_its_own_item_and_answer_digits_only():
    """Items are independent: a slip at item 2 moves that line and those two answer digits, nothing after it."""
    assert slipped_steps(ITEMS, 2, 10) == ["23+38=61", "33-9=34", "40+17=57"]
    assert ITEMS.slipped_answer(2, 10) == 613457 and ITEMS.slipped_answer(2, -1) == 612357
    assert first_wrong_step(ITEMS, format_response(slipped_steps(ITEMS, 2, 10), 613457)) == 2


def test_an_items_exit_example_copies_the_lines_written_and_answers_the_rest(tokenizer):
    ids, mask = exit_example(tokenizer, ITEMS, 1)
    assert ids == response_ids(tokenizer, format_response(["23+38=61"], 612457))
    ids, mask = exit_example(tokenizer, ITEMS, 2, slip_step=1, delta=1)
    assert ids == response_ids(tokenizer, format_response(["23+38=62", "33-9=24"], 622457))
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m == 0]) == "23+38=62\n" + EXIT_TEXT


def test_items_rows_carry_their_family_and_the_task_adapter_judges_them(tmp_path):
    train, _ = write_parquet(str(tmp_path), 4, 2, 0, build_module.ITEMS_TASK)
    row = pd.read_parquet(train).iloc[0]
    info = dict(row["extra_info"])
    problem = problem_from_extra_info(info)
    assert isinstance(problem, ItemsProblem) and row["reward_model"]["ground_truth"] == str(problem.answer)
    with pytest.raises(ValueError):  # read as a chain without the flag, its operands do not fit
        problem_from_extra_info({**info, "independent_items": None})
    lines = list(info["reference_steps"])
    wrong = format_response([lines[0], lines[1].split("=")[0] + "=0", *lines[2:]], 0)
    step, span = TASKS["arithmetic"].first_wrong_step(info, wrong)
    assert step == 2 and wrong[span[0]:span[1]] == lines[1].split("=")[0] + "=0"


def test_items_settings_are_checked_and_leave_chain_fingerprints_alone():
    for bad in ({"independent_items": 1}, {"independent_items": -2}, {"independent_items": 3, "max_operand": 4},
                {"independent_items": 3, "item_digits": 1},
                {"independent_items": 3, "item_digits": 3, "max_operand": 49}):
        with pytest.raises(ValueError):
            ArithmeticTaskConfig(**bad)
    assert not {"independent_items", "item_digits"} & set(ArithmeticTaskConfig().as_dict())
    assert build_module.ITEMS_TASK.as_dict()["independent_items"] == 7
    assert "item_digits" not in build_module.ITEMS_TASK.as_dict()
    for mixed in (((5, 3, 40, 17), ("+", "+")), ((40, 17, 500, 17), ("+", "+"))):  # 5+3 one digit; 57 and 517
        with pytest.raises(ValueError):
            ItemsProblem(*mixed)


def test_three_digit_items_draw_parse_and_judge_like_two_digit_ones():
    config = ArithmeticTaskConfig(min_operand=10, max_operand=999, independent_items=7, item_digits=3)
    assert config.as_dict()["item_digits"] == 3
    rng = random.Random(0)
    for _ in range(20):
        problem = make_problem(rng, config)
        assert len(problem.running_totals()) == 7 and all(100 <= r <= 999 for r in problem.running_totals())
        assert len(str(problem.answer)) == 21 and parse_prompt(problem.prompt) == problem
        response = reference_response(problem)
        assert compute_score(None, response, problem.answer) == 1.0 and first_wrong_step(problem, response) is None
        slipped = format_response(slipped_steps(problem, 4, 10), problem.slipped_answer(4, 10))
        assert first_wrong_step(problem, slipped) == 4 and str(problem.slipped_answer(4, 10))[9:12] == str(
            problem.running_totals()[3] + 10)


def test_committed_items_artefact_samples_in_its_band_and_its_exit_answers_rank_states():
    """build --setting items copies the committed items warm start: it samples inside its preset's band; after a
    forced exit its greedy answer is never exactly right (RESULTS.md, "The screen"), yet the probability it gives the
    right answer rises with the right lines written and falls after a slipped one: what the exit probe scores."""
    preset = build_module.PRESETS["items"]
    record = build_module.shipped_warm_start(build_module.testbed("items"))
    low, high = preset.sft.target_band
    assert low <= record["kept"]["sampled"]["accuracy"] <= high
    model, tokenizer = load_model_dir(preset.artefact.model_dir)

    def answer_log_prob(problem, kept, slip_step=0, delta=0):
        ids, _ = exit_example(tokenizer, problem, kept, slip_step, delta)
        answer = tokenizer.encode("{" + f"{problem.answer}" + "}", add_special_tokens=False)
        sequence = chat_prompt_ids(tokenizer, problem.prompt) + ids[:-1 - len(answer)] + answer
        with torch.no_grad():
            log_probs = model(torch.tensor([sequence])).logits[0, -len(answer) - 1:-1].log_softmax(-1)
        return float(log_probs.gather(1, torch.tensor(answer)[:, None]).sum())

    problems = [make_problem(random.Random(100 + i), preset.task) for i in range(4)]
    for problem in problems:
        right = [answer_log_prob(problem, kept) for kept in (0, 3, 6)]
        assert right[0] < right[1] < right[2]
        assert answer_log_prob(problem, 6, slip_step=2, delta=1) < right[2] - 3


def test_committed_items3_artefact_came_through_its_curriculum_and_samples_in_its_band():
    """build --setting items3 copies the committed three-digit items warm start: the items warm start (in its band),
    trained on until its greedy answer after a forced exit with one item left is right about half the time, then on
    three-digit items into the band (docs/choices.md, "Three-digit items")."""
    preset = build_module.PRESETS["items3"]
    record = build_module.shipped_warm_start(build_module.testbed("items3"))
    items, trained_on = record["curriculum"]
    assert [stage.task for stage in preset.curriculum] == [build_module.ITEMS_TASK] * 2
    assert 0.2 <= items["kept"]["sampled"]["accuracy"] <= 0.5
    assert trained_on["kept"]["exit"]["by_steps_left"]["1"] >= 0.4 > items["kept"]["exit"]["by_steps_left"]["1"]
    low, high = preset.sft.target_band
    assert low <= record["kept"]["sampled"]["accuracy"] <= high and record["task_config"]["item_digits"] == 3
