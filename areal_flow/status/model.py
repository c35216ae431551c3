"""What a `Snapshot` of a run holds: the figures, staleness, evaluations and processes that
`python -m areal_flow.status` shows (status/snapshot.py reads them from a run directory,
status/render.py draws them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class NotARunDirectory(ValueError):
    pass


@dataclass
class Figure:
    """A figure at the last step and over the window of the last steps (None: not reported)."""
    last: float | None = None
    window: float | None = None


@dataclass
class Staleness:
    mean: float | None = None  # the last step's token-weighted mean
    max: int | None = None  # the last step's
    hist: list[int] = field(default_factory=list)  # the last step's tokens by staleness 0, 1, ...
    window_mean: float | None = None
    run_max: int | None = None  # over every step of the run
    run_hist: list[int] = field(default_factory=list)
    seq_hist: list | None = None  # the last step's per-sequence histogram, when the run writes it


@dataclass
class Evaluation:
    accuracy: float
    when: str | None = None  # "start", "end", "version N"
    step: int | None = None
    version: int | None = None  # when the row has it
    time: float | None = None
    seconds: float | None = None
    n: int | None = None


@dataclass
class ProcessStatus:
    name: str
    role: str
    pid: int | None = None
    host: str | None = None
    state: str | None = None  # processes.json's: running | exited | restarted | removed; None: not recorded
    restarts: int = 0
    exit_code: int | None = None
    ended: float | None = None  # when it exited, or left the run (processes.json)
    started: float | None = None  # when it (last) started: a scaled server's join (processes.json)
    alive: bool | None = None  # its pid on this host; None: not probed (not local, no pid, run over)
    log_age: float | None = None  # seconds since its log's last write
    url: str | None = None  # a generation server's
    health: str | None = None  # a generation server's /health while the run is live: "ok", "HTTP 503", ...
    weight_version: str | None = None  # what a live generation server says it serves


@dataclass
class Snapshot:
    run_dir: str
    at: float  # when it was read
    state: str  # preparing | starting | running | finished | stopped | ended
    live: bool  # its processes are (taken to be) running: they were probed
    note: str  # how the state was found, or why the run ended
    total_steps: int | None = None
    step: int = 0  # steps done
    elapsed: float | None = None  # training seconds at the last step
    eta: float | None = None  # seconds to total_steps at the window's pace
    trained_version: int | None = None
    loaded_version: int | None = None
    reward: Figure = field(default_factory=Figure)
    samples_per_second: Figure = field(default_factory=Figure)
    gen_tokens_per_second: Figure = field(default_factory=Figure)
    train_tokens_per_second: Figure = field(default_factory=Figure)
    trainer_busy: Figure = field(default_factory=Figure)
    generator_busy: Figure = field(default_factory=Figure)
    reward_busy: dict[str, Figure] = field(default_factory=dict)  # reward node -> busy fraction
    env: dict[str, Figure] = field(default_factory=dict)  # a multi-turn run's env/<figure> (turns, tool_calls, ...)
    staleness: Staleness = field(default_factory=Staleness)
    first_eval: Evaluation | None = None
    last_eval: Evaluation | None = None
    extras: dict[str, Any] = field(default_factory=dict)  # OPTIONAL_KEYS / _PREFIXES of the last step row
    processes: list[ProcessStatus] = field(default_factory=list)
    summary: dict | None = None
    window: int = 0  # steps in the window
    bad_lines: int = 0  # metrics lines that did not decode
