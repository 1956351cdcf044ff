"""The calculator task (``tasks/calculator.py``) in miniature: data, tool config and a tiny warm-started model that
calls the tool, built on CPU for ``recipes/tiny_cpu/calculator.yaml``.

    python -m rredcot_verl.tasks.build --setting calculator --out DIR

writes

- ``DIR/data/{train,val}.parquet``: verl agent-loop rows (``calculator.agent_row``) from the arithmetic generator's
  streams (``arithmetic.write_parquet``).
- ``DIR/tools.yaml``: the tool config (a copy of ``assets/calculator_tools.yaml``), an absolute path for
  ``actor_rollout_ref.rollout.multi_turn.tool_config_path`` wherever Ray starts a worker.
- ``DIR/model/``: the ``qwen2_5`` miniature family (``tasks/miniature.py``) with Qwen2.5's tool-calling template and its
  tool tags as added tokens, SFT'd on whole solved conversations, loss on the assistant turns only. The token layout
  is verl's own: the prompt, every tool answer and the next assistant header come from verl's Continuous Token
  builder (the one ``ToolAgentLoop`` uses), so warm start and rollout see the same tokens. Training stops as soon as
  the sampled accuracy lies in ``target_band`` and keeps the checkpoint nearest it (``sft.band_distance``): RL needs
  groups with right and wrong traces.
- ``DIR/build.json``: the build record (``tasks/build.py``: fingerprint, token lengths, SFT checkpoints, evaluation).
  Accuracy is measured as the RL run will see it: the warm start plays verl's tool loop (hermes parser, the tool
  itself, the builder's merges) at temperature 1 on the training prompts, judged by the task reward.

The warm start takes about 17 minutes on two cores, so the package ships it (``assets/calculator_warmstart/``: the
model folder and ``calculator.json``, its fingerprint and warm-start record), copied when the fingerprint matches
(``tasks/build.py``: ``--retrain``, ``--update-artefact``). Bump ``BUILD_VERSION`` when a change to the task,
template, tool config or builder would change what gets built: it is part of the fingerprint, so stale folders and a
stale artefact stop matching.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass

from rredcot_verl.tasks import arithmetic, calculator, miniature, sft
from rredcot_verl.tasks.arithmetic import ArithmeticProblem, make_problem
from rredcot_verl.tasks.miniature import GSM8K_FAMILIES, MiniatureConfig
from rredcot_verl.tasks.reward import compute_score
from rredcot_verl.tasks.model import load_model_dir

BUILD_VERSION = 1
ARTEFACT_DIR = os.path.join(miniature.ASSETS, "calculator_warmstart")
TOOLS_FILE = "tools.yaml"
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")  # added tokens, as in Qwen2.5
FAMILY = dataclasses.replace(GSM8K_FAMILIES["qwen2_5"], template="qwen2_5_tools.jinja", added_tokens=TOOL_TAGS,
                             answer_style="boxed")


@dataclass(frozen=True)
class CalculatorBuildConfig:
    """Data, warm start and evaluation of the calculator miniature (the model's shape is ``MiniatureConfig``'s).

    Attributes:
        n_train, n_val: parquet rows.
        n_sft: solved conversations the warm start samples its batches from (fresh problems, not the parquet's).
        max_steps, budget_s: the warm start stops at whichever comes first (or in the band).
        batch_size, lr, warmup_steps: AdamW on the assistant tokens (``sft.short_sft_update``'s schedule).
        eval_every: steps between evaluations (and at the end).
        n_eval: training prompts the evaluation plays.
        target_band: sampled accuracy that stops training.
        max_turns, max_turn_tokens, max_response_tokens: the evaluation's tool loop limits (the recipe's
            max_assistant_turns and max_response_length).
        seed: data, initialisation, batches and sampling.
    """

    n_train: int = 64
    n_val: int = 16
    n_sft: int = 2048
    max_steps: int = 4000
    budget_s: float = 1500.0
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 30
    eval_every: int = 200
    n_eval: int = 32
    target_band: tuple[float, float] = (0.3, 0.6)
    max_turns: int = 6
    max_turn_tokens: int = 48
    max_response_tokens: int = 256
    seed: int = 0


def tool_schemas(tools) -> list[dict]:
    """The schemas verl's tool agent loop hands the chat template (``ToolAgentLoop.tool_schemas``)."""
    return [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for tool in tools]


def load_tools() -> list:
    """The tools of ``calculator.TOOL_CONFIG``, instantiated by verl's registry as its agent loop does."""
    from verl.tools.tool_registry import load_all_tools

    return load_all_tools(calculator.TOOL_CONFIG, None)


def token_builder(tokenizer):
    """verl's Continuous Token builder for a qwen2 model: the one ``ToolAgentLoop`` tokenises conversations with."""
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    return create_continuous_token_builder(tokenizer, hf_model_type="qwen2")


def conversation_tokens(builder, tokenizer, schemas: list[dict],
                        problem: ArithmeticProblem) -> tuple[list[int], int, list[int]]:
    """(token ids, prompt length, loss mask) of the solved conversation, laid out as verl's tool agent loop lays out a
    rollout: the builder's initial prompt; each assistant turn as generated (its text, then ``<|im_end|>``: mask 1);
    each tool answer merged by the builder (the separator after ``<|im_end|>``, the tool turn, the next assistant
    header: mask 0)."""
    im_end = tokenizer.convert_tokens_to_ids(FAMILY.eos_token)
    messages = [{"role": "user", "content": problem.prompt}]
    ids = list(builder.build_initial_tokens(messages, tools=schemas))
    prompt_length = len(ids)
    mask = [0] * prompt_length
    for text, message, tool_answer in calculator.reference_turns(problem):
        turn = tokenizer.encode(text, add_special_tokens=False) + [im_end]
        ids += turn
        mask += [1] * len(turn)
        if tool_answer is None:
            break
        previous = [*messages, message]
        messages = [*previous, {"role": "tool", "content": tool_answer}]
        merged = builder.merge_context_tokens(previous, messages, ids, tools=schemas).token_ids
        mask += [0] * (len(merged) - len(ids))
        ids = list(merged)
    return ids, prompt_length, mask


def _corpus(problems: list[ArithmeticProblem], schemas: list[dict]) -> list[str]:
    """The rendered conversations (with the tool list) the tokenizer is trained on."""
    from transformers.utils.chat_template_utils import render_jinja_template

    with open(os.path.join(miniature.ASSETS, "chat_templates", FAMILY.template), encoding="utf-8") as f:
        template = f.read()
    corpus = []
    for problem in problems:
        messages = [{"role": "user", "content": problem.prompt}]
        for _, message, tool_answer in calculator.reference_turns(problem):
            messages.append(message)
            if tool_answer is not None:
                messages.append({"role": "tool", "content": tool_answer})
        corpus.append(render_jinja_template([messages], tools=schemas, chat_template=template)[0])
    return corpus


async def _answer_calls(tools: dict, calls) -> list[str]:
    """The tool messages' texts for parsed calls, as ``ToolAgentLoop._call_tool`` answers (unknown tool, bad JSON)."""
    answers = []
    for call in calls:
        if call.name not in tools:
            answers.append(f"Unknown function '{call.name}'. Available tools: {list(tools)}")
            continue
        try:
            arguments = json.loads(call.arguments)
        except (json.JSONDecodeError, TypeError) as error:
            answers.append(f"Invalid JSON in arguments for '{call.name}': {error}")
            continue
        response, _, _ = await tools[call.name].execute("", arguments)
        answers.append(response.text or "")
    return answers


async def _parse_and_answer(parser, tools: dict, turns: list[list[int]]) -> list[tuple[list, list[str]]]:
    """Each turn's first parsed call (verl's default ``max_parallel_calls`` is 1) and the tool's answer to it."""
    results = []
    for turn in turns:
        _, calls = await parser.extract_tool_calls(turn)
        results.append((calls[:1], await _answer_calls(tools, calls[:1])))
    return results


def initial_state(builder, schemas: list[dict], problem: ArithmeticProblem) -> dict:
    """A conversation before its first assistant turn, as ``tool_loop`` advances it: the messages, the token ids
    (prompt, then the response so far), the response's mask (1 on the model's tokens, 0 on tool answers and template
    tokens between turns, as verl's ``response_mask``), the prompt's length, the turn and call counts, and the
    response position where each assistant turn starts."""
    messages = [{"role": "user", "content": problem.prompt}]
    ids = list(builder.build_initial_tokens(messages, tools=schemas))
    return {"messages": messages, "ids": ids, "mask": [], "prompt": len(ids), "turns": 0, "calls": 0, "done": False,
            "turn_starts": [0]}


def resumed_state(state: dict, turn: int) -> dict:
    """A copy of a finished conversation cut back to the start of its assistant turn ``turn`` (0-based): the
    context the policy saw there, tool answers included, ready for ``tool_loop`` to continue."""
    start = state["turn_starts"][turn]
    snapshot = state["snapshots"][turn]
    return {**snapshot, "ids": state["ids"][: state["prompt"] + start], "mask": state["mask"][:start],
            "prompt": state["prompt"], "done": False, "turn_starts": state["turn_starts"][: turn + 1],
            "snapshots": state["snapshots"][: turn + 1]}


def tool_loop(model, tokenizer, builder, tools: list, states: list[dict], do_sample: bool,
              config: CalculatorBuildConfig, seed: int = 0, chunk: int = 256) -> list[dict]:
    """The tool loop of verl's ``ToolAgentLoop`` with HF ``generate`` as the engine, batched by turn (``chunk``
    conversations per ``generate``): generate a turn (up to ``<|im_end|>``), parse it with verl's hermes parser,
    answer its first call with the tool, merge the answer with verl's builder, until a turn calls nothing,
    ``max_turns`` turns, or ``max_response_tokens``. Advances ``states`` (``initial_state`` or ``resumed_state``) in
    place and returns them; each records a snapshot (messages, counts) at every assistant-turn start."""
    import torch
    from verl.experimental.agent_loop.tool_parser import ToolParser

    parser = ToolParser.get_tool_parser("hermes", tokenizer)
    by_name = {tool.name: tool for tool in tools}
    schemas = tool_schemas(tools)
    stop_ids = tokenizer.convert_tokens_to_ids(list(FAMILY.stop_tokens))
    for state in states:
        state.setdefault("snapshots", [{"messages": state["messages"], "turns": 0, "calls": 0}])
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0} if do_sample else {"do_sample": False}
    rng_state, padding_side, was_training = torch.random.get_rng_state(), tokenizer.padding_side, model.training
    torch.manual_seed(seed)
    tokenizer.padding_side = "left"
    model.eval()
    try:
        while active := [state for state in states if not state["done"]]:
            turns = []
            for first in range(0, len(active), chunk):
                part = active[first: first + chunk]
                batch = tokenizer.pad({"input_ids": [state["ids"] for state in part]}, return_tensors="pt")
                with torch.no_grad():
                    output = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                            max_new_tokens=config.max_turn_tokens, eos_token_id=stop_ids,
                                            pad_token_id=tokenizer.pad_token_id, **sampling)
                for state, row in zip(part, output[:, batch["input_ids"].shape[1]:].tolist()):
                    stop = next((i for i, token in enumerate(row) if token in stop_ids), None)
                    turn = row if stop is None else row[: stop + 1]  # the engine returns the stop token
                    state["ids"] += turn
                    state["mask"] += [1] * len(turn)
                    state["turns"] += 1
                    turns.append(turn)
            for state, (calls, answers) in zip(active, asyncio.run(_parse_and_answer(parser, by_name, turns))):
                response_length = len(state["ids"]) - state["prompt"]
                if not calls or state["turns"] >= config.max_turns or response_length >= config.max_response_tokens:
                    state["done"] = True
                    continue
                previous = [*state["messages"], {"role": "assistant", "content": "",
                                                 "tool_calls": [{"type": "function", "function": {
                                                     "name": calls[0].name,
                                                     "arguments": json.loads(calls[0].arguments)}}]}]
                state["messages"] = [*previous, *({"role": "tool", "content": a} for a in answers)]
                merged = list(builder.merge_context_tokens(previous, state["messages"], state["ids"],
                                                           tools=schemas).token_ids)
                state["mask"] += [0] * (len(merged) - len(state["ids"]))
                state["ids"] = merged
                state["calls"] += 1
                if len(state["ids"]) - state["prompt"] >= config.max_response_tokens:
                    state["done"] = True
                    continue
                state["turn_starts"].append(len(state["ids"]) - state["prompt"])
                state["snapshots"].append({"messages": state["messages"], "turns": state["turns"],
                                           "calls": state["calls"]})
    finally:
        model.train(was_training)
        tokenizer.padding_side = padding_side
        torch.random.set_rng_state(rng_state)
    return states


