"""LoRA updates on a server (training.lora; weights/adapter.py has the format): a weight update that
is a PEFT adapter directory is merged here into the base model it names.

The merge is W + scaling · B·A in fp32 (one addmm, written into the served weight in place on the
decode thread), from a copy of the base's adapted weights kept in fp32 (read from the base's files
at the first update): each version is the base plus its own adapters, never a previous merge plus a
difference, so no rounding accumulates, and the result is bit for bit what the trainer merges
(training/lora.py). The copy costs the adapted weights again in fp32 on the server's device
(docs/lora.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from areal_flow.generation.engine.checkpoint import load_checkpoint
from areal_flow.weights import adapter as adapter_files


@dataclass
class Merge:
    """One update's adapters, checked against the served model, ready to merge into it."""

    parts: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]  # (weight name, fp32 base, A, B)
    scale: float
    digest: str

    def __call__(self, model: torch.nn.Module) -> None:
        """Merge into `model`'s weights in place (the decode thread, between two steps)."""
        params = model.state_dict()  # views of the served tensors (the decode step's fused ones too)
        with torch.no_grad():
            for name, base, a, b in self.parts:
                adapter_files.merge(base, a, b, self.scale, out=params[name])


class Adapters:
    """The base weights LoRA updates merge into, for one served `model`."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model, self.device = model, device
        self.base_path: str | None = None
        self.base: dict[str, torch.Tensor] = {}  # adapted weight name -> the base's, fp32 on the device

    def prepare(self, path: str) -> Merge:
        """The merge of the adapter directory `path`, read and checked on the caller's thread. A
        directory that does not fit raises ValueError naming what is wrong; nothing is changed."""
        config, tensors = adapter_files.read_dir(path)
        return self.prepare_tensors(config, tensors, path)

    def prepare_tensors(self, config: dict, tensors: dict[str, torch.Tensor], path: str) -> Merge:
        """The merge of adapters given as tensors (file names) with their config (r, lora_alpha,
        use_rslora, base_model_name_or_path); `path` names them in errors."""
        modules = adapter_files.pairs(tensors)
        params = self.model.state_dict()
        if unknown := sorted(f"{m}.weight" for m in modules if f"{m}.weight" not in params):
            raise ValueError(f"{path}: adapters of weights the served model does not have: {unknown[:3]}")
        self._load_base(path, config.get("base_model_name_or_path"), {f"{m}.weight" for m in modules})
        parts = []
        for module, (a, b) in modules.items():
            name = f"{module}.weight"
            if (b.shape[0], a.shape[1]) != tuple(params[name].shape):
                raise ValueError(f"{path}: {module}'s adapters make a {b.shape[0]}×{a.shape[1]} update of a "
                                 f"{tuple(params[name].shape)} weight")
            parts.append((name, self.base[name], a.to(self.device, torch.float32), b.to(self.device, torch.float32)))
        return Merge(parts, adapter_files.scaling(config), adapter_files.digest(tensors))

    def _load_base(self, path: str, base_path: str | None, names: set[str]) -> None:
        """Read the adapted weights of the base the adapters of `path` name (once, and again for
        another base or more adapted weights)."""
        if not base_path:
            raise ValueError(f"{path}/{adapter_files.CONFIG}: no base_model_name_or_path to merge the adapters into")
        if base_path == self.base_path and names <= set(self.base):
            return
        weights = load_checkpoint(base_path)
        if missing := sorted(n for n in names if n not in weights):
            raise ValueError(f"{path}: the base {base_path} has no {missing[:3]}")
        self.base = {n: weights[n].to(self.device, torch.float32) for n in names}
        self.base_path = base_path
