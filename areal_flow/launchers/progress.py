"""The launcher's view of a run: a progress bar fed by the controller's metrics.jsonl, and the
summary table at the end."""

from __future__ import annotations

import json
import os

from areal_flow.runtime import run_dir as rd

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


class RunProgress:
    """The bar of the run's steps, fed by the rows of metrics.jsonl this launch adds: the file of a
    resumed run already holds the steps up to its checkpoint (cut back to it), whose figures are
    not this launch's news; it is read from where it ends when the bar is made."""

    def __init__(self, metrics_path: str, total_steps: int, console: Console | None = None):
        self.path = metrics_path
        self.offset = os.path.getsize(metrics_path) if os.path.exists(metrics_path) else 0
        self.console = console or Console()
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"), console=self.console,
        )
        self.task = self.progress.add_task("starting", total=total_steps, info="")
        self.steps_shown = 0  # step rows shown so far
        self.reason: dict | None = None  # why the run ended, once its summary or failure row is read

    def __enter__(self) -> "RunProgress":
        self.progress.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.tick()  # the rows written since the last tick: the failure row of a controller that failed
        if exc_type is not None and self.reason is None:  # a bar that stops early says so
            self.progress.update(self.task, description="interrupted" if exc_type is KeyboardInterrupt else "failed")
        self.progress.stop()

    def tick(self) -> None:
        """Read metric lines written since the last tick and show them."""
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]  # a line still being written waits for the next tick
        self.offset += len(complete.encode())
        for line in complete.splitlines():
            self.show(json.loads(line))

    def show(self, row: dict) -> None:
        if row["event"] == "start":
            self.progress.update(self.task, description="evaluating")
        elif row["event"] == "resume":
            self.progress.update(self.task, completed=row["step"], description="resumed")
        elif row["event"] == "eval":
            self.progress.console.print(f"held-out accuracy at {row['when']}: {100 * row['accuracy']:.1f}% "
                                        f"({row['seconds']:.1f} s)")
            self.progress.update(self.task, description="training")
        elif row["event"] == "step":
            info = (f"reward {row['reward']:.2f}  staleness ≤{row['staleness_max']}  "
                    f"{row['samples_per_second']:.0f} samples/s")
            self.progress.update(self.task, completed=row["step"], description="training", info=info)
            if not self.console.is_terminal and (not self.steps_shown or row["step"] % 10 == 0):
                # Piped output (CI, nohup) gets no live bar: this launch's first step (a resumed run's
                # own), then a line every 10 steps.
                self.console.print(f"step {row['step']}: {info}", highlight=False)
            self.steps_shown += 1
        elif row["event"] == "warning":
            self.progress.console.print(f"[yellow]warning:[/] {escape(row['message'])}", highlight=False)
        elif row["event"] in ("summary", "failure") and row.get("stop_reason"):
            self.ended(row["stop_reason"], say=row["event"] == "summary")

    def ended(self, reason: dict, say: bool) -> None:
        """The bar says why the run ended; `say`: print it too (the launcher prints a failure itself)."""
        self.reason = reason
        kind, message = reason["kind"], reason["message"]
        how = {"total_steps": "done", "failure": "failed"}.get(kind, "stopped early")
        self.progress.update(self.task, description=how, info=message)
        if say:
            self.progress.console.print(f"run {'finished' if kind == 'total_steps' else 'stopped early'}: {message}",
                                        highlight=False, markup=False)


def summary_table(summary: dict, metrics: list[dict]) -> Table:
    steps = [m for m in metrics if m["event"] == "step"]

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    t = Table(title="areal_flow run summary")
    t.add_column("what")
    t.add_column("value", justify="right")
    if reason := summary.get("stop_reason"):  # absent from the summaries of older runs
        t.add_row("why it ended", reason["message"])
    t.add_row("held-out accuracy before", pct(summary["accuracy_start"]))
    t.add_row("held-out accuracy after", pct(summary["accuracy_end"]))
    t.add_row("train steps", str(summary["steps"]))
    t.add_row("trained samples", str(summary["trained_samples"]))
    t.add_row("training wall time", f"{summary['train_wall_seconds']:.1f} s")
    t.add_row("trained samples / s", f"{summary['samples_per_second']:.1f}")
    t.add_row("trainer busy", pct(summary["trainer_busy_fraction"]))
    if steps:
        idle = [s["generator_idle"] for s in steps if s.get("generator_idle") is not None]
        if idle:
            t.add_row("generator busy", pct(1 - sum(idle) / len(idle)))
        t.add_row("max realised staleness", str(max(s["staleness_max"] for s in steps)))
        if waits := [s["trainer_reward_wait"] for s in steps if "trainer_reward_wait" in s]:  # newer runs
            t.add_row("trainer waiting on rewards", pct(sum(waits) / len(waits)))
        # The weights' hand-over: the trainer writing them (disk, shm) and the servers' update after the step.
        timed = [s for s in steps if s.get("update_seconds") is not None and s.get("step_seconds")]
        if timed:
            for label, share in _update_shares(timed):
                t.add_row(label, pct(share))
        if suspect := [s["reward/suspect"] for s in steps if "reward/suspect" in s]:  # code and math rewards
            t.add_row("suspect samples (gamed or hedged)", f"{pct(sum(suspect) / len(suspect))} (max {pct(max(suspect))})")
        for key in sorted({k for s in steps for k in s if k.startswith("reward_busy/")}):
            busy = [s[key] for s in steps if key in s]
            t.add_row(f"reward workers busy ({key.split('/', 1)[1]})", pct(sum(busy) / len(busy)))
    t.add_row("checkpoint", summary["checkpoint"])
    return t


def _update_shares(steps: list[dict]) -> list[tuple[str, float]]:
    """The weight hand-over's share of the steps, and, where the servers counted their load time
    (generator_load, a share of each step), its parts: the trainer writing the weights, the servers
    finishing or cutting the answers they run (a drain with rollout.interrupt=false, an abort with
    true) and their load."""
    wall = sum(s["step_seconds"] for s in steps)
    publish = sum(s.get("train/publish_seconds", 0.0) for s in steps)
    update = sum(s["update_seconds"] for s in steps)
    rows = [("weight updates (of a step)", (publish + update) / wall)]
    if all(s.get("generator_load") is not None for s in steps):
        load = sum(s["generator_load"] * s["step_seconds"] for s in steps)
        rows += [("  the trainer writing them", publish / wall),
                 ("  the servers finishing or cutting answers", max(0.0, update - load) / wall),
                 ("  the servers loading them", min(load, update) / wall)]
    return rows


def print_summary(console: Console, run_dir: str, metrics: list[dict]) -> dict:
    with open(os.path.join(run_dir, rd.SUMMARY)) as f:
        summary = json.load(f)
    console.print(summary_table(summary, metrics))
    return summary
