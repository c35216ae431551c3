"""One OS process per role on this machine, watched until the controller finishes.

Each child writes stdout and stderr to `logs/<name>.log`, is pinned to the cores of its mesh (CPU)
or sees only its GPUs (CUDA), and gets SIGKILL from the kernel if the launcher itself dies, so no
run leaves orphans. A child started with a way to start it again (a generation server, a rollout or
reward worker, an inference process: `recover.worker_restarts`) is restarted when it dies and the run goes on. When any
other child exits before the controller has finished, every other child is stopped and
`ChildFailed` carries the dead process's name, exit code and traceback. Each start, exit and
restart is recorded in the run directory's `processes.json` (status/processes.py), which
`python -m areal_flow.status` reads.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable

from areal_flow.graph.placement import Proc
from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.child import ONE_LINE_ERROR
from areal_flow.runtime.ports import free_ports
from areal_flow.status.processes import ProcessTable

_PR_SET_PDEATHSIG = 1


def how_it_ended(returncode: int) -> str:
    return f"was killed by signal {-returncode}" if returncode < 0 else f"exited with code {returncode}"


class ChildFailed(RuntimeError):
    """A process of the run died. The message's first line is the whole reason: the process, how it
    ended and, from its traceback, the exception that ended it; the traceback follows."""

    def __init__(self, name: str, returncode: int, traceback: str, log_path: str):
        self.name, self.returncode, self.traceback, self.log_path = name, returncode, traceback, log_path
        said = "\n" not in traceback and traceback.startswith(ONE_LINE_ERROR)  # the process's own one line
        self.error = traceback[len(ONE_LINE_ERROR):] if said else exception_line(traceback)
        rest = "" if said else f"\n{traceback}"  # a traceback follows the reason; a one-line error is all of it
        super().__init__(f"process '{name}' {how_it_ended(returncode)}{': ' + self.error if self.error else ''}; "
                         f"its log is {log_path}{rest}")

    @property
    def reason(self) -> str:
        return str(self).split("\n", 1)[0]


def exception_line(traceback: str) -> str:
    """The exception a Python traceback ends with, as `Type: message` without the type's module
    (`StalledRun: no train step ...`), or the first line of a native crash's dump; a text of one
    line as it is (a Ray actor's end, an empty log); "" for the last lines of a log."""
    lines = traceback.splitlines()
    if len(lines) == 1 and not lines[0].startswith(TRACE_STARTS):
        return lines[0]
    if not lines or not lines[0].startswith(TRACE_STARTS):
        return ""
    if lines[0].startswith("Fatal Python error:"):
        return lines[0]
    # After the frames (indented) comes the exception's line, unindented.
    line = next((line for line in lines[1:] if line and not line[0].isspace()), "")
    return re.sub(r"^[\w.]+\.(\w+)(?=:|$)", r"\1", line)


Restart = Callable[[], tuple[list[str], dict[str, str]]]
"""How to start a process again: its argv and environment then (a generation server's weights are
the last ones loaded, not those it first started with)."""


@dataclass
class Child:
    proc: Proc
    popen: subprocess.Popen
    log_path: str
    again: Restart | None = None  # None: its death ends the run
    restarts_left: int = 0


def child_preexec(cores: tuple[int, ...] | None) -> None:
    """Runs in the forked child before exec: die with the launcher, stay on our cores."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if cores:
        os.sched_setaffinity(0, cores)


TRACE_STARTS = ("Traceback (most recent call last)", "Fatal Python error:")
"""How a Python traceback and faulthandler's dump of a native crash (every thread's stack) begin."""


def last_traceback(log_path: str, max_lines: int = 60) -> str:
    """The last Python traceback or native-crash dump in a log, or its last lines when there is none."""
    try:
        with open(log_path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return "(no log)"
    if lines and lines[-1].startswith(ONE_LINE_ERROR):
        return lines[-1]  # the process said what stopped it in one line (runtime/child.py)
    starts = [i for i, line in enumerate(lines) if line.startswith(TRACE_STARTS)]
    chunk = lines[starts[-1]:] if starts else lines[-20:]
    return "\n".join(chunk[-max_lines:]) or "(empty log)"


class Watching:
    """What every launcher does once the processes run: wait for `finished` (the controller) to exit
    0, and fail the run naming the first other process that exits. A launcher gives `exited()`
    (name -> exit code of the processes that have exited) and `log_path(name)`."""

    def exited(self) -> dict[str, int]:
        raise NotImplementedError

    def log_path(self, name: str) -> str:
        raise NotImplementedError

    scales = False
    """Whether it can start and retire processes while the run goes on (launchers/elastic.py)."""
    provisional: set[str] = frozenset()
    """Processes whose exit is not the run's failure: servers a scale is starting (launchers/elastic.py)."""

    on_restart: Callable[[str, int], None] = staticmethod(lambda name, code: None)
    """Called with a process's name and exit code when it was restarted (the launcher prints it)."""

    def restart(self, name: str) -> bool:
        """Start `name` again if it may be; whether it was."""
        return False

    def check(self, finished: str) -> bool:
        """True once `finished` exited 0; restarts a process that may be; raises ChildFailed if any
        other process has exited."""
        exited = {name: code for name, code in self.exited().items() if name not in self.provisional}
        if exited.get(finished) == 0:
            return True
        for name, code in list(exited.items()):
            if name != finished and self.restart(name):
                self.on_restart(name, code)
                del exited[name]
        if exited:
            # When several died since the last look, blame one that is not the `finished` process
            # (the controller): its failure is usually the consequence of another's death.
            name = next((n for n in exited if n != finished), finished)
            raise ChildFailed(name, exited[name], last_traceback(self.log_path(name)), self.log_path(name))
        return False

    def wait(self, finished: str, on_tick: Callable[[], None] = lambda: None, interval: float = 0.25,
             timeout: float | None = None) -> None:
        """Until `finished` exits 0; TimeoutError after `timeout` seconds, when given."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.check(finished):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"'{finished}' did not finish within {timeout:.0f} s")
            on_tick()
            time.sleep(interval)
        on_tick()

    def signal(self, name: str, sig: int) -> None:
        """Send `sig` to process `name` (the controller's SIGUSR1: checkpoint, then stop)."""
        raise NotImplementedError

    def running_procs(self) -> list[Proc]:
        """The processes the launcher runs now (a scale places new ones on the devices they leave free)."""
        raise NotImplementedError

    def place(self, proc: Proc) -> None:
        """Make room for `proc`, which a scale is about to start, before it starts (on this host the
        devices are the placement's: nothing to do; Ray reserves its resources); RuntimeError naming
        what is missing."""

    def retire(self, name: str) -> None:
        """Stop process `name` for good (a scale removed it): its exit is no failure, nor restarted."""
        raise NotImplementedError


class LocalLauncher(Watching):
    scales = True

    def __init__(self, run_dir: str, *, device_type: str = "cpu", pin_cpus: bool = True, stop_timeout: float = 10.0):
        self.run_dir, self.device_type, self.pin_cpus, self.stop_timeout = run_dir, device_type, pin_cpus, stop_timeout
        self.children: dict[str, Child] = {}
        self.provisional = set()
        os.makedirs(os.path.join(run_dir, rd.LOGS), exist_ok=True)
        self.processes = ProcessTable(run_dir)  # processes.json, for `python -m areal_flow.status`

    def reserve(self, names: list[str], wildcard: bool = False) -> list[tuple[str, int]]:
        """(address, free port) for each named process, in order, all on this host: free on loopback,
        or on every address with `wildcard`."""
        return [("127.0.0.1", port) for port in free_ports(len(names), "0.0.0.0" if wildcard else "127.0.0.1")]

    def start(self, proc: Proc, argv: list[str], env: dict[str, str] | None = None, *, again: Restart | None = None,
              restarts: int = 0) -> None:
        """Start `argv` as `proc`, with `env` on top of this process's environment; `again` starts it
        again when it dies, at most `restarts` times."""
        # AREAL_FLOW_RUN marks every process of this run, so tools (and tests) can find them all.
        env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", "AREAL_FLOW_PROC": proc.name,
               "AREAL_FLOW_RUN": self.run_dir}
        cores = None
        if self.device_type == "cpu":
            # Light roles (controller, rollout, reward) float; model processes own their cores.
            env["OMP_NUM_THREADS"] = str(max(1, len(proc.devices)))
            cores = proc.devices if self.pin_cpus and proc.devices else None
        elif proc.devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, proc.local_devices or proc.devices))
        log_path = os.path.join(self.run_dir, rd.log_of(proc.name))
        with open(log_path, "ab") as log:
            # A session of its own: Ctrl-C in the terminal reaches the launcher only, which stops
            # the run in order (a checkpoint first), not every process at once.
            popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, preexec_fn=lambda: child_preexec(cores), start_new_session=True)
        self.children[proc.name] = Child(proc, popen, log_path, again, restarts)
        self.processes.started(proc.name, proc.role, popen.pid)

    def restart(self, name: str) -> bool:
        child = self.children[name]
        if child.again is None or child.restarts_left <= 0:
            return False
        argv, env = child.again()
        self.start(child.proc, argv, env, again=child.again, restarts=child.restarts_left - 1)
        return True

    def exited(self) -> dict[str, int]:
        codes = {name: c.popen.poll() for name, c in self.children.items()}
        exited = {name: code for name, code in codes.items() if code is not None}
        self.processes.exited(exited)
        return exited

    def log_path(self, name: str) -> str:
        return self.children[name].log_path

    def signal(self, name: str, sig: int) -> None:
        if self.children[name].popen.poll() is None:
            self.children[name].popen.send_signal(sig)

    def running_procs(self) -> list[Proc]:
        return [c.proc for c in self.children.values()]  # one that died holds its devices until restarted

    def retire(self, name: str) -> None:
        self.provisional.discard(name)
        if (child := self.children.pop(name, None)) is None:
            return  # placed, never started
        _stop([child.popen], self.stop_timeout)
        self.processes.left(name, child.popen.returncode)

    def stop_all(self) -> None:
        """SIGTERM everyone still alive, then SIGKILL whoever ignores it for stop_timeout seconds."""
        _stop([c.popen for c in self.children.values()], self.stop_timeout)
        self.processes.exited({name: c.popen.returncode for name, c in self.children.items()
                               if c.popen.returncode is not None})


def _stop(popens: list[subprocess.Popen], timeout: float) -> None:
    """SIGTERM each that is alive, then SIGKILL whoever ignores it for `timeout` seconds."""
    alive = [p for p in popens if p.poll() is None]
    for p in alive:
        p.send_signal(signal.SIGTERM)
    deadline = time.time() + timeout
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
