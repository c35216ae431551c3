"""Stopping a watched run: Ctrl-C or a scheduler's SIGTERM, after a checkpoint at the end of the
current step when checkpoint.at_stop (docs/reliability.md)."""

from __future__ import annotations

import signal

from rich.console import Console
from rich.markup import escape

from areal_flow.config.schema import RunConfig
from areal_flow.launchers.local import ChildFailed


def interrupt(*_) -> None:
    """A SIGTERM handler: the launcher stops as on Ctrl-C."""
    raise KeyboardInterrupt


def stop_with_checkpoint(launcher, cfg: RunConfig, console: Console) -> None:
    """The launcher was stopped: with checkpoint.at_stop, the controller saves a checkpoint at the
    end of its current step and exits (SIGUSR1), within checkpoint.stop_timeout; a second Ctrl-C
    stops at once. Every process is stopped after."""
    if not cfg.checkpoint.at_stop or not hasattr(launcher, "signal"):
        console.print("[bold red]interrupted[/]: stopping every process")
        return
    console.print("[bold red]interrupted[/]: the run saves a checkpoint after the current step, then stops "
                  f"(up to {cfg.checkpoint.stop_timeout:.0f} s; Ctrl-C again stops at once)")
    try:
        launcher.signal("controller", signal.SIGUSR1)
        launcher.wait("controller", timeout=cfg.checkpoint.stop_timeout)
        console.print(f"stopped; continue with resume=auto hydra.run.dir={launcher.run_dir}", highlight=False,
                      markup=False)
    except (KeyboardInterrupt, ChildFailed, TimeoutError, NotImplementedError) as e:
        console.print(f"stopped without a checkpoint: {escape(str(e)) or 'interrupted again'}", highlight=False)
