"""Decode steps replayed as CUDA graphs, one per (rows, context width) bucket.

A decode step of a small model launches a few hundred kernels, each a few microseconds of work:
on a GPU the launches, not the math, set its time. A CUDA graph launches them all at once. A graph
replays fixed shapes, so a step is padded up to its bucket: rows to the next of `ROW_BUCKETS`
(padded rows feed token 0 at position 0, write into the null block 0 and attend to its slot 0),
the context to the next of four widths per power of two of blocks (padded columns point at slot 0,
masked: at most a quarter more columns are read). Graphs are
captured lazily, the first time a bucket is met, into one memory pool.

Only pure decode steps are captured: a forward with prefill chunks (their shapes vary with the
prompts) or a batch-invariant one (its attention loops over the rows' runs) runs eagerly, as does
everything off CUDA. `GraphRunner(capture=False)` pads exactly as a graph would but runs eagerly:
the CPU tests check the padding with it.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import torch

from areal_flow.generation.engine.decode import DecodeStep, Forward
from areal_flow.generation.engine.paged import BlockPool

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)
"""Decode batch sizes a graph is captured for (SGLang's --cuda-graph-bs are alike)."""


@dataclass
class _Static:
    """A bucket's input buffers, its output, and its graph (None: eager)."""

    width: int  # the bucket's context columns
    block_size: int
    tokens: torch.Tensor
    positions: torch.Tensor
    write: torch.Tensor
    decode_table: torch.Tensor
    decode_lengths: torch.Tensor
    logits_at: torch.Tensor  # kept here: a graph reads its inputs' memory, which must outlive the capture
    logits: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


class GraphRunner:
    """`forward(step, pool)` as `DecodeStep.forward`, through a captured graph where it can be."""

    def __init__(self, model: DecodeStep, *, max_rows: int, capture: bool) -> None:
        self.model, self.capture = model, capture
        self.row_buckets = [b for b in ROW_BUCKETS if b < max_rows] + [max_rows]
        self._static: dict[tuple[int, int], _Static] = {}
        self._storage: int | None = None  # the cache tensors the graphs were captured over (BlockPool.storage)
        self._lowrank = model.lowrank  # the LoRA paths they were captured with
        self._memory = None  # the graphs' shared memory pool
        self.bucketed = 0  # decode steps padded to a bucket (replayed, or eager without capture)
        self.replays = 0
        # Graphs captured, and the seconds their steps took (the eager run, the warm-up and the
        # capture): a benchmark that meets new buckets mid-run pays these in its decode steps.
        self.captures = 0
        self.capture_seconds = 0.0

    def eligible(self, step: Forward) -> bool:
        return not step.chunks and step.spans is None and 0 < step.decode <= self.row_buckets[-1]

    def forward(self, step: Forward, pool: BlockPool) -> torch.Tensor:
        if not self.eligible(step):
            return self.model.forward(step, pool)
        # The cache was reallocated (grown, or freed and taken again), or LoRA paths of new shapes
        # were installed (generation/engine/lowrank.py; adapters of the same shapes are copied in place).
        if self._storage != pool.storage or self._lowrank is not self.model.lowrank:
            self._static.clear()
            # A fresh pool too: the dropped graphs took their pool's last use, and capturing into a
            # pool whose graphs are all gone fails an assertion in torch's caching allocator.
            self._memory = None
            self._storage, self._lowrank = pool.storage, self.model.lowrank
        self.bucketed += 1
        rows = step.decode
        bucket = (self.row_buckets[bisect.bisect_left(self.row_buckets, rows)],
                  _width_bucket(step.decode_width, pool.block_size))
        static = self._static.get(bucket)
        if static is None:
            static = self._static[bucket] = self._buffers(*bucket, pool)
        # The padded rows are reset too: a smaller step after a larger one must not leave a row
        # writing into another row's slot.
        for buffer, values in ((static.tokens, step.tokens), (static.positions, step.positions),
                               (static.write, step.write)):
            buffer[:rows] = values
            buffer[rows:] = 0
        static.decode_table.zero_()
        static.decode_table[:rows, : step.decode_table.shape[1]] = step.decode_table
        static.decode_lengths.fill_(1)  # a padded row attends to slot 0 alone: a finite softmax, never NaN
        static.decode_lengths[:rows] = step.decode_lengths
        if static.graph is None:
            started = time.perf_counter()
            logits = self.model.forward(self._step(static), pool)
            if self.capture:
                static.graph, static.logits = self._capture(static, pool)
                logits = static.logits
                self.captures += 1
                torch.cuda.synchronize(pool.device)  # the capture's own time, not the steps' after it
                self.capture_seconds += time.perf_counter() - started
        else:
            static.graph.replay()
            self.replays += 1
            logits = static.logits
        return logits[:rows]

    def _buffers(self, rows: int, width: int, pool: BlockPool) -> _Static:
        device = pool.device
        return _Static(
            width=width, block_size=pool.block_size,
            tokens=torch.zeros(rows, dtype=torch.int64, device=device),
            positions=torch.zeros(rows, dtype=torch.int64, device=device),
            write=torch.zeros(rows, dtype=torch.int64, device=device),
            decode_table=torch.zeros(rows, width // pool.block_size, dtype=torch.int64, device=device),
            decode_lengths=torch.ones(rows, dtype=torch.int64, device=device),
            logits_at=torch.arange(rows, device=device),
        )

    @staticmethod
    def _step(static: _Static) -> Forward:
        rows = static.tokens.shape[0]
        return Forward(tokens=static.tokens, positions=static.positions, write=static.write, decode=rows,
                       decode_table=static.decode_table, decode_lengths=static.decode_lengths, decode_width=static.width,
                       block_size=static.block_size, spans=None, chunks=[],
                       logits_at=static.logits_at)

    def _capture(self, static: _Static, pool: BlockPool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the bucket's forward (its inputs already in the buffers: the eager run before
        was its warm-up, on the same inputs, so capturing rewrites the same keys and values)."""
        step = self._step(static)
        side = torch.cuda.Stream(pool.device)  # warm-up off the capture, as torch.cuda.graph asks
        side.wait_stream(torch.cuda.current_stream(pool.device))
        with torch.cuda.stream(side):
            self.model.forward(step, pool)
        torch.cuda.current_stream(pool.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._memory is None:
            self._memory = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._memory):
            logits = self.model.forward(step, pool)
        graph.replay()
        return graph, logits


def _width_bucket(width: int, block_size: int) -> int:
    """The context width a graph is captured for: the blocks rounded up to four steps per power of
    two (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, ...): at most a quarter more columns read."""
    blocks = max(1, -(-width // block_size))
    step = 1 << max(0, (blocks - 1).bit_length() - 3)
    return block_size * -(-blocks // step) * step
