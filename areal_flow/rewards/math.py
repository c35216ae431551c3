"""The `math` reward: the completion's final answer checked with math-verify against every reference.

    python -m areal_flow.rewards.math ANSWER_TEXT REFERENCE [--timeout SECONDS]

prints how one completion scores as one JSON object (`reward`, `extracted`, `references`,
`matched`, `seconds`, `hedged`).

The final answer is the content of the completion's last `\\boxed{...}` (or `\\fbox{...}`, or
`\\boxed` followed by one token); without one, the last final-answer line (`The answer is X`,
`Final answer: X`, `Answer: X`, `#### X`); without either the reward is 0. The reference is one
answer, or a JSON list of answers (AReaL's `solutions` field, e.g. `["\\\\boxed{2}", "2"]`); the
reward is 1.0 when any of them matches.

Hedging scores 0 even when the reference is among what the answer offers (`hedged` says why; the
reward node's function, `math_figures`, reports it as `suspect`). A policy rewarded by math-verify
learns whatever it accepts, and it accepts `\\boxed{41 = 42}` for 42 (it reads the last side) and
`2 \\text{ or } 3` for the reference `2, 3`:
- `boxes_differ`: two boxes of the completion (any two, a box in the working included: a box is a
  claim of the final answer, and "wait, no" costs nothing to write) whose texts differ once
  whitespace, spacing commands, `\\left`/`\\right`, `$` and boxes around a box are gone, and
  math-verify does not find equal. The same box twice, or `\\boxed{1/2}` then `\\boxed{0.5}`, is fine.
- `candidates`: the answer says "or" (a word, `\\lor`, `\\vee`), whatever the references, unless a
  reference says "or" too; or, where no reference holds several values (a comma or semicolon, a
  union, a matrix, "and", "or", plus or minus), it lists several at its top level (`2, 3, 5`,
  `2; 3`), says "and", or `\\pm`. A tuple, set or interval (`(1, 2)`, `\\{1, 2\\}`) is one value;
  `1,000` and `1,\\!000` are numbers; a list with prose in it (a final-answer line's `5, which is
  odd`) is a sentence, not candidates.
- `restated`: a `?` in the answer (`17+25=?`), or an equation whose sides without variables differ
  in value (`41 = 42`, `x = 41 = 42`; `17+25 = 42` and `x = 2` are fine).
Not covered, because it needs the question and the function sees only (completion, reference): an
answer that restates the expression asked about (`\\boxed{17+25}` for "What is 17+25?"), which
math-verify evaluates and accepts (telling it from an unsimplified honest answer needs the
question). Only boxes are compared with each other: of several final-answer lines (`The answer is
3`) the last is the answer, as before.

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


def _box_content(text: str, end: int) -> str | None:
    """The content of the box whose command ends at text[end]: its brace group, or one token after
    a space (`\\boxed 42`); None when the group never closes or the box is empty."""
    rest = text[end:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        content = _braced(text, end + len(rest) - len(stripped))
    else:
        token = re.match(r"[^\s$]+", stripped) if rest[:1].isspace() else None
        content = token.group(0).rstrip(".,;") if token else None
    return content.strip() if content and content.strip() else None


def _last_boxed(text: str) -> str | None:
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    # A last box that never closes (a truncated completion) is no answer: an earlier box is a step of
    # the working, not what the model concluded.
    return _box_content(text, matches[-1].end())


def boxes(text: str) -> list[str]:
    """The content of every box of `text` that closes and is not empty, in order (a box inside a box
    counts too)."""
    return [c for m in _BOX_RE.finditer(text) if (c := _box_content(text, m.end())) is not None]


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
    hedged: str | None = None  # why the answer was refused as a hedge (`hedging`); the reward is then 0


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


def _parsed(answer: str) -> list:
    """math-verify's reading of an answer, boxed again so that its extraction takes the whole text
    as one expression."""
    from math_verify import parse  # ~0.7 s import, once: only processes that score math pay

    _quiet_math_verify()
    return parse(f"\\boxed{{{answer}}}", extraction_config=_config(answer), parsing_timeout=None)


def _equal(a: list, b: list) -> bool:
    from math_verify import verify

    return bool(a and b and verify(a, b, timeout_seconds=None))


def _match(extracted: str, references: list[str]) -> str | None:
    """The first reference math-verify finds equal to the extracted answer."""
    from math_verify import parse

    answer = _parsed(extracted)
    for gold in references:
        if not answer:
            break
        # math-verify extracts only from delimited math: a bare gold `1/2` or `x+1` needs `$`.
        gold_parsed = parse(gold if "$" in gold or "\\boxed" in gold else f"${gold}$",
                            extraction_config=_config(gold), parsing_timeout=None)
        if _equal(gold_parsed, answer):
            return gold
    return None


# ---- hedging: answers that offer several values, refused whatever they hold --------------------

# Spacing, sizing and delimiters that do not change a box's value (`\!`, `\,`, `\left`, `$`), and
# whitespace: what two boxes may differ by and still be the same text.
_COSMETIC = re.compile(r"\\(?:left|right|displaystyle)(?![A-Za-z])|\\[,;:! ]|\s+|\$")
# A word "or", `\lor`, `\vee`, `∨`: an answer naming alternatives.
_OR = re.compile(r"(?<![A-Za-z\\])or(?![A-Za-z])|\\(?:lor|vee)(?![A-Za-z])|∨", re.IGNORECASE)
# A word "and", plus or minus: several values, where the reference holds one.
_AND_PM = re.compile(r"(?<![A-Za-z\\])and(?![A-Za-z])|\\(?:pm|mp)(?![A-Za-z])|[±∓]", re.IGNORECASE)
# A thousands separator (`1,000`, `1{,}000`, MATH's `1,\!000`): not a list.
_THOUSANDS = re.compile(r"(?<=\d)(?:,\\!|\{,\}|,)(?=\d{3}(?!\d))")
_EQUALS = re.compile(r"(?<![<>!=:\\])=(?!=)")  # not <=, >=, !=, ==, :=


def _normalised(answer: str) -> str:
    """A box's text with cosmetic differences gone: whitespace, spacing commands, `\\left`/`\\right`,
    `$`, `\\dfrac`/`\\tfrac`, a trailing period, and boxes around it (`\\boxed{\\boxed{3}}`)."""
    text = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", _COSMETIC.sub("", answer)).rstrip(".")
    while ((m := _BOX_RE.match(text)) and text[m.end():m.end() + 1] == "{"
           and _braced(text, m.end()) == text[m.end() + 1:-1]):
        text = text[m.end() + 1:-1].rstrip(".")
    return text


def _top_level(text: str, separator: re.Pattern) -> list[str]:
    """`text` split at the matches of `separator` outside every bracket, brace, parenthesis and
    environment (`\\{`, `\\left(` and `\\begin{pmatrix}` count; an interval's `[0, 1)` closes with
    either); escaped characters (`\\,`) are never separators."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        c = text[i]
        if c == "\\":
            if text[i + 1:i + 2] in ("{", "}"):
                depth += 1 if text[i + 1] == "{" else -1
            elif text.startswith(("\\begin{", "\\end{"), i):
                depth += 1 if text[i + 1] == "b" else -1
            i += 2
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and (m := separator.match(text, i)):
            parts.append(text[start:i])
            start = i = m.end()
            continue
        i += 1
    return [*parts, text[start:]]


