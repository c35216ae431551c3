"""The inside of the code sandbox: runs as a script (`python -I -S init.py`), stdlib only.

It is resident, one per reward worker: it reads jobs on stdin and writes one result per job on stdout,
each a marshalled dict behind an 8-byte length, so the interpreter starts and imports once per worker,
not once per program. Each job runs in a child forked for it. As root that child moves into new PID,
network, mount, IPC and UTS namespaces and forks again; the grandchild is PID 1 of the new PID
namespace. That child builds a root of its own (a tmpfs holding read-only binds of the interpreter's
directories, a fresh /proc, /dev/null and friends, and size-limited tmpfs /tmp and /sandbox),
chroots into it and runs each test case as a grandchild that drops to an unprivileged uid, with
resource limits, a scrubbed environment and no file descriptors but stdin/stdout/stderr.

After each case PID 1 sends SIGKILL to every process left in the namespace (a daemon the program
left behind), and when PID 1 exits the kernel kills whatever remains: nothing outlives the job, and no
job sees another's namespaces, files or processes.
Expected outputs never enter this process: the host compares the outputs it returns.
See docs/rewards.md for the limits and what each isolation layer stops.
"""

import ctypes
import fcntl
import marshal
import struct
import os
import resource
import select
import time

# Start-up is paid again whenever the host restarts this server (after a job outran the host's
# deadline): json, selectors and signal would add about 30 ms (they pull in re and enum), so jobs
# and results travel as marshal (the host runs this same interpreter) and the signals are numbers.
SIGKILL, SIGXCPU, SIGXFSZ = 9, 24, 25

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
DEVICES = ("null", "zero", "random", "urandom")
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


def build_root(job: dict) -> None:
    """The filesystem the program sees: nothing of the host but the read-only paths it needs."""
    root, uid, lim = job["root"], job["uid"], job["limits"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in job["ro_paths"]:
        if os.path.lexists(path):
            _bind_readonly(path, root)
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/dev")
    for dev in DEVICES:
        open(f"{root}/dev/{dev}", "a").close()
        _mount(f"/dev/{dev}", f"{root}/dev/{dev}", None, MS_BIND)
    disk = f"size={lim['disk_mb']}m"
    for path, mode in (("/tmp", "1777"), ("/sandbox", "700")):
        os.makedirs(root + path)
        _mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV, f"{disk},mode={mode},uid={uid},gid={uid}")
    os.chroot(root)
    os.chdir("/")


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


def _exec_case(job: dict, workdir: str, fds: dict) -> None:
    """In the forked child: become the program, with descriptors `fds` (target: source). Never returns."""
    try:
        _arrange(fds)
        os.chdir(workdir)
        _become(job["uid"], job["limits"])
        argv = [job["python"], *job["python_args"]]
        argv += ["solution.py"] if job["harness"] is None else ["harness.py"]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
               "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1"}
        os.execve(argv[0], argv, env)
    except BaseException as e:  # noqa: BLE001 - report anything, then die without running cleanup
        os.write(2, f"sandbox: could not start the program: {e}\n".encode())
    os._exit(127)


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
    """Kill what the case left running: in our own PID namespace that is everything but us, else the
    process groups (sessions) the case's processes lead."""
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


def run_case(job: dict, workdir: str, stdin_text: str, isolated: bool) -> dict:
    lim = job["limits"]
    stdin_fd = _memfd(stdin_text)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _exec_case(job, workdir, {0: stdin_fd, 1: out_w, 2: err_w})
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


def run_checked(job: dict, workdir: str, isolated: bool) -> dict:
    """The program (job["harness"] answering calls) beside its checker: the checker's reports as
    stdout, the program's status and stderr (its prints included). The case ends when the checker does."""
    lim = job["limits"]
    write_files(job, workdir)
    calls_r, calls_w = os.pipe()  # checker -> program
    replies_r, replies_w = os.pipe()  # program -> checker
    out_r, out_w = os.pipe()  # the checker's reports
    err_r, err_w = os.pipe()  # the program's stdout and stderr
    stdin_fd, null = _memfd(""), os.open("/dev/null", os.O_RDWR)
    start = time.monotonic()
    program = os.fork()
    if program == 0:
        _exec_case(job, workdir, {0: stdin_fd, 1: err_w, 2: err_w, 3: calls_r, 4: replies_w})
    checker = os.fork()
    if checker == 0:
        _run_checker(job["checker"], lim, {0: null, 1: out_w, 2: null, 3: calls_w, 4: replies_r})
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


def _read(fd: int) -> bytes | None:
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return None


def run_cases(job: dict, workdir: str, isolated: bool) -> list[dict]:
    if job["checker"] is not None:
        return [run_checked(job, workdir, isolated)]
    write_files(job, workdir)
    results = []
    for stdin_text in job["inputs"]:
        results.append(run_case(job, workdir, stdin_text, isolated))
        if job["fail_fast"] and results[-1]["status"] != "ok":
            break
    return results


def handle(job: dict) -> dict:
    """Run one job (in a process forked for it) and return the reply: its isolation, and its cases or
    an error."""
    isolation = {"pid_namespace": False, "network_namespace": False, "mount_namespace": False,
                 "unprivileged_user": os.geteuid() == 0, "rlimits": True}
    if not job["isolate"]:  # opted out of isolation: a directory of its own, the uid and the limits
        return {"isolation": isolation, "cases": run_cases(job, job["root"], isolated=False)}
    try:
        _check(libc.unshare(CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    except OSError as e:
        return {"isolation": isolation,
                "error": f"namespaces unavailable ({e.strerror}; they need root or CAP_SYS_ADMIN)"}
    isolation.update(pid_namespace=True, network_namespace=True, mount_namespace=True)
    return {"isolation": isolation, **_in_child(_in_namespace, job, "the namespace init died")}


def _in_namespace(job: dict) -> dict:
    """PID 1 of the job's namespaces."""
    try:
        build_root(job)
        return {"cases": run_cases(job, "/sandbox", isolated=True)}
    except OSError as e:
        return {"error": f"sandbox setup failed: {e}"}


def _in_child(fn, job: dict, died: str) -> dict:
    """fn(job) in a forked child that dies with us; its reply comes back through a pipe, so a child
    that dies mid-way costs this job only."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)
        try:
            reply = fn(job)
        except BaseException as e:  # noqa: BLE001 - a reply, whatever went wrong
            reply = {"error": f"{died}: {type(e).__name__}: {e}"}
        data = memoryview(marshal.dumps(reply))
        while data:
            data = data[os.write(w, data):]
        os._exit(0)
    os.close(w)
    chunks = []
    while (chunk := os.read(r, 1 << 16)):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    data = b"".join(chunks)
    try:
        return marshal.loads(data) if data else {"error": died}
    except (EOFError, ValueError, TypeError):
        return {"error": died}


def _read_exactly(n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(0, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def main() -> None:
    libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)  # the host's worker died: so do we
    while (header := _read_exactly(8)) is not None:
        job = marshal.loads(_read_exactly(struct.unpack("<Q", header)[0]))
        reply = marshal.dumps(_in_child(handle, job, "the sandbox's job process died"))
        data = memoryview(struct.pack("<Q", len(reply)) + reply)
        while data:
            data = data[os.write(1, data):]


if __name__ == "__main__":
    main()
