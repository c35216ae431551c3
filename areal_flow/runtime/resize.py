"""A trainer resize's hand-offs between the launcher and the controller
(`python -m areal_flow.scale RUN_DIR trainers=N`, docs/reliability.md "Elastic").

Three small files under `scale/`, each written whole (a temporary file, then a rename):

1. `trainers.json` {id, n}: the launcher asks for n trainer ranks. The controller looks for it
   between steps.
2. `trainers-saved.json` {id, checkpoint, step, n_before}: the controller has saved the run's
   checkpoint at the end of its step (every rank's models and the scored groups each holds), holds
   the scored groups that arrive meanwhile, and waits for n new ranks. The launcher stops the old
   ranks, rewrites spec.json (n ranks, their ports, `resume` = that checkpoint) and starts the new
   ones, which load it (the torch engine's checkpoint reshards onto any data-parallel size).
3. `trainers-done.json` {id, n, seconds}: every new rank said Hello; the reward workers send to the
   new ranks from here; the run trains on.
"""

from __future__ import annotations

import contextlib
import json
import os

from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.disk import write_atomic

ASK, SAVED, DONE = rd.TRAINERS_ASK, rd.TRAINERS_SAVED, rd.TRAINERS_DONE


def write_json(path: str, value: object) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    write_atomic(path, json.dumps(value).encode())


def read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def ask(run_dir: str, rid: str, n: int) -> None:
    write_json(os.path.join(run_dir, ASK), {"id": rid, "n": n})


def asked(run_dir: str) -> dict | None:
    """The resize the launcher asks for, if any: {id, n}."""
    return read_json(os.path.join(run_dir, ASK))


def answer(run_dir: str, which: str, rid: str, **fields: object) -> None:
    """The controller's answer `which` (SAVED or DONE) to request `rid`."""
    write_json(os.path.join(run_dir, which), {"id": rid, **fields})


def answered(run_dir: str, which: str, rid: str) -> dict | None:
    """The controller's answer `which` to request `rid`, once written."""
    out = read_json(os.path.join(run_dir, which))
    return out if out is not None and out.get("id") == rid else None


def clear(run_dir: str) -> None:
    """No resize asked or in progress (a launch's start, a resize's end)."""
    for name in (ASK, SAVED, DONE):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(run_dir, name))