def finished(tokenizer, state: dict, problem: ArithmeticProblem, config: CalculatorBuildConfig) -> dict:
    """A finished conversation as verl hands it to the reward and the trainer: the response cut at
    ``max_response_tokens`` (ids, mask, decoded text), its score, calls, turns and assistant-turn starts."""
    response = state["ids"][state["prompt"]:][: config.max_response_tokens]
    text = tokenizer.decode(response, skip_special_tokens=True)
    return {"prompt_ids": state["ids"][: state["prompt"]], "response_ids": response,
            "response_mask": state["mask"][: config.max_response_tokens], "response": text,
            "score": compute_score(calculator.DATA_SOURCE, text, problem.answer), "calls": state["calls"],
            "turns": state["turns"], "turn_starts": [s for s in state["turn_starts"] if s < len(response)]}


def play(model, tokenizer, builder, tools: list, problems: list[ArithmeticProblem], do_sample: bool,
         config: CalculatorBuildConfig, seed: int = 0) -> list[dict]:
    """Each problem played once through ``tool_loop``; per problem ``finished``'s record."""
    schemas = tool_schemas(tools)
    states = tool_loop(model, tokenizer, builder, tools, [initial_state(builder, schemas, p) for p in problems],
                       do_sample, config, seed)
    return [finished(tokenizer, state, problem, config) for state, problem in zip(states, problems)]


