"""`code_feedback`: each policy turn is an attempt at the program; a failed attempt gets the first
failing test back (the call, what was expected, what it gave) and the policy tries again.

Feedback comes only from the tests the prompt already shows (the row's first `shown_tests`), so an
attempt never learns a hidden test: the held-out score, which the reward node takes from every test
on the final attempt (graph/keys.py: final_turn), stays a score on tests the model was not shown.
An attempt runs as the code reward's are checked (areal_flow/sandbox/asserts.py: the function in the
program's own sandboxed process, the tests in a checker it cannot reach), stopping at the first
failure: a wrong value, an exception, a result that is not plain data, or a test still running at
its deadline (`timeout`). An attempt that passes the shown tests ends the trajectory with reward 1;
one that fails gets reward 0 and the observation `# failed: f(args) == expected, got ...`
(data/observations.py). The run's reward is success on every test within `max_turns` attempts; this
environment's rewards make the repair rates (env/repair_turnK).

Tests are the row's `input_output` field in AReaL's function-call shape (`fn_name`); stdin
programs and assert-style tests are refused when the environment is made, and so is a row that does
not say how many of its tests are shown (unless `feedback_from: all`, which leaks hidden tests).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

from areal_flow.config.schema import SandboxConfig
from areal_flow.data.input_output import Tests, parse_tests
from areal_flow.data.observations import MAX_OUTPUT_CHARS, call_text, failed_test
from areal_flow.envs.base import Environment, Step
from areal_flow.envs.python_tool import MAX_BOXES, check_sandbox, printable, shared_pool, tool_sandbox
from areal_flow.sandbox.asserts import run_checks

@dataclasses.dataclass(frozen=True)
class FeedbackSettings:
    """What a recipe may set under `graph.<generate>.env_settings` for code_feedback."""

    tests_field: str = "input_output"  # the row's field with the tests
    shown_field: str = "shown_tests"  # the row's field: how many of its first tests the prompt shows
    feedback_from: str = "shown"  # shown: feedback from the shown tests only; all: every test (leaks hidden ones)
    wall_seconds: float = 2.0  # wall time of each test of an attempt
    max_feedback_chars: int = MAX_OUTPUT_CHARS  # a failed test's line is cut past this many characters
    concurrency: int = 2  # sandboxes per worker process, shared by its trajectories (at most MAX_BOXES)

    def __post_init__(self) -> None:
        if self.wall_seconds <= 0 or self.max_feedback_chars < 1 or not 1 <= self.concurrency <= MAX_BOXES:
            raise ValueError(f"code_feedback: wall_seconds must be > 0, max_feedback_chars ≥ 1 and concurrency in "
                             f"1..{MAX_BOXES}")
        if self.feedback_from not in ("shown", "all"):
            raise ValueError(f"code_feedback: feedback_from must be 'shown' or 'all', got {self.feedback_from!r}")


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
        if row:  # an empty row (a test's) has no tests to give feedback from
            field = self.settings.tests_field
            if field not in row:
                raise ValueError(f"code_feedback: the row has no field {field!r} (env_settings.tests_field)")
            tests = parse_tests(row[field])
            if not isinstance(tests, Tests) or tests.fn_name is None:
                raise ValueError("code_feedback: needs function-call tests (input_output with fn_name)")
            self.tests = self._feedback_tests(row, tests)

    def _feedback_tests(self, row: dict[str, Any], tests: Tests) -> Tests:
        """The tests an attempt gets feedback from: the first `shown` of them, or all."""
        if self.settings.feedback_from == "all":
            return tests
        field, shown = self.settings.shown_field, row.get(self.settings.shown_field)
        shown = int(shown) if isinstance(shown, str) and shown.strip().isdigit() else shown  # rows arrive as text
        if not (type(shown) is int and 1 <= shown <= len(tests)):
            raise ValueError(f"code_feedback: the row's {field!r} must say how many of its first tests the prompt "
                             f"shows (an int in 1..{len(tests)}), got {shown!r}; feedback from hidden tests would "
                             f"leak them (env_settings.feedback_from=all does so on purpose)")
        return Tests(tests.inputs[:shown], tests.outputs[:shown], tests.fn_name)

    def check(self) -> None:
        check_sandbox(self.sandbox, "code_feedback")

    def snapshot(self) -> dict[str, Any]:
        return {}  # it holds nothing between turns but its row and settings: a resume goes on as it is

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
        pool = shared_pool(self.sandbox, self.settings.concurrency)
        async with pool.box() as box:
            outcomes = await asyncio.to_thread(run_checks, box, program, self.tests)
        for index, (status, _, _, got, _) in enumerate(outcomes):
            if status != "passed":
                return index, got
        return None
