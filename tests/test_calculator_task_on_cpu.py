"""The calculator task (tasks/calculator.py), its verl tool (tasks/calculator_tool.py) and the token layout of its warm
start (tasks/calculator_miniature.py) against verl's own tool-loop code: registry, hermes parser, Continuous Token
builder."""

import asyncio
import json
import random

import pandas as pd
import pytest

from rredcot_verl.tasks import calculator
from rredcot_verl.tasks.arithmetic import ArithmeticProblem, make_problem, write_parquet
from rredcot_verl.tasks.base import TASKS, check_dataset_rows
from rredcot_verl.tasks.reward import compute_score
from rredcot_verl.tasks.sft import pad_for_sft, pad_masked

PROBLEM = ArithmeticProblem((7, 1, 5, 9), ("-", "-", "-"))


@pytest.mark.parametrize(("expression", "value"), [("3+4", 7), ("7-9", -2), (" -8 * 3 ", -24), ("12-05", 7)])
def test_calculate_evaluates_one_integer_operation(expression, value):
    assert calculator.calculate(expression) == value


@pytest.mark.parametrize("expression", ["2**3", "1+2+3", "__import__('os')", "3/4", "1.5+2", "", None, 12,
                                        "1234567890123*2"])
def test_calculate_refuses_anything_else(expression):
    with pytest.raises(ValueError, match="expected 'a\\+b'"):
        calculator.calculate(expression)


def test_reference_trace_calls_once_per_step_and_boxes_the_chain():
    assert calculator.step_expressions(PROBLEM) == ["7-1", "6-5", "1-9"]
    turns = calculator.reference_turns(PROBLEM)
    assert [answer for _, _, answer in turns] == ["6", "1", "-8", None]
    assert json.loads(turns[0][0].removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")) == {
        "name": "calculator", "arguments": {"expression": "7-1"}}
    response = "".join(text for text, _, _ in turns)
    assert compute_score(calculator.DATA_SOURCE, response, str(PROBLEM.answer)) == 1.0
    # a tool's answer is never read as the model's: without the boxed turn the trace scores 0
    assert compute_score(calculator.DATA_SOURCE, "".join(text for text, _, _ in turns[:-1]) + "-8", "-8") == 0.0


def test_wrong_step_is_the_first_call_that_leaves_the_reference():
    info = {"expressions": calculator.step_expressions(PROBLEM)}
    calls = [calculator.tool_call_text(e) for e in ("7-1", "6-5", "1-9")]
    assert calculator.calculator_wrong_step(info, "\n".join(calls) + "\\boxed{3}") is None  # the reward judges it
    wrong = "\n".join([calls[0], calculator.tool_call_text("6 - 4"), calls[2]])
    step, (start, stop) = calculator.calculator_wrong_step(info, wrong)
    assert step == 2 and wrong[start:stop] == calculator.tool_call_text("6 - 4")
    assert calculator.calculator_wrong_step(info, calls[0]) == (2, (len(calls[0]), len(calls[0])))
    assert calculator.calculator_wrong_step(info, "<tool_call>not json</tool_call>")[0] == 1
    assert calculator.calculator_wrong_step(info, "\n".join([*calls, calls[0]]))[0] == 4
    assert calculator.calculator_wrong_step({}, "".join(calls)) is None


def test_rows_are_verl_agent_loop_rows_the_task_reads(tmp_path):
    train, _ = write_parquet(str(tmp_path), 8, 2, 0, calculator.TASK_CONFIG, row=calculator.agent_row)
    frame = pd.read_parquet(train)
    assert set(frame["agent_name"]) == {"tool_agent"} and set(frame["data_source"]) == {calculator.DATA_SOURCE}
    for prompt, truth, info in zip(frame["prompt"], frame["reward_model"], frame["extra_info"]):
        problem = ArithmeticProblem(tuple(int(x) for x in info["operands"]), tuple(str(o) for o in info["ops"]))
        assert [m["role"] for m in prompt] == ["user"] and prompt[0]["content"] == problem.prompt
        assert truth["ground_truth"] == str(problem.answer)
        assert list(info["expressions"]) == calculator.step_expressions(problem)
        assert problem.num_steps == 2 and max(problem.operands) <= 9
    task = TASKS["calculator"]
    assert check_dataset_rows(task, frame.to_dict("records")) is None
    assert task.extract_answer(calculator.FINAL_ANSWER.format(-8)) == "-8" and task.equivalent("-8", " -8")


def test_pad_masked_learns_only_the_masked_tokens():
    input_ids, attention_mask, labels = pad_masked(0, [([5, 6, 7, 8], [0, 1, 0, 1]), ([9, 10], [1, 1])])
    assert input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert labels.tolist() == [[-100, 6, -100, 8], [9, 10, -100, -100]]
    assert [t.tolist() for t in pad_for_sft(0, [([5, 6], [7])])] == [[[5, 6, 7]], [[1, 1, 1]], [[-100, -100, 7]]]
    with pytest.raises(ValueError, match="loss mask"):
        pad_masked(0, [([1, 2], [1])])


@pytest.fixture(scope="module")
def tool_setup():
    """verl's registry loads the task's tool config; a small tokenizer of the miniature family."""
    from rredcot_verl.tasks import calculator_miniature as cm
    from rredcot_verl.tasks.miniature import MiniatureConfig, family_tokenizer

    tools = cm.load_tools()
    schemas = cm.tool_schemas(tools)
    rng = random.Random(0)
    problems = [make_problem(rng, calculator.TASK_CONFIG) for _ in range(16)]
    tokenizer = family_tokenizer(cm.FAMILY, cm._corpus(problems, schemas), MiniatureConfig())
    return cm, tools, schemas, tokenizer


