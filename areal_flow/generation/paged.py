"""The paged KV cache: fixed-size blocks shared by every request, a block table per request.

A request's keys and values live in blocks of `block_size` token slots, anywhere in one pool per
layer; its block table lists them in order, so token position p sits in slot
`table[p // block_size] * block_size + p % block_size`. Nothing is left-padded and nothing is
copied when requests join or leave: a finished request hands its blocks back.

Blocks are reference-counted. The G answers of one prompt share the prompt's full blocks (one
prefill for the group); each gets its own copy of the last, partly filled block, the only one it
writes (copy-on-write at the fork, which is one block per answer).

Block 0 is never handed out: padded rows of a fixed-shape step (CUDA graphs) write there, and
padded columns of a block table point there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than asked for (the engine retracts a request and retries)."""


class BlockPool:
    """Keys and values of every layer in `num_blocks` blocks of `block_size` slots.

    `k[layer]`/`v[layer]` are [kv_heads, num_blocks * block_size, head_dim] (heads first: a gather
    of the rows' contexts is then contiguous per head, as the attention's batched matmuls want). `num_blocks=None`:
    the pool grows (doubling, copying the filled blocks) when it runs out, for a CPU engine with no
    KV budget; with a number it is fixed, and `allocate` raises OutOfBlocks beyond it."""

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, block_size: int, num_blocks: int | None,
                 dtype: torch.dtype, device: torch.device) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size, self.growable = block_size, num_blocks is None
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self._layers, self.dtype, self.device = layers, dtype, device
        blocks = 64 if num_blocks is None else num_blocks + 1  # + the null block 0
        self.k = [self._empty(blocks) for _ in range(layers)]
        self.v = [self._empty(blocks) for _ in range(layers)]
        self.refs = [0] * blocks
        self._free = list(range(blocks - 1, 0, -1))  # a stack: the lowest ids first
        self.storage = 0  # counts the (re)allocations of k and v: what captured CUDA graphs were built over

    def reset(self) -> None:
        """Every block free again (the engine dropped all its rows)."""
        self.refs = [0] * len(self.refs)
        self._free = list(range(len(self.refs) - 1, 0, -1))

    def free_memory(self) -> None:
        """Give the cache's memory back (a colocated trainer's turn); `ensure` takes it again."""
        self.reset()
        self.k, self.v = [], []

    def ensure(self) -> None:
        """Allocate the cache again after `free_memory`."""
        if not self.k:
            self.k = [self._empty(len(self.refs)) for _ in range(self._layers)]
            self.v = [self._empty(len(self.refs)) for _ in range(self._layers)]
            self.storage += 1

    def _empty(self, blocks: int) -> torch.Tensor:
        # Zeros, not garbage: a padded column's score is masked to -inf after it is computed, and
        # garbage may be inf or nan, which a mask does not clear.
        return torch.zeros(self.kv_heads, blocks * self.block_size, self.head_dim, dtype=self.dtype,
                           device=self.device)

    @property
    def num_blocks(self) -> int:
        """Blocks that requests can hold (the null block excluded)."""
        return len(self.refs) - 1

    @property
    def free_blocks(self) -> int:
        return len(self._free) if not self.growable else math.inf  # type: ignore[return-value]

    @property
    def used_blocks(self) -> int:
        return len(self.refs) - 1 - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks, each referenced once."""
        if n > len(self._free):
            if not self.growable:
                raise OutOfBlocks(f"{n} KV blocks asked for, {len(self._free)} free of {self.num_blocks}")
            self._grow(len(self.refs) - len(self._free) + n)
        blocks = [self._free.pop() for _ in range(n)]
        for block in blocks:
            self.refs[block] = 1
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            self.refs[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; blocks nobody holds any more are free again."""
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self._free.append(block)

    def fork(self, blocks: Sequence[int], tokens: int) -> list[int]:
        """A block table for a copy of a sequence of `tokens` tokens held in `blocks`: its full
        blocks shared, its last block copied if partly filled (the one the copy writes next)."""
        full = tokens // self.block_size
        shared = list(blocks[:full])
        self.share(shared)
        if full == len(blocks):
            return shared
        (copy,) = self.allocate(1)
        src, dst = self.slots_of(blocks[full]), self.slots_of(copy)
        for k, v in zip(self.k, self.v):
            k[:, dst] = k[:, src]
            v[:, dst] = v[:, src]
        return shared + [copy]

    def slots_of(self, block: int) -> slice:
        return slice(block * self.block_size, (block + 1) * self.block_size)

    def _grow(self, needed: int) -> None:
        blocks = max(2 * len(self.refs), needed + 1)
        for cache in (self.k, self.v):
            for i, old in enumerate(cache):
                grown = self._empty(blocks)
                grown[:, : old.shape[1]] = old
                cache[i] = grown
        self._free = list(range(blocks - 1, len(self.refs) - 1, -1)) + self._free
        self.refs += [0] * (blocks - len(self.refs))
        self.storage += 1


def block_table(tables: Sequence[Sequence[int]], device: torch.device, width: int | None = None) -> torch.Tensor:
    """The rows' block tables as one int64 tensor [rows, width] (padded with the null block 0)."""
    width = max(map(len, tables), default=0) if width is None else width
    flat = [block for t in tables for block in (*t, *[0] * (width - len(t)))]
    return torch.tensor(flat, dtype=torch.int64).view(len(tables), width).to(device)


def slots(table: torch.Tensor, columns: int, block_size: int) -> torch.Tensor:
    """The slot of each of the first `columns` positions of every row of a block table [rows, blocks]:
    [rows, columns] int64."""
    position = torch.arange(columns, device=table.device)
    return table[:, position // block_size] * block_size + position % block_size
