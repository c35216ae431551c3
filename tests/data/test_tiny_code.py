"""The tiny_code task: problems from a seed, disjoint held-out identities, reference solutions that
pass their tests in the real sandbox, tests that tell problems apart, and `dataset.name=tiny_code`."""

import itertools
import json
import os
import random
import re
from collections import Counter, defaultdict

import pytest
from hydra import compose, initialize_config_dir

from areal_flow.config.schema import SandboxConfig
from areal_flow.data.dataset import DatasetError, load_rows
from areal_flow.data.input_output import parse_tests
from areal_flow.data.loading import dataset_paths, row_format
from areal_flow.data.tiny_code import (
    N_TESTS,
    PROMPT_MAX,
    SOLUTION_MAX,
    ensure_tiny_code_data,
    heldout_problems,
    make_problem,
    sample_problem,
    training_problems,
)
from areal_flow.data.tiny_code_ops import ARITHMETIC, FAMILIES, LISTS, LOOPS, STEPS
from areal_flow.data.tiny_code_specs import chain_spec, identity, spec_of
from areal_flow.launch import CONF_DIR
from areal_flow.rewards.code import extract_code, make_sandbox, score_program
from areal_flow.runtime.spec import typed

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's namespaces need root, as on CI")
WEIGHTS = {f: w / sum(w for w, _ in FAMILIES.values()) for f, (w, _) in FAMILIES.items()}


def config(tmp_path, *overrides):
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        raw = compose("config", overrides=[f"output_dir={tmp_path}/out", f"cache_dir={tmp_path}/cache", *overrides])
    return typed(raw)


def problems(n, seed=0):
    rng = random.Random(seed)
    return [sample_problem(rng) for _ in range(n)]


def by_family(ps, per_family):
    """The first `per_family` problems of each family, family by family."""
    groups = defaultdict(list)
    for p in ps:
        groups[p.spec.family].append(p)
    return [p for f in FAMILIES for p in groups[f][:per_family]]


def step(name, **consts):
    return next(op for op in STEPS if op.name == name and op.src in ("x", "xs")), consts


def run(solution, args):
    """What the solution returns for `args` after a JSON round trip (as the sandbox's harness
    reports it), or the name of what it raised."""
    scope = {}
    exec(solution, scope)
    fn = scope[re.match(r"def (\w+)\(", solution).group(1)]
    try:
        return json.loads(json.dumps(fn(*json.loads(json.dumps(list(args))))))
    except Exception as e:
        return "!" + type(e).__name__


def fails_a_test(solution, p):
    return any(run(solution, args) != json.loads(json.dumps(out)) for args, out in zip(p.inputs, p.outputs))


# ---- the text ---------------------------------------------------------------------------------


def test_worked_example_prompt_and_completion():
    p = make_problem(random.Random(0), spec_of(ARITHMETIC[0], "arithmetic", {"k": 3}))
    lines = p.prompt.split("\n")
    assert p.prompt.endswith("\n") and lines[0] == "# add_3(x: int) -> int" and len(lines) == 3 + 2
    for line, args, out in zip(lines[1:4], p.inputs, p.outputs):
        assert line == f"# add_3({args[0]}) == {out}" and out == args[0] + 3
    assert p.solution == "def add_3(x):\n    return x + 3"
    assert extract_code(p.solution) == p.solution  # no fence: the reward runs the completion whole
    loop = make_problem(random.Random(0), spec_of(LOOPS[0], "loops", {"k": 4}))
    assert loop.solution == ("def sum_gt_4(xs):\n    t = 0\n    for x in xs:\n        if x > 4:\n"
                             "            t += x\n    return t")
    assert loop.prompt.startswith("# sum_gt_4(xs: list[int]) -> int\n# sum_gt_4([")
    both = chain_spec("xs", [step("keep_gt_{k}", k=3), step("sum")])
    assert both.name == "keep_gt_3_then_sum"
    assert both.solution == "def keep_gt_3_then_sum(xs):\n    xs = [x for x in xs if x > 3]\n    return sum(xs)"


def test_lengths_tests_and_values_of_every_problem():
    for p in problems(3000, seed=1):
        assert len(p.prompt) <= PROMPT_MAX and len(p.solution) <= SOLUTION_MAX
        assert len(p.prompt) + len(p.solution) + 1 <= 384  # + EOS: what the model sees
        assert p.solution.startswith(f"def {p.spec.name}({p.spec.params}):\n    ")
        assert len(p.inputs) == len(p.outputs) == N_TESTS and p.shown in (2, 3) and N_TESTS - p.shown >= 5
        assert len({repr(a) for a in p.inputs}) == N_TESTS and len({repr(o) for o in p.outputs}) >= 2
        shown = p.prompt.split("\n")[1:-1]
        assert shown == [f"# {p.spec.name}({', '.join(map(repr, a))}) == {o!r}"
                         for a, o in zip(p.inputs[:p.shown], p.outputs[:p.shown])]
        assert json.loads(json.dumps([p.inputs, p.outputs])) == [[list(a) for a in p.inputs], list(p.outputs)]
        assert all(" " <= c <= "~" for c in p.prompt + p.solution if c != "\n")  # printable ASCII


