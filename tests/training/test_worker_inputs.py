import numpy as np
import pytest

from areal_flow.config.schema import AlgorithmConfig, RunConfig
from areal_flow.graph import build_graph
from areal_flow.training.engine import LOSS_MASK_KEY
from areal_flow.training.worker import group_servers, minibatches, optim_spec, ppo_inputs
from areal_flow.transport.messages import Array, Finish, Sample

NODES = {
    "generate": {"type": "generate", "role": "actor", "inputs": ["prompt"],
                 "outputs": ["prompt_ids", "output_ids", "behav_logprobs", "versions"], "mesh": "0"},
    "reward": {"type": "reward", "fn": "arith", "inputs": ["output_ids", "answer"], "outputs": ["score"]},
    "prox": {"type": "inference", "role": "actor", "inputs": ["prompt_ids", "output_ids"], "outputs": ["lp_prox"],
             "keys": {"prox_logprobs": "lp_prox"}, "mesh": "1"},
    "ref": {"type": "inference", "role": "ref", "inputs": ["prompt_ids", "output_ids"], "outputs": ["lp_ref"],
            "keys": {"ref_logprobs": "lp_ref"}, "mesh": "1"},
    "train": {"type": "train", "role": "actor", "mesh": "1",
              "inputs": ["prompt_ids", "output_ids", "behav_logprobs", "lp_prox", "lp_ref", "score"]},
}


def algo(**changes) -> AlgorithmConfig:
    return AlgorithmConfig(**{"group_size": 2, **changes})


def sample(group: int, index: int, n_out: int, reward: float, finish: Finish = Finish.STOP) -> Sample:
    out = np.arange(n_out, dtype=np.int32)
    lp = lambda shift: Array.of(np.full(n_out, -1.0 - shift, dtype=np.float32))  # noqa: E731
    return Sample(uid=f"g{group}-{index}", prompt_id="p", group_id=group, index=index, birth_time=0.0,
                  arrays={"prompt_ids": Array.of(np.array([5, 6], dtype=np.int32)), "output_ids": Array.of(out),
                          "behav_logprobs": lp(0.0), "lp_prox": lp(0.1), "lp_ref": lp(0.2)},
                  scalars={"score": reward}, finish=finish)


def test_advantages_are_normalised_per_group_and_cover_every_answer_token():
    graph = build_graph(NODES, ["prompt", "answer"], 2, ["arith"])
    samples = [sample(0, 0, 3, 1.0), sample(0, 1, 5, 0.0), sample(1, 0, 2, 1.0), sample(1, 1, 4, 1.0)]
    seqs, data = ppo_inputs(samples, graph, graph.nodes["train"], algo())
    adv = [a.tolist() for a in data["advantages"]]
    assert [len(a) for a in adv] == [3, 5, 2, 4]  # one value per output token
    assert adv[0][0] > 0 > adv[1][0] and adv[0][0] == pytest.approx(-adv[1][0])  # centred within group 0
    assert adv[2] == [0.0, 0.0] and adv[3] == [0.0] * 4  # group 1 all right: no signal
    assert [len(o) for _, o in seqs] == [3, 5, 2, 4]


def test_prox_and_ref_logprobs_are_told_apart_by_the_meaning_their_writer_declares():
    graph = build_graph(NODES, ["prompt", "answer"], 2, ["arith"])
    _, data = ppo_inputs([sample(0, 0, 3, 1.0), sample(0, 1, 3, 0.0)], graph, graph.nodes["train"], algo())
    assert data["prox_logprobs"][0][0] == pytest.approx(-1.1)
    assert data["ref_logprobs"][0][0] == pytest.approx(-1.2)
    assert data["behav_logprobs"][0][0] == pytest.approx(-1.0)


def test_without_a_prox_node_the_train_node_gets_no_prox_logprobs():
    nodes = {k: v for k, v in NODES.items() if k != "prox"}
    nodes["train"] = {**NODES["train"], "inputs": ["prompt_ids", "output_ids", "behav_logprobs", "lp_ref", "score"]}
    graph = build_graph(nodes, ["prompt", "answer"], 2, ["arith"])
    _, data = ppo_inputs([sample(0, 0, 3, 1.0), sample(0, 1, 3, 0.0)], graph, graph.nodes["train"], algo())
    assert "prox_logprobs" not in data and "ref_logprobs" in data


def test_truncated_answers_get_a_zero_loss_mask_only_when_asked():
    graph = build_graph(NODES, ["prompt", "answer"], 2, ["arith"])
    samples = [sample(0, 0, 3, 1.0), sample(0, 1, 4, 0.0, Finish.LENGTH)]
    _, data = ppo_inputs(samples, graph, graph.nodes["train"], algo(mask_truncated=True))
    assert [m.tolist() for m in data[LOSS_MASK_KEY]] == [[True] * 3, [False] * 4]
    _, data = ppo_inputs(samples, graph, graph.nodes["train"], algo())
    assert LOSS_MASK_KEY not in data


def test_minibatches_split_by_whole_groups_and_repeat_per_epoch():
    group_ids = [3, 3, 1, 1, 2, 2, 5, 5]  # as samples arrive, not sorted
    one = minibatches(group_ids, n_minibatches=2, epochs=1)
    assert one == [[2, 3, 4, 5], [0, 1, 6, 7]]  # groups {1, 2} then {3, 5}: whole groups, each sample once
    assert minibatches(group_ids, n_minibatches=2, epochs=3) == one * 3
    assert minibatches(group_ids, n_minibatches=1, epochs=2) == [list(range(8))] * 2
    # More minibatches than groups: the extra ones are empty (the engine still joins the collectives).
    assert minibatches([0, 0], n_minibatches=2, epochs=1) == [[0, 1], []]


def test_the_lr_schedule_spans_every_optimizer_step_of_the_run():
    cfg = RunConfig(total_steps=10, algorithm=algo(n_minibatches=2, ppo_epochs=3, lr_schedule="linear"))
    assert optim_spec(cfg).decay_steps == 60


def test_the_weights_group_gives_a_real_sglang_server_one_rank_per_tp_rank():
    """SGLang's TP ranks each join the group (rank_offset + tp_rank); the embedded engine, whose
    tp_size is its torch threads, is one rank. Offsets follow from that."""
    from areal_flow.config.schema import GenerationConfig
    from areal_flow.training.weight_sender import WeightSender

    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    for backend, ranks, offsets, world in (("sglang", 2, [1, 3], 5), ("embedded", 1, [1, 2], 3)):
        servers = group_servers(RunConfig(generation=GenerationConfig(backend=backend, tp_size=2)), urls)
        assert [(s.name, s.url, s.ranks) for s in servers] == [("gen_server0", urls[0], ranks),
                                                                ("gen_server1", urls[1], ranks)]
        sender = WeightSender(servers)
        assert (sender.rank_offsets, sender.world_size) == (offsets, world)
