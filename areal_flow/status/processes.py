"""`processes.json`: the local launcher's record of the run's processes, for `areal_flow.status`.

{name: {role, pid, host, restarts, state, exit_code, started, ended}}, with state `running`,
`exited`, `restarted` (running again after it died; `restarts` counts how often) or `removed` (a
scale took it out: `python -m areal_flow.scale`; `started` and `ended` are when it joined and left). Rewritten
whole (a temporary file, then a rename) whenever a process starts, exits or is restarted, so a
reader never sees half of it.
"""

from __future__ import annotations

import json
import os
import socket
import time

from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.disk import write_atomic

PROCESSES = rd.PROCESSES


def write_processes(run_dir: str, table: dict[str, dict]) -> None:
    """Replace the run directory's processes.json with `table`, atomically."""
    write_atomic(os.path.join(run_dir, PROCESSES), json.dumps(table, indent=1))


def read_processes(run_dir: str) -> dict[str, dict] | None:
    """The run directory's processes.json, or None when it has none (another launcher, an older run)."""
    try:
        with open(os.path.join(run_dir, PROCESSES)) as f:
            table = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return table if isinstance(table, dict) else None


class ProcessTable:
    """The launcher's side: each change is written at once."""

    def __init__(self, run_dir: str):
        self.run_dir, self.table = run_dir, {}
        self.host = socket.gethostname()

    def started(self, name: str, role: str, pid: int) -> None:
        """`name` runs as `pid`; a name seen before was restarted (unless a scale removed it: a new
        process of that name, as a resized trainer's ranks)."""
        before = self.table.get(name)
        if before is not None and before["state"] == "removed":
            before = None
        restarts = before["restarts"] + 1 if before else 0
        self.table[name] = {"role": role, "pid": pid, "host": self.host, "restarts": restarts,
                            "state": "restarted" if before else "running", "exit_code": None,
                            "started": time.time(), "ended": None}
        self._write()

    def exited(self, codes: dict[str, int]) -> None:
        """Record the exit codes of processes not yet recorded as exited."""
        new = {name: code for name, code in codes.items()
               if name in self.table and self.table[name]["state"] != "exited"}
        if not new:
            return
        now = time.time()
        for name, code in new.items():
            self.table[name].update(state="exited", exit_code=code, ended=now)
        self._write()

    def left(self, name: str, code: int | None) -> None:
        """`name` was removed from the run (a scale): state `removed`, its end now."""
        if name in self.table:
            self.table[name].update(state="removed", exit_code=code, ended=time.time())
            self._write()

    def _write(self) -> None:
        try:
            write_processes(self.run_dir, self.table)
        except OSError:  # a view of the run: never what stops it
            pass
