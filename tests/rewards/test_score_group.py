import asyncio

import numpy as np

from areal_flow.config.schema import SandboxConfig
from areal_flow.graph import build_graph
from areal_flow.models.tokenizer import build_char_tokenizer
from areal_flow.rewards.service import RewardService
from areal_flow.rewards.worker import score_group
from areal_flow.transport.messages import Array, GeneratedGroup, Sample, Stage

NODES = {
    "generate": {"type": "generate", "role": "actor", "inputs": ["question"], "outputs": ["prompt_ids", "output_ids",
                 "behav_logprobs"], "mesh": "0"},
    "reward": {"type": "reward", "fn": "arith", "inputs": ["output_ids", "gold"], "outputs": ["correct"]},
    "train": {"type": "train", "role": "actor", "mesh": "1",
              "inputs": ["prompt_ids", "output_ids", "behav_logprobs", "correct"]},
}
TWO_REWARDS = {
    **NODES,
    # AReaL's shaping: right/wrong -> +5/-5.
    "short": {"type": "reward", "fn": "arith", "inputs": ["output_ids", "gold"], "outputs": ["also_correct"],
              "bias": -0.5, "scale": 10.0},
    "total": {"type": "combine", "inputs": ["correct", "also_correct"], "outputs": ["rewards"],
              "weights": {"correct": 1.0, "also_correct": 0.5}},
    "train": {"type": "train", "role": "actor", "mesh": "1",
              "inputs": ["prompt_ids", "output_ids", "behav_logprobs", "rewards"]},
}


def sample(tok, i: int, text: str) -> Sample:
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    return Sample(uid=f"g0-{i}", prompt_id="p", group_id=0, index=i, birth_time=0.0,
                  fields={"question": "7+8=", "gold": "15"}, arrays={"output_ids": Array.of(np.array(ids, np.int32))})


def score(nodes, texts):
    tok = build_char_tokenizer()
    graph = build_graph(nodes, ["question", "gold"], 2, ["arith"])
    service = RewardService(graph.rewards, SandboxConfig())
    try:
        group = GeneratedGroup(0, [sample(tok, i, t) for i, t in enumerate(texts)])
        return asyncio.run(score_group(group, graph, tok, service))
    finally:
        service.close()


def test_each_sample_is_scored_against_its_own_reference_field():
    group = score(NODES, ["7+8+0=15;#### 15", "7+8+0=15;#### 16", "7+8+0=15;"])
    assert [s.scalars["correct"] for s in group.samples] == [1.0, 0.0, 0.0]
    assert [s.scalars["reward_raw"] for s in group.samples] == [1.0, 0.0, 0.0]
    assert all(s.scalars["reward_timeout"] == 0.0 and s.scalars["reward_error"] == 0.0 for s in group.samples)
    assert all(s.stage == Stage.SCORED for s in group.samples)


def test_a_combine_node_writes_the_weighted_sum_of_the_shaped_rewards_it_reads():
    group = score(TWO_REWARDS, ["7+8+0=15;#### 15", "#### 16"])
    assert [s.scalars["also_correct"] for s in group.samples] == [5.0, -5.0]
    assert [s.scalars["short_raw"] for s in group.samples] == [1.0, 0.0]
    assert [s.scalars["rewards"] for s in group.samples] == [1.0 + 2.5, 0.0 - 2.5]
