"""Where metric rows go: one class per backend of `metrics.backends`, each with `log(event, step,
values)` and `close()`; `MetricsWriter` (writer.py) fans every row out to them.

- jsonl: metrics.jsonl, one JSON object per row, as given (`{"event", "time", **values}`). Always
  written: the progress display, the plots, `status` and resume read it.
- tensorboard: event files under run_dir/tensorboard, through `torch.utils.tensorboard`.
- wandb: `wandb.init(mode=metrics.wandb.mode, ...)`, offline files under run_dir/wandb by default.

A backend that is not listed is not imported: tensorboard and wandb are imported in their
backend's constructor.

Conventions for the values of a row (what `MetricsWriter.log(event, **values)` is given):

- A number (int, float, bool) is a scalar. `None` is skipped.
- A dict is flattened, its keys joined with "/": `answer_versions={"3": 10}` is the scalar
  `answer_versions/3`; its items follow these same rules.
- A list of numbers whose key ends in `_hist` is a histogram of counts: item i counts bin i. The
  bins are the integers 0..n-1 (edges i - 0.5 .. i + 0.5, e.g. staleness in versions) unless the row
  also has `<key>_edges` (e.g. `staleness_hist_edges`), a list of n + 1 increasing bin edges; that
  edges list is not logged as a metric itself. Any other list of numbers is skipped.
- A list of dicts is a table of examples, one row each (e.g. `samples` in an eval row: prompt,
  answer, reference, score; the columns are the keys in order of first appearance): TensorBoard
  text (a markdown table), a `wandb.Table`.
- A string is skipped by both in a row that has a step (`when`, `path`); see step-less rows below.

Steps and names:

- "step" rows: their values under their own keys (`reward`, `train/loss`), at the row's `step`.
- Any other event with a `step` ("eval", "eval_skipped", "checkpoint", "resume"): its values under
  `<event>/<key>` (`eval/accuracy`, `eval/version`), at the row's `step`.
- Rows without a step ("start", "summary"): TensorBoard writes them as one text, `<event>`, a
  markdown table of key and value, at the last step it logged; wandb puts their numbers and strings
  into the run's summary as `<event>/<key>`.

wandb: every row is its own history row (wandb's own `_step` counts rows), and each metric is
defined against its row's step: a "step" row's metrics against `step`, an eval row's against
`eval/step` (`wandb.define_metric(key, step_metric=...)`). So an evaluation beside training that ends
after later steps were logged is still plotted at its own version: wandb's `log(step=...)` drops rows
whose step goes back. TensorBoard takes any step in any order.
"""

from __future__ import annotations

import json
import logging
import numbers
import os
import time
from dataclasses import dataclass, field
from typing import Any

from areal_flow.runtime import run_dir as rd

log = logging.getLogger(__name__)

HIST_SUFFIX = "_hist"
EDGES_SUFFIX = "_edges"


# ---- the conventions -----------------------------------------------------------------------------

def is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real)  # int, float, bool and NumPy's scalars


def scalar(value: numbers.Real) -> int | float:
    """A Python int (bools and integers) or float."""
    return int(value) if isinstance(value, numbers.Integral) else float(value)


@dataclass
class Row:
    """A row's values sorted by kind, keys flattened (`prefix` + key)."""

    scalars: dict[str, int | float] = field(default_factory=dict)  # bools as ints
    histograms: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)  # counts, edges
    tables: dict[str, tuple[list[str], list[list]]] = field(default_factory=dict)  # columns, rows
    strings: dict[str, str] = field(default_factory=dict)


