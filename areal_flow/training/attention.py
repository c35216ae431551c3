"""Packed attention without a dense mask: block-diagonal causal attention over concatenated sequences.

A packed micro-batch holds several sequences ("documents") back to back; each token may attend to
the tokens of its own document up to itself. transformers turns restarted `position_ids` into a
DENSE [T, T] block-diagonal mask, which costs the square of the row and, on GPU, loses the flash
kernel (H100: 30.8k tok/s packed against 65.8k unpacked, docs/benchmarks.md). Here the documents'
boundaries (`Packing`, built once per forward and shared by every layer) drive one of:

- `varlen`: flash attention over `cu_seqlens` (`torch.nn.attention.varlen.varlen_attn`, CUDA,
  fp16/bf16). Elsewhere (CPU, fp32, a torch without the kernel) the same contract on causal
  `scaled_dot_product_attention` per document, documents of similar length batched into one call
  (each padded at its end, which causal attention never shows its real tokens): exact, no mask.
- `flex`: FlexAttention with a document-causal block mask, built here from the documents at block
  granularity (never a [T, T] tensor). The token count is padded up to a multiple of the block
  size (128) with a padding document, so that short micro-batches find a kernel. Compiled once
  (and cached) on CUDA, eager on the CPU (unfused: a reference, not fast).
- `sdpa`: the reference, one `scaled_dot_product_attention` with the explicit dense mask.

Every implementation has one signature: q [T, H, D], k/v [T, KVH, D] (grouped-query attention:
H a multiple of KVH, head h reading key/value head h // (H / KVH)), the `Packing` (documents.py)
and the softmax scale (None: 1/sqrt(D)) -> [T, H, D]. `resolve` turns a configured name ("auto"
included) into one of them for a device. hf_attention.py registers them with transformers;
megatron's core attention calls them directly (megatron/model.py).
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from areal_flow.training.documents import Packing, document_groups, document_ids

CHOICES = ("auto", "sdpa", "varlen", "flex")
"""What a configuration may name: "auto" picks the fastest available on the device."""
ALIASES = {"flex_attention": "flex"}
"""Older names still accepted (the torch engine once passed transformers' flex_attention through)."""
FLEX_CUDA_MIN_HEAD_DIM = 16
"""Compiled FlexAttention on CUDA refuses smaller heads ("embedding dimension ... must be at least 16",
torch 2.11 on an H200): those run the per-document loop, which is exact."""
CPU_AUTO = "sdpa"
"""What "auto" runs on the CPU: transformers' sdpa with its dense block mask over the recipe's
packed rows. In whole tiny_arith runs (η = 4, algorithm.ppo_epochs=2, 40 steps, alternated, 2 cores,
2026-11-27) its train step took 0.455 and 0.463 s against varlen's 0.511 and 0.540 s (+12%), and
the run trained 117.9-127.0 samples/s against 109.8-114.1: varlen's per-length document groups
cost more than the small dense masks of 128-token rows. (An isolated benchmark of one step on a busy
machine had put varlen over one row per micro-batch first, 0.231 s against sdpa's 0.251 s.)"""


# ---------------------------------------------------------------------------- implementations

Implementation = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Packing, "float | None"], torch.Tensor]


def dense_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Bool [total, total]: token i may attend to j when both are in one document and j <= i. The
    reference only: it is what the other implementations avoid building."""
    doc = document_ids(cu_seqlens, total)
    pos = torch.arange(total, device=doc.device)
    return (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing,
                   scale: float | None = None) -> torch.Tensor:
    """The reference: one SDPA call with the dense document-causal mask."""
    mask = dense_mask(packing.cu_seqlens, q.shape[0])
    out = F.scaled_dot_product_attention(*(_heads_first(x) for x in (q, k, v)), attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing,
                     scale: float | None = None) -> torch.Tensor:
    """Flash attention over `cu_seqlens` where the CUDA kernel runs this dtype; otherwise a causal
    SDPA call per document (exact; no mask at all)."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and varlen_kernel_works(q.device):
        return _varlen_kernel_call(q, k, v, packing, scale)
    return per_document_attention(q, k, v, packing, scale)


