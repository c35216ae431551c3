"""Resumable checkpoints on disk: `RUN_DIR/checkpoints/step-NNNNNNNN/`, each complete or absent.

Several processes write one checkpoint: each trainer rank its models and the scored groups it holds,
the controller the run's state. They write into a hidden temporary directory beside the others
(`begin`); the controller then writes the manifest, which lists every file with its size, and
renames the directory to its name (`commit`). A crash mid-write leaves only the temporary
directory, which nothing reads and the next `begin` removes: the previous checkpoints stay valid.
A checkpoint whose manifest is missing, unreadable or disagrees with its files (a truncated copy, a
disk that filled up) is skipped with a warning by `latest`, which then takes the one before.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

from areal_flow.runtime import run_dir as rd

log = logging.getLogger("areal_flow.checkpoint")

CHECKPOINTS, MANIFEST = rd.CHECKPOINTS, rd.MANIFEST

FORMAT = 1
"""The layout of a checkpoint directory; a checkpoint of another format is refused by name."""

_PREFIX, _TMP = "step-", ".tmp-"


def name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def folder(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS)


def begin(run_dir: str, step: int) -> str:
    """A fresh temporary directory for the checkpoint after `step` steps; leftovers of writes that
    never completed are removed first."""
    root = folder(run_dir)
    os.makedirs(root, exist_ok=True)
    for entry in os.listdir(root):
        if entry.startswith(_TMP):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    tmp = os.path.join(root, f"{_TMP}{name(step)}")
    os.makedirs(tmp)
    return tmp


def _files(path: str) -> dict[str, int]:
    """Every file under `path` (relative name -> size in bytes), the manifest aside."""
    sizes = {}
    for parent, _, files in os.walk(path):
        for f in files:
            full = os.path.join(parent, f)
            rel = os.path.relpath(full, path)
            if rel != MANIFEST:
                sizes[rel] = os.path.getsize(full)
    return sizes


def _fsync_tree(path: str) -> None:
    """Every file and directory under `path` on disk: a rename is durable only after its contents."""
    for parent, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(parent, f), "rb") as fh:
                os.fsync(fh.fileno())
        fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def commit(tmp: str, step: int, **meta) -> str:
    """Write the manifest of the temporary checkpoint `tmp` (its files, `step`, `meta`), and give it
    its name; returns the checkpoint's path. A checkpoint of the same step is replaced."""
    manifest = {"format": FORMAT, "step": step, "time": time.time(), **meta, "files": _files(tmp)}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    _fsync_tree(tmp)
    path = os.path.join(os.path.dirname(tmp), name(step))
    if os.path.exists(path):  # e.g. the end of a run that also saved periodically at its last step
        old = f"{tmp}.old"
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)
    return path


def problem(path: str) -> str | None:
    """Why `path` is not a complete checkpoint, or None when it is."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return f"{path} has no {MANIFEST} (its write never completed)"
    except (OSError, ValueError) as e:
        return f"{os.path.join(path, MANIFEST)} is unreadable: {e}"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"{os.path.join(path, MANIFEST)}: format {manifest.get('format') if isinstance(manifest, dict) else '?'}, " \
               f"this version reads format {FORMAT}"
    found = _files(path)
    for rel, size in manifest.get("files", {}).items():
        if rel not in found:
            return f"{os.path.join(path, rel)} is missing"
        if found[rel] != size:
            return f"{os.path.join(path, rel)} has {found[rel]} bytes, the manifest says {size} (truncated?)"
    return None


def read_manifest(path: str) -> dict:
    with open(os.path.join(path, MANIFEST)) as f:
        return json.load(f)


def listed(run_dir: str) -> list[str]:
    """The run's named checkpoints, oldest first (complete or not)."""
    root = folder(run_dir)
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, e) for e in sorted(os.listdir(root)) if e.startswith(_PREFIX)]


def latest(run_dir: str) -> str | None:
    """The newest complete checkpoint of the run; newer ones that are not complete are skipped with
    a warning naming what is wrong with them."""
    for path in reversed(listed(run_dir)):
        if (why := problem(path)) is None:
            return path
        log.warning("checkpoint skipped: %s", why)
    return None


def prune(run_dir: str, keep_last: int) -> list[str]:
    """Remove all but the newest `keep_last` complete checkpoints (and any incomplete one older than
    those); returns the removed paths."""
    paths = listed(run_dir)
    complete = [p for p in paths if problem(p) is None]
    keep = set(complete[-keep_last:])
    oldest_kept = min(keep) if keep else None
    removed = [p for p in paths if p not in keep and (oldest_kept is None or p < oldest_kept)]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def rewind(run_dir: str, checkpoint: str | None) -> None:
    """Cut the run's logs back to what they held when `checkpoint` was saved (None: the run's start),
    before a resumed run's processes start: the ledger and the metrics (lengths in the controller's
    run state) and each trainer rank's trained-samples log (in the rank's own file), and the flight
    record to the checkpoint's step. What a resumed run redoes is then logged once; the cut lines and
    records are kept aside."""
    lengths = {name: 0 for name in os.listdir(run_dir)
               if name in (rd.LEDGER, rd.METRICS) or (name.startswith("trained-rank") and
                                                                 name.endswith(".jsonl") and "discarded" not in name)}
    if checkpoint is not None:
        with open(os.path.join(checkpoint, rd.RUN_STATE)) as f:
            state = json.load(f)
        lengths[rd.LEDGER], lengths[rd.METRICS] = state["ledger_bytes"], state["metrics_bytes"]
        for entry in os.listdir(checkpoint):
            if entry.startswith("trainer-rank") and entry.endswith(".json"):
                with open(os.path.join(checkpoint, entry)) as f:
                    lengths[entry.replace("trainer-", "trained-").replace(".json", ".jsonl")] = \
                        json.load(f)["trained_log_bytes"]
    for name, length in lengths.items():
        truncate_log(os.path.join(run_dir, name), length)
    discard_flight(run_dir, 0 if checkpoint is None else read_manifest(checkpoint)["step"])


def discard_flight(run_dir: str, steps_done: int) -> list[str]:
    """Move the flight records (training/flight.py) of steps `steps_done` and later, which a resume
    redoes, to flight/discarded/ (an older copy there replaced); returns the names moved."""
    moved = []
    folder = os.path.join(run_dir, rd.FLIGHT)
    for entry in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        match = rd.FLIGHT_STEP_NAME.match(entry)
        if match and int(match.group(1)) > steps_done:  # named from 1: step-00000001 is the first step
            os.makedirs(os.path.join(run_dir, rd.FLIGHT_DISCARDED), exist_ok=True)
            os.replace(os.path.join(folder, entry), os.path.join(run_dir, rd.FLIGHT_DISCARDED, entry))
            moved.append(entry)
    return moved


def truncate_log(path: str, length: int) -> int:
    """Cut the log at `path` back to `length` bytes (what it held when a checkpoint was saved); the
    cut lines go to `<name>.discarded.jsonl`, which keeps the record of the work a resume redid.
    Returns the bytes moved."""
    if not os.path.exists(path):
        return 0
    with open(path, "rb+") as f:
        f.seek(length)
        tail = f.read()
        if tail:
            with open(path.removesuffix(".jsonl") + ".discarded.jsonl", "ab") as aside:
                aside.write(tail)
        f.truncate(length)
    return len(tail)
