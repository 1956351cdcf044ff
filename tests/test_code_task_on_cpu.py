"""The code task: the sandbox (correct, wrong and hostile programs), the reward, the task adapter and the refusal of
value sources that have no meaning for programs. Hostile programs use short limits; each must come back as a failed
case within a bounded time."""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from types import SimpleNamespace

import pytest

from rredcot_verl.tasks import TASKS, sandbox
from rredcot_verl.tasks.code import code_task_refusal
from rredcot_verl.tasks.code_reward import compute_score, parse_tests
from rredcot_verl.tasks.sandbox import CodeTests, SandboxLimits, live_processes_of, run_tests

# Programs that end by themselves (passing or failing) get room: a 2 s limit includes interpreter start-up, which a
# loaded 2-core machine (an end-to-end launch beside this tier) has stretched past 2 s, turning "ok" or "error" into
# "timeout". Programs that must be killed keep the short limit, so the bound on how long a kill takes stays tight.
LIMITS = SandboxLimits(timeout_s=30.0, memory_bytes=512 << 20, processes=16)
HOSTILE_LIMITS = SandboxLimits(timeout_s=2.0, memory_bytes=512 << 20, processes=16)
SQUARE_ASSERTS = CodeTests("assert", ("assert square(2) == 4", "assert square(-3) == 9"))
SQUARE = "def square(x):\n    return x * x\n"
# Wall time a hostile run may take: the timeout, killing and interpreter start-up on a loaded 2-core machine.
BOUND_S = HOSTILE_LIMITS.timeout_s + 6.0


def _hostile(body: str, limits: SandboxLimits = HOSTILE_LIMITS) -> tuple[object, float]:
    start = time.monotonic()
    result = run_tests(body + "\n" + SQUARE, SQUARE_ASSERTS, limits)
    return result, time.monotonic() - start


@pytest.fixture
def uids_of_this_test(monkeypatch) -> set[int]:
    """The uids the sandbox dropped to in this test (the real kill runs; only its argument is noted): another
    process's sandbox (an end-to-end code run beside this tier) may have live processes under its own uid."""
    used: set[int] = set()
    kill_uid = sandbox._kill_uid

    def noting(uid, *args, **kwargs):
        used.add(uid)
        return kill_uid(uid, *args, **kwargs)

    monkeypatch.setattr(sandbox, "_kill_uid", noting)
    return used


def test_a_correct_program_passes_every_assert():
    result = run_tests(SQUARE, SQUARE_ASSERTS, LIMITS)
    assert (result.passed, result.total, result.status) == (2, 2, "ok") and result.all_passed


def test_a_wrong_program_fails_the_cases_it_gets_wrong():
    result = run_tests("def square(x):\n    return 2 * x\n", SQUARE_ASSERTS, LIMITS)
    assert (result.passed, result.total, result.status) == (1, 2, "ok") and not result.all_passed


def test_call_and_stdin_tests_are_compared():
    call = CodeTests("call", (([2], 4), ([3], [9]), ([1], 2)), "square")
    assert run_tests(SQUARE, call, LIMITS).passed == 2  # [9] is APPS's wrapped 9; square(1) is not 2
    stdin = CodeTests("stdin", (("2\n", "4\n"), ("5", " 25 \n\n"), ("1", "2")))
    result = run_tests("print(int(input()) ** 2)\n", stdin, LIMITS)
    assert (result.passed, result.total, result.status) == (2, 3, "ok")


def test_a_program_that_raises_at_import_passes_nothing():
    result = run_tests("raise SystemExit(3)\n" + SQUARE, SQUARE_ASSERTS, LIMITS)
    assert (result.passed, result.status) == (0, "error")


def test_an_infinite_loop_times_out():
    result, took = _hostile("while True:\n    pass")
    assert (result.passed, result.status) == (0, "timeout") and took < BOUND_S


def test_a_sleeping_program_times_out():
    result, took = _hostile("import time\ntime.sleep(60)")
    assert (result.passed, result.status) == (0, "timeout") and took < BOUND_S


def test_a_memory_hog_fails_with_status_memory():
    result, took = _hostile("hog = bytearray(4 << 30)", LIMITS)
    assert (result.passed, result.status) == (0, "memory") and took < LIMITS.timeout_s


