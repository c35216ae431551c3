"""The weight publisher: loads each new policy version on every generation server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp

from areal_flow.config.schema import RolloutConfig
from areal_flow.generation.client import GenerationClient, GenerationError
from areal_flow.generation.compute_counts import COMPUTE_COUNTS
from areal_flow.generation.router import ServerPool

SERVER_COUNTS = ("busy_seconds", "load_seconds", *COMPUTE_COUNTS)
"""The running counts in the embedded engine's /server_info that the controller logs per step."""


class WeightPublisher:
    def __init__(self, urls: list[str], names: list[str], *, interrupt: bool = True, pause_mode: str = "abort",
                 config: RolloutConfig | None = None, api_key: str | None = None,
                 transfer: Callable[[int, bool, bool], Awaitable[None]] | None = None):
        """`config`: the timeouts, retries and health interval of the servers' pool; `api_key`: the
        servers' (a secured run's). `transfer` (rollout.weight_update_mode=distributed): has the
        trainer broadcast a version to the paused servers (ServerPool.update_weights); without it
        they load the published directory."""
        self.pool = ServerPool(urls, names, config, api_key=api_key)
        self.names = names  # process names, for error messages
        self.interrupt = interrupt  # rollout.interrupt
        self.pause_mode = pause_mode  # rollout.pause_mode
        self.transfer = transfer

    @property
    def clients(self) -> list[GenerationClient]:
        return self.pool.clients

    async def publish(self, weights_path: str, version: int) -> float:
        """Seconds it took every server that is up to load `weights_path` (by broadcast: the
        trainer's weights; the path is "") as `version`; a refusal raises WeightUpdateError once
        every server is continued (ServerPool.update_weights). A server that is down is logged and
        left out (by broadcast it fails the update); it is marked up again when /health answers."""
        t0 = time.perf_counter()
        await self.pool.update_weights(weights_path or None, version, interrupt=self.interrupt,
                                       pause_mode=self.pause_mode, transfer=self.transfer)
        return time.perf_counter() - t0

    async def server_counts(self) -> dict[str, float]:
        """Per server, the mean so far of each running count that every server reports: the
        seconds spent generating (`busy_seconds`) and loading weights (`load_seconds`), and the
        engine's compute counts (generation/compute_counts.py). SGLang reports none of them, and a
        server that cannot be reached leaves them all out: the run goes on without the metrics
        while a server is down."""
        async def info(c: GenerationClient) -> dict:
            try:
                return await c.get_server_info()
            except (aiohttp.ClientError, asyncio.TimeoutError, GenerationError):
                return {}

        infos = await asyncio.gather(*[info(c) for c in self.clients])
        return {key: sum(i[key] for i in infos) / len(infos) for key in SERVER_COUNTS
                if all(isinstance(i.get(key), (int, float)) for i in infos)}

    async def unresponsive(self, timeout: float = 5.0) -> list[str]:
        """Names of the servers that do not answer /health within `timeout` seconds."""
        async def answers(c: GenerationClient) -> bool:
            try:
                return await asyncio.wait_for(c.health(), timeout)
            except (asyncio.TimeoutError, OSError):
                return False

        ok = await asyncio.gather(*[answers(c) for c in self.clients])
        return [name for name, good in zip(self.names, ok) if not good]

    async def close(self) -> None:
        await self.pool.close()
