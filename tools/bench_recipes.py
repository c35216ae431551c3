"""Trained samples/s of recipes: this tree against commit REV, or against itself with other settings, alternated in one run.

Each recipe runs --steps training steps (training only: no held-out evaluation, no wall limit) with
this tree's code and with REV's (a git worktree of it), or with this tree and --versus's overrides
(e.g. `--versus flight.record=false`), one after the other, --repeats times in alternating order,
so the machine's load falls on both sides alike. Reported per recipe and side:
trained samples/s over the timed steps (the first step, with start-up, left out; the mean over the
repeats), the generator's and the trainer's busy shares, the generator's decode and prefill seconds
a step, and the ratio this tree / REV with its spread over the repeats. A bar plot goes to --plot.

    python tools/bench_recipes.py --against REV [--recipes tiny_arith tiny_arith_tool code_tiny_feedback]
                                  [--steps 30] [--repeats 2] [-- extra overrides]
    python tools/bench_recipes.py --versus flight.record=false --recipes tiny_arith
    python tools/bench_recipes.py --versus training.zero_mismatch=true --recipes tiny_arith --steps 40 \
        -- rollout.max_staleness=0 generation.deterministic=true

The max |Δ log p| column is the largest behaviour/trainer mismatch of any step's trained tokens
(train/mismatch/abs_max, where a step measures it), with the tokens it covers, over all its runs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from _bench import TRAINING_ONLY, machine, run_recipe, save_plot, timed_steps, worktree  # noqa: E402

HERE = "this tree"


def measure(metrics: list[dict]) -> dict[str, float]:
    """A run's figures over its timed steps."""
    steps, wall = timed_steps(metrics)
    every = [m for m in metrics if m["event"] == "step"]
    idle = [m.get("generator_idle") for m in steps]
    return {
        "samples_per_s": sum(m["samples_per_second"] * m["step_seconds"] for m in steps) / wall,
        "generator_busy": 1 - sum((gi or 0.0) * m["step_seconds"] for gi, m in zip(idle, steps)) / wall,
        "trainer_busy": sum(m["train_seconds"] - (m.get("train/wait_seconds") or 0.0) for m in steps) / wall,
        "decode_s": statistics.mean(m.get("gen/decode_seconds") or 0.0 for m in steps),
        "prefill_s": statistics.mean(m.get("gen/prefill_seconds") or 0.0 for m in steps),
        # The trainer/server mismatch over every step's trained tokens (where the step measured it:
        # train/mismatch/*), max |log π_start − log π_behav|, and the tokens it covers.
        "mismatch_max": max((m.get("train/mismatch/abs_max") or 0.0 for m in every), default=0.0),
        "mismatch_tokens": sum(m.get("train/mismatch/tokens") or 0.0 for m in every),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    side = ap.add_mutually_exclusive_group(required=True)
    side.add_argument("--against", help="the commit to compare with (a git revision)")
    side.add_argument("--versus", nargs="+", metavar="KEY=VALUE", help="this tree with these overrides instead")
    ap.add_argument("--recipes", nargs="+", default=["tiny_arith", "tiny_arith_tool", "code_tiny_feedback"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--plot", default="docs/bench_recipes.png")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = ap.parse_args()
    other = args.against or " ".join(args.versus)
    # side -> (checkout, extra overrides)
    sides = {HERE: (None, []), other: (worktree(args.against, "bench_recipes_"), []) if args.against else
             (None, args.versus)}
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for recipe in args.recipes:
                order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
                for side in order:
                    tree, extra = sides[side]
                    overrides = [f"recipe={recipe}", f"total_steps={args.steps}", *TRAINING_ONLY, *args.overrides, *extra]
                    _, metrics = run_recipe(f"{tmp}/{recipe}-{repeat}-{len(runs)}", overrides, tree=tree)
                    runs.setdefault((recipe, side), []).append(measure(metrics))
    console = Console(width=140)
    console.print(f"machine: {machine()}")
    flag = f"--against {args.against}" if args.against else f"--versus {other}"
    console.print(f"command: python tools/bench_recipes.py {flag} --recipes {' '.join(args.recipes)} "
                  f"--steps {args.steps} --repeats {args.repeats} {' '.join(args.overrides)}".rstrip())
    table = Table(title=f"trained samples/s, {args.steps} steps (first left out), mean of {args.repeats} alternated runs")
    for column in ("recipe", "side", "samples/s", "generator busy", "trainer busy", "decode s/step",
                   "prefill s/step", "max |Δ log p| (tokens)", "this tree / other"):
        table.add_column(column)
    ratios = {}
    for recipe in args.recipes:
        mine, theirs = runs[recipe, HERE], runs[recipe, other]
        each = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(mine, theirs)]
        ratios[recipe] = statistics.mean(r["samples_per_s"] for r in mine) / statistics.mean(
            r["samples_per_s"] for r in theirs)
        for side, rows in ((HERE, mine), (other, theirs)):
            mean = {k: statistics.mean(r[k] for r in rows) for k in rows[0]}
            table.add_row(recipe, side, f"{mean['samples_per_s']:.1f}", f"{100 * mean['generator_busy']:.0f}%",
                          f"{100 * mean['trainer_busy']:.0f}%", f"{mean['decode_s']:.2f}", f"{mean['prefill_s']:.2f}",
                          f"{max(r['mismatch_max'] for r in rows):.2g} ({sum(r['mismatch_tokens'] for r in rows):,.0f})",
                          f"{ratios[recipe]:.2f}× ({min(each):.2f}–{max(each):.2f})" if side == HERE else "")
    console.print(table)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.38
    for i, side in enumerate((other, HERE)):
        means = [statistics.mean(r["samples_per_s"] for r in runs[recipe, side]) for recipe in args.recipes]
        ax.bar([x + (i - 0.5) * width for x in range(len(args.recipes))], means, width, label=side)
    ax.set_xticks(range(len(args.recipes)), args.recipes)
    ax.set_ylabel("trained samples/s")
    ax.set_title(f"this tree against {other} ({args.steps} steps, {args.repeats} runs each)")
    ax.legend()
    save_plot(fig, args.plot)


if __name__ == "__main__":
    main()
