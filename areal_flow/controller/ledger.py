"""`ledger.jsonl`: one line per admission, finish, drop and train of a prompt group, so that every
admitted group can be shown trained exactly once or accounted for."""

from __future__ import annotations

import json
import time


class Ledger:
    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)

    def write(self, event: str, **fields) -> None:
        self._file.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")

    def close(self) -> None:
        self._file.close()
