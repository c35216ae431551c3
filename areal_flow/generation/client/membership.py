"""The policy's generation servers of a live run, as they change (`python -m areal_flow.scale`):
`servers.json` in the run directory, written by the launcher, followed by every process that
sends the servers requests or weights (the rollout workers and the controller).

    {"epoch": 3, "servers": {"gen_server0": {"url": "http://127.0.0.1:41000", "leaving": false}, ...}}

The launcher writes it whole (a temporary file, then a rename) at the run's start and at each step
of a scale. A new server is listed `joining` once its /health answers: the controller's pool alone
takes it, loads the current weights on it (holding weight updates meanwhile, so it misses none)
and marks it `scale/ready/<server>`; then the launcher lists it as serving and the rollout workers'
pools take it too. (Were a rollout worker to take it first, it could route requests to it while an
update it missed runs elsewhere.) A server that is removed is first marked `leaving` (no new
request goes to it), then dropped. A follower (`follow`) reads the file when it changes, applies
it to its ServerPool (`apply`), and acknowledges the epoch in `scale/acks/<process>`, which the
launcher waits for at each step (before it aborts a leaving server's requests, for one).
A process that starts later (a restarted worker) reads the servers from here, not from the spec.

Each judge's servers (`scale RUN_DIR judge=+1`) have a file of their own, `servers-<judge>.json`,
followed the same way by the same processes (the rollout workers ask the judges; the controller
watches their health). A judge's model never changes: a new judge server is listed serving as soon
as its /health answers.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

import msgspec

from areal_flow.generation.client.router import ServerPool
from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.disk import write_atomic

log = logging.getLogger("areal_flow.membership")

SERVERS, ACKS, READY = rd.SERVERS, rd.SCALE_ACKS, rd.SCALE_READY
"""The policy's servers (a judge's are in `servers_file(judge)`) and the scale handshake's folders."""
FOLLOW_INTERVAL = 0.5
"""Seconds between a follower's looks at servers.json."""


class Member(msgspec.Struct):
    url: str
    leaving: bool = False  # being removed: no new request goes to it
    joining: bool = False  # new: only the controller's pool takes it, until it serves the current weights


class Membership(msgspec.Struct):
    epoch: int
    servers: dict[str, Member]  # process name -> the server

    def serving(self) -> list[str]:
        """The servers that take requests (not leaving), in the order they joined."""
        return [name for name, m in self.servers.items() if not m.leaving]


def servers_file(judge: str = "") -> str:
    """The file listing the policy's servers, or judge `judge`'s."""
    return f"servers-{judge}.json" if judge else SERVERS


def write_membership(run_dir: str, membership: Membership, judge: str = "") -> None:
    write_atomic(os.path.join(run_dir, servers_file(judge)), msgspec.json.encode(membership))


def read_membership(run_dir: str, judge: str = "") -> Membership | None:
    """The run's servers.json (or judge `judge`'s file); None when it has none (a run started
    before it existed)."""
    try:
        with open(os.path.join(run_dir, servers_file(judge)), "rb") as f:
            return msgspec.json.decode(f.read(), type=Membership)
    except FileNotFoundError:
        return None


def servers_of(run_dir: str, names: list[str], urls: list[str], judge: str = "") -> tuple[list[str], list[str]]:
    """(names, urls) of the servers a starting process should use: those serving in servers.json
    (or judge `judge`'s file), else the spec's (`names`, `urls`). Not one still joining: it may not
    serve the current weights yet, and a pool takes its first servers without the version check. A
    process started during a scale-up takes it once it is listed serving (`follow`; the controller's
    pool, which loads the weights on it, as soon as it follows)."""
    membership = read_membership(run_dir, judge)
    serving = [] if membership is None else [n for n in membership.serving() if not membership.servers[n].joining]
    if not serving:
        return names, urls
    return serving, [membership.servers[n].url for n in serving]


def apply(pool: ServerPool, membership: Membership, joining: bool = False) -> None:
    """Make `pool` follow `membership`: a new server joins (one still `joining` only with `joining`:
    the controller's pool), a leaving one leaves, a gone one is forgotten."""
    now = {s.name: s for s in pool.servers}
    for name, member in membership.servers.items():
        if name not in now and not member.leaving and (joining or not member.joining):
            pool.add(name, member.url)
        elif name in now and member.leaving and not now[name].leaving:
            pool.leave(name)
    for name in now:
        if name not in membership.servers:
            pool.forget(name)


def changes(before: Membership | None, after: Membership) -> dict[str, list[str]]:
    """What changed from `before` (None: a follower's first look: nothing) to `after`: names added,
    leaving and removed."""
    if before is None:
        return {"added": [], "joined": [], "leaving": [], "removed": []}
    old = before.servers
    return {"added": [n for n, m in after.servers.items() if n not in old and not m.leaving],
            "joined": [n for n, m in after.servers.items() if n in old and old[n].joining and not m.joining],
            "leaving": [n for n, m in after.servers.items() if m.leaving and n in old and not old[n].leaving],
            "removed": [n for n in old if n not in after.servers]}


def _ack_file(run_dir: str, process: str, judge: str) -> str:
    return os.path.join(run_dir, ACKS, f"{process}@{judge}" if judge else process)


def acknowledge(run_dir: str, process: str, epoch: int, judge: str = "") -> None:
    os.makedirs(os.path.join(run_dir, ACKS), exist_ok=True)
    write_atomic(_ack_file(run_dir, process, judge), str(epoch).encode())


def acknowledged(run_dir: str, process: str, judge: str = "") -> int:
    """The last epoch `process` applied of the policy's servers (or judge `judge`'s); -1: none yet."""
    try:
        with open(_ack_file(run_dir, process, judge)) as f:
            return int(f.read().strip() or -1)
    except (FileNotFoundError, ValueError):
        return -1


def mark_ready(run_dir: str, server: str) -> None:
    """The controller's pool has taken `server`: it serves the current weights, and gets every update."""
    os.makedirs(os.path.join(run_dir, READY), exist_ok=True)
    write_atomic(os.path.join(run_dir, READY, server), b"")


def is_ready(run_dir: str, server: str) -> bool:
    return os.path.exists(os.path.join(run_dir, READY, server))


async def follow(pool: ServerPool, run_dir: str, process: str,
                 on_change: Callable[[int, dict[str, list[str]]], None] = lambda epoch, changes: None,
                 interval: float = FOLLOW_INTERVAL, joining: bool = False, judge: str = "") -> None:
    """Apply servers.json (or judge `judge`'s file) to `pool` whenever it changes, acknowledging each epoch as `process`;
    `on_change(epoch, changes)` after each change (the controller's ledger). With `joining` (the
    controller's pool, which loads the weights), new servers are taken while still joining, and
    each is marked ready once the pool takes it. Runs until cancelled."""
    if joining:
        pool.on_up = lambda name: mark_ready(run_dir, name)
    seen, stamp, previous = -1, None, None
    path = os.path.join(run_dir, servers_file(judge))
    while True:
        try:
            now = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            now = None
        if now is not None and now != stamp:
            stamp = now
            membership = read_membership(run_dir, judge)
            if membership is not None and membership.epoch != seen:
                apply(pool, membership, joining)
                changed, previous, seen = changes(previous, membership), membership, membership.epoch
                acknowledge(run_dir, process, seen, judge)
                if any(changed.values()):
                    log.warning("%s: %s servers at epoch %d: %s", process, f"judge {judge}'s" if judge else "generation", seen,
                                "; ".join(f"{k} {', '.join(v)}" for k, v in changed.items() if v))
                    on_change(seen, changed)
        await asyncio.sleep(interval)

