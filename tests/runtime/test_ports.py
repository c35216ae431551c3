"""Ports a launcher picks for processes that bind them later: outside the kernel's ephemeral range
(where outgoing connections take theirs) and reserved on the host, so neither another process's
connection nor another launcher takes them before the bind."""

import multiprocessing as mp
import os
import random
import socket
import time

import pytest

from areal_flow.runtime import ports


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_FLOW_PORTS_DIR", str(tmp_path / "ports"))
    return tmp_path / "ports"


def test_ports_are_distinct_free_and_outside_the_ephemeral_range(fresh):
    low, high = ports.ephemeral_range()
    got = ports.free_ports(40)
    assert len(set(got)) == 40
    assert all(not low <= p <= high for p in got)
    for p in got:  # each binds
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    assert sorted(int(f.name) for f in fresh.iterdir()) == sorted(got)


def test_an_outgoing_connection_never_takes_a_picked_port(fresh):
    # The race this module exists for: the kernel gives connections ports of the ephemeral range only.
    picked = set(ports.free_ports(20))
    with socket.create_server(("127.0.0.1", 0), backlog=256) as server:
        clients = [socket.create_connection(server.getsockname()) for _ in range(100)]
        try:
            assert not picked & {c.getsockname()[1] for c in clients}
        finally:
            for c in clients:
                c.close()


def test_a_port_in_use_or_reserved_is_skipped_and_a_stale_reservation_is_taken(fresh, monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        monkeypatch.setattr(ports, "candidates", lambda: range(taken, taken + 1))
        with pytest.raises(RuntimeError, match=f"no 1 free ports found among {taken}..{taken}"):
            ports.free_ports(1)
    # Free now, but its reservation (made while trying) is fresh: still skipped ...
    with pytest.raises(RuntimeError, match="no 1 free ports"):
        ports.free_ports(1)
    # ... until it is older than HOLD_S.
    old = time.time() - ports.HOLD_S - 1
    (fresh / str(taken)).touch()
    os.utime(fresh / str(taken), (old, old))
    assert ports.free_ports(1) == [taken]


def _pick(dir_: str, seed: int, out) -> None:
    os.environ["AREAL_FLOW_PORTS_DIR"] = dir_
    # Few candidates and the same draws in every process: only the reservations keep them apart.
    ports.candidates = lambda: range(20000, 20064)
    out.put(ports.free_ports(8, rng=random.Random(seed)))


def test_launchers_picking_at_once_never_share_a_port(fresh):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_pick, args=(str(fresh), 0, out)) for _ in range(4)]
    for p in procs:
        p.start()
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    flat = [p for g in got for p in g]
    assert len(flat) == 32 and len(set(flat)) == 32
