"""A secured run's ZeroMQ: real sockets over TCP on this host's address, CURVE and a ZAP handler.

Only a client with the run's keys gets a message through; a plain client, a CURVE client with a
keypair of its own, and a client of another run deliver nothing and receive nothing, and the server
keeps working for the run's own clients afterwards.
"""

import asyncio
import logging

import msgspec
import pytest
import zmq
import zmq.asyncio

from areal_flow.runtime.security import Security, host_address, release
from areal_flow.runtime.ports import free_ports
from areal_flow.transport.channels import endpoint, make_socket, recv, recv_from, send, send_blocking
from areal_flow.transport.messages import Hello, ScoredGroup, decode

QUIET = 600  # ms a server listens for a message that must not come


def impostor(run: Security) -> Security:
    """A CURVE client that knows the run's server key (it is public) but has a keypair of its own."""
    own = Security.new()
    return msgspec.structs.replace(run, client_public=own.client_public, client_secret=own.client_secret)


def close(*contexts: zmq.Context) -> None:
    for ctx in contexts:
        release(ctx)  # the ZAP handler's sockets are the context's too: stop it before term()
        ctx.destroy(linger=0)


@pytest.mark.slow  # 1.1-1.6 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_a_curve_server_receives_only_from_the_runs_clients(caplog):
    run = Security.new()
    host = host_address()
    port = free_ports(1, host)[0]
    server_ctx, client_ctx = zmq.Context(), zmq.Context()  # two processes' worth: no shared ZAP handler
    try:
        inbox = make_socket(server_ctx, zmq.PULL, bind=endpoint(port, host), security=run)
        own_keypair = impostor(run)
        strangers = {
            "plain": make_socket(client_ctx, zmq.PUSH, connect=endpoint(port, host)),
            "own keypair": make_socket(client_ctx, zmq.PUSH, connect=endpoint(port, host), security=own_keypair),
            "another run": make_socket(client_ctx, zmq.PUSH, connect=endpoint(port, host), security=Security.new()),
        }
        with caplog.at_level(logging.WARNING, logger="areal_flow.security"):
            for n, sock in enumerate(strangers.values()):
                send_blocking(sock, Hello(100 + n))  # queued by the client until a handshake succeeds
            assert inbox.poll(QUIET) == 0, "a client without the run's keys delivered a message"
        # Only the client with its own keypair reaches the ZAP handler (the others fail the
        # handshake before it): refused, and said so with its public key.
        refusals = [r.getMessage() for r in caplog.records if "refused a ZeroMQ client" in r.getMessage()]
        assert any(own_keypair.client_public in m for m in refusals), refusals

        friend = make_socket(client_ctx, zmq.PUSH, connect=endpoint(port, host), security=run)
        send_blocking(friend, Hello(7))
        assert inbox.poll(5000), "the run's own client was not heard"
        assert decode(inbox.recv()) == Hello(7)
        # The strangers' queued messages never follow.
        assert inbox.poll(QUIET) == 0
    finally:
        close(client_ctx, server_ctx)


@pytest.mark.slow  # 1.4-2.3 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_a_curve_server_sends_nothing_to_a_stranger_and_the_controller_socket_refuses_one():
    """The other direction (a rollout worker's PUSH binds, reward workers PULL from it): a stranger
    that connects gets no sample, and none is lost to it. And the controller's ROUTER, on an asyncio
    context, takes control messages from the run's DEALERs only."""
    run = Security.new()
    host = host_address()
    push_port, router_port = free_ports(2, host)

    async def main():
        server_ctx, client_ctx = zmq.asyncio.Context(), zmq.asyncio.Context()
        try:
            push = make_socket(server_ctx, zmq.PUSH, bind=endpoint(push_port, host), security=run)
            thief = make_socket(client_ctx, zmq.PULL, connect=endpoint(push_port, host), security=impostor(run))
            plain_thief = make_socket(client_ctx, zmq.PULL, connect=endpoint(push_port, host))
            await asyncio.sleep(0.3)  # the thieves are connected (and refused) before the friend
            reward = make_socket(client_ctx, zmq.PULL, connect=endpoint(push_port, host), security=run)
            for g in range(4):  # PUSH deals round-robin over its peers: a thief would take some
                await asyncio.wait_for(send(push, ScoredGroup(g, [])), 5)
            got = [(await asyncio.wait_for(recv(reward, "reward inbox"), 5)).group_id for _ in range(4)]
            stolen = [await thief.poll(QUIET // 2), await plain_thief.poll(QUIET // 2)]

            router = make_socket(server_ctx, zmq.ROUTER, bind=endpoint(router_port, host), security=run)
            forger = make_socket(client_ctx, zmq.DEALER, connect=endpoint(router_port, host), identity="forger")
            # A send may wait for a peer the router refused: refused too. (Unbounded, it hung a full
            # run once, 2026-11-28, until pytest's 300 s timeout.)
            try:
                await asyncio.wait_for(send(forger, Hello(5)), 1)
            except asyncio.TimeoutError:
                pass
            forged = await router.poll(QUIET)
            rank = make_socket(client_ctx, zmq.DEALER, connect=endpoint(router_port, host), identity="trainer0",
                               security=run)
            await asyncio.wait_for(send(rank, Hello(0)), 5)
            ident, msg = await asyncio.wait_for(recv_from(router, "controller"), 5)
            return got, stolen, forged, ident, msg
        finally:
            close(client_ctx, server_ctx)

    got, stolen, forged, ident, msg = asyncio.run(main())
    assert got == [0, 1, 2, 3]
    assert stolen == [0, 0], "a client without the run's keys received samples"
    assert forged == 0, "the controller's socket heard a client without the run's keys"
    assert (ident, msg) == (b"trainer0", Hello(0))


def test_a_secured_socket_is_a_server_or_a_client_and_a_context_serves_one_run():
    run = Security.new()
    port = free_ports(1)[0]
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="binds .* or connects"):
            make_socket(ctx, zmq.PAIR, bind=endpoint(port), connect=endpoint(port), security=run)
        make_socket(ctx, zmq.PULL, bind=endpoint(port), security=run)
        with pytest.raises(ValueError, match="another run's keys"):
            make_socket(ctx, zmq.PULL, bind=endpoint(free_ports(1)[0]), security=Security.new())
    finally:
        close(ctx)


def test_the_runs_secrets_stay_out_of_its_repr():
    run = Security.new()
    for text in (repr(run), str(run), repr(msgspec.structs.replace(run))):
        assert run.api_key not in text and run.client_secret not in text and run.server_secret not in text
    assert msgspec.json.decode(msgspec.json.encode(run), type=Security) == run  # the spec carries it whole
