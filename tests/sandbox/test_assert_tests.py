"""Assert-style code tests (HumanEval's `test` + `entry_point`, MBPP's asserts): read from the tests
field and from dataset rows, run in the real sandbox's checker beside the program's process, and
scored all-or-nothing or, with partial credit, as the fraction passed."""

import json
import os
import subprocess
import sys
import time

import pytest

from areal_flow.config.schema import SandboxConfig
from areal_flow.data.input_output import AssertTests, parse_tests, row_tests
from areal_flow.sandbox.asserts import Reports, settle
from areal_flow.rewards.code import CodeReward, score_program
from areal_flow.sandbox.local import CaseResult, Sandbox

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's namespaces need root, as on CI")

CHECK = "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(-3) == 9\n"
ASSERTS = ["assert f(1) == 2", "assert f(2) == 5", "assert g(1)", "assert f(3) == 6"]


def statuses(result) -> list[str]:
    return [t.status for t in result["tests"]]


# ---- reading the shapes ---------------------------------------------------------------------------


def test_parse_tests_reads_the_check_and_the_asserts_shapes_as_assert_tests():
    check = parse_tests(json.dumps({"test": CHECK, "entry_point": "square"}))
    assert isinstance(check, AssertTests) and len(check) == 1
    assert check.checks[0] == CHECK + "\ncheck(square)\n"  # one test: HumanEval's check, called with the function
    asserts = parse_tests({"asserts": ASSERTS, "setup": "import math"})
    assert (asserts.checks, asserts.setup, len(asserts)) == (ASSERTS, "import math", 4)
    # A Parquet struct column holds every shape's keys, null where a row has none.
    io = parse_tests({"inputs": ["1"], "outputs": ["1"], "fn_name": None, "test": None, "entry_point": None,
                      "asserts": None})
    assert not isinstance(io, AssertTests) and (io.inputs, io.outputs, len(io)) == (["1"], ["1"], 1)


@pytest.mark.parametrize("spec, message", [
    ({"test": CHECK}, "input_output: 'entry_point': expected the name of the function the test checks"),
    ({"entry_point": "f"}, "input_output: 'entry_point': given without the test code that checks it"),
    ({"test": CHECK, "entry_point": "not a name"}, "input_output: 'entry_point': expected the name"),
    ({"test": "def check(c):\n    assert c(1) ==\n", "entry_point": "f"},
     r"input_output: 'test': not valid Python \(SyntaxError at line 2"),
    ({"test": "def verify(c):\n    pass\n", "entry_point": "f"}, "input_output: 'test': defines no function check"),
    ({"asserts": "assert f(1)"}, "input_output: 'asserts': expected a list of assert statements, got str"),
    ({"asserts": []}, "input_output: 'asserts': no tests"),
    ({"asserts": ["assert f(1)", "assert f(2) =="]}, r"input_output: 'asserts'\[1\]: not valid Python"),
    ({"asserts": ["assert f(1)", 3]}, r"input_output: 'asserts'\[1\]: expected Python source, got 3"),
    ({"asserts": ["assert f(1)"], "setup": "import"}, "input_output: 'setup': not valid Python"),
    ({"tests": ["assert f(1)"]}, r"input_output: no tests in any shape: expected .* \(it has: tests\)"),
])
def test_malformed_assert_style_tests_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_tests(spec)


def test_a_rows_own_keys_become_the_tests_field():
    humaneval = {"task_id": "HumanEval/0", "prompt": "...", "test": CHECK, "entry_point": "square"}
    assert row_tests(humaneval) == {"test": CHECK, "entry_point": "square"}
    mbpp = {"task_id": 2, "text": "...", "test_list": ASSERTS[:2], "test_setup_code": "",
            "test_imports": ["import math", "import re"]}
    assert row_tests(mbpp) == {"asserts": ASSERTS[:2], "setup": "import math\nimport re"}
    assert row_tests({"asserts": ASSERTS, "test_setup_code": "X = 1"}) == {"asserts": ASSERTS, "setup": "X = 1"}
    assert row_tests({"prompt": "p", "answer": "4"}) is None
    with pytest.raises(ValueError, match=r"^test_list\[1\]: not valid Python"):
        row_tests({"test_list": ["assert f(1)", "assert ("]})
    with pytest.raises(ValueError, match="^entry_point: expected the name"):
        row_tests({"test": CHECK})


