"""Stopping a watched run: Ctrl-C or a scheduler's SIGTERM, after a checkpoint at the end of the
current step when checkpoint.at_stop (docs/reliability.md)."""

from __future__ import annotations

import json
import os
import signal

from rich.console import Console
from rich.markup import escape

from areal_flow.config.schema import RunConfig
from areal_flow.launchers.local import ChildFailed
from areal_flow.runtime import run_dir as rd


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's preemption): the launcher stops as on Ctrl-C, and says which it was."""


def interrupt(*_) -> None:
    """A SIGTERM handler."""
    raise Terminated


def stopped_because(run_dir: str) -> str:
    """The sentence of summary.json's stop_reason, or "" where the run wrote none."""
    try:
        with open(os.path.join(run_dir, rd.SUMMARY)) as f:
            return json.load(f)["stop_reason"]["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def stop_with_checkpoint(launcher, cfg: RunConfig, console: Console, signal_name: str = "Ctrl-C") -> None:
    """The launcher was stopped (`signal_name`: Ctrl-C or SIGTERM): with checkpoint.at_stop, the
    controller saves a checkpoint at the end of its current step and exits (SIGUSR1), within
    checkpoint.stop_timeout; a second Ctrl-C stops at once. Every process is stopped after."""
    if not cfg.checkpoint.at_stop or not hasattr(launcher, "signal"):
        console.print(f"[bold red]interrupted[/] ({signal_name}): stopping every process")
        return
    console.print(f"[bold red]interrupted[/] ({signal_name}): the run saves a checkpoint after the current step, "
                  f"then stops (up to {cfg.checkpoint.stop_timeout:.0f} s; Ctrl-C again stops at once)")
    try:
        launcher.signal("controller", signal.SIGUSR1)
        launcher.wait("controller", timeout=cfg.checkpoint.stop_timeout)
        why = stopped_because(launcher.run_dir)
        console.print(f"stopped{': ' + why if why else ''}; continue with resume=auto hydra.run.dir={launcher.run_dir}",
                      highlight=False, markup=False)
    except (KeyboardInterrupt, ChildFailed, TimeoutError, NotImplementedError) as e:
        console.print(f"stopped without a checkpoint: {escape(str(e)) or 'interrupted again'}", highlight=False)
