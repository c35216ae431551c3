"""LoRA adapters as a weight update carries them (training.lora; docs/lora.md): both ends' share.

With adapters, a version is the base model plus each adapted Linear layer's A (rank × in) and B
(out × rank): its weight is W + scaling · B·A. An update carries A and B alone, as a PEFT adapter
directory (`adapter_config.json`, whose `base_model_name_or_path` names the base, and
`adapter_model.safetensors`). A server adds their low-rank path at decode, or merges them into its
own copy of the base, in fp32, and casts the result once to its dtype (`merge`), so no rounding of an
earlier version carries over (generation/engine/adapters.py).

The adapters' `digest` (their names, dtypes, shapes and bytes) is what a server reports back for the
version it applied, with the update and with every answer, and what the controller checks against
the trainer's (controller/adapter_check.py): an adapter that never arrived, or arrived damaged, stops
the run naming the server (veRL #7495: an adapter that silently never reached the rollout engine).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from areal_flow.weights.digest import weights_digest

if TYPE_CHECKING:  # torch is imported where tensors are handled: the rollout workers' client reads this module too
    import torch

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""What peft's PeftModel puts before the model's own names in an adapter file."""


def is_adapter_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG))


def base_of(path: str) -> str:
    """The model a server loads for `path`: the base an adapter directory names, or `path` itself."""
    if not is_adapter_dir(path):
        return path
    try:
        with open(os.path.join(path, CONFIG)) as f:
            base = json.load(f).get("base_model_name_or_path")
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{os.path.join(path, CONFIG)}: cannot be read as an adapter config ({e})") from None
    if not base:
        raise ValueError(f"{os.path.join(path, CONFIG)}: no base_model_name_or_path to merge the adapters into")
    return base


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """The adapters' digest: their names (sorted), dtypes, shapes and bytes (weights/digest.py)."""
    return weights_digest(sorted(tensors.items()))


def arrival_problem(answer: dict, expected: str, version: int | str | None) -> str | None:
    """Why a server's answer to a LoRA update shows the adapters did not arrive as the trainer sent
    them (digest `expected`), or None when they did."""
    got = answer.get("adapter_digest")
    if got == expected:
        return None
    return (f"weight version {version}: the server applied adapters of digest {got}, the trainer sent {expected}: "
            "the adapter did not arrive as sent")


def transfer_config(config: dict) -> dict:
    """What a server needs of an adapter config to merge adapters sent as tensors (broadcast or
    handle): their scaling and their base."""
    return {k: config[k] for k in ("r", "lora_alpha", "use_rslora", "base_model_name_or_path") if k in config}


def check_config(config: object) -> dict:
    """A `lora_config` field of a weight update request, checked: a ValueError says what is wrong."""
    if not isinstance(config, dict):
        raise ValueError(f"lora_config must be an object, got {type(config).__name__}")
    r, alpha, base = config.get("r"), config.get("lora_alpha"), config.get("base_model_name_or_path")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"lora_config.r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise ValueError(f"lora_config.lora_alpha must be a positive number, got {alpha!r}")
    if not isinstance(base, str) or not base:
        raise ValueError(f"lora_config.base_model_name_or_path must name the base model, got {base!r}")
    return config


def scaling(config: dict) -> float:
    """alpha / r, or alpha / √r with rslora (peft's adapter_config.json keys)."""
    r = config["r"]
    return config["lora_alpha"] / (r ** 0.5 if config.get("use_rslora") else r)


def merge(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, out: torch.Tensor | None = None
          ) -> torch.Tensor:
    """W + scale · B·A computed in fp32 (one addmm: the trainer's merge and a server's are the same
    operation, so bit for bit the same), cast once to W's dtype; into `out` (an fp32 tensor of W's
    shape: a served weight, merged in place) when given."""
    import torch

    if out is not None and out.dtype == torch.float32:
        return torch.addmm(base.float(), b.float(), a.float(), alpha=scale, out=out)
    merged = torch.addmm(base.float(), b.float(), a.float(), alpha=scale)
    return merged.to(base.dtype) if out is None else out.copy_(merged)


def pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module name -> (A, B) from adapter tensors named `<module>.lora_A.weight`/`.lora_B.weight`;
    a ValueError names a module missing one of them or a name of another form."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        for side in ("A", "B"):
            suffix = f".lora_{side}.weight"
            if name.endswith(suffix):
                found.setdefault(name[: -len(suffix)], {})[side] = t
                break
        else:
            raise ValueError(f"adapter tensor {name!r} is neither <module>.lora_A.weight nor <module>.lora_B.weight")
    if lonely := sorted(m for m, sides in found.items() if len(sides) != 2):
        raise ValueError(f"adapters without both A and B: {lonely[:3]}")
    for module, sides in found.items():
        a, b = sides["A"], sides["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not (r, in) and (out, r)")
    return {m: (sides["A"], sides["B"]) for m, sides in found.items()}


def read_dir(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT adapter directory's config and tensors (names without peft's prefix); a missing or
    unreadable file is a ValueError naming it."""
    from safetensors.torch import load_file

    files = {name: os.path.join(path, name) for name in (CONFIG, WEIGHTS)}
    try:
        with open(files[CONFIG]) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{files[CONFIG]}: cannot be read as an adapter config ({e})") from None
    if config.get("peft_type", "LORA") != "LORA" or not isinstance(config.get("r"), int) or "lora_alpha" not in config:
        raise ValueError(f"{files[CONFIG]}: not a LoRA adapter config (peft_type LORA with r and lora_alpha)")
    try:
        tensors = load_file(files[WEIGHTS])
    except Exception as e:  # safetensors raises its own types for a truncated or corrupt file
        raise ValueError(f"{files[WEIGHTS]}: cannot be read ({e})") from None
    return config, {k.removeprefix(PEFT_PREFIX): v for k, v in tensors.items()}
