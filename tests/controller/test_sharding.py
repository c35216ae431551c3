import numpy as np

from areal_flow.controller.main import shard_groups
from areal_flow.transport.messages import Array, Sample


def group(gid: int, n_out: int, size: int = 2) -> list[Sample]:
    return [Sample(uid=f"g{gid}-{i}", prompt_id="p", group_id=gid, index=i, birth_time=0.0,
                   arrays={"prompt_ids": Array.of(np.zeros(4, np.int32)), "output_ids": Array.of(np.zeros(n_out, np.int32))})
            for i in range(size)]


def test_whole_groups_go_to_ranks_balanced_by_tokens():
    groups = [group(0, 90), group(1, 10), group(2, 40), group(3, 40), group(4, 5)]
    shards = shard_groups(groups, 2)
    ids = [sorted(g[0].group_id for g in shard) for shard in shards]
    assert sorted(ids[0] + ids[1]) == [0, 1, 2, 3, 4]  # every group once, never split
    tokens = [sum(s.n_tokens() + s.n_tokens("prompt_ids") for g in shard for s in g) for shard in shards]
    assert abs(tokens[0] - tokens[1]) <= 2 * (10 + 4)  # within one small group of each other
    assert all(len({s.group_id for s in g}) == 1 for shard in shards for g in shard)


def test_one_rank_gets_everything():
    groups = [group(0, 3), group(1, 7)]
    assert shard_groups(groups, 1) == [sorted(groups, key=lambda g: -g[0].n_tokens())]


def test_a_group_that_cannot_be_trained_is_recognised():
    from areal_flow.controller.main import group_problem
    from areal_flow.transport.messages import GroupDone

    keys = ["prompt_ids", "output_ids"]
    good = group(1, 5)
    for s in good:
        s.scalars["rewards"] = 1.0
    assert group_problem(GroupDone(1, good), 2, keys, "rewards") is None
    assert "1 samples, want 2" in group_problem(GroupDone(1, good[:1]), 2, keys, "rewards")
    assert "lacks ['rewards']" in group_problem(GroupDone(2, group(2, 5)), 2, keys, "rewards")
    bad = group(3, 5)
    for s in bad:
        s.scalars["rewards"] = 0.0
    bad[1].arrays["behav_logprobs"] = Array.of(np.zeros(4, np.float32))
    problem = group_problem(GroupDone(3, bad), 2, keys + ["behav_logprobs"], "rewards")
    assert "g3-0 lacks ['behav_logprobs']" in problem
    bad[0].arrays["behav_logprobs"] = Array.of(np.zeros(5, np.float32))
    assert "different lengths [4, 5]" in group_problem(GroupDone(3, bad), 2, keys + ["behav_logprobs"], "rewards")
