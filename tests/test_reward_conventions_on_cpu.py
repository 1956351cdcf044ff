"""Extra generations (IBPO repairs, Monte-Carlo continuations) judged with the reward verl gives the rollouts, and
revision prompts rendered with the dataset's chat-template kwargs (``integration/rollouts.py``).

The reward functions are real files loaded by path, as verl loads ``reward.custom_reward_function``: one returning
DAPO's dict, a coroutine function, one whose full credit needs the ``reward_kwargs`` verl binds. The reference score
is verl's own reward manager (``load_reward_manager`` and its ``run_single``, as the reward loop scores a rollout).
Only generation is a stand-in (``test_rollouts_on_cpu.FakeEngine``), for vLLM.
"""

import copy
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict
from verl import DataProto
from verl.trainer.ppo.reward import load_reward_manager

from rredcot_verl.integration.estimators.segment_mc import monte_carlo_values
from rredcot_verl.integration.rollouts import reward_function
from rredcot_verl.tasks.model import chat_prompt_ids, load_model_dir
from test_rollouts_on_cpu import (
    A_RIGHT,
    A_STEP2,
    ROWS,
    WARMSTART,
    FakeEngine,
    context,
    finishing_engine,
    mc_context,
    repairs,
    scripted_repairs,
    solutions_in,
    trace_batch,
)

torch.set_num_threads(1)

REWARDS = '''
import asyncio

from rredcot_verl.tasks.reward import compute_score


def dict_score(data_source, solution_str, ground_truth, extra_info=None):
    """DAPO's convention: the reward at "score", more to log beside it."""
    score = compute_score(data_source, solution_str, ground_truth, extra_info)
    return {"score": score, "acc": score == 1.0, "pred": solution_str[-6:]}


async def async_score(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0)
    return compute_score(data_source, solution_str, ground_truth, extra_info)


def weighted_score(data_source, solution_str, ground_truth, extra_info=None, correct=0.5, wrong=0.0):
    """Full credit (1.0, the top of reward_range) only with the reward_kwargs the config binds."""
    return correct if compute_score(data_source, solution_str, ground_truth, extra_info) == 1.0 else wrong
'''

# With every repair judged correct when it is: IBPO's signal of test_rollouts_on_cpu's batch.
REPAIRED_PHI = [0.0, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0]
WEIGHTS = {"correct": 1.0, "wrong": 0.1}  # 0.1 is not a float32: the rollouts' outcomes hold it rounded


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_dir(WARMSTART, with_model=False)[1]


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "rewards.py"
    path.write_text(REWARDS)
    return str(path)


def verl_config(reward_file, name, reward_kwargs=None, manager="naive", **extra):
    """The parts of verl's trainer config the reward and the rollout context read."""
    custom = {"path": reward_file, "name": name, **({"reward_kwargs": reward_kwargs} if reward_kwargs else {})}
    return OmegaConf.create(
        {
            "algorithm": {"adv_estimator": "rredcot_ibpo"},
            "reward": {
                "custom_reward_function": custom,
                "reward_manager": {"source": "register", "name": manager},
                **extra.pop("reward", {}),
            },
            **extra,
        }
    )


def verl_scorer(config, tokenizer):
    """What verl's reward loop puts in ``rm_scores`` for a rollout whose response decodes to ``solution_str``: the
    configured reward manager, loaded by verl, scoring one item as the agent loop hands it over."""
    manager = load_reward_manager(config, tokenizer)
    prompt = chat_prompt_ids(tokenizer, ROWS[0][1])

    def score(data_source, solution_str, ground_truth, extra_info) -> float:
        ids = tokenizer.encode(solution_str, add_special_tokens=False)
        assert tokenizer.decode(ids, skip_special_tokens=True) == solution_str  # the same text reaches the function
        data = DataProto(
            batch=TensorDict(
                {
                    "prompts": torch.tensor([prompt]),
                    "responses": torch.tensor([ids]),
                    "attention_mask": torch.ones(1, len(prompt) + len(ids), dtype=torch.long),
                },
                batch_size=1,
            ),
            non_tensor_batch={
                "data_source": np.array([data_source], dtype=object),
                "reward_model": np.array([{"ground_truth": ground_truth}], dtype=object),
                "extra_info": np.array([copy.deepcopy(extra_info)], dtype=object),
            },
        )
        result = manager.loop.run_until_complete(manager.run_single(data))
        return manager.assemble_rm_scores(data, [result["reward_score"]])[0, -1].item()

    return score


def recorded(score):
    """``score``, keeping every call and its result."""
    calls = []

    def recording(*args):
        calls.append((args, score(*args)))
        return calls[-1][1]

    return recording, calls


# ---------------------------------------------------------------------------------------------- reward conventions


def test_a_dict_reward_is_read_at_its_score_key(tokenizer, reward_file):
    score = reward_function(verl_config(reward_file, "dict_score"))
    assert score("rredcot_arithmetic", A_RIGHT, "59", {}) == 1.0
    assert score("rredcot_arithmetic", A_STEP2, "59", {}) == 0.0
    engine = FakeEngine(scripted_repairs(tokenizer))
    inputs, metrics, verified = repairs(context(tokenizer, engine, score=score), trace_batch(tokenizer))
    assert inputs["phi"].tolist() == pytest.approx(REPAIRED_PHI)
    assert metrics["ibpo/revisions"] == 11.0 and sorted(verified) == ["a", "b"]


def test_an_async_reward_is_awaited(tokenizer, reward_file):
    score = reward_function(verl_config(reward_file, "async_score"))
    assert score("rredcot_arithmetic", A_RIGHT, "59", {}) == 1.0
    inputs, _, _ = repairs(context(tokenizer, FakeEngine(scripted_repairs(tokenizer)), score=score),
                            trace_batch(tokenizer))  # fmt: skip
    assert inputs["phi"].tolist() == pytest.approx(REPAIRED_PHI)

    # Monte-Carlo continuations: the value of a state is the share of its continuations the reward accepts
    engine, correct_count = finishing_engine(tokenizer)
    batch = trace_batch(tokenizer)
    inputs, _ = monte_carlo_values(dataclasses.replace(mc_context(tokenizer, engine), score=score), batch)
    prompt_length = len(batch.records[0].prompt_ids)
    assert inputs["raw_values"][0, 0].item() == pytest.approx(correct_count(prompt_length) / 3)


def test_reward_kwargs_are_bound_as_verl_binds_them(tokenizer, reward_file):
    score = reward_function(verl_config(reward_file, "weighted_score", WEIGHTS))
    assert score("rredcot_arithmetic", A_RIGHT, "59", {}) == 1.0
    assert score("rredcot_arithmetic", A_STEP2, "59", {}) == torch.tensor(0.1, dtype=torch.float32).item()
    inputs, _, _ = repairs(context(tokenizer, FakeEngine(scripted_repairs(tokenizer)), score=score),
                            trace_batch(tokenizer))  # fmt: skip
    assert inputs["phi"].tolist() == pytest.approx(REPAIRED_PHI)

    # without them a correct repair earns 0.5, below the top of reward_range: nothing would be verified
    unweighted = reward_function(verl_config(reward_file, "weighted_score"))
    inputs, _, verified = repairs(context(tokenizer, FakeEngine(scripted_repairs(tokenizer)), score=unweighted),
                                   trace_batch(tokenizer))  # fmt: skip
    assert not inputs["phi"].any() and verified == {}


@pytest.mark.parametrize("manager", ["naive", "dapo"])
@pytest.mark.parametrize("name, kwargs", [("dict_score", None), ("async_score", None), ("weighted_score", WEIGHTS)])
def test_every_extra_generation_gets_the_score_verls_reward_manager_gives(tokenizer, reward_file, manager, name,
                                                                          kwargs):
    """Every repair and continuation judged in a step, scored again by verl's own reward manager on the same text."""
    config = verl_config(reward_file, name, kwargs, manager=manager)
    score, calls = recorded(reward_function(config))
    batch = trace_batch(tokenizer)
    repairs(context(tokenizer, FakeEngine(scripted_repairs(tokenizer)), score=score), batch)
    judged_repairs = len(calls)
    engine, _ = finishing_engine(tokenizer)
    monte_carlo_values(dataclasses.replace(mc_context(tokenizer, engine), score=score), batch)
    # 11 repairs, of which the truncated one fails before it is judged (a failed repair is never decoded or scored)
    assert judged_repairs == 10 and len(calls) > judged_repairs
    reference = verl_scorer(config, tokenizer)
    verdicts = set()
    for args, value in calls:
        assert value == reference(*args), args[1]
        verdicts.add(value)
    assert len(verdicts) == 2  # both right and wrong generations were compared


