"""Assert-style tests in the code sandbox: a program and its checks run together, in one process.
Function-call tests (`input_output` with `fn_name`) run here too, each case a check that calls the
function and compares its JSON round trip with the expected value (`call_checks`).

The harness below runs as that process (sandbox.py's `script`, so with the sandbox's namespaces,
uid and limits). It loads the program from solution.py (as a module that is not __main__, its
prints sent to stderr), runs the setup, then each check in the program's namespace, each in its own
try/except under its own deadline (`wall_seconds`, a SIGALRM), and reports each on its real stdout as
a line `[nonce, i]` when the check starts and `[nonce, i, status, seconds, error]` when it ends
(i = -1: the program's own start). A failing assert is wrong_answer, any other exception
runtime_error (MemoryError memory_limit), the deadline timeout; with fail_fast the checks after a
crash or a timeout are reported not_run.

A program that outlives its deadline (it swallowed the exception: a bare `except:` in a loop) is
ended by a second alarm, its check reported timeout. One that kills its process mid-check (a
segfault, os._exit, the output or memory limit) leaves a check started but not ended: that check
gets the process's status, and the checks after it run again in a new process (or not_run, with
fail_fast). All the processes of one program share the time its tests would have had as cases,
wall_seconds × (checks + 1); what is left when that runs out is not_run.

The nonce keeps a program from passing by printing status lines (it would have to find the nonce in
the harness's memory): this contains a program, it does not make it honest.
"""

from __future__ import annotations

import json
import secrets

from areal_flow.data.input_output import AssertTests, Tests
from areal_flow.rewards.sandbox import CaseResult

LOAD = -1  # the index of the program's own start in the harness's reports
GRACE_SECONDS = 0.5  # past its deadline, a check that swallowed the timeout has this long before its process ends
ERROR_CHARS = 500  # the tail of a failing check's traceback that is reported
STATUSES = ("passed", "wrong_answer", "runtime_error", "memory_limit", "timeout", "not_run")  # the harness's

HARNESS = r"""import json, os, signal, sys, time
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
job = json.loads(sys.stdin.read())
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the job (and its nonce) is gone from stdin


class Deadline(BaseException):  # not an Exception: `except Exception` in the program lets it through
    pass


def report(*fields):
    out.write(json.dumps([job["nonce"], *fields]) + "\n")
    out.flush()


def alarm(signum, frame):
    if state["fired"]:  # the program swallowed the first: report the check and end the process
        report(state["index"], "timeout", time.monotonic() - state["start"], "the check outlived its deadline")
        os._exit(0)
    state["fired"] = True
    signal.setitimer(signal.ITIMER_REAL, job["grace"])
    raise Deadline


def explain(e, source, name):
    # The traceback's tail, showing the check's lines, without run()'s frame. Imported here: a
    # program that passes pays for neither import (about 10 ms of a process's start).
    import linecache, traceback
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    return "".join(traceback.format_exception(e, e, e.__traceback__.tb_next))[-job["error_chars"]:]


def run(index, source, name):
    report(index)
    state.update(index=index, fired=False, start=time.monotonic())
    status, error = "passed", ""
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, job["seconds"])
            exec(compile(source, name, "exec"), scope)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except Deadline:
        signal.setitimer(signal.ITIMER_REAL, 0)
        status = "timeout"
    except BaseException as e:
        status = "wrong_answer" if isinstance(e, AssertionError) and index != -1 else (
            "memory_limit" if isinstance(e, MemoryError) else "runtime_error")
        error = explain(e, source, name)
    report(index, status, time.monotonic() - state["start"], error)
    return status, error


state = {}
scope = {"__name__": "solution"}
signal.signal(signal.SIGALRM, alarm)
started, error = run(-1, open("solution.py").read() + "\n" + job["setup"], "solution.py")
stopped = False
for i, check in enumerate(job["checks"]):
    if started != "passed":  # the program did not start: every check fails alike
        report(i, started if i == 0 or not job["fail_fast"] else "not_run", 0.0, error)
    elif stopped:
        report(i, "not_run", 0.0, "")
    else:
        stopped = run(i, check, f"test_{i}")[0] not in ("passed", "wrong_answer") and job["fail_fast"]
"""


