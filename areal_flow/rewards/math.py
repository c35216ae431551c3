"""The `math` reward: the completion's final answer checked with math-verify against every reference.

    python -m areal_flow.rewards.math ANSWER_TEXT REFERENCE [--timeout SECONDS]

prints how one completion scores as one JSON object (`reward`, `extracted`, `references`,
`matched`, `seconds`).

The final answer is the content of the completion's last `\\boxed{...}` (or `\\fbox{...}`, or
`\\boxed` followed by one token); without one, the last final-answer line (`The answer is X`,
`Final answer: X`, `Answer: X`, `#### X`); without either the reward is 0. The reference is one
answer, or a JSON list of answers (AReaL's `solutions` field, e.g. `["\\\\boxed{2}", "2"]`); the
reward is 1.0 when any of them matches.

Timeouts: one call gets `timeout` seconds in all (parsing the answer and every reference, and the
comparisons); when they run out the answer scores 0. The deadline is a SIGALRM timer, which works
only in the main thread of a process, so the reward runs in the reward worker processes' main thread
(and the controller's, for evaluation); called from another thread it raises RuntimeError. The timer
is this module's, not math-verify's own `signal.alarm`: a single alarm can be lost (raised while
CPython runs a weakref callback, e.g. during garbage collection, the exception is reported as
unraisable and the parse carries on for as long as it takes), so ours rings again every 0.1 s until
the call gives up.

Known gaps of math-verify 0.9.0, pinned in tests/rewards/test_math_reward.py: a boxed percent
(`\\boxed{50\\%}`) does not parse, so it matches only the reference `50\\%` itself.

Units: math-verify drops a trailing unit, and its list holds single letters (t, s, m, h, g, l, c,
d, ...), so `2+3t` would read as 5 and match the reference 5. Here a single bare letter right after
a digit at the end of an answer (or reference) is a variable: that text is parsed with unit removal
off. Units written as words or in `\\text{}` (`5 cm`, `5\\text{ cm}`, `3 hours`) are still dropped;
`5m` for five metres no longer matches `5`.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

DEFAULT_TIMEOUT = 3.0  # seconds; an ordinary answer verifies in milliseconds
_RING_AGAIN = 0.1  # seconds between alarms once the deadline has passed

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# One final-answer marker per alternative; each captures the rest of its line.
_FINAL_LINE_RE = re.compile(
    r"####[ \t]*(?P<hash>[^\n]*)"
    r"|(?:\bthe[ \t]+)?\bfinal[ \t]+answer\**[ \t]*(?:is\b)?[ \t]*\**[ \t]*:?(?P<final>[^\n]*)"
    r"|\bthe[ \t]+answer[ \t]+is\b[ \t]*:?(?P<is>[^\n]*)"
    r"|\banswer\**[ \t]*:(?P<colon>[^\n]*)",
    re.IGNORECASE,
)
_JSON_LIST_RE = re.compile(r"\s*\[\s*(?:\"|\])")  # `["...` or `[]`; an interval like `[0, 1)` is an answer


def _braced(text: str, start: int) -> str | None:
    """The content of the brace group opening at text[start]; None when it never closes. Escaped
    braces (`\\{`, `\\}`, as in a set) do not count."""
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
        i += 1
    return None


def _last_boxed(text: str) -> str | None:
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    end = matches[-1].end()
    rest = text[end:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        # A last box that never closes (a truncated completion) is no answer: an earlier box is a
        # step of the working, not what the model concluded.
        content = _braced(text, end + len(rest) - len(stripped))
    else:
        token = re.match(r"[^\s$]+", stripped) if rest[:1].isspace() else None
        content = token.group(0).rstrip(".,;") if token else None
    return content.strip() if content and content.strip() else None


def _clean_final(value: str) -> str:
    value = re.split(r"\.\s", value.strip(), maxsplit=1)[0]  # "5. That is all." -> "5"
    value = value.strip().strip("*").strip().rstrip(".").strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if value.startswith(left) and value.endswith(right) and len(value) >= len(left) + len(right):
            value = value[len(left):len(value) - len(right)].strip()
            break
    return value


def extract_answer(completion: str) -> str | None:
    """The completion's final answer as text: the last box's content, else the last final-answer
    line's value, else None."""
    boxed = _last_boxed(completion)
    if boxed is not None or _BOX_RE.search(completion):
        return boxed
    for match in reversed(list(_FINAL_LINE_RE.finditer(completion))):
        value = _clean_final(next(v for v in match.groupdict().values() if v is not None))
        if value:
            return value
    return None