# ------------------------------------------------------------------------------------------- reward managers


@pytest.mark.parametrize(
    "manager, reward, message",
    [
        ("dapo", {"reward_kwargs": {"overlong_buffer_cfg": {"enable": True, "len": 8, "penalty_factor": 1.0},
                                    "max_resp_len": 96}}, "overlong_buffer_cfg.enable=true"),  # fmt: skip
        ("rate_limited", {}, "name=rate_limited"),
    ],
)
def test_a_reward_manager_that_changes_the_score_is_refused(reward_file, manager, reward, message):
    with pytest.raises(ValueError, match=message):
        reward_function(verl_config(reward_file, "dict_score", manager=manager, reward=reward))


def test_dapos_overlong_penalty_changes_verls_score(tokenizer, reward_file):
    # why it is refused: verl would score a correct but long rollout below 1, a repair of the same text 1
    reward = {"reward_kwargs": {"overlong_buffer_cfg": {"enable": True, "len": 8, "penalty_factor": 1.0, "log": False},
                                "max_resp_len": 16}}  # fmt: skip
    config = verl_config(reward_file, "dict_score", manager="dapo", reward=reward)
    assert verl_scorer(config, tokenizer)("rredcot_arithmetic", A_RIGHT, "59", {}) < 1.0


# ------------------------------------------------------------------------------------------- chat template


def test_repair_prompts_use_the_datasets_chat_template_kwargs(reward_file, make_trainer):
    """The trainer's step context carries ``data.apply_chat_template_kwargs``: with Qwen3's template and
    ``enable_thinking: false`` a revision prompt closes an empty thinking block, as the rollouts' prompts do."""
    template = Path(__file__).resolve().parents[1] / "rredcot_verl/tasks/assets/chat_templates/qwen3.jinja"
    no_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"

    def rollout_context(*template_kwargs):
        trainer = make_trainer(
            "algorithm.adv_estimator=ibpo", "algorithm.rredcot.ibpo.repair_operator=rewrite",
            f"reward.custom_reward_function.path={reward_file}", "reward.custom_reward_function.name=dict_score",
            "data.max_prompt_length=32", "data.max_response_length=96", "actor_rollout_ref.rollout.max_model_len=2048",
            *template_kwargs,
        )  # fmt: skip
        trainer.tokenizer.chat_template = template.read_text()
        trainer.global_steps = 0
        trainer.get_llm_client = lambda: None
        trainer.actor_rollout_wg = SimpleNamespace(value_pass=None)
        engine = FakeEngine(scripted_repairs(trainer.tokenizer))
        return dataclasses.replace(trainer.step_context(), generate=engine), engine

    ctx, engine = rollout_context("+data.apply_chat_template_kwargs.enable_thinking=false")
    tokenizer = ctx.tokenizer
    inputs, _, _ = repairs(ctx, trace_batch(tokenizer))
    assert inputs["phi"].tolist() == pytest.approx(REPAIRED_PHI)  # the trainer's reward judged them
    assert len(engine.requests) == 11
    for ids, _ in engine.requests:
        text = tokenizer.decode(ids, skip_special_tokens=False)
        assert text.endswith(no_think), text[-80:]
        solutions_in(tokenizer, ids)  # the revision prompt itself is intact
        user = [{"role": "user", "content": text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]}]
        assert text == tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False,
                                                     enable_thinking=False)  # fmt: skip

    # without the kwargs the template's default (thinking) applies
    ctx, engine = rollout_context()
    repairs(ctx, trace_batch(tokenizer))
    assert engine.requests and not any(
        tokenizer.decode(ids, skip_special_tokens=False).endswith(no_think) for ids, _ in engine.requests
    )
