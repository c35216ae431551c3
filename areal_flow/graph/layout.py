"""A model-parallel layout: data, tensor and pipeline parallel sizes, parsed and checked.

Written in a recipe as `parallel: {dp: 2, tp: 2, pp: 2}` or compactly as `d2p2t2` (the letters in
any order, each at most once, a missing one is 1). Checked against the node's mesh (dp·tp·pp
devices) and the model's config (TP divides the attention heads, the key/value heads, the FFN
width and the vocabulary; PP divides the layers). Imports nothing: the graph checks a node's layout
against its mesh, the launcher (`run/checks.py`) and the Megatron engine against the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_COMPACT = re.compile(r"([dtp])(\d+)")
_NAMES = {"d": "dp", "t": "tp", "p": "pp"}


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        return f"d{self.dp}p{self.pp}t{self.tp}"


def parse_layout(spec: Any, where: str) -> Layout:
    """`spec` is None (all 1), a mapping {dp, tp, pp} or a string like 'd2p2t2'; errors name `where`."""
    if spec is None:
        return Layout()
    if isinstance(spec, str):
        text = spec.strip()
        sizes: dict[str, int] = {}
        pos = 0
        for match in _COMPACT.finditer(text):
            if match.start() != pos:
                break
            letter = match.group(1)
            if _NAMES[letter] in sizes:
                raise ValueError(f"{where}: {spec!r} gives '{letter}' twice")
            sizes[_NAMES[letter]] = int(match.group(2))
            pos = match.end()
        if pos != len(text) or not text:
            raise ValueError(f"{where}: {spec!r} is not a layout like 'd2p2t2' (d data, t tensor, p pipeline; "
                             f"unexpected text at character {pos + 1})")
    elif hasattr(spec, "keys"):
        unknown = sorted(set(spec.keys()) - set(_NAMES.values()))
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r} (expected dp, tp, pp)")
        sizes = {k: spec[k] for k in spec.keys()}
    else:
        raise ValueError(f"{where}: {spec!r} is neither a mapping {{dp, tp, pp}} nor a string like 'd2p2t2'")
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {key}={value!r} must be an integer >= 1")
    return Layout(**sizes)


def layout_problems(layout: Layout, *, n_devices: int | None, model: Any | None, where: str) -> list[str]:
    """What is wrong with `layout` on a mesh of `n_devices` for a Hugging Face `model` config."""
    problems = []
    if n_devices is not None and layout.size != n_devices:
        problems.append(f"{where}: layout {layout} needs dp·tp·pp = {layout.dp}·{layout.tp}·{layout.pp} = "
                        f"{layout.size} devices, the mesh has {n_devices}")
    if model is None:
        return problems
    for key, what in (("num_attention_heads", "attention heads"), ("num_key_value_heads", "key/value heads"),
                      ("intermediate_size", "FFN width (intermediate_size)"), ("vocab_size", "vocabulary")):
        value = getattr(model, key, None)
        if value is not None and value % layout.tp:
            problems.append(f"{where}: tp={layout.tp} does not divide the model's {what} ({value})")
    layers = model.num_hidden_layers
    if layout.pp > layers:
        problems.append(f"{where}: pp={layout.pp} is more than the model's {layers} layers")
    elif layers % layout.pp:
        problems.append(f"{where}: pp={layout.pp} does not divide the model's {layers} layers")
    return problems
