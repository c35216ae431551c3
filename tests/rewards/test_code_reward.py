import json
import os
import subprocess
import sys

import pytest

from areal_flow.config.schema import SandboxConfig
from areal_flow.rewards.code import (
    TEST_STATUSES,
    CodeReward,
    extract_code,
    parse_tests,
    passed,
    score_program,
)
from areal_flow.sandbox.local import CaseResult, Sandbox

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's namespaces need root, as on CI")


def test_extract_code_takes_the_last_python_block():
    text = "Try:\n```python\nprint(1)\n```\nBetter:\n```\nprint(2)\n```\n```bash\nrm -rf /\n```\n"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("print(3)") == "print(3)"  # no fence: the completion is the program
    assert extract_code("  \n") is None
    assert extract_code("```bash\nls\n```") is None
    assert extract_code("```python\n   \n```") is None


def test_parse_tests_stdio_and_function_call_shapes():
    t = parse_tests('{"inputs": ["1 2\\n", ["3", "4"]], "outputs": ["3", ["7"]]}')
    assert (t.inputs, t.outputs, t.fn_name) == (["1 2\n", "3\n4"], ["3", "7"], None)
    # LiveCodeBench: one JSON value per line; APPS: a list of arguments, the value wrapped in a list.
    t = parse_tests({"inputs": ["[1, 2]\n3", [[5], 1]], "outputs": ["[3, 6]", [[5]]], "fn_name": "scale"})
    assert [json.loads(x) for x in t.inputs] == [[[1, 2], 3], [[5], 1]]
    assert t.outputs == [[3, 6], [[5]]]


@pytest.mark.parametrize("bad, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected an object"),
    ('{"inputs": ["1"]}', "missing 'outputs'"),
    ('{"inputs": ["1", "2"], "outputs": ["1"]}', "'inputs' has 2 cases, 'outputs' has 1"),
    ('{"inputs": [], "outputs": []}', "no test cases"),
    ('{"inputs": ["1"], "outputs": ["1"], "fn_name": "not a name"}', "'fn_name' must be a function name"),
    ('{"inputs": ["[1"], "outputs": ["1"], "fn_name": "f"}', r"inputs\[0\] is not one JSON value per line"),
])
def test_malformed_input_output_says_what_is_wrong(bad, message):
    with pytest.raises(ValueError, match=message):
        parse_tests(bad)


def test_outputs_compare_after_normalising_whitespace():
    assert passed(CaseResult("ok", stdout="1  2\n3 \n\n"), "1 2\n3")
    assert not passed(CaseResult("ok", stdout="1 2 4"), "1 2 3")
    assert not passed(CaseResult("timeout", stdout="1 2 3"), "1 2 3")


@needs_root
def test_score_program_passes_only_when_every_test_passes():
    box = Sandbox(SandboxConfig(wall_seconds=2.0, cpu_seconds=2))
    tests = parse_tests({"inputs": ["2", "3", "10"], "outputs": ["4", "9", "100"]})
    good = score_program(box, "print(int(input()) ** 2)", tests)
    assert (good["reward"], good["tests_passed"]) == (1.0, 3)
    wrong = score_program(box, "n = int(input())\nprint(n * n if n < 10 else 0)", tests)
    assert (wrong["reward"], wrong["tests_passed"]) == (0.0, 2)
    assert [t.status for t in wrong["tests"]] == ["passed", "passed", "wrong_answer"]
    crash = score_program(box, "raise SystemExit(3)", tests)
    assert crash["reward"] == 0.0 and [t.status for t in crash["tests"]] == ["runtime_error", "not_run", "not_run"]
    assert score_program(box, None, tests)["tests"][0].status == "no_code"


