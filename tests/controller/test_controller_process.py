"""The controller built in this process, as its process builds it: from a composed config, the
prepared datasets and a tokenizer. What it decides before any other process talks to it: when it
checkpoints, and what a resumed run admits again."""

import os
import socket

import pytest
from hydra import compose, initialize_config_dir

from areal_flow.runtime.ports import free_ports
from areal_flow.checkpoint import store
from areal_flow.controller import state as run_state
from areal_flow.controller.main import Controller
from areal_flow.launch import CONF_DIR
from areal_flow.models.tokenizer import build_char_tokenizer
from areal_flow.run.prepare import prepare_data
from areal_flow.runtime.spec import RunSpec, typed


def free_port() -> int:
    return free_ports(1)[0]


@pytest.fixture()
def make_controller(tmp_path):
    made = []

    def make(*overrides: str, resume: str = "") -> Controller:
        with initialize_config_dir(str(CONF_DIR), version_base=None):
            raw = compose("config", overrides=[f"output_dir={tmp_path}/run", f"cache_dir={tmp_path}/cache", *overrides])
        cfg = typed(raw)
        train, evaluation = prepare_data(cfg)
        model = tmp_path / "model"
        if not model.exists():
            build_char_tokenizer().save_pretrained(model)
        os.makedirs(tmp_path / "run", exist_ok=True)
        spec = RunSpec(run_dir=str(tmp_path / "run"), model_path=str(model), train_path=train, eval_path=evaluation,
                       gen_ports=[free_port()], controller_port=free_port(), rollout_ports=[free_port()],
                       trainer_ports=[free_port()], dist_port=free_port(), n_trainers=1, n_rollout=1, resume=resume)
        made.append(Controller(cfg, spec))
        return made[-1]

    yield make
    for c in made:
        c.mailbox.close()


def test_it_checkpoints_every_n_steps_and_a_stop_request_wakes_the_step_loop(make_controller):
    c = make_controller("checkpoint.every_steps=3", "algorithm.batch_size=4")
    assert (c.state.staleness.batch_size, c.state.step, c.state.resumes) == (4, 0, 0)
    assert [s for s in range(1, 10) if c.checkpoints.due(s)] == [3, 6, 9]
    assert not c.stop_requested and not c.changed.is_set()
    c.request_stop()
    assert c.stop_requested and c.changed.is_set()


def test_a_resumed_controller_admits_again_the_groups_that_were_generating(make_controller, tmp_path):
    first = make_controller()
    for group in (5, 2, 9):
        first.state.staleness.admit(group)  # admitted at version 0, still generating
    first.state.step = 4
    tmp = store.begin(str(tmp_path / "run"), 4)
    run_state.save(first.state, tmp)
    folder = store.commit(tmp, 4, n_trainers=1)
    resumed = make_controller(resume=folder)
    assert resumed.admission.readmit == [2, 5, 9]  # in order, each regenerated from its prompt
    assert resumed.state.staleness.running == {} and resumed.state.step == 4 and resumed.state.resumes == 1


