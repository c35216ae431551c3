"""The controller's one socket: each message goes to the handler of its type, from one table
(controller/mailbox.py)."""

import asyncio
import logging

import zmq
import zmq.asyncio

from areal_flow.runtime.ports import free_ports
from areal_flow.controller.mailbox import Mailbox
from areal_flow.transport.channels import endpoint, make_socket, send_blocking
from areal_flow.transport.messages import Hello, Joined, Released


def free_port() -> int:
    return free_ports(1)[0]


def test_each_message_goes_to_its_types_handler_and_one_without_a_handler_is_dropped(caplog):
    port = free_port()
    got = []

    async def joined(ident, msg):  # a coroutine handler is awaited
        await asyncio.sleep(0)
        got.append(("joined", ident, msg.worker))

    async def scenario():
        box = Mailbox(make_socket(zmq.asyncio.Context(), zmq.ROUTER, bind=endpoint(port)),
                      {Hello: lambda ident, msg: got.append(("hello", ident, msg.rank)), Joined: joined})
        ctx = zmq.Context()
        client = make_socket(ctx, zmq.DEALER, connect=endpoint(port), identity="trainer1")
        try:
            for msg in (Hello(1), Released([3]), Joined("reward0")):
                send_blocking(client, msg)
            for _ in range(3):
                await asyncio.wait_for(box.receive(), 10)
            await box.send(b"trainer1", Released([7]))  # the answer goes back by the sender's identity
            assert await asyncio.wait_for(asyncio.to_thread(client.recv), 10)
        finally:
            client.close(linger=0)
            ctx.term()
            box.close()

    with caplog.at_level(logging.ERROR, logger="areal_flow.controller"):
        asyncio.run(scenario())
    assert got == [("hello", b"trainer1", 1), ("joined", b"trainer1", "reward0")]
    assert "a Released is not for the controller, dropped" in caplog.text


def test_serve_runs_its_after_step_after_every_message():
    port = free_port()
    seen, afters = [], []

    async def scenario():
        box = Mailbox(make_socket(zmq.asyncio.Context(), zmq.ROUTER, bind=endpoint(port)),
                      {Hello: lambda ident, msg: seen.append(msg.rank)})
        ctx = zmq.Context()
        client = make_socket(ctx, zmq.DEALER, connect=endpoint(port), identity="t")

        async def after():
            afters.append(len(seen))

        serving = asyncio.create_task(box.serve(after))
        try:
            for rank in (0, 1):
                send_blocking(client, Hello(rank))
            while len(afters) < 2:
                await asyncio.sleep(0.01)
        finally:
            serving.cancel()
            client.close(linger=0)
            ctx.term()
            box.close()

    asyncio.run(asyncio.wait_for(scenario(), 10))
    assert seen == [0, 1] and afters == [1, 2]
