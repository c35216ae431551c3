"""The entrypoint of every Python role: `python -m areal_flow.runtime.child ROLE NAME RANK RUN_DIR`.

The launcher has already pinned the process to its cores and pointed stdout/stderr at
`RUN_DIR/logs/NAME.log`; an uncaught exception prints its traceback there and exits 1, which
the launcher reports with the process name.
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import logging
import os
import signal
import sys

from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.disk import DiskFull
from areal_flow.runtime.spec import read_run

ROLES = {
    "controller": "areal_flow.controller.main",
    "rollout": "areal_flow.rollout.worker",
    "reward": "areal_flow.rewards.worker",
    "trainer": "areal_flow.training.worker",
    "inference": "areal_flow.training.inference",  # a replica of a node on a mesh of its own
}


ONE_LINE_ERROR = "error: "
"""How a process's last log line begins when it stopped on an error it could say in one line."""

TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun gives each process it starts; all of them present means this process is one of its workers."""


def torchrun_rank() -> int | None:
    """The global rank torchrun gave this process, or None when it was not started by torchrun
    (the local and Ray launchers give the rank on the command line instead)."""
    return int(os.environ["RANK"]) if all(k in os.environ for k in TORCHRUN_ENV) else None


def main(argv: list[str]) -> None:
    # A crash in native code (a segfault, an abort in torch or a collective library) prints every
    # thread's Python stack into the log, where the launcher's report of the dead process finds it.
    faulthandler.enable()
    role, name, rank, run_dir = argv[0], argv[1], int(argv[2]), argv[3]
    if role == "trainer" and (env_rank := torchrun_rank()) is not None:
        # One torchrun starts a node's trainer ranks (launcher.type=slurm) with one command line: the
        # rank, and so the name, is the one torchrun assigned. Its ranks share the step's output, so
        # each writes its own log, as every process does under the other launchers.
        rank, name = env_rank, f"trainer{env_rank}"
        os.environ["AREAL_FLOW_PROC"] = name
        log_fd = os.open(os.path.join(run_dir, rd.log_of(name)), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(log_fd, 1), os.dup2(log_fd, 2)
        os.close(log_fd)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # SIGTERM from the launcher means "stop now": exit without a traceback.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # SIGUSR1 asks the controller for a checkpoint and a clean stop (controller/main.py): until its
    # loop handles it, and in every other process, it must not kill.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # A weight save every step would print a progress bar into the log. Said by the environment,
    # which transformers reads when it is imported: importing it here cost every process, the light
    # ones too (controller, rollout, reward), most of a second of start-up.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    cfg, spec = read_run(run_dir)
    try:
        importlib.import_module(ROLES[role]).main(cfg, spec, name, rank)
    except DiskFull as e:
        # One line, the log's last, which the launcher reports as it is (launchers/local.py: last_traceback).
        print(f"{ONE_LINE_ERROR}{e}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        # The interpreter's last garbage collection walks every object torch made: 1-2 s of every
        # stop on 2 cores (py-spy: gc_collect_main). Frozen objects are not walked; exit handlers
        # and the unwinding above (finally blocks, sandboxes closed) still run.
        gc.freeze()


if __name__ == "__main__":
    main(sys.argv[1:])
