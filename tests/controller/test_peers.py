"""The other processes as the controller knows them: asking every trainer rank and gathering their
replies, new ranks saying Hello, who has reported at start (controller/peers.py)."""

import asyncio
import logging

import pytest

from areal_flow.controller.peers import Peers
from areal_flow.controller.watchdog import Progress, Wait
from areal_flow.transport.messages import (Hello, Joined, PublishWeights, Ready, Saved, SaveCheckpoint, StepDone,
                                           WeightsPublished)
from areal_flow.weights import UpdateFlags
from areal_flow.weights.update import WeightUpdateError


def peers_with(n_ranks: int) -> tuple[Peers, list, Progress]:
    sent, progress = [], Progress()

    async def send(ident, msg):
        sent.append((ident, msg))

    peers = Peers(send, progress)
    for rank in range(n_ranks):
        peers.hello(f"trainer{rank}".encode(), Hello(rank))
    return peers, sent, progress


def test_replies_come_back_in_rank_order_and_the_wait_names_the_ranks_still_missing(caplog):
    async def scenario():
        peers, sent, progress = peers_with(3)
        gathering = asyncio.create_task(peers.ask(lambda rank: SaveCheckpoint(f"/ckpt/{rank}"), Saved, "saving"))
        await asyncio.sleep(0)
        assert [(ident, msg.path) for ident, msg in sent] == [(b"trainer0", "/ckpt/0"), (b"trainer1", "/ckpt/1"),
                                                              (b"trainer2", "/ckpt/2")]
        peers.reply(b"trainer2", Saved(2, "/ckpt/2"))
        peers.reply(b"trainer0", StepDone(0, 5))  # not what is asked: dropped
        peers.reply(b"trainer0", Saved(0, "/ckpt/0"))
        await asyncio.sleep(0)
        assert progress.waiting == Wait.RANKS.of(missing="trainer1", what="saving")
        peers.reply(b"trainer1", Saved(1, "/ckpt/1"))
        return await gathering

    with caplog.at_level(logging.ERROR, logger="areal_flow.controller"):
        got = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert [m.rank for m in got] == [0, 1, 2]
    assert "unexpected StepDone from a trainer rank while waiting for saving, dropped" in caplog.text


def test_a_weight_send_that_a_rank_reports_failed_raises_its_account():
    async def scenario():
        peers, sent, progress = peers_with(2)
        sending = asyncio.create_task(peers.send_weights(4, UpdateFlags(abort_all_requests=True)))
        await asyncio.sleep(0)
        assert progress.waiting == Wait.SEND_WEIGHTS.of(version=4)
        assert [msg for _, msg in sent] == [PublishWeights(4, True, False)] * 2
        peers.reply(b"trainer1", WeightsPublished(1, 4))
        peers.reply(b"trainer0", WeightsPublished(0, 4, error="gen_server0: bucket 2 refused"))
        await sending

    with pytest.raises(WeightUpdateError, match="gen_server0: bucket 2 refused"):
        asyncio.run(asyncio.wait_for(scenario(), 10))


def test_new_ranks_are_waited_for_by_their_hello_and_the_missing_ones_named():
    async def scenario():
        peers, _, _ = peers_with(2)
        peers.forget_ranks()
        with pytest.raises(asyncio.TimeoutError):
            await peers.until_ranks(3, 0.2)
        assert peers.missing(3) == [0, 1, 2]

        async def arrive():
            for rank in range(3):
                await asyncio.sleep(0.02)
                peers.hello(f"new{rank}".encode(), Hello(rank))

        asyncio.create_task(arrive())
        await peers.until_ranks(3, 5)
        return peers.ranks

    assert asyncio.run(scenario()) == {0: b"new0", 1: b"new1", 2: b"new2"}


def test_start_up_waits_for_every_rank_and_replica_and_names_those_that_never_report():
    async def scenario():
        peers, _, _ = peers_with(1)
        inbox = [Ready("ref_infer0"), Joined("reward0")]

        async def receive():  # the mailbox, handing each message to its handler
            if not inbox:
                await asyncio.sleep(30)
            msg = inbox.pop(0)
            peers.ready(b"", msg) if isinstance(msg, Ready) else peers.joined(msg)

        with pytest.raises(TimeoutError, match=r"^trainer ranks \[1\] and inference processes \['ref_infer1'\] did "
                                               r"not report within 0 s \(launcher.start_timeout\)$"):
            await peers.until_reported(2, {"ref_infer0", "ref_infer1"}, receive, 0.2)
        assert peers.replicas == {"ref_infer0"} and peers.reward_workers == {"reward0"}
        peers.hello(b"trainer1", Hello(1))
        peers.ready(b"", Ready("ref_infer1"))
        await peers.until_reported(2, {"ref_infer0", "ref_infer1"}, receive, 0.2)  # all there: no wait

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_reward_worker_that_joins_again_was_restarted():
    peers, _, _ = peers_with(0)
    assert peers.joined(Joined("reward0")) is False
    assert peers.joined(Joined("reward1")) is False
    assert peers.joined(Joined("reward0")) is True
