"""A trainer resize on the controller's side: the ask it finds, the groups it holds meanwhile, the
hand-offs it writes and the new ranks it waits for (controller/trainer_resize.py)."""

import asyncio
import json

import pytest

from areal_flow.controller.ledger import Ledger
from areal_flow.controller.peers import Peers
from areal_flow.controller.trainer_resize import TrainerResize
from areal_flow.controller.watchdog import Progress, Wait
from areal_flow.metrics.writer import MetricsWriter
from areal_flow.runtime import resize
from areal_flow.transport.messages import GroupMeta, Hello, Joined, Trainers


def resizer(tmp_path, timeout=5.0) -> tuple[TrainerResize, list]:
    sent = []

    async def send(ident, msg):
        sent.append((ident, msg))

    progress = Progress()
    peers = Peers(send, progress)
    for rank in range(2):
        peers.hello(f"trainer{rank}".encode(), Hello(rank))
    peers.joined(Joined("reward0"))
    return TrainerResize(str(tmp_path), timeout, peers, progress, Ledger(str(tmp_path / "ledger.jsonl")),
                         MetricsWriter(str(tmp_path / "metrics.jsonl"))), sent


def test_an_ask_is_found_once_and_wakes_the_step_loop(tmp_path):
    r, _ = resizer(tmp_path)
    woken = []

    async def scenario():
        watching = asyncio.create_task(r.watch(lambda: woken.append(True)))
        await asyncio.sleep(0.1)
        assert r.asked is None
        resize.ask(str(tmp_path), "a1", 3)
        for _ in range(40):
            if woken:
                break
            await asyncio.sleep(0.05)
        watching.cancel()

    asyncio.run(scenario())
    assert r.asked == {"id": "a1", "n": 3} and woken == [True]


def test_a_resize_holds_the_groups_that_arrive_and_goes_on_with_the_new_ranks(tmp_path):
    r, sent = resizer(tmp_path)
    r.asked = {"id": "a1", "n": 3}
    regrouped, meta = [], GroupMeta(9, "reward0", [])
    assert not r.hold(b"reward0", meta)  # no resize yet: routed at once

    async def checkpoint(step):
        assert r.hold(b"reward0", meta)  # held from the start of the resize
        return f"/run/checkpoints/step-{step}"

    async def scenario():
        running = asyncio.create_task(r.run(7, checkpoint, regrouped.append))
        await asyncio.sleep(0.05)
        assert r.peers.ranks == {} and r.progress.waiting == Wait.NEW_RANKS.of(n=3, path="/run/checkpoints/step-7")
        assert resize.answered(str(tmp_path), resize.SAVED, "a1")["n_before"] == 2
        for rank in range(3):
            r.peers.hello(f"new{rank}".encode(), Hello(rank))
        return await running

    held = asyncio.run(asyncio.wait_for(scenario(), 10))
    assert held == [(b"reward0", meta)] and regrouped == [3]
    assert sent == [(b"reward0", Trainers(3))]  # before any route that names a new rank
    assert resize.answered(str(tmp_path), resize.DONE, "a1")["n"] == 3
    assert r.asked is None and r.held is None and not r.hold(b"reward0", meta)
    r.ledger.flush()
    (event,) = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert (event["event"], event["trainers"], event["step"]) == ("scale", {"from": 2, "to": 3}, 7)


def test_new_ranks_that_never_report_fail_the_resize_by_name(tmp_path):
    r, _ = resizer(tmp_path, timeout=0.2)
    r.asked = {"id": "a1", "n": 2}

    async def checkpoint(step):
        return "/ckpt"

    async def scenario():
        running = asyncio.create_task(r.run(3, checkpoint, lambda n: None))
        await asyncio.sleep(0.01)
        r.peers.hello(b"new1", Hello(1))
        await running

    with pytest.raises(TimeoutError, match=r"trainer resize to 2 rank\(s\): trainer ranks \[0\] did not report in time"):
        asyncio.run(asyncio.wait_for(scenario(), 10))
