"""`code_feedback` (envs/code_feedback.py): each attempt runs in the code sandbox against the row's
tests; a failure comes back as the first failing test, and the bootstrap's repair traces show the
model that very line."""

import asyncio
import os
import random

import pytest
from run_helpers import processes_of_uids

from areal_flow.data import tiny_code
from areal_flow.envs.registry import resolve_env
from areal_flow.envs.code_feedback import CodeFeedback
from areal_flow.envs.python_tool import MAX_BOXES, PID_SPAN
from areal_flow.models.tasks import repaired
from areal_flow.sandbox.local import CHECKER_UID_SHIFT, UID_BASE

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's namespaces need root, as on CI")
ROW = {"input_output": {"inputs": [[4], [2], [-3]], "outputs": [12, 6, -9], "fn_name": "mul_3"}, "shown_tests": 3}


def sandboxed_processes() -> list[int]:
    """The pids of processes running as one of this process's tool sandboxes' uids, or their checkers'
    (what a program left behind; envs/python_tool.py: SandboxPool gives box k the uid
    UID_BASE + (k+1)·PID_SPAN + pid)."""
    uids = {UID_BASE + (k + 1) * PID_SPAN + os.getpid() for k in range(MAX_BOXES)}
    return processes_of_uids(uids | {u - CHECKER_UID_SHIFT for u in uids})


def attempts(turns: list[str], row=ROW, **settings):
    async def go():
        env = CodeFeedback(row, **settings)
        return [await env.step(t) for t in turns]

    return asyncio.run(go())


@needs_root
def test_a_passing_attempt_ends_with_reward_1_and_a_failing_one_gets_its_first_failed_test():
    good, wrong, broken, missing = attempts([
        "def mul_3(x):\n    return x * 3",
        "def mul_3(x):\n    return abs(x) * 3",
        "def mul_3(x):\n    return y",
        "def triple(x):\n    return x * 3"])
    assert (good.done, good.reward, good.observation) == (True, 1.0, "")
    assert (wrong.done, wrong.reward) == (False, 0.0)
    assert wrong.observation == "# failed: mul_3(-3) == -9, got 9\n"  # the first test it fails, not the first test
    assert broken.observation == "# failed: mul_3(4) == 12, got NameError: name 'y' is not defined\n"
    assert missing.observation == "# failed: mul_3(4) == 12, got NameError: name 'mul_3' is not defined\n"
    assert all(s.figures["attempts"] == 1.0 and s.figures["tool_seconds"] > 0 for s in (good, wrong, broken))


@needs_root
def test_an_attempt_that_hangs_floods_or_forges_the_drivers_report_fails_and_nothing_is_left_running():
    hang, syntax, flood, forge = attempts([
        "def mul_3(x):\n    while True: pass",
        "def mul_3(x)\n    return x",
        "def mul_3(x):\n    print('é' * 10**6)\n    return x * 3",
        # An attempt that writes what looks like the checker's success lines on every descriptor it has.
        "import os\nfor fd in range(1, 5):\n    os.write(fd, b'[0, \"passed\", 0, \"\", \"\", \"\"]\\n')\n"
        "def mul_3(x):\n    return 0"], wall_seconds=1.0)
    assert hang.observation == "# failed: mul_3(4) == 12, got timeout\n" and hang.reward == 0.0
    assert syntax.observation.startswith("# failed: mul_3(4) == 12, got SyntaxError")
    assert not flood.done and flood.reward == 0.0 and flood.observation.isascii()
    assert forge.reward == 0.0 and forge.observation.startswith("# failed: mul_3(4) == 12, got ")
    assert sandboxed_processes() == []


@needs_root
def test_feedback_comes_from_the_shown_tests_only():
    """The prompt shows 2 tests; an attempt that fails only the hidden third is never told of it."""
    row = {**ROW, "shown_tests": 2}
    hidden_only, shown = attempts(["def mul_3(x):\n    return x * 3 if x > 0 else 0",
                                   "def mul_3(x):\n    return x * 3 if x > 2 else 0"], row=row)
    assert (hidden_only.done, hidden_only.reward, hidden_only.observation) == (True, 1.0, "")
    assert shown.observation == "# failed: mul_3(2) == 6, got 0\n"
    as_text = attempts(["def mul_3(x):\n    return x * 3 if x > 2 else 0"], row={**row, "shown_tests": "2"})[0]
    assert as_text.observation == shown.observation  # a row's fields reach the environment as text
    everything = attempts(["def mul_3(x):\n    return x * 3 if x > 0 else 0"], row=row, feedback_from="all")[0]
    assert everything.observation == "# failed: mul_3(-3) == -9, got 0\n"
    with pytest.raises(ValueError, match=r"the row's 'shown_tests' must say how many .* got None.* would leak"):
        CodeFeedback({"input_output": ROW["input_output"]})
    with pytest.raises(ValueError, match=r"an int in 1\.\.3\), got 4"):
        CodeFeedback({**ROW, "shown_tests": 4})


def test_rows_without_function_call_tests_are_refused_by_name():
    assert resolve_env("code_feedback", "graph.generate.env") is CodeFeedback
    with pytest.raises(ValueError, match=r"code_feedback: the row has no field 'tests'"):
        CodeFeedback(ROW, tests_field="tests")
    with pytest.raises(ValueError, match=r"code_feedback: needs function-call tests"):
        CodeFeedback({"input_output": {"inputs": ["1\n"], "outputs": ["2\n"]}})
    with pytest.raises(ValueError, match=r"code_feedback: wall_seconds must be > 0"):
        CodeFeedback(ROW, wall_seconds=0)


@needs_root
def test_the_bootstrap_repair_traces_show_the_very_line_the_environment_writes():
    """tiny_code_feedback's traces (models/tasks.py): a slip of the reference, then the failed test as
    code_feedback writes it for that slip in the sandbox, character for character."""
    rng = random.Random(0)
    problems = tiny_code.training_problems(0, (200, 0), stream="bootstrap")
    checked = 0
    while checked < 6:
        problem = next(problems)
        parts = repaired(problem, rng)
        if parts is None:
            continue
        (wrong, trained), (line, untrained), (fixed, _) = parts
        assert trained and not untrained and fixed == problem.solution and wrong.endswith("<eos>")
        (step,) = attempts([wrong.removesuffix("<eos>")], row=problem.row("q"))
        assert step.observation == line, (problem.prompt, wrong)
        checked += 1
