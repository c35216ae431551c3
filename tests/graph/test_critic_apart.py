"""A critic on a mesh of its own: its inference and train nodes together on devices no other node
uses, one process a device that computes values and trains (training/critic.py), a rendezvous port
for their process group, never restarted alone; the refusals name the key to change."""

import copy

import pytest
from test_dag import NODES, build, problems_of
from test_own_mesh import CRITIC

from areal_flow.config.schema import RunConfig, node_config
from areal_flow.graph import place
from areal_flow.launchers.slurm import port_names
from areal_flow.run import start
from areal_flow.run.ports import spec_with_ports


def with_critic(mesh="2", train_mesh=None, **train):
    nodes = copy.deepcopy(NODES) | copy.deepcopy(CRITIC)
    nodes["actor_train"]["inputs"].append("values")
    nodes["critic_values"]["mesh"] = mesh
    nodes["critic_train"].update(mesh=train_mesh or mesh, **train)
    return nodes


def test_a_critic_apart_runs_its_two_nodes_in_one_inference_process_and_the_trainer_keeps_the_actor():
    g = build(with_critic("2"), n_devices=3)
    assert g.critic_apart.name == "critic_train" and [n.name for n in g.own_mesh_nodes] == ["critic_values"]
    assert [n.name for n in g.trainer_nodes] == ["actor_prox", "actor_train"] and g.roles == ["actor"]
    assert "the same process runs critic_train, on the batch the trainer ranks send it" in g.describe()
    placement = place(g, rollout_workers=1)
    assert [(p.name, p.devices, p.graph_node) for p in placement.of_role("inference")] == [
        ("critic_values_infer0", (2,), "critic_values")]
    assert [p.devices for p in placement.of_role("trainer")] == [(1,)]
    names = port_names(placement)
    spec = spec_with_ports(placement, {n: 9000 + i for i, n in enumerate(names)}, run_dir="/r", model_path="/m",
                           train_path="/t", eval_path="/e")
    assert spec.infer_ports == {"critic_values": [9000 + names.index("critic_values_infer0")]}
    # On the trainer mesh, as before: the trainer ranks run both nodes.
    g = build(with_critic("1"))
    assert g.critic_apart is None and g.own_mesh_nodes == []
    assert [n.name for n in g.trainer_nodes] == ["actor_prox", "critic_values", "actor_train", "critic_train"]


def test_a_critic_apart_on_two_devices_gets_two_processes_and_their_rendezvous_port():
    placement = place(build(with_critic("2-3"), n_devices=4), rollout_workers=1)
    assert [(p.name, p.devices, p.rank) for p in placement.of_role("inference")] == [
        ("critic_values_infer0", (2,), 0), ("critic_values_infer1", (3,), 1)]
    assert placement.rendezvous == ["critic_values"]
    names = port_names(placement)
    assert names[-3:] == ["controller", "dist", "critic_values_dist"]  # after the fixed base's: theirs do not move
    spec = spec_with_ports(placement, {n: 9000 + i for i, n in enumerate(names)}, run_dir="/r", model_path="/m",
                           train_path="/t", eval_path="/e")
    assert spec.infer_dist_ports == {"critic_values": 9000 + len(names) - 1}
    assert spec.infer_ports["critic_values"] == [9000 + names.index(f"critic_values_infer{i}") for i in (0, 1)]
    # One device, or a frozen ref on two: no process group, no rendezvous.
    assert place(build(with_critic("2"), n_devices=3), rollout_workers=1).rendezvous == []


@pytest.mark.parametrize("change,problem", [
    (dict(mesh="0"), "node 'critic_train': mesh 0 (graph.critic_train.mesh) shares device(s) 0 with 'generate' (0): a "
                     "critic on a mesh of its own trains in a process of its own, on devices no other node uses"),
    (dict(engine="megatron"), "node 'critic_train': engine 'megatron' (graph.critic_train.engine) on a mesh of its own"),
    (dict(parallel="d1t2"), "node 'critic_train': layout "),
])
def test_what_a_critic_apart_cannot_be_is_refused_naming_the_key(change, problem):
    mesh = change.pop("mesh", "2")
    assert problem in problems_of(with_critic(mesh, **change), n_devices=4)


def test_the_critics_process_is_not_restarted_alone_but_a_frozen_replicas_is():
    from test_own_mesh import with_ref

    nodes = with_critic("3") | {"ref": with_ref("2")["ref"]}
    nodes["actor_train"]["inputs"].append("ref_logprobs")
    g = build(nodes, n_devices=4)
    placement = place(g, rollout_workers=1)
    names = port_names(placement)
    spec = spec_with_ports(placement, {n: 9000 + i for i, n in enumerate(names)}, run_dir="/r", model_path="/m",
                           train_path="/t", eval_path="/e")

    class Recorder:
        started = {}

        def start(self, proc, argv, env, again=None, restarts=0):
            self.started[proc.name] = again

    launcher = Recorder()
    start.start_processes(launcher, placement, spec, RunConfig(graph={n: node_config(n, c) for n, c in nodes.items()}))
    assert launcher.started["critic_values_infer0"] is None  # its death stops the run: its training state is here
    assert launcher.started["ref_infer0"] is not None
