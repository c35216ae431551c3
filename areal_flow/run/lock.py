"""One launcher per run directory: two launches into one directory would interleave their ledger
and metrics. The launcher holds an flock on RUN_DIR/launcher.lock for its whole life; the kernel
drops it when the process ends, however it ends, so a dead run's directory is taken over. Whether
the holder lives is the lock's answer, never a pid test, which a reused pid would fool: the pid
written in the file only names the holder in the error."""

from __future__ import annotations

import fcntl
import os

from areal_flow.runtime.run_dir import LOCK as LOCK_FILE

_held: dict[str, int] = {}  # the run directories this launcher holds -> the lock file's descriptor


class RunDirBusy(Exception):
    """The run directory is held by a live launcher."""


def hold_run_dir(run_dir: str, what: str) -> None:
    """Lock `run_dir` for this process's life, or raise RunDirBusy naming the holder's pid; `what`
    names the key that chose the directory, e.g. `hydra.run.dir=/runs/a`."""
    path = os.path.realpath(run_dir)
    if path in _held:
        return
    os.makedirs(path, exist_ok=True)
    fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by children
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirBusy(f"{what} is in use by a live run (launcher pid {holder}): wait for it to end or stop it, "
                         "or choose another run directory") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[path] = fd
