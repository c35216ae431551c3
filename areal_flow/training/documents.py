"""The documents of a packed forward: where each sequence starts and ends in the concatenated
tokens, built once per forward and shared by all its layers (`Packing`).

attention.py's implementations read it: varlen and the per-document path from `cu_seqlens` (off
CUDA, from the documents grouped by length: `DocumentGroups`), flex from its block mask, built
here at block granularity from the documents (never a [T, T] tensor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from areal_flow.runtime.devices import to_device

FLEX_BLOCK = 128
"""FlexAttention's block size: the token count is padded to a multiple of it."""


@dataclass(frozen=True)
class Packing:
    """Where the documents of one packed forward start and end, shared by all its layers.

    cu_seqlens: int32 [n_docs + 1] over the flattened tokens (rows concatenated), on the device;
    max_len: the longest document; total: the token count (cu_seqlens[-1], kept on the host so that
    no layer reads the device for it); block_mask: flex's block mask over the tokens padded to a
    multiple of FLEX_BLOCK (flex only); groups: the documents batched by length for the
    per-document path (varlen, and flex's backward, off CUDA only). Every field is an init field:
    FSDP rebuilds dataclass inputs with `dataclasses.replace` when it casts them."""

    cu_seqlens: torch.Tensor
    max_len: int
    total: int
    block_mask: Any = None
    groups: DocumentGroups | None = None



def cu_seqlens_from_positions(positions: np.ndarray | torch.Tensor) -> np.ndarray:
    """int32 [n_docs + 1] over the flattened [rows, length] tokens: a document starts at each row's
    start and wherever the position does not continue the previous one (restarts at 0 per
    sequence; the same rule as transformers' packed-sequence detection)."""
    pos = positions.detach().cpu().numpy() if torch.is_tensor(positions) else np.asarray(positions)
    pos = pos.reshape(-1, pos.shape[-1]) if pos.ndim > 1 else pos[None]
    starts = np.ones(pos.shape, bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    flat = np.flatnonzero(starts.reshape(-1))
    return np.append(flat, pos.size).astype(np.int32)


def packing_from_positions(positions: np.ndarray | torch.Tensor, implementation: str,
                           device: torch.device | str) -> Packing:
    """The `Packing` of packed rows [rows, length] whose positions restart per document."""
    cu = cu_seqlens_from_positions(positions)
    max_len = int(np.diff(cu).max()) if len(cu) > 1 else 0
    return _packing(to_device(cu, device), max_len, int(cu[-1]), implementation, host_cu=cu)


def packing_from_cu_seqlens(cu_seqlens: torch.Tensor, max_len: int, total: int, implementation: str) -> Packing:
    """The `Packing` of `total` tokens with documents at `cu_seqlens` (tokens past its last entry,
    if any, form one more document); the block mask only where `implementation` is flex."""
    cu = cu_seqlens.to(torch.int32)
    if int(cu[-1]) != total:  # trailing tokens: a document of their own (megatron THD padding)
        cu = torch.cat([cu, cu.new_tensor([total])])
        max_len = max(max_len, total - int(cu[-2]))
    return _packing(cu, max_len, total, implementation)


def _packing(cu_seqlens: torch.Tensor, max_len: int, total: int, implementation: str,
             host_cu: np.ndarray | None = None) -> Packing:
    mask = document_block_mask(cu_seqlens, total, FLEX_BLOCK) if implementation == "flex" else None
    # The per-document path's groups, once per forward, where it will run: off CUDA (varlen, and
    # flex's CPU backward, which would otherwise read cu_seqlens back in every layer).
    groups = None
    if implementation in ("varlen", "flex") and cu_seqlens.device.type != "cuda":
        groups = document_groups(host_cu if host_cu is not None else cu_seqlens.tolist())
    return Packing(cu_seqlens=cu_seqlens, max_len=int(max_len), total=total, block_mask=mask, groups=groups)


def document_ids(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """int32 [length]: the document of each token; tokens past the last boundary (padding) get
    one more id, so they form a document of their own."""
    arange = torch.arange(length, device=cu_seqlens.device, dtype=torch.int32)
    return torch.bucketize(arange, cu_seqlens[1:].to(torch.int32), right=True).to(torch.int32)


def document_block_mask(cu_seqlens: torch.Tensor, total: int, block: int = FLEX_BLOCK):
    """FlexAttention's BlockMask of document-causal attention over `total` tokens padded up to a
    multiple of `block`, computed per block pair from each block's first and last document (the
    documents are contiguous and in order), never as a [T, T] tensor.

    For query block i and key block j <= i: the pair is needed iff some document spans both, i.e.
    first_doc(i) <= last_doc(j); it is FULL (no mask_mod needed) iff j < i and both blocks lie in
    one document (first_doc(j) == last_doc(i)); the diagonal is always partial."""
    from torch.nn.attention.flex_attention import BlockMask

    padded = _round_up(max(total, 1), block)
    doc = document_ids(cu_seqlens, padded)
    blocks = doc.view(-1, block)
    first, last = blocks[:, 0], blocks[:, -1]
    n = blocks.shape[0]
    idx = torch.arange(n, device=doc.device)
    lower = idx[None, :] <= idx[:, None]  # [q block, kv block]
    touch = lower & (first[:, None] <= last[None, :])
    full = (idx[None, :] < idx[:, None]) & (first[None, :] == last[:, None])
    partial = touch & ~full

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    def as_blocks(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Needed blocks first, in ascending order (a stable sort of "not needed").
        order = torch.sort((~m).to(torch.int32), dim=-1, stable=True).indices
        return m.sum(-1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]

    kv_num, kv_idx = as_blocks(partial)
    full_num, full_idx = as_blocks(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(padded, padded))


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


@dataclass(frozen=True)
class DocumentGroups:
    """Documents batched for `per_document_attention`: per group, `index` [docs, length] gathers
    its tokens (T, one past the last token, for the padding) and `valid` picks its real rows from
    the flattened result (None: no padding); `inverse` puts the groups' tokens back in order (None:
    already in order)."""

    index: tuple[torch.Tensor, ...]
    valid: tuple[torch.Tensor | None, ...]
    inverse: torch.Tensor | None


GROUP_RATIO = 1.5
"""Documents share one SDPA call when the longest is at most this many times the shortest."""


def document_groups(cu_seqlens: list[int] | np.ndarray, ratio: float = GROUP_RATIO) -> DocumentGroups:
    """Group the documents at `cu_seqlens` by length (sorted, longest first; a group's shortest
    is at least 1/ratio of its longest): padding costs at most `ratio` times the attention work."""
    cu = np.asarray(cu_seqlens, np.int64)
    total = int(cu[-1])
    lengths = np.diff(cu)
    docs = [int(d) for d in np.argsort(-lengths, kind="stable") if lengths[d] > 0]
    index, valid, order = [], [], []
    while docs:
        longest = int(lengths[docs[0]])
        n = next((i for i, d in enumerate(docs) if lengths[d] * ratio < longest), len(docs))
        group, docs = docs[:n], docs[n:]
        steps = np.arange(longest)
        idx = cu[group][:, None] + steps[None, :]
        real = steps[None, :] < lengths[group][:, None]
        index.append(torch.from_numpy(np.where(real, idx, total)))
        valid.append(None if real.all() else torch.from_numpy(np.flatnonzero(real)))
        order.append(idx[real])
    order = np.concatenate(order) if order else np.zeros(0, np.int64)
    inverse = None if np.array_equal(order, np.arange(total)) else torch.from_numpy(np.argsort(order))
    return DocumentGroups(tuple(index), tuple(valid), inverse)
