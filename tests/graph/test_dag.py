import copy

import pytest

from areal_flow.graph import GraphError, build_graph, place
from areal_flow.graph.layout import Layout

NODES = {
    "generate": {"type": "generate", "role": "actor", "inputs": ["prompt"],
                 "outputs": ["prompt_ids", "output_ids", "behav_logprobs", "versions"], "mesh": "0"},
    "reward": {"type": "reward", "fn": "arith", "inputs": ["output_ids", "answer"], "outputs": ["rewards"]},
    "actor_prox": {"type": "inference", "role": "actor", "inputs": ["prompt_ids", "output_ids"],
                   "outputs": ["prox_logprobs"], "mesh": "1"},
    "actor_train": {"type": "train", "role": "actor",
                    "inputs": ["prompt_ids", "output_ids", "behav_logprobs", "prox_logprobs", "rewards"], "mesh": "1"},
}
FIELDS = ["prompt", "answer"]


def build(nodes, n_devices=2):
    return build_graph(nodes, FIELDS, n_devices, ["arith"])


def broken(**changes):
    nodes = copy.deepcopy(NODES)
    for path, value in changes.items():
        node, key = path.split("__")
        if value is None:
            nodes[node].pop(key, None)
        else:
            nodes[node][key] = value
    return nodes


def problems_of(nodes, n_devices=2) -> str:
    with pytest.raises(GraphError) as e:
        build(nodes, n_devices)
    return str(e.value)


def test_edges_come_from_keys_and_order_follows_them():
    g = build(NODES)
    assert g.order.index("generate") < g.order.index("reward") < g.order.index("actor_train")
    assert g.order.index("actor_prox") < g.order.index("actor_train")
    assert ("actor_prox", "actor_train", "prox_logprobs") in g.edges()
    assert [n.name for n in g.batch_nodes] == ["actor_prox", "actor_train"]
    assert g.trainer_mesh == (1,)


def test_placement_has_one_process_per_role_and_device():
    nodes = broken(generate__mesh="0-1", actor_prox__mesh="2,3", actor_train__mesh="2,3")
    p = place(build(nodes, n_devices=4), rollout_workers=2)
    assert [x.devices for x in p.of_role("gen_server")] == [(0,), (1,)]
    assert [(x.rank, x.devices) for x in p.of_role("trainer")] == [(0, (2,)), (1, (3,))]
    assert len(p.of_role("rollout")) == 2 and len(p.of_role("controller")) == 1


def test_a_generation_server_spans_tp_size_consecutive_devices_of_the_generate_mesh():
    nodes = broken(generate__mesh="0,2,4,5", actor_prox__mesh="6", actor_train__mesh="6")
    p = place(build(nodes, n_devices=8), rollout_workers=1, gen_tp_size=2)
    assert [(x.name, x.rank, x.devices) for x in p.of_role("gen_server")] == [
        ("gen_server0", 0, (0, 2)), ("gen_server1", 1, (4, 5))]
    assert "gen_server1    core 4,5" in p.describe("cpu")


def test_on_several_nodes_each_process_gets_its_node_and_the_devices_numbered_there():
    nodes = broken(generate__mesh="0-5", actor_prox__mesh="6-9", actor_train__mesh="6-9")
    p = place(build(nodes, n_devices=12), rollout_workers=1, gen_tp_size=2, per_node=4)
    assert [(x.node, x.local_devices) for x in p.of_role("gen_server")] == [(0, (0, 1)), (0, (2, 3)), (1, (0, 1))]
    assert [(x.node, x.local_devices) for x in p.of_role("trainer")] == [(1, (2,)), (1, (3,)), (2, (0,)), (2, (1,))]
    assert all(x.node == 0 for x in p.procs if not x.devices)  # controller, rollout, reward: node 0
    text = p.describe("cuda")
    assert text.startswith("placement on 3 nodes:") and "gen_server2    node 1   gpu 0,1" in text


def test_unknown_type_and_role_name_node_and_key():
    msg = problems_of(broken(reward__type="scorer", actor_prox__role="teacher"))
    assert "node 'reward': unknown type 'scorer' (graph.reward.type)" in msg
    assert "node 'actor_prox': unknown model role 'teacher' (graph.actor_prox.role)" in msg


def test_key_read_but_never_written():
    msg = problems_of(broken(actor_train__inputs=["prompt_ids", "output_ids", "behav_logprobs", "prox_logprob", "rewards"]))
    assert "node 'actor_train' reads key 'prox_logprob' (graph.actor_train.inputs) but no node writes it" in msg


def test_key_written_twice_and_dataset_key_overwritten():
    msg = problems_of(broken(actor_prox__outputs=["rewards"]))
    assert "key 'rewards' is written by two nodes" in msg
    msg = problems_of(broken(reward__outputs=["answer"]))
    assert "key 'answer' is written by node 'reward'" in msg and "dataset field" in msg