@needs_root
def test_function_call_tests_run_in_one_process_and_compare_the_json_round_trip():
    box = Sandbox(SandboxConfig(wall_seconds=2.0, cpu_seconds=2, fail_fast=False))
    tests = parse_tests({"inputs": [[[1, 2], 3], [[], 1], [[4], 2], [[5], 0]],
                         "outputs": [[3, 6], [], [[8]], [1]], "fn_name": "scale"})
    # A method of class Solution; a tuple returned is a list after the round trip; an expected value
    # wrapped in a one-element list (APPS) matches the value itself; prints cannot corrupt the value.
    program = ("print('noise')\nclass Solution:\n    def scale(self, xs, k):\n        print('more')\n"
               "        return tuple(x * k for x in xs)\n")
    got = score_program(box, program, tests, partial_credit=True)
    assert [t.status for t in got["tests"]] == ["passed", "passed", "passed", "wrong_answer"]
    assert got["reward"] == 0.75
    assert "scale(...) returned [0], expected [1]" in got["tests"][3].stderr
    # Every case shares the program's one process: a counter kept in a global sees the earlier calls.
    counter = "calls = []\ndef count():\n    calls.append(1)\n    return len(calls)\n"
    counted = parse_tests({"inputs": [[], [], []], "outputs": [1, 2, 3], "fn_name": "count"})
    assert score_program(box, counter, counted)["reward"] == 1.0
    # No such function, a set (plain data, but not JSON's), a set holding an object (not plain data).
    for program, status, why in (("def other(xs, k):\n    return xs\n", "runtime_error", "NameError"),
                                 ("def scale(xs, k):\n    return {1}\n", "runtime_error", "JSON cannot encode"),
                                 ("def scale(xs, k):\n    return {object()}\n", "not_plain", "not plain data")):
        failed = score_program(box, program, tests)
        assert failed["tests"][0].status == status and why in failed["tests"][0].stderr
    box.close()


@needs_root
@pytest.mark.slow  # 1.1-1.6 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_every_test_status_reaches_the_metrics_as_a_share_of_the_samples_tests():
    reward = CodeReward(SandboxConfig(wall_seconds=1.0, cpu_seconds=1, fail_fast=False))
    tests = json.dumps({"inputs": ["1", "2", "3", "4"], "outputs": ["1", "2", "3", "4"]})
    program = ("import sys, time\nn = int(input())\n"
               "if n == 2: print(0)\nelif n == 3: sys.exit(1)\nelif n == 4: time.sleep(30)\nelse: print(n)\n")
    got = reward(f"```python\n{program}```", tests)
    assert set(got) == {"reward", "suspect"} | {f"tests_{s}" for s in TEST_STATUSES}
    assert got["reward"] == 0.0
    assert {k: v for k, v in got.items() if v and k != "reward"} == {
        "tests_passed": 0.25, "tests_wrong_answer": 0.25, "tests_runtime_error": 0.25, "tests_timeout": 0.25}
    prose = "no fence and only prose"  # taken as a bare program: a syntax error in every test
    assert reward(prose, tests)["tests_runtime_error"] == 1.0
    assert reward("```python\n```", tests)["tests_no_code"] == 1.0
    reward.sandbox.close()
    fail_fast = CodeReward(SandboxConfig(wall_seconds=1.0, cpu_seconds=1, fail_fast=True))
    stopped = fail_fast(prose, tests)
    assert (stopped["tests_runtime_error"], stopped["tests_not_run"]) == (0.25, 0.75)
    fail_fast.sandbox.close()


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_flow.rewards.code", *args], capture_output=True, text=True,
                          timeout=60)


@needs_root
@pytest.mark.slow  # 1.4-2.3 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_command_prints_one_json_object_and_exits_0_whatever_the_program_did(tmp_path):
    tests = tmp_path / "tests.json"
    tests.write_text(json.dumps({"inputs": ["1\n2", "[1]\n[2]"], "outputs": ["3", "[1, 2]"], "fn_name": "add"}))
    program = tmp_path / "prog.py"
    program.write_text("def add(a, b):\n    return a + b\n")
    out = cli(str(program), str(tests))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["reward"] == 1.0 and [t["status"] for t in result["tests"]] == ["passed", "passed"]
    assert result["sandbox"].startswith("local sandbox (pid_namespace, network_namespace, mount_namespace")

    program.write_text("import time\ntime.sleep(30)\n")
    out = cli(str(program), str(tests), "--timeout", "1")
    assert out.returncode == 0
    result = json.loads(out.stdout)
    assert result["reward"] == 0.0 and result["tests"][0]["status"] == "timeout"


def test_command_exits_2_naming_the_bad_argument(tmp_path):
    program = tmp_path / "prog.py"
    program.write_text("print(1)")
    missing = cli(str(program), str(tmp_path / "none.json"))
    assert missing.returncode == 2 and "none.json" in missing.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"inputs": ["1"], "outputs": []}')
    out = cli(str(program), str(bad))
    assert out.returncode == 2 and f"{bad}: input_output: 'inputs' has 1 cases" in out.stderr
    assert cli(str(program)).returncode == 2  # argparse: a missing argument
