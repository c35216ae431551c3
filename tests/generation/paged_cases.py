"""Paged decode-attention cases and their plain-torch reference, for the kernels' tests
(test_triton_decode.py, test_cpu_decode.py)."""

from __future__ import annotations

import math

import torch

GARBAGE = 1e4  # in block 0 (padded table columns) and in the unused tail of each row's last block


def make_case(lengths: list[int], *, kv_heads: int, group: int, head_dim: int, block_size: int, seed: int,
              dtype: torch.dtype = torch.float32, device: str = "cpu", spare_columns: int = 2, spare_blocks: int = 3):
    """q, keys, values, table, lengths of rows with these context lengths: each row's blocks drawn out of
    order from the pool (block 0 never), table padded with block 0; block 0 and the slots past each
    row's length hold GARBAGE, which must not leak into the result."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in lengths]
    num_blocks = 1 + sum(needed) + spare_blocks
    heads = kv_heads * group
    q = torch.randn(len(lengths), heads, head_dim, generator=gen)
    keys = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen)
    values = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen)
    keys[:, :block_size] = values[:, :block_size] = GARBAGE
    table = torch.zeros(len(lengths), max(needed, default=0) + spare_columns, dtype=torch.int64)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    for r, (n, count) in enumerate(zip(lengths, needed)):
        blocks = [order.pop() for _ in range(count)]
        table[r, :count] = torch.tensor(blocks, dtype=torch.int64)
        for p in range(n, count * block_size):  # the rest of the last block
            slot = blocks[p // block_size] * block_size + p % block_size
            keys[:, slot] = values[:, slot] = -GARBAGE
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), keys.to(dtype=dtype, **to), values.to(dtype=dtype, **to), table.to(**to),
            torch.tensor(lengths, dtype=torch.int64, device=device))


def reference(q, keys, values, table, lengths, block_size: int, scale: float) -> torch.Tensor:
    """softmax(scale * q·k) · v over each row's gathered slots, in float32 (zeros for length 0)."""
    rows, heads, head_dim = q.shape
    group = heads // keys.shape[0]
    out = torch.zeros(rows, heads, head_dim, dtype=torch.float32, device=q.device)
    for r in range(rows):
        n = int(lengths[r])
        if n == 0:
            continue
        pos = torch.arange(n, device=q.device)
        slots = table[r, pos // block_size] * block_size + pos % block_size
        k = keys[:, slots].float().repeat_interleave(group, 0)  # [heads, n, head_dim]
        v = values[:, slots].float().repeat_interleave(group, 0)
        weights = torch.softmax(scale * (q[r].float()[:, None] @ k.transpose(1, 2)), dim=-1)
        out[r] = (weights @ v)[:, 0]
    return out
