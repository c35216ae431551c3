"""Free TCP ports for processes that will listen on them a moment later.

A port the kernel hands out for `bind(("", 0))` comes from the ephemeral range, the same range it
hands out for every outgoing connection. Between the moment a launcher picks such a port and the
moment the started process binds it, any other process on the host may get it as the source port of
a connection, and the bind fails (`Address already in use`). Ports are therefore drawn at random
*below* the ephemeral range, where the kernel never assigns one by itself, and each is reserved for a
while in a file of the host's temporary directory, so two launchers on one host (a test suite, a
Hydra multirun) do not draw the same port either. This is the approach of Google's `portpicker`
without its port server.
"""

from __future__ import annotations

import errno
import os
import random
import socket
import tempfile
import time
from pathlib import Path

from areal_flow.runtime.security import LOOPBACK

#: Ports below this are left alone (well-known and registered services commonly listen there).
LOWEST = 15000
#: How long a drawn port stays reserved for the process that will bind it, in seconds. Bound by then,
#: it is found in use when tried; never bound, it is free to draw again.
HOLD_S = 120.0


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports it assigns by itself (Linux; the IANA range elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


def candidates() -> range:
    """The ports drawn from: below the ephemeral range (above it when that leaves too few)."""
    low, high = ephemeral_range()
    if low - LOWEST >= 4096:
        return range(LOWEST, low)
    return range(high + 1, 65536)


def reservations() -> Path:
    """The host-wide directory of reserved ports (one empty file a port, its mtime the reservation)."""
    path = Path(os.environ.get("AREAL_FLOW_PORTS_DIR") or Path(tempfile.gettempdir(), "areal_flow-ports"))
    path.mkdir(mode=0o1777, parents=True, exist_ok=True)
    return path


def _reserve(port: int, now: float) -> bool:
    """Claim `port`'s reservation file; False when another process holds it (younger than HOLD_S)."""
    path = reservations() / str(port)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        return True
    except FileExistsError:
        pass
    try:
        if now - path.stat().st_mtime < HOLD_S:
            return False
        os.utime(path, (now, now))  # stale: take it over (two takers both pass only within a microsecond)
        return True
    except OSError:
        return False


def _bindable(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES, errno.EADDRNOTAVAIL):
                return False
            raise
    return True


def free_ports(n: int, host: str = LOOPBACK, *, rng: random.Random | None = None) -> list[int]:
    """`n` distinct ports free on `host` now, outside the kernel's ephemeral range, each reserved on
    this host for HOLD_S seconds. `host` "0.0.0.0" asks for ports free on every address."""
    rng = rng or random.SystemRandom()
    pool = candidates()
    out: list[int] = []
    for _ in range(20 * n + 200):
        if len(out) == n:
            return out
        port = rng.choice(pool)
        if port in out or not _reserve(port, time.time()):
            continue
        if _bindable(port, host):
            out.append(port)
    raise RuntimeError(f"no {n} free ports found among {pool.start}..{pool.stop - 1} on {host} "
                       f"(reservations in {reservations()})")
