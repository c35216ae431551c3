"""`python_tool`: the policy may run Python between its turns and read what it printed.

A turn that ends with a tool call, `<python>CODE</python>` (the tags are settings), runs CODE in the
code sandbox (areal_flow/sandbox/local.py: namespaces, chroot, its own uid, limits), with its own
wall time; the observation is what it printed, cut at `max_output_chars` and marked where cut, in
`<output>` tags. A program that fails, hangs or prints what the tokenizer cannot hold is an
observation too (`error: ...`, characters outside printable ASCII replaced): nothing a program does
ends the rollout. A turn without a tool call is the final answer: the trajectory is done.

The sandboxes are a pool per worker process and configuration (`concurrency` of them, each with a
uid of its own), shared by the trajectories the worker runs at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from typing import Any, AsyncIterator

from areal_flow.config.schema import SandboxConfig
from areal_flow.data.observations import MAX_OUTPUT_CHARS, PYTHON_CLOSE, PYTHON_OPEN, cut, output_observation
from areal_flow.envs.base import Environment, Step
from areal_flow.sandbox.local import UID_BASE, CaseResult, Sandbox, SandboxUnavailable

PID_SPAN = 1 << 22  # Linux's largest pid_max: uid UID_BASE + k·PID_SPAN + pid is the k-th box of pid, unique
MAX_BOXES = 64  # sandboxes a worker process may hold: their uids stay below 2^31
PRINTABLE = frozenset(map(chr, range(32, 127))) | {"\n"}


class SandboxPool:
    """`size` sandboxes for one worker process, lent one run at a time."""

    def __init__(self, cfg: SandboxConfig, size: int):
        self.boxes: asyncio.Queue[Sandbox] = asyncio.Queue()
        for k in range(size):
            box = Sandbox(cfg, uid=UID_BASE + (k + 1) * PID_SPAN + os.getpid())
            box.isolation()  # a machine that cannot isolate programs fails here (SandboxUnavailable)
            self.boxes.put_nowait(box)

    @contextlib.asynccontextmanager
    async def box(self) -> AsyncIterator[Sandbox]:
        box = await self.boxes.get()
        try:
            yield box
        finally:
            self.boxes.put_nowait(box)

    async def run(self, program: str) -> CaseResult:
        """`program` run once with empty stdin, in a thread (a run blocks until the program ends)."""
        async with self.box() as box:
            (result,) = await asyncio.to_thread(box.run, program, [""])
            return result


_POOLS: dict[tuple[str, int, int], SandboxPool] = {}  # (configuration, size, event loop) -> this process's pool


def shared_pool(cfg: SandboxConfig, size: int) -> SandboxPool:
    """This process's pool for `cfg`, made on first use. One per event loop: an asyncio queue
    belongs to one."""
    key = (repr(cfg), size, id(asyncio.get_running_loop()))
    if key not in _POOLS:
        _POOLS[key] = SandboxPool(cfg, size)
    return _POOLS[key]


def tool_sandbox(run: SandboxConfig | None, wall_seconds: float) -> SandboxConfig:
    """The run's sandbox settings (`sandbox=`) with a tool's own wall time (and a CPU limit that
    follows it), stopping at the first case that fails."""
    return dataclasses.replace(run or SandboxConfig(), wall_seconds=wall_seconds,
                               cpu_seconds=max(1, round(wall_seconds)), fail_fast=True)


def check_sandbox(cfg: SandboxConfig, env: str) -> None:
    """ValueError naming `env` unless the sandbox can isolate programs here (or the run's sandbox
    config opted out of isolation)."""
    box = Sandbox(cfg)
    try:
        box.isolation()
    except SandboxUnavailable as e:
        raise ValueError(f"{env}: {e}") from None
    finally:
        box.close()


def printable(text: str) -> str:
    """`text` with every character but printable ASCII and newline replaced by '?' (a tab by a space)."""
    return "".join(c if c in PRINTABLE else (" " if c == "\t" else "?") for c in text)


@dataclasses.dataclass(frozen=True)
class ToolSettings:
    """What a recipe may set under `graph.<generate>.env_settings` for python_tool."""

    open: str = PYTHON_OPEN  # a tool call starts with this ...
    close: str = PYTHON_CLOSE  # ... and ends with this, which also ends the policy's turn
    wall_seconds: float = 2.0  # wall time of one tool run (the sandbox's CPU limit follows it)
    max_output_chars: int = MAX_OUTPUT_CHARS  # an observation's output is cut past this many characters
    ascii_only: bool = True  # replace characters outside printable ASCII (a character tokenizer holds no others)
    concurrency: int = 2  # sandboxes per worker process, shared by its trajectories (at most MAX_BOXES)

    def __post_init__(self) -> None:
        for name in ("open", "close"):
            if not getattr(self, name):
                raise ValueError(f"python_tool: {name!r} must be a non-empty string")
        if self.wall_seconds <= 0 or self.max_output_chars < 1 or not 1 <= self.concurrency <= MAX_BOXES:
            raise ValueError(f"python_tool: wall_seconds must be > 0, max_output_chars ≥ 1 and concurrency in "
                             f"1..{MAX_BOXES}")


class PythonTool(Environment):
    figures = ("tool_calls", "tool_errors", "tool_seconds")

    def __init__(self, row: dict[str, Any], *, sandbox: SandboxConfig | None = None, **settings: Any):
        super().__init__(row)
        try:
            self.settings = ToolSettings(**settings)
        except TypeError as e:
            raise ValueError(f"python_tool: {e}") from None
        self.sandbox = tool_sandbox(sandbox, self.settings.wall_seconds)
        self.stop = (self.settings.close,)

    def check(self) -> None:
        check_sandbox(self.sandbox, "python_tool")

    def snapshot(self) -> dict[str, Any]:
        return {}  # it holds nothing between turns but its row and settings: a resume goes on as it is

    def tool_call(self, turn: str) -> str | None:
        """The code of the turn's tool call: between the last opening tag and the closing tag that
        ends the turn; None when the turn makes none."""
        s = self.settings
        if not turn.rstrip().endswith(s.close):
            return None
        body = turn.rstrip()[: -len(s.close)]
        start = body.rfind(s.open)
        return None if start < 0 else body[start + len(s.open):]

    async def step(self, turn: str) -> Step:
        code = self.tool_call(turn)
        if code is None:
            return Step(done=True)
        observation, figures = await run_tool(code, self.settings, self.sandbox)
        return Step(observation, figures=figures)


async def run_tool(code: str, settings: ToolSettings, sandbox: SandboxConfig) -> tuple[str, dict[str, float]]:
    """`code` run in this process's sandbox pool: the observation (what it printed, or the error,
    in `<output>` tags) and the figures tool_calls, tool_errors, tool_seconds. An agent's tool
    calls it too (areal_flow/agents/examples/arith_tool.py)."""
    text, figures = await _run(code, settings, sandbox)
    return output_observation(text, settings.max_output_chars), figures


async def tool_output(code: str, settings: ToolSettings, sandbox: SandboxConfig) -> tuple[str, dict[str, float]]:
    """run_tool's without the tags: what `code` printed (or the error), cut at `max_output_chars`;
    a chat agent's tool result (areal_flow/agents/examples/arith_chat_tool.py)."""
    text, figures = await _run(code, settings, sandbox)
    return cut(text, settings.max_output_chars), figures


async def _run(code: str, settings: ToolSettings, sandbox: SandboxConfig) -> tuple[str, dict[str, float]]:
    t0 = time.monotonic()
    result = await shared_pool(sandbox, settings.concurrency).run(code)
    seconds = time.monotonic() - t0
    failed = result.status != "ok"
    text = result.stdout if not failed else error_text(result, settings.wall_seconds)
    if settings.ascii_only:
        text = printable(text)
    return text, {"tool_calls": 1.0, "tool_errors": float(failed), "tool_seconds": seconds}


def error_text(result: CaseResult, wall_seconds: float) -> str:
    """What a failed run says: its status, and the last line of its traceback where it has one."""
    if result.status == "timeout":
        return f"error: timeout after {wall_seconds:g} s"
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    return f"error: {result.status}" + (f": {lines[-1]}" if lines else "")
