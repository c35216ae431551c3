"""What megatron-core 0.16 needs to run on a machine without a GPU; used ONLY to run on the CPU.

megatron-core assumes CUDA in a few places that no config flag avoids: the pipeline schedules and
the p2p layer allocate with `device="cuda"` or `torch.cuda.current_device()` and call
`torch.cuda.synchronize()`; DistributedDataParallel allocates its gradient buffers on
`torch.cuda.current_device()`; the tensor-parallel RNG tracker saves and restores the CUDA RNG.
When the engine runs on the CPU (always, without a GPU), `cpu_mode()` changes, for as long as it
is entered and nothing else:

- `torch.cuda.current_device` returns 0 and `torch.cuda.synchronize` does nothing;
- `torch.cuda.get_rng_state` / `set_rng_state` / `manual_seed` (and megatron's own
  `tensor_parallel.random._get_cuda_rng_state` / `_set_cuda_rng_state`) use the CPU generator;
- a `TorchFunctionMode` rewrites a `device=` argument of "cuda", "cuda:N" or an int to "cpu" in
  every torch call.

What it cannot make work, and what the engine therefore avoids on CPU: the distributed optimizer,
megatron's gradient clipping (the engine clips by hand), the bf16 mixed-precision optimizer and
sequence parallel (they require CUDA tensor types or TransformerEngine). On a GPU none of this is
entered: the engine runs megatron-core as it is (docs/architecture.md, "Training engines").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

_PATCHED_CUDA = {
    "current_device": lambda: 0,
    "synchronize": lambda device=None: None,
    "get_rng_state": lambda device="cuda": torch.get_rng_state(),
    "set_rng_state": lambda new_state, device="cuda": torch.set_rng_state(new_state),
    "manual_seed": lambda seed: torch.manual_seed(seed),
}


def _is_cuda(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Rewrites `device=` CUDA arguments of torch calls to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_mode() -> Iterator[None]:
    """The changes above, undone on exit. The engine enters it only to run on the CPU."""
    from megatron.core.tensor_parallel import random as mrandom

    saved = {name: getattr(torch.cuda, name) for name in _PATCHED_CUDA}
    saved_random = (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)
    for name, fn in _PATCHED_CUDA.items():
        setattr(torch.cuda, name, fn)
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    try:
        with _CudaToCpu():
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)
        mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = saved_random
