"""Checked tests: every shape but stdin (function calls, HumanEval's check(candidate), MBPP's
asserts), run in two processes of the sandbox, so that the verdict is reached where the program
cannot reach.

The program runs in a process of its own (areal_flow/sandbox/serve.py, as the sandbox's uid for
programs) that loads it and answers calls. The tests run in the checker (areal_flow/rewards/
checker.py), which the sandbox's init forks beside it as another uid: it holds the tests and what
they expect, calls the program over two pipes and gets back plain data only (areal_flow/rewards/
plain.py). The expected values never enter the program's process, no object of the program's
reaches the checker, and only the checker holds the descriptor its reports go out on: nothing the
program prints, patches or forges can pass for a verdict.

Each test runs under the checker's own deadline (`wall_seconds`). A test whose program died under it
(an exit, a segfault, the output or memory limit) gets the program process's status (exiting 0
mid-test is a runtime_error, and suspect). A test that timed out leaves its program busy: the tests
after it run again with a new pair of processes (with `fail_fast`, they are `not_run`), and the
processes of one program share the time its tests would have had as cases, wall_seconds × (tests + 1).
"""

from __future__ import annotations

import json

from areal_flow.data.input_output import AssertTests, Tests
from areal_flow.sandbox import checker, plain, serve
from areal_flow.sandbox.checker import LOAD
from areal_flow.sandbox.local import CaseResult

ERROR_CHARS = 500  # the tail of a failing test's traceback that is reported
STATUSES = ("passed", "wrong_answer", "runtime_error", "memory_limit", "timeout", "output_limit", "not_plain",
            "not_run")  # the checker's
Outcome = tuple[str, float, str, str, str]  # a test as checked: (status, seconds, error, got, suspect)


def bundle(*modules) -> str:
    """One script from the sources of stdlib-only modules, in order, without their imports of each
    other (the lines marked `# bundled`): what runs in the sandbox, where the package is not."""
    parts = []
    for module in modules:
        with open(module.__file__, encoding="utf-8") as f:
            parts.append("".join(line for line in f if not line.rstrip().endswith("# bundled")))
    return "\n".join(parts)


SERVE = bundle(plain, serve)  # the program's process
CHECKER = bundle(plain, checker)  # the checker's: the init runs its main(job)


def check_list(tests: AssertTests | Tests) -> list[dict]:
    """The checker's tests: each assert-style check as source, each function-call case as a call and
    the value it must return."""
    if isinstance(tests, AssertTests):
        return [{"source": source} for source in tests.checks]
    assert tests.fn_name is not None, "stdin tests are compared on the host"
    return [{"call": tests.fn_name, "args": json.loads(arguments), "expected": expected}
            for arguments, expected in zip(tests.inputs, tests.outputs)]


def checker_job(tests: list[dict], setup: str, cfg) -> dict:
    """What the checker is given: the tests still to run and how to run them."""
    return {"seconds": cfg.wall_seconds, "fail_fast": cfg.fail_fast, "error_chars": ERROR_CHARS,
            "setup": setup, "tests": tests, "max_reply": cfg.output_bytes}


class Reports:
    """What one checker said: which tests started and how each that ended ended."""

    def __init__(self, stdout: str):
        self.started: set[int] = set()
        self.ended: dict[int, Outcome] = {}
        for line in stdout.splitlines():
            try:
                fields = json.loads(line)
            except ValueError:
                continue
            if not (isinstance(fields, list) and len(fields) in (1, 6) and isinstance(fields[0], int)):
                continue
            if len(fields) == 1:
                self.started.add(fields[0])
            elif fields[0] not in self.ended and fields[1] in STATUSES:
                self.ended[fields[0]] = (fields[1], float(fields[2]), str(fields[3]), str(fields[4]), str(fields[5]))


def died(case: CaseResult) -> Outcome:
    """A test whose program's process ended under it: that process's status (exiting 0, or closing its
    end of the pipes, mid-test is a crash, and suspect)."""
    status = "runtime_error" if case.status == "ok" else case.status
    why = f"[the program's process ended under the test: {case.status}, exit code {case.exit_code}]"
    lines = [line for line in case.stderr.splitlines() if line.strip()]
    got = "timeout" if status == "timeout" else (lines[-1] if lines else status)  # its last words, for feedback
    return status, case.seconds, (case.stderr[-ERROR_CHARS:] + "\n" + why).lstrip(), got, (
        "exited" if case.status == "ok" else "")


def settle(case: CaseResult, reports: Reports, n: int, fail_fast: bool) -> tuple[list[Outcome], bool]:
    """The outcomes of the `n` tests this pair of processes settled, and whether the rest should run
    again with a new pair."""
    if case.status == "sandbox_error":  # the host's failure: no new process would do better
        return [died(case)] * n, False
    if LOAD not in reports.ended:  # the program never finished starting: every test fails alike
        return [died(case)] + [("not_run" if fail_fast else died(case)[0], 0.0, "", "", "")] * (n - 1), False
    settled: list[Outcome] = []
    for i in range(n):
        if i in reports.ended:
            settled.append(reports.ended[i])
        else:
            if i in reports.started or not settled:  # it ended mid-test, or settled nothing at all
                settled.append(died(case))
            return settled, not fail_fast
    return settled, False


def run_checks(sandbox, program: str, tests: AssertTests | Tests) -> list[Outcome]:
    """One outcome per test of `tests` (assert-style or function calls), run against `program`."""
    cfg, todo = sandbox.cfg, check_list(tests)
    setup = tests.setup if isinstance(tests, AssertTests) else ""
    n = len(todo)
    budget = cfg.wall_seconds * (n + 1)
    results: list[Outcome] = []
    while len(results) < n and budget >= cfg.wall_seconds:
        rest = todo[len(results):]
        case = sandbox.check(program, SERVE, CHECKER, checker_job(rest, setup, cfg), scale=budget / cfg.wall_seconds)
        budget -= case.seconds
        settled, again = settle(case, Reports(case.stdout), len(rest), cfg.fail_fast)
        results += settled
        if not again:
            break
    return results + [("not_run", 0.0, "", "", "")] * (n - len(results))