CALL = "__areal_flow_call"  # the function-call tests' helper, defined in the program's namespace
# What a function-call test does, as a setup: look the function up (a
# method of a new `Solution()` first, as LeetCode-style programs define it), call it with the case's
# arguments, and compare the JSON round trip of what it returns (tuples become lists, as they would
# reaching another process) with the expected value; APPS wraps an expected value in a one-element
# list. A value JSON cannot encode is a runtime_error, as a process that could not print it was.
CALL_SETUP = f"""
def {CALL}(name, arguments, expected):
    import json
    cls = globals().get("Solution")
    fn = getattr(cls(), name) if cls is not None and hasattr(cls, name) else globals()[name]
    got = json.loads(json.dumps(fn(*json.loads(arguments))))
    want = json.loads(expected)
    assert got == want or (isinstance(want, list) and len(want) == 1 and got == want[0]), (
        f"{{name}}(...) returned {{json.dumps(got)[:200]}}, expected {{json.dumps(want)[:200]}}")
"""


def call_checks(tests: Tests) -> AssertTests:
    """Function-call tests as checks for the harness: one process per program instead of one per
    case (a process costs ~30 ms of a reward worker's time). The cases share the process, so a
    function that keeps state between calls (a global, a mutable default) sees the earlier cases'
    calls, as it would in HumanEval's check(candidate)."""
    assert tests.fn_name is not None, "stdin tests need a process each"
    return AssertTests([f"{CALL}({tests.fn_name!r}, {arguments!r}, {json.dumps(expected)!r})"
                        for arguments, expected in zip(tests.inputs, tests.outputs)], CALL_SETUP)


def harness_job(tests: AssertTests, cfg, nonce: str) -> dict:
    """The job the harness reads on stdin: the checks still to run and how to run them."""
    return {"nonce": nonce, "seconds": cfg.wall_seconds, "grace": GRACE_SECONDS, "fail_fast": cfg.fail_fast,
            "error_chars": ERROR_CHARS, "setup": tests.setup, "checks": tests.checks}


class Reports:
    """What one harness process said: which checks started and how each that ended ended."""

    def __init__(self, stdout: str, nonce: str):
        self.started: set[int] = set()
        self.ended: dict[int, tuple[str, float, str]] = {}
        for line in stdout.splitlines():
            try:
                fields = json.loads(line)
            except ValueError:
                continue  # the output limit cut the last line
            if not (isinstance(fields, list) and len(fields) in (2, 5) and fields[0] == nonce
                    and isinstance(fields[1], int)):
                continue
            if len(fields) == 2:
                self.started.add(fields[1])
            elif fields[1] not in self.ended and fields[2] in STATUSES and isinstance(fields[3], (int, float)):
                # The first report counts: a forked copy of the harness reports again.
                self.ended[fields[1]] = (fields[2], float(fields[3]), str(fields[4]))


def died(case: CaseResult) -> tuple[str, float, str]:
    """A check whose process ended under it: the process's status (exiting 0 mid-check is a crash)."""
    status = "runtime_error" if case.status == "ok" else case.status
    why = f"[the test's process ended under it: {case.status}, exit code {case.exit_code}]"
    return status, case.seconds, (case.stderr[-ERROR_CHARS:] + "\n" + why).lstrip()


def settle(case: CaseResult, reports: Reports, n: int, fail_fast: bool) -> tuple[list[tuple[str, float, str]], bool]:
    """The results of this process's `n` checks that it settled, and whether the rest should run
    again in a new process."""
    if case.status == "sandbox_error":  # the host's failure: no new process would do better
        return [died(case)] * n, False
    if LOAD not in reports.ended:  # the program never finished starting: every check fails alike
        return [died(case)] + [("not_run" if fail_fast else died(case)[0], 0.0, "")] * (n - 1), False
    settled = []
    for i in range(n):
        if i in reports.ended:
            settled.append(reports.ended[i])
        else:
            if i in reports.started or not settled:  # it ended mid-check, or settled nothing at all
                settled.append(died(case))
            return settled, not fail_fast
    return settled, False


def run_asserts(sandbox, program: str, tests: AssertTests) -> list[tuple[str, float, str]]:
    """(status, seconds, error) per check of `tests`, run with `program` in `sandbox` (local or remote)."""
    cfg, n = sandbox.cfg, len(tests.checks)
    budget = cfg.wall_seconds * (n + 1)
    results: list[tuple[str, float, str]] = []
    while len(results) < n and budget >= cfg.wall_seconds:
        checks = tests.checks[len(results):]
        nonce = secrets.token_hex(16)
        job = harness_job(AssertTests(checks, tests.setup), cfg, nonce)
        (case,) = sandbox.run(program, [json.dumps(job)], script=HARNESS, scale=budget / cfg.wall_seconds)
        budget -= case.seconds
        settled, again = settle(case, Reports(case.stdout, nonce), len(checks), cfg.fail_fast)
        results += settled
        if not again:
            break
    return results + [("not_run", 0.0, "")] * (n - len(results))
