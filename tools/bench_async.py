"""Asynchronous (η=4) against synchronous (η=0) training: same recipe, same cores, one run each.

Generation is pinned to core 0 and the trainer to core 1 by the recipe's meshes. Prints trained
samples per second for both, the ratio, and each side's busy fraction, and writes a bar plot.

With η = 0 among the runs it also prints the two-stage pipeline's bound, from the same runs: at
η = 0 the sides take turns, each busy T_gen and T_train seconds a step; overlapped perfectly a step
takes max(T_gen, T_train), so no η trains faster than (T_gen + T_train) / max(T_gen, T_train) times
η = 0. The measured ratio's share of that bound is what asynchrony leaves on the table.

    python tools/bench_async.py [--steps 40] [--etas 0 4] [-- extra overrides]
"""

from __future__ import annotations

import argparse
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from _bench import TRAINING_ONLY, machine, run_recipe, save_plot, timed_steps  # noqa: E402


def _computing(step: dict) -> float:
    """The trainer's seconds of a step at work: train_seconds less its wait for the step's groups."""
    return step["train_seconds"] - (step.get("train/wait_seconds") or 0.0)


def pipeline_bound(sync_runs: list[dict]) -> tuple[float, float, float]:
    """(T_gen, T_train, bound) from η = 0 runs: each side's busy seconds a step (means over the runs)
    and (T_gen + T_train) / max(T_gen, T_train), the most an overlapped pipeline can gain."""
    t_gen = sum(r["gen_seconds"] for r in sync_runs) / len(sync_runs)
    t_train = sum(r["train_seconds"] for r in sync_runs) / len(sync_runs)
    return t_gen, t_train, (t_gen + t_train) / max(t_gen, t_train)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--etas", type=int, nargs="+", default=[0, 4])
    ap.add_argument("--plot", default="docs/bench_async.png")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = ap.parse_args()
    base = [f"total_steps={args.steps}", *TRAINING_ONLY, *args.overrides]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, eta in enumerate(args.etas):  # an η may repeat (alternated runs)
            _, metrics = run_recipe(f"{tmp}/run{i}-eta{eta}", [*base, f"rollout.max_staleness={eta}"])
            steps, wall = timed_steps(metrics)
            gen_idle = [m["generator_idle"] for m in steps if m.get("generator_idle") is not None]
            # The trainer's step less its wait for the step's groups (train/wait_seconds), which
            # train_seconds holds: at η > 0 the trainer may wait there for the generator.
            computing = sum(_computing(m) for m in steps)
            rows.append({
                "eta": eta,
                "samples_per_s": sum(m["samples_per_second"] * m["step_seconds"] for m in steps) / wall,
                "trainer_busy": computing / wall,
                "trainer_wait": sum(m.get("train/wait_seconds") or 0.0 for m in steps) / wall,
                "generator_busy": 1 - sum(gi * m["step_seconds"] for gi, m in zip(gen_idle, steps)) / wall
                if gen_idle else float("nan"),
                "staleness_max": max(m["staleness_max"] for m in steps),
                # Busy seconds a step of each side: the pipeline bound's terms (η = 0 runs).
                "train_seconds": computing / len(steps),
                "gen_seconds": sum((1 - gi) * m["step_seconds"] for gi, m in zip(gen_idle, steps)) / len(steps)
                if gen_idle else float("nan"),
                "steps": len(steps),
            })
    print(f"\nmachine: {machine()}")
    print(f"command: python tools/bench_async.py --steps {args.steps} --etas {' '.join(map(str, args.etas))} "
          f"{' '.join(args.overrides)}".rstrip())
    print("\n| η | steps timed | trained samples/s | trainer busy | trainer waiting for groups | generator busy | "
          "max staleness |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['eta']} | {r['steps']} | {r['samples_per_s']:.1f} | {100 * r['trainer_busy']:.0f}% | "
              f"{100 * r['trainer_wait']:.0f}% | {100 * r['generator_busy']:.0f}% | {r['staleness_max']} |")
    # Repeated (alternated) runs of one η are averaged before the ratio: the runs of one η differ
    # by several percent on a shared machine, so one pair alone says little.
    by_eta = {eta: [r for r in rows if r["eta"] == eta] for eta in dict.fromkeys(args.etas)}
    mean = {eta: sum(r["samples_per_s"] for r in rs) / len(rs) for eta, rs in by_eta.items()}
    first = next(iter(by_eta))
    print()
    for eta, rs in by_eta.items():
        busy = ", ".join(f"{100 * r['trainer_busy']:.0f}%/{100 * r['generator_busy']:.0f}%" for r in rs)
        ratio = "" if eta == first else f", {mean[eta] / mean[first]:.2f}× η={first}"
        print(f"η={eta}: {mean[eta]:.1f} trained samples/s (mean of {len(rs)}){ratio}; trainer/generator busy {busy}")
    if 0 in by_eta and len(by_eta) > 1:
        t_gen, t_train, bound = pipeline_bound(by_eta[0])
        print(f"\ntwo-stage bound from η=0: T_gen {t_gen:.3f} s + T_train {t_train:.3f} s a step → {bound:.2f}×")
        for eta in by_eta:
            if eta != 0:
                ratio = mean[eta] / mean[0]
                print(f"η={eta}: {ratio:.2f}× η=0, {100 * ratio / bound:.0f}% of the bound")
    fig, ax = plt.subplots(figsize=(5, 3.5))
    # Bars by position: a repeated η would otherwise be one category, its bars drawn over each other.
    ax.bar(range(len(rows)), [r["samples_per_s"] for r in rows],
           tick_label=[f"η={r['eta']}\nrun {i + 1}" for i, r in enumerate(rows)])
    ax.set_ylabel("trained samples / s")
    ax.set_title("async vs sync, tiny_arith, 2 cores")
    save_plot(fig, args.plot)


if __name__ == "__main__":
    main()
