"""The evaluation beside training: the pin that holds the next version's load, and the version
each answer came from."""

import asyncio

import pytest

from areal_flow.controller.evaluation import VersionPin, answer_version


@pytest.mark.parametrize("meta, version", [
    ({"output_token_versions": [3, 3, 3], "weight_version": "3"}, 3),
    ({"output_token_versions": [2, 2, 3], "weight_version": "3"}, -1),  # an update reached it mid-answer
    ({"weight_version": "5"}, 5),  # SGLang: no per-token versions, the label
    ({"weight_version": "default"}, 0),
    ({"output_token_versions": [], "weight_version": "4"}, 4),  # an empty answer
])
def test_an_answer_counts_for_the_one_version_all_its_tokens_came_from(meta, version):
    assert answer_version({"meta_info": meta}) == version


def test_a_load_waits_for_the_pinned_evaluation_and_goes_on_when_it_ends():
    async def scenario():
        pin, order = VersionPin(), []
        pin.hold(2)

        async def load():
            await pin.wait()
            order.append("load v3")

        async def evaluation():
            await asyncio.sleep(0.05)
            order.append("eval v2 done")
            pin.release()

        await asyncio.gather(load(), evaluation())
        assert not pin.held and pin.version is None
        await asyncio.wait_for(pin.wait(), 1)  # free: no wait
        return order

    assert asyncio.run(scenario()) == ["eval v2 done", "load v3"]


def test_one_pin_at_a_time():
    async def scenario():
        pin = VersionPin()
        pin.hold(2)
        with pytest.raises(RuntimeError, match="version 2 is already pinned"):
            pin.hold(4)

    asyncio.run(scenario())