_LIST = re.compile(r"[,;]")
# Words in a command's argument (`\text{ cm}`, `\begin{pmatrix}`), which are no prose of the answer's own.
_COMMAND_WORDS = re.compile(r"\\(?:text[a-z]*|math[a-z]*|mbox|operatorname)\s*\{[^{}]*\}"
                            r"|\\[A-Za-z]+\*?(?:\{[A-Za-z*]*\})?")
_PROSE_WORD = re.compile(r"(?<![A-Za-z])(?!(?:and|or)(?![A-Za-z]))[A-Za-z]{3,}")


def _many_valued(reference: str) -> bool:
    """Whether a reference holds several values: a list, tuple, set or interval (a comma or a
    semicolon anywhere, thousands separators aside), a union, a matrix or vector, "and", "or", plus
    or minus."""
    text = _THOUSANDS.sub("", reference)
    return bool(re.search(r"(?<!\\)[,;]|\\(?:cup|begin)(?![A-Za-z])", text) or _OR.search(text)
                or _AND_PM.search(text))


def _candidates(answer: str, references: list[str]) -> bool:
    """An answer that names alternatives ("or", `\\lor`: always, unless a reference says "or" too),
    or, where no reference holds several values, one with two or more items at its top level
    (`2, 3`, `2; 3`), "and", or plus or minus. A list with prose in it (a final-answer line's
    `5, which is odd`) is a sentence, not candidates."""
    if _OR.search(answer) and not any(_OR.search(r) for r in references):
        return True
    if any(_many_valued(r) for r in references) or _PROSE_WORD.search(_COMMAND_WORDS.sub(" ", answer)):
        return False
    items = [item for item in _top_level(_THOUSANDS.sub("", answer), _LIST) if item.strip()]
    return len(items) > 1 or bool(_AND_PM.search(answer))


