"""End to end through the real stack: verl's V1 trainer, vLLM (CPU) servers in Ray workers, FSDP2 actor update.

Each run is a subprocess under a hard timeout in its own process group (recipes/tiny_cpu/run.sh uses setsid +
timeout), on the committed warm-started model, so a hang ends as a failure and Ray/vLLM are torn down with it.
Runs serve several assertions where they can: one uninterrupted 3-step `rredcot` run on two actor ranks, sent with
`ray job submit` to a head node started by hand and checkpointed after step 2, is the reference both for verl's own
sync trainer (the same prompts at every step) and for a fresh process that resumes from its step-2 checkpoint (step 3
on the same batch, the value gate's window restored). The fused estimator (``rredcot_ibpo``) is launched by the
one-GPU recipe's miniature run (tests/test_recipes_miniature_on_cpu.py), which reads its bank and shaped advantage;
``segment_mc`` by the code task's miniature run (tests/test_code_miniature_on_cpu.py), which reads its continuations.
"""

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rredcot_verl.runs import load_metrics

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "recipes" / "tiny_cpu" / "run.sh"
pytestmark = pytest.mark.e2e

# Steps of 4 prompts x 4 samples, no validation: the smallest run that still has mixed groups.
SMALL = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.val_before_train=false", "trainer.test_freq=-1"]


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("build")
    subprocess.run(
        [sys.executable, "-m", "rredcot_verl.tasks.build", "--out", str(out)], check=True, capture_output=True, timeout=600
    )
    return out


RUN_TIMEOUT_S = 900
# Values from the two ranks against one process on the same plans, with the actor's precision: usually equal (max
# difference 0.0; 6.7e-6 between other micro-batch splits), once 8.3e-4 on a loaded clean-clone CI (bf16 sums
# whose order a CPU kernel chose differently). A trace given its neighbour's values differs by 0.38 (median), and a
# model cast wholly to bf16 (rotary frequencies included) by 0.011: both still fail by a wide margin.
VALUE_ATOL = 2e-3


def _train(estimator: str, build: Path, out: Path, steps: int = 2, extra=(), env_extra=None) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "RREDCOT_BUILD": str(build),
        "OUT": str(out),
        "RREDCOT_STEPS": str(steps),
        "RUN_TIMEOUT": str(RUN_TIMEOUT_S),
        **(env_extra or {}),
    }
    result = subprocess.run(
        ["bash", str(RUN), estimator, *SMALL, *extra], env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S + 100
    )
    (out / "stdout.log").write_text(result.stdout + result.stderr)
    return result