def per_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing,
                           scale: float | None = None) -> torch.Tensor:
    """Causal `scaled_dot_product_attention` per document, documents of similar length batched
    into one call (`DocumentGroups`): each padded at its end, which causal attention keeps away
    from its real tokens, so the result is exact and needs no mask."""
    groups = packing.groups if packing.groups is not None else document_groups(packing.cu_seqlens.tolist())
    zero = q.new_zeros(1, *q.shape[1:]), k.new_zeros(1, *k.shape[1:])
    qz, kz, vz = torch.cat([q, zero[0]]), torch.cat([k, zero[1]]), torch.cat([v, zero[1]])
    outs = []
    for index, valid in zip(groups.index, groups.valid):
        index = index.to(q.device)
        qs, ks, vs = (x[index].transpose(1, 2) for x in (qz, kz, vz))  # [docs, heads, length, dim]
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        out = out.transpose(1, 2).reshape(-1, *q.shape[1:])
        outs.append(out if valid is None else out[valid.to(q.device)])
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out if groups.inverse is None else out[groups.inverse.to(q.device)]



def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing,
                   scale: float | None = None) -> torch.Tensor:
    """FlexAttention with the `Packing`'s document-causal block mask, over the tokens padded to a
    multiple of the block size (the padding rows attend to themselves and are dropped)."""
    if packing.block_mask is None:
        raise ValueError("flex attention needs a Packing built for 'flex' (it carries the block mask)")
    total = q.shape[0]
    padded = packing.block_mask.seq_lengths[0]
    pad = padded - total
    if pad < 0:
        raise ValueError(f"flex attention: {total} tokens but the block mask covers {padded}")
    if q.is_cuda and q.shape[-1] < FLEX_CUDA_MIN_HEAD_DIM:  # compiled flex refuses it: the exact loop instead
        return per_document_attention(q, k, v, packing, scale)
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return _CpuFlex.apply(q, k, v, packing, scale)
    return _flex_forward(q, k, v, packing, scale, pad)


def _flex_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing, scale: float | None,
                  pad: int) -> torch.Tensor:
    qp, kp, vp = (_heads_first(F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x) for x in (q, k, v))
    out = _flex_function(q.device.type)(qp, kp, vp, block_mask=packing.block_mask, scale=scale, enable_gqa=True)
    return out[0, :, :q.shape[0]].transpose(0, 1)


class _CpuFlex(torch.autograd.Function):
    """torch's FlexAttention has no backward on the CPU (it refuses inputs that require grad). There
    the forward is flex's and the backward recomputes the same attention per document and
    differentiates that: the gradient of the same function, so that a CPU run can train with
    attention=flex. On CUDA flex's own backward runs (tests/training/test_attention.py, gpu)."""

    @staticmethod
    def forward(ctx, q, k, v, packing, scale):
        ctx.save_for_backward(q, k, v)
        ctx.packing, ctx.scale = packing, scale
        pad = packing.block_mask.seq_lengths[0] - q.shape[0]
        return _flex_forward(q.detach(), k.detach(), v.detach(), packing, scale, pad)

    @staticmethod
    def backward(ctx, grad):
        inputs = [x.detach().requires_grad_() for x in ctx.saved_tensors]
        with torch.enable_grad():
            out = per_document_attention(*inputs, ctx.packing, ctx.scale)
        return (*torch.autograd.grad(out, inputs, grad), None, None)


