"""Run a model-written Python program against tests, treating it as hostile.

Each run is a separate process tree that never shares the trainer's interpreter:

1. The parent writes the program, the tests and a small harness into a fresh temporary working directory and starts
   ``python -I -S -c <bootstrap>`` in a new session (``start_new_session=True``) with a minimal environment (no
   variable of the trainer's is passed in). It is started without ``preexec_fn`` because verl calls rule rewards from
   worker threads, where running Python between fork and exec can deadlock; the bootstrap is a fresh interpreter, so
   its set-up code runs before any program code, as a preexec would.
2. The bootstrap isolates itself as far as the kernel allows and records what held (``SandboxResult.isolation``):
   ``network``: a new network namespace (``unshare(CLONE_NEWNET)`` through libc; inside it only a loopback device
   exists, and it is down, so not even 127.0.0.1 can be reached); ``readonly_fs``: a new mount namespace in which every
   mount but the working directory is remounted read-only (checked by a write next to the working directory);
   ``unprivileged_user``: when the trainer runs as root, the program runs as a fresh unprivileged uid (which makes the
   process limit count, takes away the capabilities that could undo the read-only mounts, and lets the parent kill
   every process of that uid); ``no_new_privs``: set-uid binaries cannot raise privileges. An unprivileged trainer
   gets the namespaces through a user namespace (its own uid mapped to itself, so the program has no capabilities
   after exec) where the kernel permits one.
3. It sets resource limits (``resource.setrlimit``: CPU seconds, address space, file size, which also caps stdout and
   stderr, number of processes, no core files) and execs ``python -I`` on the harness, which runs the program and
   the tests.
4. The parent waits at most ``timeout_s``; then, and after every run, it kills the process group (``os.killpg``) and,
   with a dropped uid, every process left with that uid (a child that left the group with ``setsid`` included). The
   working directory is removed.

Where a namespace cannot be created (a container without the capability, user namespaces switched off), the run goes
on without it and ``isolation`` says so: the resource limits, the timeout, the fresh directory and the minimal
environment still hold, but the program may reach the network or write wherever the trainer's user may. Use verl's
sandbox-fusion reward there (docs/usage.md, "Code tasks").

Results of assert and call tests are reported by the harness inside the sandbox, so a program that tampers with its
own harness (it shares its process) can forge them; stdin/stdout tests are compared by the parent.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

MODES = ("assert", "call", "stdin")
STATUSES = ("ok", "timeout", "memory", "output_limit", "error")
ISOLATION = ("network", "readonly_fs", "unprivileged_user", "no_new_privs")
_MEMORY_EXIT = 99  # the harness's exit code for a MemoryError
_BOOTSTRAP_FAILED = 98
# uids handed to sandboxed programs when the trainer is root: fresh per run, so that the process limit and the final
# kill apply to one run's processes only.
UID_BASE, UID_SPAN = 200_000, 1_000_000


@dataclass(frozen=True)
class SandboxLimits:
    """Per-process limits. ``cpu_s`` None takes ``timeout_s`` rounded up; ``output_bytes`` is how much of stdout and
    stderr the result keeps (the file-size limit caps what the program may write at all)."""

    timeout_s: float = 5.0
    cpu_s: int | None = None
    memory_bytes: int = 1 << 30
    file_size_bytes: int = 1 << 20
    processes: int = 32
    output_bytes: int = 4096


@dataclass(frozen=True)
class CodeTests:
    """Tests of one problem: ``assert`` (each case an assert statement run after the program), ``call`` (each case
    ``(args, expected)``: ``fn_name(*args)`` compared with ``expected``) or ``stdin`` (each case ``(input, output)``:
    the program's standard output for that input, compared line by line ignoring surrounding whitespace)."""

    mode: str
    cases: tuple
    fn_name: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"tests mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "call" and not self.fn_name:
            raise ValueError("call tests need fn_name")


@dataclass(frozen=True)
class SandboxResult:
    """``passed`` of ``total`` test cases; ``status`` one of ``STATUSES`` (the first that was not ``ok`` over the
    processes of the run); ``stdout`` / ``stderr`` truncated to ``SandboxLimits.output_bytes``; ``isolation``: the
    items of ``ISOLATION`` that held for every process of the run."""

    passed: int
    total: int
    status: str
    stdout: str = ""
    stderr: str = ""
    isolation: tuple[str, ...] = field(default_factory=tuple)

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total

    @property
    def network_isolated(self) -> bool:
        return "network" in self.isolation


# The bootstrap runs as ``python -I -S -c _BOOTSTRAP <config json>`` in the working directory's new session. It
# imports only builtin and stdlib modules; every step that may be refused by the kernel is tried and recorded.
_BOOTSTRAP = r"""
import ctypes, errno, json, os, resource, sys
cfg = json.loads(sys.argv[1])
held = []
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
NEWNS, NEWUSER, NEWNET = 0x00020000, 0x10000000, 0x40000000
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, NOATIME, NODIRATIME, BIND, REC = 1, 2, 4, 8, 32, 1024, 2048, 4096, 16384
PRIVATE, RELATIME = 1 << 18, 1 << 21
KEEP = {"nosuid": NOSUID, "nodev": NODEV, "noexec": NOEXEC, "noatime": NOATIME, "nodiratime": NODIRATIME,
        "relatime": RELATIME}
work = cfg["workdir"]
uid, gid = os.getuid(), os.getgid()

def unshare(flags):
    if libc.unshare(flags) != 0:
        return False
    if flags & NEWUSER:  # map our own uid and gid onto themselves: no capability survives the exec below
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    return True

user = 0 if uid == 0 else NEWUSER
mounts = unshare(user | NEWNET | NEWNS)
if mounts or unshare(user | NEWNET):
    held.append("network")

def unescape(path):
    return path.encode().decode("unicode_escape").encode("latin-1")

def readonly_outside_workdir():
    if libc.mount(None, b"/", None, REC | PRIVATE, None) != 0:
        return False
    if libc.mount(work.encode(), work.encode(), None, BIND, None) != 0:
        return False
    with open("/proc/self/mountinfo") as f:
        entries = [line.split() for line in f]
    for fields in entries:
        point = unescape(fields[4])
        if point == work.encode():
            continue
        keep = sum(KEEP.get(option, 0) for option in fields[5].split(","))
        libc.mount(None, point, None, REMOUNT | BIND | RDONLY | keep, None)  # checked below, not per mount
    probe = os.path.join(os.path.dirname(work), ".rredcot-probe-" + os.path.basename(work))
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as error:
        return error.errno == errno.EROFS
    os.unlink(probe)
    return False

if mounts and readonly_outside_workdir():
    held.append("readonly_fs")
if cfg["uid"] is not None:
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
    held.append("unprivileged_user")
if libc.prctl(38, 1, 0, 0, 0) == 0:  # PR_SET_NO_NEW_PRIVS
    held.append("no_new_privs")
cpu = cfg["cpu_s"]
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_bytes"],) * 2)
resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["file_size_bytes"],) * 2)
resource.setrlimit(resource.RLIMIT_NPROC, (cfg["processes"],) * 2)
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.write(cfg["report_fd"], json.dumps(held).encode())
os.close(cfg["report_fd"])
os.chdir(work)
argv = [cfg["python"], "-I", "_harness.py", cfg["mode"], str(cfg["results_fd"])]
try:
    os.execve(cfg["python"], argv, cfg["env"])
except OSError as error:
    sys.stderr.write(f"sandbox: cannot start the program: {error}\n")
    os._exit(98)
"""

# The harness runs the program and, for assert and call tests, writes "<case> <0|1>" lines to the results file.
_HARNESS = r"""
import json, os, sys, traceback

def same(out, expected):
    if isinstance(out, tuple):
        out = list(out)
    if out == expected:
        return True
    # APPS-style call tests wrap the expected return value in a list.
    return isinstance(expected, list) and len(expected) == 1 and out == expected[0]

def main():
    mode, results = sys.argv[1], os.fdopen(int(sys.argv[2]), "w", buffering=1)
    with open("tests.json") as f:
        tests = json.load(f)
    with open("solution.py") as f:
        code = compile(f.read(), "solution.py", "exec")
    namespace = {"__name__": "__main__" if mode == "stdin" else "solution", "__builtins__": __builtins__}
    exec(code, namespace)
    if mode == "stdin":
        return
    if mode == "call":
        name = tests["fn_name"]
        fn = namespace[name] if name in namespace else getattr(namespace["Solution"](), name)
    for i, case in enumerate(tests["cases"]):
        try:
            ok = same(fn(*case[0]), case[1]) if mode == "call" else exec(case, namespace) is None
        except MemoryError:
            raise
        except Exception:
            ok = False
        results.write(f"{i} {int(bool(ok))}\n")

try:
    main()
except MemoryError:
    sys.stderr.write("MemoryError\n")
    os._exit(99)
"""


def _reachable_by_anyone(path: str) -> bool:
    """Whether a user with no relation to the files can traverse to ``path`` and read and execute it."""
    path = os.path.realpath(path)
    try:
        if os.stat(path).st_mode & (stat.S_IROTH | stat.S_IXOTH) != (stat.S_IROTH | stat.S_IXOTH):
            return False
        parent = os.path.dirname(path)
        while True:
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
            if parent == os.path.dirname(parent):
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


def _interpreter(drop_uid: bool) -> str:
    """The trainer's interpreter, or with a dropped uid the first Python the unprivileged uid can start: the
    trainer's may live under a private home (pyenv in /root) that only root can enter."""
    if not drop_uid or _reachable_by_anyone(sys.executable):
        return sys.executable
    for candidate in (getattr(sys, "_base_executable", ""), "/usr/local/bin/python3", "/usr/bin/python3"):
        if candidate and _reachable_by_anyone(candidate):
            return candidate
    return ""


def _kill_uid(uid: int, within_s: float = 5.0) -> None:
    """SIGKILL every process of ``uid`` (a program's children that left its process group included), by a helper
    that takes the uid and signals everything it may (``kill(-1)``); repeated while any is left, for up to
    ``within_s``: a killed process stays alive until the kernel has torn it down, which on a loaded machine can take
    longer than one pass, and a fork bomb's child born during a pass escapes it."""
    helper = "import os, sys; u = int(sys.argv[1]); os.setgroups([]); os.setgid(u); os.setuid(u); os.kill(-1, 9)"
    deadline = time.monotonic() + within_s
    pause = 0.02
    while live_processes_of(uid) and time.monotonic() < deadline:
        subprocess.run([sys.executable, "-I", "-S", "-c", helper, str(uid)], env={}, check=False, timeout=10)
        time.sleep(pause)
        pause = min(2 * pause, 0.5)


def live_processes_of(uid: int) -> list[int]:
    """Processes of ``uid`` that are not zombies (a killed process stays listed until its new parent reaps it)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != b"Z":
            found.append(int(name))
    return found


def _read(path: str, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace")


def _remove_tree(path: str) -> None:
    # A program may have removed its own permissions on what it wrote; give them back before removing.
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            try:
                os.chmod(os.path.join(root, name), 0o700)
            except OSError:
                pass
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class _Process:
    returncode: int | None
    timed_out: bool
    stdout: str
    stderr: str
    results: str
    isolation: tuple[str, ...]


def _run_once(program: str, tests: CodeTests, stdin: str, limits: SandboxLimits) -> _Process:
    """One sandboxed process: the harness runs ``program`` with ``tests`` (mode ``stdin``: reads ``stdin``)."""
    drop_uid = os.geteuid() == 0
    python = _interpreter(drop_uid)
    uid = UID_BASE + secrets.randbelow(UID_SPAN) if drop_uid and python else None
    python = python or sys.executable
    private = tempfile.mkdtemp(prefix="rredcot-sandbox-io-")  # outputs: the parent's only, passed as descriptors
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="rredcot-sandbox-"))  # the mount table holds real paths
    try:
        for name, text in (("solution.py", program), ("_harness.py", _HARNESS),
                           ("tests.json", json.dumps({"cases": list(tests.cases), "fn_name": tests.fn_name}))):
            with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
                f.write(text)
            os.chmod(os.path.join(workdir, name), 0o644)
        if uid is not None:
            os.chown(workdir, uid, uid)
        paths = {name: os.path.join(private, name) for name in ("stdin", "stdout", "stderr", "results")}
        with open(paths["stdin"], "w", encoding="utf-8") as f:
            f.write(stdin)
        report_read, report_write = os.pipe()
        report = os.fdopen(report_read, "rb")
        with report, open(paths["stdin"], "rb") as stdin_file, open(paths["stdout"], "wb") as stdout_file, \
                open(paths["stderr"], "wb") as stderr_file, open(paths["results"], "wb") as results_file:
            config = {
                "workdir": workdir, "uid": uid, "python": python, "mode": tests.mode,
                "cpu_s": int(limits.cpu_s or max(1, -(-limits.timeout_s // 1))),
                "memory_bytes": limits.memory_bytes, "file_size_bytes": limits.file_size_bytes,
                "processes": limits.processes, "report_fd": report_write, "results_fd": results_file.fileno(),
                "env": {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "PYTHONHASHSEED": "0",
                        "PYTHONDONTWRITEBYTECODE": "1"},
            }
            try:
                process = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _BOOTSTRAP, json.dumps(config)],
                    stdin=stdin_file, stdout=stdout_file, stderr=stderr_file, cwd=workdir, env={},
                    start_new_session=True, pass_fds=(report_write, results_file.fileno()), close_fds=True,
                )
            finally:
                os.close(report_write)
            timed_out = False
            try:
                process.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                process.wait()
                if uid is not None:
                    _kill_uid(uid)
            reported = report.read()
        try:
            isolation = tuple(json.loads(reported)) if reported else ()
        except ValueError:
            isolation = ()
        return _Process(
            returncode=None if timed_out else process.returncode, timed_out=timed_out,
            stdout=_read(paths["stdout"], limits.file_size_bytes), stderr=_read(paths["stderr"], limits.output_bytes),
            results=_read(paths["results"], 1 << 20), isolation=isolation,
        )
    finally:
        _remove_tree(workdir)
        _remove_tree(private)


def _status(process: _Process) -> str:
    code = process.returncode
    if process.timed_out or code in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout"
    if code == _MEMORY_EXIT or "MemoryError" in process.stderr:
        return "memory"
    # Python ignores SIGXFSZ, so the file-size limit usually shows as EFBIG ("File too large") rather than the signal.
    if code == -signal.SIGXFSZ or "[Errno 27] File too large" in process.stderr:
        return "output_limit"
    return "ok" if code == 0 else "error"


def _same_output(actual: str, expected: str) -> bool:
    """Standard outputs equal line by line, each line's surrounding whitespace and trailing blank lines ignored."""
    return [row.strip() for row in actual.strip().splitlines()] == [
        row.strip() for row in str(expected).strip().splitlines()]


def run_tests(program: str, tests: CodeTests, limits: SandboxLimits = SandboxLimits(), *,
              stop_at_first_failure: bool = False) -> SandboxResult:
    """Run ``program`` against ``tests`` in the sandbox (module docstring). Never raises for anything the program
    does: a crash, a timeout or an exhausted limit is a failed case. Assert and call tests run in one process;
    stdin tests run one process per case, and after a case that timed out or exhausted memory the remaining cases
    count as failed without running (so a run takes at most about ``total × timeout_s``, usually one
    ``timeout_s``); ``stop_at_first_failure`` stops at any failing stdin case."""
    total = len(tests.cases)
    if total == 0:
        return SandboxResult(0, 0, "ok")
    if tests.mode != "stdin":
        process = _run_once(program, tests, "", limits)
        passed = set()
        for line in process.results.splitlines():
            fields = line.split()
            if len(fields) == 2 and fields[0].isdigit() and fields[1] == "1" and int(fields[0]) < total:
                passed.add(int(fields[0]))
        return SandboxResult(len(passed), total, _status(process), process.stdout[:limits.output_bytes],
                             process.stderr, process.isolation)
    passed, status, stdout, stderr, isolation = 0, "ok", "", "", None
    for case_input, expected in tests.cases:
        process = _run_once(program, tests, str(case_input), limits)
        case_status = _status(process)
        held = set(process.isolation)
        isolation = held if isolation is None else isolation & held
        ok = case_status == "ok" and _same_output(process.stdout, expected)
        passed += ok
        if status == "ok" and case_status != "ok":
            status, stdout, stderr = case_status, process.stdout[:limits.output_bytes], process.stderr
        elif not stdout and not stderr:
            stdout, stderr = process.stdout[:limits.output_bytes], process.stderr
        if case_status in ("timeout", "memory") or (stop_at_first_failure and not ok):
            break
    return SandboxResult(passed, total, status, stdout, stderr, tuple(i for i in ISOLATION if i in (isolation or ())))
