"""A judge (a generate node of role judge): the graph it makes, and each refusal by name."""

import copy

import pytest
from judge_graphs import JUDGE, build, problems_of, with_judge
from omegaconf import OmegaConf
from test_dag import NODES
from test_own_mesh import with_ref

from areal_flow.graph.allocation import apply_allocation, parse_allocation


def test_the_recipes_graph_is_accepted_with_the_policy_its_judge_and_their_references():
    g = build(with_judge(), n_devices=3)
    assert g.order.index("generate") < g.order.index("judge") < g.order.index("judge_reward") < g.order.index("combine")
    assert g.generate.name == "generate" and [n.name for n in g.judges] == ["judge"]
    assert g.nodes["judge"].kind.must_write == ("judge_ids",) and g.meaning["judge_ids"] == "judge_ids"
    assert g.reference(g.nodes["judge_reward"]) == "judge_ids" and g.reference(g.nodes["reward"]) == "answer"
    assert g.eval_reward.name == "reward" and g.dataset_inputs(g.nodes["judge"]) == ["prompt"]
    assert not g.colocated and g.own_mesh_nodes == [] and g.trainer_mesh == (1,)
    assert ("judge: a frozen judge on mesh 2, one generation server per device, model the run's starting model; "
            "never updated") in g.describe()
    assert "model /m/j; never updated" in build(with_judge(model="/m/j"), n_devices=3).describe()


@pytest.mark.parametrize("mesh, other, nodes", [
    ("1", "'actor_prox' (1)", with_judge()),
    ("0", "'generate' (0)", with_judge()),
    ("2", "'ref' (2)", with_judge(with_ref("2"))),
])
def test_a_judge_shares_no_device(mesh, other, nodes):
    nodes["judge"]["mesh"] = mesh
    assert (f"node 'judge': mesh {mesh} (graph.judge.mesh) shares device(s) {mesh} with {other}: a judge's generation "
            "servers hold its model and KV cache for the whole run, on devices no other node uses") in \
        problems_of(nodes, n_devices=3)


def test_a_second_policy_is_refused_naming_the_role_to_change():
    nodes = copy.deepcopy(NODES) | {"gen_b": copy.deepcopy(NODES["generate"]) | {"mesh": "2"}}
    nodes["gen_b"]["outputs"] = ["b_ids"]
    nodes["gen_b"]["keys"] = {"output_ids": "b_ids"}
    assert ("the graph needs exactly one generate node with role actor (the policy), found 2 ('generate', 'gen_b'): "
            "two trained policies are not supported in this version; a frozen model's generate node is role judge "
            "(graph.gen_b.role)") in problems_of(nodes, n_devices=3)


def test_a_judges_own_settings_and_the_settings_only_a_judge_has():
    msg = problems_of(with_judge(template=None, parallel="d1"), n_devices=3)
    assert "node 'judge': a judge needs a prompt template (graph.judge.template)" in msg
    assert ("node 'judge': graph.judge.parallel: a judge runs one generation server per device of its mesh (no tensor "
            "parallel for judges in this version)") in msg
    nodes = with_judge()
    nodes["generate"] |= {"template": "{prompt}", "temperature": 0.7}
    assert ("node 'generate': graph.generate.template, graph.generate.temperature: a judge's settings (role judge); "
            "the policy's are dataset.prompt_template, model.path and algorithm.*") in problems_of(nodes, n_devices=3)


def test_judge_roles_elsewhere_chained_judges_and_double_references_are_refused():
    nodes = with_judge()
    nodes["actor_prox"]["role"] = "judge"
    assert "node 'actor_prox': a inference node runs on role actor or ref or critic, not 'judge' (graph.actor_prox.role)" \
        in problems_of(nodes, n_devices=3)
    nodes = with_judge()
    nodes["j2"] = {**JUDGE, "inputs": ["prompt", "output_ids", "judge_ids"], "outputs": ["j2_ids"],
                   "keys": {"judge_ids": "j2_ids"}, "mesh": "3"}
    nodes["judge_reward"]["inputs"].append("j2_ids")
    assert "node 'j2' (generate) reads 'judge_ids' (judge_ids), which it does not use (graph.j2.inputs)" in \
        problems_of(nodes, n_devices=4)
    nodes = with_judge()
    nodes["judge_reward"]["inputs"].append("answer")
    assert ("node 'judge_reward': a reward node compares the answer with one reference: dataset field 'answer' or a "
            "judge's judge_ids, not both (graph.judge_reward.inputs)") in problems_of(nodes, n_devices=3)
    nodes = with_judge()
    nodes["judge"]["inputs"] = ["output_ids"]
    assert ("node 'judge': a generate node of role judge reads one or more dataset fields, the fields its template "
            "names (graph.judge.inputs has none)") in problems_of(nodes, n_devices=3)


def test_an_allocation_leaves_the_judge_on_its_mesh_and_an_overlap_names_the_judge():
    raw = OmegaConf.create({"generation": {"backend": "embedded", "tp_size": 1}, "graph": with_judge()})
    lines = apply_allocation(raw, parse_allocation("d1 + d2"))
    assert raw.graph.judge.mesh == "2" and not any("graph.judge" in line for line in lines)
    assert "node 'judge': mesh 2 (graph.judge.mesh) shares device(s) 2 with 'actor_prox' (1,2)" in \
        problems_of(OmegaConf.to_container(raw.graph), n_devices=3)
