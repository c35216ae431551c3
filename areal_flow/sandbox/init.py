"""The inside of the code sandbox: runs as a script (`python -I -S init.py FD`), stdlib only.

It is resident, one per sandbox: it reads a setup frame and then jobs on stdin, and writes one reply
per job on stdout, each a marshalled value behind an 8-byte length. As root it moves into new PID,
network, mount, IPC and UTS namespaces once and forks PID 1 of the new PID namespace, which builds a
root of its own (a tmpfs holding read-only binds of the interpreter's directories, a fresh /proc,
/dev/null and friends), chroots into it and serves the jobs (`serve`).

PID 1 never reads a job. For each job it forks a job process before the job comes (`_one_job`),
which mounts a new size-limited /tmp and /sandbox, reads the job and runs each test case as a
process forked from itself that drops to an unprivileged uid, with resource limits, a scrubbed
environment and no descriptors but its own, and runs the program in this interpreter
(`_run_script`): started, and with what programs often use imported (PREIMPORTED), once. So a
program costs a fork, not an interpreter's start, and nothing a program must not see is ever in the
process it is forked from: another job's data never (each job has a process of its own), expected
outputs never (the host compares the outputs returned), and a checked job's tests only after the
program is forked (they come on descriptor FD, `_secret`). A job whose program is for another
interpreter (sandbox.python) executes that one instead.

After each case the job process kills every process left in the namespace but PID 1 and itself (a
daemon the program left behind) and reaps it, before the reply; when PID 1 exits the kernel kills
whatever remains. See docs/rewards.md for the limits and what each isolation layer stops.
"""

import atexit
import builtins
import ctypes
import fcntl
import io
import marshal
import struct
import os
import resource
import select
import shutil
import sys
import time
import traceback
import types

# What programs often import, imported once here so that a forked program need not: the checked
# runs' harness needs json; the rest is what solutions to contest problems use.
# Not threading: its hook after each fork costs more than its import.
PREIMPORTED = ("json", "collections", "itertools", "functools", "math", "heapq", "bisect", "re", "string")
for _name in PREIMPORTED:
    __import__(_name)

# Start-up is paid again whenever the host restarts this server (after a job outran the host's
# deadline): json, selectors and signal would add about 30 ms (they pull in re and enum), so jobs
# and results travel as marshal (the host runs this same interpreter) and the signals are numbers.
SIGKILL, SIGXCPU, SIGXFSZ = 9, 24, 25

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
MNT_DETACH = 2
PR_SET_CHILD_SUBREAPER = 36
DEVICES = ("null", "zero", "random", "urandom")
NO_MORE_JOBS = 3  # a job process's exit code when the host closed stdin
WRITABLE = {"/tmp": "1777", "/sandbox": "700"}  # the writable directories, new for each job
STDERR_KEEP = 4096  # the tail of stderr returned per case, for the reader of a failure

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source or fstype} on {target}")


