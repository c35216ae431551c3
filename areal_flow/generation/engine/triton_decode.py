"""Decode attention over the paged KV cache as a Triton kernel (flash-decoding style).

One program per (row, KV head, split): it loads the row's context length, walks the row's block
table tile by tile (a tile is `tile` key positions: their blocks from the table, then a
[tile, head_dim] tile of K and of V), and keeps an online softmax in float32 for the `group` query
heads that share that KV head (one [group, head_dim] tile of queries, padded to 16 rows for
`tl.dot`). Each row's own blocks are read once; the padded table columns are never touched.

CUDA-graph safe: nothing syncs with the host, and the grid depends only on the tensors' shapes;
the loop bounds are read from `lengths` inside the kernel, so a captured graph replays correctly
after new lengths (and tables) are written into the same tensors. Long contexts with few rows can
be split over `splits` programs per (row, KV head) whose partial results a second small kernel
merges (flash-decoding split-K); the split count, too, comes from shapes only. With a fixed
`splits` (e.g. 1) every row's result is independent of the other rows (batch-invariant).

triton is imported guarded: without it this module imports and `available()` says False. On a
CPU, the kernels run through Triton's interpreter when TRITON_INTERPRET=1 is set before this module
is imported (triton.jit reads it then).
"""

from __future__ import annotations

import functools
import math
import os

import torch

try:  # pragma: no cover - depends on the environment
    import triton
    import triton.language as tl
except Exception:  # ImportError, or a triton that cannot load here
    triton = tl = None

# Query heads of one KV head are padded to at least this many rows (tl.dot's minimum).
_MIN_DOT = 16
# Whether the kernels below were made for Triton's interpreter (TRITON_INTERPRET=1 at import).
_INTERPRET = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


def _jit(fn):
    """triton.jit where triton is there (read at import: TRITON_INTERPRET must be set by then)."""
    return fn if triton is None else triton.jit(fn)


def available(device: torch.device | str) -> bool:
    """Whether `paged_decode_attention` can run on tensors of `device`: triton is importable and the
    device is CUDA, or TRITON_INTERPRET=1 was set when this module was imported (Triton's interpreter,
    CPU tensors)."""
    if triton is None:
        return False
    return torch.device(device).type == "cuda" or _INTERPRET


def _check_inputs(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                  lengths: torch.Tensor) -> None:
    """Refuse shapes and dtypes `paged_decode_attention` cannot take, naming them."""
    rows, heads, head_dim = q.shape
    kv_heads = keys.shape[0]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if keys.shape != values.shape or keys.shape[2] != head_dim:
        raise ValueError(f"keys {tuple(keys.shape)} / values {tuple(values.shape)} do not match q {tuple(q.shape)}")
    if not q.dtype == keys.dtype == values.dtype:
        raise ValueError(f"q, keys and values differ in dtype: {q.dtype}, {keys.dtype}, {values.dtype}")
    if table.dim() != 2 or table.shape[0] != rows or lengths.shape != (rows,):
        raise ValueError(f"table {tuple(table.shape)} / lengths {tuple(lengths.shape)} for {rows} rows")


