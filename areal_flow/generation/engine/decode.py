"""The forward of Llama/Qwen2-family models over the paged KV cache in plain torch ops: the engine's hot loop.

One forward feeds the engine's running rows together: a token for each decoding row and a chunk of
prompt for rows being prefilled (chunked prefill mixed with decode steps, as SGLang does), packed
into one [N] stream with no padding. Through `transformers` a decode step costs about 2 ms of fixed
overhead (mask building, output dataclasses, three projections where one would do); this computes
the same step directly: fused q/k/v and gate/up projections over all N tokens at once, rotary
embeddings from a table built once, each token's keys and values written to its slot of the paged
cache (generation/engine/paged.py), then attention: decode rows as two matmuls over their context's slots
(grouped-query heads as the query rows of one matmul, padded columns masked), prefill chunks through
SDPA with a causal mask offset by the tokens already cached. (`tools/bench_generation.py` measures
the engine; docs/generation.md says what this is worth.)

Only architectures whose forward this reproduces exactly are taken (`DecodeStep.for_model` returns
None for the rest, and the engine keeps the `transformers` forward and a left-padded cache for them:
generation/engine/kv_batch.py).

**Batch invariance** (`batch_invariant`: the server's --enable-deterministic-inference): a row's
logits are then bit-identical whatever else is in the batch, so a seeded request draws the same
tokens with the same logprobs alone or batched with any others (the trainer reads the logprobs in
its ratio π_θ/π_behav: a last-bit difference changes the trained weights). Two things make a row
depend on the batch on the CPU (measured with torch 2.13's MKL; tests/generation/test_batch_invariance.py):
a matmul computes a row differently when it has fewer than 4 rows (and, on several threads, some
row counts that are no multiple of 4), so every projection's rows are padded to a multiple of
`GEMM_ROWS`; and attention over padded columns sums a row's scores in an order that depends on
the padding, so each run of decode rows with the same context length (a group's answers) attends
over its own columns only. Prompts are then prefilled whole, never split into chunks whose bounds
depend on the other rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from areal_flow.generation.engine import cpu_decode, triton_decode
from areal_flow.generation.engine.lowrank import LowRank
from areal_flow.generation.engine.paged import BlockPool, slots

_MODEL_TYPES = frozenset({"llama", "qwen2"})
_STATIC_ROPE = frozenset({"default", "linear", "llama3"})  # cos/sin depend on the position only
GEMM_ROWS = 4
"""Batch-invariant matmuls have a multiple of this many rows (module docstring)."""


@dataclass
class Chunk:
    """A prefill chunk: `length` tokens of one row from `start` in the step's tokens."""

    start: int
    length: int
    slots: torch.Tensor  # [C] int64: the row's context (its earlier tokens and these), in order
    mask: torch.Tensor  # [length, C] bool: causal, offset by the C - length tokens before the chunk


@dataclass
class Forward:
    """One forward over new tokens of several rows, decode rows first (one token each), then
    prefill chunks. Each token's keys and values are written to its slot, then attended to."""

    tokens: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    write: torch.Tensor  # [N] int64: the slot of each token's keys and values
    decode: int  # the first `decode` tokens are the decode rows'
    decode_table: torch.Tensor  # [decode, blocks] int64: each decode row's block table (padded with block 0)
    decode_lengths: torch.Tensor  # [decode] int64: each decode row's context length
    decode_width: int  # the columns a decode row's attention spans: the longest context (or a graph's bucket)
    block_size: int  # the pool's: positions per block of the tables
    spans: list[tuple[int, int, int]] | None  # batch-invariant: (first row, end row, width) of equal contexts
    chunks: list[Chunk]
    logits_at: torch.Tensor  # [L] int64: the tokens whose logits are wanted


