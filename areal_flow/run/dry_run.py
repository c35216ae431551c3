"""`dry_run=true`: what would run, printed, with nothing prepared, written or started."""

from __future__ import annotations

import os

from rich.console import Console

from areal_flow.config.schema import RunConfig
from areal_flow.generation.sglang_backend import shell_line
from areal_flow.graph.dag import Graph
from areal_flow.graph.placement import Placement
from areal_flow.launchers.commands import judge_command, server_command, server_host
from areal_flow.launchers.slurm import sbatch_script
from areal_flow.run.checks import check_model
from areal_flow.runtime.security import host_address, security_needed


def describe_servers(cfg: RunConfig, graph: Graph, placement: Placement) -> str:
    """The generation and judge servers' command lines, for a dry run (ports and the secret are made at start)."""
    model = os.path.abspath(cfg.model.path) if cfg.model.path else f"<the bootstrapped model in {cfg.cache_dir}/models>"
    judges = {n.name: os.path.abspath(n.model) if n.model else model for n in graph.judges}
    secured = security_needed(cfg)
    # On this host: its address; placed by a launcher on other nodes: each node's, known at start.
    here = cfg.launcher.type == "local" and cfg.cluster.n_nodes == 1
    api_key = "<the API key of the run>" if secured else None
    lines = [f"generation servers (generation.backend={cfg.generation.backend}):"]
    for proc in placement.of_role("gen_server") + placement.of_role("judge_server"):
        if proc.role == "judge_server" and proc.rank == 0:
            lines.append(f"judge servers of '{proc.graph_node}' (model {judges[proc.graph_node]}, never updated):")
        host = None if not secured else server_host(cfg, host_address() if here else f"<address of node {proc.node}>")
        argv, env = (judge_command(cfg, proc, judges[proc.graph_node], "<port>", host=host, api_key=api_key)
                     if proc.role == "judge_server" else server_command(cfg, proc, model, "<port>", host=host,
                                                                        api_key=api_key))
        lines.append(f"  {proc.name}: {shell_line(argv, env)}")
    return "\n".join(lines)


def dry_run(cfg: RunConfig, graph: Graph, placement: Placement, console: Console) -> int:
    """Print the graph, its placement, the servers' commands (and a Slurm run's job script); check
    the layouts against model.path when it is on this machine. Exit code 0."""
    if cfg.model.path and os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        check_model(graph, cfg.model.path, cfg.generation.tp_size, cfg.training.zero_mismatch)
    elif cfg.model.path:  # a cluster's model need not be on the machine that plans the run
        console.print(f"model.path={cfg.model.path} is not here: the layouts were not checked against it",
                      highlight=False, markup=False)
    console.print(graph.describe(), highlight=False, markup=False)
    console.print(placement.describe(cfg.cluster.device_type), highlight=False, markup=False)
    console.print(describe_servers(cfg, graph, placement), highlight=False, markup=False)
    if cfg.launcher.type == "slurm":
        run_dir = os.path.abspath(cfg.output_dir)
        console.print(f"sbatch script (RUN_DIR/job.sbatch, not submitted: dry_run=true):\n"
                      f"{sbatch_script(cfg, placement, run_dir)}", highlight=False, markup=False)
    return 0
