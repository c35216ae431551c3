"""`code_feedback`: each policy turn is an attempt at the program; a failed attempt gets the first
failing test back (the call, what was expected, what it gave) and the policy tries again.

The attempt runs in the code sandbox (areal_flow/rewards/sandbox.py) under a small driver that
calls the function on each of the row's tests in order and stops at the first failure: a wrong
value, an exception, or a test still running at the wall time (`timeout`). An attempt that
passes every test ends the trajectory with reward 1; one that fails gets reward 0 and the
observation `# failed: f(args) == expected, got ...` (data/observations.py). The reward node
scores the final attempt on its own (graph/keys.py: final_turn), so the run's reward is success
within `max_turns` attempts; this environment's rewards make the repair rates (env/repair_turnK).

Tests are the row's `input_output` field in AReaL's function-call shape (`fn_name`); stdin
programs and assert-style tests are refused when the environment is made.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
from typing import Any

from areal_flow.config.schema import SandboxConfig
from areal_flow.data.input_output import Tests, parse_tests
from areal_flow.data.observations import MAX_OUTPUT_CHARS, call_text, failed_test
from areal_flow.envs.base import Environment, Step
from areal_flow.envs.python_tool import MAX_BOXES, check_sandbox, printable, shared_pool, tool_sandbox

# Runs in the sandbox: the attempt from solution.py, then each test until one fails. Each line it
# reports starts with a nonce the attempt cannot know, so nothing the attempt prints passes for one.
DRIVER = r"""
import json, sys
job = json.loads(sys.stdin.read())

def report(**fields):
    print("\n" + job["nonce"] + json.dumps(fields), flush=True)

def error(e):
    return f"{type(e).__name__}: {e}"

scope = {"__name__": "solution"}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), scope)
    if job["fn"] not in scope:
        raise NameError(f"name {job['fn']!r} is not defined")
    fn = scope[job["fn"]]
except BaseException as e:
    report(index=0, got=error(e))
    sys.exit(0)
for i, (args, want) in enumerate(zip(job["inputs"], job["outputs"])):
    report(index=i, started=True)
    try:
        got = fn(*json.loads(args))
        same = json.loads(json.dumps(got)) == want
    except BaseException as e:
        report(index=i, got=error(e))
        sys.exit(0)
    if not same:
        report(index=i, got=repr(got))
        sys.exit(0)
report(index=-1)
"""


@dataclasses.dataclass(frozen=True)
class FeedbackSettings:
    """What a recipe may set under `graph.<generate>.env_settings` for code_feedback."""

    tests_field: str = "input_output"  # the row's field with the tests
    wall_seconds: float = 2.0  # wall time of one attempt's run over all its tests
    max_feedback_chars: int = MAX_OUTPUT_CHARS  # a failed test's line is cut past this many characters
    concurrency: int = 2  # sandboxes per worker process, shared by its trajectories (at most MAX_BOXES)

    def __post_init__(self) -> None:
        if self.wall_seconds <= 0 or self.max_feedback_chars < 1 or not 1 <= self.concurrency <= MAX_BOXES:
            raise ValueError(f"code_feedback: wall_seconds must be > 0, max_feedback_chars ≥ 1 and concurrency in "
                             f"1..{MAX_BOXES}")


class CodeFeedback(Environment):
    figures = ("attempts", "tool_seconds")

    def __init__(self, row: dict[str, Any], *, sandbox: SandboxConfig | None = None, **settings: Any):
        super().__init__(row)
        try:
            self.settings = FeedbackSettings(**settings)
        except TypeError as e:
            raise ValueError(f"code_feedback: {e}") from None
        self.sandbox = tool_sandbox(sandbox, self.settings.wall_seconds)
        self.tests: Tests | None = None
        if row:  # the launch check makes one from an empty row
            field = self.settings.tests_field
            if field not in row:
                raise ValueError(f"code_feedback: the row has no field {field!r} (env_settings.tests_field)")
            tests = parse_tests(row[field])
            if not isinstance(tests, Tests) or tests.fn_name is None:
                raise ValueError("code_feedback: needs function-call tests (input_output with fn_name)")
            self.tests = tests

    def check(self) -> None:
        check_sandbox(self.sandbox, "code_feedback")

    async def step(self, turn: str) -> Step:
        t0 = time.monotonic()
        failed = await self.first_failure(turn)
        figures = {"attempts": 1.0, "tool_seconds": time.monotonic() - t0}
        if failed is None:
            return Step(reward=1.0, done=True, figures=figures)
        index, got = failed
        tests = self.tests
        call = call_text(tests.fn_name, json.loads(tests.inputs[index]))
        return Step(failed_test(call, tests.outputs[index], printable(got), self.settings.max_feedback_chars),
                    reward=0.0, figures=figures)

    async def first_failure(self, program: str) -> tuple[int, str] | None:
        """(the index of the first test the program fails, what it gave), or None when all pass."""
        nonce = secrets.token_hex(8)
        job = json.dumps({"nonce": nonce, "fn": self.tests.fn_name, "inputs": self.tests.inputs,
                          "outputs": self.tests.outputs})
        pool = shared_pool(self.sandbox, self.settings.concurrency)
        async with pool.box() as box:
            (result,) = await asyncio.to_thread(box.run, program, [job], script=DRIVER)
        reports = [json.loads(line[len(nonce):]) for line in result.stdout.splitlines() if line.startswith(nonce)]
        if reports and reports[-1]["index"] == -1 and result.status == "ok":
            return None
        if reports and "got" in reports[-1]:
            return reports[-1]["index"], reports[-1]["got"]
        index = reports[-1]["index"] if reports else 0  # the test that was running when it stopped
        if result.status == "timeout":
            return index, "timeout"
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        return index, lines[-1] if lines else result.status  # (a program that does not compile: its SyntaxError)
