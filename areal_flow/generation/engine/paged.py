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

**The prefix cache** (SGLang's radix cache, as vLLM's automatic prefix caching keys it): a full
block whose keys and values are computed is named by a digest of its tokens chained to the digest
of the blocks before it, so a name stands for the whole prefix up to the block's end. When a request
ends its full blocks are registered under their names and, held by nobody, kept as *idle* instead
of freed. A new request takes the longest run of its sequence's blocks found there and prefills
only the rest: the later turns of a multi-turn rollout, a retracted request, the next samples of a
prompt. Idle blocks are handed out again when the free ones run out, least recently released
first (a request's deepest blocks before its first). A weight update flushes the cache: keys and
values belong to the weights that computed them.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than asked for (the engine retracts a request and retries)."""


class BlockPool:
    """Keys and values of every layer in `num_blocks` blocks of `block_size` slots.

    `k[layer]`/`v[layer]` are [kv_heads, num_blocks * block_size, head_dim] (heads first: a gather
    of the rows' contexts is then contiguous per head, as the attention's batched matmuls want). `num_blocks=None`:
    the pool grows (doubling, copying the filled blocks) when it runs out, for a CPU engine with no
    KV budget; with a number it is fixed, and `allocate` raises OutOfBlocks beyond it (idle cached
    blocks count as free). `prefix_cache`: keep the full blocks of ended requests for later ones
    (the module docstring); a growable pool grows rather than evict while its idle blocks are fewer
    than those in use, so the cache holds about as much as the running requests."""

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, block_size: int, num_blocks: int | None,
                 dtype: torch.dtype, device: torch.device, prefix_cache: bool = False) -> None:
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
        self.prefix_cache = prefix_cache
        self.epoch = 0  # counts flushes: a row admitted in an older epoch holds keys of older weights
        self._named: dict[bytes, int] = {}  # chained digest -> the block holding that prefix's last block
        self._names: dict[int, bytes] = {}  # the inverse, for the blocks in the cache
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest first

    def reset(self) -> None:
        """Every block free again (the engine dropped all its rows), the prefix cache flushed."""
        self.refs = [0] * len(self.refs)
        self._free = list(range(len(self.refs) - 1, 0, -1))
        self._forget()

    def flush(self) -> None:
        """Empty the prefix cache (new weights): idle blocks are free again, and the blocks running
        requests hold are freed as usual when they end, never registered (`register` checks the epoch)."""
        self._free += self._idle
        self._forget()

    def _forget(self) -> None:
        self._named, self._names, self._idle = {}, {}, OrderedDict()
        self.epoch += 1

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
        """Blocks `allocate` can hand out without growing: free ones and idle cached ones."""
        return len(self._free) + len(self._idle) if not self.growable else math.inf  # type: ignore[return-value]

    @property
    def used_blocks(self) -> int:
        """Blocks that running requests hold."""
        return len(self.refs) - 1 - len(self._free) - len(self._idle)

    @property
    def cached_blocks(self) -> int:
        """Blocks in the prefix cache (held or idle)."""
        return len(self._names)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks, each referenced once (idle cached blocks evicted when the free run out)."""
        while n > len(self._free) and self._idle and (not self.growable or len(self._idle) >= self.used_blocks):
            block, _ = self._idle.popitem(last=False)
            del self._named[self._names.pop(block)]
            self._free.append(block)
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
        """Drop one reference to each block; blocks nobody holds any more are free again, or idle
        if cached (the last blocks first in line for eviction)."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self._names:
                    self._idle[block] = None
                else:
                    self._free.append(block)

    def register(self, blocks: Sequence[int], tokens: Sequence[int], epoch: int) -> None:
        """Name the full blocks of a sequence whose first `len(tokens)` tokens' keys and values
        `blocks` hold, computed in `epoch` (nothing, if the cache was flushed since). A prefix the
        cache holds already in other blocks keeps those."""
        if not self.prefix_cache or epoch != self.epoch:
            return
        for block, name in zip(blocks, self._chain(tokens, len(tokens) // self.block_size)):
            if name not in self._named and block not in self._names:
                self._named[name], self._names[block] = block, name

    def match(self, tokens: Sequence[int], most: int) -> list[int]:
        """The cached blocks of the longest run of `tokens`' first full blocks, at most `most` of
        them, each now referenced by the caller."""
        blocks = []
        if self.prefix_cache and self._named:
            for name in self._chain(tokens, min(most, len(tokens) // self.block_size)):
                block = self._named.get(name)
                if block is None:
                    break
                self._idle.pop(block, None)
                self.refs[block] += 1
                blocks.append(block)
        return blocks

    def _chain(self, tokens: Sequence[int], blocks: int):
        """The chained digests of the first `blocks` full blocks of `tokens` (blake2b, 128 bits: a
        collision would hand a request another prefix's keys, so not Python's 64-bit hash)."""
        name, size = b"", self.block_size
        for i in range(blocks):
            name = hashlib.blake2b(name + array("q", tokens[i * size: (i + 1) * size]).tobytes(),
                                   digest_size=16).digest()
            yield name

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