IMPLEMENTATIONS: dict[str, Implementation] = {"sdpa": sdpa_attention, "varlen": varlen_attention,
                                               "flex": flex_attention}


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> [1, H, T, D]."""
    return x.transpose(0, 1)[None]


@functools.cache
def _flex_function(device_type: str) -> Callable:
    """flex_attention, compiled once on CUDA (the fused kernel) and eager elsewhere (its unfused
    reference path; the warning that says so is silenced)."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    if device_type == "cuda":
        return torch.compile(flex)

    def eager(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention.*")
            return flex(*args, **kwargs)

    return eager


# ---------------------------------------------------------------------------- the CUDA varlen kernel


@functools.cache
def _varlen_kernel() -> tuple[Callable, frozenset[str]] | None:
    """torch's varlen_attn and the names of its parameters, or None where torch has none. Its
    signature changed between releases (torch 2.11: scale, window_size, no enable_gqa; 2.13 adds
    enable_gqa; older ones had is_causal), so the call adapts to what is there."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_kernel_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing,
                        scale: float | None) -> torch.Tensor:
    fn, params = _varlen_kernel()
    kwargs = _causal_kwargs(params)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        elif not _varlen_native_gqa(str(q.device)):  # expand key/value heads as SDPA's enable_gqa does
            group = q.shape[1] // k.shape[1]  # (query head h reads h // group)
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if scale is not None:
        if "scale" in params:
            kwargs["scale"] = scale
        else:  # the kernel's own scale is 1/sqrt(D)
            q = q * (scale * math.sqrt(q.shape[-1]))
    cu = packing.cu_seqlens
    # Contiguous: megatron's q/k/v are views into its fused QKV projection.
    return fn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, packing.max_len, packing.max_len, **kwargs)


def _causal_kwargs(params: frozenset[str]) -> dict[str, Any]:
    return {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}


@functools.cache
def _varlen_native_gqa(device: str) -> bool:
    """Whether torch's varlen kernel, whose signature has no enable_gqa (torch 2.11), takes fewer
    key/value heads than query heads as they are: the flash kernel reads query head h's keys from
    KV head h // group itself, and expanding K and V first costs a copy of each in every layer,
    forward and backward. Probed once per device: a bf16 grouped-query forward and backward with
    the heads as they are against the same with them expanded (outputs and gradients); any error
    or difference means expand."""
    fn, params = _varlen_kernel()
    try:
        with torch.inference_mode(False), torch.enable_grad():
            base = _probe_qkv(device)
            cu, longest = torch.tensor(PROBE_CU, dtype=torch.int32, device=device), int(max(np.diff(PROBE_CU)))
            runs = []
            for expand in (False, True):
                q, k, v = (t.clone().requires_grad_() for t in base)
                kk, vv = (k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)) if expand else (k, v)
                out = fn(q, kk, vv, cu, cu, longest, longest, **_causal_kwargs(params))
                (out.float() * torch.linspace(-1, 1, out.numel(), device=device).view_as(out)).sum().backward()
                runs.append([out.detach(), q.grad, k.grad, v.grad])
        # Within bf16's rounding of the sums (2%); a head read from the wrong KV head differs by the values.
        return all(a.shape == b.shape and bool((a.float() - b.float()).abs().max() <= 0.02 * max(1.0, b.abs().max()))
                   for a, b in zip(*runs))
    except Exception:  # noqa: BLE001 - the kernel refused the shapes: expand
        return False


@functools.cache
def _varlen_probe(device: str) -> bool:
    fn = _varlen_kernel()
    if fn is None:
        return False
    try:  # with gradients on: the first forward to ask may be a logprob pass under no_grad
        with torch.inference_mode(False), torch.enable_grad():
            return _varlen_agrees(device)
    except Exception as e:  # noqa: BLE001 - any failure means: do not use the kernel
        warnings.warn(f"torch's varlen flash attention does not run on {device} ({type(e).__name__}: {e}); "
                      "using flex attention (or the per-document loop) instead", stacklevel=2)
        return False


PROBE_CU = [0, 7, 8, 40]
"""The probes' documents: one of 7 tokens, one of 1, one of 32."""


def _probe_qkv(device: str) -> list[torch.Tensor]:
    """The probes' bf16 q [40, 4, 64] and grouped k, v [40, 2, 64], the same on every call."""
    gen = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(PROBE_CU[-1], h, 64, device=device, generator=gen, dtype=torch.bfloat16) for h in (4, 2, 2)]


def _varlen_agrees(device: str) -> bool:
    """One bf16 grouped-query forward and backward of the kernel against the per-document reference."""
    q, k, v = (t.requires_grad_() for t in _probe_qkv(device))
    packing = Packing(torch.tensor(PROBE_CU, dtype=torch.int32, device=device), int(max(np.diff(PROBE_CU))), PROBE_CU[-1])
    out = _varlen_kernel_call(q, k, v, packing, None)
    out.float().sum().backward()
    with torch.no_grad():
        ref = per_document_attention(q.float(), k.float(), v.float(), packing)
    return bool((out.float() - ref).abs().max() < 0.05) and k.grad is not None


def varlen_kernel_works(device: torch.device | str) -> bool:
    """Whether torch's CUDA varlen flash attention runs (forward and backward, bf16, grouped-query)
    and agrees with the per-document reference on `device`: probed once per device."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _varlen_probe(str(device))


def resolve(attention: str, device: torch.device | str) -> str:
    """The implementation ("sdpa", "varlen" or "flex") that `attention` means on `device`.

    "auto": on CUDA varlen where torch's flash kernel works, else flex; on the CPU `CPU_AUTO`
    (measured: varlen's per-document SDPA). An unknown name fails, naming the choices."""
    name = ALIASES.get(attention, attention)
    if name not in CHOICES:
        raise ValueError(f"attention must be one of {', '.join(CHOICES)}, got {attention!r}")
    if name != "auto":
        return name
    device = torch.device(device)
    if device.type == "cuda":
        return "varlen" if varlen_kernel_works(device) else "flex"
    return CPU_AUTO