def flatten(values: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dicts' keys joined with "/"."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def hist_edges(counts: list, edges: Any) -> list[float] | None:
    """The bin edges of a `_hist` list: `edges` when given (n + 1 increasing numbers), else the
    integer bins 0..n-1 (i - 0.5 .. i + 0.5); None when `edges` does not fit `counts`."""
    if edges is None:
        return [i - 0.5 for i in range(len(counts) + 1)]
    if (not isinstance(edges, (list, tuple)) or len(edges) != len(counts) + 1 or not all(map(is_number, edges))
            or any(b <= a for a, b in zip(edges, edges[1:]))):
        return None
    return [float(e) for e in edges]


def table(rows: list[dict]) -> tuple[list[str], list[list]]:
    """Columns (the keys, in order of first appearance) and rows of a list of dicts."""
    columns: list[str] = []
    for row in rows:
        columns += [str(k) for k in row if str(k) not in columns]
    return columns, [[cell(row.get(c)) for c in columns] for row in rows]


def cell(value: Any) -> Any:
    if value is None or isinstance(value, str) or is_number(value):
        return value
    return json.dumps(value, default=str)


def split_row(values: dict, prefix: str = "", skip: tuple[str, ...] = ("step",)) -> Row:
    """A row's values by kind, under `prefix` + key, by the conventions above; keys in `skip` (at
    the top level) are left out."""
    flat = flatten({k: v for k, v in values.items() if k not in skip})
    out = Row()
    for key, value in flat.items():
        name = prefix + key
        if value is None:
            continue
        if is_number(value):
            out.scalars[name] = scalar(value)
        elif isinstance(value, str):
            out.strings[name] = value
        elif isinstance(value, (list, tuple)) and value:
            if key.endswith(HIST_SUFFIX) and all(map(is_number, value)):
                edges = hist_edges(value, flat.get(key + EDGES_SUFFIX))
                if edges is None:
                    log.warning("metric %s: %s is not %d increasing bin edges: histogram skipped", name,
                                key + EDGES_SUFFIX, len(value) + 1)
                    continue
                out.histograms[name] = ([float(c) for c in value], edges)
            elif all(isinstance(v, dict) for v in value):
                out.tables[name] = table(list(value))
    return out


def hist_stats(counts: list[float], edges: list[float]) -> dict[str, Any]:
    """TensorBoard's raw histogram of counts and edges: min and max are the outer edges of the
    non-empty bins, sum and sum_squares are over the bin centres."""
    centres = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
    full = [i for i, c in enumerate(counts) if c]
    lo, hi = (edges[full[0]], edges[full[-1] + 1]) if full else (edges[0], edges[-1])
    return dict(min=lo, max=hi, num=sum(counts), sum=sum(c * x for c, x in zip(counts, centres)),
                sum_squares=sum(c * x * x for c, x in zip(counts, centres)), bucket_limits=edges[1:],
                bucket_counts=counts)


def markdown_table(columns: list[str], rows: list[list]) -> str:
    def esc(value: Any) -> str:
        text = "" if value is None else str(value)
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "<br>")

    lines = ["| " + " | ".join(map(esc, columns)) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(map(esc, row)) + " |" for row in rows])


def prefix_of(event: str) -> str:
    return "" if event == "step" else f"{event}/"


# ---- the backends --------------------------------------------------------------------------------

