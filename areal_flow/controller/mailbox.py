"""The controller's one socket: every other process's messages arrive on it, and each is handed to
the handler of its type, from one table.

A ROUTER socket: each message comes with its sender's identity, which is also how the controller
answers it. A restarted worker connects with its old identity and takes the connection over
(ROUTER_HANDOVER), so a worker's identity outlives its process.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import zmq

from areal_flow.transport.channels import recv_from, send_to
from areal_flow.transport.messages import Message

log = logging.getLogger("areal_flow.controller")

Handler = Callable[[bytes, Any], "Awaitable[None] | None"]
"""Takes a message's sender identity and the message; may be a coroutine function."""


class Mailbox:
    def __init__(self, socket: zmq.asyncio.Socket, handlers: Mapping[type, Handler]):
        """`handlers`: message type -> what to do with one; a type without a handler is logged and dropped."""
        self.socket = socket
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.handlers = dict(handlers)

    async def receive(self) -> None:
        """Take the next message and hand it to its type's handler."""
        ident, msg = await recv_from(self.socket, "controller")
        handler = self.handlers.get(type(msg))
        if handler is None:
            log.error("controller: a %s is not for the controller, dropped", type(msg).__name__)
            return
        result = handler(ident, msg)
        if inspect.isawaitable(result):
            await result

    async def serve(self, after: Callable[[], Awaitable[None]]) -> None:
        """Take messages until cancelled, awaiting `after()` after each (the controller fills the
        rollout slots a message may have freed)."""
        while True:
            await self.receive()
            await after()

    async def send(self, ident: bytes, msg: Message) -> None:
        await send_to(self.socket, ident, msg)

    def close(self) -> None:
        self.socket.close(linger=0)
