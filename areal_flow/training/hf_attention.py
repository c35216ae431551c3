"""Packed attention inside transformers models: the implementations of attention.py registered
with transformers ("areal_varlen", "areal_flex") with a mask function that builds no mask. The
model's forward then takes `packed_forward_kwargs(positions, ...)`, which carries the `Packing`
(documents.py) to every layer. transformers is imported only here, and only when registering.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from areal_flow.training import documents
from areal_flow.training.attention import IMPLEMENTATIONS
from areal_flow.training.documents import Packing

PACKING_KWARG = "packing"
"""The forward keyword that carries the `Packing` to the registered transformers attention."""
HF_NAMES = {"varlen": "areal_varlen", "flex": "areal_flex"}
"""transformers attention-implementation names of the registered functions ("sdpa": its own)."""


def _hf_attention(implementation: str) -> Callable:
    """A transformers attention function (AttentionInterface) running `implementation` over the
    `Packing` that the forward passed as `packing=` (or, without one, that of the layer's
    position_ids: correct, but built again in every layer)."""
    run = IMPLEMENTATIONS[implementation]

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        b, h, length, d = query.shape
        if key.shape[2] != length:
            raise ValueError(f"packed attention ({implementation}) needs as many keys as queries (no KV cache), "
                             f"got {key.shape[2]} keys for {length} queries")
        if attention_mask is not None:
            raise ValueError(f"packed attention ({implementation}) takes no attention mask")
        if dropout or sliding_window:
            raise ValueError(f"packed attention ({implementation}) supports neither attention dropout "
                             f"({dropout}) nor a sliding window ({sliding_window})")
        query, key, value = _autocast_inputs(query, key, value)
        packing = kwargs.get(PACKING_KWARG)
        if packing is None:
            positions = kwargs.get("position_ids")
            positions = (torch.arange(length) if positions is None else positions).expand(b, length)
            packing = documents.packing_from_positions(positions, implementation, query.device)
        if packing.total != b * length:
            raise ValueError(f"packed attention: the Packing covers {packing.total} tokens, "
                             f"the forward has {b} x {length}")
        flat = [x.transpose(1, 2).reshape(b * length, x.shape[1], d) for x in (query, key, value)]
        return run(*flat, packing, scaling).view(b, length, h, d), None

    return attention


def _autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The attention's inputs in autocast's dtype when autocast is on for their device, as
    autocast casts the inputs of `scaled_dot_product_attention` (transformers' own sdpa path).

    Under autocast over fp32 weights transformers' rotary embedding returns q and k in the residual
    stream's dtype, fp32 (its cos/sin take the dtype of the fp32 embeddings), while v is the
    projection's bf16. These implementations are not autocast ops: `varlen_attention` saw an fp32 q
    and took the per-document loop instead of the flash kernel on CUDA (the torch engine's bf16
    train step ran at half the speed of a plain HF step on an H200), and flex got mixed dtypes.
    The cast rounds q and k exactly as autocast's SDPA would."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def _no_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> None:
    """The mask function of the registered implementations: the `Packing` replaces the mask. A
    padding mask cannot be honoured, so one that masks anything is refused."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError("packed attention takes no padding mask: pack the sequences instead")
    return None


@functools.cache
def register_transformers() -> None:
    """Register the packed implementations with transformers (once): attention function and a
    mask function that builds no mask, under HF_NAMES."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for implementation, name in HF_NAMES.items():
        AttentionInterface.register(name, _hf_attention(implementation))
        AttentionMaskInterface.register(name, _no_mask)


def hf_implementation(implementation: str) -> str:
    """The `attn_implementation` to load a transformers model with for a resolved implementation
    ("sdpa": transformers' own, which builds the dense block-diagonal mask itself)."""
    if implementation == "sdpa":
        return "sdpa"
    if implementation not in HF_NAMES:
        raise ValueError(f"implementation must be one of sdpa, {', '.join(HF_NAMES)}, got {implementation!r}")
    register_transformers()
    return HF_NAMES[implementation]


def packed_forward_kwargs(positions: np.ndarray | torch.Tensor, implementation: str,
                          device: torch.device | str) -> dict[str, Packing]:
    """Keyword arguments for a transformers forward over packed rows [rows, length] (positions
    restarting per document) loaded with `hf_implementation(implementation)`: the `Packing`,
    built once and passed to every layer; none for sdpa."""
    if implementation == "sdpa":
        return {}
    return {PACKING_KWARG: documents.packing_from_positions(positions, implementation, device)}
