"""Counting where the host reads a tensor's values: on a GPU each such read waits for every queued
kernel (a device synchronisation), which stalls the pipeline of launches the host keeps ahead of
the device.

`count_host_reads` patches, while entered, the Python entry points through which a tensor's
values reach the host: `.item()`, `.tolist()`, `.cpu()`, `.numpy()`, `bool()`/`int()`/`float()`
of a tensor, `.nonzero()`/`torch.nonzero` (its output size depends on the values) and indexing
with a boolean mask (the same). It counts calls, on any device, so it works on the CPU: what it
measures there is how many reads a step *would* make on a GPU. A read of a tensor that lives on
the host by design (a count all-reduced over gloo) is counted too; a bound stated with it says so.

What it cannot see: the blocking host-to-device copy of pageable memory (`.to("cuda")`), which
torch implements as a copy and a stream synchronisation, and reads inside torch's own kernels
(embedding's backward reads its segment count). On CUDA `count_cuda_syncs` sees every
synchronisation torch makes, copies included, through `torch.cuda.set_sync_debug_mode`;
tools/bench_engine.py --profile reports it per train step.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero")


@dataclass
class HostReads:
    """Reads counted by kind (READS, plus "bool_mask" for `t[mask]`) and by the module that made
    them: the first caller outside torch (e.g. "transformers.masking_utils", "areal_flow.training.engine")."""

    by_kind: Counter = field(default_factory=Counter)
    by_module: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def outside(self, *prefixes: str) -> int:
        """Reads made by modules other than those under `prefixes`."""
        return sum(n for module, n in self.by_module.items() if not module.startswith(prefixes))


def _caller_module() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "?")
        if not (module == __name__ or module == "torch" or module.startswith("torch.")):
            return module
        frame = frame.f_back
    return "?"


@contextlib.contextmanager
def count_host_reads() -> Iterator[HostReads]:
    """HostReads filled while entered."""
    counts = HostReads()
    saved = {name: getattr(torch.Tensor, name) for name in (*READS, "__getitem__")}
    saved_nonzero = torch.nonzero

    def count(kind: str) -> None:
        counts.by_kind[kind] += 1
        counts.by_module[_caller_module()] += 1

    def counting(name, original):
        def read(self, *args, **kwargs):
            count(name)
            return original(self, *args, **kwargs)
        return read

    def getitem(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
            count("bool_mask")
        return saved["__getitem__"](self, index)

    def nonzero(*args, **kwargs):
        count("nonzero")
        return saved_nonzero(*args, **kwargs)

    try:
        for name in READS:
            setattr(torch.Tensor, name, counting(name, saved[name]))
        torch.Tensor.__getitem__ = getitem
        torch.nonzero = nonzero
        yield counts
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
        torch.nonzero = saved_nonzero


SYNC_WARNING = "called a synchronizing CUDA operation"


@contextlib.contextmanager
def count_cuda_syncs() -> Iterator[Counter]:
    """On CUDA: every synchronising call torch makes while entered (`torch.cuda.set_sync_debug_mode`
    warns on each: `.item()`, a blocking copy either way, `nonzero`, a stream synchronisation, ...),
    counted by the Python line that made it ("file:line"); filled on exit. Warnings from backward
    arrive at the `backward()` call (autograd replays its threads' warnings there)."""
    counts: Counter = Counter()
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            torch.cuda.set_sync_debug_mode(before)
    for w in caught:
        if SYNC_WARNING in str(w.message):
            counts[f"{w.filename}:{w.lineno}"] += 1
