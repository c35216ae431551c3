"""Start a run the launcher watches (launcher.type local or ray): from its checkpoint with resume,
every process of the placement, watched until the controller finishes, and the run restarted
from its last checkpoint when a process dies (recover.retries; docs/reliability.md)."""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import signal
import time
import uuid
from collections.abc import Callable

from omegaconf import DictConfig
from rich.console import Console
from rich.markup import escape

from areal_flow.checkpoint import compat, store
from areal_flow.config.schema import RunConfig
from areal_flow.graph.dag import graph_from_config
from areal_flow.graph.placement import Placement, Proc
from areal_flow.launchers.commands import first_weights, judge_command, python_role, server_command, server_host
from areal_flow.launchers.autoscale import AutoScaler
from areal_flow.launchers.elastic import Scaler
from areal_flow.launchers.local import ChildFailed, LocalLauncher, how_it_ended
from areal_flow.launchers.progress import RunProgress
from areal_flow.run.checks import SHARED_MEMORY
from areal_flow.run.lock import hold_run_dir
from areal_flow.run.ports import watched_spec
from areal_flow.run.prepare import Prepared
from areal_flow.run.stop import Terminated, interrupt, stop_with_checkpoint
from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.spec import RunSpec, write_run
from areal_flow.weights.files import last_loaded


def make_launcher(cfg: RunConfig, run_dir: str, placement: Placement):
    """The launcher launcher.type names: this host's processes, or actors on a Ray cluster."""
    lc = cfg.launcher
    if lc.type == "ray":
        from areal_flow.launchers.ray_cluster import RayLauncher  # ray is an optional extra

        return RayLauncher(run_dir, placement, address=lc.ray_address, device_type=cfg.cluster.device_type,
                           start_timeout=lc.start_timeout, stop_timeout=lc.stop_timeout)
    return LocalLauncher(run_dir, device_type=cfg.cluster.device_type, pin_cpus=lc.pin_cpus,
                         stop_timeout=lc.stop_timeout)


def start_processes(launcher, placement: Placement, spec: RunSpec, cfg: RunConfig) -> Callable:
    """Start every process; returns `command(proc, weights, port)`, which makes a process's argv and
    environment (a scale starts servers with it)."""
    first = first_weights(spec)
    # Processes the local launcher restarts alone when they die (the run goes on): the workers, the
    # inference processes (the trainer ranks ask a restarted one again: training/worker.py), the
    # judges' servers (frozen: they start from their model), and the policy's servers when the
    # weights they must load are files (the last version the controller loaded: weights/files.py).
    # A server of a trainer-sent channel has no copy to start from.
    files = cfg.rollout.weight_update_mode in ("disk", "shm")
    # A critic's process on a mesh of its own holds the critic's training state: restarted alone, it
    # would go on from its start weights; its death stops the run (recover from a checkpoint instead).
    trained = {p.graph_node for p in placement.of_role("inference")
               if getattr(cfg.graph.get(p.graph_node), "role", None) == "critic"}

    def command(proc: Proc, weights: tuple[str, int] = first, port: int | None = None,
                host: str | None = None) -> tuple[list[str], dict[str, str]]:
        if proc.role == "judge_server":  # a judge's model is its start files, resumed or not
            return judge_command(cfg, proc, spec.judge_models[proc.graph_node],
                                 port or spec.judge_ports[proc.graph_node][proc.rank], api_key=spec.api_key,
                                 host=server_host(cfg, host or spec.host_of(proc.name)))
        if proc.role != "gen_server":
            return python_role(proc.role, proc, spec.run_dir), {}
        path, version = weights
        return server_command(cfg, proc, path, port or spec.gen_ports[proc.rank], api_key=spec.api_key,
                              host=server_host(cfg, host or spec.host_of(proc.name)), version=version)

    for proc in placement.procs:
        again = None
        if proc.role == "gen_server" and files:
            again = functools.partial(lambda proc: command(proc, last_loaded(spec.run_dir, first)), proc)
        elif proc.role in ("rollout", "reward", "inference", "judge_server") and proc.graph_node not in trained:
            again = functools.partial(command, proc)
        launcher.start(proc, *command(proc), again=again, restarts=cfg.recover.worker_restarts)
    return command


