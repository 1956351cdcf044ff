"""Every launch refusal that suggests a fix, walked: the suggested overrides applied to the refused command, the
launch checks (``--check-only``'s ``check``) accept it or refuse it for another, stated reason. A hint must never lead
into a traceback (any exception but ``LaunchError`` fails the test) nor back into the same refusal."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from composing import compose_recipe
from rredcot_verl.integration import launcher, run_shapes
from rredcot_verl.integration.launcher import LaunchError, check

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Hint:
    """A fix a refusal suggests: ``said`` is a pattern the refusal must match; its groups fill the ``{0}``, ``{1}``
    of ``overrides`` (and of ``env``'s names and values), what following the hint adds to the refused command."""

    said: str
    overrides: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Refused:
    """A refused command on a tiny recipe: ``check`` names the function that refuses it; ``build`` changes the
    build (its rows or its model) first, ``unset`` environment variables it lacks."""

    check: str
    overrides: tuple[str, ...]
    hints: tuple[Hint, ...]
    recipe: str = "rredcot"
    build: Callable[[Path], None] | None = None
    unset: tuple[str, ...] = ()


def _model_config(**changes) -> Callable[[Path], None]:
    def change(build: Path) -> None:
        path = build / "model" / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    return change


def _rows_without_worked_solutions(build: Path) -> None:
    rows = pd.read_parquet(build / "data" / "train.parquet")
    rows["extra_info"] = [{"split": "train", "index": i} for i in range(len(rows))]
    rows.to_parquet(build / "data" / "train.parquet")


def _rows_of(data_source: str) -> Callable[[Path], None]:
    def change(build: Path) -> None:
        rows = pd.read_parquet(build / "data" / "train.parquet")
        rows.assign(data_source=data_source).to_parquet(build / "data" / "train.parquet")

    return change


def _gsm8k_rows(build: Path) -> None:
    """verl's GSM8K rows: the answer after ``####``, which ``boxed_math`` cannot read."""
    from rredcot_verl.tasks.miniature import GSM8K_INSTRUCTION

    question = "Natalia sold clips to 48 of her friends in April, and half as many in May. How many in total?"
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
             "reward_model": {"style": "rule", "ground_truth": "72"},
             "extra_info": {"answer": "48/2 = 24 clips in May.\n48+24 = 72.\n#### 72", "question": question}}] * 8
    pd.DataFrame(rows).to_parquet(build / "data" / "train.parquet")


REF_MICRO_BATCH = "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16"
DAPO_OVERLONG = ("reward.reward_manager.name=dapo", "+reward.reward_kwargs.overlong_buffer_cfg.enable=true",
                 "+reward.reward_kwargs.overlong_buffer_cfg.len=16",
                 "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
                 "+reward.reward_kwargs.overlong_buffer_cfg.log=false", "+reward.reward_kwargs.max_resp_len=96")
TOOL_LOOP = "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"
VERLS_SCORER = ("reward.custom_reward_function.path=pkg://verl.utils.reward_score",
                "reward.custom_reward_function.name=default_compute_score")
LONG_CONTEXT = _model_config(max_position_embeddings=40960)
# The end of check_ibpo_context's advice: the response length that fits, on the engine or past it.
SHORTER_RESPONSE = Hint(r"data.max_response_length <= (\d+)$", ("data.max_response_length={0}",))
SHORTER_RESPONSE_LONGER_ENGINE = Hint(r"data.max_response_length <= (\d+) \(with max_model_len (\d+)\)$",
                                      ("data.max_response_length={0}", "actor_rollout_ref.rollout.max_model_len={1}"))

