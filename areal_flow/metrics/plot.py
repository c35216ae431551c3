"""Learning curves as a PNG: rewards per step and held-out accuracy against wall time."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402


def plot_learning_curve(metrics: list[dict], path: str, title: str = "") -> str:
    steps = [m for m in metrics if m["event"] == "step"]
    evals = [m for m in metrics if m["event"] == "eval"]
    t0 = min((m["time"] for m in metrics), default=0.0)
    fig, ax = plt.subplots(figsize=(7, 4))
    if steps:
        times, rewards = [m["time"] - t0 for m in steps], [m["reward"] for m in steps]
        ax.plot(times, rewards, ".", alpha=0.3, label="batch reward")
        window = max(1, len(rewards) // 20)
        smooth = [sum(rewards[max(0, i - window + 1): i + 1]) / len(rewards[max(0, i - window + 1): i + 1])
                  for i in range(len(rewards))]
        ax.plot(times, smooth, "-", label=f"batch reward (mean of {window})")
    if evals:
        ax.plot([m["time"] - t0 for m in evals], [m["accuracy"] for m in evals], "o-", label="held-out accuracy")
    ax.set_xlabel("wall time (s)")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