def make_scaler(launcher, placement: Placement, spec: RunSpec, cfg: RunConfig, command: Callable,
                say: Callable[[str], None]) -> Scaler:
    """The launcher's side of `python -m areal_flow.scale` for this launch (launchers/elastic.py)."""
    first = first_weights(spec)
    # A new server starts from the run's first weights, which stay (a version's files may be pruned
    # while it starts: trainer rank 0 keeps two), and gets the newest when it joins (ServerPool._back).
    return Scaler(launcher, spec.run_dir, command=lambda proc, port, host: command(proc, first, port, host),
                  n_devices=cfg.cluster.n_devices * cfg.cluster.n_nodes,
                  devices_named="cluster.n_devices" + (" × cluster.n_nodes" if cfg.cluster.n_nodes > 1 else ""),
                  per_server=cfg.generation.tp_size,
                  followers=[p.name for p in placement.procs if p.role in ("controller", "rollout")],
                  weight_mode=cfg.rollout.weight_update_mode, restarts=cfg.recover.worker_restarts,
                  api_key=spec.api_key, start_timeout=cfg.launcher.start_timeout,
                  trainer_problem=functools.partial(resize_problem, cfg), judges=list(spec.judge_ports),
                  auto=AutoScaler(spec.run_dir, cfg.elastic, cfg.generation.tp_size) if cfg.elastic.auto else None,
                  say=say)


