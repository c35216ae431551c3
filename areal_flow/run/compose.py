"""Compose: the typed config of what Hydra composed, with its `allocation` string applied."""

from __future__ import annotations

from omegaconf import DictConfig
from rich.console import Console

from areal_flow.config.schema import RunConfig
from areal_flow.config.validate import ConfigError
from areal_flow.graph.allocation import allocation_problems, apply_allocation, parse_allocation
from areal_flow.metrics.backends import hydra_wandb_group
from areal_flow.runtime.spec import typed


def with_allocation(raw: DictConfig, console: Console) -> None:
    """An `allocation` string places the generate and batch nodes: written into `raw` itself, so
    the run directory's config.yaml, which every process reads, is the placement that runs."""
    if not raw.get("allocation"):
        return
    alloc = parse_allocation(raw.allocation)
    # Before the graph is built: a mesh past the cluster's end would be reported there, less clearly.
    if problems := allocation_problems(alloc, n_nodes=raw.cluster.n_nodes, per_node=raw.cluster.n_devices):
        raise ConfigError(problems)
    console.print(f"allocation {alloc.text.strip()!r} sets " + ", ".join(apply_allocation(raw, alloc)),
                  highlight=False, markup=False)


def compose(raw: DictConfig, console: Console) -> RunConfig:
    """The run's typed config; `raw` gets the allocation's keys too (it is written to the run directory),
    and a Hydra multirun's wandb group (metrics.wandb.group null: the sweep directory's name)."""
    with_allocation(raw, console)
    raw.metrics.wandb.group = hydra_wandb_group(raw.metrics.wandb.group)
    return typed(raw)
