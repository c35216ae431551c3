"""tiny_code's functions before they have tests: one drawn from a family's ops, or a composition of
steps, and the identity that keeps the held-out set out of training (areal_flow/data/tiny_code.py).

A problem's identity is what its function does on a fixed set of probe inputs of its parameter
types, not its name: two names for one function (`keep_gt_4_then_sum` and the loop `sum_gt_4`,
`add_2_then_add_3` and `add_5`) are one problem, so holding out one holds out the other too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import random
from typing import Any, Callable

from areal_flow.data.tiny_code_ops import FAMILIES, LETTERS, PARAM_TYPES, STEP_MAX_CONST, STEPS, VARIABLE, Op

FAMILY_NAMES = tuple(FAMILIES)
FAMILY_WEIGHTS = tuple(w for w, _ in FAMILIES.values())
# A composition has two steps three times in four, else three (the long tail of the long tail).
THREE_STEPS = 0.25


@dataclasses.dataclass(frozen=True)
class Spec:
    """A function to write: its name and signature, the reference solution and its meaning."""

    name: str
    params: str  # a key of PARAM_TYPES, as the def line writes it: "x", "a, b", "xs"
    ret: str  # the return type the prompt's signature shows
    solution: str  # the whole function: `def name(params):` and a body of 4-space indents
    fn: Callable[..., Any] = dataclasses.field(compare=False)
    family: str = ""
    difficulty: int = 1
    key: str = ""  # the op's name pattern ("compositions" for those): a cap of the held-out set counts per key
    size: int = 0  # problems that share `key`; 0 for compositions (too many to count)
    hints: tuple = ()  # the constants: test inputs are drawn near them


def _bind(fn: Callable[..., Any], consts: dict[str, Any]) -> Callable[..., Any]:
    return lambda *args: fn(*args, **consts)


def _def(name: str, params: str, body: str) -> str:
    return f"def {name}({params}):\n" + "\n".join("    " + line for line in body.split("\n"))


def spec_of(op: Op, family: str, consts: dict[str, Any]) -> Spec:
    """The problem of `op` with these constants."""
    code = op.code.format(v=op.src, **consts)
    body = code if op.block else f"return {code}"
    return Spec(op.name.format(**consts), op.src, op.dst, _def(op.name.format(**consts), op.src, body),
                _bind(op.fn, consts), family, op.difficulty, f"{family}/{op.name}", len(op.choices),
                tuple(consts.values()))


def _chain(steps: list[tuple[Op, dict[str, Any]]]) -> Callable[[Any], Any]:
    def run(value: Any) -> Any:
        for op, consts in steps:
            value = op.fn(value, **consts)
        return value
    return run


# Each step with its constants in a composition: ints up to STEP_MAX_CONST.
_STEPS = [(op, [c for c in op.choices if all(not isinstance(v, int) or v <= STEP_MAX_CONST for v in c.values())])
          for op in STEPS]


def compose(rng: random.Random) -> Spec | None:
    """A chain of two or three STEPS on one parameter, e.g. `keep_gt_3_then_sum`; None when the
    draw is redundant (a step that changes nothing a shorter chain would not, as
    `reverse_then_sum`): the caller draws again."""
    src = rng.choice(("x", "s", "xs"))
    kind, steps = PARAM_TYPES[src], []
    n_steps = 3 if rng.random() < THREE_STEPS else 2
    for i in range(n_steps):
        # A bool only ends a chain; the same op twice in a row is one op with other constants.
        pool = [(op, cs) for op, cs in _STEPS if PARAM_TYPES[op.src] == kind
                and (i == n_steps - 1 or op.dst in VARIABLE) and (not steps or op is not steps[-1][0])]
        op, choices = rng.choice(pool)
        steps.append((op, rng.choice(choices)))
        kind = op.dst
    return None if _redundant(src, steps) else chain_spec(src, steps)


def chain_spec(src: str, steps: list[tuple[Op, dict[str, Any]]]) -> Spec:
    """The composition of `steps` (ops of STEPS with their constants) on parameter `src`: each step
    but the last assigns the variable of its type, the last returns."""
    name = "_then_".join(op.name.format(**c) for op, c in steps)
    lines, v = [], src
    for op, consts in steps[:-1]:
        lines.append(f"{VARIABLE[op.dst]} = {op.code.format(v=v, **consts)}")
        v = VARIABLE[op.dst]
    lines.append("return " + steps[-1][0].code.format(v=v, **steps[-1][1]))
    return Spec(name, src, steps[-1][0].dst, _def(name, src, "\n".join(lines)), _chain(steps), "compositions",
                3 + len(steps), "compositions", 0, tuple(v for _, c in steps for v in c.values()))


def _redundant(src: str, steps: list[tuple[Op, dict[str, Any]]]) -> bool:
    """Whether a shorter chain (the steps in order, some left out) does the same on the probes."""
    whole = fingerprint(src, _chain(steps))
    for n in range(len(steps)):
        for sub in itertools.combinations(steps, n):
            kinds = [PARAM_TYPES[src]] + [op.dst for op, _ in sub]
            if all(PARAM_TYPES[op.src] == k for (op, _), k in zip(sub, kinds)) and kinds[-1] == steps[-1][0].dst:
                if fingerprint(src, _chain(list(sub))) == whole:
                    return True
    return False


def sample_family(rng: random.Random) -> str:
    """A family by FAMILIES' weights."""
    return rng.choices(FAMILY_NAMES, weights=FAMILY_WEIGHTS)[0]


