"""Whether a generation server that was marked down, and whose /health answers again, may serve
again (generation/client/router.py takes it back then): it must serve the weights the pool last
loaded, which it is given first where it missed them while down, or, in a pool that loads no
weights (a rollout worker's), at least the newest version answers came from. A stalled or restarted
server would otherwise decode on older weights until the next update."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import aiohttp

from areal_flow.generation.client.generation_client import GenerationClient, GenerationError, describe_error
from areal_flow.generation.client.versions import version_number

log = logging.getLogger(__name__)

Reload = Callable[[GenerationClient], Awaitable[Any]]


class Server(Protocol):
    """What this asks of a pool's server (router.py's `Server`, which imports this module)."""

    name: str
    client: GenerationClient
    last_error: str


async def serves_again(server: Server, weights: tuple[Reload | None, int] | None, newest: int, timeout: float) -> bool:
    """Whether `server` may serve again. `weights`: (how to give a server the pool's last version,
    or None where there is no copy to load; that version), None in a pool that loads none;
    `newest`: the newest version an answer came from. Where it may not, `server.last_error` says why."""
    if weights is None:
        # The pool that loads the weights (the controller's) brings a restarted server up to date.
        try:
            version = version_number(await asyncio.wait_for(server.client.get_weight_version(), timeout))
        except (aiohttp.ClientError, asyncio.TimeoutError, GenerationError) as exc:
            server.last_error = f"its weight version is unknown: {describe_error(exc)}"
            return False
        if version < newest:
            server.last_error = f"it serves weight version {version}, older than version {newest} of the others"
            return False
        return True
    reload, version = weights
    try:
        if await asyncio.wait_for(server.client.get_weight_version(), timeout) != str(version):
            if reload is None:
                server.last_error = (f"it serves old weights, and weight version {version} was sent by the "
                                     "trainer (rollout.weight_update_mode): there is no copy to load")
                return False
            log.warning("generation server %s came back with old weights: loading version %d", server.name, version)
            await reload(server.client)
    except (aiohttp.ClientError, asyncio.TimeoutError, GenerationError) as exc:
        server.last_error = f"could not load weight version {version} on its return: {describe_error(exc)}"
        return False
    return True
