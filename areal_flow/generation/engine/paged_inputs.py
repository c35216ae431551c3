"""A paged forward's inputs, built on the host (generation/engine/paged_batch.py plans the forward):
the prefill chunks' tokens, positions, slots and masks, the runs of equal contexts a batch-invariant
step attends over apart, every integer input in one upload, and how far two sequences share full
blocks (the prefix a row can take from the cache)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from areal_flow.generation.engine.decode import Chunk
from areal_flow.generation.engine.kv_batch import Row
from areal_flow.runtime.devices import to_device


def common_blocks(a: tuple[int, ...], b: tuple[int, ...], size: int, most: int) -> int:
    """How many of the first full blocks of `a` and `b` hold the same tokens (at most `most`)."""
    blocks = min(len(a), len(b)) // size
    same = 0
    while same < min(blocks, most) and a[same * size: (same + 1) * size] == b[same * size: (same + 1) * size]:
        same += 1
    return same


def spans(contexts: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive rows with the same context length: (first row, end row, length)."""
    spans, first = [], 0
    for row in range(1, len(contexts) + 1):
        if row == len(contexts) or contexts[row] != contexts[first]:
            spans.append((first, row, contexts[first]))
            first = row
    return spans


@dataclass
class PrefillInputs:
    """The prefill chunks' share of a forward's inputs, after the `decode` rows' tokens."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    write: list[int] = field(default_factory=list)  # the slot of each token's keys and values
    logits_at: list[int] = field(default_factory=list)  # the tokens whose logits are wanted, decode rows' first
    wanted: list[tuple[Row, int, int]] = field(default_factory=list)  # (row, first in logits_at, prompt positions)
    chunks: list[Chunk] = field(default_factory=list)

    @classmethod
    def of(cls, chunks: list[tuple[Row, int]], keep: dict[int, int], decode: int, size: int,
           device: torch.device) -> PrefillInputs:
        inputs = cls(logits_at=list(range(decode)))
        for row, n in chunks:
            start, first = decode + len(inputs.tokens), row.computed
            inputs.tokens += row.sequence[first: first + n]
            inputs.positions += range(first, first + n)
            context = [row.blocks[p // size] * size + p % size for p in range(first + n)]
            inputs.write += context[first:]
            mask = torch.ones(n, first + n, dtype=torch.bool, device=device).tril_(first)
            inputs.chunks.append(Chunk(start, n, to_device(context, device, torch.int64), mask))
            # Logits of the positions a prompt's logprobs need; the last one's if it completes.
            total, last_kept = len(row.sequence), keep.get(id(row), 0)
            scored = [p for p in range(max(first, total - last_kept), first + n)]
            if scored:
                inputs.wanted.append((row, len(inputs.logits_at), len(scored)))
                inputs.logits_at += [start + p - first for p in scored]
            if first + n == total and total - 1 not in scored:
                inputs.wanted.append((row, len(inputs.logits_at), 0))
                inputs.logits_at.append(start + n - 1)
        return inputs


def upload(tokens: list, positions: list, write: list, lengths: np.ndarray, table: np.ndarray, logits_at: list,
            device: torch.device) -> list[torch.Tensor]:
    """Every integer input of a forward in one buffer, copied to the device at once (one transfer,
    from pinned memory without waiting for the device, instead of one blocking copy each); each
    of `tokens`, `positions` and `write` is the decode rows' part and the chunks' part."""
    parts = [np.asarray(part, dtype=np.int64) for part in (*tokens, *positions, *write, lengths, table, logits_at)]
    n_tokens = len(parts[0]) + len(parts[1])
    sizes = [n_tokens, n_tokens, n_tokens, len(lengths), table.size, len(parts[-1])]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=device.type == "cuda")
    np.concatenate(parts, out=host.numpy())
    return list(host.to(device, non_blocking=True).split(sizes))