def evaluate(model, tokenizer, builder, tools, problems, config: CalculatorBuildConfig) -> dict:
    """Sampled (temperature 1) and greedy play: accuracy, mean tool calls and turns, the share of traces whose calls
    are all the reference's (``calculator_wrong_step``), and one example response."""
    report = {}
    for mode, do_sample in (("sampled", True), ("greedy", False)):
        played = play(model, tokenizer, builder, tools, problems, do_sample, config, seed=config.seed)
        right_calls = [calculator.calculator_wrong_step({"expressions": calculator.step_expressions(p)},
                                                        r["response"]) is None for p, r in zip(problems, played)]
        report[mode] = {
            "accuracy": sum(r["score"] for r in played) / len(played),
            "right_calls": sum(right_calls) / len(played),
            "mean_calls": sum(r["calls"] for r in played) / len(played),
            "mean_turns": sum(r["turns"] for r in played) / len(played),
            "example": played[0]["response"],
        }
    return report


def warm_start(model, tokenizer, builder, tools, eval_problems, config: CalculatorBuildConfig, log=print) -> dict:
    """SFT on ``n_sft`` solved conversations until the band, the step or the time budget; keeps the checkpoint whose
    sampled accuracy is nearest the band (the later among equals). Returns the record."""
    import torch

    schemas = tool_schemas(tools)
    rng = random.Random(f"calculator-sft:{config.seed}")
    pool = []
    for _ in range(config.n_sft):
        ids, _, mask = conversation_tokens(builder, tokenizer, schemas, make_problem(rng, calculator.TASK_CONFIG))
        pool.append((ids, mask))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.98), weight_decay=0.01)
    checkpoints, states, stopped_because = [], [], "max_steps"
    start = time.monotonic()
    model.train()
    for step in range(config.max_steps):
        batch = sft.pad_masked(tokenizer.pad_token_id, rng.sample(pool, config.batch_size))
        loss = sft.short_sft_update(model, optimizer, batch, config.lr, step, config.warmup_steps, config.max_steps)
        done = step + 1
        out_of_time = time.monotonic() - start >= config.budget_s
        if done % config.eval_every and done != config.max_steps and not out_of_time:
            continue
        evaluation = evaluate(model, tokenizer, builder, tools, eval_problems, config)
        checkpoints.append({"step": done, "seconds": round(time.monotonic() - start, 1),
                            "loss": round(loss.item(), 4), **evaluation})
        states.append(copy.deepcopy(model.state_dict()))
        log(f"calculator warm start step {done} ({checkpoints[-1]['seconds']:.0f} s): loss {loss.item():.3f}, "
            f"sampled {evaluation['sampled']['accuracy']:.0%} (calls {evaluation['sampled']['mean_calls']:.1f}), "
            f"greedy {evaluation['greedy']['accuracy']:.0%}")
        if sft.band_distance(evaluation["sampled"]["accuracy"], config.target_band) == 0.0:
            stopped_because = "in_target_band"
            break
        if out_of_time:
            stopped_because = "budget_s"
            break
    kept = min(range(len(checkpoints)),
               key=lambda i: (sft.band_distance(checkpoints[i]["sampled"]["accuracy"], config.target_band), -i))
    model.load_state_dict(states[kept])
    model.eval()
    return {"kept": checkpoints[kept], "stopped_because": stopped_because, "checkpoints": checkpoints,
            "seconds": round(time.monotonic() - start, 1)}