def test_the_tool_loads_through_verls_registry_and_answers(tool_setup):
    from rredcot_verl.tasks.calculator_tool import CalculatorTool

    _, tools, schemas, _ = tool_setup
    assert [type(t) for t in tools] == [CalculatorTool] and tools[0].name == "calculator"
    assert schemas[0]["function"]["parameters"]["required"] == ["expression"]
    response, reward, metrics = asyncio.run(tools[0].execute("id", {"expression": "6-5"}))
    assert (response.text, reward, metrics) == ("1", 0.0, {"valid_call": 1.0})
    response, _, metrics = asyncio.run(tools[0].execute("id", {"expression": "import os"}))
    assert response.text.startswith("error: expected") and metrics == {"valid_call": 0.0}


def test_warm_start_tokens_are_the_tool_loops_layout(tool_setup):
    """The SFT conversation is what verl's ToolAgentLoop builds: the same prompt, assistant turns ending at
    <|im_end|> that verl's hermes parser reads as the reference calls, tool answers and headers (mask 0) from verl's
    builder, and as a whole the chat template's rendering of the conversation."""
    from verl.experimental.agent_loop.tool_parser import ToolParser

    cm, _, schemas, tokenizer = tool_setup
    builder = cm.token_builder(tokenizer)
    ids, prompt_length, mask = cm.conversation_tokens(builder, tokenizer, schemas, PROBLEM)
    assert ids[:prompt_length] == builder.build_initial_tokens([{"role": "user", "content": PROBLEM.prompt}],
                                                               tools=schemas)
    assert mask[:prompt_length] == [0] * prompt_length and mask[prompt_length] == 1
    turns, current = [], None
    for token, bit in zip(ids[prompt_length:], mask[prompt_length:]):
        if bit and current is None:
            current = []
            turns.append(current)
        if bit:
            current.append(token)
        else:
            current = None
    reference = calculator.reference_turns(PROBLEM)
    assert [tokenizer.decode(turn) for turn in turns] == [text + "<|im_end|>" for text, _, _ in reference]
    parser = ToolParser.get_tool_parser("hermes", tokenizer)
    for turn, expression in zip(turns, calculator.step_expressions(PROBLEM)):
        _, calls = asyncio.run(parser.extract_tool_calls(turn))
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("calculator", {"expression": expression})]
    messages = [{"role": "user", "content": PROBLEM.prompt}]
    for _, message, answer in reference:
        messages += [message] + ([{"role": "tool", "content": answer}] if answer is not None else [])
    rendered = tokenizer.apply_chat_template(messages, tools=schemas, tokenize=False)
    assert tokenizer.decode(ids) + "\n" == rendered
    holes = tokenizer.decode([t for t, bit in zip(ids[prompt_length:], mask[prompt_length:]) if not bit])
    assert holes.count("<tool_response>") == 3 and "calculator" not in holes


def test_a_played_conversation_resumed_at_any_turn_start_replays_it():
    """The tool loop the turn-credit benchmark samples with (``calculator_miniature.tool_loop``, verl's parser, tool
    and builder around HF generate): the shipped warm start plays greedily; its response mask is 1 exactly on the
    assistant turns (each opens at a recorded turn start and ends at <|im_end|>), 0 on the tool answers between them;
    and a conversation cut back to any turn start (``resumed_state``) and played on greedily ends as it did."""
    from rredcot_verl.tasks import calculator_miniature as cm
    from rredcot_verl.tasks.model import load_model_dir

    model, tokenizer = load_model_dir(f"{cm.ARTEFACT_DIR}/model")
    tools, builder = cm.load_tools(), cm.token_builder(tokenizer)
    schemas = cm.tool_schemas(tools)
    rng = random.Random(3)
    problems = [make_problem(rng, calculator.TASK_CONFIG) for _ in range(3)]
    config = cm.CalculatorBuildConfig()
    states = cm.tool_loop(model, tokenizer, builder, tools, [cm.initial_state(builder, schemas, p) for p in problems],
                          False, config)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert sum(state["calls"] for state in states) >= 3
    for state in states:
        response, mask = state["ids"][state["prompt"]:], state["mask"]
        assert len(mask) == len(response) and len(state["turn_starts"]) == state["turns"]
        opens = [k for k, bit in enumerate(mask) if bit and (k == 0 or not mask[k - 1])]
        closes = [k for k, bit in enumerate(mask) if bit and (k + 1 == len(mask) or not mask[k + 1])]
        assert opens == state["turn_starts"] and all(response[k] == im_end for k in closes[:-1])
        holes = tokenizer.decode([t for t, bit in zip(response, mask) if not bit])
        assert holes.count("<tool_response>") == state["calls"]
    resumed = [cm.resumed_state(state, turn) for state in states for turn in range(state["turns"])]
    cm.tool_loop(model, tokenizer, builder, tools, resumed, False, config)
    originals = [state for state in states for _ in range(state["turns"])]
    assert [(r["ids"], r["mask"], r["turns"], r["calls"]) for r in resumed] == [
        (s["ids"], s["mask"], s["turns"], s["calls"]) for s in originals]
