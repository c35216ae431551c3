"""The decode step of Llama/Qwen2-family models in plain torch ops: the engine's hot loop.

A decode step feeds one token per row. Through `transformers` it costs about 2 ms of fixed overhead
(mask building, output dataclasses, config lookups, three projections where one would do) and runs
attention through SDPA's CPU kernel, which is slow for a single query row. This module computes the
same step directly: fused q/k/v and gate/up projections, rotary embeddings from a table built once,
and grouped-query attention as two matmuls over the engine's KV cache with an additive padding bias.
Prefill still runs the `transformers` forward, so a prompt's cache is exactly Hugging Face's.
(`tools/bench_generation.py` measures the engine; docs/generation.md says what this is worth.)

Only architectures whose decode this reproduces exactly are taken (`DecodeStep.for_model` returns
None for the rest, and the engine keeps the `transformers` forward for them).

**Batch invariance** (`batch_invariant`: the server's --enable-deterministic-inference): a row's
logits are then bit-identical whatever else is in the batch, so a seeded request draws the same
tokens with the same logprobs alone or batched with any others (the trainer reads the logprobs in
its ratio π_θ/π_behav: a last-bit difference changes the trained weights). Two things make a row
depend on the batch on the CPU (measured with torch 2.13's MKL; tests/generation/test_batch_invariance.py):
a matmul computes a row differently when it has fewer than 4 rows (and, on several threads, some
row counts that are no multiple of 4), so every projection's rows are padded to a multiple of
`GEMM_ROWS`; and attention over a left-padded cache sums a row's scores in an order that depends on
the padding, so each run of rows that start at the same column (a group's answers join together)
attends over its own columns only, with no padding. That costs a few small matmuls per run and
layer: about a fifth of the tokens/s of a full batch of many prompt lengths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache

_MODEL_TYPES = frozenset({"llama", "qwen2"})
_STATIC_ROPE = frozenset({"default", "linear", "llama3"})  # cos/sin depend on the position only
GEMM_ROWS = 4
"""Batch-invariant matmuls have a multiple of this many rows (module docstring)."""


class DecodeStep:
    """`step(tokens [B], positions [B], cache, bias [B, W+1]) -> logits [B, V]` (float32).

    `batch_invariant`: a row's logits do not depend on the other rows (module docstring)."""

    def __init__(self, model: nn.Module, *, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant
        inner = model.model
        self.layers = list(inner.layers)
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.lm_head = model.lm_head
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.qkv = [_fuse(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
                    for layer in self.layers]
        self.gate_up = [_fuse(layer.mlp.gate_proj, layer.mlp.up_proj) for layer in self.layers]
        positions = torch.arange(model.config.max_position_embeddings)[None]
        probe = torch.zeros(1, dtype=self.embed.weight.dtype, device=self.embed.weight.device)
        cos, sin = inner.rotary_emb(probe, positions.to(probe.device))
        self.cos, self.sin = cos[0], sin[0]  # [max_positions, head_dim]

    @classmethod
    def for_model(cls, model: nn.Module, *, batch_invariant: bool = False) -> DecodeStep | None:
        """A DecodeStep for `model`, or None where its decode differs from what this computes."""
        config = model.config
        rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        if (config.model_type not in _MODEL_TYPES or config.hidden_act != "silu" or rope not in _STATIC_ROPE
                or getattr(config, "use_sliding_window", False) or getattr(config, "pretraining_tp", 1) != 1):
            return None
        return cls(model, batch_invariant=batch_invariant)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Cache, bias: torch.Tensor
                 ) -> torch.Tensor:
        rows = tokens.shape[0]
        hidden = self.embed(tokens[:, None])[:, 0]  # [B, hidden]; the embedding sees [B, 1] ids, as in a forward
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [B, 1, head_dim]
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        spans = _spans(bias) if self.batch_invariant else None
        bias = bias[:, None, None]  # [B, 1, 1, W]
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = self.linear(_rms_norm(hidden, layer.input_layernorm), *self.qkv[i])
            # q and k side by side in one tensor: one rotation for both.
            qk = _rotate(qkv[:, : q_size + kv_size].view(rows, -1, self.head_dim), cos, sin)
            q, k = qk[:, : self.heads], qk[:, self.heads:]
            v = qkv[:, q_size + kv_size:].view(rows, self.kv_heads, 1, self.head_dim)
            keys, values = cache.layers[i].update(k[:, :, None], v)
            # Grouped-query attention without repeating the cache: the heads that share a KV head
            # are the query rows of one matmul.
            q = q.reshape(rows, self.kv_heads, -1, self.head_dim)
            if spans is None:
                scores = torch.matmul(q, keys.transpose(-1, -2))
                out = torch.matmul(torch.softmax(scores.mul_(self.scaling).add_(bias), dim=-1), values)
            else:  # each span of rows over its own columns: no padding in any row's sums
                out, q = q.new_empty(q.shape), q * self.scaling
                keys_t = keys.transpose(-1, -2)
                for a, b, start in spans:  # batched over the span's rows and KV heads
                    scores = torch.bmm(q[a:b].flatten(0, 1), keys_t[a:b, :, :, start:].flatten(0, 1))
                    torch.bmm(torch.softmax(scores, dim=-1), values[a:b, :, start:].flatten(0, 1),
                              out=out[a:b].view(-1, *q.shape[2:]))
            hidden = hidden + self.linear(out.reshape(rows, q_size), attn.o_proj.weight, attn.o_proj.bias)
            gate, up = self.linear(_rms_norm(hidden, layer.post_attention_layernorm), *self.gate_up[i]).chunk(2, dim=-1)
            hidden = hidden + self.linear(F.silu(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        return self.logits(_rms_norm(hidden, self.norm))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer over final hidden states [N, hidden]: logits [N, V] (float32)."""
        return self.linear(hidden, self.lm_head.weight, self.lm_head.bias).float()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear over rows x [N, in]; batch-invariant: through a matmul of a multiple of GEMM_ROWS rows."""
        rows = x.shape[0]
        pad = -rows % GEMM_ROWS if self.batch_invariant else 0
        if pad == 0:
            return F.linear(x, weight, bias)
        return F.linear(F.pad(x, (0, 0, 0, pad)), weight, bias)[:rows]


def _spans(bias: torch.Tensor) -> list[tuple[int, int, int]]:
    """The runs of consecutive rows whose first attended column (0 in the padding bias [B, W]) is
    the same: (first row, end row, column)."""
    starts = (bias == 0).to(torch.uint8).argmax(dim=1).tolist()
    spans, first = [], 0
    for row in range(1, len(starts) + 1):
        if row == len(starts) or starts[row] != starts[first]:
            spans.append((first, row, starts[first]))
            first = row
    return spans


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """The model's RMSNorm as one fused op (its weight and epsilon)."""
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def padding_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention bias of an attend mask [B, W]: 0 where attended, -inf at padding."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask == 0, float("-inf"))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (the `rotate_half` convention of Llama and Qwen2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _fuse(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several projections of the same input, with each projection's
    parameters turned into views of it: one matmul instead of several, no second copy of the
    weights, and a weight update that writes the parameters in place updates the fused tensor too."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    biases = [linear.bias for linear in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b.detach() if b is not None else weight.new_zeros(linear.out_features)
                          for b, linear in zip(biases, linears)])
    start = 0
    for linear in linears:
        end = start + linear.out_features
        linear.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return weight, bias
