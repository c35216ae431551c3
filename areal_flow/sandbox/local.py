"""The code sandbox, host side: runs an untrusted program against test inputs and returns what it
printed, case by case.

The program was written by a model under training: treat it as hostile. Each Sandbox keeps one
`init.py` (stdlib only, beside it) resident in a session of its own, in PID, network, mount and IPC
namespaces it makes once, and sends it one job per program; each job runs in a process of its own
(new /tmp and /sandbox), chrooted into a root of read-only binds, each case forked from it as an
unprivileged uid of its own, under resource limits, with a wall-clock deadline per case. The host keeps a deadline over the whole job and kills the init's
process group when it passes (the next job starts a new init); the init dies with its parent
(PR_SET_PDEATHSIG), and the kernel kills every process of a PID namespace whose init dies. What each
layer stops is in docs/rewards.md.

Isolation is checked once per process (`isolation()`): where namespaces are unavailable (not root,
no CAP_SYS_ADMIN) the sandbox refuses to run unless `allow_unsandboxed` is set, and then warns.
"""

from __future__ import annotations

import fcntl
import marshal
import logging
import math
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import weakref
from typing import Any

import msgspec

from areal_flow.config.schema import SandboxConfig

log = logging.getLogger("areal_flow.sandbox")

INIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "init.py")
# Programs run as uid UID_BASE + the pid of the worker that runs them: one uid per worker, so
# RLIMIT_NPROC (counted per uid across the machine) is a budget per sandbox, and no two sandboxes
# share a uid. Far above any account a distribution creates.
UID_BASE = 1_500_000_000
# The checker of a program's tests (areal_flow/sandbox/checker.py) runs as a uid of its own, this far
# below its program's: below every program's uid (those of a worker's tool sandboxes reach UID_BASE +
# 65·2^22, about 0.27e9 above it), so no checker shares a uid with any program.
CHECKER_UID_SHIFT = 300_000_000
# Directories the program's interpreter needs (shown read-only); the interpreter's own prefix is added.
LIMITS = ("wall_seconds", "cpu_seconds", "memory_mb", "file_size_mb", "disk_mb", "processes", "open_files",
          "output_bytes")
# Seconds the host waits beyond the cases' own deadlines (start-up, namespace set-up, clean-up).
HOST_SLACK = 10.0
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache")
# An init's root directory is `{ROOT_PREFIX}{host pid}_...` in the temporary directory, locked by its
# host. The host removes it when it closes the sandbox; a host killed (a reward worker replaced after a
# timeout) cannot, so the next sandbox to start removes the roots of hosts that no longer run.
ROOT_PREFIX = "areal_flow_sandbox_"
ROOT_LOCK_SECONDS = 60.0  # far more than a host takes from making its root to locking it
WORKDIR = "/sandbox"  # a program's working directory in its namespace (init.py makes it)


class SandboxUnavailable(RuntimeError):
    """The machine cannot isolate programs and the configuration did not opt out of isolation."""


class CaseResult(msgspec.Struct):
    """One test case as the program ran it: status is ok | timeout | runtime_error | memory_limit |
    file_size_limit | disk_limit | output_limit (| sandbox_error for the host's own failures)."""

    status: str
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    seconds: float = 0.0


class Isolation(msgspec.Struct):
    """Which layers a run had; `active` is the whole set."""

    pid_namespace: bool
    network_namespace: bool
    mount_namespace: bool
    unprivileged_user: bool
    rlimits: bool

    @property
    def active(self) -> bool:
        return all(msgspec.structs.asdict(self).values())


def _interpreter_paths(python: str) -> list[str]:
    real = os.path.realpath(python)
    prefix = os.path.dirname(os.path.dirname(real))  # .../bin/python3.11 -> ...
    return [prefix] if not any(prefix == p or prefix.startswith(p + "/") for p in SYSTEM_PATHS) else []