def _prompts_per_step(rollout_data_dir: Path) -> dict[int, list[tuple[str, str]]]:
    """verl's rollout dump (trainer.rollout_data_dir, one ``<step>.jsonl`` per step, one row per trace): the step's
    (prompt text, ground truth) pairs, sorted (the row order follows random uids)."""
    steps = {}
    for path in rollout_data_dir.glob("*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        steps[int(path.stem)] = sorted((row["input"], str(row["gts"])) for row in rows)
    return steps


def _snapshot_traces(out: Path) -> list[dict]:
    """Every step's snapshot traces: a step may hold only all-agreeing groups, so checks of credit read all steps."""
    return [trace for snapshot in sorted((out / "snapshots").glob("step_*.json"))
            for trace in json.loads(snapshot.read_text())["traces"]]  # fmt: skip


def _assert_finite_steps(out: Path, steps: int) -> list[dict]:
    rows = load_metrics(out / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    for row in rows:
        for key in ("actor/grad_norm", "critic/advantages/mean", "critic/advantages/max", "actor/pg_loss"):
            assert math.isfinite(float(row[key])), (key, row[key])
    return rows


# Two FSDP2 actor ranks over gloo (two fake Ray GPUs, two vLLM replicas); each rank holds 16 / 2 = 8 traces and
# verl's engine needs micro-batches that divide them.
DP2 = [
    "trainer.n_gpus_per_node=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
]


# The reference run's overrides beyond SMALL, except where it writes (_checkpointing).
REFERENCE_RUN = [*DP2, "trainer.save_freq=2"]

# The tests that read the reference run (or a run that needs it) go to one stream of the end-to-end tier (conftest.py).
REFERENCE_GROUP = pytest.mark.launch_group("rredcot_reference")


def _checkpointing(out: Path) -> list[str]:
    # The value gate off: its decision on one or two batches of 16 traces is noise (a batch's concordance has a
    # standard deviation of about 0.06 around 0.7). The gate is tested in test_value_gate_on_cpu.py; its window is
    # still kept, saved and restored here.
    return [f"trainer.default_local_dir={out / 'checkpoints'}", "algorithm.rredcot.redistribution.min_value_concordance=0.0",
            f"trainer.rollout_data_dir={out / 'rollouts'}"]  # fmt: skip


@REFERENCE_GROUP
def test_rredcot_dp2_trains_and_redistributes(build, rredcot_reference):
    """The driver's probe plans are split across the two ranks by verl's DP_COMPUTE_PROTO dispatch and the segment
    data comes back in batch order."""
    out = rredcot_reference
    rows = _assert_finite_steps(out, 3)
    # verl balances each step's tokens over the actor's dp ranks: the mean per rank is half the total with two.
    assert all(row["perf/total_num_tokens"] == 2 * row["global_seqlen/mean"] for row in rows)
    # Every trace is redistributed except those of groups where all outcomes agree (all right or all wrong, which keep
    # GRPO's zero): a step of four such groups redistributes nothing (CI met one), so only the three steps together
    # must redistribute some trace.
    for row in rows:
        kept = {key: row[key] for key in row if key.startswith("rredcot/fallback/") and row[key]}
        assert set(kept) <= {"rredcot/fallback/zero_return", "rredcot/fallback/empty"}, kept
        assert round(row["rredcot/redistributed_frac"] * 16) + sum(kept.values()) == 16, row
    assert any(row["rredcot/redistributed_frac"] > 0 for row in rows), [row["rredcot/redistributed_frac"] for row in rows]
    # Each rank's segment data landed on its own traces: segments end at the trace's own length (lengths differ
    # between traces) and the value column after the last segment is the trace's own outcome.
    for snapshot in sorted((out / "snapshots").glob("step_*.json")):
        for trace in json.loads(snapshot.read_text())["traces"]:
            ends = [e for e in trace["seg_ends"] if e >= 0]
            if not trace["response_tokens"]:
                continue
            assert ends and ends[-1] == len(trace["response_tokens"]), (snapshot.name, ends, len(trace["response_tokens"]))
            assert trace["seg_raw_values"][len(ends)] == pytest.approx(trace["outcome"]), snapshot.name
    traces = _snapshot_traces(out)
    differing = 0
    for trace in traces:
        ends = [e for e in trace["seg_ends"] if e >= 0]
        values = [v for v in trace["values"] if v is not None and not math.isnan(v)]
        if len(ends) < 2 or len(values) != len(ends) + 1:
            continue
        advantages = trace["token_advantages"]
        starts = [0, *ends[:-1]]
        per_segment = {round(advantages[s], 6) for s in starts if s < len(advantages)}
        differing += len(per_segment) > 1
        rewards = [r for r in trace["segment_rewards"][: len(ends)]]
        assert sum(rewards) == pytest.approx(values[-1] - values[0], abs=1e-5)  # telescoping on real data
    assert differing > 0, "no redistributed trace had different advantages between its segments"
    _assert_step_1_values_equal_one_process(build, out)


def _assert_step_1_values_equal_one_process(build: Path, out: Path) -> None:
    """The values the two ranks computed at step 1 (warm-start weights, before any update) equal the values one
    process computes for the same probe plans: verl's balance + DP dispatch split the batch, the rows come back to
    their own traces, and a rank's shard is scored as it would be in the whole batch."""
    import torch

    from rredcot_verl.core.values import score_plans
    from rredcot_verl.tasks.model import load_model_dir

    plans = torch.load(out / "snapshots" / "step_00001_plans.pt", weights_only=False)
    traces = json.loads((out / "snapshots" / "step_00001.json").read_text())["traces"]
    assert len(plans) == len(traces) == 16
    model, _ = load_model_dir(str(build / "model"))
    # As verl's FSDP2 default mixed precision computes: bf16 parameters, fp32 buffers (the rotary frequencies).
    for parameter in model.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    model.eval()
    with torch.no_grad():
        segment_ends, raw_values, _ = score_plans(model, plans, max_segments=8)
    for i, trace in enumerate(traces):
        assert trace["seg_ends"] == segment_ends[i].tolist(), i
        ranks = torch.tensor([math.nan if v is None else v for v in trace["seg_raw_values"]])
        torch.testing.assert_close(ranks, raw_values[i], rtol=0, atol=VALUE_ATOL, equal_nan=True)


def test_ibpo_generates_repairs_and_localises_blame(build, tmp_path):
    result = _train("ibpo", build, tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = _assert_finite_steps(tmp_path, 2)
    assert all(row["ibpo/revisions"] > 0 for row in rows)
    assert all(row["ibpo/extra_generated_tokens"] > 0 for row in rows)
    traces = _snapshot_traces(tmp_path)
    non_uniform_incorrect = [
        t for t in traces if t["outcome"] == 0 and len({round(a, 6) for a in t["token_advantages"]}) > 1
    ]
    assert non_uniform_incorrect, "no incorrect trace got a localised (non-uniform) advantage"


# The task's reward for the first step's 16 traces (counted across the reward workers' processes), then a reward that
# raises on about half of the responses, as math-verify's SIGALRM timeout did in verl's reward workers: verl logs each
# error and carries on with the traces that did not raise.
RAISING_REWARD = """
import fcntl
import zlib

from rredcot_verl.tasks.reward import compute_score as task_score

CALLS = {calls!r}
FIRST_STEP_TRACES = 16


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    with open(CALLS, "a+") as calls:
        fcntl.flock(calls, fcntl.LOCK_EX)
        calls.write("+")
        calls.seek(0)
        count = len(calls.read())
    if count > FIRST_STEP_TRACES and zlib.crc32(solution_str.encode()) % 2:
        raise ValueError("signal only works in main thread of the main interpreter")
    return task_score(data_source, solution_str, ground_truth, extra_info)
"""


def _assert_stopped_by_the_raising_reward(result: subprocess.CompletedProcess) -> None:
    log = result.stdout + result.stderr
    assert result.returncode != 0, log[-4000:]
    assert "RolloutFailure" in log and "prompt groups lost" in log, log[-6000:]
    failure = log[log.index("prompt groups lost") :]
    assert "max_failed_group_share=0.1" in failure
    # The first error, recorded in the reward worker, travelled with the failure to the trainer's message.
    assert "First error:" in failure and "signal only works in main thread" in failure.split("First error:")[1][:6000]


# The task's reward on another scale (2 wrong, 3 right) than the recipe's reward_range [0, 1], which the launcher cannot
# read from a custom reward function.
SHIFTED_REWARD = """
from rredcot_verl.tasks.reward import compute_score as task_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 2.0 + task_score(data_source, solution_str, ground_truth, extra_info)
"""


def test_a_reward_off_the_declared_scale_stops_the_run_at_its_first_batch(build, tmp_path):
    """The first batch's outcomes all outside algorithm.rredcot.reward_range: the run stops after its rollouts with
    one line naming the key, before the value pass and the update (no step is logged)."""
    reward = tmp_path / "shifted_reward.py"
    reward.write_text(SHIFTED_REWARD)
    result = _train("rredcot", build, tmp_path, steps=1, env_extra={"RREDCOT_REWARD_FILE": str(reward)})
    log = result.stdout + result.stderr
    assert result.returncode != 0, log[-4000:]
    assert ("RewardScaleError: step 1: 16 of 16 outcomes of the first batch lie outside "
            "algorithm.rredcot.reward_range=[0, 1] (they lie in [2, ") in log, log[-6000:]  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    assert not metrics.exists() or not load_metrics(metrics)


@pytest.fixture(scope="module")
def rredcot_reference(build, tmp_path_factory) -> Path:
    """Three uninterrupted `rredcot` steps through our launcher on two actor ranks, checkpointed after step 2,
    rollouts dumped per step, sent with `ray job submit` to a head node started by hand (as on a cluster, with the
    two GPUs the ranks ask for) and torn down afterwards. The head runs in its own session (`ray start --block`) so
    teardown kills exactly its processes."""
    out = tmp_path_factory.mktemp("rredcot_reference")
    ray = str(Path(sys.executable).parent / "ray")
    gcs_port, dashboard_port = _free_port(), _free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    temp_dir = Path("/tmp") / f"ray_e2e_{os.getpid()}"
    start = [
        ray, "start", "--head", "--block", f"--port={gcs_port}", "--num-cpus=32", "--num-gpus=2",
        "--include-dashboard=true", f"--dashboard-port={dashboard_port}", "--dashboard-host=127.0.0.1",
        # Ports of its own for the agents that take job submissions: Ray's fixed defaults (52365, ...) are taken
        # when another Ray instance runs on the machine, and the head then never gets an agent to submit to.
        f"--dashboard-agent-listen-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}",
        f"--runtime-env-agent-port={_free_port()}",
        f"--temp-dir={temp_dir}", "--disable-usage-stats",
    ]
    head_log = open(out / "ray_head.log", "w")
    head = subprocess.Popen(start, env=env, stdout=head_log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_for_dashboard(dashboard_port, timeout_s=180)
        # The dashboard answers before the head's job agent has registered, and Ray refuses a submission meanwhile
        # ("No available agent to submit job, please try again later").
        for _ in range(6):
            result = _train(
                "rredcot", build, out, steps=3, extra=[*REFERENCE_RUN, *_checkpointing(out)],
                env_extra={**env, "RAY_ADDRESS": f"http://127.0.0.1:{dashboard_port}"},
            )
            if "No available agent to submit job" not in result.stdout + result.stderr:
                break
            time.sleep(10)
        assert result.returncode == 0, (
            result.stdout[-4000:] + result.stderr[-4000:] + (out / "ray_head.log").read_text()[-2000:]
        )
    finally:
        _kill_session(head)
        head_log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
    _assert_finite_steps(out, 3)
    return out


@REFERENCE_GROUP
def test_ray_job_submit_to_a_running_head_node(rredcot_reference):
    """The reference run went through `ray job submit`: the job finished as succeeded, with all its steps."""
    assert "succeeded" in (rredcot_reference / "stdout.log").read_text()
    _assert_finite_steps(rredcot_reference, 3)


def _verl_sync_prompts_per_step(build: Path, overrides: list[str], steps: int) -> dict[int, list[tuple[str, str]]]:
    """What verl's PPOTrainerSync submits for generation at steps 1..``steps`` of a run of the tiny recipe with
    ``overrides``: its own ``_next_train_batch`` (what its ``prepare_step`` calls once per step) on its own dataloader,
    built in this process from the config our launcher prepares (no Ray: ``__init__``, tokenizer and dataloaders, as
    in tests/test_trainer_mode_on_cpu.py). Each prompt as verl's rollout dump writes it (the chat-templated prompt
    decoded without special tokens) with its ground truth, once per sample, sorted as ``_prompts_per_step``."""
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from rredcot_verl.integration.launcher import prepare
    from rredcot_verl.integration.trainer import SYNC_MODE

    with initialize_config_dir(config_dir=str(ROOT / "recipes" / "tiny_cpu"), version_base=None):
        config = prepare(compose(config_name="rredcot", overrides=overrides))
    config.trainer.v1.trainer_mode = SYNC_MODE
    trainer = PPOTrainerSync(config)
    trainer._init_tokenizer()
    trainer._init_dataloader()
    tokenizer, samples = trainer.tokenizer, int(config.actor_rollout_ref.rollout.n)
    prompts = {}
    for step in range(1, steps + 1):
        trainer.global_steps = step
        batch = trainer._next_train_batch()
        pairs = []
        for messages, reward_model in zip(batch["raw_prompt"], batch["reward_model"]):
            text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
            pairs += [(tokenizer.decode(ids, skip_special_tokens=True), str(reward_model["ground_truth"]))] * samples
        prompts[step] = sorted(pairs)
    return prompts


@REFERENCE_GROUP
def test_our_trainer_draws_the_prompts_verls_sync_trainer_fetches(build, rredcot_reference, monkeypatch):
    """Same seed and data: at every step of the reference run (our trainer, two ranks, submitted to a cluster), the
    16 traces verl dumped are the prompts verl's own sync trainer fetches for that step (the prompt order depends on
    the data seed, not the estimator, the trainer class or the ranks). verl's side is its fetch code run in this
    process rather than a second launch of its trainer: the launch cost four CPU-minutes of the suite's thirty."""
    monkeypatch.setenv("RREDCOT_BUILD", str(build))
    monkeypatch.setenv("RREDCOT_REWARD_FILE", str(ROOT / "rredcot_verl" / "tasks" / "reward.py"))
    monkeypatch.setenv("RREDCOT_CPU", "1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ours = _prompts_per_step(rredcot_reference / "rollouts")
    assert sorted(ours) == [1, 2, 3]
    verls = _verl_sync_prompts_per_step(build, [*SMALL, *REFERENCE_RUN], steps=3)
    for step in (1, 2, 3):
        assert len(ours[step]) == 16 and len(set(ours[step])) == 4  # 4 prompts x 4 samples
        assert ours[step] == verls[step], f"step {step}: the trainers drew different prompts"
    assert ours[1] != ours[2] != ours[3]


@REFERENCE_GROUP
def test_a_fresh_process_resumes_the_dp2_checkpoint_trains_step_3_as_uninterrupted_and_stops_at_a_raising_reward(build, rredcot_reference, tmp_path):
    """The reference run's checkpoint after step 2 (verl's sync checkpoint, two ranks: no TransferQueue state) is
    resumed by a fresh local process on two ranks, which trains step 3. Compared with the uninterrupted run: step 3's
    sorted (prompt, ground truth) pairs, and the value gate's pooled concordance over steps 1-3. At step 4 the reward
    raises on about half of the traces and the run stops with the first error (one launch for both: each costs about
    four CPU-minutes here)."""
    reference_rows = _assert_finite_steps(rredcot_reference, 3)
    checkpoint = rredcot_reference / "checkpoints" / "global_step_2"
    assert (checkpoint / "data.pt").is_file()
    assert not (checkpoint / "transfer_queue").exists(), "an async-mode checkpoint was written"
    # The value gate's window is saved with the checkpoint: both steps' counts, as their metrics report them.
    saved = json.loads((checkpoint / "value_gate.json").read_text())["previous_batches"]
    assert [comparisons for _, comparisons in saved] == [
        row["rredcot/value_concordance_comparisons"] for row in reference_rows[:2]
    ]

    reward = tmp_path / "raising_reward.py"
    reward.write_text(RAISING_REWARD.format(calls=str(tmp_path / "reward_calls")))
    resume = [*DP2, *_checkpointing(tmp_path), "trainer.save_freq=-1", "trainer.resume_mode=resume_path",
              f"trainer.resume_from_path={checkpoint}"]  # fmt: skip
    result = _train("rredcot", build, tmp_path, steps=4, extra=resume, env_extra={"RREDCOT_REWARD_FILE": str(reward)})
    _assert_stopped_by_the_raising_reward(result)
    assert "'num_gpus': 2" in result.stdout + result.stderr  # the local cluster follows trainer.n_gpus_per_node
    [step_3] = load_metrics(tmp_path / "metrics.jsonl")
    assert step_3["step"] == 3 and step_3["rollout/failed_groups"] == 0
    for key in ("actor/grad_norm", "actor/pg_loss", "critic/advantages/mean", "critic/score/mean"):
        assert math.isfinite(float(step_3[key])), (key, step_3[key])
    # ... and restored: step 3's pooled concordance counts steps 1 and 2 as the uninterrupted run would (with the
    # window lost it would be this batch's alone, or absent for a batch without comparisons: all 16 traces wrong, as
    # one verification run drew).
    comparisons = step_3["rredcot/value_concordance_comparisons"]
    concordant = step_3.get("rredcot/value_concordance", 0.0) * comparisons
    expected = (concordant + sum(c for c, _ in saved)) / (comparisons + sum(n for _, n in saved))
    assert step_3["rredcot/value_concordance_pooled"] == pytest.approx(expected)
    resumed = _prompts_per_step(tmp_path / "rollouts")
    assert set(resumed) <= {3, 4} and resumed[3] == _prompts_per_step(rredcot_reference / "rollouts")[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_dashboard(port: int, timeout_s: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/version", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"Ray dashboard on port {port} did not come up in {timeout_s} s")


def _kill_session(process: subprocess.Popen) -> None:
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=30)
            return
        except subprocess.TimeoutExpired:
            continue