def _health_server():
    """A real HTTP server answering GET /health with 200, as a generation server does."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the http.server API
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.slow  # a second of waiting on the start-up timeout: the full suite runs it
def test_the_controller_waits_for_each_inference_replica_and_names_the_one_missing(make_controller):
    """Start-up with a ref node on a mesh of its own: the run starts once every trainer rank said
    Hello and every inference replica Ready; a replica that never reports fails the start, named."""
    import asyncio

    import msgspec
    import zmq

    from areal_flow.training.inference import Ready
    from areal_flow.transport.channels import make_socket, send_blocking
    from areal_flow.transport.messages import Hello

    health = _health_server()
    c = make_controller("launcher.start_timeout=1")
    c.spec = msgspec.structs.replace(c.spec, gen_ports=[health.server_address[1]], infer_ports={"ref": [free_port(), free_port()]})
    ctx = zmq.Context()
    socks = []

    def report(identity, msg):
        sock = make_socket(ctx, zmq.DEALER, connect=c.spec.endpoint("controller", c.spec.controller_port),
                           identity=identity)
        socks.append(sock)
        send_blocking(sock, msg)

    try:
        report("trainer0", Hello(0))
        report("ref_infer0", Ready("ref_infer0"))
        with pytest.raises(TimeoutError, match=r"inference processes \['ref_infer1'\] did not report within 1 s"):
            asyncio.run(c.wait_for_processes())
        report("ref_infer1", Ready("ref_infer1"))
        asyncio.run(asyncio.wait_for(c.wait_for_processes(), 10))
        assert c.peers.replicas == {"ref_infer0", "ref_infer1"} and set(c.peers.ranks) == {0}
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
        health.shutdown()


def test_the_step_loop_stops_at_the_wall_time_limit_and_the_summary_says_so(make_controller):
    import asyncio

    from areal_flow.controller.ending import run_summary, why_it_ended

    c = make_controller("max_wall_seconds=540", "total_steps=1000")

    async def no_servers() -> dict[str, float]:
        return {}

    c.step_metrics.counts = no_servers
    c.clock.start(already=541.0)  # training time so far, as a resumed run's: past the limit
    assert asyncio.run(c.train()) == 0 and c.wall_time_reached and not c.stop_requested
    reason = why_it_ended(c.cfg, 0, wall_time=c.wall_time_reached)
    assert reason == {"kind": "wall_time", "message": "max_wall_seconds=540 reached after 0 of 1000 steps"}
    summary = run_summary(c.state, c.cfg.algorithm.group_size, c.spec.run_dir, 0, stopped=False, accuracy=(None, None),
                          train_wall=541.0, checkpoint=None, reason=reason)
    assert summary["stop_reason"] == reason and not summary["stopped"]


def test_a_group_scored_again_after_its_reward_worker_restarted_goes_to_its_rank_again(make_controller):
    """A reward worker killed between the controller's Route and its send loses the group; the rank
    would wait for it until step_timeout (a run hung so). The rollout worker keeps its copy until a
    step trains the group, and a copy scored again is routed to the same rank (which drops a second
    copy it already holds); once trained, a copy is a duplicate."""
    import asyncio

    import zmq

    from areal_flow.transport.messages import DROP, Finish, GroupMeta, Released, Route, SampleMeta, decode

    c = make_controller("algorithm.success_rate_range=null")
    ctx = zmq.Context()
    peers = {}
    for name in ("reward0", "rollout0"):
        peers[name] = ctx.socket(zmq.DEALER)
        peers[name].setsockopt(zmq.IDENTITY, name.encode())
        peers[name].connect(f"tcp://127.0.0.1:{c.spec.controller_port}")
    keys = c.intake.token_keys
    lengths = {k: 4 if k == c.intake.prompt_key else 3 for k in keys}
    meta = GroupMeta(7, "reward0", [SampleMeta(f"g7-{i}", i, dict(lengths), {0: 3}, {c.intake.reward_key: float(i)},
                                               Finish.STOP) for i in range(c.cfg.algorithm.group_size)])

    def received(name: str) -> list:
        sock, got = peers[name], []
        while sock.poll(300):
            got.append(decode(sock.recv()))
        return got

    async def scored() -> None:
        await c.route(b"reward0", meta)

    async def greeted() -> None:  # the router sends only to peers it has heard from
        for sock in peers.values():
            sock.send(b"hello")
            await c.mailbox.socket.recv_multipart()

    try:
        asyncio.run(greeted())
        c.admission.slots.offer(b"rollout0", 4)
        c.admission.slots.take(7)
        c.staleness.admit(7)
        c.state.running_prompts[7] = 0
        asyncio.run(scored())
        assert received("reward0") == [Route(7, 0)]
        assert received("rollout0") == []  # the copy is kept: the route may not take effect
        asyncio.run(scored())  # the reward worker restarted, the rollout worker sent its copy again
        assert received("reward0") == [Route(7, 0)]
        asyncio.run(c.release(c.admission.in_transit.trained([7])))  # a step trained it
        assert received("rollout0") == [Released([7])]
        asyncio.run(scored())
        assert received("reward0") == [Route(7, DROP)]
    finally:
        for sock in peers.values():
            sock.close(linger=0)


def test_a_scored_group_whose_server_served_other_adapters_stops_the_run_at_the_next_batch(make_controller):
    """training.lora: a sample whose server reports adapters other than the trainer's for its version
    (messages.Served) stops the step loop with an error naming the server and the version."""
    import asyncio

    import zmq

    from areal_flow.controller.adapter_check import AdapterMismatch
    from areal_flow.transport.messages import Finish, GroupMeta, SampleMeta, Served

    c = make_controller("algorithm.success_rate_range=null")
    ctx = zmq.Context()
    reward = ctx.socket(zmq.DEALER)
    reward.setsockopt(zmq.IDENTITY, b"reward0")
    reward.connect(f"tcp://127.0.0.1:{c.spec.controller_port}")
    lengths = {k: 4 if k == c.intake.prompt_key else 3 for k in c.intake.token_keys}

    def meta(group_id: int, digest: str) -> GroupMeta:
        return GroupMeta(group_id, "reward0", [
            SampleMeta(f"g{group_id}-{i}", i, dict(lengths), {1: 3}, {c.intake.reward_key: float(i)}, Finish.STOP,
                       [Served("gen_server1", 1, digest)]) for i in range(c.cfg.algorithm.group_size)])

    async def go() -> None:
        reward.send(b"hello")  # the router sends only to peers it has heard from
        await c.mailbox.socket.recv_multipart()
        c.admission.slots.offer(b"rollout0", 4)
        for group_id in (7, 8):
            c.admission.slots.take(group_id)
            c.staleness.admit(group_id)
            c.state.running_prompts[group_id] = 0
        c.adapter_check.trained(1, "d1")  # the trainer's version 1
        await c.route(b"reward0", meta(7, "d1"))
        assert c.adapter_check.problem is None
        c.changed.clear()
        await c.route(b"reward0", meta(8, "d0"))  # served under version 1 with other adapters
        assert c.adapter_check.problem is not None and c.changed.is_set()
        await asyncio.wait_for(c.next_batch(1), 10)

    try:
        with pytest.raises(AdapterMismatch, match="generation server gen_server1 answered sample g8-0 .* at weight "
                                                  "version 1 with adapters of digest d0; the trainer's adapters of "
                                                  "version 1 have digest d1"):
            asyncio.run(go())
    finally:
        reward.close(linger=0)
        ctx.term()
