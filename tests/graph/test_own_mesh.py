"""An inference node of a frozen role (ref) on a mesh of its own: which nodes may move, the
refusals that name the key to change, and the processes, devices and ports the run gets for it."""

import copy

import pytest
from test_dag import NODES, build, problems_of

from areal_flow.graph import GraphError, place
from areal_flow.graph.placement import infer_name, replica_of
from areal_flow.launchers.slurm import port_names
from areal_flow.run.ports import spec_with_ports

CRITIC = {
    "critic_values": {"type": "inference", "role": "critic", "inputs": ["prompt_ids", "output_ids"],
                      "outputs": ["values"], "mesh": "1"},
    "critic_train": {"type": "train", "role": "critic",
                     "inputs": ["prompt_ids", "output_ids", "behav_logprobs", "values", "rewards"], "mesh": "1"},
}


def with_ref(mesh="2", first=True, **ref):
    """NODES with a ref node on `mesh`, read by the train node; listed first (before the prox node) by default."""
    nodes = copy.deepcopy(NODES)
    node = {"type": "inference", "role": "ref", "inputs": ["prompt_ids", "output_ids"], "outputs": ["ref_logprobs"],
            "mesh": mesh, **ref}
    nodes = ({"ref": node} | nodes) if first else (nodes | {"ref": node})
    nodes["actor_train"]["inputs"].append("ref_logprobs")
    return nodes


def test_a_ref_node_on_a_mesh_of_its_own_is_accepted_and_the_trainer_mesh_stays_the_train_nodes():
    g = build(with_ref("2-3"), n_devices=4)
    assert g.batch_nodes[0].name == "ref"  # first in graph order: trainer_mesh is not the first batch node's
    assert g.trainer_mesh == (1,)
    assert [n.name for n in g.own_mesh_nodes] == ["ref"]
    assert [n.name for n in g.trainer_nodes] == ["actor_prox", "actor_train"] and g.roles == ["actor"]
    assert not g.colocated
    assert "ref: on a mesh of its own, one inference process per device" in g.describe()
    # On the trainer mesh it is a trainer node, as before.
    g = build(with_ref("1"))
    assert g.own_mesh_nodes == [] and [n.name for n in g.trainer_nodes] == ["ref", "actor_prox", "actor_train"]
    assert g.roles == ["ref", "actor"]


def test_a_node_of_a_trained_role_stays_on_the_trainer_mesh():
    nodes = copy.deepcopy(NODES)
    nodes["actor_prox"]["mesh"] = "2"
    msg = problems_of(nodes, n_devices=3)
    assert ("meshes of batch nodes 'actor_prox' (2) and 'actor_train' (1) differ (graph.actor_prox.mesh): role "
            "'actor' is trained, so its inference node runs on the trainer ranks, with the weights they train; only an "
            "inference node of a frozen role (ref) or a critic may have a mesh of its own") in msg
    # A critic's two nodes move together (tests/graph/test_critic_apart.py), never one alone.
    critic = copy.deepcopy(NODES) | copy.deepcopy(CRITIC)
    critic["actor_train"]["inputs"].append("values")
    together = ("a critic's inference and train nodes run together: both on the trainer mesh, or both on one mesh of "
                "their own (graph.<node>.mesh the same for both)")
    critic["critic_values"]["mesh"] = "2"
    assert ("meshes of batch nodes 'critic_values' (2) and 'actor_train' (1) differ (graph.critic_values.mesh): "
            + together) in problems_of(critic, n_devices=3)
    critic["critic_values"]["mesh"], critic["critic_train"]["mesh"] = "1", "2"
    assert ("meshes of batch nodes 'critic_train' (2) and 'actor_train' (1) differ (graph.critic_train.mesh): "
            + together) in problems_of(critic, n_devices=3)


def test_a_mesh_of_its_own_holds_torch_replicas_only():
    msg = problems_of(with_ref("2-3", parallel="t2"), n_devices=4)
    assert ("node 'ref': layout d1p1t2 (graph.ref.parallel) splits the model on a mesh of its own: its inference "
            "processes are independent replicas, one per device (data parallel only)") in msg
    assert "splits the model, which engine 'torch' cannot" not in msg  # one message for the one problem
    msg = problems_of(with_ref("2", engine="megatron"), n_devices=3)
    assert ("node 'ref': engine 'megatron' (graph.ref.engine) on a mesh of its own: its inference processes run "
            "engine 'torch', one replica per device") in msg
    # Its layout (two replicas) is not the trainer's (one rank), and need not be.
    assert build(with_ref("2-3"), n_devices=4).nodes["ref"].layout.dp == 2


