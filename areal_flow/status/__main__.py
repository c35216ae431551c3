"""`python -m areal_flow.status RUN_DIR [--once] [--interval SECONDS]`: a live view of a running
run read from its run directory, until Ctrl-C; a finished run, `--once`, or an output that is not
a terminal gets one view and exits 0."""

from __future__ import annotations

import argparse
import sys
import time

from rich.console import Console
from rich.live import Live

from areal_flow.status.render import render
from areal_flow.status.model import NotARunDirectory
from areal_flow.status.snapshot import WINDOW, RunReader

FINAL = ("finished", "stopped")
"""The states of a run whose summary is written: nothing more happens to it."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m areal_flow.status", description="A live view of a run, running or finished, read from "
                                "its run directory (Ctrl-C leaves it).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (hydra.run.dir)")
    p.add_argument("--once", action="store_true", help="print one view and exit (as for a finished run, or an "
                   "output that is not a terminal)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.add_argument("--window", type=int, default=WINDOW, help=f"steps the rates average over (default {WINDOW})")
    p.add_argument("--no-probe", action="store_true", help="read the files only: ask no process (pids, /health)")
    p.add_argument("--width", type=int, default=None, help="columns of the view (default: the terminal's, "
                   "at least 120 when not a terminal)")
    args = p.parse_args(argv)
    if args.interval <= 0 or args.window < 1:
        p.error("--interval must be > 0 and --window ≥ 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    console = Console(width=args.width)
    if args.width is None and not console.is_terminal:
        console = Console(width=max(120, console.width))
    try:
        reader = RunReader(args.run_dir, window=args.window, probe=not args.no_probe)
        snap = reader.snapshot()
        # One view and an exit: asked for, a run that has finished (its view no longer changes), or
        # an output that is not a terminal (a pipe, a script, CI), where a live view shows nothing
        # until it stops, which it never does.
        if args.once or snap.state in FINAL or not console.is_terminal:
            console.print(render(snap))
            return 0
        with Live(render(snap), console=console, auto_refresh=False) as live:
            while snap.state not in FINAL:  # a run that finishes meanwhile: its last view stays
                time.sleep(args.interval)
                snap = reader.snapshot()
                live.update(render(snap), refresh=True)
        return 0
    except NotARunDirectory as e:
        print(f"areal_flow.status: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
