"""The reward service: worker processes, per-sample timeouts that never hang, shaping, functions of
the user's own module (sync in the pool, async in the caller's loop), errors that score 0."""

import asyncio
import multiprocessing
import os
import signal
import time

import pytest

from areal_flow.config.schema import SandboxConfig
from areal_flow.graph import build_graph
from areal_flow.rewards.service import NodeScorer, RewardPoolError, RewardService, Shaping, resolve


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


@pytest.mark.slow  # seconds of waiting on a timeout or a process: the full suite runs it
def test_a_sample_past_its_timeout_scores_zero_and_the_worker_is_replaced():
    node = scorer("user_rewards:spins", timeout=1.0)
    t0 = time.monotonic()
    scores = run(node, ("a", "b"), ("c", "d"))
    assert all(s.raw == 0.0 and s.stats["timeout"] == 1.0 for s in scores)
    assert time.monotonic() - t0 < 8  # two timeouts in one worker, then a fresh worker
    node = scorer("user_rewards:sleeps", timeout=1.0)
    slow, fast = run(node, ("x", "30"), ("x", "0"))
    assert slow.stats["timeout"] == 1.0 and fast.raw == 1.0 and fast.stats["timeout"] == 0.0


@pytest.mark.slow  # 1.4-2.3 s: the full suite runs it; the fast tier keeps its 3 minutes
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


def pool_workers(before: set[int]) -> list:
    """The pebble workers started since `before` (pids of this process's children then)."""
    return [p for p in multiprocessing.active_children() if p.pid not in before and p.name == "pebble_pool_worker"]


def test_every_pool_of_the_service_is_rebuilt_after_its_idle_worker_is_killed():
    # An idle worker killed from outside leaves pebble's pool in its error state, which refused every
    # later sample: each scored 0 with a warning. Each reward node's pool is rebuilt instead.
    nodes = {
        "generate": {"type": "generate", "role": "actor", "inputs": ["question"],
                     "outputs": ["prompt_ids", "output_ids", "behav_logprobs"], "mesh": "0"},
        "reward": {"type": "reward", "fn": "arith", "inputs": ["output_ids", "gold"], "outputs": ["correct"]},
        "short": {"type": "reward", "fn": "arith", "inputs": ["output_ids", "gold"], "outputs": ["also_correct"],
                  "bias": -0.5, "scale": 10.0},
        "total": {"type": "combine", "inputs": ["correct", "also_correct"], "outputs": ["rewards"],
                  "weights": {"correct": 1.0, "also_correct": 0.5}},
        "train": {"type": "train", "role": "actor", "mesh": "1",
                  "inputs": ["prompt_ids", "output_ids", "behav_logprobs", "rewards"]},
    }
    before = {p.pid for p in multiprocessing.active_children()}
    service = RewardService(build_graph(nodes, ["question", "gold"], 2, ["arith"]).rewards, SandboxConfig())

    async def main():
        right = "7+8+0=15;#### 15"
        first = await asyncio.gather(service.score("reward", right, "15"), service.score("short", right, "15"))
        workers = pool_workers(before)
        assert len(workers) == 2  # one per reward node
        for w in workers:
            os.kill(w.pid, signal.SIGKILL)
        await asyncio.sleep(0.5)  # pebble's manager sees the dead workers: both pools in their error state
        again = await asyncio.gather(service.score("reward", right, "15"), service.score("short", right, "15"),
                                     service.score("reward", "#### 16", "15"))
        return first, again

    try:
        first, again = asyncio.run(main())
    finally:
        service.close()
    assert [s.reward for s in first] == [1.0, 5.0]
    assert [s.reward for s in again] == [1.0, 5.0, 0.0]
    assert all(s.stats["error"] == 0.0 and s.stats["timeout"] == 0.0 for s in again)
    assert all(s.pools_started == 2 for s in service.scorers.values())


@pytest.mark.slow  # seconds of waiting on a timeout or a process: the full suite runs it
def test_a_worker_killed_under_a_sample_has_the_sample_scored_again():
    before = {p.pid for p in multiprocessing.active_children()}
    node = scorer("user_rewards:sleeps")

    async def main():
        await node.score("x", "0")  # the worker is up
        (worker,) = pool_workers(before)
        pending = asyncio.ensure_future(node.score("x", "1.5"))
        await asyncio.sleep(0.7)
        os.kill(worker.pid, signal.SIGKILL)
        return await pending

    try:
        s = asyncio.run(main())
    finally:
        node.close()
    assert (s.raw, s.stats["error"], s.stats["timeout"]) == (1.0, 0.0, 0.0)


def test_a_pool_that_cannot_be_rebuilt_raises_naming_the_node_and_the_pool():
    # "nope" resolves nowhere, so every worker's initializer fails and every pool breaks: an error
    # that must stop the reward worker, not a reward of 0.
    node = NodeScorer("my_reward", "nope", 1, 10.0, Shaping(), SandboxConfig())
    with pytest.raises(RewardPoolError, match=r"the worker pool of reward node 'my_reward' .*'nope'.* could not be rebuilt"):
        run(node, ("a", "a"))
    assert node.pools_started == 3
