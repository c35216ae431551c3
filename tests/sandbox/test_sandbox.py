"""Hostile programs in the code sandbox: each is contained, fails its test, and leaves the host, the
test run and the filesystem as they were.

These tests run as root (as CI does). The ones whose failure could reach other processes (a
program that kills everything it can) run the sandbox from a driver inside a PID namespace of the
test's own, so a broken sandbox takes down only that namespace, never pytest.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

from areal_flow.config.schema import SandboxConfig
from areal_flow.data.input_output import parse_tests
from areal_flow.rewards.code import score_program
from areal_flow.sandbox.local import ROOT_PREFIX, Sandbox

LIMITS = SandboxConfig(wall_seconds=2.0, cpu_seconds=2, memory_mb=512, file_size_mb=4, disk_mb=16, processes=16,
                output_bytes=1 << 16)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's namespaces need root, as on CI")


def processes_of(uid: int) -> list[int]:
    """Host pids owned by `uid` (read from /proc, so it sees every PID namespace below ours)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    line = next(ln for ln in f if ln.startswith("Uid:"))
            except (OSError, StopIteration):
                continue
            if int(line.split()[1]) == uid:
                pids.append(int(entry))
    return pids


def wait_until_gone(uid: int, seconds: float = 5.0) -> list[int]:
    """The processes of `uid` still there after up to `seconds` (a killed namespace dies async)."""
    deadline = time.monotonic() + seconds
    while (left := processes_of(uid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def sandbox_dirs() -> set[str]:
    """This process's sandbox roots: other test runs on the machine make and remove their own meanwhile."""
    return {d for d in os.listdir(tempfile.gettempdir()) if d.startswith(f"{ROOT_PREFIX}{os.getpid()}_")}


@pytest.fixture
def sandbox():
    before = sandbox_dirs()
    box = Sandbox(LIMITS)
    yield box
    assert processes_of(box.uid) == [], "a process of the sandbox's uid outlived its run"
    init = box._server
    box.close()
    assert init is None or not os.path.exists(f"/proc/{init.pid}"), "the resident init outlived close()"
    assert sandbox_dirs() == before, "the sandbox left its temporary directory behind"


def run1(box: Sandbox, program: str, stdin: str = ""):
    (result,) = box.run(textwrap.dedent(program), [stdin])
    return result


def test_isolation_is_reported_and_complete_as_root(sandbox):
    iso = sandbox.isolation()
    assert iso.active
    assert iso.pid_namespace and iso.network_namespace and iso.mount_namespace and iso.unprivileged_user


def test_correct_program_passes_and_wrong_output_is_returned_as_printed(sandbox):
    results = sandbox.run("a, b = map(int, input().split())\nprint(a + b)\n", ["1 2", "40 2"])
    assert [(r.status, r.stdout) for r in results] == [("ok", "3\n"), ("ok", "42\n")]


def test_program_runs_as_an_unprivileged_uid_in_a_pid_namespace_of_its_own(sandbox):
    r = run1(sandbox, "import os; print(os.getuid(), os.geteuid(), os.getpid(), os.getppid(), "
                      "sorted(p for p in os.listdir('/proc') if p.isdigit()))")
    uid, euid, pid, ppid, procs = r.stdout.split(" ", 4)
    assert int(uid) == int(euid) == sandbox.uid != 0
    # PID 1 is the namespace's init, the parent the job's process: no host process is visible (the
    # last job's process may be on its way out).
    others = set(eval(procs)) - {"1", ppid, pid}
    assert {"1", ppid, pid} <= set(eval(procs)) and "1" not in (pid, ppid)
    assert len(others) <= 1 and all(int(p) < int(ppid) for p in others), procs


def test_programs_share_one_resident_init_and_nothing_else(sandbox):
    # The init and its namespaces stay up between programs, but each job gets a new /tmp and
    # /sandbox, its processes are gone before its reply, and no System V IPC object or message queue
    # (which would outlive a job in the shared IPC namespace) can be made.
    first = run1(sandbox, """
        import os
        open('/sandbox/left', 'w').write('x'); open('/tmp/left', 'w').write('x')
        print(os.getpid())
    """)
    init = sandbox._server.pid
    second = run1(sandbox, "import os; print(os.path.exists('/sandbox/left'), os.path.exists('/tmp/left'))")
    assert first.status == "ok" and second.stdout == "False False\n"
    assert sandbox._server.pid == init
    ipc = run1(sandbox, """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        IPC_CREAT = 0o1000
        print(libc.shmget(1234, 4096, IPC_CREAT | 0o666), libc.msgget(1234, IPC_CREAT | 0o666),
              libc.semget(1234, 1, IPC_CREAT | 0o666), libc.mq_open(b"/q", 0o100 | 2, 0o666, None))
    """)
    assert ipc.stdout == "-1 -1 -1 -1\n", ipc


# A program scans its whole memory for strings (built at run time, so its own copies are counted
# in the baseline) that an earlier job's program printed or read, or that a checked job's tests held.
MEMORY_SCAN = """
    import re
    def count(marker):
        found = 0
        for line in open("/proc/self/maps"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if "r" not in line.split()[1]:
                continue
            try:
                with open("/proc/self/mem", "rb", buffering=0) as mem:
                    mem.seek(start)
                    found += mem.read(end - start).count(marker)
            except (OSError, ValueError, OverflowError):
                pass
        return found
    print(*(count(("%s" % w[::-1]).encode()) for w in WORDS))
"""


def test_no_job_data_is_in_a_later_program_s_memory(sandbox):
    # Programs run in forked interpreters, so the process they are forked from must never have
    # held another job's program, input, output or tests.
    words = ["KRAMNEVESRCOTNOL", "TUPNINEDDIHA", "TUPTUODETNIRPA", "TSETNEDDIHA"]  # reversed
    first = run1(sandbox, f"print(input(), {words[2][::-1]!r})", words[1][::-1])
    assert first.stdout == f"{words[1][::-1]} {words[2][::-1]}\n"
    tests = parse_tests({"asserts": [f"assert f(1) == {words[3][::-1]!r}"]})
    assert score_program(sandbox, "def f(x):\n    return 'no'\n", tests)["reward"] == 0.0
    counts = run1(sandbox, f"WORDS = {words!r}\n" + textwrap.dedent(MEMORY_SCAN)).stdout.split()
    assert len(counts) == 4 and int(counts[0]) > 0, counts  # the scan finds its own strings
    assert counts[1:] == [counts[0]] * 3, counts  # and no more of the other jobs' than of a word never used


def test_a_program_that_does_not_compile_fails_as_the_interpreter_would_without_a_job(sandbox, monkeypatch):
    program = "Sure! Here is the answer: print(input()"
    launched = []
    real = Sandbox._launch
    monkeypatch.setattr(Sandbox, "_launch", lambda self, *a, **k: launched.append(a) or real(self, *a, **k))
    sandbox.isolation()
    launched.clear()  # the probe's job
    (r,) = sandbox.run(program, ["x", "y"])
    assert r.status == "runtime_error" and r.exit_code == 1 and "SyntaxError" in r.stderr
    assert launched == []
    # The same failure when the interpreter in the sandbox reads it (the shortcut is bypassed).
    monkeypatch.setattr(Sandbox, "_does_not_compile", lambda self, program: None)
    (ran,) = sandbox.run(program, ["x", "y"])
    assert (ran.status, ran.exit_code) == (r.status, r.exit_code) and "SyntaxError" in ran.stderr
    assert len(launched) == 1


def test_slow_but_correct_program_within_the_limit_passes(sandbox):
    r = run1(sandbox, "import time; time.sleep(0.8); print(input())", "slow")
    assert (r.status, r.stdout) == ("ok", "slow\n")


@pytest.mark.slow  # seconds of waiting on a timeout or a process: the full suite runs it
def test_infinite_loop_is_stopped_by_the_cpu_or_wall_limit(sandbox):
    t0 = time.monotonic()
    r = run1(sandbox, "while True: pass")
    assert r.status == "timeout"
    assert time.monotonic() - t0 < LIMITS.wall_seconds + 3


@pytest.mark.slow  # seconds of waiting on a timeout or a process: the full suite runs it
def test_sleeping_past_the_deadline_is_a_timeout(sandbox):
    t0 = time.monotonic()
    r = run1(sandbox, "import time; print('started', flush=True); time.sleep(60)")
    assert r.status == "timeout" and r.stdout == "started\n"
    assert LIMITS.wall_seconds <= r.seconds < LIMITS.wall_seconds + 0.5
    assert time.monotonic() - t0 < LIMITS.wall_seconds + 3


@pytest.mark.slow  # 2 s of the pids limit at work: the full suite runs it
def test_fork_bomb_is_contained_and_the_next_program_runs(sandbox):
    r = run1(sandbox, """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """)
    assert r.status == "timeout"
    assert run1(sandbox, "print(6 * 7)").stdout == "42\n"


def test_memory_bomb_hits_the_address_space_limit(sandbox):
    r = run1(sandbox, "x = bytearray(8 * 1024 ** 3)\nprint('allocated')")
    assert r.status == "memory_limit" and "allocated" not in r.stdout
    r = run1(sandbox, "chunks = []\nwhile True: chunks.append(b'x' * (1 << 24))")
    assert r.status == "memory_limit"


def test_huge_file_hits_the_file_size_limit(sandbox):
    r = run1(sandbox, "with open('big', 'wb') as f:\n    while True: f.write(b'0' * (1 << 20))")
    assert r.status == "file_size_limit"


def test_printing_gigabytes_stops_at_the_output_limit(sandbox):
    t0 = time.monotonic()
    r = run1(sandbox, "import sys\nwhile True: sys.stdout.write('x' * 65536)")
    assert r.status == "output_limit"
    assert len(r.stdout) <= LIMITS.output_bytes
    assert time.monotonic() - t0 < 2  # stopped when the limit was hit, not at the deadline
    r = run1(sandbox, "import sys\nwhile True: sys.stderr.write('y' * 65536)")
    assert r.status == "output_limit" and len(r.stderr) <= 4096


def test_writing_outside_its_directory_reaches_nothing_on_the_host(sandbox, tmp_path):
    target = tmp_path / "open"
    target.mkdir()
    target.chmod(0o777)  # only the sandbox's own root keeps the program out, not permissions
    escape = f"/tmp/areal_flow_escape_{uuid.uuid4().hex}"
    r = run1(sandbox, f"""
        import os
        for path in ({str(target / 'x')!r}, {escape!r}, '/usr/x', '/x', '/etc/x'):
            try:
                with open(path, 'w') as f:
                    f.write('pwned')
                print('wrote', path)
            except OSError as e:
                print('refused', path, type(e).__name__)
    """)
    assert r.status == "ok"
    assert f"refused {target / 'x'}" in r.stdout and "refused /usr/x" in r.stdout and "refused /x" in r.stdout
    assert not (target / "x").exists() and not os.path.exists(escape)  # /tmp inside is a tmpfs of its own
    assert list(target.iterdir()) == []


def test_reading_files_outside_it_finds_nothing(sandbox, tmp_path):
    secret = uuid.uuid4().hex
    public = tmp_path / "public.txt"
    public.write_text(secret)
    public.chmod(0o644)
    tmp_path.chmod(0o755)
    home = os.path.join(os.path.expanduser("~"), f".areal_flow_test_secret_{secret[:8]}")
    with open(home, "w") as f:
        f.write(secret)
    try:
        r = run1(sandbox, f"""
            for path in ({str(public)!r}, {home!r}, '/etc/shadow', '/etc/passwd'):
                try:
                    print(open(path).read())
                except OSError as e:
                    print('refused', path, type(e).__name__)
        """)
    finally:
        os.unlink(home)
    assert r.status == "ok"
    assert secret not in r.stdout
    assert r.stdout.count("refused") == 4


def test_connecting_to_a_local_listener_reaches_nothing(sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    r = run1(sandbox, f"""
        import socket
        for host in ('127.0.0.1', 'localhost', '0.0.0.0'):
            try:
                s = socket.create_connection((host, {port}), timeout=1)
                s.sendall(b'stolen')
                print('connected', host)
            except OSError as e:
                print('refused', host, type(e).__name__)
    """)
    with pytest.raises(socket.timeout):
        listener.accept()  # the listener saw nothing
    listener.close()
    assert r.status == "ok" and "connected" not in r.stdout


def test_closing_or_hijacking_stdio_only_fails_its_own_test(sandbox):
    r = run1(sandbox, "import os\nos.close(0)\nos.close(1)\nos.close(2)\n")
    assert r.status == "ok" and r.stdout == ""
    # The init's own stdout carries the result to the host: the program cannot reach it.
    forged = '{"cases": [{"status": "ok", "stdout": "FORGED"}]}'
    r = run1(sandbox, f"""
        import os
        for path in ('/proc/1/fd/1', '/proc/1/fd/0', '/dev/tty'):
            try:
                with open(path, 'w') as f:
                    f.write({forged!r})
                print('opened', path)
            except OSError as e:
                print('refused', path, type(e).__name__)
    """)
    assert r.status == "ok" and "FORGED" not in r.stdout and "opened" not in r.stdout


def test_a_daemon_left_behind_is_killed_with_its_case(sandbox, tmp_path):
    r = run1(sandbox, """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(30)
                os._exit(0)
            os._exit(0)
        print('parent done')
    """)
    assert (r.status, r.stdout) == ("ok", "parent done\n")
    # The fixture checks that no process of the sandbox's uid is left on the host.


# ---- programs that attack other processes: run inside a PID namespace of the test's own ----------

CONTAIN = r"""
import ctypes, os, sys
if ctypes.CDLL(None, use_errno=True).unshare(0x20000000) != 0:  # CLONE_NEWPID
    sys.exit("cannot make the test's PID namespace")
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status) & 0xFF)
"""

DRIVER = r"""
import json, os, subprocess, sys, time
from areal_flow.config.schema import SandboxConfig
from areal_flow.sandbox.local import Sandbox

uid = int(sys.argv[1])
def as_uid():
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
# Sentinels: a root process and one of the very uid the program runs as (what kill(-1) from that
# uid would reach if the sandbox had no PID namespace of its own).
root_sentinel = subprocess.Popen(["sleep", "120"])
uid_sentinel = subprocess.Popen(["sleep", "120"], preexec_fn=as_uid)
box = Sandbox(SandboxConfig(wall_seconds=2.0, cpu_seconds=2), uid=uid)
program = sys.stdin.read()
results = box.run(program, [""])
time.sleep(0.2)
alive = [p.poll() is None for p in (root_sentinel, uid_sentinel)]
print(json.dumps({"status": results[0].status, "stdout": results[0].stdout, "alive": alive,
                  "after": box.run("print('still works')", [""])[0].stdout}))
"""


def run_contained(program: str, tmp_path) -> dict:
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    uid = 1_400_000_000 + os.getpid()
    proc = subprocess.run([sys.executable, "-c", CONTAIN, str(driver), str(uid)], input=textwrap.dedent(program),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert processes_of(uid) == []
    return json.loads(proc.stdout)


@pytest.mark.parametrize("attack", [
    "os.kill(-1, signal.SIGKILL)",
    "os.kill(os.getppid(), signal.SIGKILL); os.kill(1, signal.SIGKILL)",
    "[os.kill(int(p), signal.SIGKILL) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]",
    "os.killpg(0, signal.SIGKILL)",
])
def test_killing_other_processes_reaches_none_of_them(attack, tmp_path):
    program = f"""
        import os, signal
        print('attacking', flush=True)
        try:
            {attack}
        except OSError as e:
            print('refused', type(e).__name__)
        print('survived')
    """
    out = run_contained(program, tmp_path)
    assert out["alive"] == [True, True], f"{attack} killed a process outside the sandbox"
    assert out["after"] == "still works\n"
    assert out["stdout"].startswith("attacking\n")


def test_without_namespaces_the_sandbox_refuses_unless_opted_in(tmp_path):
    # Drop CAP_SYS_ADMIN from the bounding set before exec: the process is root without the
    # capability namespaces need, as on a machine that cannot make them.
    def drop_sys_admin():
        ctypes.CDLL(None, use_errno=True).prctl(24, 21, 0, 0, 0)  # PR_CAPBSET_DROP, CAP_SYS_ADMIN

    script = r"""
import json, sys, logging
from areal_flow.config.schema import SandboxConfig
from areal_flow.sandbox.local import Sandbox, SandboxUnavailable
logging.basicConfig(level=logging.WARNING)
try:
    Sandbox(SandboxConfig(wall_seconds=2.0)).isolation()
    print(json.dumps({"refused": False}))
except SandboxUnavailable as e:
    print(json.dumps({"refused": True, "message": str(e)}))
# Opting in: limits and a uid of its own only; the program needs an interpreter every uid can run.
box = Sandbox(SandboxConfig(wall_seconds=2.0, python=sys.argv[1], allow_unsandboxed=True))
iso = box.isolation()
r = box.run("import os; print(os.getuid())", [""])[0]
# A checked run too: the program's process and its checker, each a session of its own, both ended.
from areal_flow.data.input_output import parse_tests
from areal_flow.rewards.code import score_program
calls = parse_tests({"inputs": [[1], [2]], "outputs": [2, 4], "fn_name": "f"})
checked = [score_program(box, p, calls)["reward"] for p in ("def f(x):\n    return 2 * x\n", "def f(x):\n    return x\n")]
print(json.dumps({"pid_namespace": iso.pid_namespace, "status": r.status, "uid": r.stdout.strip(),
                  "box_uid": box.uid, "checked": checked}))
"""
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.skip("no system interpreter that an unprivileged uid can run")
    proc = subprocess.run([sys.executable, "-c", script, python], capture_output=True, text=True, timeout=60,
                          preexec_fn=drop_sys_admin)
    assert proc.returncode == 0, proc.stderr
    refused, opted = map(json.loads, proc.stdout.splitlines())
    assert refused["refused"] and "sandbox.allow_unsandboxed" in refused["message"]
    assert "CAP_SYS_ADMIN" in refused["message"]
    assert "WITHOUT NAMESPACES" in proc.stderr  # said loudly
    assert opted == {"pid_namespace": False, "status": "ok", "uid": str(opted["box_uid"]), "box_uid": opted["box_uid"],
                     "checked": [1.0, 0.0]}


@pytest.mark.slow  # 1.4-2.3 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_the_host_deadline_kills_an_init_that_hangs(monkeypatch, tmp_path):
    # A job whose cases never end (wall limit far beyond the host's deadline): the host gives up
    # at its own deadline and kills the whole group.
    box = Sandbox(SandboxConfig(wall_seconds=30.0, cpu_seconds=30))
    monkeypatch.setattr("areal_flow.sandbox.local.HOST_SLACK", -29.0)
    t0 = time.monotonic()
    (r,) = box.run("import time; time.sleep(60)", [""])
    assert r.status == "sandbox_error" and "did not finish" in r.stderr
    assert time.monotonic() - t0 < 10
    # Killing the init is immediate; the kernel tears its namespace down right after.
    assert wait_until_gone(box.uid) == []
    # The next program gets a new init.
    monkeypatch.setattr("areal_flow.sandbox.local.HOST_SLACK", 10.0)
    assert [(r.status, r.stdout) for r in box.run("print(input())", ["again"])] == [("ok", "again\n")]
    box.close()


def test_a_killed_worker_takes_its_sandbox_down():
    # The reward worker dies mid-run: PR_SET_PDEATHSIG kills the init, and with it its namespace.
    uid = 1_300_000_000 + os.getpid()
    # The first run probes the isolation with a program of the same uid that exits at once: the
    # worker says when that is over, so the process looked for below is the sleeping one.
    script = ("from areal_flow.config.schema import SandboxConfig\nfrom areal_flow.sandbox.local import Sandbox\n"
              f"box = Sandbox(SandboxConfig(wall_seconds=60, cpu_seconds=60), uid={uid})\nbox.isolation()\n"
              "print('probed', flush=True)\nbox.run('import time; time.sleep(60)', [''])\n")
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline() == "probed\n", "the worker died before its first program"
    deadline = time.monotonic() + 20
    while not processes_of(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_of(uid), "the program never started"
    roots = glob.glob(os.path.join(tempfile.gettempdir(), f"{ROOT_PREFIX}{worker.pid}_*"))
    assert len(roots) == 1, roots  # the running job's
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    assert wait_until_gone(uid) == []
    # The dead worker could not remove its job's root; the next sandbox to start does.
    assert os.path.isdir(roots[0])
    box = Sandbox(LIMITS)
    try:
        assert [r.status for r in box.run("print(1)", [""])] == ["ok"]
    finally:
        box.close()
    assert not os.path.exists(roots[0])