# ---- the mix ----------------------------------------------------------------------------------


def test_families_follow_their_weights_and_every_op_appears():
    ps = problems(5000, seed=2)
    shares = Counter(p.spec.family for p in ps)
    for family, weight in WEIGHTS.items():
        assert abs(shares[family] / len(ps) - weight) < 0.015, (family, shares[family])
    keys = {p.spec.key for p in ps}
    assert all(f"{f}/{op.name}" in keys for f, (_, ops) in FAMILIES.items() for op in ops)
    assert {p.spec.difficulty for p in ps} == set(range(1, 7))
    assert Counter(len(p.spec.solution.split("\n")) > 3 for p in ps if p.spec.family == "compositions")[True] > 20


def test_the_same_seed_gives_the_same_problems(tmp_path):
    def texts(ps):
        return [(p.prompt, p.solution, p.inputs, p.outputs) for p in ps]
    assert texts(heldout_problems(40, seed=3)) == texts(heldout_problems(40, seed=3))
    assert texts(heldout_problems(40, seed=3)) != texts(heldout_problems(40, seed=4))
    first = texts(itertools.islice(training_problems(5, (40, 3)), 50))
    assert first == texts(itertools.islice(training_problems(5, (40, 3)), 50))
    a = ensure_tiny_code_data(str(tmp_path / "a"), 60, 20, 7)
    b = ensure_tiny_code_data(str(tmp_path / "b"), 60, 20, 7)
    assert [open(x).read() for x in a] == [open(x).read() for x in b]


# ---- held-out ---------------------------------------------------------------------------------


def test_a_name_fixes_the_function_and_aliases_share_an_identity():
    names = {}
    for p in problems(2500, seed=5):
        assert names.setdefault(p.spec.name, (p.solution, identity(p.spec))) == (p.solution, identity(p.spec))
    # Two names for one function are one problem: holding out one holds out the other.
    assert identity(chain_spec("xs", [step("keep_gt_{k}", k=4), step("sum")])) == \
        identity(spec_of(LOOPS[0], "loops", {"k": 4}))
    assert identity(chain_spec("x", [step("add_{k}", k=2), step("add_{k}", k=3)])) == \
        identity(spec_of(ARITHMETIC[0], "arithmetic", {"k": 5}))
    assert identity(spec_of(LISTS[0], "lists", {"k": 4})) != identity(spec_of(LISTS[0], "lists", {"k": 5}))


