"""Inside a launcher.type=slurm job (launchers/slurm.py writes the script that calls these):

    python -m areal_flow.launchers.slurm_job prepare RUN_DIR [HOST ...]
        once, on the job's first node, before any step: placement node k runs on the k-th host
        (the hosts given, or $SLURM_JOB_NODELIST expanded); writes each process's address into
        spec.json (still owner-only: it holds the run's secret) and slurm_hosts.json for the user,
        and prints each placement node's address, one a line (the script's ADDRS).
    python -m areal_flow.launchers.slurm_job step RUN_DIR NAME [--devices 0-3] [-- ARGV ...]
        in each srun step: gives the process its devices and the run's variables, then becomes
        process NAME of the placement (its command made here, where the spec is complete), or ARGV
        (a node's trainer ranks under torchrun).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys

from areal_flow.checkpoint import store
from areal_flow.graph import graph_from_config, place
from areal_flow.graph.mesh import parse_mesh
from areal_flow.graph.placement import Placement
from areal_flow.launchers.commands import first_weights, judge_command, python_role, server_command, server_host
from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.security import host_address, is_loopback
from areal_flow.runtime.spec import RunSpec, reachable, read_run, write_spec


class SlurmJobError(RuntimeError):
    pass


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compact host list (`node[01-03,7],gpu7`) as host names, in order, as
    `scontrol show hostnames` prints them (used when the script does not pass the hosts)."""
    hosts: list[str] = []
    # Split on commas outside brackets.
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        parts = re.split(r"\[([^\]]*)\]", item)  # prefix, ranges, text, ranges, ... text
        names = [""]
        for i, part in enumerate(parts):
            if i % 2 == 0:
                names = [n + part for n in names]
                continue
            choices = []
            for rng in part.split(","):
                lo, _, hi = rng.partition("-")
                if not lo.isdigit() or (hi and not hi.isdigit()):
                    raise SlurmJobError(f"cannot read the host list {nodelist!r}: {rng!r} is not a number or range")
                width = len(lo)  # node[01-10]: zero-padded to the width of the first bound
                choices += [str(k).zfill(width) for k in range(int(lo), int(hi or lo) + 1)]
            names = [n + c for n in names for c in choices]
        hosts += names
    return hosts


