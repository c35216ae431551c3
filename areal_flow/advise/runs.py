"""One run directory as the advisor reads it: its settings (`config.yaml`, else the metrics' start
row), its step rows (`metrics.jsonl`) and, where it has one, its ledger (`ledger.jsonl`: each
group's answer lengths and control-path delays). fit.py fits costs from these."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from areal_flow.advise.costs import AdviseError
from areal_flow.graph.mesh import parse_mesh
from areal_flow.metrics.writer import read_metrics
from areal_flow.runtime import run_dir as rd

EMBEDDED_MAX_BATCH = 128
"""The embedded engine's max_batch_size when generation.max_batch_size is null (generation/engine/options.py)."""


@dataclass(frozen=True)
class RunFacts:
    """One run directory: its settings and its step rows (the first, which includes start-up, left out)."""

    path: str
    steps: list[dict]
    batch_size: int
    group_size: int
    max_new_tokens: int
    eta: int
    interrupt: bool
    max_concurrent: int | None
    gen_devices: int
    servers: int
    train_devices: int
    max_running: int | None
    join_group: int  # queued answers join a running batch only this many at once (the embedded engine's rule)
    ppo_epochs: int
    trainer_waits: bool  # weights by broadcast: the trainer sends them, so it waits for each update
    colocated: bool = False  # generation and training on the same devices, taking turns (docs/colocation.md)
    groups: tuple[tuple[int, ...], ...] = ()  # answer lengths of each group finished for training (ledger.jsonl)
    filtered_groups: tuple[tuple[int, ...], ...] = ()  # those of each group dynamic filtering dropped
    admit_s: tuple[float, ...] = ()  # per scored group: seconds from its admission to its request
    deliver_s: tuple[float, ...] = ()  # per scored group: seconds from its last answer to the controller

    @property
    def overlaps(self) -> bool:
        """Generation and training run at the same time (η > 0 on devices of their own); at η = 0,
        or colocated, they take turns."""
        return self.eta > 0 and not self.colocated


def _get(cfg: dict, dotted: str, default: Any = None) -> Any:
    node: Any = cfg
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


def read_run(path: str | Path) -> RunFacts:
    """The settings (config.yaml, else the metrics' start row) and step rows of one run directory."""
    path = Path(path)
    metrics_file = path / rd.METRICS
    if not metrics_file.is_file():
        raise AdviseError(f"--from-run: {str(path)!r} has no metrics.jsonl")
    try:
        rows = read_metrics(str(metrics_file))
    except ValueError as exc:
        raise AdviseError(f"--from-run: {str(metrics_file)!r} is not JSON lines: {exc}") from None
    start = next((r for r in rows if r.get("event") == "start"), {})
    steps = [r for r in rows if r.get("event") == "step"][1:]
    if len(steps) < 2:
        raise AdviseError(f"--from-run: {str(metrics_file)!r} has {len(steps) + 1 if steps else 0} step rows; "
                          "at least 3 are needed (the first includes start-up)")
    cfg: dict = {}
    if (path / rd.CONFIG).is_file():
        cfg = yaml.safe_load((path / rd.CONFIG).read_text()) or {}
    nodes = _get(cfg, "graph", {}) or {}
    judges = [name for name, n in nodes.items() if isinstance(n, dict) and n.get("role") == "judge"]
    if judges:  # its group's deliver time would hold the judge's answers, which the model does not cost
        raise AdviseError(f"advise: node '{judges[0]}' is a judge, whose time the model does not have "
                          f"(--from-run {str(path)!r})")
    gen_mesh = next((n.get("mesh") for n in nodes.values() if isinstance(n, dict) and n.get("type") == "generate"
                     and n.get("role") != "judge"), None)
    train_mesh = next((n.get("mesh") for n in nodes.values() if isinstance(n, dict) and n.get("type") == "train"), None)
    gen_placed = parse_mesh(gen_mesh, "generate")[0] if gen_mesh is not None else None
    train_placed = parse_mesh(train_mesh, "train")[0] if train_mesh is not None else None
    gen_devices = len(gen_placed or (0,)) if gen_mesh is not None else 1
    train_devices = len(train_placed or (0,)) if train_mesh is not None else 1
    tp = int(_get(cfg, "generation.tp_size", 1) or 1)
    backend = _get(cfg, "generation.backend", "embedded")
    max_batch = _get(cfg, "generation.max_batch_size")
    return RunFacts(
        path=str(path), steps=steps,
        batch_size=int(_get(cfg, "algorithm.batch_size", start.get("batch_size", 0)) or 0),
        group_size=int(_get(cfg, "algorithm.group_size", start.get("group_size", 0)) or 0),
        max_new_tokens=int(_get(cfg, "algorithm.max_new_tokens", 0) or 0),
        eta=int(_get(cfg, "rollout.max_staleness", start.get("max_staleness", 0)) or 0),
        interrupt=bool(_get(cfg, "rollout.interrupt", True)),
        max_concurrent=_get(cfg, "rollout.max_concurrent"),
        gen_devices=gen_devices, servers=max(1, gen_devices // tp), train_devices=train_devices,
        max_running=max_batch if max_batch is not None else (EMBEDDED_MAX_BATCH if backend == "embedded" else None),
        join_group=max(1, (max_batch or EMBEDDED_MAX_BATCH) // 8) if backend == "embedded" else 1,
        ppo_epochs=int(_get(cfg, "algorithm.ppo_epochs", 1) or 1),
        trainer_waits=_get(cfg, "rollout.weight_update_mode", "disk") in ("distributed", "ipc"),  # the trainer sends
        colocated=bool(gen_placed) and gen_placed == train_placed,  # Graph.colocated's rule
        **_read_ledger(path / rd.LEDGER),
    )


def _read_ledger(ledger: Path) -> dict[str, Any]:
    """From a run's ledger (runs since it records them; nothing from older runs): each finished and
    each filtered group's answer lengths, and per group the control path's two delays: admission to
    its request (`requested` − its `admit`), and its last answer to the controller (the event's
    time − `generated`)."""
    groups: dict[str, list[tuple[int, ...]]] = {"finish": [], "filter": []}
    admitted: dict[int, float] = {}
    admit_s, deliver_s = [], []
    if ledger.is_file():
        with open(ledger, "rb") as f:
            for line in f:
                if b'"lengths"' not in line and b'"admit"' not in line:  # steps and updates: skipped unparsed
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    raise AdviseError(f"--from-run: {str(ledger)!r} has a line that is not JSON: {line[:80]!r}") from None
                kind = event.get("event")
                if kind == "admit":
                    admitted[event["group"]] = event["time"]
                elif kind in groups:
                    groups[kind].append(tuple(int(n) for n in event["lengths"]))
                    if "requested" in event and event.get("group") in admitted:
                        admit_s.append(event["requested"] - admitted[event["group"]])
                        deliver_s.append(event["time"] - event["generated"])
    return {"groups": tuple(groups["finish"]), "filtered_groups": tuple(groups["filter"]),
            "admit_s": tuple(admit_s), "deliver_s": tuple(deliver_s)}