class Backend:
    """Where metric rows go. `values` is the row as logged, `step` its `step` (None without one)."""

    def log(self, event: str, step: int | None, values: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class JsonlBackend(Backend):
    """metrics.jsonl: one JSON object per row, line-buffered."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.file = open(path, "a", buffering=1)

    def log(self, event: str, step: int | None, values: dict[str, Any]) -> None:
        self.file.write(json.dumps({"event": event, "time": time.time(), **values}) + "\n")

    def tell(self) -> int:
        self.file.flush()
        return self.file.tell()

    def close(self) -> None:
        self.file.close()


class TensorBoardBackend(Backend):
    """Event files under `run_dir/tensorboard` (`tensorboard --logdir <run_dir or above>`)."""

    def __init__(self, run_dir: str, purge_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch is there: tensorboard is the optional part
            raise ImportError("metrics.backends has tensorboard: pip install tensorboard (or -e '.[tensorboard]')") from e
        self.dir = os.path.join(run_dir, rd.TENSORBOARD)
        # purge_step: a resumed run's events from the rewound steps on are dropped when read.
        self.writer = SummaryWriter(self.dir, purge_step=purge_step, flush_secs=10)
        self.last_step = 0

    def log(self, event: str, step: int | None, values: dict[str, Any]) -> None:
        if step is None:
            row = split_row(values, skip=())
            items = {**row.scalars, **row.strings}
            if items:
                self.writer.add_text(event, markdown_table(["key", "value"], [[k, v] for k, v in items.items()]),
                                     self.last_step)
            return
        if event == "step":
            self.last_step = max(self.last_step, step)
        row = split_row(values, prefix_of(event))
        for tag, value in row.scalars.items():
            self.writer.add_scalar(tag, value, step)
        for tag, (counts, edges) in row.histograms.items():
            self.writer.add_histogram_raw(tag, global_step=step, **hist_stats(counts, edges))
        for tag, (columns, rows) in row.tables.items():
            self.writer.add_text(tag, markdown_table(columns, rows), step)

    def close(self) -> None:
        self.writer.close()


class WandbBackend(Backend):
    """A wandb run in `run_dir/wandb`: online, offline (`wandb sync` later) or disabled (nothing)."""

    def __init__(self, run_dir: str, cfg: Any = None, run_name: str = "", config: dict | None = None):
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb  # ~0.6 s: only when listed

        self.wandb = wandb
        mode = getattr(cfg, "mode", "offline")
        name = getattr(cfg, "name", None) or run_name_default(run_name, run_dir)
        self.run = wandb.init(mode=mode, project=getattr(cfg, "project", None) or "areal_flow",
                              entity=getattr(cfg, "entity", None), group=getattr(cfg, "group", None),
                              tags=list(getattr(cfg, "tags", None) or []) or None, name=name,
                              config=config, dir=run_dir)
        self.defined: set[str] = set()

    def define(self, keys, step_metric: str) -> None:
        if step_metric not in self.defined:
            self.run.define_metric(step_metric)
            self.defined.add(step_metric)
        for key in keys:
            if key not in self.defined:
                self.run.define_metric(key, step_metric=step_metric)
                self.defined.add(key)

    def log(self, event: str, step: int | None, values: dict[str, Any]) -> None:
        prefix = prefix_of(event)
        if step is None:
            row = split_row(values, f"{event}/", skip=())
            if items := {**row.scalars, **row.strings}:
                self.run.summary.update(items)
            return
        row = split_row(values, prefix)
        data: dict[str, Any] = dict(row.scalars)
        for key, (counts, edges) in row.histograms.items():
            data[key] = self.wandb.Histogram(np_histogram=(counts, edges))
        for key, (columns, rows) in row.tables.items():
            data[key] = self.wandb.Table(columns=columns, data=rows)
        if not data:
            return
        step_key = f"{prefix}step"
        self.define(data, step_key)
        self.run.log({step_key: step, **data})

    def close(self) -> None:
        self.run.finish()
        # finish() returns before wandb's service has written the offline run file out; teardown
        # waits for it (the controller exits next, and its process group with it).
        self.wandb.teardown()


def run_name_default(run_name: str, run_dir: str) -> str:
    """`<run_name>/<run directory's name>` (e.g. tiny_arith/2025-01-01_12-00-00, or a multirun
    job's override directory), or the directory's name alone."""
    base = os.path.basename(os.path.normpath(os.path.abspath(run_dir)))
    return f"{run_name}/{base}" if run_name else base


def make_backends(metrics: Any, run_dir: str, run_name: str = "", config: dict | None = None,
                  purge_step: int | None = None) -> list[Backend]:
    """The backends `metrics.backends` lists besides jsonl (which MetricsWriter always writes)."""
    names = list(getattr(metrics, "backends", None) or ["jsonl"])
    unknown = [n for n in names if n not in ("jsonl", "tensorboard", "wandb")]
    if unknown:
        raise ValueError(f"metrics.backends: unknown {unknown}; choose from jsonl, tensorboard, wandb")
    out: list[Backend] = []
    if "tensorboard" in names:
        out.append(TensorBoardBackend(run_dir, purge_step=purge_step))
    if "wandb" in names:
        out.append(WandbBackend(run_dir, getattr(metrics, "wandb", None), run_name, config))
    return out


# ---- the wandb group of a Hydra multirun ---------------------------------------------------------

def multirun_group(group: str | None, multirun: bool, sweep_dir: str | None) -> str | None:
    """metrics.wandb.group as set, else, in a Hydra multirun, the sweep directory's name (one wandb
    group per multirun: every job of it the same); None for a single run."""
    if group or not multirun or not sweep_dir:
        return group
    return os.path.basename(os.path.normpath(str(sweep_dir))) or None


def hydra_wandb_group(group: str | None) -> str | None:
    """`multirun_group` of the running Hydra job (decided at launch: the controller runs in a process
    of its own, without Hydra); `group` as it is outside Hydra."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if group or not HydraConfig.initialized():
        return group
    hydra_cfg = HydraConfig.get()
    return multirun_group(group, hydra_cfg.mode == RunMode.MULTIRUN, hydra_cfg.sweep.dir)
