"""The function shapes of the tiny_code task (areal_flow/data/tiny_code.py), family by family.

An op is a name pattern, the code a solution writes and, written separately, its meaning: the tests
are computed from the meaning, so a test that runs the reference code against them checks the code.
Its constants are listed rather than drawn, so how many problems a shape has is known (the held-out
set takes at most a quarter of any shape) and a neighbour (one constant moved) can be built.

Names carry the intent and every constant (`add_3`, `keep_gt_4`, `count_in_aei`), so a name fixes
the function: the examples of a prompt disambiguate, they do not carry the whole burden.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import string
from typing import Any, Callable

LETTERS = tuple(string.ascii_lowercase)
# The parameter(s) of an op, and the types a prompt's signature line shows for them.
PARAM_TYPES = {"x": "int", "n": "int", "a, b": "int, int", "s": "str", "xs": "list[int]"}
# The variable a composition keeps a value of each type in; a bool is only ever returned.
VARIABLE = {"int": "x", "str": "s", "list[int]": "xs"}


def K(lo: int, hi: int) -> tuple[int, ...]:
    return tuple(range(lo, hi + 1))


@dataclasses.dataclass(frozen=True, eq=False)  # ops are told apart by identity: a composition never repeats one
class Op:
    name: str  # format over the constants: the function's name, or its part of a composition's
    code: str  # an expression of {v} (one line, returned), or with block=True a function body
    fn: Callable[..., Any]  # the meaning: fn(*arguments, **constants)
    src: str  # the parameter(s): a key of PARAM_TYPES
    dst: str  # the return type: int, bool, str or list[int]
    consts: dict[str, tuple] = dataclasses.field(default_factory=dict)
    difficulty: int = 1
    block: bool = False
    valid: Callable[..., bool] | None = None  # a constraint between the constants

    @functools.cached_property  # a frozen dataclass still takes it: it writes __dict__, not setattr
    def choices(self) -> list[dict[str, Any]]:
        """Every valid assignment of the constants: the op's problems, one each (computed once)."""
        names = list(self.consts)
        combos = (dict(zip(names, values)) for values in itertools.product(*self.consts.values()))
        return [c for c in combos if self.valid is None or self.valid(**c)]


def _acc(cond: str, inc: str) -> str:
    """A loop that adds `inc` to an accumulator for each x of xs meeting `cond`."""
    return f"t = 0\nfor x in xs:\n    if {cond}:\n        t += {inc}\nreturn t"


LOOP_INDEX = "for i in range(len(xs)):\n    if xs[i] == {k}:\n        return i\nreturn -1"
LOOP_BELOW = "t = 0\nfor i in range(n):\n    if i % {k} == 0:\n        t += i\nreturn t"
LOOP_POW = "p = 1\nfor i in range(n):\n    p *= {k}\nreturn p"
LOOP_IN = "t = 0\nfor c in s:\n    if c in '{w}':\n        t += 1\nreturn t"
PAIRS = tuple(a + b for a in LETTERS for b in LETTERS)
# Two or three distinct letters in order, from the first ten (a set spelled one way only).
LETTER_SETS = tuple("".join(c) for n in (2, 3) for c in itertools.combinations("abcdefghij", n))

