"""The embedded engine's running sums over its compute, which /server_info reports and the
controller logs per step (`gen/*` in the step rows). Imports nothing heavy: the controller reads
the keys without loading torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class ComputeCounts:
    """Running sums over the engine's compute, from which a decode step's cost is fitted as
    a + b·n + e·k (n the rows it decodes, k the KV positions they read) and a prefill's as
    p0 + p·m (m the positions it computes) by least squares: the allocation advisor's generation
    costs (advise/fit.py). Decode steps and prefills run one at a time on the engine's thread, so
    their seconds add up to its busy time (a forward that mixes decode rows and prefill chunks is
    split between the two by its tokens). Over the paged cache k is the sum of the rows' contexts
    and m the tokens computed; over the left-padded cache of the `transformers` path, k is n × the
    batch's width and m the distinct sequences × the longest of them (padding costs as much as a
    token). The thread's time neither computing, nor loading weights, nor waiting for
    work (`waited`) is its loop's own, most of it handing answers back (`answered`): the advisor's
    answer_s."""

    decode_steps: int = 0
    decode_rows: int = 0  # Σ n: the rows each step sampled for
    decode_rows_sq: int = 0  # Σ n²
    decode_seconds: float = 0.0  # Σ t
    decode_row_seconds: float = 0.0  # Σ n·t
    decode_kv: int = 0  # Σ k: KV positions the rows attend over (left-padded: n × width)
    decode_kv_sq: int = 0  # Σ k²
    decode_rows_kv: int = 0  # Σ n·k
    decode_kv_seconds: float = 0.0  # Σ k·t
    prefills: int = 0  # prefill forwards (each admits one or more requests)
    prefill_tokens: int = 0  # distinct sequences' tokens computed (G answers of a prompt: once)
    prefill_positions: int = 0  # Σ m: positions computed (left-padded: distinct sequences × the longest)
    prefill_positions_sq: int = 0  # Σ m²
    prefill_seconds: float = 0.0  # Σ t
    prefill_position_seconds: float = 0.0  # Σ m·t
    cached_tokens: int = 0  # prompt tokens the prefix cache spared a prefill (paged cache; not in prefill_tokens)
    waited: float = 0.0  # seconds the thread waited for work (nothing queued or running, or paused)
    answered: int = 0  # requests answered (finished or aborted), each handed to the server's event loop

    def decoded(self, rows: int, kv: int, seconds: float) -> None:
        """One decode step that sampled for `rows` rows whose next forward reads `kv` KV positions."""
        self.decode_steps += 1
        self.decode_rows += rows
        self.decode_rows_sq += rows * rows
        self.decode_seconds += seconds
        self.decode_row_seconds += rows * seconds
        self.decode_kv += kv
        self.decode_kv_sq += kv * kv
        self.decode_rows_kv += rows * kv
        self.decode_kv_seconds += kv * seconds

    def prefilled(self, tokens: int, positions: int, seconds: float) -> None:
        """One prefill computing `tokens` tokens of distinct sequences in `positions` positions
        (with the padding of a left-padded batch; the paged cache has none)."""
        self.prefills += 1
        self.prefill_tokens += tokens
        self.prefill_positions += positions
        self.prefill_positions_sq += positions * positions
        self.prefill_seconds += seconds
        self.prefill_position_seconds += positions * seconds


COMPUTE_COUNTS = tuple(f.name for f in dataclasses.fields(ComputeCounts))
"""The keys of `ComputeCounts` in `stats()` and in the server's /server_info."""
