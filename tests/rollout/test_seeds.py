"""The rollout worker's sampling seeds: one per sample of the run, fixed by (run seed, group, index),
sent with the group's request and kept by a sample's resubmissions."""

import asyncio

from sglang_standin import StandIn, serving

from areal_flow.generation.client.router import ServerPool
from areal_flow.generation.client.seeds import SEED_LIMIT, group_seed
from areal_flow.rollout.requests import generate_group


def test_every_sample_of_a_run_has_its_own_seed_fixed_by_run_seed_group_and_index():
    seeds = [group_seed(1, g, 8) + i for g in range(5000) for i in range(8)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < SEED_LIMIT for s in seeds)  # SGLang holds a seed as int32
    assert group_seed(1, 17, 8) == group_seed(1, 17, 8)
    assert group_seed(2, 17, 8) != group_seed(1, 17, 8)
    assert all(0 <= group_seed(s, 2**40, 64) <= SEED_LIMIT - 64 for s in range(50))


class GroupThenResume(StandIn):
    """Answers a group request of n = 2 with one finished and one aborted sample, then the resubmission."""

    def answer(self, body: dict) -> object:
        def one(out, reason, version):
            return {"text": "", "output_ids": out, "meta_info": {
                "id": "x", "weight_version": version, "finish_reason": {"type": reason},
                "output_token_logprobs": [[-0.5, t, None] for t in out]}}

        if len(GroupThenResume.calls) == 1:
            return [one([7, 1], "stop", "0"), one([8], "abort", "0")]
        return one([9, 1], "stop", "1")


def test_the_group_request_carries_the_seed_and_a_resubmitted_sample_keeps_its_own():
    async def run(url):
        async with ServerPool([url]) as pool:
            return await generate_group(pool, [4, 5], {"max_new_tokens": 10, "temperature": 1.0}, 2, "g3", seed=1000)

    with serving(GroupThenResume) as url:
        outs = asyncio.run(run(url))
    group, resumed = GroupThenResume.calls
    assert group["sampling_params"]["n"] == 2 and group["sampling_params"]["sampling_seed"] == 1000
    # Sample 1 draws from seed + 1 (the server's rule for n samples); its resubmission keeps it.
    assert resumed["input_ids"] == [4, 5, 8] and resumed["sampling_params"]["sampling_seed"] == 1001
    assert "n" not in resumed["sampling_params"]
    assert [o["output_ids"] for o in outs] == [[7, 1], [8, 9, 1]]