def resize_problem(cfg: RunConfig, n: int) -> str | None:
    """What stops the run's trainer from going on with n ranks from a checkpoint, if anything."""
    graph = graph_from_config(cfg)
    layout = graph.train.layout
    if layout is not None and (layout.tp > 1 or layout.pp > 1):
        return f"graph.{graph.train.name}.parallel has tp={layout.tp}, pp={layout.pp}: only a data-parallel trainer resizes"
    megatron = [node.name for node in graph.trainer_nodes if node.engine == "megatron"]
    if megatron and cfg.training.distributed_optimizer:
        return (f"graph.{megatron[0]}.engine=megatron with training.distributed_optimizer=true keeps each rank's shard "
                "of the optimizer state, which resumes only on the layout that saved it; without it (or with the torch "
                "engine) the checkpoint reshards")
    if graph.colocated:
        return "generation and training share devices (colocated): their turns are fixed at the run's start"
    if graph.own_mesh_nodes:
        return (f"node(s) {', '.join(n.name for n in graph.own_mesh_nodes)} run on a mesh of their own, whose processes "
                "send to the trainer ranks of the run's start")
    most = -(-cfg.algorithm.batch_size // n)
    if cfg.algorithm.n_minibatches > most:
        return (f"algorithm.n_minibatches={cfg.algorithm.n_minibatches} exceeds the {most} prompt group(s) a rank gets "
                f"from algorithm.batch_size={cfg.algorithm.batch_size} over {n} ranks")
    return None


def launch_once(raw: DictConfig, cfg: RunConfig, placement: Placement, prepared: Prepared, console: Console,
                resume: str | None) -> tuple[int, RunSpec]:
    """Start every process of the run (from the checkpoint `resume`, when given) and watch them
    until the controller finishes: (0, spec) when it did; 1 when a process died; 130 when stopped
    (SIGINT or SIGTERM), after the controller saved a checkpoint at the end of its step when
    checkpoint.at_stop."""
    # Made by trainer rank 0 at its first publish; removed when the run ends (shared memory is RAM).
    weights_dir = os.path.join(SHARED_MEMORY, f"areal_flow-{uuid.uuid4().hex[:12]}") \
        if cfg.rollout.weight_update_mode == "shm" else ""
    launcher = make_launcher(cfg, prepared.run_dir, placement)
    launcher.on_restart = lambda name, code: console.print(
        f"process '{name}' {how_it_ended(code)}: restarted, the run goes on (its log: {launcher.log_path(name)})",
        highlight=False, markup=False)
    spec = watched_spec(cfg, placement, launcher, prepared, weights_dir=weights_dir, resume=resume)
    write_run(prepared.run_dir, raw, spec)
    console.print(f"run directory: {prepared.run_dir}", highlight=False)
    if spec.security is not None:
        console.print(f"secured: servers listen on {spec.host}; ZeroMQ is CURVE-encrypted and the generation "
                      "servers take the run's API key (in spec.json, owner-only)", highlight=False)
    previous = signal.signal(signal.SIGTERM, interrupt)  # a scheduler's SIGTERM stops the run as Ctrl-C does
    # Made before any process starts: it shows the rows they add to metrics.jsonl, not a resumed run's earlier ones.
    progress = RunProgress(spec.path(rd.METRICS), cfg.total_steps, console)
    try:
        # servers.json lists the placement's servers before any process reads it (an earlier launch's scale is gone).
        Scaler.reset(spec.run_dir, dict(zip(spec.gen_names, spec.gen_urls)),
                     {node: dict(zip(spec.judge_names(node), spec.judge_urls(node))) for node in spec.judge_ports})
        command = start_processes(launcher, placement, spec, cfg)
        scaler = make_scaler(launcher, placement, spec, cfg, command,
                             lambda text: console.print(text, highlight=False, markup=False))

        def tick() -> None:
            progress.tick()
            scaler.tick()

        with progress:
            launcher.wait("controller", on_tick=tick)
    except ChildFailed as e:
        # The reason on one line (the process and the exception that ended it), then its traceback.
        console.print(f"[bold red]run failed:[/] {escape(e.reason)}", highlight=False)
        if e.traceback != e.error:  # a one-line account is the reason already
            console.print(escape(e.traceback), highlight=False)
        return 1, spec
    except KeyboardInterrupt as e:
        stop_with_checkpoint(launcher, cfg, console, "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C")
        return 130, spec
    finally:
        signal.signal(signal.SIGTERM, previous)
        launcher.stop_all()
        if weights_dir and not removed(weights_dir):
            console.print(f"could not remove the run's weights from shared memory: {weights_dir} (remove it by hand)",
                          highlight=False, markup=False)
    return 0, spec


def removed(path: str, tries: int = 50) -> bool:
    """Remove the run's weights from shared memory (RAM); whether they are gone. A removal can meet
    a folder a stopped process's last write is still renaming into place (CI saw one left behind):
    it is tried again."""
    for _ in range(tries):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            return True
        time.sleep(0.1)
    return False


def find_resume(raw: DictConfig, cfg: RunConfig, prepared: Prepared, console: Console) -> tuple[str | None, Prepared]:
    """The checkpoint `resume` names (None: a new run), checked against the composed config, and
    the run's inputs in the checkpoint's own run directory; raise ResumeError when it does not fit."""
    if not cfg.resume:
        return None, prepared
    resume, run_dir = compat.find(cfg.resume, prepared.run_dir)
    if resume is None:
        console.print(f"resume=auto: {store.folder(run_dir)} holds no complete checkpoint: starting the run",
                      highlight=False, markup=False)
        return None, prepared
    compat.check(resume, raw)
    raw.output_dir = run_dir  # the run goes on in its own directory
    return resume, dataclasses.replace(prepared, run_dir=run_dir)


def start_watched(raw: DictConfig, cfg: RunConfig, placement: Placement, prepared: Prepared,
                  console: Console) -> tuple[int, RunSpec]:
    """Run to the end, restarting from the last checkpoint up to recover.retries times when a
    process dies: the exit code of the last attempt, and its spec."""
    resume, prepared = find_resume(raw, cfg, prepared, console)
    run_dir = prepared.run_dir
    hold_run_dir(run_dir, f"resume={cfg.resume}: its run directory {run_dir}")  # held already unless resume=PATH
    for attempt in range(cfg.recover.retries + 1):
        if resume is not None:
            console.print(f"resuming from {resume} (step {store.read_manifest(resume)['step']})", highlight=False)
            store.rewind(run_dir, resume)
        code, spec = launch_once(raw, cfg, placement, prepared, console, resume)
        if code != 1 or attempt == cfg.recover.retries:
            break
        console.print(f"recover: restart {attempt + 1} of {cfg.recover.retries} (recover.retries)", highlight=False)
        if (resume := store.latest(run_dir)) is None:
            console.print("recover: no checkpoint yet: the run starts again", highlight=False)
            store.rewind(run_dir, None)
    return code, spec
