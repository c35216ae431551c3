"""Where a decode step's time goes: the engine's host work against the device's (`time_steps=True`).

A decode step of the paged engine runs, in order: the sampling call (kernels launched on a GPU,
computed on the CPU), the readback of the sampled tokens (on a GPU: waiting for the device to
finish the step's work), the engine's own Python (answering rows, scheduling, building the
forward's inputs), the model's forward call (a graph replay or eager launches on a GPU, the math
on the CPU), and its bookkeeping after. `StepTimer` adds up those parts with `time.perf_counter`
marks; on CUDA it also records events around the sampling and the forward on the current stream
and reads their elapsed times once they are done (never waiting for them mid-step), which is the
device's own time. "host" is everything that is not one of the timed calls nor the readback: the
engine's Python per step, the cost that does not shrink with a faster device. "loop" is the decode
thread's time between two back-to-back steps (its lock, admitting, answering finished rows).

Only pure decode steps (no prefill chunk in their forward) are counted, so the means are per
decode step. Off unless asked for: the engine then makes no mark and records no event.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import torch

PARTS = ("sample", "readback", "forward", "host")
"""The timed parts of a step (seconds, summed); "loop" and "wall" come with them."""


class StepTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._lock = threading.Lock()  # the decode thread adds, another thread reads
        self._totals = dict.fromkeys((*PARTS, "loop", "wall"), 0.0)
        self._device = {"sample": 0.0, "forward": 0.0}  # CUDA event milliseconds, resolved steps only
        self._steps = self._device_steps = 0
        self._pending: deque[tuple[torch.cuda.Event, ...]] = deque()  # a counted step's events, not yet read
        self._parts: dict[str, float] | None = None  # the step in progress
        self._events: list[torch.cuda.Event] = []
        self._last = self._began = 0.0
        self._ended: float | None = None  # when the last counted step ended, while the next follows at once

    def begin(self, started: float) -> None:
        """A step began at `started` (perf_counter)."""
        self._parts = dict.fromkeys(PARTS, 0.0)
        self._events = []
        self._began = self._last = started

    def mark(self, part: str) -> None:
        """The time since the last mark was spent on `part`."""
        if self._parts is None:
            return
        now = time.perf_counter()
        self._parts[part] += now - self._last
        self._last = now

    def _event(self) -> None:
        if self.cuda and self._parts is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append(event)

    def sample_launching(self) -> None:
        self.mark("host")
        self._event()

    def sample_launched(self) -> None:
        self.mark("sample")
        self._event()

    def forward_launching(self) -> None:
        self.mark("host")
        self._event()

    def forward_launched(self) -> None:
        self.mark("forward")
        self._event()

    def end(self, decode_only: bool) -> None:
        """The step ended; it counts if it was a pure decode step that sampled."""
        if self._parts is None:
            return
        self.mark("host")
        now = self._last  # the parts then add up to the wall time exactly
        with self._lock:
            if decode_only and len(self._events) in (0, 4):
                for part, seconds in self._parts.items():
                    self._totals[part] += seconds
                self._totals["wall"] += now - self._began
                if self._ended is not None:
                    self._totals["loop"] += self._began - self._ended
                self._steps += 1
                if self._events:
                    self._pending.append(tuple(self._events))
                self._resolve(wait=False)
            self._ended = now if decode_only else None
        self._parts = None

    def idle(self) -> None:
        """The thread is about to wait for work: the next step does not follow this one at once."""
        self._ended = None

    def _resolve(self, wait: bool) -> None:
        """Add the elapsed times of the counted steps' events that are done (all, waiting, if `wait`)."""
        while self._pending:
            events = self._pending[0]
            if not wait and not events[-1].query():
                break
            if wait:
                events[-1].synchronize()
            self._pending.popleft()
            self._device["sample"] += events[0].elapsed_time(events[1])
            self._device["forward"] += events[2].elapsed_time(events[3])
            self._device_steps += 1

    def totals(self) -> dict[str, float]:
        """Running sums: `steps`, seconds of each part, "loop" and "wall"; on CUDA `device_steps` and
        the device's milliseconds `device_sample_ms`, `device_forward_ms` over them."""
        with self._lock:
            self._resolve(wait=True)
            return {"steps": self._steps, **self._totals, "device_steps": self._device_steps,
                    **{f"device_{k}_ms": v for k, v in self._device.items()}}


def per_step_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The mean milliseconds per decode step between two `totals()`: each part, "loop", "wall",
    and on CUDA "device_sample" and "device_forward"; "steps" is the count."""
    steps = after["steps"] - before["steps"]
    out: dict[str, float] = {"steps": steps}
    for key in (*PARTS, "loop", "wall"):
        out[key] = 1e3 * (after[key] - before[key]) / steps if steps else 0.0
    device_steps = after["device_steps"] - before["device_steps"]
    for key in ("sample", "forward"):
        name = f"device_{key}_ms"
        out[f"device_{key}"] = (after[name] - before[name]) / device_steps if device_steps else float("nan")
    return out