class DecodeStep:
    """`forward(step, pool) -> logits` (float32): decode rows and prefill chunks over the paged cache.

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
        # LoRA adapters served unmerged (generation/engine/lowrank.py): None without any.
        self.lowrank: LowRank | None = None
        # Decode attention reading each row's own blocks once, in place (no gathered copy nor
        # padding): the Triton kernel on CUDA (generation/engine/triton_decode.py), the C kernel on
        # the CPU (generation/engine/cpu_decode.py, batch-invariant by construction); torch's
        # matmuls over a gathered copy where neither runs.
        device, dtype = self.embed.weight.device, self.embed.weight.dtype
        self.paged_kernel = device.type == "cuda" and triton_decode.available(device) and not batch_invariant
        self.cpu_kernel = device.type == "cpu" and dtype == torch.float32 and cpu_decode.available()
        positions = torch.arange(model.config.max_position_embeddings)[None]
        probe = torch.zeros(1, dtype=self.embed.weight.dtype, device=self.embed.weight.device)
        cos, sin = inner.rotary_emb(probe, positions.to(probe.device))
        self.cos, self.sin = cos[0], sin[0]  # [max_positions, head_dim]

    @classmethod
    def for_model(cls, model: nn.Module, *, batch_invariant: bool = False) -> DecodeStep | None:
        """A DecodeStep for `model`, or None where its decode differs from what this computes."""
        return None if unsupported(model.config) else cls(model, batch_invariant=batch_invariant)

    def forward(self, step: Forward, pool: BlockPool) -> torch.Tensor:
        """Feed `step`'s tokens: write their keys and values into `pool` and return the logits
        [len(step.logits_at), V] (float32) at the tokens `step.logits_at`."""
        n = step.tokens.shape[0]
        hidden = self.embed(step.tokens[:, None])[:, 0]  # [N, hidden]; the embedding sees [N, 1] ids
        cos, sin = self.cos[step.positions][:, None], self.sin[step.positions][:, None]  # [N, 1, head_dim]
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        # The decode rows' context slots and padding bias, for every layer's torch attention (the
        # kernels read the block tables and lengths themselves).
        context = self._context(step) if step.decode and not (self.paged_kernel or self.cpu_kernel) else None
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = self.project(_rms_norm(hidden, layer.input_layernorm), i, "qkv", *self.qkv[i])
            # q and k side by side in one tensor: one rotation for both.
            qk = _rotate(qkv[:, : q_size + kv_size].view(n, -1, self.head_dim), cos, sin)
            q, k = qk[:, : self.heads], qk[:, self.heads:]
            v = qkv[:, q_size + kv_size:].view(n, self.kv_heads, self.head_dim)
            keys, values = pool.k[i], pool.v[i]  # [kv_heads, slots, head_dim]
            keys.index_copy_(1, step.write, k.transpose(0, 1))
            values.index_copy_(1, step.write, v.transpose(0, 1))
            outs = [self._decode_attention(q[: step.decode], keys, values, step, context)] if step.decode else []
            for chunk in step.chunks:  # a prefill chunk of one row: its queries over its context
                outs.append(F.scaled_dot_product_attention(
                    q[chunk.start: chunk.start + chunk.length].transpose(0, 1)[None],
                    keys.index_select(1, chunk.slots)[None], values.index_select(1, chunk.slots)[None],
                    attn_mask=chunk.mask, scale=self.scaling, enable_gqa=True)[0].transpose(0, 1))
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
            hidden = hidden + self.project(out.reshape(n, q_size), i, "o", attn.o_proj.weight, attn.o_proj.bias)
            gate, up = self.project(_rms_norm(hidden, layer.post_attention_layernorm), i, "gate_up",
                                    *self.gate_up[i]).chunk(2, dim=-1)
            hidden = hidden + self.project(F.silu(gate) * up, i, "down", mlp.down_proj.weight, mlp.down_proj.bias)
        return self.logits(_rms_norm(hidden[step.logits_at], self.norm))

    def _context(self, step: Forward) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode rows' context slots [D, W] (padded with slot 0) and attention bias [D, W]
        (0 on a row's context, -inf on its padding), from their block tables and lengths."""
        width, device = step.decode_width, step.decode_table.device
        columns = torch.arange(width, device=device)
        bias = torch.zeros(step.decode, width, dtype=self.embed.weight.dtype, device=device).masked_fill_(
            columns >= step.decode_lengths[:, None], float("-inf"))
        return slots(step.decode_table, width, step.block_size), bias

    def _decode_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: Forward,
                          context: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """One query per row [D, heads, head_dim] over its context's slots: [D, heads, head_dim].
        Grouped-query attention without repeating the cache: the heads that share a KV head are the
        query rows of one matmul."""
        if self.paged_kernel:
            return triton_decode.paged_decode_attention(q, keys, values, step.decode_table, step.decode_lengths,
                                                        step.block_size, self.scaling)
        if self.cpu_kernel:
            return cpu_decode.paged_decode_attention(q, keys, values, step.decode_table, step.decode_lengths,
                                                     step.block_size, self.scaling)
        decode_slots, decode_bias = context
        rows = decode_slots.shape[0]
        # KV heads first, rows second: the gathered context is contiguous for the batched matmuls,
        # and only the (small) queries are transposed.
        q = q.view(rows, self.kv_heads, -1, self.head_dim).transpose(0, 1)  # [kv_heads, D, group, head_dim]
        if step.spans is None:
            k, v = self._gather(keys, values, decode_slots)
            scores = torch.matmul(q, k.transpose(-1, -2)).mul_(self.scaling).add_(decode_bias[:, None])
            out = torch.matmul(torch.softmax(scores, dim=-1), v)
        else:
            # Batch-invariant: each run of rows with the same context gathers exactly its own
            # columns, so that no row's sums (nor its matmul's layout) depend on the other rows.
            out, q = q.new_empty(q.shape), q * self.scaling
            for a, b, used in step.spans:
                k, v = self._gather(keys, values, decode_slots[a:b, :used])
                scores = torch.matmul(q[:, a:b], k.transpose(-1, -2))
                out[:, a:b] = torch.matmul(torch.softmax(scores, dim=-1), v)
        return out.transpose(0, 1).reshape(rows, self.heads, self.head_dim)

    def _gather(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values at `slots` [rows, W]: [kv_heads, rows, W, head_dim] each, contiguous."""
        rows, width = slots.shape
        flat = slots.reshape(-1)
        return (keys.index_select(1, flat).view(self.kv_heads, rows, width, self.head_dim),
                values.index_select(1, flat).view(self.kv_heads, rows, width, self.head_dim))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer over final hidden states [N, hidden]: logits [N, V] (float32)."""
        return self.linear(hidden, self.lm_head.weight, self.lm_head.bias).float()

    def project(self, x: torch.Tensor, layer: int, group: str, weight: torch.Tensor, bias: torch.Tensor | None
                ) -> torch.Tensor:
        """Layer `layer`'s projection `group` (lowrank.GROUPS) of rows x: its weights', plus the
        low-rank path of its LoRA adapters where they are served unmerged (generation/engine/lowrank.py)."""
        out = self.linear(x, weight, bias)
        path = self.lowrank[layer].get(group) if self.lowrank is not None else None
        if path is not None:
            out = out + self.linear(self.linear(x, path.a), path.b)
        return out

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear over rows x [N, in]; batch-invariant: through a matmul of a multiple of GEMM_ROWS rows."""
        rows = x.shape[0]
        pad = -rows % GEMM_ROWS if self.batch_invariant else 0
        if pad == 0:
            return F.linear(x, weight, bias)
        return F.linear(F.pad(x, (0, 0, 0, pad)), weight, bias)[:rows]


def unsupported(config) -> str | None:
    """Why a model of this (transformers) config is not one DecodeStep computes exactly; None if it is."""
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    why = [(config.model_type not in _MODEL_TYPES, f"model_type {config.model_type} (not {', '.join(sorted(_MODEL_TYPES))})"),
           (getattr(config, "hidden_act", None) != "silu", f"hidden_act {getattr(config, 'hidden_act', None)}"),
           (rope not in _STATIC_ROPE, f"rope_type {rope}"),
           (bool(getattr(config, "use_sliding_window", False)), "sliding-window attention"),
           (getattr(config, "pretraining_tp", 1) != 1, "pretraining_tp != 1")]
    return next((reason for refused, reason in why if refused), None)


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """The model's RMSNorm as one fused op (its weight and epsilon)."""
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


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
