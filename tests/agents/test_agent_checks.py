"""A recipe's agent checked at launch (run/checks.py: check_agent, the graph's own rules): each
refusal names the key, before any process starts; the shipped agent recipe passes and says so."""

import io

import pytest
from hydra import compose, initialize_config_dir
from rich.console import Console

from areal_flow.config.validate import ConfigError
from areal_flow.graph.dag import GraphError
from areal_flow.launch import CONF_DIR
from areal_flow.run.checks import check_agent, validate
from areal_flow.runtime.spec import typed

pytest.importorskip("openai")  # the agents extra's
pytestmark = pytest.mark.slow  # a server and Hydra composes: 8-11 s; the fast tier keeps its 3 minutes


def config(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = typed(compose("config", overrides=["output_dir=/tmp/unused", *overrides]))
    return cfg, validate(cfg)


def check(*overrides: str) -> str:
    cfg, graph = config(*overrides)
    out = io.StringIO()
    check_agent(graph, cfg.algorithm.group_size, Console(file=out, width=200))
    return out.getvalue()


def sync_agent(client, row):  # not async: refused
    return 1.0


def test_the_shipped_agent_recipe_passes_and_says_so():
    assert "generate node generate: agent areal_flow.agents.examples.arith_tool:run, 60 s a rollout" in \
        check("recipe=tiny_arith_agent")


@pytest.mark.parametrize("agent, why", [
    ("no_such_module:run", r"graph.generate.agent: cannot import 'no_such_module'"),
    ("areal_flow.agents.examples.arith_tool:walk", r"graph.generate.agent: .* has no callable 'walk'"),
    (f"{__name__}:sync_agent", r"graph.generate.agent: .*sync_agent' is not an async function"),
])
def test_an_agent_that_cannot_run_is_refused_naming_the_key(agent, why):
    with pytest.raises(ConfigError, match=why):
        check("recipe=tiny_arith_agent", f"graph.generate.agent={agent}")


def test_the_agent_s_reward_without_an_agent_is_refused():
    with pytest.raises(ConfigError, match=r"graph.reward.fn=agent: the reward the agent returns, but "
                                          r"graph.generate.agent names no agent"):
        check("recipe=tiny_arith_tool", "graph.reward.fn=agent")


def test_an_environment_and_an_agent_together_are_refused():
    with pytest.raises(GraphError, match=r"graph.generate.env and graph.generate.agent both run its rollouts"):
        config("recipe=tiny_arith_agent", "graph.generate.env=python_tool")


def test_an_agent_without_the_loss_mask_is_refused():
    with pytest.raises(GraphError, match=r"with an agent \(graph.generate.agent\) it must write loss_mask"):
        config("recipe=tiny_arith_agent", "graph.generate.outputs=[prompt_ids,output_ids,behav_logprobs,versions]")


@pytest.mark.parametrize("roles, why", [
    ("[a,a]", "the roles must differ"),
    ("[a,'b/c']", "a role is 1-32 letters, digits, _ or -, got 'b/c'"),
    ("[a,b,c]", r"algorithm.group_size=8 must be a multiple of the 3 roles"),
])
def test_roles_that_cannot_split_a_group_are_refused_naming_the_key(roles, why):
    with pytest.raises(ConfigError, match=r"graph.generate.agent_roles=.*: " + why):
        check("recipe=tiny_arith_agent", f"graph.generate.agent_roles={roles}", "algorithm.group_size=8")


def test_roles_without_an_agent_are_refused():
    with pytest.raises(ConfigError, match=r"graph.generate.agent_roles: the roles of an agent, but "
                                          r"graph.generate.agent names no agent"):
        check("recipe=tiny_arith", "+graph.generate.agent_roles=[a,b]")
