"""The entrypoint of every Python role: `python -m areal_flow.runtime.child ROLE NAME RANK RUN_DIR`.

The launcher has already pinned the process to its cores and pointed stdout/stderr at
`RUN_DIR/logs/NAME.log`; an uncaught exception prints its traceback there and exits 1, which
the launcher reports with the process name.
"""

from __future__ import annotations

import importlib
import logging
import signal
import sys

from areal_flow.runtime.spec import read_run

ROLES = {
    "controller": "areal_flow.controller.main",
    "rollout": "areal_flow.rollout.worker",
    "reward": "areal_flow.rewards.worker",
    "trainer": "areal_flow.training.worker",
}


def main(argv: list[str]) -> None:
    role, name, rank, run_dir = argv[0], argv[1], int(argv[2]), argv[3]
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # SIGTERM from the launcher means "stop now": exit without a traceback.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a weight save every step would print a bar into the log
    cfg, spec = read_run(run_dir)
    importlib.import_module(ROLES[role]).main(cfg, spec, name, rank)


if __name__ == "__main__":
    main(sys.argv[1:])