def _parquet_problems(path: str) -> list[ArithmeticProblem]:
    import pandas as pd

    return [ArithmeticProblem(tuple(int(x) for x in info["operands"]), tuple(str(op) for op in info["ops"]))
            for info in pd.read_parquet(path)["extra_info"]]


def fingerprint(config: CalculatorBuildConfig, model_config: MiniatureConfig) -> dict:
    """What a build depends on: the settings and ``BUILD_VERSION``."""
    return json.loads(json.dumps({"version": BUILD_VERSION, "config": asdict(config), "model": asdict(model_config)}))


def write_data(config: CalculatorBuildConfig, data_dir: str) -> tuple[list[ArithmeticProblem], list[ArithmeticProblem]]:
    """The parquet rows and, beside ``data_dir``, the tool config; returns the (train, val) problems as read back."""
    train_path, val_path = arithmetic.write_parquet(data_dir, config.n_train, config.n_val, config.seed,
                                                    calculator.TASK_CONFIG, row=calculator.agent_row)
    shutil.copyfile(calculator.TOOL_CONFIG, os.path.join(os.path.dirname(data_dir), TOOLS_FILE))
    return _parquet_problems(train_path), _parquet_problems(val_path)


def train(config: CalculatorBuildConfig, model_config: MiniatureConfig, data, model_dir: str, log=print) -> dict:
    """The tool-tagged qwen2_5 tokenizer and model, warm-started (``warm_start``) and saved to ``model_dir``; returns
    ``{"sft": the warm start's record}`` (what the shipped artefact's record holds beside its fingerprint)."""
    tools = load_tools()
    rng = random.Random(f"calculator-corpus:{config.seed}")
    corpus = _corpus([make_problem(rng, calculator.TASK_CONFIG) for _ in range(256)], tool_schemas(tools))
    tokenizer = miniature.family_tokenizer(FAMILY, corpus, model_config)
    model = miniature.build_model(FAMILY, tokenizer, model_config)
    eval_problems = data[0][: config.n_eval]
    record_sft = warm_start(model, tokenizer, token_builder(tokenizer), tools, eval_problems, config, log)
    miniature.save_checked(model, tokenizer, model_dir)
    kept = record_sft["kept"]
    log(f"calculator: kept step {kept['step']}: on {len(eval_problems)} training prompts sampled "
        f"{kept['sampled']['accuracy']:.0%} correct ({kept['sampled']['mean_calls']:.1f} calls), greedy "
        f"{kept['greedy']['accuracy']:.0%}")
    return {"sft": record_sft}


def measure(data, model_dir: str) -> dict:
    """Sizes, the tool config's path and the token lengths of the solved conversations (verl's layout)."""
    _, tokenizer = load_model_dir(model_dir, with_model=False)
    builder, schemas = token_builder(tokenizer), tool_schemas(load_tools())
    lengths = [conversation_tokens(builder, tokenizer, schemas, problem) for problem in data[0] + data[1]]
    return {"family": "qwen2_5 with tools", "n_train": len(data[0]), "n_val": len(data[1]),
            "tool_config": os.path.join(os.path.dirname(model_dir), TOOLS_FILE),
            "max_prompt_tokens": max(prompt for _, prompt, _ in lengths),
            "max_reference_response_tokens": max(len(ids) - prompt for ids, prompt, _ in lengths),
            "vocab_size": len(tokenizer)}