def sample_spec(rng: random.Random, family: str) -> Spec:
    """One function of `family`: an op uniformly, then its constants uniformly (compositions: a
    chain of steps, drawn again while redundant)."""
    while family == "compositions":
        spec = compose(rng)
        if spec is not None:
            return spec
    op = rng.choice(FAMILIES[family][1])
    return spec_of(op, family, rng.choice(op.choices))


# ---- identity --------------------------------------------------------------------------------


def _probes() -> dict[str, list[tuple]]:
    """Fixed inputs per parameter type; every constant of the ops shows up near some of them."""
    rng = random.Random("tiny-code-probes")
    ints = list(range(-10, 61))
    words = ["", *LETTERS] + ["".join(rng.choices(LETTERS[:10], k=rng.randint(2, 8))) for _ in range(40)] \
        + ["".join(rng.choices(LETTERS, k=rng.randint(2, 8))) for _ in range(40)]
    lists = [[]] + [[rng.randint(-5, 35) for _ in range(rng.randint(1, 6))] for _ in range(80)]
    return {"int": [(x,) for x in ints], "int, int": [(a, (a * 7) % 23 - 5) for a in ints] + [(3, 9), (9, 3)],
            "str": [(w,) for w in words], "list[int]": [(xs,) for xs in lists]}


PROBES = _probes()


def fingerprint(params: str, fn: Callable[..., Any]) -> str:
    """What `fn` returns on the probes of its parameter type (an exception counts as its type's
    name), hashed: `"{types}:{16 hex digits}"`."""
    outs = []
    for args in PROBES[PARAM_TYPES[params]]:
        try:
            outs.append(repr(fn(*[list(a) if isinstance(a, list) else a for a in args])))
        except Exception as e:  # the function's own domain error (e.g. an empty list) is behaviour too
            outs.append("!" + type(e).__name__)
    return f"{PARAM_TYPES[params]}:" + hashlib.sha1("\n".join(outs).encode()).hexdigest()[:16]


_IDENTITIES: dict[tuple[str, str], str] = {}


def identity(spec: Spec) -> str:
    """The problem's identity (see the module's doc), cached by name: a name fixes the function."""
    key = (spec.name, spec.params)
    if key not in _IDENTITIES:
        _IDENTITIES[key] = fingerprint(spec.params, spec.fn)
    return _IDENTITIES[key]
