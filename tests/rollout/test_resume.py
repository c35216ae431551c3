"""The rollout worker's resubmission of aborted samples, against a stand-in for real SGLang.

Real SGLang (which cannot run on these CPU machines) answers `finish_reason: abort` when a weight
update interrupts a request, and reports one `weight_version` per answer instead of areal_flow's
per-token versions. This stand-in HTTP server does exactly that, so the resume path is exercised.
"""

import asyncio

from sglang_standin import StandIn, serving

from areal_flow.generation.client.router import ServerPool
from areal_flow.rollout.requests import generate_sample
from areal_flow.transport.messages import Finish


class AbortingSGLang(StandIn):
    def answer(self, body: dict) -> dict:
        first = len(AbortingSGLang.calls) == 1
        out = [7, 8, 9] if first else [10, 1]
        return {"text": "", "output_ids": out, "meta_info": {
            "id": body["rid"], "weight_version": "default" if first else "3",
            "finish_reason": {"type": "abort"} if first else {"type": "stop", "matched": 1},
            "output_token_logprobs": [[-0.5, t, None] for t in out]}}


def test_an_aborted_sample_is_resumed_with_its_tokens_and_their_versions():
    async def run(url):
        async with ServerPool([url]) as pool:
            return await generate_sample(pool, [4, 5], {"max_new_tokens": 10, "temperature": 1.0}, "g0-0", "g0")

    with serving(AbortingSGLang) as url:
        out = asyncio.run(run(url))
    first, second = AbortingSGLang.calls
    assert first["input_ids"] == [4, 5] and first["sampling_params"]["max_new_tokens"] == 10
    # The resubmission carries the tokens so far and only the remaining budget.
    assert second["input_ids"] == [4, 5, 7, 8, 9] and second["sampling_params"]["max_new_tokens"] == 7
    assert first["rid"] != second["rid"]
    assert out["output_ids"] == [7, 8, 9, 10, 1] and out["finish"] == Finish.STOP
    assert out["versions"] == [0, 0, 0, 3, 3]  # "default" is version 0; each token keeps its own
    assert out["behav_logprobs"] == [-0.5] * 5
