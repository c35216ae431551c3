"""A `Snapshot` as rich renderables: the run's state, progress and versions, throughput, busy
fractions, staleness, the last evaluation, optional figures and the processes."""

from __future__ import annotations

import datetime
import os
import time

from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from areal_flow.status.model import Evaluation, Figure, ProcessStatus, Snapshot

STATE_STYLES = {"running": "bold green", "starting": "bold cyan", "preparing": "bold cyan", "finished": "bold blue",
                "stopped": "bold yellow", "ended": "bold red"}


def rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.1f}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def duration(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def age(s: float | None) -> str:
    return "-" if s is None else f"{duration(s)} ago"


def hist(counts: list[int] | None) -> str:
    """`0: 348 (23%)  1: 1,149 (77%)`: count (share) by staleness."""
    if not counts:
        return "-"
    total = sum(c for c in counts if isinstance(c, (int, float))) or 1
    return "  ".join(f"{i}: {c:,} ({100 * c / total:.0f}%)" for i, c in enumerate(counts) if c)


def value(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def table(title: str, *columns: str, left: tuple[int, ...] = (0,)) -> Table:
    """A table whose columns are right-justified but those numbered in `left`."""
    t = Table(title=title, title_justify="left", title_style="bold", expand=False, pad_edge=False)
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i in left else "right")
    return t


def header(snap: Snapshot) -> Text:
    text = Text()
    text.append("areal_flow status  ", style="bold")
    text.append(os.path.abspath(snap.run_dir))
    text.append("  ")
    text.append(snap.state or "?", style=STATE_STYLES.get(snap.state, "bold"))
    text.append(f"  (read {datetime.datetime.fromtimestamp(snap.at):%H:%M:%S})\n", style="dim")
    text.append(snap.note, style="dim")
    if snap.bad_lines:
        text.append(f"; {snap.bad_lines} line(s) of metrics.jsonl did not decode", style="yellow")
    return text


def progress(snap: Snapshot) -> Table:
    t = table("progress", "", "")
    t.show_header = False
    done = f"{snap.step} / {snap.total_steps}" if snap.total_steps else str(snap.step)
    if snap.total_steps:
        done += f" ({100 * snap.step / snap.total_steps:.0f}%)"
    t.add_row("step", done)
    if snap.total_steps:
        t.add_row("", ProgressBar(total=snap.total_steps, completed=min(snap.step, snap.total_steps), width=24))
    t.add_row("training time", duration(snap.elapsed))
    if snap.eta is not None:
        t.add_row("left (at this pace)", duration(snap.eta))
    t.add_row("trained version", value(snap.trained_version))
    t.add_row("loaded version (servers)", value(snap.loaded_version))
    served = sorted({p.weight_version for p in snap.processes if p.weight_version is not None})
    if served:
        t.add_row("servers answer (live)", ", ".join(served))
    if snap.summary:
        s = snap.summary
        if s.get("trained_samples") is not None:
            t.add_row("trained samples", value(s["trained_samples"]))
        if s.get("samples_per_second") is not None:
            t.add_row("run: trained samples/s", rate(s["samples_per_second"]))
    return t


def figures(title: str, snap: Snapshot, rows: list[tuple[str, Figure, object]]) -> Table:
    """Rows of (name, figure, how to format it)."""
    t = table(title, "", "last step", f"last {snap.window} step{'s' if snap.window != 1 else ''}")
    for name, f, fmt in rows:
        t.add_row(name, fmt(f.last), fmt(f.window))
    return t


def throughput(snap: Snapshot) -> Table:
    return figures("throughput", snap, [("samples / s", snap.samples_per_second, rate),
                                        ("generated tokens / s", snap.gen_tokens_per_second, rate),
                                        ("trained tokens / s", snap.train_tokens_per_second, rate),
                                        ("reward", snap.reward, num)])


def busy(snap: Snapshot) -> Table:
    rows = [("trainer", snap.trainer_busy, pct), ("generator", snap.generator_busy, pct)]
    rows += [(f"reward: {node}", f, pct) for node, f in sorted(snap.reward_busy.items())]
    return figures("busy", snap, rows)


ENV_ROWS = {"turns": ("turns", num), "tool_calls": ("tool calls", num), "tool_errors": ("tool errors", num),
            "tool_seconds": ("tool seconds", num), "observation_tokens": ("observation tokens (share)", pct),
            "errors": ("environment errors (trajectories)", num), "error_share": ("environment errors (share)", pct)}
"""How the environment's figures read, in this order; the others (an environment's own, repair
rates, why trajectories ended) follow under their names."""


def environment(snap: Snapshot) -> Table | None:
    """A multi-turn run's figures per trajectory: turns, tool calls, errors and seconds, the share of
    observation tokens, the repair rates and why trajectories ended (None for a single-turn run)."""
    if not snap.env:
        return None
    rows = []
    for k in [*(k for k in ENV_ROWS if k in snap.env), *(k for k in snap.env if k not in ENV_ROWS)]:
        name, fmt = ENV_ROWS.get(k) or (k.replace("_", " "), pct if k.startswith(("end_", "repair_")) else num)
        rows.append((name, snap.env[k], fmt))
    return figures("environment (per trajectory)", snap, rows)


def staleness(snap: Snapshot) -> Table:
    s = snap.staleness
    t = table("staleness (versions behind)", "", "")
    t.show_header = False
    t.add_row("mean (last step)", num(s.mean))
    if s.window_mean is not None and snap.window > 1:
        t.add_row(f"mean (last {snap.window} steps)", num(s.window_mean))
    t.add_row("max (last step)", value(s.max) if s.max is not None else "-")
    t.add_row("max (whole run)", value(s.run_max) if s.run_max is not None else "-")
    t.add_row("tokens by staleness (last step)", hist(s.hist))
    t.add_row("tokens by staleness (whole run)", hist(s.run_hist))
    if s.seq_hist is not None:
        t.add_row("sequences by staleness (last step)",
                  hist(s.seq_hist) if isinstance(s.seq_hist, list) and all(isinstance(c, int) for c in s.seq_hist)
                  else value(s.seq_hist))
    return t


def describe(e: Evaluation) -> str:
    where = [f"version {e.version}" if e.version is not None else None,
             f"step {e.step}" if e.step is not None and e.step != e.version else None,
             f"at {e.when}" if e.when and not e.when.startswith(("step", "version")) else None]
    text = f"{pct(e.accuracy)}"
    if e.n:
        text += f" of {e.n:,}"
    if any(where):
        text += " (" + ", ".join(w for w in where if w) + ")"
    if e.time:
        text += f", {datetime.datetime.fromtimestamp(e.time):%H:%M:%S}"
    return text


def evaluation(snap: Snapshot) -> Table:
    t = table("held-out evaluation", "", "")
    t.show_header = False
    if snap.last_eval is None:
        t.add_row("last", "none yet")
        return t
    if snap.first_eval is not None and snap.first_eval is not snap.last_eval:
        t.add_row("first", describe(snap.first_eval))
    t.add_row("last", describe(snap.last_eval))
    return t


def extras(snap: Snapshot) -> Table | None:
    """The optional figures of the last step: `by_length/<figure>/<bucket>` as a figure x bucket
    grid, the others one a row."""
    grid: dict[str, dict[str, object]] = {}
    single = {}
    for key, v in snap.extras.items():
        parts = key.split("/")
        if parts[0] == "by_length" and len(parts) >= 3:
            grid.setdefault("/".join(parts[1:-1]), {})[parts[-1]] = v
        elif key.startswith((STALE_PREFIX, MISMATCH_PREFIX)):
            continue  # by_staleness's table
        else:
            single[key] = v
    if not grid and not single:
        return None
    buckets = list(dict.fromkeys(b for row in grid.values() for b in row))
    t = table("more (last step)", "", *(buckets or [""]))
    t.show_header = bool(grid)
    for name, row in grid.items():
        t.add_row(f"by length: {name}", *(value(row.get(b)) for b in buckets))
    for key, v in single.items():
        t.add_row(key, value(v), *([""] * (len(buckets) - 1)))
    return t


STALE_PREFIX = "train/stale/"
STALE_FIGURES = ("tokens", "weight_mean", "weight_max", "capped_fraction", "grad_share")
MISMATCH_PREFIX = "train/mismatch/"
MISMATCH_FIGURES = {"abs_mean": "|Δ log p| mean", "abs_p99": "|Δ log p| p99 ≤", "abs_max": "|Δ log p| max",
                    "k3": "KL (k3)", "past_fraction": "past the correction"}


def by_staleness(snap: Snapshot) -> Table | None:
    """The last step's behaviour weights π_prox/π_behav by versions behind π_prox (the columns):
    tokens, mean and largest weight, the share capped (masked or clamped) and of the gradient; the
    stalest tokens' share of a minibatch's gradient (the largest, the last minibatch's); and the
    mismatch log π_start − log π_behav by the same columns, with every token's in a column "all"."""
    grid: dict[str, dict[str, object]] = {}
    single = {}
    for key, v in snap.extras.items():
        if key.startswith(MISMATCH_PREFIX):
            *bucket, figure = key[len(MISMATCH_PREFIX):].split("/")
            if figure in MISMATCH_FIGURES:
                grid.setdefault(MISMATCH_FIGURES[figure], {})[bucket[0] if bucket else "all"] = v
            continue
        if not key.startswith(STALE_PREFIX):
            continue
        bucket, _, figure = key[len(STALE_PREFIX):].partition("/")
        if figure:
            grid.setdefault(figure.replace("_", " "), {})[bucket] = v
        else:
            single[bucket] = v
    if not grid:
        return None
    buckets = list(dict.fromkeys(b for row in grid.values() for b in row if b != "all"))
    buckets += ["all"] if any("all" in row for row in grid.values()) else []
    t = table("by versions behind (last step)", "", *buckets)
    for figure in (f.replace("_", " ") for f in STALE_FIGURES):
        if figure in grid:
            t.add_row(figure, *(value(grid[figure].get(b)) for b in buckets))
    for figure in (f for f in MISMATCH_FIGURES.values() if f in grid):
        t.add_row(figure, *(value(grid[figure].get(b)) for b in buckets))
    for key, v in single.items():
        t.add_row(key.replace("_", " "), value(v), *([""] * (len(buckets) - 1)))
    return t


def clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "?"


def process_state(p: ProcessStatus) -> Text:
    again = f", restarted {p.restarts}×" if p.restarts else ""
    if p.state == "exited":
        return Text(f"exited ({p.exit_code}){again}", style="green" if p.exit_code == 0 else "red")
    if p.state == "removed":  # a scale took it out (python -m areal_flow.scale)
        return Text(f"removed: joined {clock(p.started)}, left {clock(p.ended)}", style="dim")
    if p.alive is True:
        return Text(f"running (pid alive){again}", style="green")
    if p.alive is False:
        return Text(f"gone (pid not alive){again}", style="red")
    return Text(f"{p.state or '-'}{again}")


def processes(snap: Snapshot) -> Table:
    t = table("processes", "name", "role", "host", "pid", "state", "log written", "/health", "serves version",
              left=(0, 1, 2, 4, 6))
    for p in snap.processes:
        health = p.health or ("-" if p.url is None else "not asked")
        t.add_row(p.name, p.role or "-", p.host or "-", str(p.pid) if p.pid is not None else "-", process_state(p),
                  age(p.log_age),
                  Text(health, style="green" if health == "ok" else ("red" if p.health else "dim")),
                  p.weight_version or "-")
    if not snap.processes:
        t.add_row("(none known yet)", "", "", "", "", "", "", "")
    return t


def side_by_side(*items: RenderableType | None) -> Table:
    grid = Table.grid(padding=(0, 3))
    items = [i for i in items if i is not None]
    for _ in items:
        grid.add_column(vertical="top")
    grid.add_row(*items)
    return grid


def render(snap: Snapshot) -> RenderableType:
    return Group(header(snap), Text(""),
                 side_by_side(progress(snap), evaluation(snap)), Text(""),
                 side_by_side(throughput(snap), busy(snap)), Text(""),
                 side_by_side(staleness(snap), extras(snap)), Text(""),
                 *((t, Text("")) if (t := environment(snap)) is not None else ()),
                 *((t, Text("")) if (t := by_staleness(snap)) is not None else ()),
                 processes(snap))
