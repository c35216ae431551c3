"""The simulated pipeline's moving parts (simulate.py): prompt groups, their answers, and the
generation servers with the op each is running."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(eq=False)
class SimGroup:
    """A prompt group: admitted, generating, finished."""

    gid: int
    left: int  # answers not finished yet
    filtered: bool = False  # dynamic filtering drops it when it finishes
    seqs: list[SimSeq] = field(default_factory=list)


@dataclass(eq=False)
class SimSeq:
    """One answer of a group."""

    group: SimGroup
    index: int  # its place in the group: the order aborted answers go back in, the same in every run
    length: int  # tokens it ends at
    done: int = 0  # tokens generated before the current decode segment
    start: int = 0  # its server's step counter when the current segment began
    resumed: bool = False  # aborted by an update: prefilled again as prompt + tokens so far
    versions: dict[int, int] = field(default_factory=dict)  # policy version -> tokens


@dataclass(eq=False)
class SimServer:
    """One generation server: its running answers, queue and the op in progress."""

    index: int
    version: int = 0
    steps: int = 0  # decode steps done since the start
    running: set[SimSeq] = field(default_factory=set)
    finishing: list[tuple[int, int, SimSeq]] = field(default_factory=list)  # heap: (step it finishes at, tiebreak, seq)
    queue: deque[SimSeq] = field(default_factory=deque)
    op: str | None = None  # decode | prefill | answer | load | None (idle)
    op_start: float = 0.0
    op_end: float = 0.0
    op_steps: int = 0
    step_cost: float = 0.0  # seconds of the op's first decode step
    step_growth: float = 0.0  # seconds each further step adds (the context grows by one token per answer)
    context: int = 0  # Σ over running answers of prompt + done − start: their context is this + n · steps
    admitting: list[SimSeq] = field(default_factory=list)  # the answers being prefilled
    answering: list[SimGroup] = field(default_factory=list)  # groups whose last answer is being handed back
    wake: int = 0  # the current op's token: an earlier wake-up event is stale
    busy: float = 0.0  # seconds of finished decode and prefill ops
    decoded: int = 0  # tokens of finished decode ops
    pause_wanted: bool = False
    paused: bool = False
    draining: bool = False
    load: int = 0  # answers on it not finished: what the router's least-load choice counts

    def busy_until(self, now: float) -> float:
        """Busy seconds up to `now`, the op in progress included."""
        return self.busy + (now - self.op_start if self.op in ("decode", "prefill") else 0.0)