def parse_references(reference: str) -> list[str]:
    """One reference answer, or the answers of a JSON list of strings. A malformed list is a data
    error, not a wrong completion, so it raises ValueError instead of scoring every sample 0."""
    if not _JSON_LIST_RE.match(reference):
        return [reference]
    try:
        items = json.loads(reference)
    except json.JSONDecodeError as e:
        raise ValueError(f"reference looks like a JSON list but does not parse ({e}): {reference!r}") from None
    if not isinstance(items, list) or not items:
        raise ValueError(f"reference is an empty JSON list: {reference!r}")
    if not all(isinstance(item, (str, int, float)) and not isinstance(item, bool) for item in items):
        raise ValueError(f"reference JSON list holds something other than strings and numbers: {reference!r}")
    return [str(item) for item in items]


@dataclass
class MathScore:
    reward: float
    extracted: str | None
    references: list[str]
    matched: str | None
    seconds: float


# A digit or a closing brace, then one letter that is not part of a word or a command, at the end:
# `3t`, `2+3 t`, `\frac{1}{2}t` (what math-verify's unit pattern would take for a unit).
_TRAILING_VARIABLE = re.compile(r"[\d}]\s*[A-Za-z]\W*$")


@functools.cache
def _configs(units: bool) -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig
    from latex2sympy2_extended.math_normalization import NormalizationConfig

    # math-verify's defaults, with unit removal as asked.
    normalization = NormalizationConfig(basic_latex=True, units=units, malformed_operators=True, nits=True,
                                        boxed="all", equations=False)
    return [LatexExtractionConfig(try_extract_without_anchor=True, boxed_match_priority=50,
                                  normalization_config=normalization),
            ExprExtractionConfig(try_extract_without_anchor=True)]


def _config(text: str) -> list:
    """math-verify's extraction settings for `text`: without unit removal when it ends in a variable."""
    return _configs(units=_TRAILING_VARIABLE.search(text) is None)


class _OutOfTime(BaseException):
    """The deadline passed. A BaseException, so math-verify's `except Exception` clauses let it through."""


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise _OutOfTime in the main thread once `seconds` have passed, and every 0.1 s after until the
    block is left: an exception raised inside a weakref callback is dropped, so one alarm is not enough."""
    def ring(signum, frame):
        raise _OutOfTime

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds, _RING_AGAIN)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _NoTimeoutWarning(logging.Filter):
    """math-verify warns once that its own timeouts are off; here the deadline is ours."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


@functools.cache
def _quiet_math_verify() -> None:
    """Once per process: drop math-verify's warning that its own timeouts are off."""
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_NoTimeoutWarning())


def _match(extracted: str, references: list[str]) -> str | None:
    """The first reference math-verify finds equal to the extracted answer."""
    from math_verify import parse, verify  # ~0.7 s import, once: only processes that score math pay

    _quiet_math_verify()
    # Boxed again so that math-verify's own extraction takes the whole answer as one expression.
    answer = parse(f"\\boxed{{{extracted}}}", extraction_config=_config(extracted), parsing_timeout=None)
    for gold in references:
        if not answer:
            break
        # math-verify extracts only from delimited math: a bare gold `1/2` or `x+1` needs `$`.
        gold_parsed = parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$",
                            extraction_config=_config(gold), parsing_timeout=None)
        if verify(gold_parsed, answer, timeout_seconds=None):
            return gold
    return None


def score(completion: str, reference: str, timeout: float = DEFAULT_TIMEOUT) -> MathScore:
    """The reward with what led to it (what the debug command prints)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("the math reward must run in a process's main thread: its deadline is a SIGALRM "
                           "timer")
    start = time.monotonic()
    references = parse_references(reference)
    extracted = extract_answer(completion)
    matched = None
    if extracted is not None:
        try:
            with _deadline(timeout):
                matched = _match(extracted, references)
        except _OutOfTime:
            matched = None
    return MathScore(1.0 if matched is not None else 0.0, extracted, references, matched,
                     time.monotonic() - start)


def math_reward(completion: str, reference: str, timeout: float = DEFAULT_TIMEOUT) -> float:
    """1.0 when the completion's final answer equals any reference answer per math-verify, else 0.0."""
    return score(completion, reference, timeout).reward


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds > 0")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m areal_flow.rewards.math",
        description="Score one completion with the math reward and print the details as one JSON object. "
                    "Exits 0 whatever the reward; 2 for bad arguments.",
        epilog="An argument that starts with '-' (other than a number) goes after '--'.")
    ap.add_argument("answer_text", metavar="ANSWER_TEXT", help="the completion, e.g. 'so \\boxed{1/2}'")
    ap.add_argument("reference", metavar="REFERENCE", help="a reference answer, or a JSON list of them")
    ap.add_argument("--timeout", type=_seconds, metavar="SECONDS", default=DEFAULT_TIMEOUT,
                    help=f"seconds for the whole check; past them the answer scores 0 (default {DEFAULT_TIMEOUT:g})")
    args = ap.parse_args(argv)
    try:
        parse_references(args.reference)
    except ValueError as e:
        ap.error(f"argument REFERENCE: {e}")
    result = score(args.answer_text, args.reference, args.timeout)
    print(json.dumps({**asdict(result), "seconds": round(result.seconds, 4)}, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
