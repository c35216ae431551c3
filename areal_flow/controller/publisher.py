"""The weight publisher: loads each new policy version on every generation server."""

from __future__ import annotations

import asyncio
import time

from areal_flow.generation.client import GenerationClient


class WeightPublisher:
    def __init__(self, urls: list[str], names: list[str], *, interrupt: bool = True):
        self.clients = [GenerationClient(url) for url in urls]
        self.names = names  # process names, for error messages
        self.interrupt = interrupt  # rollout.interrupt

    async def publish(self, weights_path: str, version: int) -> float:
        """Seconds it took every server to load `weights_path` as `version` (a refusal raises).

        Interrupting (AReaL's sequence): pause every server (their running requests return with
        finish_reason abort and the tokens so far, which the rollout workers resubmit), load the
        weights, then continue. No server decodes on the old weights once any has the new ones, and
        no update waits for the longest answer in flight. The servers continue even when a load
        fails. Without interrupting, each server loads once its running requests have finished.
        """
        t0 = time.perf_counter()
        if not self.interrupt:
            await asyncio.gather(*[c.update_weights_from_disk(weights_path, version) for c in self.clients])
            return time.perf_counter() - t0
        await asyncio.gather(*[c.pause_generation() for c in self.clients])
        try:
            await asyncio.gather(*[c.update_weights_from_disk(weights_path, version, abort_all_requests=True)
                                   for c in self.clients])
        finally:
            await asyncio.gather(*[c.continue_generation() for c in self.clients])
        return time.perf_counter() - t0

    async def busy_seconds(self) -> float | None:
        """Mean seconds the servers have spent generating so far (None if a server does not say)."""
        infos = await asyncio.gather(*[c.get_server_info() for c in self.clients])
        busy = [i.get("busy_seconds") for i in infos]
        return None if None in busy else sum(busy) / len(busy)

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
        for c in self.clients:
            await c.close()