def test_a_fork_bomb_is_contained(uids_of_this_test):
    result, took = _hostile("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert result.passed == 0 and result.status in ("timeout", "error") and took < BOUND_S
    # Nothing of it survives the run (when the uid was dropped every process of that uid is killed).
    if "unprivileged_user" in result.isolation:
        assert uids_of_this_test and not [uid for uid in uids_of_this_test if live_processes_of(uid)]


def test_a_child_that_leaves_the_process_group_is_killed(uids_of_this_test):
    result, _ = _hostile("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)", LIMITS)
    assert result.all_passed
    if "unprivileged_user" not in result.isolation:
        pytest.skip("only a dropped uid lets the parent find a child outside the process group")
    assert uids_of_this_test and not [uid for uid in uids_of_this_test if live_processes_of(uid)]


def test_a_write_outside_the_working_directory_fails_and_leaves_no_file(tmp_path):
    target = tmp_path / f"escaped-{uuid.uuid4().hex}"
    result, took = _hostile(f"open({str(target)!r}, 'w').write('x')", LIMITS)
    assert not target.exists()
    assert result.passed == 0 and result.status == "error" and took < LIMITS.timeout_s


def test_the_working_directory_is_writable_and_removed():
    program = "import os\nopen('scratch.txt', 'w').write('x')\nprint(os.getcwd())\n" + SQUARE
    result = run_tests(program, SQUARE_ASSERTS, LIMITS)
    assert result.all_passed
    workdir = result.stdout.strip()
    assert workdir and not os.path.exists(workdir)


def test_the_trainers_environment_is_not_passed_in(monkeypatch):
    monkeypatch.setenv("RREDCOT_SECRET_TOKEN", "do-not-leak")
    program = "import os\nassert 'RREDCOT_SECRET_TOKEN' not in os.environ\n" + SQUARE
    assert run_tests(program, SQUARE_ASSERTS, LIMITS).all_passed


def test_output_is_truncated():
    result = run_tests("print('x' * 100_000)\n" + SQUARE, SQUARE_ASSERTS, LIMITS)
    assert result.all_passed and len(result.stdout) == LIMITS.output_bytes


def test_a_connection_to_loopback_fails_in_the_network_namespace():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        program = (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'x')\n"
                   + SQUARE)
        result, took = _hostile(program, LIMITS)
        if not result.network_isolated:
            pytest.skip("the kernel refused a network namespace here (unshare(CLONE_NEWNET)); isolation: "
                        f"{result.isolation}")
        assert result.passed == 0 and result.status == "error" and took < LIMITS.timeout_s
        with pytest.raises(BlockingIOError):
            listener.accept()


# --------------------------------------------------------------------------------------------------------- reward


def _response(program: str) -> str:
    return f"Reasoning first.\n\n```python\nprint('draft')\n```\n\nFinal:\n```python\n{program}```\n"


@pytest.mark.parametrize("ground_truth", [
    json.dumps({"assert_case": ["assert square(3) == 9", "assert square(0) == 0"]}),
    json.dumps({"inputs": ["3", "0"], "outputs": ["9", "0"], "fn_name": "square"}),  # prime_code's strings
    {"inputs": [[3], [0]], "outputs": [9, 0], "fn_name": "square"},
])
def test_reward_is_all_or_nothing_on_the_last_python_block(ground_truth):
    assert compute_score("code", _response(SQUARE), ground_truth) == 1.0
    assert compute_score("code", _response("def square(x):\n    return 9\n"), ground_truth) == 0.0
    assert compute_score("code", "no code here", ground_truth) == 0.0


def test_reward_reads_stdin_tests():
    truth = json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]})
    assert compute_score("code", _response("a, b = map(int, input().split())\nprint(a + b)\n"), truth) == 1.0
    assert compute_score("code", _response("print(3)\n"), truth) == 0.0


def test_reward_rejects_a_ground_truth_without_cases():
    with pytest.raises(ValueError):
        compute_score("code", _response(SQUARE), json.dumps({"inputs": [], "outputs": []}))
    with pytest.raises(ValueError):
        parse_tests("[1, 2]")


# ---------------------------------------------------------------------------------------------- adapter, refusal


def test_code_task_adapter():
    task = TASKS["code"]
    assert task.extract_answer(_response(SQUARE)) == SQUARE.strip()
    assert task.extract_answer("```python\nunclosed") is None
    assert task.equivalent("def f(x):\n    return x  # id\n", "def f( x ):\n\n    return (x)")
    assert not task.equivalent("def f(x):\n    return x\n", "def f(x):\n    return -x\n")
    assert task.split_steps("Plan.\n\n```python\nimport os\n\ndef f():\n    pass\n```") == [
        "Plan.", "```python\nimport os", "def f():\n    pass\n```"]
    assert task.step_separator == "\n\n"


def _settings(task: str, value_source: str):
    return SimpleNamespace(task=task, probe=SimpleNamespace(value_source=value_source))


@pytest.mark.parametrize("estimator", ["rredcot", "rredcot_ibpo", None])
@pytest.mark.parametrize("source", ["exit_probe", "reference_continuation"])
def test_value_sources_without_meaning_for_programs_are_refused(estimator, source):
    message = code_task_refusal(_settings("code", source), estimator)
    assert message is not None and "algorithm.rredcot.probe.value_source" in message and "\n" not in message


@pytest.mark.parametrize("task, source, estimator", [
    ("code", "exit_probe", "segment_mc"),
    ("code", "exit_probe", "ibpo"),
    ("code", "own_continuation", "rredcot"),
    ("boxed_math", "exit_probe", "rredcot"),
])
def test_other_combinations_are_not_refused(task, source, estimator):
    assert code_task_refusal(_settings(task, source), estimator) is None


def test_refusal_reads_the_real_settings():
    from rredcot_verl.core.settings import settings_from_config

    settings = settings_from_config({"rredcot": {"task": "code"}})
    assert code_task_refusal(settings, "rredcot") is not None
