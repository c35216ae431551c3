"""Held-out accuracy of several runs of one recipe (seeds), on one plot and in one table.

Each run directory's metrics.jsonl gives its held-out evaluations; each is placed at the training
time (the `elapsed` of the step it followed, evaluation pauses excluded) so runs of different
speeds compare at equal wall time. The table gives each run's start, end, gain and steps, and the
mean gain with its spread.

    python tools/plot_seeds.py RUN_DIR [RUN_DIR ...] --out docs/code_tiny_seeds.png [--title TEXT]
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


def held_out_curve(run_dir: Path) -> tuple[list[tuple[float, float]], int]:
    """[(training seconds, accuracy)] of the run's evaluations, and its steps trained. ValueError
    naming the file when it holds no evaluation."""
    path = run_dir / "metrics.jsonl"
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: {e}") from None
    elapsed = {0: 0.0, **{r["step"]: r["elapsed"] for r in rows if r["event"] == "step"}}
    curve = [(elapsed.get(r["step"], max(elapsed.values())), r["accuracy"]) for r in rows if r["event"] == "eval"]
    if not curve:
        raise ValueError(f"{path}: no held-out evaluation (eval rows) in it")
    return curve, max(elapsed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (one per seed)")
    ap.add_argument("--out", required=True, help="the plot's path (PNG)")
    ap.add_argument("--title", default="held-out accuracy", help="the plot's title")
    args = ap.parse_args()
    try:
        curves = {run: held_out_curve(run) for run in args.runs}
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    table = Table(title=args.title)
    for col in ("run", "start", "end", "gain (points)", "steps", "training s"):
        table.add_column(col, justify="left" if col == "run" else "right")
    fig, ax = plt.subplots(figsize=(7, 4))
    gains = []
    for run, (curve, steps) in curves.items():
        seconds, accuracy = zip(*curve)
        ax.plot(seconds, [100 * a for a in accuracy], "o-", label=run.name)
        gains.append(100 * (accuracy[-1] - accuracy[0]))
        table.add_row(run.name, f"{100 * accuracy[0]:.1f}%", f"{100 * accuracy[-1]:.1f}%", f"{gains[-1]:+.1f}",
                      str(steps), f"{seconds[-1]:.0f}")
    spread = statistics.stdev(gains) if len(gains) > 1 else 0.0
    table.add_row("mean", "", "", f"{statistics.mean(gains):+.1f} ± {spread:.1f}", "", "")
    Console().print(table)
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    save_plot(fig, args.out)


if __name__ == "__main__":
    main()
