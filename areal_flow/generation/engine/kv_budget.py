"""How many tokens of KV cache an engine may hold: given (max_total_tokens), or what a share of the
GPU's memory leaves beside the weights (SGLang's --mem-fraction-static rule)."""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token takes in every layer: keys and values of each KV head."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def kv_budget_tokens(mem_fraction: float, total_bytes: int, used_bytes: int, per_token_bytes: int) -> int:
    """The KV cache tokens that fit in `mem_fraction` of a device's `total_bytes` beside the
    `used_bytes` the server already holds (its weights); SGLang's --mem-fraction-static rule.
    Raises ValueError when nothing is left for the cache."""
    left = int(mem_fraction * total_bytes) - used_bytes
    if left < per_token_bytes:
        raise ValueError(f"generation.mem_fraction_static={mem_fraction} of {total_bytes / 2**30:.1f} GiB leaves no "
                         f"room for a KV cache: the server's weights take {used_bytes / 2**30:.1f} GiB of it; raise it")
    return left // per_token_bytes


def resolve_budget(max_total_tokens: int | None, mem_fraction: float | None, config: Any, dtype: torch.dtype,
                   device: torch.device) -> int | None:
    """The engine's KV budget in tokens, once its weights are on `device`: `max_total_tokens` if
    given, else (on a GPU, with `mem_fraction`) what that share of the device leaves; else None."""
    if max_total_tokens is not None or mem_fraction is None or device.type != "cuda":
        return max_total_tokens
    # This process's own memory: a colocated trainer's is outside the share, as in SGLang.
    total, weights = torch.cuda.get_device_properties(device).total_memory, torch.cuda.memory_allocated(device)
    tokens = kv_budget_tokens(mem_fraction, total, weights, kv_bytes_per_token(config, dtype))
    logger.info("KV budget %d tokens: %.0f%% of %.1f GiB, of which the weights take %.1f GiB",
                tokens, 100 * mem_fraction, total / 2**30, weights / 2**30)
    return tokens
