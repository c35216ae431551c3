"""The allocation advisor's predictions against measured runs of tiny_arith (docs/advise.md, "Validation").

Generation on core 0 and training on core 1, by the recipe's meshes. First a short profiling set:
η = 1 with draining updates, η = 4 draining and interrupting (so that the interrupting update's
pause is fitted), and one synchronous run (η = 0), in which generation and training take turns,
so that what each costs alone separates from what sharing the machine adds;
the advisor fits its costs from their metrics.jsonl. Then each measured configuration (η ×
interrupt) runs and is predicted by the simulation with the fitted costs; the table gives measured
and predicted trained samples/s, idle fractions and staleness, with the relative error, and a plot
is written. With --repeats N the profiling set and every configuration run N times, in rounds, and
the table gives each configuration's mean.

    python tools/validate_advise.py [--steps 30] [--profile-steps 20] [--repeats 1] [--etas 0 1 4] [--sim-seeds 8]
                                    [--keep DIR [--reuse]] [-- overrides]
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

from _bench import TRAINING_ONLY, machine, read_run_dir, run_recipe, save_plot, timed_steps  # noqa: E402

from areal_flow.advise.cost_file import parse_costs  # noqa: E402
from areal_flow.advise.fit import fit_runs  # noqa: E402
from areal_flow.advise.prediction import Candidate  # noqa: E402
from areal_flow.advise.report import costs_table  # noqa: E402
from areal_flow.advise.simulate import simulate  # noqa: E402


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


def mean_of(runs: list[dict]) -> dict:
    """The repeats of one configuration: each figure's mean."""
    return {key: sum(r[key] for r in runs) / len(runs) for key in runs[0]}


def error(predicted: float, actual: float) -> str:
    return f"{(predicted - actual) / actual:+.0%}" if actual else "—"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="train steps of each measured run")
    ap.add_argument("--profile-steps", type=int, default=20, help="train steps of each profiling run")
    ap.add_argument("--etas", type=int, nargs="+", default=[0, 1, 4], help="η of the measured runs")
    ap.add_argument("--interrupt", nargs="+", default=["false", "true"], choices=["false", "true"],
                    help="rollout.interrupt of the measured runs")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the profiling set and each configuration this many times (runs of one configuration "
                         "differ by up to a third on a shared machine); the fit takes every profiling run, "
                         "the table each configuration's mean")
    ap.add_argument("--keep", metavar="DIR", help="keep the run directories here (default: a temporary directory)")
    ap.add_argument("--reuse", action="store_true",
                    help="with --keep: read the runs an earlier call left there instead of running them again "
                         "(to predict the same runs after a change to the advisor)")
    ap.add_argument("--sim-seeds", type=int, default=8, help="simulate each configuration with this many seeds "
                    "(length and filter draws) and predict their mean")
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

    base = [*TRAINING_ONLY, *args.overrides]
    profile_configs = [
        ("profile_eta1", ["rollout.interrupt=false", "rollout.max_staleness=1"]),  # the sides in lockstep
        ("profile_eta4", ["rollout.interrupt=false", "rollout.max_staleness=4"]),
        ("profile_interrupt", ["rollout.interrupt=true", "rollout.max_staleness=4"]),
        ("profile_sync", ["rollout.interrupt=false", "rollout.max_staleness=0"]),
    ]
    # Drain and interrupt alternate, and each repeat runs the whole set again, so that a drift of the
    # machine's speed over the series spreads over every configuration instead of biasing the later ones.
    configs = [(eta, interrupt) for eta in args.etas for interrupt in args.interrupt]
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or tmp
        os.makedirs(root, exist_ok=True)
        profiles, runs = [], {config: [] for config in configs}
        for rep in range(args.repeats):
            suffix = f"_r{rep + 1}" if rep else ""
            for name, extra in profile_configs:
                run(f"{root}/{name}{suffix}", [*base, f"total_steps={args.profile_steps}", *extra])
                profiles.append(f"{root}/{name}{suffix}")
            for eta, interrupt in configs:
                run_dir = f"{root}/eta{eta}_interrupt_{interrupt}{suffix}"
                _, metrics = run(run_dir, [*base, f"total_steps={args.steps}", f"rollout.max_staleness={eta}",
                                           f"rollout.interrupt={interrupt}"])
                runs[eta, interrupt].append((run_dir, metrics))
        fitted = fit_runs(profiles, parse_costs({})[0])
        rows = []
        for (eta, interrupt), done in runs.items():
            run_dir, metrics = done[0]
            start = next(m for m in metrics if m["event"] == "start")
            costs = replace(fitted.costs, workload=replace(
                fitted.costs.workload, interrupt=interrupt == "true", batch_size=start["batch_size"],
                group_size=start["group_size"], max_concurrent=_max_concurrent(run_dir)))
            # The measured window starts after the first step, as timed_steps() does; over so few
            # steps one draw of the lengths and the filter moves a prediction by ~5%: the mean of several.
            cand = Candidate(*fitted.split, eta=eta, interrupt=interrupt == "true")
            pred = simulate(costs, cand, steps=args.steps - 1, warmup=1, seeds=args.sim_seeds)
            rows.append((eta, interrupt, [measured(m) for _, m in done], pred))
    console = Console(width=140)
    console.print(f"\nmachine: {machine()}", highlight=False)
    console.print(f"command: python tools/validate_advise.py --steps {args.steps} --profile-steps {args.profile_steps} "
                  f"--repeats {args.repeats} "
                  f"--etas {' '.join(map(str, args.etas))} --interrupt {' '.join(args.interrupt)}", highlight=False)
    for note in fitted.notes:
        console.print(f"fit: {note}", highlight=False)
    console.print(costs_table(fitted.costs))
    print("\n| η | interrupt | samples/s measured | predicted | error | gen idle measured | predicted | "
          "train idle measured | predicted | staleness measured | predicted |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [(eta, interrupt, mean_of(ms), ms, p) for eta, interrupt, ms, p in rows]
    for eta, interrupt, m, ms, p in rows:
        each = " (" + ", ".join(f"{x['samples_per_s']:.1f}" for x in ms) + ")" if len(ms) > 1 else ""
        print(f"| {eta} | {interrupt} | {m['samples_per_s']:.1f}{each} | {p.samples_per_s:.1f} | "
              f"{error(p.samples_per_s, m['samples_per_s'])} | {m['gen_idle']:.0%} | {p.gen_idle:.0%} | "
              f"{m['train_idle']:.0%} | {p.train_idle:.0%} | {m['staleness_mean']:.2f} | {p.staleness_mean:.2f} |")
    errors = [abs(p.samples_per_s - m["samples_per_s"]) / m["samples_per_s"] for _, _, m, _, p in rows]
    print(f"\nmean |error| of trained samples/s: {sum(errors) / len(errors):.0%}, largest {max(errors):.0%}")

    fig, ax = plt.subplots(figsize=(7, 3.8))
    labels = [f"η={eta}\n{'interrupt' if i == 'true' else 'drain'}" for eta, i, *_ in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [m["samples_per_s"] for _, _, m, _, _ in rows], width=0.4, label="measured (mean)")
    for x, (*_, ms, _) in zip(xs, rows):  # each repeat's run
        ax.plot([x - 0.2] * len(ms), [r["samples_per_s"] for r in ms], "k.", markersize=4)
    ax.bar([x + 0.2 for x in xs], [p.samples_per_s for *_, p in rows], width=0.4, label="predicted")
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
