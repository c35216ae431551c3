"""The reward service: worker processes, per-sample timeouts that never hang, shaping, functions of
the user's own module (sync in the pool, async in the caller's loop), errors that score 0."""

import asyncio
import time

import pytest

from areal_flow.config.schema import SandboxConfig
from areal_flow.rewards.service import NodeScorer, Shaping, resolve


def scorer(fn: str, timeout: float = 10.0, workers: int = 1, shaping: Shaping = Shaping()) -> NodeScorer:
    return NodeScorer("node", fn, workers, timeout, shaping, SandboxConfig())


def run(node: NodeScorer, *pairs: tuple[str, str]):
    async def main():
        return await asyncio.gather(*(node.score(c, r) for c, r in pairs))

    try:
        return asyncio.run(main())
    finally:
        node.close()


def test_shaping_maps_right_and_wrong_to_plus_and_minus_five_and_clips():
    areal = Shaping(scale=10.0, bias=-0.5)
    assert (areal(1.0), areal(0.0)) == (5.0, -5.0)
    assert Shaping(scale=10.0, clip=3.0)(1.0) == 3.0 and Shaping(scale=10.0, clip=3.0)(-1.0) == -3.0
    assert Shaping()(0.25) == 0.25


def test_a_user_function_by_import_path_with_its_statistics():
    (s1, s2) = run(scorer("user_rewards:with_stats", shaping=Shaping(bias=-0.5, scale=10.0)),
                   ("the answer is 42", "42"), ("no", "42"))
    assert (s1.reward, s1.raw, s1.stats["length"]) == (5.0, 1.0, 16.0)
    assert (s2.reward, s2.raw, s2.stats["length"]) == (-5.0, 0.0, 2.0)
    assert s1.stats["timeout"] == s1.stats["error"] == 0.0


def test_a_sample_past_its_timeout_scores_zero_and_the_worker_is_replaced():
    node = scorer("user_rewards:spins", timeout=1.0)
    t0 = time.monotonic()
    scores = run(node, ("a", "b"), ("c", "d"))
    assert all(s.raw == 0.0 and s.stats["timeout"] == 1.0 for s in scores)
    assert time.monotonic() - t0 < 8  # two timeouts in one worker, then a fresh worker
    node = scorer("user_rewards:sleeps", timeout=1.0)
    slow, fast = run(node, ("x", "30"), ("x", "0"))
    assert slow.stats["timeout"] == 1.0 and fast.raw == 1.0 and fast.stats["timeout"] == 0.0


def test_workers_score_in_parallel():
    node = scorer("user_rewards:sleeps", workers=2)

    async def main():
        await asyncio.gather(node.score("x", "0.2"), node.score("x", "0.2"))  # both workers started
        t0 = time.monotonic()
        await asyncio.gather(node.score("x", "1"), node.score("x", "1"))
        return time.monotonic() - t0

    try:
        assert asyncio.run(main()) < 1.8
    finally:
        node.close()


@pytest.mark.parametrize("fn, what", [
    ("user_rewards:dies", "ProcessExpired"),
    ("user_rewards:raises", "ZeroDivisionError"),
    ("user_rewards:returns_text", "TypeError"),
])
def test_a_broken_function_scores_zero_counted_as_an_error(fn, what, caplog):
    node = scorer(fn)
    (s,) = run(node, ("x", "y"))
    assert (s.raw, s.stats["error"], s.stats["timeout"]) == (0.0, 1.0, 0.0)
    assert what in caplog.text
    # The pool survives a worker that died: the next sample is scored.
    node = scorer("user_rewards:exact")
    assert [s.raw for s in run(node, ("a", "a"), ("a", "b"))] == [1.0, 0.0]


def test_async_functions_run_in_the_callers_loop_with_the_same_timeout():
    node = scorer("user_rewards:async_exact")
    assert node._pool is None
    assert [s.raw for s in run(node, ("a", "a"), ("a", "b"))] == [1.0, 0.0]
    t0 = time.monotonic()
    (s,) = run(scorer("user_rewards:async_hangs", timeout=0.5), ("a", "a"))
    assert s.stats["timeout"] == 1.0 and time.monotonic() - t0 < 2


@pytest.mark.parametrize("fn, message", [
    ("nope", "unknown reward function 'nope': expected one of arith"),
    ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
    ("user_rewards:missing", "has no callable 'missing'"),
    ("user_rewards:NOT_CALLABLE", "has no callable 'NOT_CALLABLE'"),
])
def test_a_bad_function_name_says_what_is_wrong(fn, message):
    with pytest.raises(ValueError, match=message):
        resolve(fn, SandboxConfig())
