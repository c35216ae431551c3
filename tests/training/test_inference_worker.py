"""An inference process (training/inference.py) over real sockets: a replica of a ref node on a
mesh of its own, in a thread, fed by a PUSH socket playing the reward worker, answering into a
bound PULL socket playing the trainer rank's inbox. Its results are the torch engine's logprobs,
whatever the order and grouping of the requests it found queued."""

import random
import threading

import numpy as np
import zmq
from engine_helpers import make_seqs, save_tiny_qwen2
from hydra import compose, initialize_config_dir

from areal_flow.launch import CONF_DIR
from areal_flow.rewards.worker import infer_requests
from areal_flow.graph import graph_from_config
from areal_flow.runtime.ports import free_ports
from areal_flow.runtime.spec import RunSpec, typed
from areal_flow.training.inference import InferenceWorker, answers
from areal_flow.training.torch_engine import TorchEngine
from areal_flow.transport.channels import endpoint, make_socket, recv_blocking, send_blocking
from areal_flow.transport.messages import Array, Inferred, InferRequest, Ready, Sample, ScoredGroup

REF = ('+graph.ref={type: inference, role: ref, inputs: [prompt_ids, output_ids], outputs: [ref_logprobs], '
       'mesh: "2", micro_batch_tokens: 64}')
READS_REF = "graph.actor_train.inputs=[prompt_ids,output_ids,behav_logprobs,versions,prox_logprobs,rewards,ref_logprobs]"


def run_config():
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return typed(compose("config", overrides=["output_dir=/tmp/unused", "cluster.n_devices=3", REF, READS_REF]))


def scored_groups(n_groups: int, size: int) -> list[ScoredGroup]:
    seqs = make_seqs(1, n_groups * size)
    return [ScoredGroup(g, [Sample(uid=f"g{g}-{i}", prompt_id="p", group_id=g, index=i, birth_time=0.0,
                                   arrays={"prompt_ids": Array.of(p.astype(np.int32)),
                                           "output_ids": Array.of(o.astype(np.int32)),
                                           "behav_logprobs": Array.of(np.zeros(len(o), dtype=np.float32))})
                            for i, (p, o) in enumerate(seqs[g * size:(g + 1) * size])])
            for g in range(n_groups)]


def test_a_replica_answers_shuffled_queued_requests_with_the_engines_logprobs(tmp_path):
    model = save_tiny_qwen2(tmp_path / "model")
    cfg = run_config()
    infer_port, trainer_port, controller_port = free_ports(3)
    spec = RunSpec(run_dir=str(tmp_path), model_path=model, train_path="", eval_path="", gen_ports=[],
                   controller_port=controller_port, rollout_ports=[], trainer_ports=[trainer_port],
                   infer_ports={"ref": [infer_port]}, dist_port=0, n_trainers=1, n_rollout=1)
    ctx = zmq.Context()
    controller = make_socket(ctx, zmq.ROUTER, bind=endpoint(controller_port))
    inbox = make_socket(ctx, zmq.PULL, bind=endpoint(trainer_port))  # the trainer rank's
    worker = InferenceWorker(cfg, spec, "ref_infer0", 0)
    reward = make_socket(ctx, zmq.PUSH, connect=endpoint(infer_port))
    groups = scored_groups(n_groups=6, size=3)
    # What the reward worker sends: only the node's inputs, here with each group's samples shuffled
    # too, and the groups queued in a shuffled order before the replica takes any.
    rng = random.Random(0)
    graph = graph_from_config(cfg)
    requests = []
    for g in groups:
        shuffled = ScoredGroup(g.group_id, rng.sample(g.samples, len(g.samples)))
        [request] = infer_requests(shuffled, 0, graph.own_mesh_nodes)
        assert set(request.inputs[0]) == {"prompt_ids", "output_ids"}  # not behav_logprobs
        requests.append(request)
    rng.shuffle(requests)
    for r in requests:
        send_blocking(reward, r)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, kwargs={"stop": stop.is_set}, daemon=True)
    thread.start()
    try:
        assert controller.poll(30_000) and isinstance(recv_blocking(controller, "controller"), Ready)
        results: dict[int, Inferred] = {}
        while len(results) < len(groups):
            assert inbox.poll(60_000), f"results for groups {sorted(results)} only"
            msg = recv_blocking(inbox, "trainer inbox")
            assert isinstance(msg, Inferred) and msg.group_id not in results
            results[msg.group_id] = msg
    finally:
        stop.set()
        thread.join(10)
        for sock in (controller, inbox, reward, worker.inbox, worker.control, *worker.ranks):
            sock.close(linger=0)
    engine = TorchEngine(model, micro_batch_tokens=64)
    for g in groups:
        expected = engine.logprobs([(s.array("prompt_ids"), s.array("output_ids")) for s in g.samples])
        got = results[g.group_id]
        assert (got.node, got.key, got.worker) == ("ref", "ref_logprobs", "ref_infer0") and got.seconds > 0
        by_index = dict(zip(got.indices, got.arrays))
        for s, lp in zip(g.samples, expected):
            np.testing.assert_allclose(by_index[s.index].numpy(), lp, atol=1e-6, rtol=0)


def test_each_group_gets_its_own_outputs_and_its_share_of_the_call_by_tokens():
    requests = [InferRequest(4, 1, "ref", [1, 0], []), InferRequest(2, 0, "ref", [0], [])]
    outputs = [np.zeros(3), np.zeros(1), np.zeros(4)]
    first, second = answers(requests, outputs, "ref_logprobs", "ref_infer0", seconds=2.0)
    assert (first.group_id, first.indices, [len(a) for a in first.arrays]) == (4, [1, 0], [3, 1])
    assert (second.group_id, [len(a) for a in second.arrays]) == (2, [4])
    assert (first.seconds, second.seconds) == (1.0, 1.0)
