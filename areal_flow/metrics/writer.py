"""One JSON object per line in `metrics.jsonl`; the launcher tails it for the progress display."""

from __future__ import annotations

import json
import os
import time
from typing import Any


class MetricsWriter:
    def __init__(self, path: str, use_wandb: bool = False, wandb_project: str = "", run_name: str = "", config: dict | None = None):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._file = open(path, "a", buffering=1)
        self._wandb = None
        if use_wandb:
            import wandb  # imported only when asked for: it costs ~0.6 s

            os.environ.setdefault("WANDB_MODE", "offline")
            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(project=wandb_project, name=run_name, config=config,
                                     dir=os.path.dirname(path) or ".")

    def log(self, event: str, **values: Any) -> None:
        row = {"event": event, "time": time.time(), **values}
        self._file.write(json.dumps(row) + "\n")
        if self._wandb is not None and event == "step":
            self._wandb.log({k: v for k, v in values.items() if isinstance(v, (int, float))}, step=values.get("step"))

    def tell(self) -> int:
        """The file's length in bytes, every row logged so far included."""
        self._file.flush()
        return self._file.tell()

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
