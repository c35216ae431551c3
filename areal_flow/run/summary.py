"""The end of a finished run: its summary table, step profile, and plots (metrics.plot)."""

from __future__ import annotations

from rich.console import Console

from areal_flow.config.schema import RunConfig
from areal_flow.launchers.progress import print_summary
from areal_flow.metrics.profile import profile_table
from areal_flow.metrics.writer import read_metrics
from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.spec import RunSpec


def report(cfg: RunConfig, spec: RunSpec, console: Console) -> None:
    """Print the summary of the run in `spec.run_dir`; write profile.md and, with metrics.plot, the
    learning curve and the step timeline."""
    metrics = read_metrics(spec.path(rd.METRICS))
    print_summary(console, spec.run_dir, metrics)
    with open(spec.path(rd.PROFILE), "w") as f:
        f.write(profile_table(metrics))
    console.print(f"step profile: {spec.path(rd.PROFILE)}", highlight=False)
    if cfg.metrics.plot:
        from areal_flow.metrics.plot import plot_learning_curve  # matplotlib: half a second of every start
        from areal_flow.metrics.profile import plot_timeline

        png = plot_learning_curve(metrics, spec.path(rd.LEARNING_CURVE), f"{cfg.recipe} (η={cfg.rollout.max_staleness})")
        console.print(f"learning curve: {png}", highlight=False)
        if any(m["event"] == "step" for m in metrics):
            png = plot_timeline(metrics, spec.path(rd.PROFILE_PLOT), title=f"{cfg.recipe}: the last steps")
            console.print(f"step timeline: {png}", highlight=False)
