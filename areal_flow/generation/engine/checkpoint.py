"""The served model and its weights: loading the model, reading a checkpoint's tensors, and
refusing new weights that would not fit it (before any of them is copied in)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def load_model(model_path: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The Hugging Face model of `model_path` on `device`, for inference; refuses the
    architectures the engine cannot serve (sliding-window attention layers)."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa")
    model.to(device).eval().requires_grad_(False)
    if any(kind != "full_attention" for kind in getattr(model.config, "layer_types", None) or ()):
        raise ValueError(f"{model_path}: sliding-window attention layers are not supported by the embedded engine")
    return model


def eos_ids(model: torch.nn.Module) -> frozenset[int]:
    """The eos ids of the config and the generation config together (as SGLang does)."""
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    return frozenset(ids)


def load_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Read the weights of a Hugging Face directory (model.safetensors, or an index of shards)."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model_path {path!r} is not a directory")
    index = root / "model.safetensors.index.json"
    if (root / "model.safetensors").is_file():
        files = [root / "model.safetensors"]
    elif index.is_file():
        files = [root / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        raise FileNotFoundError(f"model_path {path!r} has no model.safetensors or model.safetensors.index.json")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(file))
        except Exception as exc:  # safetensors raises its own error types for truncated/corrupt files
            raise ValueError(f"cannot read weights from {file}: {exc}") from exc
    return state


def check_compatible(model: torch.nn.Module, what: str, state: dict[str, torch.Tensor], *, complete: bool) -> None:
    """Refuse weights that would not fit `model`, naming the first few tensors at fault;
    `complete`: every weight must be there (a checkpoint, not a bucket)."""
    expected = model.state_dict()
    unknown = sorted(set(state) - set(expected))
    # named_parameters() drops duplicates, so a tied lm_head may be absent from the file.
    missing = sorted({name for name, _ in model.named_parameters()} - set(state)) if complete else []
    wrong = [f"{n} {tuple(t.shape)} != {tuple(expected[n].shape)}" for n, t in state.items()
             if n in expected and t.shape != expected[n].shape]
    not_float = [f"{n} {str(t.dtype).removeprefix('torch.')}" for n, t in state.items()
                 if n in expected and not t.is_floating_point() and expected[n].is_floating_point()]
    problems = [
        f"unknown weights {unknown[:3]}" if unknown else "",
        f"missing weights {missing[:3]}" if missing else "",
        f"shape mismatch {wrong[:3]}" if wrong else "",
        f"not floating point {not_float[:3]}" if not_float else "",
    ]
    if any(problems):
        raise ValueError(f"{what} do not fit the served model: " + "; ".join(p for p in problems if p))


def copy_in(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into the model's tensors in place (a floating dtype is cast as it is copied)."""
    params = model.state_dict()  # these tensors share storage with the model's
    for name, tensor in state.items():
        params[name].copy_(tensor)