def paged_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                           lengths: torch.Tensor, block_size: int, scale: float, *, splits: int | None = None,
                           tile: int | None = None) -> torch.Tensor:
    """softmax(scale * q·k) · v of one query per row over that row's context in the paged cache.

    q [D, heads, head_dim]; keys, values [kv_heads, num_slots, head_dim] (slot = block * block_size
    + offset); table [D, max_blocks] int64 (each row's blocks in order, padded with any block);
    lengths [D] int64 (row r attends to positions 0..lengths[r]-1, at most max_blocks * block_size). Grouped-query: query head h uses
    KV head h // (heads // kv_heads). Returns [D, heads, head_dim] in q's dtype; a row of length 0
    gives zeros. `splits`: programs per (row, KV head) that share its context (None: chosen from the
    shapes and the GPU; 1: one pass, no second kernel). `tile`: key positions per loop step (a power
    of two, at least 16, spanning blocks as needed; None: chosen from head_dim)."""
    if triton is None:
        raise RuntimeError("paged_decode_attention needs triton")
    _check_inputs(q, keys, values, table, lengths)
    rows, heads, head_dim = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    head_dim_p = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    if tile is None:  # no register spills on sm_90 (checked with ptxas) for head_dim up to 256
        tile = 64 if head_dim_p <= 32 else 32 if head_dim_p <= 128 else 16
    if tile < _MIN_DOT or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= {_MIN_DOT}, got {tile}")
    if splits is None:
        splits = _splits(q.device, rows * kv_heads, table.shape[1] * block_size, tile)
    if splits < 1:
        raise ValueError(f"splits must be at least 1, got {splits}")
    q, keys, values = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, keys, values))
    table, lengths = table.contiguous(), lengths.contiguous()
    out = torch.empty(rows, heads, head_dim, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    if splits == 1:
        part, m, l = out, out, out  # m, l unused
        stride_part = (out.stride(0), out.stride(1), 0)
    else:
        part = torch.empty(rows, heads, splits, head_dim, dtype=torch.float32, device=q.device)
        m = torch.empty(rows, heads, splits, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        stride_part = part.stride()[:3]
    _partial_kernel[(rows, kv_heads, splits)](
        q, keys, values, table, lengths, part, m, l,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        table.stride(0), *stride_part, float(scale),
        GROUP=group, GROUP_P=max(_MIN_DOT, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p, BLOCK_SIZE=block_size, TILE=tile, SPLITS=splits,
        IEEE=q.dtype == torch.float32 and keys.dtype == torch.float32, INTERPRET=_INTERPRET,
        num_warps=4 if head_dim_p <= 32 else 8)
    if splits > 1:
        _combine_kernel[(rows, heads)](
            part, m, l, out, out.stride(0), out.stride(1), heads,
            HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, SPLITS=splits, SPLITS_P=triton.next_power_of_2(splits),
            num_warps=4)
    return out


def _splits(device: torch.device, programs: int, max_context: int, tile: int) -> int:
    """Splits per (row, KV head): enough programs for about two waves of the GPU's SMs, each split
    keeping at least 4 tiles of the longest possible context. From shapes only (CUDA-graph safe)."""
    if device.type != "cuda":
        return 1
    want = math.ceil(2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
                     / max(programs, 1))
    most = max(1, max_context // (4 * tile))
    splits = min(want, most, 16)
    return 1 if splits <= 1 else 1 << (splits.bit_length() - 1)  # a power of two, rounded down


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@_jit
def _tile(q, k_base, v_base, table_row, stride_ks, stride_vs, length, i, m, l, acc, scale, d_mask,
          HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr):
    """One step of the online softmax: key positions i * TILE .. + TILE - 1 (those below `length`)."""
    t = tl.arange(0, TILE)
    d = tl.arange(0, HEAD_DIM_P)
    pos = i * TILE + t
    valid = pos < length
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + slot[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(valid[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))  # finite: every tile in range has a valid position
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc


@_jit
def _partial_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lengths_ptr, out_ptr, m_ptr, l_ptr,
                    stride_qr, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_tr,
                    stride_or, stride_oh, stride_os, scale,
                    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """Program (row, kv, split): the queries of KV head `kv`'s GROUP heads over this split's tiles of
    the row's context. SPLITS == 1: the normalised output [rows, heads, head_dim]; else the
    unnormalised accumulator [rows, heads, SPLITS, head_dim] and the running max and sum [rows, heads,
    SPLITS] (float32)."""
    row = tl.program_id(0)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HEAD_DIM_P)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    head = kv * GROUP + g
    q = tl.load(q_ptr + row.to(tl.int64) * stride_qr + head[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    length = tl.load(lengths_ptr + row)
    tiles = tl.cdiv(length, TILE)
    per_split = tl.cdiv(tiles, SPLITS)
    start = split * per_split
    end = tl.minimum(start + per_split, tiles)
    k_base = k_ptr + kv.to(tl.int64) * stride_kh
    v_base = v_ptr + kv.to(tl.int64) * stride_vh
    table_row = table_ptr + row.to(tl.int64) * stride_tr
    m = tl.full([GROUP_P], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_DIM_P], tl.float32)
    if INTERPRET:  # the interpreter's scalars are 1-element arrays, which range() rejects under numpy 2.4
        i = start
        while i < end:
            m, l, acc = _tile(q, k_base, v_base, table_row, stride_ks, stride_vs, length, i, m, l, acc, scale, d_mask,
                              HEAD_DIM_P, BLOCK_SIZE, TILE, IEEE)
            i += 1
    else:
        for i in range(start, end):
            m, l, acc = _tile(q, k_base, v_base, table_row, stride_ks, stride_vs, length, i, m, l, acc, scale, d_mask,
                              HEAD_DIM_P, BLOCK_SIZE, TILE, IEEE)
    o_mask = g_mask[:, None] & d_mask[None, :]
    out_at = out_ptr + row.to(tl.int64) * stride_or + head * stride_oh
    if SPLITS == 1:
        acc = acc / tl.where(l > 0, l, 1.0)[:, None]  # length 0: zeros
        tl.store(out_at[:, None] + d[None, :], acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(out_at[:, None] + split * stride_os + d[None, :], acc, mask=o_mask)
        stat = (row.to(tl.int64) * tl.num_programs(1) * GROUP + head) * SPLITS + split
        tl.store(m_ptr + stat, m, mask=g_mask)
        tl.store(l_ptr + stat, l, mask=g_mask)


@_jit
def _combine_kernel(part_ptr, m_ptr, l_ptr, out_ptr, stride_or, stride_oh, heads,
                    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, SPLITS: tl.constexpr, SPLITS_P: tl.constexpr):
    """Program (row, head): merges the SPLITS partial results (contiguous [rows, heads, SPLITS, ...])."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_P)
    d = tl.arange(0, HEAD_DIM_P)
    s_mask = s < SPLITS
    d_mask = d < HEAD_DIM
    base = (row.to(tl.int64) * heads + head) * SPLITS
    m = tl.load(m_ptr + base + s, mask=s_mask, other=float("-inf"))
    l = tl.load(l_ptr + base + s, mask=s_mask, other=0.0)
    top = tl.max(m, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty (length 0)
    w = tl.exp(m - top)  # an empty split (max -inf) weighs 0
    part = tl.load(part_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :],
                   mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    num = tl.sum(part * w[:, None], 0)
    den = tl.sum(l * w, 0)
    out = num / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + row.to(tl.int64) * stride_or + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d_mask)