def test_only_reports_with_a_known_status_count_and_a_death_mid_test_is_that_tests():
    lines = [[-1], [-1, "passed", 0.01, "", "", ""], [0], [0, "wrong_answer", 0.1, "AssertionError", "", ""],
             [0, "passed", 0.1, "", "", ""],  # the first report counts
             [1, "forged", 0.0, "", "", ""], ["1", "passed", 0.0, "", "", ""], [1]]
    reports = Reports("\n".join(map(json.dumps, lines)) + '\n[1, "pass')  # the output limit cut the last
    assert reports.started == {-1, 0, 1}
    assert reports.ended == {-1: ("passed", 0.01, "", "", ""), 0: ("wrong_answer", 0.1, "AssertionError", "", "")}
    case = CaseResult("output_limit", exit_code=-9, seconds=0.5)
    settled, again = settle(case, reports, 3, fail_fast=False)
    assert [s[0] for s in settled] == ["wrong_answer", "output_limit"] and again  # test 2 runs in a new process
    assert "process ended under the test: output_limit, exit code -9" in settled[1][2]
    assert settle(case, reports, 3, fail_fast=True)[1] is False
    # A process that never finished loading the program: every test alike, none run again.
    assert settle(CaseResult("timeout", seconds=2.0), Reports(""), 2, fail_fast=False)[0] == [
        ("timeout", 2.0, "[the program's process ended under the test: timeout, exit code None]", "timeout", ""),
        ("timeout", 0.0, "", "", "")]
    # Exiting 0 under a test is a crash, and suspect.
    assert settle(CaseResult("ok", exit_code=0), Reports("[-1, \"passed\", 0, \"\", \"\", \"\"]\n[0]"), 1,
                  fail_fast=True)[0][0][::4] == ("runtime_error", "exited")


# ---- running them -----------------------------------------------------------------------------


@pytest.fixture
def box():
    sandbox = Sandbox(SandboxConfig(wall_seconds=1.0, cpu_seconds=1, fail_fast=False))
    yield sandbox
    sandbox.close()


@needs_root
def test_each_assert_is_a_test_with_its_own_status(box):
    tests = parse_tests({"asserts": ASSERTS})
    got = score_program(box, "def f(x):\n    return 2 * x\n", tests)
    assert statuses(got) == ["passed", "wrong_answer", "runtime_error", "passed"]
    assert (got["reward"], got["tests_passed"], got["tests_total"]) == (0.0, 2, 4)
    assert "assert f(2) == 5" in got["tests"][1].stderr and "AssertionError" in got["tests"][1].stderr
    assert "NameError: name 'g' is not defined" in got["tests"][2].stderr
    assert got["tests"][0].stderr == ""
    good = score_program(box, "def f(x):\n    return 2 * x\ng = bool\n", parse_tests({"asserts": ASSERTS[::2]}))
    assert (good["reward"], statuses(good)) == (1.0, ["passed", "passed"])
    # MBPP's setup (test_imports) runs before the asserts, in the program's namespace.
    setup = parse_tests({"asserts": ["assert math.isclose(f(0.1), 0.2)"], "setup": "import math"})
    assert score_program(box, "def f(x):\n    return 2 * x\n", setup)["reward"] == 1.0


@needs_root
def test_a_check_and_entry_point_is_one_test(box):
    tests = parse_tests({"test": CHECK, "entry_point": "square"})
    assert score_program(box, "def square(x):\n    return x * x\n", tests)["reward"] == 1.0
    wrong = score_program(box, "def square(x):\n    return x * abs(x)\n", tests)
    assert statuses(wrong) == ["wrong_answer"] and "candidate(-3) == 9" in wrong["tests"][0].stderr
    missing = score_program(box, "def cube(x):\n    return x ** 3\n", tests)
    assert statuses(missing) == ["runtime_error"] and "name 'square' is not defined" in missing["tests"][0].stderr


@needs_root
def test_partial_credit_scores_the_fraction_passed_in_every_shape(box):
    asserts = parse_tests({"asserts": ASSERTS})
    assert score_program(box, "def f(x):\n    return 2 * x\n", asserts, partial_credit=True)["reward"] == 0.5
    io = parse_tests({"inputs": ["2", "3", "10"], "outputs": ["4", "9", "100"]})
    program = "n = int(input())\nprint(n * n if n < 10 else 0)"
    assert score_program(box, program, io, partial_credit=True)["reward"] == pytest.approx(2 / 3)
    assert score_program(box, program, io)["reward"] == 0.0  # the default: all or nothing
    assert score_program(box, None, asserts, partial_credit=True)["reward"] == 0.0
    # Through the reward function, with fail_fast (the default): tests not run count as failed.
    reward = CodeReward(SandboxConfig(wall_seconds=1.0, cpu_seconds=1, partial_credit=True))
    try:
        got = reward("```python\ndef f(x):\n    return 2 * x\n```", json.dumps({"asserts": ASSERTS}))
    finally:
        reward.sandbox.close()
    assert (got["reward"], got["tests_passed"], got["tests_runtime_error"], got["tests_not_run"]) == (0.25,) * 4


