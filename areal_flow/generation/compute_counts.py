"""The embedded engine's running sums over its compute, which /server_info reports and the
controller logs per step (`gen/*` in the step rows). Imports nothing heavy: the controller reads
the keys without loading torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class ComputeCounts:
    """Running sums over the engine's compute, from which a decode step's cost is fitted as
    a + b·n (n the rows it decodes) by least squares, and a prefill's per token: the
    allocation advisor's generation costs (advise/fit.py). Decode steps and prefills run one at a
    time on the engine's thread, so their seconds add up to its busy time (with the cache copies
    of joins and compactions counted in the prefill and decode that cause them)."""

    decode_steps: int = 0
    decode_rows: int = 0  # Σ n: the rows each step sampled for
    decode_rows_sq: int = 0  # Σ n²
    decode_seconds: float = 0.0  # Σ t
    decode_row_seconds: float = 0.0  # Σ n·t
    prefills: int = 0  # prefill forwards (each admits one or more requests)
    prefill_tokens: int = 0  # distinct sequences' tokens computed (G answers of a prompt: once)
    prefill_seconds: float = 0.0

    def decoded(self, rows: int, seconds: float) -> None:
        self.decode_steps += 1
        self.decode_rows += rows
        self.decode_rows_sq += rows * rows
        self.decode_seconds += seconds
        self.decode_row_seconds += rows * seconds

    def prefilled(self, tokens: int, seconds: float) -> None:
        self.prefills += 1
        self.prefill_tokens += tokens
        self.prefill_seconds += seconds


COMPUTE_COUNTS = tuple(f.name for f in dataclasses.fields(ComputeCounts))
"""The keys of `ComputeCounts` in `stats()` and in the server's /server_info."""
