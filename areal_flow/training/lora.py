"""Low-rank adapters (`training.lora`, LoRA through peft) on the torch engine's model.

peft injects its LoRA layers into the transformers model in place (`inject_adapter_in_model`): the
model keeps its class and forward, every targeted Linear becomes `base_layer` (frozen) plus
`lora_A`/`lora_B` (trained), whose product, scaled by alpha / r (alpha / √r with rslora), adds to
the base layer's output. Only the adapters train, so the optimizer holds their state alone.

What leaves the trainer:
- `merged`: the base with every adapter merged in fp32 (weights/adapter.py `merge`), under the
  Hugging Face names of the model without adapters (what `from_pretrained` loads);
- the adapters alone, under their file names (`adapter_name`:
  `model.layers.0.self_attn.q_proj.lora_A.weight`), as `write_adapter_dir` writes them: a PEFT adapter
  directory that `peft.PeftModel.from_pretrained` loads and a server merges (a weight update).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from areal_flow.config.schema import LORA_TARGETS
from areal_flow.weights import adapter as adapter_files

ADAPTER = "default"
"""peft's name of the one adapter the engine trains."""


@dataclass(frozen=True)
class LoraSpec:
    """The adapters: rank, alpha, dropout, which Linear layers (names, or one regex matched against
    each module's full name), peft's init, and rslora's scaling."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = tuple(LORA_TARGETS)
    target_regex: str | None = None
    init: str = "default"
    rslora: bool = False

    @classmethod
    def of(cls, cfg) -> LoraSpec | None:
        """The spec of a config's `training.lora` section, or None where rank is 0 (no LoRA)."""
        if not cfg.rank:
            return None
        return cls(rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout, target_modules=tuple(cfg.target_modules),
                   target_regex=cfg.target_regex, init=cfg.init, rslora=cfg.rslora)

    @property
    def scaling(self) -> float:
        return self.alpha / (self.rank ** 0.5 if self.rslora else self.rank)

    def peft_config(self, base: str | None = None):
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout,
                          target_modules=self.target_regex or list(self.target_modules),
                          init_lora_weights=True if self.init == "default" else self.init, use_rslora=self.rslora,
                          bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base)


def inject(model: nn.Module, spec: LoraSpec) -> None:
    """Put the adapters into `model` in place; only they train. A target that matches no Linear is
    a ValueError naming the key."""
    from peft import inject_adapter_in_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    key = "training.lora.target_regex" if spec.target_regex else "training.lora.target_modules"
    try:
        inject_adapter_in_model(spec.peft_config(), model, adapter_name=ADAPTER)
    except ValueError as e:  # peft's NoMatchingPeftModuleError is one
        raise ValueError(f"{key}={spec.target_regex or list(spec.target_modules)}: {e}") from None
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if not layers or not all(isinstance(layer.get_base_layer(), nn.Linear) for layer in layers):
        raise ValueError(f"{key}: LoRA here adapts Linear layers only")
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(module name, peft LoRA layer) of every adapted Linear, in the model's order."""
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoraLayer)]


def hf_name(name: str) -> str:
    """A parameter's name in the model without adapters (`q_proj.base_layer.weight` -> `q_proj.weight`)."""
    return name.replace(".base_layer.", ".")


def adapter_name(name: str) -> str:
    """peft's file name of an adapter parameter (without the adapter's own name)."""
    return name.replace(f".{ADAPTER}.", ".")


def merged(named: Iterator[tuple[str, torch.Tensor]], spec: LoraSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights of the model without adapters, each adapted base weight merged with its adapter
    in fp32 (weights/adapter.py `merge`), from the adapted model's named parameters in order (full
    tensors: the caller gathers shards)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        if not (is_adapter(name) or ".base_layer.weight" in name):
            yield hf_name(name), tensor
            continue
        module = name.split(".base_layer.")[0] if ".base_layer." in name else name.split(".lora_")[0]
        parts = pending.setdefault(module, {})
        parts["A" if ".lora_A." in name else "B" if ".lora_B." in name else "W"] = tensor
        if len(parts) == 3:
            del pending[module]
            yield f"{module}.weight", adapter_files.merge(parts["W"], parts["A"], parts["B"], spec.scaling)
    if pending:
        raise RuntimeError(f"adapted layers without their three tensors: {sorted(pending)[:3]}")


def write_adapter_dir(path: str, tensors: dict[str, torch.Tensor], spec: LoraSpec, base: str | None) -> None:
    """A PEFT adapter directory at `path` (an existing folder): adapter_config.json and the
    adapters' tensors (`tensors`, under their file names: `adapter_name`) as PeftModel names them,
    which `PeftModel.from_pretrained` loads and a server merges (weights/adapter.py)."""
    from safetensors.torch import save_file

    spec.peft_config(base).save_pretrained(path)
    save_file({adapter_files.PEFT_PREFIX + k: v.contiguous() for k, v in tensors.items()},
              os.path.join(path, adapter_files.WEIGHTS), metadata={"format": "pt"})
