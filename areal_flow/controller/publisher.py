"""The weight publisher: loads each new policy version on every generation server."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from areal_flow.config.schema import RolloutConfig
from areal_flow.generation.client.generation_client import GenerationClient, GenerationError
from areal_flow.generation.compute_counts import COMPUTE_COUNTS
from areal_flow.generation.client.router import ServerPool
from areal_flow.weights.channel import SendByTrainers, WeightChannel
from areal_flow.weights.update import update_servers

SERVER_COUNTS = ("busy_seconds", "load_seconds", "memory_releases", *COMPUTE_COUNTS)
"""The running counts in the embedded engine's /server_info that the controller logs per step."""


async def server_counts(clients: list[GenerationClient]) -> dict[str, float]:
    """Per server, the mean so far of each running count that every server of `clients` reports:
    the seconds spent generating (`busy_seconds`) and loading weights (`load_seconds`), and the
    engine's compute counts (generation/compute_counts.py). SGLang reports none of them, and a
    server that cannot be reached leaves them all out: the run goes on without the metrics while a
    server is down."""
    async def info(c: GenerationClient) -> dict:
        try:
            return await c.get_server_info()
        except (aiohttp.ClientError, asyncio.TimeoutError, GenerationError):
            return {}

    infos = await asyncio.gather(*[info(c) for c in clients])
    return {key: sum(i[key] for i in infos) / len(infos) for key in SERVER_COUNTS
            if all(isinstance(i.get(key), (int, float)) for i in infos)}


class WeightPublisher:
    def __init__(self, urls: list[str], names: list[str], channel: WeightChannel, *, interrupt: bool = True,
                 pause_mode: str = "abort", config: RolloutConfig | None = None, api_key: str | None = None,
                 trainers: SendByTrainers | None = None, colocated: bool = False):
        """`channel`: how the weights travel (areal_flow/weights/); `config`: the timeouts, retries
        and health interval of the servers' pool; `api_key`: the servers' (a secured run's);
        `trainers`: has the trainer ranks send a version, for channels whose trainers send;
        `colocated`: the servers share the trainer's devices and take turns with it
        (docs/colocation.md)."""
        self.pool = ServerPool(urls, names, config, api_key=api_key)
        self.names = names  # process names, for error messages
        self.channel = channel
        self.interrupt = interrupt  # rollout.interrupt
        self.pause_mode = pause_mode  # rollout.pause_mode
        self.trainers = trainers
        self.colocated = colocated

    @property
    def clients(self) -> list[GenerationClient]:
        return self.pool.clients

    async def publish(self, location: str, version: int) -> float:
        """Seconds it took every server that is up to get `version` (at `location`, or "" when the
        trainers send it); a refusal raises WeightUpdateError once every server is continued
        (weights/update.py). A server that is down is logged and left out (where the channel
        involves every server, it fails the update); it is marked up again when /health answers."""
        t0 = time.perf_counter()
        await update_servers(self.pool, self.channel, location, version, interrupt=self.interrupt,
                             pause_mode=self.pause_mode, trainers=self.trainers)
        return time.perf_counter() - t0

    @property
    def overlaps_training(self) -> bool:
        """Whether a version loads while the trainer trains the next step: not where the trainer
        ranks send the weights themselves (the channel's `overlaps_training`), nor colocated."""
        return self.channel.overlaps_training and not self.colocated

    async def trainers_turn(self) -> None:
        """Colocated: the servers free their KV cache and stay paused while the trainer steps."""
        await self.pool.release_memory()

    async def generations_turn(self) -> None:
        """Colocated: the trainer's step is done; the servers take their memory back (the weight
        update that follows continues them)."""
        await self.pool.resume_memory()

    async def server_counts(self) -> dict[str, float]:
        """The policy's servers' counts (`server_counts`)."""
        return await server_counts(self.clients)

    async def unresponsive(self, timeout: float = 5.0) -> list[str]:
        """Names of the servers that do not answer /health within `timeout` seconds."""
        return await self.pool.unresponsive(timeout)

    async def close(self) -> None:
        await self.pool.close()
