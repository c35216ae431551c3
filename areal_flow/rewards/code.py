"""The code reward: the completion's last fenced code block, run in the sandbox against the
problem's tests, scores 1.0 when every test passes and 0.0 otherwise (with sandbox.partial_credit,
the fraction of its tests that pass).

Tests come in two kinds of shape (areal_flow/data/input_output.py). AReaL's `input_output`: without
`fn_name` each input is the program's stdin and its output the expected stdout, compared after
normalising whitespace; with `fn_name` the program defines that function (or a method of
`class Solution`) called with each input's arguments, and the return value must equal the expected
output (APPS wraps it in a one-element list). Assert-style, HumanEval's `{test, entry_point}` (one
test: check(entry_point)) and MBPP's `{asserts}` (one test per assert). Every shape but stdin runs
its tests in one sandboxed process with the program (areal_flow/sandbox/asserts.py): a function
call is a check too.

Debug one program as a user would before a long run:

    python -m areal_flow.rewards.code PROGRAM.py TESTS.json

prints one JSON object (reward, per-test results, the sandbox's isolation) and exits 0 whatever the
program did; 2 only for bad input to the command itself.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

import msgspec

from areal_flow.config.schema import SandboxConfig
from areal_flow.data.input_output import SHAPES, AnyTests, AssertTests, Tests, parse_tests
from areal_flow.sandbox.asserts import run_checks
from areal_flow.sandbox.remote import RemoteSandbox
from areal_flow.sandbox.local import CaseResult, Sandbox, SandboxUnavailable

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str | None:
    """The last fenced code block of a completion (a python/py/untagged block; other languages
    are skipped); a completion with no fence at all is taken whole, as a bare program (it then
    fails as a syntax error when it is prose); None when there is nothing to run."""
    if "```" not in completion:
        return completion if completion.strip() else None
    blocks = [body for lang, body in _FENCE.findall(completion) if lang.lower() in ("", "python", "py", "python3")]
    return blocks[-1] if blocks and blocks[-1].strip() else None


def passed(result: CaseResult, expected: str) -> bool:
    """A stdin test's case: it finished and printed the expected output, whitespace aside."""
    return result.status == "ok" and result.stdout.split() == expected.split()


# Every status a test can end with: passed, wrong_answer, the sandbox's statuses of a program that
# did not finish well, not_run (after an earlier failure, with sandbox.fail_fast) and no_code.
TEST_STATUSES = ("passed", "wrong_answer", "timeout", "runtime_error", "memory_limit", "file_size_limit",
                 "disk_limit", "output_limit", "not_plain", "sandbox_error", "not_run", "no_code")


class TestResult(msgspec.Struct):
    """One test as scored: passed | wrong_answer | not_plain (a result that is not plain data) | a
    sandbox status (timeout, runtime_error, ...) | not_run (after an earlier failure); see
    TEST_STATUSES."""

    status: str
    seconds: float = 0.0
    stderr: str = ""
    got: str = ""  # a function-call test's: what the call returned (its repr) or raised
    suspect: str = ""  # what no honest program does: not_plain, forged, exit, exited (docs/rewards.md)


def make_sandbox(cfg: SandboxConfig) -> Sandbox | RemoteSandbox:
    """The configured backend. The local one probes its isolation here (and refuses to run where it
    has none, unless cfg.allow_unsandboxed), so a misconfigured machine fails at start."""
    if cfg.backend == "remote":
        return RemoteSandbox(cfg)
    box = Sandbox(cfg)
    box.isolation()
    return box


class CodeReward:
    """The `code` reward function of a worker process: (completion, tests field) -> scores."""

    def __init__(self, cfg: SandboxConfig):
        self.sandbox = make_sandbox(cfg)
        self.partial_credit = cfg.partial_credit

    def __call__(self, completion: str, reference: str) -> dict[str, float]:
        """The reward and `tests_<status>`: the fraction of the sample's tests that ended so, for
        every status of TEST_STATUSES (0.0 included, so a step's mean is over all its samples)."""
        result = score_program(self.sandbox, extract_code(completion), parse_tests(reference), self.partial_credit)
        return {"reward": result["reward"], **status_fractions(result["tests"]), "suspect": float(result["suspect"])}


