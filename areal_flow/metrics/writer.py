"""The run's metrics: every row to metrics.jsonl (the launcher tails it for the progress display)
and to the other backends metrics.backends lists (TensorBoard, wandb: backends.py, whose docstring
says how each kind of value is logged)."""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Any

from areal_flow.metrics.backends import Backend, JsonlBackend, make_backends

if TYPE_CHECKING:
    from areal_flow.config.schema import MetricsConfig

log = logging.getLogger(__name__)


class MetricsWriter:
    """Fans each row out to metrics.jsonl (`path`, always) and the backends `metrics.backends` lists;
    their files go in `path`'s folder, the run directory. `run_name` (e.g. the recipe) starts wandb's
    default run name, `config` (a plain dict) is the wandb run's config. A backend other than jsonl
    never stops the run: its first error is logged, and rows go on to the others."""

    def __init__(self, path: str, metrics: MetricsConfig | None = None, *, run_name: str = "",
                 config: dict | None = None):
        run_dir = os.path.dirname(path) or "."
        wants = list(getattr(metrics, "backends", None) or [])
        # A resumed run appends to its metrics.jsonl, cut back to its checkpoint: TensorBoard drops
        # its events from the step after the last one kept.
        purge = last_step(path) + 1 if "tensorboard" in wants and os.path.exists(path) else None
        self._jsonl = JsonlBackend(path)
        self._backends: list[Backend] = make_backends(metrics, run_dir, run_name, config, purge_step=purge)
        self._failed: set[int] = set()

    def log(self, event: str, **values: Any) -> None:
        step = values.get("step")
        self._jsonl.log(event, step, values)
        for i, backend in enumerate(self._backends):
            try:
                backend.log(event, step, values)
            except Exception:
                if i not in self._failed:
                    self._failed.add(i)
                    log.exception("metrics backend %s failed on a %r row (later errors not shown)",
                                  type(backend).__name__, event)

    def tell(self) -> int:
        """The file's length in bytes, every row logged so far included."""
        return self._jsonl.tell()

    def close(self) -> None:
        self._jsonl.close()
        for backend in self._backends:
            try:
                backend.close()
            except Exception:
                log.exception("metrics backend %s failed to close", type(backend).__name__)


def last_step(path: str) -> int:
    """The largest `step` of metrics.jsonl's rows (-1 when none; a line cut short is passed over)."""
    best = -1
    with open(path) as f:
        for line in f:
            try:
                step = json.loads(line).get("step")
            except (ValueError, AttributeError):
                continue
            if isinstance(step, int):
                best = max(best, step)
    return best


def read_metrics(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
