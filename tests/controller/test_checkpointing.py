"""Resumable checkpoints as the controller takes them: when one is due, what it holds, how it is
recorded (controller/checkpointing.py)."""

import asyncio
import json
import os

import msgspec

from areal_flow.checkpoint import store
from areal_flow.config.schema import CheckpointConfig
from areal_flow.controller import state as run_state
from areal_flow.controller.checkpointing import Checkpoints
from areal_flow.controller.intake import Intake
from areal_flow.controller.peers import Peers
from areal_flow.controller.run_metrics import RunClock
from areal_flow.controller.staleness import StalenessManager
from areal_flow.controller.watchdog import Progress, Wait
from areal_flow.metrics.writer import MetricsWriter
from areal_flow.transport.messages import Hello, Saved


def checkpoints(tmp_path, clock=None, **cfg) -> tuple[Checkpoints, list]:
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    (run_dir / "config.yaml").write_text("total_steps: 10\n")
    progress, asked = Progress(), []
    peers: Peers

    async def send(ident, msg):  # each rank writes its part and answers Saved
        asked.append((ident, msg, str(progress.waiting)))
        rank = int(ident.decode()[-1])
        os.makedirs(msg.path, exist_ok=True)
        with open(os.path.join(msg.path, f"rank{rank}.bin"), "wb") as f:
            f.write(b"x" * (rank + 1))
        peers.reply(ident, Saved(rank, msg.path))

    peers = Peers(send, progress)
    for rank in range(2):
        peers.hello(f"trainer{rank}".encode(), Hello(rank))
    if clock is None:
        clock = RunClock()
        clock.start()
    return Checkpoints(CheckpointConfig(**cfg), str(run_dir), peers, clock,
                       MetricsWriter(str(run_dir / "metrics.jsonl")), progress), asked


def test_one_is_due_every_n_steps_or_every_m_minutes_of_training(tmp_path):
    ckpt, _ = checkpoints(tmp_path, every_steps=3)
    assert [s for s in range(1, 10) if ckpt.due(s)] == [3, 6, 9]
    clock = RunClock()
    clock.start(already=600.0)
    ckpt, _ = checkpoints(tmp_path, clock=clock, every_minutes=5)
    ckpt.saved = (2, 400.0)
    assert not ckpt.due(3)  # 200 s of training since the last
    ckpt.saved = (2, 300.0)
    assert ckpt.due(3)


def test_a_checkpoint_holds_the_run_state_each_ranks_part_and_the_config(tmp_path):
    ckpt, asked = checkpoints(tmp_path, keep_last=1)
    state = run_state.RunState(StalenessManager(2, 1, 8), Intake(2, 2, [], [], "p", "r"), step=4)

    def snapshot():
        return msgspec.json.encode(state), 3, {0: [7], 1: []}

    path = asyncio.run(ckpt.save(4, snapshot))
    assert [(ident, msg.groups) for ident, msg, _ in asked] == [(b"trainer0", [7]), (b"trainer1", [])]
    assert asked[0][2] == str(Wait.CHECKPOINT.of(step=4))
    assert store.problem(path) is None and store.latest(str(tmp_path / "run")) == path
    manifest = store.read_manifest(path)
    assert (manifest["step"], manifest["version"], manifest["n_trainers"]) == (4, 3, 2)
    assert run_state.load(path).step == 4 and open(os.path.join(path, "config.yaml")).read() == "total_steps: 10\n"
    assert ckpt.of_step(4) == path and ckpt.of_step(5) is None and ckpt.saved[0] == 4
    second = asyncio.run(ckpt.save(6, snapshot))
    assert store.listed(str(tmp_path / "run")) == [second]  # keep_last=1 removed the first
    ckpt.metrics.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["event"], r["step"], r["removed"]) for r in rows] == [("checkpoint", 4, []), ("checkpoint", 6, [path])]
