"""The `math` reward: answer extraction, math-verify's equivalences, timeouts and the debug command.
pytest runs tests in the main thread, where the reward's SIGALRM deadline works."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from areal_flow.rewards.functions import REWARD_FNS
from areal_flow.rewards.math import (
    _deadline,
    _OutOfTime,
    boxes,
    extract_answer,
    math_figures,
    math_reward,
    parse_references,
    score,
)

REPO = Path(__file__).resolve().parents[2]


# ---- extraction ---------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, expected", [
    ("so x = \\boxed{5}.", "5"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("first \\boxed{1}, then \\boxed{2}", "2"),
    ("\\fbox{7}", "7"),
    ("$\\boxed 42$", "42"),
    ("\\boxed 42.", "42"),
    ("\\boxed {3}", "3"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("\\boxed{\\left( \\frac{a}{b^{2}} \\right)}", "\\left( \\frac{a}{b^{2}} \\right)"),
    ("The answer is 12.", "12"),
    ("The answer is 12. I hope that helps.", "12"),
    ("The final answer is $\\frac{3}{4}$.", "\\frac{3}{4}"),
    ("**Final Answer:** 8", "8"),
    ("Final answer: x+1", "x+1"),
    ("7+8=15\n#### 15", "15"),
    ("Answer: 3\nwait, no.\nAnswer: 4", "4"),
    ("The answer is 3.\n#### 9", "9"),
])
def test_extracts_the_last_final_answer(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize("completion", [
    "",
    "I think it is five.",
    "an answer is needed",
    "\\boxed{}",
    "\\boxed{1} and then \\boxed{\\frac{1}{2",  # the last box never closes: truncated
    "Answer: \\boxed{3",                           # a box wins over a final-answer line, even unclosed
])
def test_no_final_answer_is_none(completion):
    assert extract_answer(completion) is None


# ---- references ---------------------------------------------------------------------------------

def test_references_are_one_answer_or_a_json_list():
    assert parse_references("2") == ["2"]
    assert parse_references('["\\\\boxed{2}", "2"]') == ["\\boxed{2}", "2"]
    assert parse_references('["2", 3]') == ["2", "3"]
    assert parse_references("[0, 1)") == ["[0, 1)"]  # an interval, not a list
    assert parse_references("[1, 2]") == ["[1, 2]"]
    for bad in ('["2", ', "[]", '["2", null]', '["2", ["3"]]'):
        with pytest.raises(ValueError, match="reference"):
            parse_references(bad)


# ---- verification -------------------------------------------------------------------------------

def boxed(answer: str) -> str:
    return f"Working it out, the result is \\boxed{{{answer}}}."


@pytest.mark.parametrize("answer, reference", [
    ("0.5", "\\frac{1}{2}"),
    ("\\frac{1}{2}", "0.5"),
    ("\\frac12", "\\frac{1}{2}"),
    ("\\dfrac{3}{4}", "0.75"),
    ("(x+1)^2", "x^2+2x+1"),
    ("b+a", "a+b"),
    ("3", "\\boxed{3}"),
    ("\\boxed{3}", "3"),          # a box inside the box
    ("\\{3, 1, 2\\}", "\\{1,2,3\\}"),  # sets compare unordered
    ("2, 1", "1, 2"),              # so do comma-separated answers (math-verify reads them as sets)
    ("1,000", "1000"),
    ("x = 2", "2"),
    ("50", "50\\%"),               # the gold's percent sign is dropped
    ("50\\%", "50\\%"),            # a boxed percent does not parse; it matches the gold as the same string
    ("7", '["\\\\boxed{2}", "7"]'),
    ("7", '["7", "\\\\boxed{2}"]'),
])
def test_equivalent_answers_score_one(answer, reference):
    reward = math_reward(boxed(answer), reference)
    assert reward == 1.0 and type(reward) is float


@pytest.mark.parametrize("answer, reference", [
    ("3", "4"),
    ("x+1", "x+2"),
    ("0.5", "\\frac{1}{3}"),
    ("(2, 1)", "(1, 2)"),          # tuples (points) are ordered
    ("5", '["\\\\boxed{2}", "7"]'),
    ("50\\%", "50"),               # math-verify 0.9.0 cannot parse `\boxed{50\%}`: pinned, a known gap
    ("50\\%", "0.5"),
])
def test_wrong_answers_score_zero(answer, reference):
    assert math_reward(boxed(answer), reference) == 0.0


def test_a_trailing_letter_after_a_digit_is_a_variable_not_a_unit():
    """math-verify 0.9.0 strips a trailing unit, and its list holds t, s, m, h, g, l, c, d, ...: left
    alone, `2+3t` reads as 2+3. A single bare letter after a digit or a brace is kept as a variable."""
    assert math_reward(boxed("2+3t"), "5") == 0.0          # was a false positive
    assert math_reward(boxed("3t+2"), "2+3t") == 1.0       # was a false negative
    assert math_reward(boxed("\\frac{1}{2}t"), "t/2") == 1.0
    assert math_reward(boxed("7s"), "7") == 0.0
    assert math_reward(boxed("3x+2"), "2+3x") == 1.0


@pytest.mark.parametrize("answer", ["5 cm", "5\\text{ cm}", "5\\text{m}", "5 \\mathrm{cm}", "5 meters", "5 \\text{ hours}"])
def test_units_written_as_words_or_text_are_still_dropped(answer):
    assert math_reward(boxed(answer), "5") == 1.0


def test_final_answer_lines_are_verified_too():
    assert math_reward("The answer is $\\frac{1}{2}$.", "0.5") == 1.0
    assert math_reward("7+8=15\n#### 15", "15") == 1.0


def test_no_answer_scores_zero():
    assert math_reward("1/2, I think", "\\frac{1}{2}") == 0.0
    assert math_reward("\\boxed{\\frac{1}{2", "\\frac{1}{2}") == 0.0


def test_the_score_names_the_reference_that_matched():
    result = score(boxed("0.5"), '["\\\\frac{1}{3}", "\\\\frac{1}{2}", "0.5"]')
    assert (result.reward, result.extracted, result.matched) == (1.0, "0.5", "\\frac{1}{2}")
    assert result.references == ["\\frac{1}{3}", "\\frac{1}{2}", "0.5"]


def test_a_malformed_reference_list_raises():
    with pytest.raises(ValueError, match="JSON list"):
        math_reward(boxed("2"), '["2", ')


def test_registered_as_math_with_a_suspect_figure():
    assert REWARD_FNS["math"] is math_figures
    assert "math_verify" not in REWARD_FNS
    # The same keys on every call, right, wrong, hedged or without an answer.
    assert math_figures(boxed("2"), "2") == {"reward": 1.0, "suspect": 0.0}
    assert math_figures(boxed("3"), "2") == {"reward": 0.0, "suspect": 0.0}
    assert math_figures(boxed("2 \\text{ or } 3"), "2") == {"reward": 0.0, "suspect": 1.0}
    assert math_figures("no idea", "2") == {"reward": 0.0, "suspect": 0.0}


# ---- hedging: an answer that offers several values scores 0, the reference among them or not -------

def hedged(completion: str, reference: str) -> str | None:
    result = score(completion, reference)
    assert result.hedged is None or (result.reward, result.matched) == (0.0, None)
    return result.hedged


def test_boxes_collects_every_closed_box():
    assert boxes("\\boxed{1} then \\fbox{2}, \\boxed 3 and \\boxed{} and \\boxed{\\boxed{4}} \\boxed{5") == [
        "1", "2", "3", "\\boxed{4}", "4"]


@pytest.mark.parametrize("completion, reference", [
    ("It is \\boxed{2} or maybe \\boxed{3}.", "2"),
    ("It is \\boxed{3} or maybe \\boxed{2}.", "2"),                   # the last box right: still a hedge
    ("\\fbox{5} ... \\boxed{2}", "2"),
    ("\\boxed{\\boxed{2} \\boxed{3}}", "2"),                             # boxes inside a box
    ("x = \\boxed{3}? No: recomputing, x = \\boxed{2}.", "2"),          # a wrong box in the working counts
])
def test_boxes_with_different_values_are_a_hedge(completion, reference):
    assert math_reward(completion, reference) == 0.0
    assert hedged(completion, reference) == "boxes_differ"


@pytest.mark.parametrize("completion, reference", [
    ("\\boxed{2, 3, 5}", "2"),
    ("\\boxed{2; 3}", "2"),
    ("\\boxed{x = 2, x = 3}", "2"),
    ("\\boxed{2 \\text{ or } 3}", "2"),
    ("\\boxed{2 \\lor 3}", "2"),
    ("\\boxed{2 \\vee 3}", "2"),
    ("\\boxed{2 \\text{ and } 3}", "2"),
    ("\\boxed{\\pm 2}", '["2", "-2"]'),                                  # each reference is one value
    ("The answer is 2 or 3.", "2"),                                       # a final-answer line too
    ("\\boxed{2 \\text{ or } 3}", "2, 3"),                                # "or" is a hedge even for a list
    ("\\boxed{x = 2 \\text{ or } x = 3}", "2, 3"),                         # (math-verify accepts both)
])
def test_candidates_where_the_reference_is_one_value_are_a_hedge(completion, reference):
    assert math_reward(completion, reference) == 0.0
    assert hedged(completion, reference) == "candidates"


@pytest.mark.parametrize("completion, reference", [
    ("\\boxed{41 = 42}", "42"),                                          # math-verify takes the 42
    ("\\boxed{x = 41 = 42}", "42"),
    ("\\boxed{? = 42}", "42"),                                            # math-verify takes the 42
    ("\\boxed{17+25=?}", "42"),
    ("The answer is 41 = 42", "42"),
])
def test_a_question_or_a_false_equation_is_a_restated_answer(completion, reference):
    assert math_reward(completion, reference) == 0.0
    assert hedged(completion, reference) == "restated"


@pytest.mark.parametrize("completion, reference", [
    ("The result is \\boxed{2}.", "2"),                                    # a single right box
    ("So \\boxed{2}. Checking: 1+1 = 2, so indeed \\boxed{ 2 }.", "2"),    # the same box twice
    ("\\boxed{\\frac{1}{2}}, that is \\boxed{\\dfrac12}", "0.5"),           # same text once normalised
    ("\\boxed{1/2}, that is \\boxed{0.5}", "0.5"),                         # different text, equal per math-verify
    ("\\boxed{\\boxed{3}}", "3"),
    ("\\boxed{\\left( 1, 2 \\right)} or, written plainly, \\boxed{(1,2)}", "(1, 2)"),
    ("Put the answer in \\boxed{} as asked: \\boxed{5}", "5"),              # an empty box is no value
    ("\\boxed{3, 2}", "2, 3"),                                               # a list for a list
    ("\\boxed{x = 2, y = 3}", "(2, 3)"),
    ("\\boxed{(1, 2)}", "(1, 2)"),                                           # a tuple is one value
    ("\\boxed{\\{1, 2\\}}", "\\{1,2\\}"),
    ("\\boxed{[0, 1)}", "[0, 1)"),
    ("\\boxed{1,000}", "1000"),                                              # thousands, not a list
    ("\\boxed{10,\\!000}", "10000"),
    ("\\boxed{\\pm 2}", "\\pm 2"),
    ("\\boxed{17+25 = 42}", "42"),                                           # an equation that holds
    ("\\boxed{x = 2}", "2"),
    ("\\boxed{f(2) = 5}", "5"),
])
def test_honest_answers_are_no_hedge(completion, reference):
    assert hedged(completion, reference) is None
    assert math_reward(completion, reference) == 1.0


@pytest.mark.parametrize("completion, reference", [
    ("The answer is 5, which is odd.", "5"),     # prose after a comma: no candidates (math-verify reads no 5)
    ("Final answer: 5 apples and 3 pears", "5"),
    ("\\boxed{3}", "4"),
])
def test_wrong_or_unreadable_answers_are_not_called_hedges(completion, reference):
    assert hedged(completion, reference) is None and math_reward(completion, reference) == 0.0


def test_an_unevaluated_question_is_not_covered():
    """`\\boxed{17+25}` for "What is 17+25?" restates the question, but the reward never sees the
    question: math-verify evaluates the sum and it scores 1 (docs/rewards.md)."""
    assert hedged("\\boxed{17+25}", "42") is None and math_reward("\\boxed{17+25}", "42") == 1.0


@pytest.mark.parametrize("answer", [
    "9^{9^{9^{9^{9}}}}",                             # the comparison evaluates the tower: > 40 s untimed
    "+".join(f"x^{{{i}}}" for i in range(3000)),    # the parse alone takes > 2 s
], ids=["power tower", "3000-term sum"])
def test_a_pathological_answer_times_out_and_scores_zero(answer):
    start = time.monotonic()
    # Three references: the deadline covers the whole call, not each of them in turn.
    assert math_reward(boxed(answer), '["5", "6", "7"]', timeout=1) == 0.0
    assert time.monotonic() - start < 1 + 1.5


def test_the_deadline_rings_again_when_an_alarm_is_lost():
    # CPython drops an exception raised inside a weakref callback (it happens during garbage collection
    # in math-verify's parse); the code below swallows the first alarm the same way.
    start = time.monotonic()
    rings = []
    with pytest.raises(_OutOfTime):
        with _deadline(0.2):
            try:
                while True:
                    pass
            except _OutOfTime:
                rings.append(time.monotonic() - start)
            while True:  # only a second alarm ends this
                pass
    assert len(rings) == 1 and 0.2 <= rings[0] < 0.5
    assert time.monotonic() - start < rings[0] + 0.4
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_refuses_to_run_outside_the_main_thread():
    raised = []
    thread = threading.Thread(target=lambda: raised.append(pytest.raises(RuntimeError, math_reward, "x", "1")))
    thread.start()
    thread.join()
    assert raised and "main thread" in str(raised[0].value)


# ---- the debug command --------------------------------------------------------------------------

def run_command(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "areal_flow.rewards.math", *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env=env, check=False)


def test_command_prints_one_json_object():
    proc = run_command("so \\boxed{\\frac{1}{2}}", '["\\\\frac{1}{3}", "0.5"]')
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["reward"] == 1.0 and isinstance(out["reward"], float)
    assert out["extracted"] == "\\frac{1}{2}"
    assert out["references"] == ["\\frac{1}{3}", "0.5"]
    assert out["matched"] == "0.5"
    assert out["hedged"] is None


def test_command_prints_why_an_answer_is_a_hedge():
    proc = run_command("\\boxed{2} or \\boxed{3}", "3")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert (out["reward"], out["extracted"], out["matched"], out["hedged"]) == (0.0, "3", None, "boxes_differ")


def test_command_exits_zero_for_a_wrong_or_missing_answer():
    wrong, missing = run_command("\\boxed{3}", "4"), run_command("no idea", "4", "--timeout", "2")
    assert (wrong.returncode, missing.returncode) == (0, 0)
    assert json.loads(wrong.stdout) == {**json.loads(wrong.stdout), "reward": 0.0, "extracted": "3", "matched": None}
    assert json.loads(missing.stdout)["extracted"] is None and json.loads(missing.stdout)["reward"] == 0.0


@pytest.mark.parametrize("args, named", [
    (["only one"], "REFERENCE"),
    (["a", "b", "c"], "unrecognized arguments"),
    (["\\boxed{2}", '["2", '], "REFERENCE"),
    (["\\boxed{2}", "2", "--timeout", "0"], "--timeout"),
])
def test_command_refuses_bad_input_with_status_2(args, named):
    proc = run_command(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert named in proc.stderr


def test_importing_the_module_has_no_side_effects():
    check = "import sys, areal_flow.rewards.math; assert 'math_verify' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60, cwd=REPO,
                          check=False)
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr
