"""Hosts with their own network addresses on this machine: Linux network namespaces, each with a
veth pair to one bridge, as machines on one LAN (docs/clusters.md, "Testing across hosts").

Nothing here reaches beyond the namespaces the helper makes: they have no route but their own
subnet, and a process in one cannot reach another's 127.0.0.1 — so a role that binds loopback
where it should bind its node's address is not reachable from the other host, as on two machines.
Everything is removed again by `down()`, which also kills whatever still runs inside."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def free_subnet() -> int:
    """X of a 10.X.0.0/24 no interface of this machine uses (from 200 up)."""
    used = ip("-o", "-4", "addr").stdout
    return next(x for x in range(200, 255) if f" 10.{x}." not in used)


@dataclass
class Hosts:
    n: int
    tag: str = field(default_factory=lambda: f"af{os.getpid() % 100000}")
    subnet: int = field(default_factory=free_subnet)

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"  # interface names are at most 15 characters

    @property
    def names(self) -> list[str]:
        return [f"{self.tag}n{i}" for i in range(self.n)]

    @property
    def addresses(self) -> list[str]:
        return [f"10.{self.subnet}.0.{i + 1}" for i in range(self.n)]

    @property
    def gateway(self) -> str:
        """This machine's own address on the bridge (where a service of the root namespace listens)."""
        return f"10.{self.subnet}.0.254"

    def up(self) -> Hosts:
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, (name, address) in enumerate(zip(self.names, self.addresses)):
            ip("netns", "add", name)
            ip("link", "add", f"{self.tag}v{i}", "type", "veth", "peer", "name", "eth0", "netns", name)
            ip("link", "set", f"{self.tag}v{i}", "master", self.bridge, "up")
            ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")
            ip("-n", name, "link", "set", "lo", "up")
        return self

    def command(self, i: int, argv: list[str]) -> list[str]:
        """`argv` run inside host i's network namespace. nsenter rather than `ip netns exec`: that
        one also mounts a sysfs of its own over /sys, hiding the cgroup file systems slurmd needs."""
        return ["nsenter", f"--net=/run/netns/{self.names[i]}", *argv]

    def pids(self, i: int) -> list[int]:
        out = ip("netns", "pids", self.names[i], check=False).stdout
        return [int(p) for p in out.split()]

    def kill(self, i: int) -> list[int]:
        """SIGKILL every process of host i (a machine that loses power); the pids killed."""
        killed = []
        for _ in range(20):  # processes may fork while being killed: until none is left
            pids = self.pids(i)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        return killed

    def down(self) -> None:
        for i, name in enumerate(self.names):
            self.kill(i)
            ip("netns", "del", name, check=False)  # removes its end of the veth pair, and so the pair
        ip("link", "del", self.bridge, check=False)
