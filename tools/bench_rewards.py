"""Reward throughput on one process: how many completions a reward worker scores per second.

Part `math`: the `math` reward (areal_flow/rewards/math.py: extraction, then math-verify against the
reference) over a fixed mix of --pairs (completion, reference) pairs generated here from --seed:
integers, decimals against fractions (`fraction`: either side may hold the decimal), linear
expressions written in another order (`expression`), and wrong answers of each of those kinds; a
quarter of the references are JSON lists of two answers, as AReaL's `solutions` field arrives.
Every repeat starts with math-verify's and sympy's caches empty, so no pair is scored from an
earlier repeat's parse; the best of --repeats is reported, per kind and over the mix. Each pair's
reward is checked against the one the mix expects.

A part is one entry of PARTS, chosen with --only; `code` (programs/s in the sandbox) is to come.

    python tools/bench_rewards.py [--only math] [--pairs 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from fractions import Fraction

from rich.console import Console
from rich.table import Table

from _bench import machine
from areal_flow.rewards.math import DEFAULT_TIMEOUT, math_reward

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
            # Not t, s, m...: math-verify drops a trailing unit letter (tests/rewards/test_math_reward.py).
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


# A part is a function (args, console) that prints its own table; `code` is meant to join `math` here.
PARTS = {"math": bench_math}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=list(PARTS), help="run one part (default: every part)")
    ap.add_argument("--pairs", type=int, default=200, help="math: (completion, reference) pairs in the mix")
    ap.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT, help="math: the reward's timeout, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each part; the best is reported")
    args = ap.parse_args()
    console = Console()
    console.print(f"machine: {machine()}")
    console.print(f"command: python tools/bench_rewards.py{f' --only {args.only}' if args.only else ''} "
                  f"--pairs {args.pairs} --repeats {args.repeats}")
    for name in [args.only] if args.only else PARTS:
        PARTS[name](args, console)


if __name__ == "__main__":
    main()