ARITHMETIC = (
    Op("add_{k}", "{v} + {k}", lambda x, k: x + k, "x", "int", {"k": K(1, 99)}),
    Op("sub_{k}", "{v} - {k}", lambda x, k: x - k, "x", "int", {"k": K(1, 99)}),
    Op("sub_from_{k}", "{k} - {v}", lambda x, k: k - x, "x", "int", {"k": K(1, 99)}),
    Op("mul_{k}", "{v} * {k}", lambda x, k: x * k, "x", "int", {"k": K(2, 30)}),
    Op("div_{k}", "{v} // {k}", lambda x, k: x // k, "x", "int", {"k": K(2, 30)}),
    Op("mod_{k}", "{v} % {k}", lambda x, k: x % k, "x", "int", {"k": K(2, 30)}),
    Op("times_{a}_plus_{b}", "{v} * {a} + {b}", lambda x, a, b: x * a + b, "x", "int",
       {"a": K(2, 9), "b": K(1, 20)}, 2),
    Op("square_plus_{k}", "{v} * {v} + {k}", lambda x, k: x * x + k, "x", "int", {"k": K(1, 50)}, 2),
    Op("sum_times_{k}", "(a + b) * {k}", lambda a, b, k: (a + b) * k, "a, b", "int", {"k": K(2, 30)}, 2),
    Op("diff_plus_{k}", "a - b + {k}", lambda a, b, k: a - b + k, "a, b", "int", {"k": K(1, 99)}, 2),
)

CONDITIONALS = (
    Op("is_mult_{k}", "{v} % {k} == 0", lambda x, k: x % k == 0, "x", "bool", {"k": K(2, 30)}, 2),
    Op("is_gt_{k}", "{v} > {k}", lambda x, k: x > k, "x", "bool", {"k": K(0, 50)}, 2),
    Op("is_lt_{k}", "{v} < {k}", lambda x, k: x < k, "x", "bool", {"k": K(0, 50)}, 2),
    Op("is_between_{a}_{b}", "{a} <= {v} <= {b}", lambda x, a, b: a <= x <= b, "x", "bool",
       {"a": K(0, 30), "b": K(2, 40)}, 3, valid=lambda a, b: a + 2 <= b <= a + 20),
    Op("clip_{k}", "{k} if {v} > {k} else {v}", lambda x, k: min(x, k), "x", "int", {"k": K(0, 50)}, 2),
    Op("at_least_{k}", "{k} if {v} < {k} else {v}", lambda x, k: max(x, k), "x", "int", {"k": K(0, 50)}, 2),
    Op("add_{k}_if_even", "{v} + {k} if {v} % 2 == 0 else {v}", lambda x, k: x + k if x % 2 == 0 else x,
       "x", "int", {"k": K(1, 50)}, 3),
    Op("double_if_gt_{k}", "{v} * 2 if {v} > {k} else {v}", lambda x, k: 2 * x if x > k else x,
       "x", "int", {"k": K(0, 50)}, 3),
    Op("big_if_gt_{k}", "'big' if {v} > {k} else 'small'", lambda x, k: "big" if x > k else "small",
       "x", "str", {"k": K(0, 50)}, 3),
    Op("first_or_{k}", "{v}[0] if {v} else {k}", lambda xs, k: xs[0] if xs else k, "xs", "int", {"k": K(0, 50)}, 3),
    Op("pick_gt_{k}", "a if a > {k} else b", lambda a, b, k: a if a > k else b, "a, b", "int", {"k": K(0, 50)}, 3),
)

STRINGS = (
    Op("count_{c}", "{v}.count('{c}')", lambda s, c: s.count(c), "s", "int", {"c": LETTERS}, 2),
    Op("has_{c}", "'{c}' in {v}", lambda s, c: c in s, "s", "bool", {"c": LETTERS}, 2),
    Op("starts_{c}", "{v}.startswith('{c}')", lambda s, c: s.startswith(c), "s", "bool", {"c": LETTERS}, 2),
    Op("ends_{c}", "{v}.endswith('{c}')", lambda s, c: s.endswith(c), "s", "bool", {"c": LETTERS}, 2),
    Op("append_{w}", "{v} + '{w}'", lambda s, w: s + w, "s", "str", {"w": LETTERS + PAIRS}, 2),
    Op("prepend_{w}", "'{w}' + {v}", lambda s, w: w + s, "s", "str", {"w": LETTERS + PAIRS}, 2),
    Op("first_{k}", "{v}[:{k}]", lambda s, k: s[:k], "s", "str", {"k": K(1, 5)}, 2),
    Op("last_{k}", "{v}[-{k}:]", lambda s, k: s[-k:], "s", "str", {"k": K(1, 5)}, 2),
    Op("drop_{k}", "{v}[{k}:]", lambda s, k: s[k:], "s", "str", {"k": K(1, 5)}, 2),
    Op("find_{c}", "{v}.find('{c}')", lambda s, c: s.find(c), "s", "int", {"c": LETTERS}, 3),
    Op("replace_{c}_{d}", "{v}.replace('{c}', '{d}')", lambda s, c, d: s.replace(c, d), "s", "str",
       {"c": LETTERS, "d": LETTERS}, 3, valid=lambda c, d: c != d),
)

LISTS = (
    Op("keep_gt_{k}", "[x for x in {v} if x > {k}]", lambda xs, k: [x for x in xs if x > k], "xs", "list[int]",
       {"k": K(0, 30)}, 3),
    Op("keep_lt_{k}", "[x for x in {v} if x < {k}]", lambda xs, k: [x for x in xs if x < k], "xs", "list[int]",
       {"k": K(0, 30)}, 3),
    Op("keep_mult_{k}", "[x for x in {v} if x % {k} == 0]", lambda xs, k: [x for x in xs if x % k == 0], "xs",
       "list[int]", {"k": K(2, 9)}, 3),
    Op("remove_{k}", "[x for x in {v} if x != {k}]", lambda xs, k: [x for x in xs if x != k], "xs", "list[int]",
       {"k": K(0, 30)}, 3),
    Op("add_{k}_each", "[x + {k} for x in {v}]", lambda xs, k: [x + k for x in xs], "xs", "list[int]",
       {"k": K(1, 30)}, 3),
    Op("sub_{k}_each", "[x - {k} for x in {v}]", lambda xs, k: [x - k for x in xs], "xs", "list[int]",
       {"k": K(1, 30)}, 3),
    Op("mul_{k}_each", "[x * {k} for x in {v}]", lambda xs, k: [x * k for x in xs], "xs", "list[int]",
       {"k": K(2, 9)}, 3),
    Op("take_{k}", "{v}[:{k}]", lambda xs, k: xs[:k], "xs", "list[int]", {"k": K(1, 4)}, 3),
    Op("skip_{k}", "{v}[{k}:]", lambda xs, k: xs[k:], "xs", "list[int]", {"k": K(1, 4)}, 3),
    Op("clip_{k}_each", "[min(x, {k}) for x in {v}]", lambda xs, k: [min(x, k) for x in xs], "xs", "list[int]",
       {"k": K(0, 30)}, 4),
)

LOOPS = (
    Op("sum_gt_{k}", _acc("x > {k}", "x"), lambda xs, k: sum(x for x in xs if x > k), "xs", "int",
       {"k": K(0, 30)}, 4, block=True),
    Op("sum_lt_{k}", _acc("x < {k}", "x"), lambda xs, k: sum(x for x in xs if x < k), "xs", "int",
       {"k": K(0, 30)}, 4, block=True),
    Op("sum_mult_{k}", _acc("x % {k} == 0", "x"), lambda xs, k: sum(x for x in xs if x % k == 0), "xs", "int",
       {"k": K(2, 9)}, 4, block=True),
    Op("count_gt_{k}", _acc("x > {k}", "1"), lambda xs, k: sum(x > k for x in xs), "xs", "int",
       {"k": K(0, 30)}, 4, block=True),
    Op("count_lt_{k}", _acc("x < {k}", "1"), lambda xs, k: sum(x < k for x in xs), "xs", "int",
       {"k": K(0, 30)}, 4, block=True),
    Op("count_mult_{k}", _acc("x % {k} == 0", "1"), lambda xs, k: sum(x % k == 0 for x in xs), "xs", "int",
       {"k": K(2, 9)}, 4, block=True),
    Op("count_eq_{k}", _acc("x == {k}", "1"), lambda xs, k: xs.count(k), "xs", "int", {"k": K(0, 30)}, 4, block=True),
    Op("index_of_{k}", LOOP_INDEX, lambda xs, k: xs.index(k) if k in xs else -1, "xs", "int",
       {"k": K(0, 30)}, 5, block=True),
    Op("sum_mult_{k}_below", LOOP_BELOW, lambda n, k: sum(i for i in range(n) if i % k == 0), "n", "int",
       {"k": K(2, 9)}, 5, block=True),
    Op("pow_{k}", LOOP_POW, lambda n, k: k ** max(n, 0), "n", "int", {"k": K(2, 9)}, 5, block=True),
    Op("count_in_{w}", LOOP_IN, lambda s, w: sum(c in w for c in s), "s", "int", {"w": LETTER_SETS}, 5, block=True),
)

# Steps of compositions: one-line ops whose parameter is a single value. They repeat shapes of the
# families above, plus a few that need no constant; in a composition int constants stay under
# STEP_MAX_CONST, so a name of two or three steps stays short.
STEPS = (
    *(op for op in ARITHMETIC[:6]),
    Op("square", "{v} * {v}", lambda x: x * x, "x", "int"),
    *(op for op in CONDITIONALS[:3]),
    *(op for op in STRINGS if op.name.split("_")[0] in ("count", "has", "starts", "first", "drop", "replace")),
    Op("append_{w}", "{v} + '{w}'", lambda s, w: s + w, "s", "str", {"w": LETTERS}),
    Op("reverse", "{v}[::-1]", lambda s: s[::-1], "s", "str"),
    Op("upper", "{v}.upper()", lambda s: s.upper(), "s", "str"),
    Op("length", "len({v})", lambda s: len(s), "s", "int"),
    *(op for op in LISTS if op.name.split("_")[0] in ("keep", "remove", "add", "mul", "take")),
    Op("sort", "sorted({v})", lambda xs: sorted(xs), "xs", "list[int]"),
    Op("reverse", "{v}[::-1]", lambda xs: xs[::-1], "xs", "list[int]"),
    Op("sum", "sum({v})", lambda xs: sum(xs), "xs", "int"),
    Op("count", "len({v})", lambda xs: len(xs), "xs", "int"),
)
STEP_MAX_CONST = 9

# family -> (weight, ops); weights 1/rank, as arith.py's digit counts: easy families are common.
# Compositions have no list of ops: they are chains of STEPS (areal_flow/data/tiny_code.py).
FAMILIES: dict[str, tuple[float, tuple[Op, ...]]] = {
    "arithmetic": (1.0, ARITHMETIC),
    "conditionals": (1 / 2, CONDITIONALS),
    "strings": (1 / 3, STRINGS),
    "lists": (1 / 4, LISTS),
    "loops": (1 / 5, LOOPS),
    "compositions": (1 / 6, ()),
}
