"""LoRA updates on a server (training.lora; weights/adapter.py has the format): a weight update that
is a PEFT adapter directory, or adapters sent as tensors, applied to the base model it names.

Two ways (generation.lora_decode, measured in docs/lora.md):
- **lowrank** (the default where the engine's own decode step runs and serves that base): the
  adapters become low-rank paths beside the projections (generation/engine/lowrank.py); an update
  copies them alone, the served weights stay the base.
- **merge** (also every other case: a model the decode step does not take, adapters of modules it
  has no path for, weights that are no longer the base): W + scaling · B·A in fp32 (one addmm,
  written into the served weight in place on the decode thread), from a copy of the base's adapted
  weights kept in fp32 (read from the base's files at the first update): each version is the base
  plus its own adapters, never a previous merge plus a difference, so no rounding accumulates, and
  the result is bit for bit what the trainer merges (training/lora.py). The copy costs the adapted
  weights again in fp32 on the server's device.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from areal_flow.generation.engine import lowrank
from areal_flow.generation.engine.checkpoint import load_checkpoint
from areal_flow.generation.engine.decode import DecodeStep
from areal_flow.weights import adapter as adapter_files

logger = logging.getLogger(__name__)


@dataclass
class Merge:
    """One update's adapters, checked against the served model, ready to merge into it."""

    parts: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]  # (weight name, fp32 base, A, B)
    scale: float
    digest: str
    step: DecodeStep | None  # whose low-rank paths the merged weights replace

    def __call__(self, model: torch.nn.Module) -> None:
        """Merge into `model`'s weights in place (the decode thread, between two steps)."""
        if self.step is not None:
            self.step.lowrank = None
        params = model.state_dict()  # views of the served tensors (the decode step's fused ones too)
        with torch.no_grad():
            for name, base, a, b in self.parts:
                adapter_files.merge(base, a, b, self.scale, out=params[name])


@dataclass
class Install:
    """One update's adapters as low-rank paths, ready to install in the decode step."""

    paths: lowrank.LowRank
    step: DecodeStep
    digest: str

    def __call__(self, model: torch.nn.Module) -> None:
        """Install the paths (the decode thread, between two steps): copied into the current ones
        in place where their shapes match, so that captured CUDA graphs stay valid."""
        if lowrank.same_shapes(self.step.lowrank, self.paths):
            lowrank.copy_into(self.step.lowrank, self.paths)
        else:
            self.step.lowrank = self.paths


class Adapters:
    """How LoRA updates apply to one served `model`: as low-rank paths of its decode `step` (None:
    merged), and the base weights merges start from."""

    def __init__(self, model: torch.nn.Module, device: torch.device, *, step: DecodeStep | None,
                 served_base: str) -> None:
        self.model, self.device, self.step = model, device, step
        self.served_base: str | None = os.path.realpath(served_base)
        """The base the served weights are (the model loaded at start); None once a merge or a full
        update changed them: low-rank paths add to the base alone."""
        self.base_path: str | None = None
        self.base: dict[str, torch.Tensor] = {}  # adapted weight name -> the base's, fp32 on the device

    def replaced(self, path: str | None) -> Callable[[torch.nn.Module], None]:
        """A full-weight update replaces the served weights, with the model at `path` (None: some of
        them, a broadcast's bucket): what drops the low-rank paths on the decode thread."""
        self.served_base = None if path is None else os.path.realpath(path)
        step = self.step

        def drop(model: torch.nn.Module) -> None:
            if step is not None:
                step.lowrank = None
        return drop

    def prepare(self, path: str) -> Merge | Install:
        """The application of the adapter directory `path`, read and checked on the caller's thread. A
        directory that does not fit raises ValueError naming what is wrong; nothing is changed."""
        config, tensors = adapter_files.read_dir(path)
        return self.prepare_tensors(config, tensors, path)

    def prepare_tensors(self, config: dict, tensors: dict[str, torch.Tensor], path: str) -> Merge | Install:
        """The application of adapters given as tensors (file names) with their config (r,
        lora_alpha, use_rslora, base_model_name_or_path); `path` names them in errors."""
        modules = adapter_files.pairs(tensors)
        params = self.model.state_dict()
        if unknown := sorted(f"{m}.weight" for m in modules if f"{m}.weight" not in params):
            raise ValueError(f"{path}: adapters of weights the served model does not have: {unknown[:3]}")
        base_path = config.get("base_model_name_or_path")
        if not base_path:
            raise ValueError(f"{path}/{adapter_files.CONFIG}: no base_model_name_or_path to merge the adapters into")
        if self.step is not None and self.served_base == os.path.realpath(base_path):
            if (module := lowrank.unsupported(modules, len(self.step.layers))) is None:
                paths = lowrank.build(self.step.layers, modules, adapter_files.scaling(config), device=self.device,
                                      dtype=self.step.embed.weight.dtype, where=path)
                return Install(paths, self.step, adapter_files.digest(tensors))
            logger.warning("%s: adapters of %s, which the low-rank path does not compute: merged into the weights",
                           path, module)
        self._load_base(path, base_path, {f"{m}.weight" for m in modules})
        parts = []
        for module, (a, b) in modules.items():
            name = f"{module}.weight"
            if (b.shape[0], a.shape[1]) != tuple(params[name].shape):
                raise ValueError(f"{path}: {module}'s adapters make a {b.shape[0]}×{a.shape[1]} update of a "
                                 f"{tuple(params[name].shape)} weight")
            parts.append((name, self.base[name], a.to(self.device, torch.float32), b.to(self.device, torch.float32)))
        self.served_base = None  # merged from here on: the served weights are no longer the base
        return Merge(parts, adapter_files.scaling(config), adapter_files.digest(tensors), self.step)

    def _load_base(self, path: str, base_path: str, names: set[str]) -> None:
        """Read the adapted weights of the base the adapters of `path` name (once, and again for
        another base or more adapted weights)."""
        if base_path == self.base_path and names <= set(self.base):
            return
        weights = load_checkpoint(base_path)
        if missing := sorted(n for n in names if n not in weights):
            raise ValueError(f"{path}: the base {base_path} has no {missing[:3]}")
        self.base = {n: weights[n].to(self.device, torch.float32) for n in names}
        self.base_path = base_path
