"""ZeroMQ sockets that carry `messages` and survive bad input.

Every receive goes through `recv`/`recv_from`: a frame that does not decode is logged with the
socket's name and dropped, and the receiver keeps listening, so one bad sender cannot stop a run.
Every send goes through `send`/`send_to`/`send_blocking`, which count the bytes this process has
sent (`sent_bytes`): the per-process traffic metric of each step.

`make_socket` is the one place sockets are made and secured: given the run's `Security`, a socket
that binds is a CURVE server that accepts only the run's client key, and one that connects a CURVE
client (runtime/security.py, docs/security.md).
"""

from __future__ import annotations

import logging

import msgspec
import zmq
import zmq.asyncio

from areal_flow.runtime.security import Security, curve_client, curve_server
from areal_flow.transport.messages import Message, decode, encode

log = logging.getLogger("areal_flow.transport")

_sent = 0  # bytes this process has sent through any socket made here


def sent_bytes() -> int:
    """Bytes of messages this process has sent so far."""
    return _sent


def _encoded(msg: Message) -> bytes:
    global _sent
    data = encode(msg)
    _sent += len(data)
    return data


def endpoint(port: int, host: str = "127.0.0.1") -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"  # an IPv6 address in brackets


def make_socket(ctx: zmq.Context | zmq.asyncio.Context, kind: int, *, bind: str | None = None,
                connect: list[str] | str | None = None, identity: str | None = None,
                security: Security | None = None) -> zmq.Socket:
    """A socket of `kind` on `ctx` that binds `bind` or connects to `connect`; with `security`
    (the run's, from its spec) it speaks CURVE, and a server refuses every client without the
    run's client key: such a client delivers nothing."""
    if security is not None and bind and connect:
        raise ValueError(f"a secured socket either binds ({bind}) or connects ({connect}): CURVE makes it "
                         "a server or a client, not both")
    sock = ctx.socket(kind)
    try:
        # No high-water mark: a full queue must block the sender, never silently drop a sample.
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 1000)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity.encode())
        if security is not None:
            # Before bind/connect: libzmq reads the mechanism when a connection starts.
            if bind:
                curve_server(ctx, sock, security)
            else:
                curve_client(sock, security)
        if bind:
            sock.bind(bind)
        for addr in [connect] if isinstance(connect, str) else connect or []:
            sock.connect(addr)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def _decode_or_log(data: bytes, where: str) -> Message | None:
    try:
        return decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        log.error("rejected a message on %s that does not decode (%d bytes): %s", where, len(data), e)
        return None


async def recv(sock: zmq.asyncio.Socket, where: str) -> Message:
    """Next valid message on a PULL/DEALER socket; bad frames are logged and skipped."""
    while True:
        frames = await sock.recv_multipart()
        msg = _decode_or_log(frames[-1], where)
        if msg is not None:
            return msg


async def recv_from(sock: zmq.asyncio.Socket, where: str) -> tuple[bytes, Message]:
    """Next valid message on a ROUTER socket, with the sender's identity."""
    while True:
        frames = await sock.recv_multipart()
        if len(frames) < 2:
            log.error("rejected a message on %s without a sender identity", where)
            continue
        msg = _decode_or_log(frames[-1], where)
        if msg is not None:
            return frames[0], msg


def recv_blocking(sock: zmq.Socket, where: str) -> Message | None:
    """One message from a synchronous socket (the trainer ranks), or None when it does not decode."""
    return _decode_or_log(sock.recv_multipart()[-1], where)


def send_blocking(sock: zmq.Socket, msg: Message) -> None:
    sock.send(_encoded(msg))


async def send(sock: zmq.asyncio.Socket, msg: Message) -> None:
    await sock.send(_encoded(msg))


async def send_to(sock: zmq.asyncio.Socket, identity: bytes, msg: Message) -> None:
    await sock.send_multipart([identity, _encoded(msg)])
