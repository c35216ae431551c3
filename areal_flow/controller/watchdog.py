"""What the step loop waits for, and the watchdog that fails a run when no train step completes in
`step_timeout` seconds.

The loop and the components it calls record what they wait for as a typed `Waiting`: one kind of
`Wait` and the numbers it names. Code can ask which wait a run is in (`progress.waiting.on is
Wait.BATCH`); the sentence a stalled run's error shows is made only when the error is raised, from
the kind's template, and reads word for word as it always has (logs, summary.json's stop_reason and
the status view quote it).
"""

from __future__ import annotations

import asyncio
import enum
import string
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


class StalledRun(RuntimeError):
    """No train step completed within `step_timeout`; the message says what the run waited for."""


class Wait(enum.Enum):
    """What the step loop can wait for; each value is the sentence's template."""

    START_UP = "start-up"
    EVALUATION = "the held-out evaluation at {when}"
    PINNED_LOAD = "the held-out evaluation at version {pinned} before loading version {version}"
    CHECKPOINT = "the trainer ranks to save the checkpoint of step {step}"
    SERVER_COUNTS = "the generation servers' counts of the step (/get_server_info)"
    LOAD = "the generation servers to load the weights of version {version}"
    BATCH = "finished prompt groups to train step {step}"
    MEMORY = "the generation servers to free their memory for step {step}"
    STEP = "the trainer ranks to finish step {step}"
    SEND_WEIGHTS = "the trainer ranks to send weight version {version}"
    RANKS = "{missing} to finish {what}"
    NEW_RANKS = "{n} new trainer rank(s) to start from the checkpoint {path} (a trainer resize)"

    def of(self, **fields: object) -> Waiting:
        """This wait, naming `fields` (exactly those its template names)."""
        names = {name for _, name, _, _ in string.Formatter().parse(self.value) if name}
        if set(fields) != names:
            raise TypeError(f"Wait.{self.name} names {sorted(names)}, given {sorted(fields)}")
        return Waiting(self, dict(fields))


@dataclass(frozen=True)
class Waiting:
    """One wait of the step loop: its kind and what it names (a step, a version, ranks)."""

    on: Wait
    fields: Mapping[str, object] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.on.value.format(**self.fields)


class Progress:
    """Where the step loop is: what it waits for now, and when it last made progress (a step
    closed, a checkpoint saved, a resize done). The components that wait share it; none of them
    holds the controller."""

    def __init__(self) -> None:
        self.waiting = Wait.START_UP.of()
        self.last = time.monotonic()

    def waits(self, on: Wait, **fields: object) -> None:
        self.waiting = on.of(**fields)

    def made(self) -> None:
        self.last = time.monotonic()


async def watchdog(progress: Progress, step_timeout: float, situation: Callable[[], Awaitable[str]]) -> None:
    """Raise StalledRun once `step_timeout` seconds pass without progress, naming what the loop waits
    for and then `situation()` (the controller's account: groups finished, servers that do not
    answer). A frozen process holds no socket error: only the clock finds it."""
    while True:
        await asyncio.sleep(min(1.0, step_timeout / 4))
        if time.monotonic() - progress.last > step_timeout:
            raise StalledRun(f"no train step completed within {step_timeout:.0f} s (step_timeout); the controller "
                             f"waits for {progress.waiting}" + await situation())


async def until_stalled(work: Awaitable[T], progress: Progress, step_timeout: float,
                        situation: Callable[[], Awaitable[str]]) -> T:
    """`work`'s result, under the watchdog (none when `step_timeout` is 0): a stalled run raises StalledRun."""
    progress.made()
    if not step_timeout:
        return await work
    task, dog = asyncio.ensure_future(work), asyncio.create_task(watchdog(progress, step_timeout, situation))
    await asyncio.wait({task, dog}, return_when=asyncio.FIRST_COMPLETED)
    for t in (task, dog):
        if not t.done():
            t.cancel()
    return task.result() if task.done() else dog.result()