def _bind_readonly(path: str, root: str) -> None:
    """Show `path` at the same place under `root`, read-only; a symlink is recreated as one."""
    target = root + path
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(path):
        if not os.path.lexists(target):
            os.symlink(os.readlink(path), target)
        return
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        open(target, "a").close()
    _mount(path, target, None, MS_BIND | MS_REC)
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build_root(root: str, ro_paths: list) -> None:
    """The filesystem programs see: nothing of the host but the read-only paths they need."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in ro_paths:
        if os.path.lexists(path):
            _bind_readonly(path, root)
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/dev")
    for dev in DEVICES:
        open(f"{root}/dev/{dev}", "a").close()
        _mount(f"/dev/{dev}", f"{root}/dev/{dev}", None, MS_BIND)
    for path in WRITABLE:
        os.makedirs(root + path)
    os.chroot(root)
    os.chdir("/")
    # No System V IPC object or POSIX message queue can be made: they would outlive the job that
    # made them in this IPC namespace, which every job of the sandbox shares.
    for key, value in (("kernel/shmmni", "0"), ("kernel/msgmni", "0"), ("kernel/sem", "250 32000 32 0"),
                       ("fs/mqueue/queues_max", "0")):
        with open(f"/proc/sys/{key}", "w") as f:
            f.write(value)


def fresh_dirs(setup: dict) -> None:
    """A new, empty /tmp and /sandbox for the next job (size-limited tmpfs, the programs' uid's):
    nothing a job wrote reaches the next."""
    uid, disk = setup["uid"], f"size={setup['disk_mb']}m"
    for path, mode in WRITABLE.items():
        libc.umount2(path.encode(), MNT_DETACH)  # the last job's, if any
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"{disk},mode={mode},uid={uid},gid={uid}")


def write_files(job: dict, workdir: str) -> None:
    """The program and the harness, read-only for the program, in its working directory."""
    if os.geteuid() == 0:
        os.chown(workdir, job["uid"], job["uid"])
    os.chmod(workdir, 0o700)
    for name, text in (("solution.py", job["program"]), ("harness.py", job["harness"] or "")):
        path = os.path.join(workdir, name)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o444)


def _limits(lim: dict) -> None:
    mib = 1024 * 1024
    for which, value in ((resource.RLIMIT_CPU, (lim["cpu_seconds"], lim["cpu_seconds"] + 1)),
                         (resource.RLIMIT_AS, (lim["memory_mb"] * mib,) * 2),
                         (resource.RLIMIT_FSIZE, (lim["file_size_mb"] * mib,) * 2),
                         (resource.RLIMIT_NPROC, (lim["processes"],) * 2),
                         (resource.RLIMIT_NOFILE, (lim["open_files"],) * 2),
                         (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(which, value)


def _arrange(fds: dict) -> None:
    """Make each target descriptor a copy of its source, and close every other."""
    high = {target: fcntl.fcntl(source, fcntl.F_DUPFD, 256) for target, source in fds.items()}  # out of the way
    for target, copy in high.items():
        os.dup2(copy, target)
    os.closerange(max(fds) + 1, 65536)  # the copies above included


def _become(uid: int, lim: dict) -> None:
    """Drop to `uid` (as root), under the limits, in a session of its own that dies with us."""
    os.setsid()
    _limits(lim)
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)  # after the uid change, which clears it


def _exec_case(job: dict, workdir: str, fds: dict, ready: tuple | None) -> None:
    """In the forked child: become the program, with descriptors `fds` (target: source), and run it:
    forked (`ready` from `_ready`) or executed. Never returns."""
    try:
        _arrange(fds)
        os.chdir(workdir)
        _become(job["uid"], job["limits"])
        script = "solution.py" if job["harness"] is None else "harness.py"
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
               "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1"}
        if ready is not None:
            _run_script(os.path.join(workdir, script), env, *ready)
        argv = [job["python"], *job["python_args"], script]
        os.execve(argv[0], argv, env)
    except BaseException as e:  # noqa: BLE001 - report anything, then die without running cleanup
        os.write(2, f"sandbox: could not start the program: {e}\n".encode())
    os._exit(127)


def _ready(job: dict, workdir: str) -> tuple | None:
    """What each case's forked program needs that can be made once, before the forks: its code and
    its standard streams (on descriptors 0-2, which are the case's once it is forked). Compiling here
    spares each case's process the compiler's allocations, each page of which copy-on-write makes
    a slow fault (1.2 of 1.3 ms for print(1+2)). None where the program is for another interpreter."""
    if not job["fork"]:
        return None
    path = os.path.join(workdir, "solution.py" if job["harness"] is None else "harness.py")
    code = job["code"]  # compiled by the host where it could
    if code is None:
        try:
            code = compile(job["harness"] or job["program"], path, "exec", dont_inherit=True)
        except BaseException:  # noqa: BLE001 - its own process compiles it again and says why, as the interpreter would
            pass
    size = io.DEFAULT_BUFFER_SIZE  # given: the descriptors are not the case's yet
    streams = (io.open(0, "r", size, encoding="utf-8", closefd=False),
               io.open(1, "w", size, encoding="utf-8", closefd=False),
               io.TextIOWrapper(io.open(2, "wb", size, closefd=False), encoding="utf-8", errors="backslashreplace",
                                line_buffering=True))
    return code, streams


def _run_script(path: str, env: dict, code, streams: tuple) -> None:
    """Run the script at `path` (compiled: `code`, or None) as `python -I -S path` would, in this
    process (forked for it, already the program's uid). Never returns."""
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # as an exec would: the uid change cleared it
    os.environ.clear()
    os.environ.update(env)
    sys.argv, sys.path[0] = [path], os.path.dirname(path)
    sys.stdin, sys.stdout, sys.stderr = streams
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    sys.setrecursionlimit(sys.getrecursionlimit() + depth)  # the program gets the whole default depth
    main = types.ModuleType("__main__")
    main.__file__, main.__builtins__ = path, builtins
    sys.modules["__main__"] = main
    status = 0
    try:
        if code is None:
            with open(path) as f:
                code = compile(f.read(), path, "exec", dont_inherit=True)
        exec(code, main.__dict__)
    except SystemExit as e:
        status = _exit_code(e)
    except BaseException as e:  # noqa: BLE001 - what the interpreter prints for an uncaught exception
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        status = 1
    os._exit(_shut_down(status))


def _exit_code(e: SystemExit) -> int:
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def _shut_down(code: int) -> int:
    """What the interpreter does at exit: wait for the program's threads, run its atexit functions,
    flush its output (120 where that fails, as the interpreter does)."""
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()
        atexit._run_exitfuncs()
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001
            code = 120
    return code


def _run_checker(checker: dict, lim: dict, fds: dict) -> None:
    """In the forked child: become the checker (its own uid; stdout its reports, 3 and 4 the pipes to
    the program) and run its source's main(job). Never returns. It is this process forked, not a new
    interpreter: it may hold the tests, which the program's process never does. Its source runs (its
    imports) before the uid changes: unsandboxed, the interpreter's own files may be root's only."""
    try:
        _arrange(fds)
        os.chdir("/")
        scope = {"__name__": "checker"}
        exec(compile(checker["source"], "checker", "exec"), scope)
        _become(checker["uid"], lim)
        scope["main"](checker["job"])
    except BaseException as e:  # noqa: BLE001 - the tests it did not report are the host's to settle
        os.write(2, f"sandbox: the checker failed: {type(e).__name__}: {e}\n".encode())
    os._exit(0)


def _kill_all_but_me(isolated: bool, *pgids: int) -> None:
    """Kill what the case left running: in our own PID namespace that is everything but us (and PID 1),
    else the process groups (sessions) the case's processes lead."""
    for pgid in (-1,) if isolated else pgids:
        try:
            os.kill(pgid, SIGKILL) if isolated else os.killpg(pgid, SIGKILL)
        except ProcessLookupError:
            pass
    while True:  # reap the case and every orphan the kernel handed to us
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def _memfd(text: str) -> int:
    """A file holding `text`, at its start: a program that never reads it cannot block us."""
    fd = os.memfd_create("stdin")
    os.write(fd, text.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _watch(out_r: int, err_r: int, pid: int, deadline: float, lim: dict) -> tuple:
    """Read stdout and stderr until `pid` exits, the deadline passes or an output limit is crossed:
    (stdout, the stderr's tail, status or None)."""
    pidfd = os.pidfd_open(pid)  # readable once the child exits
    poll = select.poll()
    for fd in (out_r, err_r):
        os.set_blocking(fd, False)
        poll.register(fd, select.POLLIN)
    poll.register(pidfd, select.POLLIN)
    out, err, status, exited, err_seen = bytearray(), bytearray(), None, False, 0
    while status is None:
        left = deadline - time.monotonic()
        if left <= 0:
            status = "timeout"
            break
        for fd, _ in poll.poll(left * 1000):
            if fd == pidfd:
                exited = True
                continue
            chunk = _read(fd)
            if chunk is None:
                continue
            if not chunk:
                poll.unregister(fd)
                continue
            if fd == out_r:
                out += chunk
                if len(out) > lim["output_bytes"]:
                    status = "output_limit"
            else:
                err += chunk
                err_seen += len(chunk)
                if err_seen > lim["output_bytes"]:
                    status = "output_limit"
                if len(err) > 2 * STDERR_KEEP:
                    del err[:-STDERR_KEEP]  # only the tail is reported
        if exited:
            # A daemon may hold the pipes open: take what is there now, then stop waiting.
            for fd, buf in ((out_r, out), (err_r, err)):
                while (chunk := _read(fd)):
                    buf += chunk
            break
    os.close(pidfd)
    return out, err, status


def _status(code: int, err: bytes) -> str:
    """What a program's exit code (and its stderr's tail) say happened to it."""
    if code == 0:
        return "ok"
    if code in (-SIGXCPU, -SIGKILL):
        return "timeout"  # the CPU limit: SIGXCPU at the soft limit, SIGKILL at the hard one
    if code == -SIGXFSZ or b"File too large" in err[-STDERR_KEEP:]:
        return "file_size_limit"  # Python ignores SIGXFSZ, so the write fails with EFBIG
    if b"No space left on device" in err[-STDERR_KEEP:]:
        return "disk_limit"
    if b"MemoryError" in err[-STDERR_KEEP:]:
        return "memory_limit"
    return "runtime_error"


def _result(status, code, seconds, out: bytes, err: bytes, lim: dict) -> dict:
    return {"status": status, "exit_code": code, "seconds": round(seconds, 4),
            "stdout": out[: lim["output_bytes"]].decode("utf-8", "replace"),
            "stderr": err[-STDERR_KEEP:].decode("utf-8", "replace")}


def run_case(job: dict, workdir: str, stdin_text: str, isolated: bool, ready: tuple | None) -> dict:
    lim = job["limits"]
    stdin_fd = _memfd(stdin_text)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _exec_case(job, workdir, {0: stdin_fd, 1: out_w, 2: err_w}, ready)
    for fd in (stdin_fd, out_w, err_w):
        os.close(fd)
    out, err, status = _watch(out_r, err_r, pid, start + lim["wall_seconds"], lim)
    seconds = time.monotonic() - start
    try:
        os.kill(pid, SIGKILL)
    except ProcessLookupError:
        pass
    _, wait_status = os.waitpid(pid, 0)
    _kill_all_but_me(isolated, pid)
    for fd in (out_r, err_r):
        os.close(fd)
    code = os.waitstatus_to_exitcode(wait_status)
    return _result(status or _status(code, err), code, seconds, out, err, lim)


def run_checked(job: dict, workdir: str, isolated: bool, ready: tuple | None) -> dict:
    """The program (job["harness"] answering calls) beside its checker: the checker's reports as
    stdout, the program's status and stderr (its prints included). The case ends when the checker does."""
    lim = job["limits"]
    calls_r, calls_w = os.pipe()  # checker -> program
    replies_r, replies_w = os.pipe()  # program -> checker
    out_r, out_w = os.pipe()  # the checker's reports
    err_r, err_w = os.pipe()  # the program's stdout and stderr
    stdin_fd, null = _memfd(""), os.open("/dev/null", os.O_RDWR)
    start = time.monotonic()
    program = os.fork()
    if program == 0:
        _exec_case(job, workdir, {0: stdin_fd, 1: err_w, 2: err_w, 3: calls_r, 4: replies_w}, ready)
    tests = dict(job["checker"], job=_secret(job["checker"]["id"]))  # read only now that the program is forked
    checker = os.fork()
    if checker == 0:
        _run_checker(tests, lim, {0: null, 1: out_w, 2: null, 3: calls_w, 4: replies_r})
    del tests
    for fd in (calls_r, calls_w, replies_r, replies_w, out_w, err_w, stdin_fd, null):
        os.close(fd)
    out, err, status = _watch(out_r, err_r, checker, start + lim["wall_seconds"], lim)
    seconds = time.monotonic() - start
    code = None
    if status is None:  # the checker is done: a program that ended under it has a moment to be reaped
        for _ in range(20):
            pid, wait_status = os.waitpid(program, os.WNOHANG)
            if pid:
                code = os.waitstatus_to_exitcode(wait_status)
                status = _status(code, err)
                break
            time.sleep(0.005)
        else:
            status = "ok"  # still answering calls when the checks ended
    _kill_all_but_me(isolated, program, checker)
    for fd in (out_r, err_r):
        os.close(fd)
    return _result(status, code, seconds, out, err, lim)


def _secret(job_id: int):
    """The tests of checked job `job_id`, from the descriptor only a job's PID 1 reads (argv[1]): frames of
    jobs that ended before reading theirs are passed over."""
    while True:
        frame = _read_frame(SECRETS)
        if frame is None:
            raise OSError("the host closed the tests' channel")
        if frame["id"] == job_id:
            return frame["job"]


def _read(fd: int) -> bytes | None:
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return None


def run_cases(job: dict, workdir: str, isolated: bool) -> list[dict]:
    write_files(job, workdir)
    ready = _ready(job, workdir)
    if job["checker"] is not None:
        return [run_checked(job, workdir, isolated, ready)]
    results = []
    for stdin_text in job["inputs"]:
        results.append(run_case(job, workdir, stdin_text, isolated, ready))
        if job["fail_fast"] and results[-1]["status"] != "ok":
            break
    return results


def serve(setup: dict, isolation: dict, failed: str | None = None) -> None:
    """Serve jobs until the host closes stdin: as PID 1 of the sandbox's namespaces, chrooted into its
    root, where `isolation` has them. Each job is read and run by a child forked for it before the
    job comes (`_one_job`), and programs are forked from that child: so no job's data (programs,
    inputs, outputs, tests) is ever in a process that a later job's program is forked from."""
    isolated = isolation["pid_namespace"]
    if failed is None:  # else each job is answered with it
        try:
            if isolated:
                build_root(setup["root"], setup["ro_paths"])
            else:
                os.chmod(setup["root"], 0o711)  # each job's directory in it is its uid's alone
        except OSError as e:
            failed = f"sandbox setup failed: {e}"
    last = None
    while True:
        done_r, done_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(done_r)
            os._exit(_one_job(setup, isolation, failed, done_w))
        os.close(done_w)
        if last is not None:
            os.waitpid(last, 0)  # the last job's process, which exits right after its reply
        last = pid
        said = os.read(done_r, 1)  # once its processes are gone: the next job process starts meanwhile
        os.close(done_r)
        if said == bytes([NO_MORE_JOBS]):
            return
        if not said:  # it died mid-job: what it left goes too
            os.waitpid(pid, 0)
            if isolated:
                _kill_all_but_me(True)
            _write_frame(1, {"isolation": isolation, "error": "the sandbox's job process died"})
            last = None


def _one_job(setup: dict, isolation: dict, failed: str | None, done: int) -> int:
    """In the child forked for the next job: read it, run it, say on `done` that its processes are
    gone, write its reply. The exit code."""
    libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # what the job's processes leave is ours to reap
    isolated = isolation["pid_namespace"]
    workdir = "/sandbox" if isolated else os.path.join(setup["root"], f"job{os.getpid()}")
    try:
        if failed is None:  # ready before the job comes
            fresh_dirs(setup) if isolated else os.mkdir(workdir)
    except OSError as e:
        failed = f"sandbox setup failed: {e}"
    job = _read_frame(0)
    if job is None:
        os.write(done, bytes([NO_MORE_JOBS]))
        return NO_MORE_JOBS
    try:
        if failed is not None:
            raise OSError(failed)
        reply = {"cases": run_cases(job, workdir, isolated)}
    except BaseException as e:  # noqa: BLE001 - a reply, whatever went wrong
        reply = {"error": str(e) if failed is not None else f"the sandbox could not run the job: {e}"}
    if not isolated:
        shutil.rmtree(workdir, ignore_errors=True)
    os.write(done, b"\0")
    _write_frame(1, {"isolation": isolation, **reply})
    return 0


def _read_exactly(n: int, fd: int = 0) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _read_frame(fd: int):
    """The next marshalled value behind its 8-byte length, or None at the end of input."""
    header = _read_exactly(8, fd)
    return None if header is None else marshal.loads(_read_exactly(struct.unpack("<Q", header)[0], fd))


def _write_frame(fd: int, value) -> None:
    data = marshal.dumps(value)
    view = memoryview(struct.pack("<Q", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def main() -> None:
    """Read the setup frame (root, ro_paths, isolate), make the namespaces, and serve jobs in them
    (as PID 1, forked: the namespaces die with it, and it dies with us)."""
    libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)  # the host's worker died: so do we
    setup = _read_frame(0)
    isolation = {"pid_namespace": False, "network_namespace": False, "mount_namespace": False,
                 "unprivileged_user": os.geteuid() == 0, "rlimits": True}
    if not setup["isolate"]:  # opted out of isolation: a directory of its own, the uid and the limits
        serve(setup, isolation)
        return
    try:
        _check(libc.unshare(CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    except OSError as e:
        serve(setup, isolation, f"namespaces unavailable ({e.strerror}; they need root or CAP_SYS_ADMIN)")
        return
    isolation.update(pid_namespace=True, network_namespace=True, mount_namespace=True)
    pid = os.fork()
    if pid == 0:
        libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
        serve(setup, isolation)
        os._exit(0)
    os.waitpid(pid, 0)


if __name__ == "__main__":
    SECRETS = int(sys.argv[1])  # the checked jobs' tests: never read here, only by a job's process
    main()