def status_fractions(tests: list[TestResult]) -> dict[str, float]:
    """`tests_<status>` -> the share of `tests` with that status, for every status; they sum to 1."""
    counts = dict.fromkeys(TEST_STATUSES, 0)
    for t in tests:
        counts[t.status] += 1  # a status outside TEST_STATUSES is a bug of this module: KeyError
    return {f"tests_{status}": n / len(tests) for status, n in counts.items()}


def score_program(sandbox: Sandbox | RemoteSandbox, program: str | None, tests: AnyTests,
                  partial_credit: bool = False) -> dict[str, Any]:
    """{reward, tests_passed, tests_total, suspect, tests: [TestResult]}; reward 1.0 only when every
    test passes, or with `partial_credit` the fraction that pass; `suspect` when any test's program
    did what no honest one does (its reason in that test's `suspect`)."""
    n = len(tests)
    if program is None:
        scored = [TestResult("no_code")] * n
    elif isinstance(tests, AssertTests) or tests.fn_name is not None:
        scored = [TestResult(*outcome) for outcome in run_checks(sandbox, program, tests)]
    else:
        scored = run_cases(sandbox, program, tests)
    n_passed = sum(t.status == "passed" for t in scored)
    reward = n_passed / n if partial_credit else float(n_passed == n)
    return {"reward": reward, "tests_passed": n_passed, "tests_total": n, "suspect": any(t.suspect for t in scored),
            "tests": scored}


def run_cases(sandbox: Sandbox | RemoteSandbox, program: str, tests: Tests) -> list[TestResult]:
    """The stdin tests: one sandboxed process per case (its own stdin), its output compared here."""
    results = sandbox.run(program, tests.inputs)
    scored = []
    for r, expected in zip(results, tests.outputs):
        ok = passed(r, expected)
        status = "passed" if ok else ("wrong_answer" if r.status == "ok" else r.status)
        scored.append(TestResult(status, r.seconds, "" if ok else r.stderr[-500:]))
    return scored + [TestResult("not_run")] * (len(tests) - len(scored))


def _read(path: str) -> str:
    """A file's text; ValueError naming the file when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: {e.strerror if isinstance(e, OSError) else e}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_flow.rewards.code",
                                     description="Run one program in the code sandbox against a tests file and "
                                                 "print the reward and per-test results as JSON.")
    parser.add_argument("program", help="the program file (Python source, not a completion)")
    parser.add_argument("tests", help=f"a JSON file of the tests, in any shape: {SHAPES}")
    defaults = SandboxConfig()
    parser.add_argument("--timeout", type=float, default=defaults.wall_seconds, help="seconds per test case")
    parser.add_argument("--memory-mb", type=int, default=defaults.memory_mb, help="address space of the program")
    parser.add_argument("--partial-credit", action="store_true", help="score the fraction of tests passed")
    parser.add_argument("--remote", metavar="URL", help="run on a SandboxFusion-style service instead of locally")
    parser.add_argument("--allow-unsandboxed", action="store_true",
                        help="run without namespaces where the machine cannot make them (unsafe)")
    args = parser.parse_args(argv)
    try:
        program = _read(args.program)
        try:
            tests = parse_tests(_read(args.tests))
        except ValueError as e:
            raise ValueError(e if str(e).startswith(args.tests) else f"{args.tests}: {e}") from None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = SandboxConfig(backend="remote" if args.remote else "local", url=args.remote, wall_seconds=args.timeout,
                        cpu_seconds=max(1, round(args.timeout)), memory_mb=args.memory_mb,
                        allow_unsandboxed=args.allow_unsandboxed)
    try:
        sandbox = make_sandbox(cfg)
    except SandboxUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = score_program(sandbox, program, tests, args.partial_credit)
    where = sandbox.describe()
    print(json.dumps(msgspec.to_builtins({**result, "sandbox": where})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
