"""The one sequence every weight update follows, whatever carries the weights: pause the servers,
deliver the version through the run's channel, continue them.

Interrupting (rollout.interrupt): every server that is up is paused; with pause_mode "abort"
(AReaL's sequence) its running requests return with finish_reason abort and their tokens so far,
which the rollout workers resubmit; with "retract" (SGLang's) each server requeues them and
prefills them again under the new weights; "in_place" keeps them and their KV cache. No server
decodes on the old weights once any has the new ones, and no update waits for the longest answer in
flight. Without interrupting, each server loads once its running requests have finished.

A server that refuses (a load that fails) makes the update raise WeightUpdateError, but only after
every paused server has been continued. A server that cannot be reached is marked down and left
out, unless the channel involves every server together (a process group): then one that is down
fails the update before any is paused. A server that comes back is given the last version first,
where the channel has a copy to load (the pool's `loaded`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_flow.weights.channel import SendByTrainers, UpdateFlags, WeightChannel

if TYPE_CHECKING:
    from areal_flow.generation.client.router import ServerPool


class WeightUpdateError(RuntimeError):
    """A server refused to pause, load the weights or continue; the message names each."""


async def _no_trainers(version: int, flags: UpdateFlags) -> None:
    raise WeightUpdateError(f"weight version {version}: no trainer ranks to send it")


async def update_servers(pool: ServerPool, channel: WeightChannel, location: str, version: int, *,
                         interrupt: bool = True, pause_mode: str = "abort",
                         trainers: SendByTrainers | None = None) -> list[str]:
    """Load `version` (found at `location`, for channels the servers fetch from) on every server of
    `pool` that is up; returns the names of the servers left out because they are down (raises
    ServerPoolError when every one is). `trainers` has the trainer ranks send it, for channels
    whose trainers send."""
    while True:
        # Waited for without the lock: a server comes back (the pool's watcher) under it.
        await pool.servers_up(f"the update to weight version {version}")
        async with pool.updating:  # a server coming back meanwhile waits: it gets this version after
            if servers := [s for s in pool.servers if s.up]:
                return await _update(pool, servers, channel, location, version, interrupt, pause_mode,
                                     trainers or _no_trainers)


async def _update(pool: ServerPool, servers: list, channel: WeightChannel, location: str, version: int,
                  interrupt: bool, pause_mode: str, trainers: SendByTrainers) -> list[str]:
    if channel.sent_by_trainers and not interrupt:
        raise ValueError(f"{channel.describe()} delivers in several parts and needs interrupting updates")
    if channel.every_server and len(servers) < len(pool.servers):
        raise WeightUpdateError(
            f"weight version {version} cannot be sent {channel.source(location)}: every generation server takes "
            "part in each delivery, and " + "; ".join(s.describe() for s in pool.servers if not s.up))
    flags = UpdateFlags(abort_all_requests=interrupt and pause_mode == "abort",
                        keep_cache=interrupt and pause_mode == "in_place")
    refusals: list[str] = []
    if not interrupt:
        refusals += await channel.deliver(pool, servers, location, version, flags, trainers)
    else:
        paused, refused = await pool.call_each("pause", servers, lambda c: c.pause_generation(pause_mode))
        refusals += refused
        try:
            if len(paused) < len(servers) and channel.every_server:
                # A server that is not paused would decode between the parts of the delivery.
                refusals.append(f"the delivery was not started: {len(servers) - len(paused)} server(s) not paused")
            else:
                refusals += await channel.deliver(pool, paused, location, version, flags, trainers)
        finally:
            # Every server that may be paused, also one whose pause answered an error.
            _, refused = await pool.call_each("continue", [s for s in servers if s.up],
                                              lambda c: c.continue_generation())
            refusals += refused
    if refusals:
        raise WeightUpdateError(f"weight version {version} {channel.source(location)}: " + "; ".join(refusals))
    pool.loaded(version, channel.reload(location, version))
    return pool.left_out(version)