class Sandbox:
    """Runs programs, one `run` at a time per instance (a reward worker holds one, and with it one
    resident init process)."""

    def __init__(self, cfg: SandboxConfig = SandboxConfig(), *, uid: int | None = None):
        self.cfg = cfg
        # The program runs with -I (no environment variables, no user site) and -S (no
        # site-packages: the standard library only, and a faster start).
        self.python = os.path.realpath(cfg.python or sys.executable)
        self._same_grammar = self.python == os.path.realpath(sys.executable)  # may compile programs here
        self.uid = UID_BASE + os.getpid() if uid is None else uid
        self.checker_uid = self.uid - CHECKER_UID_SHIFT
        self._isolate: bool | None = None  # None until probed: whether runs use namespaces
        self._isolation: Isolation | None = None
        self._server: subprocess.Popen | None = None  # the resident init (init.py)
        self._server_isolate = True  # whether it made namespaces
        self._server_log: Any = None
        self._root = ""  # the init's root directory (its mounts are in its own mount namespace)
        self._secrets = -1  # the write end of the init's descriptor for checked jobs' tests
        self._jobs = 0
        self._compiled: tuple[str, Any] = ("", None)  # the last program compiled here, and its code
        self._harnesses: dict[str, Any] = {}  # the code of each harness script
        self._root_lock = -1  # a descriptor of the root, locked while the init runs

    def isolation(self) -> Isolation:
        """Probe: run a trivial program and report which isolation it had. Raises
        `SandboxUnavailable` where namespaces cannot be made and `allow_unsandboxed` is false."""
        reply = self._launch("pass", [""], None, isolate=True)
        if "error" not in reply:
            self._isolate = True
            self._isolation = msgspec.convert(reply["isolation"], Isolation)
            return self._isolation
        if not self.cfg.allow_unsandboxed:
            raise SandboxUnavailable(
                f"the code sandbox cannot isolate programs on this machine: {reply['error']}. Run as root "
                "(or with CAP_SYS_ADMIN), or set sandbox.allow_unsandboxed=true to run model-written code "
                "with resource limits and a separate uid only, which does NOT stop it reaching the network "
                "or reading files this machine lets any user read")
        log.warning("!" * 80)
        log.warning("THE CODE SANDBOX RUNS WITHOUT NAMESPACES (sandbox.allow_unsandboxed=true): %s. Programs "
                    "written by the model can use the network and read world-readable files.", reply["error"])
        log.warning("!" * 80)
        self._isolate = False
        reply = self._launch("pass", [""], None, isolate=False)
        self._isolation = msgspec.convert(reply["isolation"], Isolation)
        return self._isolation

    def describe(self) -> str:
        """One line for logs: which isolation the programs get."""
        iso = self.isolation() if self._isolate is None else self._isolation
        layers = [k for k, on in msgspec.structs.asdict(iso).items() if on]
        return f"local sandbox ({', '.join(layers) or 'no isolation'})"

    def run(self, program: str, inputs: list[str]) -> list[CaseResult]:
        """Run `program` once per input, as a script fed the input on stdin. Stops at the first case
        that does not finish cleanly when fail_fast. Never raises for anything the program does."""
        if self._isolate is None:
            self.isolation()
        if (failed := self._does_not_compile(program)) is not None:
            return [failed] if self.cfg.fail_fast else [failed] * len(inputs)
        reply = self._launch(program, inputs, None, isolate=self._isolate)
        if "error" in reply:
            return [CaseResult("sandbox_error", stderr=reply["error"])]
        return [msgspec.convert(c, CaseResult) for c in reply["cases"]]

    def check(self, program: str, script: str, checker: str, job: dict, *, scale: float = 1.0) -> CaseResult:
        """Run `program` under `script` (which reads it from solution.py and answers calls on
        descriptors 3 and 4) beside a checker: `checker`'s source, whose main(job) runs in a process
        of its own uid, forked by the init, whose stdout comes back as the result's. The result's
        status and stderr are the program's. The case gets `scale` times the configured wall and CPU
        seconds (it runs several tests). Never raises for anything the program does."""
        if self._isolate is None:
            self.isolation()
        if (failed := self._does_not_compile(program)) is not None:
            return failed
        reply = self._launch(program, [""], script, isolate=self._isolate, scale=scale,
                             checker={"source": checker, "uid": self.checker_uid}, tests=job)
        if "error" in reply:
            return CaseResult("sandbox_error", stderr=reply["error"])
        return msgspec.convert(reply["cases"][0], CaseResult)

    def close(self) -> None:
        """Stop the resident init (it also dies with this process)."""
        if self._server is not None:
            _kill_group(self._server)
            self._server.stdin.close()
            self._server.stdout.close()
            self._server_log.close()
            self._server = None
            os.close(self._secrets)
            shutil.rmtree(self._root, ignore_errors=True)
            os.close(self._root_lock)

    def _start(self, isolate: bool) -> subprocess.Popen:
        """The resident init, started on first use and again after it was killed (or with the other
        isolation)."""
        if self._server is None or self._server.poll() is not None or self._server_isolate != isolate:
            self.close()
            remove_orphaned_roots()
            self._server_log = tempfile.TemporaryFile()  # its own errors, for the reply that explains them
            secrets_r, self._secrets = os.pipe()
            os.set_blocking(self._secrets, False)
            self._server = subprocess.Popen([sys.executable, "-I", "-S", INIT, str(secrets_r)], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=self._server_log, pass_fds=(secrets_r,),
                                            start_new_session=True, env={})
            os.close(secrets_r)
            weakref.finalize(self, _kill_group, self._server)  # the root goes at the next start's clean-up
            self._server_isolate = isolate
            self._root = tempfile.mkdtemp(prefix=f"{ROOT_PREFIX}{os.getpid()}_")
            self._root_lock = os.open(self._root, os.O_RDONLY | os.O_DIRECTORY)
            fcntl.flock(self._root_lock, fcntl.LOCK_SH)  # ours while we run (remove_orphaned_roots)
            # The checker runs in the init's own interpreter, the program in self.python.
            ro_paths = [*SYSTEM_PATHS, *_interpreter_paths(self.python), *_interpreter_paths(sys.executable)]
            setup = _frame({"root": self._root, "ro_paths": list(dict.fromkeys(ro_paths)), "isolate": isolate,
                            "uid": self.uid, "disk_mb": self.cfg.disk_mb})
            self._server.stdin.write(setup)
            self._server.stdin.flush()
        return self._server

    def _does_not_compile(self, program: str) -> CaseResult | None:
        """The failure a program that does not compile would give, found without starting it: early
        in training most completions are not Python. Only where the sandbox runs this interpreter
        (the same grammar); compiling runs none of the program, and CPython bounds what it folds."""
        if not self._same_grammar:
            return None
        try:
            with warnings.catch_warnings():  # a SyntaxWarning is the program's business, not the worker's log's
                warnings.simplefilter("ignore")
                self._compiled = (program, compile(program, f"{WORKDIR}/solution.py", "exec", dont_inherit=True))
        except (SyntaxError, ValueError) as e:  # ValueError: a NUL byte in the source
            return CaseResult("runtime_error", stderr="".join(traceback.format_exception_only(e)), exit_code=1)
        except (RecursionError, MemoryError):
            pass  # let the interpreter in the sandbox say what it makes of it
        return None

    def _code(self, program: str, harness: str | None) -> Any:
        """The code object of what the sandbox runs as a script (the program or its harness), where
        this interpreter runs it; None where the sandbox's must compile it."""
        if not self._same_grammar:
            return None
        if harness is not None:
            if harness not in self._harnesses:
                self._harnesses[harness] = compile(harness, f"{WORKDIR}/harness.py", "exec", dont_inherit=True)
            return self._harnesses[harness]
        return self._compiled[1] if self._compiled[0] is program else None

    def _launch(self, program: str, inputs: list[str], harness_source: str | None, isolate: bool,
                scale: float = 1.0, checker: dict | None = None, tests: Any = None) -> dict[str, Any]:
        limits = {k: getattr(self.cfg, k) for k in LIMITS}
        limits.update(wall_seconds=self.cfg.wall_seconds * scale, cpu_seconds=math.ceil(self.cfg.cpu_seconds * scale))
        job = {"uid": self.uid, "python": self.python, "python_args": ["-I", "-S"],
               "program": program, "harness": harness_source, "inputs": inputs,
               "limits": limits, "fail_fast": self.cfg.fail_fast, "checker": checker,
               # The program runs in the init's interpreter forked, where it is that interpreter,
               # compiled here: compiling in the forked process would cost it a page fault a page.
               "fork": self._same_grammar, "code": self._code(program, harness_source) if isolate else None}
        self._jobs += 1
        if checker is not None:
            checker["id"] = self._jobs
        # Each case is bounded inside; this bounds the whole job, namespace set-up and clean-up included.
        budget = len(inputs) * (limits["wall_seconds"] + 1.0) + HOST_SLACK
        deadline = time.monotonic() + budget
        server = self._start(isolate)
        try:
            server.stdin.write(_frame(job))
            server.stdin.flush()
            fd = server.stdout.fileno()
            taken = tests is None or _write_unless(self._secrets, _frame({"id": self._jobs, "job": tests}), fd, deadline)
            size = struct.unpack("<Q", _read_exactly(fd, 8, deadline))[0]
            reply = marshal.loads(_read_exactly(fd, size, deadline))
            if not taken:
                self.close()  # part of the tests is still in the channel: the next job starts a new init
            return reply
        except TimeoutError:
            self.close()  # the job's namespace dies with the init; the next job starts a fresh one
            return {"error": f"the sandbox did not finish within {budget:.0f} s"}
        except (OSError, EOFError, ValueError, struct.error):
            _kill_group(server)
            self._server_log.seek(0)
            tail = self._server_log.read()[-2000:].decode("utf-8", "replace")
            self.close()
            return {"error": f"the sandbox init failed (exit {server.returncode}): {tail}"}


