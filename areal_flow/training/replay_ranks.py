"""A replay of a run of several trainer ranks: one process a rank, as in the run. The process the
user started (`python -m areal_flow.replay`) is rank 0; `OtherRanks` starts ranks 1..N-1 as
`python -m areal_flow.replay RUN_DIR ... --rank r --port P` beside it, all joining one gloo group
whose store rank 0 keeps at P on this host, and watches them: a rank that stops with an error stops
the replay with its message (rank 0 would otherwise wait in a collective forever), and none is left
running when rank 0 is done.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable

from rich.console import Console

from areal_flow.runtime.child import TORCHRUN_ENV
from areal_flow.runtime.ports import free_ports
from areal_flow.runtime.spec import read_spec
from areal_flow.training import flight
from areal_flow.training.replay import ReplayError


class RanksError(ReplayError):
    """The record's ranks do not match the run's, or another rank failed (names the step or rank)."""


def check_ranks(run_dir: str, steps: Iterable[int], n_ranks: int) -> None:
    """Every one of `steps` (from 0) recorded by exactly ranks 0..n_ranks-1, the run's trainer ranks
    now (a run whose trainers were resized trained some steps with another number)."""
    ranks = flight.recorded_ranks(run_dir)
    for step in steps:
        got = ranks.get(step, set())
        if got != set(range(n_ranks)):
            raise RanksError(f"{os.path.join(run_dir, flight.FLIGHT)}: step {step + 1} was recorded by rank(s) "
                             f"{', '.join(map(str, sorted(got))) or 'none'}, but the run has {n_ranks} trainer "
                             f"rank(s) (its spec.json): replay a range of steps trained by {n_ranks}")


class OtherRanks:
    """`with OtherRanks(run_dir, argv, console) as port:` ranks 1..N-1 of the run replay `argv`
    beside this process, rank 0, whose process group's store listens at `port` (a fresh port also
    for one rank, which needs a group under megatron)."""

    POLL_S = 0.2
    REASON_S = 2.0  # how long a rank that rank 0's collective saw go away may take to exit
    WAIT_S = 60.0  # for the other ranks to finish once rank 0 has

    def __init__(self, run_dir: str, argv: list[str], console: Console):
        self.n = read_spec(run_dir).n_trainers
        self.argv, self.console = argv, console
        self.procs: dict[int, tuple[subprocess.Popen, object]] = {}
        self.done = threading.Event()

    def __enter__(self) -> int:
        port = free_ports(1)[0]
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
        for rank in range(1, self.n):
            log = tempfile.TemporaryFile(mode="w+")
            cmd = [sys.executable, "-m", "areal_flow.replay", *self.argv, "--rank", str(rank), "--port", str(port)]
            self.procs[rank] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log)
        if self.procs:
            threading.Thread(target=self._watch, daemon=True, name="replay-ranks").start()
        return port

    def __exit__(self, kind, error, tb) -> None:
        self.done.set()
        if kind is not None and not issubclass(kind, ReplayError):
            # Rank 0 failed in a collective: gloo saw another rank go away, whose reason is the news.
            self._wait_any(self.REASON_S)
            failed = self._failed()
            if failed:
                for proc, _ in self.procs.values():
                    proc.kill()
                raise RanksError(self._stopped(failed[0])) from error
        for rank, (proc, _) in self.procs.items():
            if kind is not None:
                proc.kill()
            try:
                proc.wait(timeout=self.WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                if kind is None:
                    raise RanksError(f"rank {rank} of the replay did not end {self.WAIT_S:.0f} s after rank 0") from None
        if kind is None and (failed := self._failed()):
            raise RanksError(self._stopped(failed[0]))

    def _watch(self) -> None:
        """A rank that stops with an error ends the replay now: rank 0 may be waiting for it in a
        collective that would never return."""
        while not self.done.wait(self.POLL_S):
            failed = self._failed()
            if failed and not self.done.wait(self.REASON_S):  # (rank 0's own error may say it first)
                self.console.print(f"[red]cannot replay[/red]: {self._stopped(failed[0])}")
                for proc, _ in self.procs.values():
                    proc.kill()
                os._exit(2)

    def _failed(self) -> list[int]:
        return [r for r, (p, _) in self.procs.items() if p.poll() not in (None, 0)]

    def _wait_any(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._failed() and time.monotonic() < deadline:
            time.sleep(self.POLL_S / 4)

    def _stopped(self, rank: int) -> str:
        return f"rank {rank} of the replay stopped (exit {self.procs[rank][0].returncode}): {self._tail(rank)}"

    def _tail(self, rank: int) -> str:
        """The rank's last line: its error (progress bars end their lines with carriage returns)."""
        log = self.procs[rank][1]
        log.seek(0)
        lines = [line for line in re.split(r"[\r\n]+", log.read()) if line.strip()]
        return lines[-1].strip() if lines else "(nothing printed)"
