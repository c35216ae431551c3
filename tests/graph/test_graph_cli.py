"""Nodes added and removed from the command line and in a recipe, and the node kinds as a registry
that graph validation reads."""

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from areal_flow.config.nodes import BatchNodeConfig
from areal_flow.config.validate import ConfigError, check_known_keys
from areal_flow.graph import GraphError, build_graph, graph_from_config, keys
from areal_flow.graph.allocation import apply_allocation, parse_allocation
from areal_flow.graph.keys import NodeKind, register
from areal_flow.launch import CONF_DIR
from areal_flow.runtime.spec import typed

REF = '+graph.ref={type: inference, role: ref, inputs: [prompt_ids, output_ids], outputs: [ref_logprobs], mesh: "1"}'
TRAIN_READS_REF = "graph.actor_train.inputs=[prompt_ids,output_ids,behav_logprobs,versions,prox_logprobs,rewards,ref_logprobs]"


def composed(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return compose("config", overrides=["output_dir=/tmp/unused", *overrides])


def graph_of(*overrides: str):
    cfg = typed(composed(*overrides))
    check_known_keys(cfg)
    return graph_from_config(cfg)


def test_a_node_added_on_the_command_line_is_a_node_config_with_its_defaults():
    cfg = typed(composed(REF, TRAIN_READS_REF))
    ref = cfg.graph["ref"]
    assert isinstance(ref, BatchNodeConfig) and (ref.micro_batch_tokens, ref.engine, ref.mesh) == (8192, "torch", "1")
    g = graph_from_config(cfg)
    assert [n.name for n in g.batch_nodes] == ["actor_prox", "ref", "actor_train"]
    assert ("ref", "actor_train", "ref_logprobs") in g.edges()


def test_an_added_node_whose_key_nobody_reads_is_named():
    with pytest.raises(GraphError) as e:
        graph_of(REF)
    assert e.value.problems == ["node 'ref' writes 'ref_logprobs' (graph.ref.outputs) but no node reads it: list it in "
                                "the inputs of the node that uses it, or remove the node (~graph.ref)"]


def test_a_node_removed_on_the_command_line_is_gone_and_its_readers_are_named():
    with pytest.raises(GraphError) as e:
        graph_of("~graph.actor_prox")
    assert e.value.problems == ["node 'actor_train' reads key 'prox_logprobs' (graph.actor_train.inputs) but no node "
                                "writes it and the dataset has no such field (dataset fields: prompt, answer)"]
    g = graph_of("~graph.actor_prox", "graph.actor_train.inputs=[prompt_ids,output_ids,behav_logprobs,versions,rewards]")
    assert "actor_prox" not in g.nodes and [n.name for n in g.batch_nodes] == ["actor_train"]


def test_a_typo_or_a_wrong_type_in_an_added_node_is_named_by_its_full_key():
    cfg = typed(composed(REF[:-1] + ", micro_batch_token: 4096}", TRAIN_READS_REF))
    with pytest.raises(ConfigError) as e:
        check_known_keys(cfg)
    assert e.value.problems == ["graph.ref.micro_batch_token: unknown key, 'graph.ref' (BatchNodeConfig) has no field "
                                "'micro_batch_token'; did you mean graph.ref.micro_batch_tokens?"]
    with pytest.raises(ConfigError) as e:
        typed(composed(REF[:-1] + ", row_tokens: many}"))
    assert e.value.problems == ["graph.ref.row_tokens: Value 'many' of type 'str' could not be converted to Integer"]


def test_a_recipe_adds_a_node_and_removes_one_by_setting_it_to_null(tmp_path):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "no_prox_ref.yaml").write_text(
        "# @package _global_\ndefaults:\n  - tiny_arith\n  - _self_\nrecipe: no_prox_ref\ngraph:\n  actor_prox: null\n"
        "  ref: {type: inference, role: ref, inputs: [prompt_ids, output_ids], outputs: [ref_logprobs], mesh: '1'}\n"
        "  actor_train:\n    inputs: [prompt_ids, output_ids, behav_logprobs, versions, rewards, ref_logprobs]\n")
    raw = composed("recipe=no_prox_ref", f"hydra.searchpath=[file://{tmp_path}]")
    apply_allocation(raw, parse_allocation("d1 + d1"))  # writes the other nodes' keys, passes the null one
    g = graph_from_config(typed(raw))
    assert [n.name for n in g.batch_nodes] == ["ref", "actor_train"] and g.nodes["ref"].layout is not None


