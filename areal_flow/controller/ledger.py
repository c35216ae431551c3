"""`ledger.jsonl`: one line per admission, finish, drop and train of a prompt group, so that every
admitted group can be shown trained exactly once or accounted for."""

from __future__ import annotations

import time

import msgspec


class Ledger:
    def __init__(self, path: str):
        # Buffered, and flushed once per step by the controller (and on close): a line-buffered
        # file costs a write system call per event, ~20 per step, on the controller's CPU.
        self._file = open(path, "ab")
        self._encoder = msgspec.json.Encoder()

    def write(self, event: str, **fields) -> None:
        self._file.write(self._encoder.encode({"event": event, "time": time.time(), **fields}) + b"\n")

    def flush(self) -> None:
        self._file.flush()

    def tell(self) -> int:
        """The ledger's length in bytes, written events included."""
        self._file.flush()
        return self._file.tell()

    def close(self) -> None:
        self._file.close()
