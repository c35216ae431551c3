"""Which checkpoint a resumed run continues from, and whether its configuration still fits it.

A resumed run may change how it runs (the number of steps, devices, processes, timeouts, where its
metrics go) but not what it computes: a changed key of the model, the graph's math, the algorithm,
the training data or the seed would make the resumed run a different run, so it is refused by name.
A changed parallel layout is not refused here: the torch engine reshards its full-state checkpoint
onto any layout, and the megatron engine refuses another layout when it loads (its optimizer state
is per rank), but for another data-parallel size without tp, pp or the distributed optimizer. A node moved from the trainer mesh onto a mesh of its own is: the scored groups the
checkpoint holds were waiting for a trainer rank to compute its key, and no inference process ever
gets them.
"""

from __future__ import annotations

import dataclasses
import os

from omegaconf import DictConfig, OmegaConf

from areal_flow.checkpoint import store
from areal_flow.config.schema import node_config
from areal_flow.graph.mesh import parse_mesh
from areal_flow.runtime import run_dir as rd

SAME = ("seed", "model", "dataset", "graph", "algorithm", "training.dtype")
"""Config keys (and everything under them) that a resumed run keeps: they change the math."""

MAY_CHANGE = ("dataset.eval_path", "dataset.eval_split", "dataset.n_eval")
"""... except these, which only change what the held-out evaluation reads."""

LAYOUT = ("mesh", "parallel", "engine", "micro_batch_tokens", "row_tokens", "workers", "timeout")
"""Graph node keys that change where and how a node runs, not what it computes."""


class ResumeError(ValueError):
    """A resume that cannot go on; the message names the checkpoint, the key or what is missing."""


def _flat(node, prefix: str = "") -> dict[str, object]:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out or {prefix: {}}
    return {prefix: node}


def _kept(key: str) -> bool:
    if key in MAY_CHANGE:
        return False
    parts = key.split(".")
    if parts[0] == "graph" and len(parts) >= 3 and parts[2] in LAYOUT:
        return False
    return any(key == k or key.startswith(k + ".") for k in SAME)


def changed_keys(saved: dict, now: dict) -> list[str]:
    """The keys of the math that differ between the checkpoint's config and this run's, as
    'key: saved -> now'."""
    a, b = _flat(saved), _flat(now)
    out = []
    for key in sorted(set(a) | set(b)):
        if _kept(key) and a.get(key, "<absent>") != b.get(key, "<absent>"):
            out.append(f"{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}")
    return out


def lr_schedule_changed(saved: dict, now: dict) -> str | None:
    """A longer or shorter run changes a decaying LR schedule whose length is the run's (the
    schedule counts total_steps when algorithm.lr_decay_steps is null)."""
    algo = now.get("algorithm", {})
    if saved.get("total_steps") != now.get("total_steps") and algo.get("lr_schedule") != "constant" \
            and algo.get("lr_decay_steps") is None:
        return (f"total_steps: {saved.get('total_steps')} -> {now.get('total_steps')} changes the {algo.get('lr_schedule')} "
                "LR schedule, which decays over the run's length: set algorithm.lr_decay_steps to resume with "
                "another length")
    return None


def with_typed_graph(conf: dict) -> dict:
    """`conf` with each graph node given its kind's defaults (config/nodes.py): the config holds nodes as written,
    so a key written out at its default and one left out are the same node."""
    graph = {name: dataclasses.asdict(node_config(name, node)) for name, node in (conf.get("graph") or {}).items()
             if node is not None}
    return {**conf, "graph": graph}


def own_mesh(conf: dict) -> set[str]:
    """The inference nodes of a typed config's graph that run on a mesh of their own: not the
    actor's train node's (the graph has checked that only a frozen role's may)."""
    graph = conf.get("graph", {})
    train = next((n for n in graph.values() if n["type"] == "train" and n["role"] == "actor"), None)
    if train is None or train["mesh"] is None:
        return set()
    trainer = parse_mesh(train["mesh"], "")[0]
    return {name for name, n in graph.items()
            if n["type"] == "inference" and n["mesh"] is not None and parse_mesh(n["mesh"], "")[0] != trainer}


def moved_off_trainer(saved: dict, now: dict) -> list[str]:
    """Nodes the checkpoint's run ran on its trainer ranks and this run runs on a mesh of their own."""
    return sorted(n for n in own_mesh(now) - own_mesh(saved) if n in saved.get("graph", {}))


def check(checkpoint: str, cfg: DictConfig) -> None:
    """Raise ResumeError naming every key of the math that this run changes from `checkpoint`'s, or
    a node it moves off the trainer mesh."""
    saved = with_typed_graph(OmegaConf.to_container(OmegaConf.load(os.path.join(checkpoint, rd.CONFIG)), resolve=True))
    now = with_typed_graph(OmegaConf.to_container(cfg, resolve=True))
    problems = changed_keys(saved, now)
    if (why := lr_schedule_changed(saved, now)) is not None:
        problems.append(why)
    if problems:
        raise ResumeError(f"resume from {checkpoint}: this run changes what the checkpoint's run computes:\n  "
                          + "\n  ".join(problems) + "\n(start a new run to change them)")
    for name in moved_off_trainer(saved, now):
        node = now["graph"][name]
        raise ResumeError(f"resume from {checkpoint}: node '{name}' ran on the trainer ranks (graph.{name}.mesh="
                          f"{saved['graph'][name]['mesh']!r}) and this run puts it on a mesh of its own "
                          f"({node['mesh']!r}): the scored groups the checkpoint holds have no "
                          f"{', '.join(node['outputs'])} yet, which only the trainer ranks would have computed; "
                          f"resume with graph.{name}.mesh={saved['graph'][name]['mesh']!r}, or start a new run")


def find(resume: str, run_dir: str) -> tuple[str | None, str]:
    """(the checkpoint to continue from, or None for a new run; the run directory). `resume`: 'auto'
    (the latest complete checkpoint of `run_dir`, if any) or a checkpoint's path (its run's
    directory is the run directory)."""
    if resume == "auto":
        return store.latest(run_dir), run_dir
    path = os.path.abspath(resume)
    if not os.path.isdir(path):
        raise ResumeError(f"resume={resume}: no such checkpoint directory")
    if (why := store.problem(path)) is not None:
        raise ResumeError(f"resume={resume}: not a complete checkpoint: {why}")
    parent = os.path.dirname(path)
    if os.path.basename(parent) != store.CHECKPOINTS:
        raise ResumeError(f"resume={resume}: a checkpoint lies in a run directory's {store.CHECKPOINTS}/ folder")
    return path, os.path.dirname(parent)