def remove_orphaned_roots() -> None:
    """Remove the sandbox roots that hosts which no longer run left in the temporary directory. From
    the host's side a root is an empty directory: the mounts lived in its init's mount namespace,
    which died with it. A root is its host's while the host holds a lock on it (a host in another PID
    namespace names it with a pid that means another process here). A root not locked yet, just made,
    is left alone while its host's pid runs, or for ROOT_LOCK_SECONDS."""
    tmp, removed = tempfile.gettempdir(), 0
    for name in os.listdir(tmp):
        if not name.startswith(ROOT_PREFIX):
            continue
        pid = name[len(ROOT_PREFIX):].partition("_")[0]
        path = os.path.join(tmp, name)
        if _unlocked(path) and (not pid.isdigit() or not _pid_runs(int(pid)) or _age(path) > ROOT_LOCK_SECONDS):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    if removed:
        log.info("removed %d sandbox root(s) of hosts that no longer run", removed)


def _unlocked(root: str) -> bool:
    """Whether no host holds `root`'s lock (taken, and let go at once)."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _age(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:
        return 0.0


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it runs, as another user
    return True


def _frame(value: Any) -> bytes:
    data = marshal.dumps(value)
    return struct.pack("<Q", len(data)) + data


def _write_unless(fd: int, data: bytes, reply_fd: int, deadline: float) -> bool:
    """Write all of `data` to the non-blocking `fd`, unless a reply on `reply_fd` comes first (the job
    ended without reading it): whether all was written. TimeoutError at the deadline."""
    view = memoryview(data)
    while view:
        left = deadline - time.monotonic()
        readable, writable, _ = select.select([reply_fd], [fd], [], max(left, 0))
        if writable:
            view = view[os.write(fd, view):]
        elif readable:
            return False
        elif left <= 0:
            raise TimeoutError
    return True


def _read_exactly(fd: int, n: int, deadline: float) -> bytes:
    """n bytes from fd; TimeoutError at the deadline, EOFError if the writer is gone."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.returncode is not None:
        return  # reaped: its pid may belong to someone else now (and its children died with it)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
