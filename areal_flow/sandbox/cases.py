"""A job's test cases in the code sandbox, run by the job process (areal_flow/sandbox/init.py): each
case's process forked (areal_flow/sandbox/program.py makes it the program), read until it exits, its
deadline passes or its output passes the limit, and everything it left killed; a checked job's
program beside its checker. Stdlib only: the init imports it from beside itself.
"""

import os
import select
import time

import program  # beside this file: the init puts its directory on sys.path while it imports us

SIGKILL, SIGXCPU, SIGXFSZ = 9, 24, 25
STDERR_KEEP = 4096  # the tail of stderr returned per case, for the reader of a failure


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


def kill_all_but_me(isolated: bool, *pgids: int) -> None:
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
        program.exec_case(job, workdir, {0: stdin_fd, 1: out_w, 2: err_w}, ready)
    for fd in (stdin_fd, out_w, err_w):
        os.close(fd)
    out, err, status = _watch(out_r, err_r, pid, start + lim["wall_seconds"], lim)
    seconds = time.monotonic() - start
    try:
        os.kill(pid, SIGKILL)
    except ProcessLookupError:
        pass
    _, wait_status = os.waitpid(pid, 0)
    kill_all_but_me(isolated, pid)
    for fd in (out_r, err_r):
        os.close(fd)
    code = os.waitstatus_to_exitcode(wait_status)
    return _result(status or _status(code, err), code, seconds, out, err, lim)


def run_checked(job: dict, workdir: str, isolated: bool, ready: tuple | None, secret) -> dict:
    """The program (job["harness"] answering calls) beside its checker, which gets the tests that
    `secret()` reads once the program is forked: the checker's reports as stdout, the program's
    status and stderr (its prints included). The case ends when the checker does."""
    lim = job["limits"]
    calls_r, calls_w = os.pipe()  # checker -> program
    replies_r, replies_w = os.pipe()  # program -> checker
    out_r, out_w = os.pipe()  # the checker's reports
    err_r, err_w = os.pipe()  # the program's stdout and stderr
    stdin_fd, null = _memfd(""), os.open("/dev/null", os.O_RDWR)
    start = time.monotonic()
    solver = os.fork()
    if solver == 0:
        program.exec_case(job, workdir, {0: stdin_fd, 1: err_w, 2: err_w, 3: calls_r, 4: replies_w}, ready)
    tests = dict(job["checker"], job=secret())  # read only now that the program is forked
    checker = os.fork()
    if checker == 0:
        program.run_checker(tests, lim, {0: null, 1: out_w, 2: null, 3: calls_w, 4: replies_r})
    del tests
    for fd in (calls_r, calls_w, replies_r, replies_w, out_w, err_w, stdin_fd, null):
        os.close(fd)
    out, err, status = _watch(out_r, err_r, checker, start + lim["wall_seconds"], lim)
    seconds = time.monotonic() - start
    code = None
    if status is None:  # the checker is done: a program that ended under it has a moment to be reaped
        for _ in range(20):
            pid, wait_status = os.waitpid(solver, os.WNOHANG)
            if pid:
                code = os.waitstatus_to_exitcode(wait_status)
                status = _status(code, err)
                break
            time.sleep(0.005)
        else:
            status = "ok"  # still answering calls when the checks ended
    kill_all_but_me(isolated, solver, checker)
    for fd in (out_r, err_r):
        os.close(fd)
    return _result(status, code, seconds, out, err, lim)


def _read(fd: int) -> bytes | None:
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return None


def run_cases(job: dict, workdir: str, isolated: bool, secret) -> list[dict]:
    """The job's cases' results; `secret()` reads a checked job's tests (see run_checked)."""
    write_files(job, workdir)
    ready = program.ready(job, workdir)
    if job["checker"] is not None:
        return [run_checked(job, workdir, isolated, ready, secret)]
    results = []
    for stdin_text in job["inputs"]:
        results.append(run_case(job, workdir, stdin_text, isolated, ready))
        if job["fail_fast"] and results[-1]["status"] != "ok":
            break
    return results