def test_cycle_is_named():
    nodes = broken(actor_prox__inputs=["prompt_ids", "output_ids", "extra"])
    nodes["actor_train"]["outputs"] = ["extra"]
    msg = problems_of(nodes)
    assert "cycle in the graph" in msg and "'actor_prox'" in msg and "'actor_train'" in msg and "extra" in msg


def test_mesh_beyond_devices_bad_syntax_and_overlaps():
    assert "uses device 3 but the cluster has 2 (cluster.n_nodes × cluster.n_devices)" in problems_of(broken(actor_train__mesh="1-3"))
    assert "mesh 'one' is not a device list" in problems_of(broken(generate__mesh="one"))
    msg = problems_of(broken(generate__mesh="0-1"))
    assert "meshes of 'generate' (0,1) and 'actor_prox' (1) overlap" in msg
    msg = problems_of(broken(actor_prox__mesh="0-1", generate__mesh="2"), n_devices=3)
    assert "batch nodes 'actor_prox' (0,1) and 'actor_train' (1) differ" in msg
    assert "needs a mesh (graph.actor_train.mesh)" in problems_of(broken(actor_train__mesh=None))


def test_unknown_reward_function_and_missing_train_inputs():
    assert "unknown reward function 'gsm8k' (graph.reward.fn)" in problems_of(broken(reward__fn="gsm8k"))
    msg = problems_of(broken(actor_train__inputs=["prompt_ids", "output_ids", "prox_logprobs", "rewards"]))
    assert "a train node must read behav_logprobs (graph.actor_train.inputs)" in msg


def test_streaming_node_cannot_read_from_batch_node():
    nodes = broken(reward__inputs=["output_ids", "answer", "prox_logprobs"])
    assert "streaming nodes (generate, reward, combine) run before batch nodes" in problems_of(nodes)


def test_every_problem_is_reported_at_once():
    err = pytest.raises(GraphError, build, broken(reward__type="x", actor_train__mesh="7")).value
    assert len(err.problems) >= 2


def test_train_node_must_read_a_reward_and_reward_nodes_need_a_reference():
    msg = problems_of(broken(actor_train__inputs=["prompt_ids", "output_ids", "behav_logprobs", "prox_logprobs"]))
    assert "a train node must read the output of a reward node (graph.actor_train.inputs)" in msg
    msg = problems_of(broken(reward__inputs=["output_ids"]))
    assert "node 'reward': a reward node reads exactly one dataset field, the reference answer" in msg


def test_a_critic_has_one_train_node_and_only_it_writes_values():
    nodes = copy.deepcopy(NODES)
    nodes["critic_values"] = {"type": "inference", "role": "critic", "inputs": ["prompt_ids", "output_ids"],
                              "outputs": ["values"], "mesh": "1"}
    critic_train = {"type": "train", "role": "critic", "mesh": "1",
                    "inputs": ["prompt_ids", "output_ids", "behav_logprobs", "values", "rewards"]}
    nodes["critic_train"] = critic_train
    g = build_graph(nodes, ["prompt", "answer"], 2, ["arith"])
    assert g.train.name == "actor_train" and g.critic_train.name == "critic_train"
    assert g.order.index("critic_values") < g.order.index("critic_train")
    msg = problems_of({**nodes, "critic_train2": critic_train})
    assert "the graph has 2 train nodes with role critic (critic_train, critic_train2): at most one" in msg
    msg = problems_of({**nodes, "critic_values": {**nodes["critic_values"], "role": "actor"}})
    assert "node 'critic_values': values come from an inference node with role critic, not 'actor'" in msg


def test_what_an_output_means_is_declared_not_guessed_from_the_role():
    # An actor node writing a name that is no well-known key must say what it is.
    msg = problems_of(broken(actor_prox__outputs=["old_logp"], actor_train__inputs=[
        "prompt_ids", "output_ids", "behav_logprobs", "old_logp", "rewards"]))
    assert "not 'old_logp' (graph.actor_prox.outputs; name a well-known key differently with graph.actor_prox.keys)" in msg
    renamed = broken(actor_prox__outputs=["old_logp"], actor_prox__keys={"prox_logprobs": "old_logp"},
                     actor_train__inputs=["prompt_ids", "output_ids", "behav_logprobs", "old_logp", "rewards"])
    g = build(renamed)
    assert g.input(g.nodes["actor_train"], "prox_logprobs") == "old_logp"
    assert "-> old_logp as prox_logprobs" in g.describe()
    # π_prox is the trained actor's: a ref model writing it is refused.
    msg = problems_of(broken(actor_prox__role="ref"))
    assert "node 'actor_prox': prox_logprobs come from an inference node with role actor, not 'ref'" in msg


def test_keys_maps_only_what_the_node_writes():
    msg = problems_of(broken(generate__keys={"rewards": "output_ids"}))
    assert "graph.generate.keys maps 'rewards', which a generate node does not write" in msg
    msg = problems_of(broken(generate__keys={"versions": "v"}))
    assert "graph.generate.keys maps 'versions' to 'v', which is not one of its outputs" in msg


