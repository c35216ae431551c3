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
