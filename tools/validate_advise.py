"""The allocation advisor's predictions against measured runs of tiny_arith (docs/advise.md, "Validation").

Generation on core 0 and training on core 1, by the recipe's meshes. First a short profiling set
(η = 4 without interruption at two values of rollout.max_concurrent, one interrupting run, so that
the interrupting update's pause is fitted, and one synchronous run, in which generation and training
take turns, so that what each costs alone separates from what sharing the machine adds); the
advisor fits its costs from their metrics.jsonl. Then each measured configuration (η × interrupt)
runs once and is predicted by the simulation with the fitted costs; the table gives measured and
predicted trained samples/s, idle fractions and staleness, with the relative error, and a plot
is written.

    python tools/validate_advise.py [--steps 30] [--profile-steps 20] [--etas 0 1 4] [--keep DIR [--reuse]] [-- overrides]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import replace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402
from rich.console import Console  # noqa: E402

from _bench import machine, read_run_dir, run_recipe, save_plot, timed_steps  # noqa: E402

from areal_flow.advise.costs import parse_costs  # noqa: E402
from areal_flow.advise.fit import fit_runs  # noqa: E402
from areal_flow.advise.report import costs_table  # noqa: E402
from areal_flow.advise.simulate import Candidate, simulate  # noqa: E402


def measured(metrics: list[dict]) -> dict:
    """Trained samples/s, idle fractions and mean staleness over a run's steps after the first."""
    steps, wall = timed_steps(metrics)
    gen_idle = [(m["generator_idle"], m["step_seconds"]) for m in steps if m.get("generator_idle") is not None]
    return {
        "samples_per_s": sum(m["samples_per_second"] * m["step_seconds"] for m in steps) / wall,
        "gen_idle": sum(i * s for i, s in gen_idle) / wall if gen_idle else float("nan"),
        "train_idle": 1 - sum(m["train_seconds"] for m in steps) / wall,
        "staleness_mean": sum(m["staleness_mean"] for m in steps) / len(steps),
        "steps": len(steps),
    }


def error(predicted: float, actual: float) -> str:
    return f"{(predicted - actual) / actual:+.0%}" if actual else "—"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="train steps of each measured run")
    ap.add_argument("--profile-steps", type=int, default=20, help="train steps of each profiling run")
    ap.add_argument("--etas", type=int, nargs="+", default=[0, 1, 4], help="η of the measured runs")
    ap.add_argument("--interrupt", nargs="+", default=["false", "true"], choices=["false", "true"],
                    help="rollout.interrupt of the measured runs")
    ap.add_argument("--profile-concurrency", type=int, nargs=2, default=[4, 32], metavar=("LOW", "HIGH"),
                    help="rollout.max_concurrent of the two non-interrupting profiling runs")
    ap.add_argument("--keep", metavar="DIR", help="keep the run directories here (default: a temporary directory)")
    ap.add_argument("--reuse", action="store_true",
                    help="with --keep: read the runs an earlier call left there instead of running them again "
                         "(to predict the same runs after a change to the advisor)")
    ap.add_argument("--plot", default="docs/validate_advise.png")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = ap.parse_args()
    if args.reuse and not args.keep:
        ap.error("--reuse needs --keep DIR")

    def run(run_dir: str, overrides: list[str]) -> tuple[dict, list[dict]]:
        if args.reuse and os.path.isfile(os.path.join(run_dir, "summary.json")):
            print(f"reusing {run_dir}", flush=True)
            return read_run_dir(run_dir)
        return run_recipe(run_dir, overrides)

    base = ["eval_at_start=false", "eval_at_end=false", "eval_every=0", "max_wall_seconds=0", "metrics.plot=false",
            *args.overrides]
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or tmp
        os.makedirs(root, exist_ok=True)
        profiles = []
        for name, extra in (
            *((f"profile_c{c}", ["rollout.interrupt=false", f"rollout.max_concurrent={c}", "rollout.max_staleness=4"])
              for c in args.profile_concurrency),
            ("profile_interrupt", ["rollout.interrupt=true", "rollout.max_staleness=4"]),
            ("profile_sync", ["rollout.interrupt=false", "rollout.max_staleness=0"]),
        ):
            run(f"{root}/{name}", [*base, f"total_steps={args.profile_steps}", *extra])
            profiles.append(f"{root}/{name}")
        fitted = fit_runs(profiles, parse_costs({})[0])
        rows = []
        for interrupt in args.interrupt:
            for eta in args.etas:
                name = f"eta{eta}_interrupt_{interrupt}"
                _, metrics = run(f"{root}/{name}", [*base, f"total_steps={args.steps}",
                                                           f"rollout.max_staleness={eta}", f"rollout.interrupt={interrupt}"])
                start = next(m for m in metrics if m["event"] == "start")
                costs = replace(fitted.costs, workload=replace(
                    fitted.costs.workload, interrupt=interrupt == "true", batch_size=start["batch_size"],
                    group_size=start["group_size"], max_concurrent=_max_concurrent(f"{root}/{name}")))
                # The measured window starts after the first step, as timed_steps() does.
                pred = simulate(costs, Candidate(*fitted.split, eta=eta, interrupt=interrupt == "true"),
                                steps=args.steps - 1, warmup=1)
                rows.append((eta, interrupt, measured(metrics), pred))
    console = Console(width=140)
    console.print(f"\nmachine: {machine()}", highlight=False)
    console.print(f"command: python tools/validate_advise.py --steps {args.steps} --profile-steps {args.profile_steps} "
                  f"--etas {' '.join(map(str, args.etas))} --interrupt {' '.join(args.interrupt)}", highlight=False)
    for note in fitted.notes:
        console.print(f"fit: {note}", highlight=False)
    console.print(costs_table(fitted.costs))
    print("\n| η | interrupt | samples/s measured | predicted | error | gen idle measured | predicted | "
          "train idle measured | predicted | staleness measured | predicted |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for eta, interrupt, m, p in rows:
        print(f"| {eta} | {interrupt} | {m['samples_per_s']:.1f} | {p.samples_per_s:.1f} | "
              f"{error(p.samples_per_s, m['samples_per_s'])} | {m['gen_idle']:.0%} | {p.gen_idle:.0%} | "
              f"{m['train_idle']:.0%} | {p.train_idle:.0%} | {m['staleness_mean']:.2f} | {p.staleness_mean:.2f} |")
    errors = [abs(p.samples_per_s - m["samples_per_s"]) / m["samples_per_s"] for _, _, m, p in rows]
    print(f"\nmean |error| of trained samples/s: {sum(errors) / len(errors):.0%}, largest {max(errors):.0%}")

    fig, ax = plt.subplots(figsize=(7, 3.8))
    labels = [f"η={eta}\n{'interrupt' if i == 'true' else 'drain'}" for eta, i, _, _ in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [m["samples_per_s"] for _, _, m, _ in rows], width=0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], [p.samples_per_s for _, _, _, p in rows], width=0.4, label="predicted")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("trained samples / s")
    ax.set_title("advisor: predicted vs measured, tiny_arith, 2 cores", fontsize=9)
    ax.legend(fontsize=8)
    save_plot(fig, args.plot)


def _max_concurrent(run_dir: str) -> int | None:
    """rollout.max_concurrent of a run, from its resolved config.yaml."""
    with open(os.path.join(run_dir, "config.yaml")) as f:
        return (yaml.safe_load(f).get("rollout") or {}).get("max_concurrent")


if __name__ == "__main__":
    main()
