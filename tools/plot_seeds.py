"""Held-out accuracy of several runs of one recipe (seeds), on one plot and in one table.

Each run directory's metrics.jsonl gives its held-out evaluations; each is placed at the training
time (the `elapsed` of the step it followed, evaluation pauses excluded) so runs of different
speeds compare at equal wall time. The table gives each run's start, end, gain and steps, and the
mean gain with its spread.

    python tools/plot_seeds.py RUN_DIR [RUN_DIR ...] --out docs/code_tiny_seeds.png [--title TEXT]
        [--figure KEY ...]   # eval row keys beside accuracy, a panel each (e.g. agent/reward/checker)
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from _bench import save_plot  # noqa: E402


def held_out_curve(run_dir: Path, key: str = "accuracy") -> tuple[list[tuple[float, float]], int]:
    """[(training seconds, the eval row's `key`)] of the run's evaluations, and its steps trained.
    ValueError naming the file when it holds no evaluation, or the key when an evaluation lacks it."""
    path = run_dir / "metrics.jsonl"
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: {e}") from None
    elapsed = {0: 0.0, **{r["step"]: r["elapsed"] for r in rows if r["event"] == "step"}}
    evals = [r for r in rows if r["event"] == "eval"]
    if not evals:
        raise ValueError(f"{path}: no held-out evaluation (eval rows) in it")
    if missing := [r["version"] for r in evals if key not in r]:
        raise ValueError(f"{path}: the evaluation at version {missing[0]} has no {key!r}")
    curve = [(elapsed.get(r["step"], max(elapsed.values())), r[key]) for r in evals]
    return curve, max(elapsed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (one per seed)")
    ap.add_argument("--out", required=True, help="the plot's path (PNG)")
    ap.add_argument("--title", default="held-out accuracy", help="the plot's title")
    ap.add_argument("--figure", action="append", default=[], help="an eval row key to plot beside accuracy")
    args = ap.parse_args()
    keys = ["accuracy", *args.figure]
    try:
        curves = {key: {run: held_out_curve(run, key) for run in args.runs} for key in keys}
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    fig, axes = plt.subplots(1, len(keys), figsize=(7 * len(keys), 4), squeeze=False)
    for key, ax in zip(keys, axes[0]):
        plot_key(key, curves[key], ax, args.title if key == "accuracy" else f"{args.title}: {key}")
    save_plot(fig, args.out)


def plot_key(key: str, curves: dict, ax, title: str) -> None:
    """One panel and one table: each run's `key` over training time, its start, end and gain."""
    table = Table(title=title)
    for col in ("run", "start", "end", "gain (points)", "steps", "training s"):
        table.add_column(col, justify="left" if col == "run" else "right")
    gains = []
    for run, (curve, steps) in curves.items():
        seconds, values = zip(*curve)
        ax.plot(seconds, [100 * a for a in values], "o-", label=run.name)
        gains.append(100 * (values[-1] - values[0]))
        table.add_row(run.name, f"{100 * values[0]:.1f}%", f"{100 * values[-1]:.1f}%", f"{gains[-1]:+.1f}",
                      str(steps), f"{seconds[-1]:.0f}")
    spread = statistics.stdev(gains) if len(gains) > 1 else 0.0
    table.add_row("mean", "", "", f"{statistics.mean(gains):+.1f} ± {spread:.1f}", "", "")
    Console().print(table)
    ax.set_xlabel("training time (s)")
    ax.set_ylabel(f"held-out {'accuracy' if key == 'accuracy' else key} (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()


if __name__ == "__main__":
    main()
