"""LoRA adapters computed at decode (generation.lora_decode=lowrank): the low-rank path beside each
adapted projection, as SGLang and vLLM serve LoRA.

A LoRA version is the base plus, for each adapted Linear layer, scaling · B·A (weights/adapter.py).
Instead of merging that into the served weights (generation/engine/adapters.py `Merge`), the engine's
own forward (generation/engine/decode.py) adds x·Aᵀ·(scaling·B)ᵀ to the projection's output. An update
then copies the adapters alone, the served weights stay the base, and no fp32 copy of the base is
kept. The decode step's fused projections take one path each: the A's of q, k and v stacked
([r_q + r_k + r_v, in]) and their B's as one block-diagonal matrix (the parts without adapters are
rows of zeros), and so gate and up.

The price is two small matmuls per adapted projection in every forward (`tools/bench_lora.py`
measures it against the merge).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
"""The decode step's projections (decode.py `DecodeStep.project`) and the Linear layers each computes."""
_MODULE = re.compile(r"model\.layers\.(\d+)\.(.+)")


@dataclass
class Path:
    """One projection's low-rank path: its output gains (x·aᵀ)·bᵀ."""

    a: torch.Tensor  # [R, in]: the parts' A's stacked
    b: torch.Tensor  # [out, R]: their B's block-diagonal, the scaling folded in


LowRank = list[dict[str, Path]]
"""Per layer, the paths of its projections that have adapters (GROUPS' names)."""


def unsupported(modules: dict[str, object], layers: int) -> str | None:
    """The first of adapted `modules` that no path computes (the model has `layers` decoder layers), or None."""
    for module in sorted(modules):
        m = _MODULE.fullmatch(module)
        if m is None or int(m[1]) >= layers or not any(m[2] in parts for parts in GROUPS.values()):
            return module
    return None


def build(layers: list[torch.nn.Module], modules: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float,
          *, device: torch.device, dtype: torch.dtype, where: str) -> LowRank:
    """The paths of adapters `modules` (module name -> (A, B)) for the decoder `layers`, in `dtype` on
    `device` (scaling · B computed in fp32, then cast). Every module must be one a path computes
    (`unsupported`); adapters of the wrong shape raise ValueError naming them (`where`: the update)."""
    assert unsupported(modules, len(layers)) is None
    found = {(int(m[1]), m[2]): ab for module, ab in modules.items() if (m := _MODULE.fullmatch(module))}
    paths: LowRank = []
    for i, layer in enumerate(layers):
        paths.append({})
        for group, parts in GROUPS.items():
            adapted = [part for part in parts if (i, part) in found]
            if not adapted:
                continue
            linears = [(part, layer.get_submodule(part)) for part in parts]
            # The parts' B's side by side, each in its own rows (the others' are zeros): block-diagonal.
            b_full = torch.zeros(sum(linear.out_features for _, linear in linears),
                                 sum(found[i, part][0].shape[0] for part in adapted), dtype=torch.float32)
            row = col = 0
            for part, linear in linears:
                if part in adapted:
                    a, b = found[i, part]
                    if a.shape[1] != linear.in_features or b.shape[0] != linear.out_features:
                        raise ValueError(f"{where}: model.layers.{i}.{part}'s adapters make a {b.shape[0]}×"
                                         f"{a.shape[1]} update of a ({linear.out_features}, {linear.in_features}) weight")
                    b_full[row: row + b.shape[0], col: col + b.shape[1]] = b.float() * scale
                    col += b.shape[1]
                row += linear.out_features
            a_full = torch.cat([found[i, part][0] for part in adapted])
            paths[i][group] = Path(a_full.to(device, dtype), b_full.to(device, dtype))
    return paths


def same_shapes(a: LowRank | None, b: LowRank) -> bool:
    """Whether `b`'s tensors can be copied into `a`'s in place (the same paths and ranks)."""
    return a is not None and len(a) == len(b) and all(
        x.keys() == y.keys() and all(x[g].a.shape == y[g].a.shape for g in x) for x, y in zip(a, b))


def copy_into(dest: LowRank, src: LowRank) -> None:
    """Copy `src`'s adapters into `dest`'s tensors in place (a captured CUDA graph reads those)."""
    for x, y in zip(dest, src):
        for group, path in x.items():
            path.a.copy_(y[group].a)
            path.b.copy_(y[group].b)