def test_no_training_problem_has_a_held_out_identity(tmp_path):
    train_path, eval_path = ensure_tiny_code_data(str(tmp_path), n_train=2000, n_eval=200, seed=0)
    held, train = load_rows(eval_path, [], "areal_code"), load_rows(train_path, [], "areal_code")
    assert (len(held), len(train)) == (200, 2000)
    held_names = {json.loads(r["input_output"])["fn_name"] for r in held}
    assert len(held_names) == 200
    assert not held_names & {json.loads(r["input_output"])["fn_name"] for r in train}
    # By identity, which also catches two names for one function; the bootstrap's stream as well.
    held_ids = {identity(p.spec) for p in heldout_problems(200, 0)}
    assert len(held_ids) == 200
    for stream in ("train", "bootstrap"):
        drawn = list(itertools.islice(training_problems(0, (200, 0), stream), 2000))
        assert not held_ids & {identity(p.spec) for p in drawn}
    assert [p.prompt for p in drawn[:3]] != [r["prompt"] for r in train[:3]]  # other draws than the rows'
    # The held-out set has the mix exactly: 82 arithmetic, 41 conditionals, 27 strings, 20 lists, ...
    assert Counter(r["family"] for r in held) == {f: round(200 * w) for f, w in WEIGHTS.items()} == \
        {"arithmetic": 82, "conditionals": 41, "strings": 27, "lists": 20, "loops": 16, "compositions": 14}
    assert {r["family"] for r in train} == set(FAMILIES)
    # No op gives more than a quarter of its problems to the held-out set.
    per_key = Counter(p.spec.key for p in heldout_problems(200, 0) if p.spec.size)
    sizes = {p.spec.key: p.spec.size for p in heldout_problems(200, 0)}
    assert all(n <= max(1, sizes[k] // 4) for k, n in per_key.items())


def test_files_are_cached_by_settings(tmp_path):
    train, held = ensure_tiny_code_data(str(tmp_path), 30, 10, 1)
    assert os.path.basename(os.path.dirname(train)) == "tiny-code-v1.2-train30-eval10-seed1"
    before = os.stat(train).st_mtime_ns
    assert ensure_tiny_code_data(str(tmp_path), 30, 10, 1) == (train, held)
    assert os.stat(train).st_mtime_ns == before
    assert ensure_tiny_code_data(str(tmp_path), 30, 10, 2)[0] != train
    with pytest.raises(ValueError, match="n_train and n_eval must be >= 1"):
        ensure_tiny_code_data(str(tmp_path), 0, 10, 1)


# ---- the tests of a problem ------------------------------------------------------------------


def test_the_tests_tell_problems_of_a_family_apart():
    """A reference solution of another problem of the same family and signature fails some test of
    almost every problem (99.87% here, 99.97% of 6,000), and so does one of the same op with a
    constant moved by one (99.3% here, 99.8% of 2,500; some pairs are one function: sum_lt_0 and
    sum_lt_1)."""
    rng = random.Random(6)
    ps = problems(1500, seed=6)
    assert not [p.spec.name for p in ps if fails_a_test(p.solution, p)]
    groups = defaultdict(list)
    for p in ps:
        groups[p.spec.family, p.spec.params].append(p)
    told = [fails_a_test(rng.choice([q for q in groups[p.spec.family, p.spec.params]
                                     if identity(q.spec) != identity(p.spec)]).solution, p) for p in ps]
    print(f"another problem's solution fails a test of {sum(told) / len(told):.2%} of problems")
    assert sum(told) / len(told) >= 0.995
    near = []
    for family, (_, ops) in FAMILIES.items():
        for op in ops:
            for consts in rng.sample(op.choices, min(12, len(op.choices))):
                k = rng.choice([c for c, v in consts.items() if isinstance(v, int)] or [None])
                moved = {**consts, k: consts[k] + rng.choice((-1, 1))} if k else None
                p = make_problem(rng, spec_of(op, family, consts))
                if moved in op.choices and p is not None:
                    near.append(fails_a_test(spec_of(op, family, moved).solution, p))
    print(f"a neighbour's solution fails a test of {sum(near) / len(near):.2%} of {len(near)} problems")
    assert len(near) > 300 and sum(near) / len(near) >= 0.98


def score_in_sandbox(sandbox, ps, solutions=None):
    """The code reward of each solution (default: the problem's own) on the problem's tests, run as
    the reward runs it: extract_code, the problem's row, the sandbox."""
    rewards = []
    for i, p in enumerate(ps):
        tests = parse_tests(json.dumps(p.row("q")["input_output"]))
        completion = p.solution if solutions is None else solutions[i]
        rewards.append(score_program(sandbox, extract_code(completion), tests)["reward"])
    return rewards


@needs_root
def test_reference_solutions_pass_in_the_sandbox_a_sample_across_families():
    sandbox = make_sandbox(SandboxConfig())
    # 0.1 s a program on an idle machine (0.3 s on a loaded one): 4 of each family here, 500 problems
    # in the slow test.
    sample = by_family(problems(600, seed=8), 4)
    assert {p.spec.family for p in sample} == set(FAMILIES) and len(sample) == 24
    assert score_in_sandbox(sandbox, sample) == [1.0] * len(sample)
    # The solution of the next problem of the family, renamed, fails: the reward tells them apart.
    pairs = [(sample[i], sample[i + 1]) for i in range(0, 24, 4)]
    other = [q.solution.replace(q.spec.name, p.spec.name, 1) for p, q in pairs]
    assert score_in_sandbox(sandbox, [p for p, _ in pairs], other) == [0.0] * len(pairs)


@needs_root
@pytest.mark.slow  # 300 programs, ~7 s: the full suite runs it
def test_every_reference_solution_of_the_held_out_set_and_100_training_problems_passes_in_the_sandbox():
    sandbox = make_sandbox(SandboxConfig())  # the 200 held out and 100 training: about 40 s on 2 cores
    ps = heldout_problems(200, 0) + list(itertools.islice(training_problems(0, (200, 0), "train"), 100))
    rewards = score_in_sandbox(sandbox, ps)
    assert [p.spec.name for p, r in zip(ps, rewards) if r != 1.0] == []


# ---- dataset.name=tiny_code --------------------------------------------------------------------


def test_dataset_name_tiny_code_generates_and_loads_code_rows(tmp_path):
    from areal_flow.run.prepare import prepare_data

    cfg = config(tmp_path, "dataset.name=tiny_code", "dataset.n_train=40", "dataset.n_eval=12",
                 "dataset.fields=[prompt,input_output]", "graph.reward.inputs=[output_ids,input_output]")
    train, held_out = prepare_data(cfg)
    assert train == str(tmp_path / "cache" / "data" / "tiny-code-v1.2-train40-eval12-seed0" / "train.jsonl")
    assert row_format("tiny_code") == "areal_code"
    rows = load_rows(held_out, ["prompt", "input_output", "solution", "family", "difficulty"], "areal_code")
    assert len(rows) == 12 and rows[0]["id"] == "eval-0" and len(load_rows(train, [], "areal_code")) == 40
    io = json.loads(rows[0]["input_output"])
    assert len(io["inputs"]) == N_TESTS and rows[0]["solution"].startswith(f"def {io['fn_name']}(")
    cfg.dataset.train_path = "x.jsonl"
    with pytest.raises(DatasetError, match="^dataset.name=tiny_code generates its training problems: leave "
                                           r"dataset.train_path null \(dataset.eval_path may name"):
        dataset_paths(cfg.dataset, cfg.cache_dir)
