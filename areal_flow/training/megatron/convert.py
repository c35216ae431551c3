"""Hugging Face <-> megatron-core weights, exact both ways, for any tensor/pipeline split.

A megatron rank holds, for its pipeline stage's layers, its tensor-parallel shard of each weight
under megatron's local-spec names. Each rule below maps one megatron parameter to the Hugging Face
tensor(s) it is made of and says how it is split over the TP ranks:

- column-parallel (split on the output dim, dim 0): embedding and output layer (by vocab),
  fused QKV and fused gate/up (FC1);
- row-parallel (split on the input dim, dim 1): attention output and FC2;
- replicated: the RMSNorm weights.

Fused QKV: megatron orders the rows by query group, [q heads of group g, k of g, v of g] for each
group, so that a TP shard is a contiguous run of whole groups. Fused FC1: a TP shard is
[gate shard; up shard]. Both are undone exactly on the way back: conversion only moves values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# megatron suffix -> (Hugging Face names with {i} for the layer, kind)
_LAYER_RULES = {
    "input_layernorm.weight": (("model.layers.{i}.input_layernorm.weight",), "replicated"),
    "pre_mlp_layernorm.weight": (("model.layers.{i}.post_attention_layernorm.weight",), "replicated"),
    "self_attention.linear_qkv.weight": (tuple(f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
    "self_attention.linear_qkv.bias": (tuple(f"model.layers.{{i}}.self_attn.{p}_proj.bias" for p in "qkv"), "qkv"),
    "self_attention.linear_proj.weight": (("model.layers.{i}.self_attn.o_proj.weight",), "row"),
    "mlp.linear_fc1.weight": (("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"), "fc1"),
    "mlp.linear_fc2.weight": (("model.layers.{i}.mlp.down_proj.weight",), "row"),
}
_TOP_RULES = {
    "embedding.word_embeddings.weight": (("model.embed_tokens.weight",), "column"),
    "decoder.final_layernorm.weight": (("model.norm.weight",), "replicated"),
    "output_layer.weight": (("lm_head.weight",), "column"),
}


@dataclass(frozen=True)
class Heads:
    """What the QKV rule needs: attention heads, key/value heads (query groups), head dim."""

    n_heads: int
    n_groups: int
    head_dim: int


@dataclass(frozen=True)
class Rule:
    hf_names: tuple[str, ...]
    kind: str  # replicated | column | row | qkv | fc1


def rule(megatron_name: str, global_layer: dict[int, int]) -> Rule:
    """The rule of a megatron parameter of this rank; `global_layer` maps the stage's local layer
    index to the model's layer index (pipeline stages number their layers from 0)."""
    if megatron_name in _TOP_RULES:
        names, kind = _TOP_RULES[megatron_name]
        return Rule(names, kind)
    match = _LAYER.match(megatron_name)
    if match and match.group(2) in _LAYER_RULES:
        names, kind = _LAYER_RULES[match.group(2)]
        i = global_layer[int(match.group(1))]
        return Rule(tuple(n.format(i=i) for n in names), kind)
    raise KeyError(f"no Hugging Face rule for megatron parameter {megatron_name!r}")


def to_megatron(kind: str, hf: list[torch.Tensor], tp: int, tp_rank: int, heads: Heads) -> torch.Tensor:
    """This TP rank's shard of the megatron parameter made of the Hugging Face tensors `hf`."""
    if kind == "replicated":
        return hf[0].clone()
    if kind == "column":
        return hf[0].chunk(tp, dim=0)[tp_rank].clone()
    if kind == "row":
        return hf[0].chunk(tp, dim=1)[tp_rank].clone()
    if kind == "fc1":
        gate, up = hf
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]])
    if kind == "qkv":
        q, k, v = hf
        per_group = heads.n_heads // heads.n_groups
        rest = q.shape[1:]
        q = q.reshape(heads.n_groups, per_group * heads.head_dim, *rest)
        k = k.reshape(heads.n_groups, heads.head_dim, *rest)
        v = v.reshape(heads.n_groups, heads.head_dim, *rest)
        fused = torch.cat([q, k, v], dim=1)  # [groups, (per_group + 2) * head_dim, ...]
        return fused.chunk(tp, dim=0)[tp_rank].reshape(-1, *rest).clone()
    raise ValueError(f"unknown conversion kind {kind!r}")


def to_hf(kind: str, shards: list[torch.Tensor], heads: Heads) -> list[torch.Tensor]:
    """The Hugging Face tensors of a megatron parameter, from all its TP shards in TP-rank order."""
    if kind == "replicated":
        return [shards[0]]
    if kind == "column":
        return [torch.cat(shards, dim=0)]
    if kind == "row":
        return [torch.cat(shards, dim=1)]
    if kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    if kind == "qkv":
        per_group = heads.n_heads // heads.n_groups
        full = torch.cat(shards, dim=0)
        rest = full.shape[1:]
        fused = full.reshape(heads.n_groups, (per_group + 2) * heads.head_dim, *rest)
        q, k, v = fused.split([per_group * heads.head_dim, heads.head_dim, heads.head_dim], dim=1)
        return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]
    raise ValueError(f"unknown conversion kind {kind!r}")
