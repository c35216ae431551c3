"""Which device a process computes on, in which number format, and whether this machine has the
devices a config asks for.

One code path for CPU and GPU: every engine takes the device and dtype these functions give. A
process placed on GPUs sees only its own (the launchers set CUDA_VISIBLE_DEVICES from the
placement: launchers/local.py, ray_cluster.py, slurm_job.py), so on CUDA its device is always
`cuda:0` of what it sees. On the CPU a device is a core, and the process is pinned to its cores.

Number formats: `auto` is bfloat16 on CUDA (the format GPUs train and serve LLMs in) and float32 on
the CPU, where bfloat16 matmuls are slow and the tests compare against float32 references. Master
weights, optimizer state and gradient reductions stay float32 whatever the compute dtype, and the
logprobs the loss sees are float32 (the engines cast before log_softmax).
"""

from __future__ import annotations

import os
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16}
"""Config names of number formats (SGLang's --dtype names included) -> torch dtypes."""

TRAINER_BACKENDS = {"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl"}
"""The trainer ranks' process-group backend per cluster.device_type. On CUDA the group has both: the
engines' collectives on GPU tensors (FSDP2's gathers and reductions, megatron's) run over NCCL, the
small bookkeeping ones on CPU tensors (micro-batch counts, token totals, stats) over gloo."""


def local_device(device_type: str) -> torch.device:
    """This process's compute device for `cluster.device_type`: its first visible GPU, or the CPU.
    Raises RuntimeError naming what is missing when CUDA is asked for and this process sees no GPU
    (a launcher that gave it none, or a CPU build of torch)."""
    if device_type == "cpu":
        return torch.device("cpu")
    if device_type != "cuda":
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"cluster.device_type='cuda' but this process sees no GPU (torch {torch.__version__}, "
                           f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r})")
    torch.cuda.set_device(0)  # NCCL and the caching allocator use the current device
    return torch.device("cuda", 0)


def compute_dtype(name: str | None, device_type: str) -> torch.dtype:
    """The dtype a config name means on `device_type`; None or 'auto' is bfloat16 on CUDA, float32
    on the CPU."""
    if name in (None, "auto"):
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def visible_gpus() -> int:
    """GPUs torch sees in this process (0 with a CPU build)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_problems(n_devices: int, found: int) -> list[str]:
    """What is wrong with asking for `n_devices` GPUs per node on a host where torch sees `found`."""
    if found == 0:
        return [f"cluster.device_type='cuda' but torch {torch.__version__} sees no GPU on this machine (CUDA "
                "available: False): use cluster.device_type=cpu, or run on a machine with NVIDIA GPUs and a "
                "CUDA build of torch"]
    if n_devices > found:
        return [f"cluster.n_devices={n_devices} GPUs asked for, but torch sees {found} on this machine: lower "
                f"cluster.n_devices to at most {found} (and the meshes with it)"]
    return []


def to_device(data: Any, device: torch.device | str | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host data (an array, a list or a CPU tensor; `dtype`, when given, its dtype) as a tensor on
    `device` (None: the CPU), without making the host wait.

    On CUDA a plain `.to("cuda")` from pageable memory is a copy followed by a synchronisation of
    the stream (torch's `memcpy_and_sync`): the host waits for every kernel queued before it, and
    the GPU then idles while the host prepares the next launches (a trainer's next micro-batch, a
    generation engine's next step queued behind its forward). Staged through pinned memory, the
    copy is queued on the stream like a kernel (`non_blocking`); torch's caching host allocator
    keeps the pinned buffer until the copy has run. Elsewhere (CPU) it is the plain conversion."""
    tensor = torch.as_tensor(data, dtype=dtype)
    device = torch.device("cpu" if device is None else device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
