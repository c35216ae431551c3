"""Graphs with a judge for the tests of several folders: tiny_arith's graph (recipes/tiny_arith.yaml)
plus the judge, its reward and a combine of both rewards, as recipes/tiny_arith_judge.yaml has them."""

import copy
from pathlib import Path

import pytest
import yaml

from areal_flow.graph import GraphError, build_graph

TINY_ARITH = yaml.safe_load((Path(__file__).resolve().parents[1] / "recipes" / "tiny_arith.yaml").read_text())["graph"]
JUDGE = {"type": "generate", "role": "judge", "inputs": ["prompt", "output_ids"], "outputs": ["judge_ids"],
         "mesh": "2", "template": "{prompt}", "max_new_tokens": 96}
JUDGE_REWARD = {"type": "reward", "fn": "judge_agree", "inputs": ["output_ids", "judge_ids"],
                "outputs": ["judge_rewards"]}


def build(nodes, n_devices=3):
    return build_graph(nodes, ["prompt", "answer"], n_devices, ["arith", "judge_agree"])


def problems_of(nodes, n_devices=3) -> str:
    with pytest.raises(GraphError) as e:
        build(nodes, n_devices)
    return str(e.value)


def with_judge(nodes=None, **judge):
    """`nodes` (tiny_arith's graph by default) with its reward renamed arith_rewards, a judge on device 2, the
    judge's reward, and a combine of both."""
    nodes = copy.deepcopy(nodes or TINY_ARITH)
    nodes["reward"]["outputs"] = ["arith_rewards"]
    nodes["judge"] = {**copy.deepcopy(JUDGE), **judge}
    nodes["judge_reward"] = copy.deepcopy(JUDGE_REWARD)
    nodes["combine"] = {"type": "combine", "inputs": ["arith_rewards", "judge_rewards"], "outputs": ["rewards"],
                        "weights": {"arith_rewards": 1.0, "judge_rewards": 0.5}}
    return nodes