@needs_root
def test_fail_fast_stops_at_the_first_crash_and_a_program_that_does_not_start_fails_every_test(box):
    tests = parse_tests({"asserts": ASSERTS})
    fast = Sandbox(SandboxConfig(wall_seconds=1.0, cpu_seconds=1, fail_fast=True))
    try:
        got = score_program(fast, "def f(x):\n    return 2 * x\n", tests)
        assert statuses(got) == ["passed", "wrong_answer", "runtime_error", "not_run"]  # a failed assert goes on
        broken = score_program(fast, "import no_such_module\n", tests)
        assert statuses(broken) == ["runtime_error", "not_run", "not_run", "not_run"]
        assert "No module named 'no_such_module'" in broken["tests"][0].stderr
        syntax = score_program(fast, "def f(x) return x", tests)  # refused before any job
        assert statuses(syntax) == ["runtime_error", "not_run", "not_run", "not_run"]
    finally:
        fast.close()
    assert statuses(score_program(box, "import no_such_module\n", tests)) == ["runtime_error"] * 4


@needs_root
@pytest.mark.slow  # 2-3 s of deadlines: the full suite runs it
def test_a_check_that_hangs_or_kills_its_process_costs_that_test_only(box):
    tests = parse_tests({"asserts": ["assert f(0) == 0", "assert f(1) == 1", "assert f(2) == 2", "assert f(3) == 3"]})
    program = """
import os, time
def f(x):
    if x == 1:  # swallows the deadline's exception: the second alarm ends the process
        while True:
            try:
                time.sleep(10)
            except BaseException:
                pass
    if x == 2:
        os._exit(0)  # ends its process mid-test, reporting nothing
    return x
"""
    t0 = time.monotonic()
    got = score_program(box, program, tests)
    assert statuses(got) == ["passed", "timeout", "runtime_error", "passed"]  # the rest ran in new processes
    assert "past 1.0 s" in got["tests"][1].stderr
    assert "process ended under the test: ok, exit code 0" in got["tests"][2].stderr
    assert time.monotonic() - t0 < 1.0 + 0.5 + 2.0


@needs_root
def test_printed_status_lines_cannot_pass_a_test(box):
    # Lines in the checker's report format, on every descriptor the program has, then an exit before
    # any test runs: only the checker holds the descriptor its reports go out on.
    forged = json.dumps([0, "passed", 0.0, "", "", ""]) + "\n"
    program = f"""
import os
for fd in range(1, 8):
    try:
        os.write(fd, {forged.encode()!r})
    except OSError:
        pass
os._exit(0)
"""
    got = score_program(box, program, parse_tests({"asserts": ["assert False"]}))
    assert got["reward"] == 0.0 and statuses(got) == ["not_plain"] and got["suspect"]  # on its reply pipe: forged


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_flow.rewards.code", *args], capture_output=True, text=True,
                          timeout=60)


@needs_root
@pytest.mark.slow  # 3-4 s of starting the command twice: the full suite runs it
def test_the_command_takes_every_shape(tmp_path):
    program = tmp_path / "prog.py"
    program.write_text("def f(x):\n    return 2 * x\n")
    asserts, check = tmp_path / "asserts.json", tmp_path / "check.json"
    asserts.write_text(json.dumps({"asserts": ASSERTS}))
    check.write_text(json.dumps({"test": "def check(candidate):\n    assert candidate(4) == 8\n", "entry_point": "f"}))
    out = cli(str(program), str(asserts), "--partial-credit")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["reward"] == 0.25 and [t["status"] for t in result["tests"]] == ["passed", "wrong_answer",
                                                                                   "runtime_error", "not_run"]
    out = cli(str(program), str(check))
    assert out.returncode == 0 and json.loads(out.stdout)["reward"] == 1.0
    check.write_text(json.dumps({"test": CHECK}))
    out = cli(str(program), str(check))
    assert out.returncode == 2 and f"{check}: input_output: 'entry_point': expected the name" in out.stderr