def slurm_node_addr(node: str) -> str | None:
    """The address Slurm itself reaches node `node` at (slurm.conf's NodeAddr), where it names one
    other than the node's name; None otherwise, or where scontrol cannot say."""
    try:
        r = subprocess.run(["scontrol", "show", "node", node, "--oneliner"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"(?:^|\s)NodeAddr=(\S+)", r.stdout)
    return found.group(1) if r.returncode == 0 and found and found.group(1) != node else None


def node_address(hostname: str) -> str:
    """The address the run's servers on `hostname` listen on and are reached at (ZeroMQ binds an
    address, not a name): the node's NodeAddr where Slurm names one (a cluster whose node names
    do not resolve), else what the name resolves to, IPv4 first; this host's routed address when
    the name resolves to loopback here, as /etc/hosts often makes a host's own name."""
    target = slurm_node_addr(hostname) or hostname
    try:
        infos = socket.getaddrinfo(target, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise SlurmJobError(f"the job's node {hostname!r} does not resolve to an address: {e}") from None
    addresses = [info[4][0] for info in infos]
    routed = [a for a in addresses if not is_loopback(a)]
    if routed:
        return next((a for a in routed if ":" not in a), routed[0])
    if hostname.split(".")[0] == socket.gethostname().split(".")[0]:
        return host_address()
    raise SlurmJobError(f"the job's node {hostname!r} resolves only to loopback ({', '.join(addresses)}): the other "
                        "nodes could not reach its processes")


def placement_of(cfg) -> Placement:
    graph = graph_from_config(cfg)
    return place(graph, cfg.rollout.workers, cfg.generation.tp_size, cfg.cluster.n_devices)


def requeued(run_dir: str, spec: RunSpec) -> None:
    """A job Slurm started again (requeued after a node failed, or a preemption; SLURM_RESTART_COUNT)
    goes on from the run's newest complete checkpoint, the run directory rewound to it, as
    `resume=auto` would; without one, from the start."""
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    if not restarts.isdigit() or int(restarts) == 0:
        return
    spec.resume = store.latest(run_dir) or ""
    store.rewind(run_dir, spec.resume or None)
    where = f"its checkpoint {spec.resume}" if spec.resume else "the start: it holds no complete checkpoint"
    print(f"areal_flow: the job was requeued (start {int(restarts) + 1}): the run goes on from {where}",
          file=sys.stderr)


def prepare(run_dir: str, hostnames: list[str]) -> list[str]:
    """Complete spec.json with each process's node address (and, in a requeued job, the checkpoint
    to go on from); the placement's nodes' addresses."""
    cfg, spec = read_run(run_dir)
    requeued(run_dir, spec)
    placement = placement_of(cfg)
    needed = max(p.node for p in placement.procs) + 1
    if len(hostnames) < needed:
        raise SlurmJobError(f"the placement uses {needed} nodes, the job has {len(hostnames)}: {hostnames}")
    addresses = [node_address(h) for h in hostnames[:needed]]
    spec.hosts = {p.name: addresses[p.node] for p in placement.procs}
    # The light processes run on the first node: anything not named in `hosts` is there.
    spec.host = addresses[0]
    spec.gen_host = reachable(server_host(cfg, spec.host))
    write_spec(run_dir, spec)
    where = {p.name: {"node": p.node, "hostname": hostnames[p.node], "address": addresses[p.node],
                      "devices": list(p.local_devices)} for p in placement.procs}
    with open(os.path.join(run_dir, rd.SLURM_HOSTS), "w") as f:
        json.dump(where, f, indent=1)
    return addresses


def visible(local: tuple[int, ...], env: str) -> str:
    """The placement's node-local device numbers as this step names them: through the list Slurm
    gave the step in `env` (e.g. CUDA_VISIBLE_DEVICES=4,5,6,7 when the node's devices are not
    renumbered), or as they are when there is none."""
    given = [d for d in env.split(",") if d]
    if not given:
        return ",".join(map(str, local))
    if max(local) >= len(given):
        raise SlurmJobError(f"the placement gives devices {list(local)} on this node, the step sees only {given}")
    return ",".join(given[d] for d in local)


def step_command(run_dir: str, name: str, devices: tuple[int, ...], argv: list[str],
                 environ: dict[str, str]) -> tuple[list[str], dict[str, str], tuple[int, ...] | None]:
    """(argv, environment, cores to pin or None) of step `name`."""
    cfg, spec = read_run(run_dir)
    env = {**environ, "PYTHONUNBUFFERED": "1", "AREAL_FLOW_PROC": name, "AREAL_FLOW_RUN": run_dir}
    if not argv:
        procs = {p.name: p for p in placement_of(cfg).procs}
        if name not in procs:
            raise SlurmJobError(f"no process {name!r} in the placement of {run_dir}; it has {', '.join(procs)}")
        proc = procs[name]
        if proc.role == "gen_server":
            path, version = first_weights(spec)  # a resumed run's servers start from its checkpoint
            argv, extra = server_command(cfg, proc, path, spec.gen_ports[proc.rank], version=version,
                                         host=server_host(cfg, spec.host_of(name)), api_key=spec.api_key)
            env.update(extra)
        elif proc.role == "judge_server":
            argv, extra = judge_command(cfg, proc, spec.judge_models[proc.graph_node],
                                        spec.judge_ports[proc.graph_node][proc.rank],
                                        host=server_host(cfg, spec.host_of(name)), api_key=spec.api_key)
            env.update(extra)
        else:
            argv = python_role(proc.role, proc, run_dir)
    cores = None
    if cfg.cluster.device_type == "cpu":
        env["OMP_NUM_THREADS"] = str(max(1, len(devices)))
        if cfg.launcher.pin_cpus and devices:
            # The cores Slurm gave the step (its cpuset), numbered as the placement numbers a node's.
            allowed = sorted(os.sched_getaffinity(0))
            if max(devices) >= len(allowed):
                raise SlurmJobError(f"{name}: the placement gives cores {list(devices)} on this node, the step may "
                                    f"use {len(allowed)} ({allowed})")
            cores = tuple(allowed[d] for d in devices)
    elif devices:
        env["CUDA_VISIBLE_DEVICES"] = visible(devices, environ.get("CUDA_VISIBLE_DEVICES", ""))
    return argv, env, cores


def main(argv: list[str]) -> int:
    # The job script passes Slurm's SIGUSR1 (a stop before the time limit) to the controller; until
    # the controller's loop handles it, it must not kill. Ignored here, it stays ignored across exec.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="python -m areal_flow.launchers.slurm_job")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("run_dir")
    p.add_argument("hosts", nargs="*")
    s = sub.add_parser("step")
    s.add_argument("run_dir")
    s.add_argument("name")
    s.add_argument("--devices", default="")
    rest: list[str] = []
    if "--" in argv:
        argv, rest = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            hosts = args.hosts or expand_nodelist(os.environ.get("SLURM_JOB_NODELIST", ""))
            addresses = prepare(args.run_dir, hosts)
            for node, (host, address) in enumerate(zip(hosts, addresses)):
                print(f"node {node}: {host} at {address}", file=sys.stderr)  # into the job's log
            print("\n".join(addresses))  # the script's ADDRS
            return 0
        devices, problem = parse_mesh(args.devices, "--devices") if args.devices else ((), None)
        if problem:
            raise SlurmJobError(problem)
        command, env, cores = step_command(args.run_dir, args.name, devices, rest, dict(os.environ))
    except SlurmJobError as e:
        print(f"areal_flow: {e}", file=sys.stderr)
        return 1
    if cores:
        os.sched_setaffinity(0, cores)
    os.execvpe(command[0], command, env)  # the step's task becomes the process: srun's signals reach it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
