"""`launcher.type=ray`: the run's processes on the nodes of a Ray cluster.

Every process of the placement gets a Ray actor on the node the placement gives it: one placement
group per placement node (STRICT_PACK: that node's processes share a Ray node), one bundle per
process that owns devices (its GPUs, or its cores on CPU), and the placement groups are all
reserved before anything starts, so a run starts whole or not at all (gang scheduling). The light
processes (controller, rollout and reward workers) need no devices and go beside the first node's
group. Each actor starts its process with the same command line the local launcher uses, on its
node, with `logs/<name>.log` in the run directory (which must be on a file system every node
shares), and reports its node's address and free ports, which the launcher writes into the run
spec before any process starts.

The launcher watches the actors the way the local launcher watches its children: a process that
may be restarted alone (a generation server, a rollout or reward worker, an inference process) is started again by its
actor, on its node, with its resources; any other process that exits, or an actor whose node is
lost, stops the run with the process's name; stopping the run stops every process and releases
the placement groups.

A scale (`python -m areal_flow.scale`, launchers/elastic.py) places each process it adds (`place`):
on the bundle a retired process left with the same devices (a resized trainer's ranks), else in a
placement group of its own, wherever the cluster has room; a process retired from a group of its
own releases it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import uuid
from collections import Counter

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from areal_flow.graph.placement import Placement, Proc
from areal_flow.launchers.local import ChildFailed, Restart, Watching, child_preexec
from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.ports import free_ports


@ray.remote(num_cpus=0)
class ProcessActor:
    """Starts one process of the run on its node and answers for it."""

    def __init__(self) -> None:
        self.popen: subprocess.Popen | None = None

    def node(self) -> str:
        return ray.util.get_node_ip_address()

    def free_ports(self, n: int) -> list[int]:
        return free_ports(n, "0.0.0.0")  # free on every address of the node: servers may bind any

    def start(self, argv: list[str], env: dict[str, str], log_path: str) -> dict[str, object]:
        # The node's own environment (what Ray gave this actor: CUDA_VISIBLE_DEVICES among it),
        # then the run's variables.
        with open(log_path, "ab") as log:
            self.popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env={**os.environ, **env}, preexec_fn=lambda: child_preexec(None))
        context = ray.get_runtime_context()
        return {"pid": self.popen.pid, "node_id": context.get_node_id(), "address": ray.util.get_node_ip_address(),
                "gpus": [str(g) for g in context.get_accelerator_ids().get("GPU", [])]}

    def poll(self) -> int | None:
        return self.popen.poll() if self.popen is not None else None

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(sig)

    def stop(self, timeout: float) -> int | None:
        if self.popen is None or self.popen.poll() is not None:
            return None if self.popen is None else self.popen.returncode
        self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()


def _bundle(proc: Proc, device_type: str, sharers: dict[int, int] | None = None) -> dict[str, float]:
    """The Ray resources of a process: its devices, each divided among the processes placed on it
    (`sharers`: device -> processes; colocated generation and training take half a GPU each, which
    Ray packs onto the same GPU)."""
    n = sum(1.0 / (sharers or {}).get(d, 1) for d in proc.devices)
    return {"GPU": n, "CPU": 1.0} if device_type == "cuda" else {"CPU": n}


def _sharers(placement: Placement) -> dict[int, int]:
    return dict(Counter(d for p in placement.procs for d in p.devices))


PLACE_TIMEOUT = 10.0
"""Seconds a scale waits for the cluster to place a process it adds, before it is refused."""


class RayLauncher(Watching):
    """The local launcher's interface (`reserve`, `start`, `check`, `wait`, `stop_all`) on Ray."""

    scales = True

    def __init__(self, run_dir: str, placement: Placement, *, address: str, device_type: str,
                 start_timeout: float, stop_timeout: float):
        self.run_dir, self.stop_timeout, self.device_type = run_dir, stop_timeout, device_type
        self.sharers = _sharers(placement)
        os.makedirs(os.path.join(run_dir, rd.LOGS), exist_ok=True)
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        nodes = sorted({p.node for p in placement.procs if p.devices})
        self.groups: dict[int, PlacementGroup] = {}
        self.actors: dict[str, ray.actor.ActorHandle] = {}
        self.log_paths: dict[str, str] = {}
        self.started: dict[str, dict] = {}
        self.again: dict[str, tuple[Proc, Restart, int]] = {}  # how to restart a process, and how often yet
        self.procs = {p.name: p for p in placement.procs}  # what runs (running_procs)
        self.provisional = set()
        # A device-owning process's bundle, by its devices, and who holds it now (None: free for a
        # process a scale adds on those devices); the groups of processes a scale added, by name.
        self.bundles: dict[tuple[int, ...], tuple[PlacementGroup, int]] = {}
        self.holder: dict[tuple[int, ...], str | None] = {}
        self.own_groups: dict[str, PlacementGroup] = {}
        try:
            for node in nodes:
                procs = [p for p in placement.procs if p.devices and p.node == node]
                self.groups[node] = placement_group([_bundle(p, device_type, self.sharers) for p in procs],
                                                    strategy="STRICT_PACK",
                                                    name=f"areal_flow-node{node}")
            self._wait_for_groups(start_timeout)
            for node, group in self.groups.items():
                procs = [p for p in placement.procs if p.devices and p.node == node]
                for index, proc in enumerate(procs):
                    self.actors[proc.name] = self._actor(proc, group, index, device_type)
                    self.bundles[proc.devices], self.holder[proc.devices] = (group, index), proc.name
            first = self.groups[nodes[0]] if nodes else None
            for proc in placement.procs:
                if not proc.devices:  # light: no resources, next to the first node's processes
                    self.actors[proc.name] = ProcessActor.options(
                        scheduling_strategy=None if first is None else PlacementGroupSchedulingStrategy(first),
                    ).remote()
        except BaseException:
            self.stop_all()
            raise

    def _actor(self, proc: Proc, group: PlacementGroup, index: int, device_type: str, sharers: dict | None = None):
        resources = _bundle(proc, device_type, self.sharers if sharers is None else sharers)
        return ProcessActor.options(
            num_cpus=resources.get("CPU", 0.0), num_gpus=resources.get("GPU", 0.0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
        ).remote()

    def _wait_for_groups(self, timeout: float) -> None:
        pending = {node: group.ready() for node, group in self.groups.items()}
        try:
            ray.get(list(pending.values()), timeout=timeout)
        except GetTimeoutError:
            ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=0)
            missing = [f"node {node} ({self.groups[node].bundle_specs})" for node, ref in pending.items()
                       if ref not in ready]
            raise RuntimeError(f"the Ray cluster could not place {', '.join(missing)} within {timeout:.0f} s "
                               f"(launcher.start_timeout); it has {ray.cluster_resources()}") from None

    def reserve(self, names: list[str], wildcard: bool = True) -> list[tuple[str, int]]:
        """(address, free port) on the node of each named process, in order (a name may repeat);
        ports are always free on every address of the node."""
        wanted: dict[str, int] = {}
        for name in names:
            wanted[name] = wanted.get(name, 0) + 1
        asked = {n: (self.actors[n].node.remote(), self.actors[n].free_ports.remote(k)) for n, k in wanted.items()}
        answers = {n: (ray.get(host), ray.get(ports)) for n, (host, ports) in asked.items()}
        out = []
        for name in names:
            host, ports = answers[name]
            out.append((host, ports.pop(0)))
        return out

    def start(self, proc: Proc, argv: list[str], env: dict[str, str] | None = None, *, again: Restart | None = None,
              restarts: int = 0) -> None:
        """Start `argv` as `proc` through its actor; `again` starts it again when it dies (the same
        actor: its node and resources), at most `restarts` times."""
        if again is not None:
            self.again[proc.name] = (proc, again, restarts)
        env = {**(env or {}), "PYTHONUNBUFFERED": "1", "AREAL_FLOW_PROC": proc.name, "AREAL_FLOW_RUN": self.run_dir}
        if self.device_type == "cpu":  # as the local launcher: a process's threads are its cores, light ones 1
            env["OMP_NUM_THREADS"] = str(max(1, len(proc.devices)))
        log_path = os.path.join(self.run_dir, rd.log_of(proc.name))
        self.log_paths[proc.name] = log_path
        self.started[proc.name] = {"node": proc.node, **ray.get(self.actors[proc.name].start.remote(argv, env, log_path))}
        # Where each process runs (its Ray node, address, pid, GPUs), for the user and the tests.
        with open(os.path.join(self.run_dir, rd.RAY_PLACEMENT), "w") as f:
            json.dump(self.started, f, indent=1)

    def exited(self) -> dict[str, int]:
        """Exit codes of the processes that exited; ChildFailed at once for one whose actor is gone."""
        names = list(self.log_paths)
        refs = [self.actors[n].poll.remote() for n in names]
        codes: dict[str, int] = {}
        for name, ref in zip(names, refs):
            try:
                code = ray.get(ref, timeout=30)
            except (RayActorError, GetTimeoutError) as e:
                raise ChildFailed(name, -signal.SIGKILL, f"its Ray actor on {self.where(name)} is gone: {e}",
                                  self.log_paths[name]) from None
            if code is not None:
                codes[name] = code
        return codes

    def where(self, name: str) -> str:
        """Process `name`'s node as a reader finds it: placement node, address, and whether Ray still
        counts it alive (a node that died takes its actors with it)."""
        started = self.started.get(name, {})
        text = f"node {started.get('node', '?')} ({started.get('address', '?')}"
        try:
            alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}.get(started.get("node_id"))
        except Exception:  # noqa: BLE001 - the GCS itself may be gone: the address is what there is to say
            alive = None
        return text + (", which Ray reports dead)" if alive is False else ")")

    def log_path(self, name: str) -> str:
        return self.log_paths[name]

    def restart(self, name: str) -> bool:
        proc, again, left = self.again.get(name, (None, None, 0))
        if again is None or left <= 0:
            return False
        argv, env = again()
        self.start(proc, argv, env, again=again, restarts=left - 1)
        return True

    def signal(self, name: str, sig: int) -> None:
        ray.get(self.actors[name].signal.remote(sig), timeout=30)

    def running_procs(self) -> list[Proc]:
        return list(self.procs.values())

    def place(self, proc: Proc) -> None:
        """An actor for `proc`, which a scale adds: on the free bundle of its devices, else in a
        placement group of its own (RuntimeError when the cluster has no room within PLACE_TIMEOUT)."""
        if self.holder.get(proc.devices, "taken") is None:
            group, index = self.bundles[proc.devices]
            self.actors[proc.name] = self._actor(proc, group, index, self.device_type)
            self.holder[proc.devices] = proc.name
        else:
            bundle = _bundle(proc, self.device_type)
            group = placement_group([bundle], strategy="STRICT_PACK", name=f"areal_flow-{proc.name}-{uuid.uuid4().hex[:6]}")
            try:
                ray.get(group.ready(), timeout=PLACE_TIMEOUT)
            except GetTimeoutError:
                remove_placement_group(group)
                raise RuntimeError(f"the Ray cluster has no room for {proc.name} ({bundle}) within {PLACE_TIMEOUT:g} s; "
                                   f"free: {ray.available_resources()}") from None
            self.own_groups[proc.name] = group
            self.actors[proc.name] = self._actor(proc, group, 0, self.device_type, sharers={})
        self.procs[proc.name] = proc

    def retire(self, name: str) -> None:
        """Stop process `name` for good (a scale removed it): its actor goes, and its resources with
        a group of its own, or its bundle waits for a process on the same devices."""
        self.provisional.discard(name)
        actor = self.actors.pop(name)
        try:
            ray.get(actor.stop.remote(self.stop_timeout), timeout=self.stop_timeout + 30)
        except (RayActorError, GetTimeoutError):
            pass  # a lost actor took its process with it
        ray.kill(actor)
        proc = self.procs.pop(name)
        self.log_paths.pop(name, None)
        self.again.pop(name, None)
        if (group := self.own_groups.pop(name, None)) is not None:
            remove_placement_group(group)
        elif self.holder.get(proc.devices) == name:
            self.holder[proc.devices] = None

    def stop_all(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL after stop_timeout), kill the actors, release the groups."""
        stops = [a.stop.remote(self.stop_timeout) for a in self.actors.values()]
        try:
            ray.get(stops, timeout=self.stop_timeout + 30)
        except Exception:  # noqa: BLE001 - a lost actor took its process with it
            pass
        for actor in self.actors.values():
            ray.kill(actor)
        for group in [*self.groups.values(), *self.own_groups.values()]:
            remove_placement_group(group)
        self.actors, self.groups, self.own_groups = {}, {}, {}
        ray.shutdown()