def test_each_device_of_the_mesh_runs_a_replica_as_a_process_of_its_own():
    p = place(build(with_ref("2-3"), n_devices=4), rollout_workers=1)
    procs = p.of_role("inference")
    assert [(x.name, x.rank, x.devices, x.graph_node) for x in procs] == [
        ("ref_infer0", 0, (2,), "ref"), ("ref_infer1", 1, (3,), "ref")]
    assert [x.devices for x in p.of_role("trainer")] == [(1,)]
    assert "ref_infer1     core 3" in p.describe("cpu")
    # On nodes of 2 devices, the replicas are numbered on their node, as every process is.
    nodes = with_ref("4-5")
    nodes["generate"]["mesh"], nodes["actor_prox"]["mesh"], nodes["actor_train"]["mesh"] = "0-1", "2-3", "2-3"
    p = place(build(nodes, n_devices=6), rollout_workers=1, per_node=2)
    assert [(x.node, x.local_devices) for x in p.of_role("inference")] == [(2, (0,)), (2, (1,))]
    assert infer_name("ref", 1) == "ref_infer1" and [replica_of(g, 2) for g in range(4)] == [0, 1, 0, 1]


def test_the_spec_and_the_slurm_ports_name_each_replicas_inbox():
    placement = place(build(with_ref("2-3"), n_devices=4), rollout_workers=1)
    names = port_names(placement)
    assert names == ["gen_server0", "rollout0", "trainer0", "ref_infer0", "ref_infer1", "controller", "dist"]
    ports = {name: 9000 + i for i, name in enumerate(names)}
    spec = spec_with_ports(placement, ports, run_dir="/r", model_path="/m", train_path="/t", eval_path="/e")
    assert spec.infer_ports == {"ref": [9003, 9004]} and spec.trainer_ports == [9002] and spec.controller_port == 9005
    # Without such a node nothing changes.
    plain = place(build(NODES), rollout_workers=1)
    assert port_names(plain) == ["gen_server0", "rollout0", "trainer0", "controller", "dist"]
    assert spec_with_ports(plain, {n: 1 for n in port_names(plain)}, run_dir="", model_path="", train_path="",
                           eval_path="").infer_ports == {}


def test_an_allocation_keeps_a_frozen_nodes_own_mesh_and_a_collision_is_refused_naming_it():
    from omegaconf import OmegaConf

    from areal_flow.graph.allocation import apply_allocation, parse_allocation

    raw = OmegaConf.create({"generation": {"backend": "embedded", "tp_size": 1}, "graph": with_ref()})
    lines = apply_allocation(raw, parse_allocation("embedded:d1 + torch:d1"))
    assert raw.graph.ref.mesh == "2" and raw.graph.actor_train.mesh == "1" and raw.graph.generate.mesh == "0"
    assert "graph.ref.mesh=2 (kept: a frozen node on a mesh of its own)" in lines
    assert build(OmegaConf.to_container(raw.graph), n_devices=3).own_mesh_nodes[0].name == "ref"
    # A ref on the trainer's mesh (not a mesh of its own) moves with the trainer, as before.
    raw = OmegaConf.create({"generation": {"backend": "embedded", "tp_size": 1}, "graph": with_ref(mesh="1")})
    apply_allocation(raw, parse_allocation("embedded:d1 + torch:d2"))
    assert raw.graph.ref.mesh == raw.graph.actor_train.mesh == "1-2"
    # Training given the ref's device: refused, naming the ref node.
    raw = OmegaConf.create({"generation": {"backend": "embedded", "tp_size": 1}, "graph": with_ref()})
    apply_allocation(raw, parse_allocation("embedded:d1 + torch:d2"))
    assert "node 'ref': mesh 2 (graph.ref.mesh) shares device(s) 2 with 'actor_prox'" in \
        problems_of(OmegaConf.to_container(raw.graph), n_devices=3)
