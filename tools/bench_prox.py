"""What π_prox costs the trainer: its forward pass against the exact shortcut and the log-linear
approximation, on the default recipe, one run each.

- one optimizer step per update (the default): the prox forward (`prox_shortcut=false`) against
  the shortcut, where the trained logprobs are π_prox;
- two optimizer steps per update (`n_minibatches=2`), where no shortcut is exact: the prox forward
  against `prox_logp=loglinear`.

Prints the trainer's seconds per step, the prox forward's share and trained samples per second,
with the ratios, and writes a bar plot.

    python tools/bench_prox.py [--steps 30] [-- extra overrides]
"""

from __future__ import annotations

import argparse
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from _bench import TRAINING_ONLY, machine, run_recipe, save_plot, timed_steps  # noqa: E402

CASES = [
    ("1 step, prox forward", ["algorithm.prox_shortcut=false"]),
    ("1 step, shortcut", []),
    ("2 minibatches, prox forward", ["algorithm.n_minibatches=2"]),
    ("2 minibatches, loglinear", ["algorithm.n_minibatches=2", "algorithm.prox_logp=loglinear"]),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--plot", default="docs/bench_prox.png")
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = ap.parse_args()
    base = [f"total_steps={args.steps}", *TRAINING_ONLY, *args.overrides]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(CASES):
            _, metrics = run_recipe(f"{tmp}/case{i}", [*base, *overrides])
            steps, wall = timed_steps(metrics)
            train = sum(m["train_seconds"] for m in steps)
            rows.append({
                "case": name,
                "train_s": train / len(steps),
                "prox_share": sum(m.get("train/prox_seconds", 0.0) for m in steps) / train,
                "samples_per_s": sum(m["samples_per_second"] * m["step_seconds"] for m in steps) / wall,
            })
    print(f"\nmachine: {machine()}")
    print(f"command: python tools/bench_prox.py --steps {args.steps}")
    print("\n| case | trainer s/step | prox forward share | trained samples/s |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['train_s']:.3f} | {100 * r['prox_share']:.0f}% | {r['samples_per_s']:.1f} |")
    for slow, fast in ((0, 1), (2, 3)):
        print(f"\n{rows[fast]['case']} vs {rows[slow]['case']}: trainer {rows[slow]['train_s'] / rows[fast]['train_s']:.2f}× "
              f"faster per step, {rows[fast]['samples_per_s'] / rows[slow]['samples_per_s']:.2f}× trained samples/s")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["case"] for r in rows], [r["train_s"] for r in rows])
    ax.set_xlabel("trainer seconds per step")
    ax.invert_yaxis()
    ax.set_title("π_prox: forward pass vs shortcut vs log-linear, tiny_arith, 2 cores")
    save_plot(fig, args.plot)


if __name__ == "__main__":
    main()
