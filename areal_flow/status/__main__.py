"""`python -m areal_flow.status RUN_DIR [--once] [--interval SECONDS]`: a live view of a run
(running or finished) read from its run directory; Ctrl-C leaves it."""

from __future__ import annotations

import argparse
import sys
import time

from rich.console import Console
from rich.live import Live

from areal_flow.status.render import render
from areal_flow.status.snapshot import WINDOW, NotARunDirectory, RunReader


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m areal_flow.status", description="A live view of a run, running or finished, read from "
                                "its run directory (Ctrl-C leaves it).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's directory (hydra.run.dir)")
    p.add_argument("--once", action="store_true", help="print one view and exit")
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
        if args.once:
            console.print(render(reader.snapshot()))
            return 0
        with Live(render(reader.snapshot()), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(render(reader.snapshot()), refresh=True)
    except NotARunDirectory as e:
        print(f"areal_flow.status: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
