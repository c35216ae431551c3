"""Weights as files: each version a Hugging Face directory that every server loads
(`/update_weights_from_disk`), on disk in the run directory or in shared memory (/dev/shm: RAM,
one host). Trainer rank 0 writes the directory right after the step, so the servers can load it
while the next step trains."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.disk import write_atomic, writing
from areal_flow.weights.channel import SendByTrainers, UpdateFlags, WeightChannel

if TYPE_CHECKING:
    from areal_flow.generation.client.generation_client import GenerationClient
    from areal_flow.generation.client.router import Server, ServerPool
    from areal_flow.training.engine import Engine


class FileChannel(WeightChannel):
    """Versions as `root/v{N}`; the last two are kept (and every `keep_every`-th, when set).
    `adapters`: a trainer of LoRA adapters writes them alone (the embedded servers merge them);
    false, it writes the merged weights (real SGLang loads whole models from disk)."""

    sent_by_trainers = False
    every_server = False

    def __init__(self, name: str, root: str, keep_every: int = 0, adapters: bool = True) -> None:
        self.name, self.root, self.keep_every = name, root, keep_every  # type: ignore[misc]
        self.adapters = adapters

    def after_step(self, engine: Engine, version: int, rank: int) -> str:
        path = os.path.join(self.root, f"v{version}")
        with writing("the weights", path):
            digest = engine.save_update(path) if self.adapters else engine.save_weights(path)  # rank 0 writes
            if digest is not None and rank == 0:  # LoRA: what each server must report having merged
                write_atomic(os.path.join(path, DIGEST), digest)
        if rank == 0:
            prune(self.root, keep=version, every=self.keep_every)
        return path

    async def deliver(self, pool: ServerPool, servers: list[Server], location: str, version: int,
                      flags: UpdateFlags, trainers: SendByTrainers) -> list[str]:
        expected = sent_digest(location)

        _, refusals = await pool.call_each("load the weights", servers, lambda c: c.update_weights_from_disk(
            location, version, abort_all_requests=flags.abort_all_requests, flush_cache=not flags.keep_cache,
            adapter_digest=expected))
        return refusals

    def reload(self, location: str, version: int) -> Callable[[GenerationClient], Awaitable[Any]]:
        # Requests another pool routed to it meanwhile come back aborted, for resubmission.
        return lambda client: client.update_weights_from_disk(location, version, abort_all_requests=True,
                                                              adapter_digest=sent_digest(location))

    def source(self, location: str) -> str:
        return f"from {location}"


LOADED = rd.WEIGHTS_LOADED
DIGEST = "sent_digest"
"""Beside a LoRA update's adapters: the digest of those the trainer sent (weights/adapter.py)."""


def sent_digest(location: str) -> str | None:
    """The digest of the adapters the trainer wrote at `location` (None: not a LoRA update)."""
    try:
        with open(os.path.join(location, DIGEST)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def record_loaded(run_dir: str, path: str, version: int) -> None:
    """Every server up has loaded `version` from `path`: a server restarted later starts from it."""
    write_atomic(os.path.join(run_dir, LOADED), json.dumps({"path": path, "version": version}))


def last_loaded(run_dir: str, first: tuple[str, int]) -> tuple[str, int]:
    """(path, version) of the weights a restarted generation server starts from: the last version
    loaded, or `first` (the run's start) when none was yet."""
    try:
        with open(os.path.join(run_dir, LOADED)) as f:
            loaded = json.load(f)
    except FileNotFoundError:
        return first
    path, version = loaded["path"], loaded["version"]
    if not os.path.isdir(path):
        # Trainer rank 0 prunes all but the last two versions it wrote, and may write two while the
        # servers load one: the recorded version is gone, a newer one is there (written whole).
        root = os.path.dirname(path)
        newer = sorted(int(n[1:]) for n in os.listdir(root) if n.startswith("v") and n[1:].isdigit()
                       and int(n[1:]) > version) if os.path.isdir(root) else []
        if newer:
            return os.path.join(root, f"v{newer[0]}"), newer[0]
    return path, version


def prune(root: str, keep: int, every: int = 0) -> None:
    """Old versions are no longer read once the next one is loaded: keep the last two, and every
    `every`-th version when asked (rollout.keep_weights_every)."""
    for name in os.listdir(root):
        if name.startswith("v") and name[1:].isdigit() and int(name[1:]) < keep - 1:
            if every and int(name[1:]) % every == 0:
                continue
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
