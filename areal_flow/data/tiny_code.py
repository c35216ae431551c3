"""The tiny code task (`dataset.name=tiny_code`): program synthesis from examples, generated from a
seed, for a character-level model and the code reward (areal_flow/rewards/code.py).

A prompt is comment lines only: the signature, then two or three examples, e.g.

    # keep_gt_4(xs: list[int]) -> list[int]
    # keep_gt_4([3, 7, 5]) == [7, 5]
    # keep_gt_4([9, 1]) == [9]
    # keep_gt_4([4, 12, 0, 6]) == [12, 6]

and the reference completion is the whole function, in plain Python with 4-space indents:

    def keep_gt_4(xs):
        return [x for x in xs if x > 4]

The `def` line is the completion's, not the prompt's: the code reward runs the completion alone
(`extract_code` takes a completion without a code fence whole, as the program), so the program must
define the function itself; a prompt ending in the `def` line would have the model write a body
that does not run by itself. The signature line gives the name and the parameter names to copy
(copying a line of the context is the first thing a small model learns), and its types tell what
the values are, which the examples' notation (Python's repr) shows too.

Families of rising difficulty (areal_flow/data/tiny_code_ops.py), drawn with weights 1/rank as
arith.py draws digit counts: arithmetic 1, conditionals 1/2, strings 1/3, lists 1/4, loops 1/5,
compositions 1/6 (shares 41%, 20%, 14%, 10%, 8%, 7%). Each problem has N_TESTS tests drawn near
its constants, the shown examples first; every test is hidden from the model but those. The held-out
set is n_eval problems of distinct identity (areal_flow/data/tiny_code_specs.py) taking at most a
quarter of any op's problems; no training problem has a held-out identity. docs/datasets.md.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import random
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from areal_flow.data.arith import write_jsonl_atomic  # the same publish-by-rename as tiny_arith's files
from areal_flow.data.tiny_code_ops import LETTERS, PARAM_TYPES
from areal_flow.data.tiny_code_specs import FAMILY_NAMES, FAMILY_WEIGHTS, Spec, identity, sample_family, sample_spec

# Bump when the sampling or file format changes, so cached files of an older scheme are not reused.
DATA_VERSION = 1
# Bump when only the rows' fields change (not the problems, so not the bootstrapped model); 2: shown_tests.
ROWS_VERSION = 2
N_TESTS = 8  # per problem: the shown examples (3, or 2 when 3 make the prompt too long) and the rest
N_SHOWN = 3
N_NEAR = 4  # tests taken near the constants first: where `keep_gt_4` and `keep_gt_5` differ
# The model sees at most 384 characters: the prompt, the solution and its EOS.
PROMPT_MAX = 256
SOLUTION_MAX = 127
# The held-out set takes at most this share of any op's problems (at least one), so every op keeps
# most of its constants for training.
HELDOUT_SHARE = 0.25
# Draws of one family refused in a row before its problems count as used up (a held-out set too large).
MAX_REFUSED = 10000


@dataclasses.dataclass(frozen=True)
class Problem:
    """A function to write (`spec`), its tests (argument lists and expected values) and its prompt."""

    spec: Spec
    inputs: tuple[tuple, ...]
    outputs: tuple[Any, ...]
    shown: int  # the first `shown` tests are the prompt's examples
    prompt: str

    @property
    def solution(self) -> str:
        return self.spec.solution

    def row(self, query_id: str) -> dict[str, Any]:
        """The problem as an AReaL code row (`dataset.name=areal_code`'s shape, plus its family and difficulty)."""
        s = self.spec
        return {"query_id": query_id, "prompt": self.prompt,
                "input_output": {"inputs": [list(a) for a in self.inputs], "outputs": list(self.outputs),
                                 "fn_name": s.name},
                "shown_tests": self.shown, "solution": s.solution, "family": s.family, "difficulty": s.difficulty}


# ---- tests ----------------------------------------------------------------------------------


def _word(rng: random.Random, alphabet: list[str], longest: int) -> str:
    return "".join(rng.choices(alphabet, k=rng.randint(0, longest)))


def _edges(spec: Spec) -> list[tuple]:
    """The ints on either side of each place where a function of an int to a bool or a string
    changes its answer: where `add_7_then_is_lt_8` turns (at 0 and 1), far from its constants."""
    if spec.params != "x" or spec.ret not in ("bool", "str"):
        return []
    outs = [spec.fn(x) for x in range(-10, 46)]
    return [(x + d,) for x, (a, b) in zip(range(-10, 45), zip(outs, outs[1:])) if a != b for d in (0, 1)]


def _candidates(rng: random.Random, spec: Spec) -> tuple[list[tuple], list[tuple]]:
    """Argument lists to choose tests from: those near the constants (shuffled), and random ones.

    Near a constant k an int is k-1, k, k+1, 2k+1 or -k, and a list holds k-1, k or k+1; a string
    holds the letters of the constants, at its start or its end, so `is_gt_4` and `is_gt_5`,
    `count_a` and `count_b` differ on some test. The empty string or list comes first of all."""
    params, hints = spec.params, spec.hints
    ints = [h for h in hints if isinstance(h, int)]
    letters = sorted({c for h in hints if isinstance(h, str) for c in h} | set(rng.sample(LETTERS, 3)))
    if params == "x":
        near = [(v,) for k in ints for v in (k - 1, k, k + 1, 2 * k + 1, -k)] + _edges(spec)
        rand = [(rng.randint(-9, 40),) for _ in range(24)]
    elif params == "n":  # the loops over range(n): n small enough for pow_9(n) to stay short
        near, rand = [], [(n,) for n in range(13)]
    elif params == "a, b":
        near = [(k + d, rng.randint(-9, 40)) for k in ints for d in (0, 1)]
        rand = [(rng.randint(-9, 40), rng.randint(-9, 40)) for _ in range(24)]
    elif params == "s":
        words = [h for h in hints if isinstance(h, str)]
        near = [(w,) for h in words for w in (h + _word(rng, letters, 4), _word(rng, letters, 4) + h)]
        rand = [(_word(rng, letters, 7),) for _ in range(24)]
    else:
        def some() -> list[int]:
            return [rng.randint(-5, 30) for _ in range(rng.randint(0, 5))]
        near = [(xs[:i] + [v] + xs[i:],) for k in ints for v in (k - 1, k, k + 1) for xs in (some(),)
                for i in (rng.randint(0, len(xs)),)]
        rand = [(some(),) for _ in range(24)]
    rng.shuffle(near)
    rng.shuffle(rand)
    edge = {"s": [("",)], "xs": [([],)]}.get(params, [])  # first_or_3([]) == 3 tells it from first_or_4
    return edge + near, rand


def choose_tests(rng: random.Random, spec: Spec) -> list[tuple[tuple, Any]] | None:
    """N_TESTS distinct (arguments, output) pairs: up to N_NEAR near the constants, then one for each
    output not yet seen (so a predicate's tests hold both answers), then the rest in order. None
    when the function cannot be told apart from a constant or (same type in and out) from doing
    nothing."""
    near, rand = _candidates(rng, spec)
    seen, pairs = set(), []
    for args in near + rand:
        if repr(args) in seen:
            continue
        seen.add(repr(args))
        try:
            out = spec.fn(*[list(a) if isinstance(a, list) else a for a in args])  # a copy: fn may not mutate
        except Exception:  # outside the function's domain (none of the ops has one yet): not a test
            continue
        pairs.append((args, out))
    near_keys = {repr(a) for a in near}
    n_near = min(N_NEAR, sum(repr(a) in near_keys for a, _ in pairs))  # pairs keep near ones first
    tests, outputs = pairs[:n_near], {repr(o) for _, o in pairs[:n_near]}
    for args, out in pairs[n_near:]:
        if repr(out) not in outputs:
            tests.append((args, out))
            outputs.add(repr(out))
    tests += [t for t in pairs[n_near:] if t not in tests]
    tests = tests[:N_TESTS]
    changed = next(((a, o) for a, o in pairs if o != a[0]), None)
    if _same_type(spec) and changed is not None and all(o == a[0] for a, o in tests):
        tests[-1] = changed  # `clip_8`'s outputs below 8 are all distinct: show one it clips
    if len(tests) < N_TESTS or len({repr(o) for _, o in tests}) < 2:
        return None
    if _same_type(spec) and changed is None:
        return None
    return tests


def _same_type(spec: Spec) -> bool:
    return PARAM_TYPES[spec.params] == spec.ret


def _call(name: str, args: tuple) -> str:
    return f"{name}({', '.join(map(repr, args))})"


def prompt_text(spec: Spec, examples: list[tuple[tuple, Any]]) -> str:
    """The signature line and one `# name(args) == value` line per example, each ending in a newline."""
    typed = ", ".join(f"{p}: {t}" for p, t in zip(spec.params.split(", "), PARAM_TYPES[spec.params].split(", ")))
    lines = [f"# {spec.name}({typed}) -> {spec.ret}"] + [f"# {_call(spec.name, a)} == {o!r}" for a, o in examples]
    return "".join(line + "\n" for line in lines)


def _examples_first(spec: Spec, tests: list[tuple[tuple, Any]], n: int) -> list[tuple[tuple, Any]]:
    """`tests` reordered with the `n` to show first: the shortest set that shows two different
    outputs and, for a function from a type to itself, one output that differs from its input (so
    `clip_25` is not shown clipping nothing); empty inputs (edge cases) are left hidden if they can be."""
    cost = [len(_call("f", a)) + len(repr(o)) + 100 * any(x in ("", []) for x in a) for a, o in tests]
    outs = [repr(o) for _, o in tests]
    same = _same_type(spec)

    def informative(combo: tuple[int, ...]) -> bool:
        changed = not same or any(tests[i][1] != tests[i][0][0] for i in combo)
        return len({outs[i] for i in combo}) >= 2 and changed

    combos = sorted(itertools.combinations(range(len(tests)), n), key=lambda c: sum(cost[i] for i in c))
    shown = next((c for c in combos if informative(c)), combos[0])
    return [tests[i] for i in shown] + [t for i, t in enumerate(tests) if i not in shown]


def make_problem(rng: random.Random, spec: Spec) -> Problem | None:
    """The problem of `spec` with tests drawn from `rng`; None when no good tests came, or the
    prompt or solution would be too long (the caller draws another)."""
    tests = choose_tests(rng, spec)
    if tests is None or len(spec.solution) > SOLUTION_MAX:
        return None
    for shown in (N_SHOWN, N_SHOWN - 1):
        tests = _examples_first(spec, tests, shown)
        prompt = prompt_text(spec, tests[:shown])
        if len(prompt) <= PROMPT_MAX:
            return Problem(spec, tuple(a for a, _ in tests), tuple(o for _, o in tests), shown, prompt)
    return None


def sample_problem(rng: random.Random, accept: Callable[[Problem], bool] | None = None,
                   family: str | None = None) -> Problem:
    """One problem from the task mix (or of `family`) that `accept` takes. The family is drawn first
    and kept while draws are refused, so every set has the families' shares; ValueError when one
    seems used up."""
    family = family or sample_family(rng)
    for _ in range(MAX_REFUSED):
        problem = make_problem(rng, sample_spec(rng, family))
        if problem is not None and (accept is None or accept(problem)):
            return problem
    raise ValueError(f"tiny_code: {MAX_REFUSED} draws of family {family} in a row refused: are its problems all held "
                     "out (dataset.n_eval too large)?")


# ---- held-out and training sets --------------------------------------------------------------


def family_quota(rng: random.Random, n: int) -> list[str]:
    """The families of `n` problems in shuffled order, each as many times as its weight's share of
    `n` (largest remainders): a held-out set has the mix exactly, not by chance."""
    exact = {f: n * w / sum(FAMILY_WEIGHTS) for f, w in zip(FAMILY_NAMES, FAMILY_WEIGHTS)}
    counts = {f: int(x) for f, x in exact.items()}
    for f in sorted(exact, key=lambda f: counts[f] - exact[f])[:n - sum(counts.values())]:
        counts[f] += 1
    order = [f for f in FAMILY_NAMES for _ in range(counts[f])]
    rng.shuffle(order)
    return order


def heldout_problems(n_eval: int = 200, seed: int = 0) -> list[Problem]:
    """`n_eval` problems of distinct identity from a fixed seed: the held-out set.

    It depends only on (n_eval, seed), so the bootstrap and the data files agree on what must never
    be trained on. Its families have their weights' shares exactly (`family_quota`). An op gives at
    most HELDOUT_SHARE of its problems (at least one); compositions, too many to count, have no cap."""
    return list(_heldout(n_eval, seed))


@functools.lru_cache(maxsize=4)  # the data files and the training streams of one process ask for the same set
def _heldout(n_eval: int, seed: int) -> tuple[Problem, ...]:
    rng = random.Random(f"tiny-code-eval-{seed}")  # str seeds are hashed with sha512: stable
    taken: set[str] = set()
    per_key: Counter[str] = Counter()

    def new(p: Problem) -> bool:
        s = p.spec
        return identity(s) not in taken and not (s.size and per_key[s.key] >= max(1, int(s.size * HELDOUT_SHARE)))

    out: list[Problem] = []
    for family in family_quota(rng, n_eval):
        p = sample_problem(rng, new, family)
        taken.add(identity(p.spec))
        per_key[p.spec.key] += 1
        out.append(p)
    return tuple(out)


def training_problems(seed: int = 0, heldout: tuple[int, int] = (200, 0),
                      stream: str = "bootstrap") -> Iterator[Problem]:
    """Fresh problems from the task mix, endlessly, none with the identity of a problem of
    `heldout_problems(*heldout)`: for the supervised bootstrap (`stream` names the use, so the
    training rows and the bootstrap draw different problems from one seed)."""
    excluded = {identity(p.spec) for p in heldout_problems(*heldout)}
    rng = random.Random(f"tiny-code-{stream}-{seed}")
    while True:
        yield sample_problem(rng, lambda p: identity(p.spec) not in excluded)


def ensure_tiny_code_data(data_dir: str, n_train: int = 20000, n_eval: int = 200, seed: int = 0) -> tuple[str, str]:
    """Write (or reuse) `train.jsonl` and `eval.jsonl` for these settings; return their paths.

    Files go to `data_dir/tiny-code-v{DATA_VERSION}.{ROWS_VERSION}-train{n_train}-eval{n_eval}-seed{seed}/`, so
    files of other settings are never mistaken for these. Training rows may share an identity with
    each other (with other tests), never with a held-out row."""
    if n_train < 1 or n_eval < 1:
        raise ValueError(f"n_train and n_eval must be >= 1, got n_train={n_train}, n_eval={n_eval}")
    folder = os.path.join(data_dir, f"tiny-code-v{DATA_VERSION}.{ROWS_VERSION}-train{n_train}-eval{n_eval}-seed{seed}")
    train_path, eval_path = os.path.join(folder, "train.jsonl"), os.path.join(folder, "eval.jsonl")
    # Each file is published by an atomic rename, so existing means complete.
    if os.path.isfile(train_path) and os.path.isfile(eval_path):
        return train_path, eval_path
    os.makedirs(folder, exist_ok=True)
    heldout = heldout_problems(n_eval, seed)
    stream = training_problems(seed, (n_eval, seed), stream="train")
    write_jsonl_atomic(eval_path, [p.row(f"eval-{i}") for i, p in enumerate(heldout)])
    write_jsonl_atomic(train_path, [next(stream).row(f"train-{i}") for i in range(n_train)])
    return train_path, eval_path
