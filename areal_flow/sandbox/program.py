"""The program's side of a test case in the code sandbox: what the process forked for a case (by the
job process, areal_flow/sandbox/cases.py) does to become the program and run it, and the checker's
process beside a checked program. Stdlib only: the init (areal_flow/sandbox/init.py) imports it from
beside itself.

The program runs in this interpreter, forked (`_run_script`): it started, and imported what programs
often use (PREIMPORTED), once; the host compiled the program. It runs as `python -I -S` would run it:
`__main__`, `sys.argv`, its own streams, threads joined and `atexit` run at exit, the exit code and
traceback the interpreter's.
"""

import atexit
import builtins
import ctypes
import fcntl
import io
import os
import resource
import sys
import traceback
import types

# What programs often import, imported once here so that a forked program need not: the checked
# runs' harness needs json; the rest is what solutions to contest problems use.
# Not threading: its hook after each fork costs more than its import.
PREIMPORTED = ("json", "collections", "itertools", "functools", "math", "heapq", "bisect", "re", "string")
for _name in PREIMPORTED:
    __import__(_name)

SIGKILL = 9
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38

libc = ctypes.CDLL(None, use_errno=True)


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


def exec_case(job: dict, workdir: str, fds: dict, ready: tuple | None) -> None:
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


def ready(job: dict, workdir: str) -> tuple | None:
    """What each case's forked program needs that can be made once, before the forks: its code (the
    host's, else compiled here) and its standard streams (on descriptors 0-2, which are the case's
    once it is forked). Compiling in each case's process would cost it a copy-on-write fault for each
    page the compiler writes (1.2 of 1.3 ms for print(1+2)). None where the program is for another
    interpreter."""
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


def run_checker(checker: dict, lim: dict, fds: dict) -> None:
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