def _constant(parsed: list) -> bool:
    """Whether math-verify read a value with no variable and no unknown function in it."""
    from sympy import Basic
    from sympy.core.function import AppliedUndef

    expr = parsed[0] if parsed else None
    return isinstance(expr, Basic) and not expr.free_symbols and not expr.atoms(AppliedUndef)


def _false_equation(answer: str) -> bool:
    """An item of the answer (between top-level commas) written `a = b` where two sides without
    variables differ in value, per math-verify (`41 = 42`: math-verify would take the 42)."""
    for item in _top_level(answer, _LIST):
        sides = _top_level(item, _EQUALS)
        if len(sides) < 2:
            continue
        values = [p for side in sides if side.strip() and _constant(p := _parsed(side.strip()))]
        if any(not _equal(a, b) for i, a in enumerate(values) for b in values[i + 1:]):
            return True
    return False


def _boxes_differ(completion: str, extracted: str) -> bool:
    """Whether a box of the completion holds a value other than the final answer's: different text
    (after `_normalised`) that math-verify does not find equal."""
    final = _normalised(extracted)
    others = {n for box in boxes(completion) if (n := _normalised(box)) and n != final}
    if not others:
        return False
    answer = _parsed(extracted)
    return any(not _equal(answer, _parsed(other)) for other in sorted(others))


def hedging(completion: str, extracted: str, references: list[str]) -> str | None:
    """Why the completion's final answer is refused as a hedge, or None: `boxes_differ` (boxes with
    different values), `candidates` (alternatives, or a list where the references hold one value),
    `restated` (a question mark, or an equation whose sides differ in value). Uses math-verify: call
    it under the deadline."""
    if _boxes_differ(completion, extracted):
        return "boxes_differ"
    if _candidates(extracted, references):
        return "candidates"
    if "?" in extracted or _false_equation(extracted):
        return "restated"
    return None


def score(completion: str, reference: str, timeout: float = DEFAULT_TIMEOUT) -> MathScore:
    """The reward with what led to it (what the debug command prints)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("the math reward must run in a process's main thread: its deadline is a SIGALRM "
                           "timer")
    start = time.monotonic()
    references = parse_references(reference)
    extracted = extract_answer(completion)
    matched = hedged = None
    if extracted is not None:
        try:
            with _deadline(timeout):
                hedged = hedging(completion, extracted, references)
                if hedged is None:
                    matched = _match(extracted, references)
        except _OutOfTime:
            matched = None
    return MathScore(1.0 if matched is not None else 0.0, extracted, references, matched,
                     time.monotonic() - start, hedged)


def math_reward(completion: str, reference: str, timeout: float = DEFAULT_TIMEOUT) -> float:
    """1.0 when the completion's final answer equals any reference answer per math-verify and is no
    hedge, else 0.0."""
    return score(completion, reference, timeout).reward


def math_figures(completion: str, reference: str, timeout: float = DEFAULT_TIMEOUT) -> dict[str, float]:
    """The `math` reward function of a reward node: the reward, and `suspect`, 1.0 when the answer was
    refused as a hedge (logged per step as `reward/<node>_suspect`)."""
    result = score(completion, reference, timeout)
    return {"reward": result.reward, "suspect": 1.0 if result.hedged else 0.0}


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