def test_two_rewards_need_a_combine_node_with_a_weight_for_each():
    nodes = copy.deepcopy(NODES)
    nodes["fmt"] = {"type": "reward", "fn": "arith", "inputs": ["output_ids", "answer"], "outputs": ["fmt"]}
    nodes["actor_train"]["inputs"] = nodes["actor_train"]["inputs"] + ["fmt"]
    assert "node 'actor_train' reads more than one rewards (graph.actor_train.inputs): add a combine node" in problems_of(nodes)
    nodes["actor_train"]["inputs"] = [k for k in nodes["actor_train"]["inputs"] if k not in ("fmt", "rewards")] + ["total"]
    nodes["total"] = {"type": "combine", "inputs": ["rewards", "fmt"], "outputs": ["total"], "weights": {"rewards": 1.0}}
    assert "graph.total.weights must have exactly the keys of graph.total.inputs" in problems_of(nodes)
    nodes["total"]["weights"] = {"rewards": 1.0, "fmt": 0.5}
    g = build(nodes)
    assert [n.name for n in g.scorers][-1] == "total" and g.input(g.nodes["actor_train"], "rewards") == "total"


def test_a_node_that_reads_a_key_its_type_does_not_use_is_refused():
    msg = problems_of(broken(actor_prox__inputs=["prompt_ids", "output_ids", "rewards"]))
    assert "node 'actor_prox' (inference) reads 'rewards' (rewards), which it does not use" in msg


def test_engines_are_named_per_node_one_per_role_and_only_ones_that_exist():
    assert build(NODES).nodes["actor_train"].engine == "torch"  # the default
    g = build(broken(actor_prox__engine="megatron", actor_train__engine="megatron"))
    assert g.nodes["actor_train"].engine == "megatron"
    msg = problems_of(broken(actor_train__engine="deepspeed"))
    assert "node 'actor_train': unknown engine 'deepspeed' (graph.actor_train.engine); expected one of torch, megatron" in msg
    msg = problems_of(broken(actor_train__engine="megatron"))
    assert ("nodes 'actor_prox' and 'actor_train' run role 'actor' on different engines ('torch', 'megatron'; "
            "graph.actor_train.engine): a role has one model") in msg


def test_packed_rows_per_call_are_a_torch_engine_setting():
    assert build(NODES).nodes["actor_train"].row_tokens is None  # the default: one row per micro-batch
    assert build(broken(actor_train__row_tokens=128)).nodes["actor_train"].row_tokens == 128
    msg = problems_of(broken(actor_prox__engine="megatron", actor_train__engine="megatron", actor_train__row_tokens=128))
    assert ("node 'actor_train': row_tokens=128 (graph.actor_train.row_tokens) is for engine 'torch'; the megatron "
            "engine packs each micro-batch as one THD row") in msg


def test_batch_nodes_take_a_parallel_layout_checked_against_their_mesh_and_engine():
    wide = dict(generate__mesh="0", actor_prox__mesh="1-4", actor_train__mesh="1-4",
                actor_prox__engine="megatron", actor_train__engine="megatron")
    assert build(broken(**wide), n_devices=5).nodes["actor_train"].layout == Layout(dp=4)  # default: all DP
    g = build(broken(**wide, actor_prox__parallel="d2t2", actor_train__parallel={"dp": 2, "tp": 2}), n_devices=5)
    assert g.nodes["actor_prox"].layout == g.nodes["actor_train"].layout == Layout(dp=2, tp=2)
    assert build(NODES).nodes["generate"].layout is None  # generation is not placed by a layout (yet)

    msg = problems_of(broken(**wide, actor_prox__parallel="t2p2d2", actor_train__parallel="t2p2d2"), n_devices=5)
    assert ("node 'actor_train' (graph.actor_train.parallel): layout d2p2t2 needs dp·tp·pp = 2·2·2 = 8 devices, "
            "the mesh has 4") in msg
    msg = problems_of(broken(**wide, actor_prox__parallel="d2t2", actor_train__parallel="d2p2"), n_devices=5)
    assert ("batch nodes 'actor_prox' (d2p1t2) and 'actor_train' (d2p2t1) have different layouts "
            "(graph.actor_train.parallel)") in msg
    msg = problems_of(broken(**wide, actor_prox__parallel="d2x", actor_train__parallel="d2t2"), n_devices=5)
    assert "node 'actor_prox' (graph.actor_prox.parallel): 'd2x' is not a layout like 'd2p2t2'" in msg
    torch_tp = dict(wide, actor_prox__engine="torch", actor_train__engine="torch")
    msg = problems_of(broken(**torch_tp, actor_prox__parallel="d2t2", actor_train__parallel="d2t2"), n_devices=5)
    assert ("node 'actor_train': layout d2p1t2 (graph.actor_train.parallel) splits the model, which engine 'torch' "
            "cannot: tensor and pipeline parallel need engine: megatron") in msg