REFUSALS = {
    # run_shapes.py
    "legacy_trainer": Refused("legacy_trainer", ("trainer.use_v1=false",),
                              (Hint("set (trainer.use_v1=true)", ("{0}",)),)),
    "bypass_mode": Refused("bypass_mode", ("algorithm.rollout_correction.bypass_mode=true",),
                           (Hint(r"^(\S+)=true .*set it to false", ("{0}=false",)),)),
    "critic": Refused("critic", ("critic.enable=true", "critic.model.path=${actor_rollout_ref.model.path}",
                                 "critic.ppo_micro_batch_size_per_gpu=16"),
                      (Hint("set (critic.enable=false)", ("{0}",)),
                       Hint(r"or (adv_estimator=gae) for PPO", ("algorithm.{0}",)))),
    "group_size": Refused("group_size", ("actor_rollout_ref.rollout.n=1",
                                         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                                         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"),
                          (Hint(r"set (actor_rollout_ref.rollout.n) >= (\d+)", ("{0}={1}",)),)),
    "multi_turn_generations": Refused(
        "multi_turn", ("algorithm.adv_estimator=ibpo", TOOL_LOOP),
        (Hint("use a single-turn rollout", ("actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent",)),
         Hint(r"or adv_estimator=(rredcot) with a candidates.source other than (group_and_repairs)",
              ("algorithm.adv_estimator={0}", "algorithm.rredcot.candidates.source=both")))),
    "multi_turn_continuations": Refused(
        "multi_turn", (TOOL_LOOP, "algorithm.rredcot.probe.value_source=reference_continuation"),
        (Hint(r"use probe.value_source=(\w+)$", ("algorithm.rredcot.probe.value_source={0}",)),)),
    "greedy_rollouts": Refused(
        "sampling", ("algorithm.adv_estimator=rredcot_ibpo", "actor_rollout_ref.rollout.temperature=0",
                     "algorithm.rredcot.ibpo.revision_temperature=0"),
        (Hint("sample the rollouts at a temperature > 0", ("actor_rollout_ref.rollout.temperature=1.0",)),)),
    "own_temperature": Refused(
        "sampling", ("algorithm.adv_estimator=ibpo", "actor_rollout_ref.rollout.temperature=0.7"),
        (Hint(r"set (algorithm.rredcot.ibpo.revision_temperature)=(0.7)", ("{0}={1}",)),
         Hint(r"set (\S+)=0.7 \(or \$\{(actor_rollout_ref.rollout.temperature)\}\)", ("{0}=${{{1}}}",)))),
    "truncated_sampling": Refused(
        "sampling", ("actor_rollout_ref.rollout.top_p=0.9",),
        (Hint(r"set (actor_rollout_ref.rollout.top_p=1) and (actor_rollout_ref.rollout.top_k=-1)", ("{0}", "{1}")),)),
    "kl_in_reward": Refused("kl_in_reward", ("algorithm.use_kl_in_reward=true", REF_MICRO_BATCH),
                            (Hint("use (actor_rollout_ref.actor.use_kl_loss=true)",
                                  ("algorithm.use_kl_in_reward=false", "{0}")),)),
    "overlong_penalty": Refused("overlong_penalty", DAPO_OVERLONG,
                                (Hint(r"^(\S+overlong_buffer_cfg.enable)=true .*set it to false", ("{0}=false",)),)),
    "reward_model": Refused("reward_model", ("reward.reward_model.enable=true",),
                            (Hint(r"^(\S+)=true .*set it to false", ("{0}=false",)),)),
    "megatron": Refused("megatron", ("actor_rollout_ref.actor.strategy=megatron",),
                        (Hint(r"use (strategy=fsdp2)", ("actor_rollout_ref.actor.{0}",)),
                         Hint(r"or (adv_estimator=ibpo), which needs no value pass", ("algorithm.{0}",)))),
    "value_pass_model": Refused("value_pass_model", (), (Hint("use (adv_estimator=ibpo) or another model",
                                                             ("algorithm.{0}",)),),
                                build=_model_config(attn_logit_softcapping=50.0)),
    "micro_batches": Refused("micro_batches", ("actor_rollout_ref.rollout.n=5",),
                             (Hint(r"^(\S+)=16 does not divide the 40 traces .*choose a divisor of 40", ("{0}=8",)),
                              Hint(r"or set (\S+use_dynamic_bsz)=true$", ("{0}=true",)))),
    # launcher.py
    "check_environment": Refused("check_environment", (), (Hint(r"environment variable (\w+) is not set.*; set it",
                                                                env=(("{0}", "{reward_file}"),)),),
                                 unset=("RREDCOT_REWARD_FILE",)),
    "select_trainer_mode": Refused("select_trainer_mode", ("trainer.v1.trainer_mode=colocate_async",),
                                   (Hint(r"\((trainer.v1.trainer_mode=sync), the default\)", ("{0}",)),)),
    "check_value_pass_parallelism": Refused(
        "check_value_pass_parallelism", ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",),
        (Hint(r"^(\S+)=2 .*set it to 1$", ("{0}=1",)),)),
    "revision_template_without_rewrite": Refused(
        "settings_from_config", ("algorithm.rredcot.ibpo.repair_operator=resume",),
        (Hint("leave (revision_template) null", ("algorithm.rredcot.ibpo.{0}=null",)),
         Hint("set (repair_operator) to '(rewrite)'", ("algorithm.rredcot.ibpo.{0}={1}",))), recipe="ibpo"),
    "check_model_dir": Refused("check_model_dir", ("actor_rollout_ref.model.path=/nonexistent/model",),
                               (Hint(r"a hub id such as (\S+)$", ("actor_rollout_ref.model.path={0}",)),)),
    "check_prompt_lengths": Refused("check_prompt_lengths", ("data.max_prompt_length=4",
                                                             "data.filter_overlong_prompts=true"),
                                    (Hint(r"\(shortest (\d+)\).*raise data.max_prompt_length$",
                                          ("data.max_prompt_length={0}",)),)),
    "code_task_refusal": Refused(
        "code_task_refusal", ("algorithm.rredcot.task=code",),
        (Hint(r"use (algorithm.adv_estimator)=(segment_mc) or (ibpo)", ("{0}={1}",)),
         Hint(r"use (algorithm.adv_estimator)=(segment_mc) or (ibpo)", ("{0}={2}",)),
         Hint(r"or (probe.value_source=own_continuation)$", ("algorithm.rredcot.{0}",)))),
    "check_task_answers": Refused("check_task_answers", ("algorithm.rredcot.task=boxed_math",),
                                  (Hint(r"task (\w+) reads them", ("algorithm.rredcot.task={0}",)),),
                                  build=_gsm8k_rows),
    "check_worked_solutions": Refused(
        "check_worked_solutions", ("algorithm.rredcot.probe.value_source=reference_continuation",
                                   "algorithm.rredcot.candidates.source=ground_truth"),
        (Hint(r"set (algorithm.rredcot.candidates.source)=(\w+) \(README row C\)", ("{0}={1}",)),),
        build=_rows_without_worked_solutions),
    "adopt_scorer_reward_range": Refused(
        "adopt_scorer_reward_range", (*VERLS_SCORER, "algorithm.rredcot.reward_range=[0,2]"),
        (Hint(r"set (algorithm.rredcot.reward_range)=(\[[^\]]+\])", ("{0}={1}",)),), build=_rows_of("math_dapo")),
    "check_rule_reward": Refused("check_rule_reward", ("algorithm.adv_estimator=rredcot_ibpo",
                                                      "reward.custom_reward_function.path=null"),
                                 (Hint(r"set (reward.custom_reward_function.path)",
                                       ("{0}=${{oc.env:RREDCOT_REWARD_FILE}}",)),)),
    "reward_manager_refusal": Refused("reward_manager_refusal", ("algorithm.adv_estimator=ibpo",
                                                                "reward.reward_manager.name=prime"),
                                      (Hint(r"use one of (\w+)", ("reward.reward_manager.name={0}",)),)),
    # The tiny ibpo recipe's rewrite repairs, whose revision template the resume operator refuses.
    "ibpo_context_rewrite_with_template": Refused(
        "check_ibpo_context", ("data.max_response_length=2048",),
        (Hint(r"set (algorithm.rredcot.ibpo.repair_operator=resume) (algorithm.rredcot.ibpo.revision_template=null) "
              r"with data.max_response_length <= (\d+),", ("{0}", "{1}", "data.max_response_length={2}")),
         SHORTER_RESPONSE), recipe="ibpo"),
    "ibpo_context_rewrite_resume_fits": Refused(
        "check_ibpo_context", ("algorithm.adv_estimator=ibpo", "algorithm.rredcot.ibpo.repair_operator=rewrite",
                               "data.max_response_length=25000", "data.max_prompt_length=1024",
                               "actor_rollout_ref.rollout.max_model_len=40960"),
        (Hint(r"set (algorithm.rredcot.ibpo.repair_operator=resume) \(it needs \d+, which the engine has\)", ("{0}",)),
         SHORTER_RESPONSE), build=LONG_CONTEXT),
    "ibpo_context_resume_engine_short": Refused(
        "check_ibpo_context", ("algorithm.adv_estimator=ibpo", "data.max_response_length=25000",
                               "data.max_prompt_length=1024", "actor_rollout_ref.rollout.max_model_len=25000"),
        (Hint(r"set (actor_rollout_ref.rollout.max_model_len) >= (\d+)", ("{0}={1}",)),
         SHORTER_RESPONSE_LONGER_ENGINE), build=LONG_CONTEXT),
}  # fmt: skip


@pytest.fixture()
def cpu_build(build, monkeypatch):
    monkeypatch.setenv("RREDCOT_CPU", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return build


def _refusal(recipe: str, overrides) -> str | None:
    """The launch checks' refusal of the command, None where they accept it; any other exception propagates."""
    try:
        check(compose_recipe(str(ROOT / "recipes" / "tiny_cpu"), recipe, list(overrides)))
    except LaunchError as error:
        return str(error)
    return None


def _reason(refusal: str) -> str:
    """What a refusal is about: its words before the first colon (the key and value refused, or what is needed)."""
    return refusal.split(": ")[0]


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_every_hint_leads_past_its_refusal(cpu_build, case, monkeypatch):
    refused = REFUSALS[case]
    if refused.build is not None:
        refused.build(cpu_build)
    for name in refused.unset:
        monkeypatch.delenv(name)
    message = _refusal(refused.recipe, refused.overrides)
    assert message is not None, f"{case}: {refused.overrides} is no longer refused"
    assert "\n" not in message
    for hint in refused.hints:
        said = re.search(hint.said, message)
        assert said, f"{case}: the refusal no longer suggests {hint.said!r}: {message}"
        followed = [override.format(*said.groups()) for override in hint.overrides]
        with monkeypatch.context() as scoped:
            for name, value in hint.env:
                reward_file = str(ROOT / "rredcot_verl" / "tasks" / "reward.py")
                scoped.setenv(name.format(*said.groups()), value.format(*said.groups(), reward_file=reward_file))
            after = _refusal(refused.recipe, [*refused.overrides, *followed])
        assert after is None or _reason(after) != _reason(message), (
            f"{case}: following {hint.said!r} ({followed}) leads into the same refusal: {after}"
        )


# Words a refusal suggests a fix with.
_HINT_WORDS = re.compile(r"\b(set|use|raise|give|choose|write)\b")


def _launcher_functions_with_hints() -> set[str]:
    """The launcher's functions that raise a ``LaunchError`` whose own text suggests a fix."""
    tree = ast.parse(Path(launcher.__file__).read_text())
    found = set()
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef):
            continue
        for node in ast.walk(function):
            if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                    and getattr(node.exc.func, "id", None) == "LaunchError"):  # fmt: skip
                texts = [part.value for part in ast.walk(node.exc) if isinstance(part, ast.Constant)
                         and isinstance(part.value, str)]  # fmt: skip
                if _HINT_WORDS.search(" ".join(texts)):
                    found.add(function.name)
    return found


def test_every_refusal_that_suggests_a_fix_is_walked():
    """A new refusal with advice (a run shape, or a launcher check whose message says what to set) gets a case
    above; the scan must see the launcher's known ones, so that it can fail."""
    walked = {refused.check for refused in REFUSALS.values()}
    shapes = {check.__name__ for check in run_shapes.SHAPE_CHECKS} | {run_shapes.micro_batches.__name__}
    assert shapes <= walked, sorted(shapes - walked)
    hinted = _launcher_functions_with_hints()
    assert {"check_ibpo_context", "check_model_dir", "check_prompt_lengths"} <= hinted
    assert hinted <= walked, sorted(hinted - walked)