def test_the_dry_run_prints_a_node_added_on_the_command_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "areal_flow.launch", "dry_run=true", REF, TRAIN_READS_REF],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ref: inference [ref] on mesh 1" in r.stdout and "<- ref_logprobs (from ref)" in r.stdout


JUDGE = NodeKind(streaming=True, reads=("output_ids",), writes=("rewards",), must_write=("rewards",), n_outputs=1,
                 outputs_mean="rewards")
NODES = {
    "generate": {"type": "generate", "role": "actor", "inputs": ["prompt"],
                 "outputs": ["prompt_ids", "output_ids", "behav_logprobs", "versions"], "mesh": "0"},
    "reward": {"type": "reward", "fn": "arith", "inputs": ["output_ids", "answer"], "outputs": ["rewards"]},
    "train": {"type": "train", "role": "actor", "inputs": ["prompt_ids", "output_ids", "behav_logprobs", "rewards"],
              "mesh": "1"},
}


@pytest.fixture
def registry(monkeypatch):
    """The node kinds as they are, restored after the test registers its own."""
    monkeypatch.setattr(keys, "NODE_KINDS", dict(keys.NODE_KINDS))


def problems(nodes) -> list[str]:
    with pytest.raises(GraphError) as e:
        build_graph(nodes, ["prompt", "answer"], 2)
    return e.value.problems


def test_the_built_in_node_kinds_are_registry_entries():
    assert list(keys.node_kinds()) == ["generate", "reward", "combine", "inference", "train"]
    assert keys.node_kinds()["combine"].weighted and keys.node_kinds()["reward"].outputs_mean == "rewards"


def test_a_registered_kind_is_validated_by_its_spec_then_refused_as_no_process_runs_it(registry):
    assert "expected one of generate, reward, combine, inference, train" in problems(NODES | {"j": {"type": "judge"}})[0]
    assert register("node", "judge")(JUDGE) is JUDGE
    found = problems(NODES | {"j": {"type": "judge", "outputs": ["score"]}})
    assert found == [
        "node 'j' writes 'score' (graph.j.outputs) but no node reads it: list it in the inputs of the node that uses "
        "it, or remove the node (~graph.j)",
        "node 'j': type 'judge' (graph.j.type) is a registered node kind that no process of this version runs (they "
        "run generate, reward, combine, inference, train)",
        "node 'j': a judge node must read output_ids (graph.j.inputs)",
    ]
    # Its spec takes part in the rules that span kinds: it streams, so it cannot read a batch node's output.
    reads_prox = NODES | {"j": {"type": "judge", "inputs": ["output_ids", "x"], "outputs": ["score"]},
                          "x_node": {"type": "inference", "role": "actor", "inputs": ["prompt_ids", "output_ids"],
                                     "outputs": ["x"], "keys": {"prox_logprobs": "x"}, "mesh": "1"}}
    assert any("streaming nodes (generate, reward, combine, judge) run before batch nodes (inference, train)" in p
               for p in problems(reads_prox))


def test_register_refuses_another_registry_a_second_spec_and_what_is_not_a_spec(registry):
    register("node", "judge")(JUDGE)
    register("node", "judge")(JUDGE)  # the same spec again: nothing changes
    with pytest.raises(ValueError, match="node kind 'judge' is already registered"):
        register("node", "judge")(NodeKind(streaming=False))
    with pytest.raises(ValueError, match="unknown registry 'policy_loss'.*areal_flow.algorithms.registry"):
        register("policy_loss", "judge")
    with pytest.raises(TypeError, match="a spec is a NodeKind"):
        register("node", "other")(lambda: None)
