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
  every torch call, and answers `tensor.type()` of a CPU tensor with its CUDA name
  ("torch.cuda.FloatTensor"): megatron's bf16 and distributed optimizers and its gradient clipping
  accept only those;
- the backward of custom autograd Functions (`BackwardCFunction.apply`) runs with that mode entered
  again: a mode is off while it handles a call, and `torch.autograd.backward` is one, but the
  backward of megatron's sequence-parallel collectives allocates on the CUDA device, and
  activation recomputation runs a layer's forward there.

`seed_rng_tracker` gives megatron's RNG tracker its states on the CPU (sequence parallelism forks
them) without reseeding the process's CPU RNG.

With these, everything the engine uses runs on the CPU over gloo (which has the all-gather and
reduce-scatter into one tensor that the distributed optimizer and sequence parallelism use): the
bf16 mixed-precision optimizer, the distributed optimizer, megatron's clipping, activation
recomputation and sequence parallelism. On a GPU none of this is entered: the engine runs
megatron-core as it is (docs/architecture.md, "Training engines").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.autograd.function import BackwardCFunction
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


def _as_cuda_type(tensor: torch.Tensor) -> str:
    """`tensor.type()` with a CPU tensor named as its CUDA type ("torch.cuda.FloatTensor"): megatron's
    optimizers and clipping accept only those names."""
    name = torch.Tensor.type(tensor)
    return name.replace("torch.", "torch.cuda.", 1) if tensor.device.type == "cpu" else name


class _CudaToCpu(TorchFunctionMode):
    """Rewrites `device=` CUDA arguments of torch calls to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _as_cuda_type(args[0])
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _backward_in_cpu_mode(apply):
    """A custom autograd Function's backward, run with the device rewriting on. It runs inside
    `torch.autograd.backward`, a torch call the mode handles, and a mode is off while its handler
    runs; but the backward of megatron's sequence-parallel collectives allocates on the CUDA device,
    and activation recomputation runs a layer's forward there."""

    def applied(ctx, *args):
        with _CudaToCpu():
            return apply(ctx, *args)

    return applied


def seed_rng_tracker(seed: int) -> None:
    """megatron's `model_parallel_cuda_manual_seed` inside `cpu_mode`: its RNG tracker's states
    (data-, tensor- and expert-parallel) become CPU generator states seeded as on a GPU, and the
    process's own CPU RNG is left as it was (megatron reseeds the default generator, CUDA's on a
    GPU). Sequence parallelism needs them: the embedding forks the tensor-parallel state for its
    dropout (0 here, so nothing is drawn)."""
    from megatron.core import tensor_parallel

    state = torch.get_rng_state()
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    finally:
        torch.set_rng_state(state)


@contextlib.contextmanager
def cpu_mode() -> Iterator[None]:
    """The changes above, undone on exit. The engine enters it only to run on the CPU."""
    from megatron.core.tensor_parallel import random as mrandom

    saved = {name: getattr(torch.cuda, name) for name in _PATCHED_CUDA}
    saved_random = (mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state)
    saved_backward = BackwardCFunction.apply
    for name, fn in _PATCHED_CUDA.items():
        setattr(torch.cuda, name, fn)
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    BackwardCFunction.apply = _backward_in_cpu_mode(saved_backward)
    try:
        with _CudaToCpu():
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)
        mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = saved_random
        BackwardCFunction.apply = saved_backward
