"""The reward service: scores completions for the graph's reward nodes without ever blocking the
caller's event loop, and without ever hanging on a sample.

Each reward node gets a pool of `workers` processes (pebble's ProcessPool: a task past its
timeout has its worker killed and replaced, which neither concurrent.futures nor multiprocessing
can do). A worker builds the node's function once (math-verify's import, the sandbox's isolation
probe) and runs it in its main thread, where math-verify's `signal.alarm` works. An `async def`
function of the user's runs in the caller's event loop instead, for functions that wait on a
service rather than compute.

A reward function takes (completion text, reference text) and returns a float, or a mapping with
a "reward" float and any other numbers, which become per-node metrics (docs/rewards.md). Every
score comes back as a `Score`: the shaped reward, the raw one, and its statistics, with a timeout
or an exception scoring 0 and counted.

A pool that breaks (a worker killed from outside while idle leaves pebble's pool in its error state,
where it refuses every later task) is rebuilt and the sample retried; a worker that dies under a
sample gets the sample retried on its replacement. Only a sample that kills its worker on every try
scores 0 (counted as an error, like the function's own exception); a pool that cannot be rebuilt
raises `RewardPoolError`, never a score.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import multiprocessing
import time
from collections.abc import Callable, Mapping
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

import pebble

from areal_flow.config.import_path import resolve_named
from areal_flow.config.schema import SandboxConfig

log = logging.getLogger("areal_flow.reward")

RewardFn = Callable[[str, str], "float | Mapping[str, float]"]

POOL_RETRIES = 2  # tries of a sample beyond the first, after its pool broke or its worker died
POOL_CHECK_SECONDS = 1.0  # how often a waiting sample checks that its pool still runs


class RewardPoolError(RuntimeError):
    """A reward node's worker pool broke and could not be rebuilt: no score of that node can be
    trusted, so the caller fails (the reward worker exits and the launcher reports it)."""


AGENT_FN = "agent"
"""`fn: agent`: the reward is what the rollout's agent returned (agents/runner.py), shaped."""


def builtin_names() -> list[str]:
    from areal_flow.rewards.functions import REWARD_FNS

    return [*REWARD_FNS, "code", AGENT_FN]


def resolve(fn: str, sandbox: SandboxConfig) -> RewardFn:
    """The function a reward node names: a built-in, or `package.module:function`. Raises
    ValueError saying what is wrong with the name."""
    from areal_flow.rewards.functions import REWARD_FNS

    if fn == "code":
        from areal_flow.rewards.code import CodeReward

        return CodeReward(sandbox)
    return resolve_named(fn, REWARD_FNS, where=f"reward function {fn!r}", unknown=lambda: (
        f"unknown reward function {fn!r}: expected one of {', '.join(builtin_names())}, or 'module:function'"))


@dataclass(frozen=True)
class Shaping:
    """reward = clip((raw + bias) * scale, -clip, clip)."""

    scale: float = 1.0
    bias: float = 0.0
    clip: float | None = None

    def __call__(self, raw: float) -> float:
        r = (raw + self.bias) * self.scale
        return r if self.clip is None else max(-self.clip, min(self.clip, r))


@dataclass
class Score:
    reward: float  # shaped
    raw: float
    # The function's own numbers; timeout and error (0/1); seconds (the function's run time) and
    # latency (from the request to the score, the wait for a worker included).
    stats: dict[str, float] = field(default_factory=dict)


def _normalise(out: object) -> tuple[float, dict[str, float]]:
    """A function's return value as (raw reward, other numbers); TypeError when it is neither a
    number nor a mapping with a numeric "reward"."""
    if isinstance(out, Mapping):
        if "reward" not in out:
            raise TypeError(f"a reward function returned a mapping without 'reward': {sorted(out)}")
        stats = {str(k): float(v) for k, v in out.items() if k != "reward"}
        out = out["reward"]
    else:
        stats = {}
    if isinstance(out, bool) or not isinstance(out, (int, float)) or not math.isfinite(out):
        raise TypeError(f"a reward function returned {out!r}; expected a finite number")
    return float(out), stats


# ---- inside a pool worker -----------------------------------------------------------------------

_WORKER_FN: RewardFn | None = None


def _init_worker(fn: str, sandbox: SandboxConfig) -> None:
    global _WORKER_FN
    logging.basicConfig(level=logging.INFO)
    _WORKER_FN = resolve(fn, sandbox)
    if fn == "math":  # math-verify's import and sympy's first parse take about a second: not a sample's
        _WORKER_FN("\\boxed{\\frac{1}{2}}", "0.5")


def _call(completion: str, reference: str) -> tuple[float, dict[str, float], float]:
    """(raw reward, statistics, seconds the function ran): the last is the worker's busy time,
    where the caller's clock would also count the wait for a free worker."""
    assert _WORKER_FN is not None, "the pool initializer did not run"
    t0 = time.perf_counter()
    raw, stats = _normalise(_WORKER_FN(completion, reference))
    return raw, stats, time.perf_counter() - t0


# ---- in the caller --------------------------------------------------------------------------------


class NodeScorer:
    """Scores samples for one reward node."""

    def __init__(self, name: str, fn: str, workers: int, timeout: float, shaping: Shaping, sandbox: SandboxConfig):
        self.name, self.fn, self.timeout, self.shaping = name, fn, timeout, shaping
        self.workers, self.sandbox = workers, sandbox
        local = resolve(fn, sandbox) if ":" in fn else None  # a user's function: is it a coroutine?
        self._async_fn = local if local is not None and inspect.iscoroutinefunction(local) else None
        self._pool = None
        self.pools_started = 0  # the first pool and each rebuilt one
        if self._async_fn is None:
            self._pool = self._new_pool()

    def _new_pool(self) -> pebble.ProcessPool:
        self.pools_started += 1
        # spawn: a reward process holds ZeroMQ sockets and an event loop, which must not be forked.
        return pebble.ProcessPool(max_workers=self.workers, initializer=_init_worker, initargs=(self.fn, self.sandbox),
                                  context=multiprocessing.get_context("spawn"))

    def _pool_name(self) -> str:
        return (f"the worker pool of reward node {self.name!r} ({self.workers} process(es) running {self.fn!r}, "
                f"pool #{self.pools_started})")

    async def _rebuild(self, broken: pebble.ProcessPool) -> None:
        """Replace a broken pool, once however many samples saw it break."""
        if broken is not self._pool:
            return  # another sample rebuilt it already
        self._pool = self._new_pool()
        await asyncio.to_thread(_stop_pool, broken)

    async def _result(self, pool: pebble.ProcessPool, future):
        """The future's result. A pool that stops running leaves the futures it holds pending
        forever (its manager threads are gone): BrokenProcessPool then."""
        waiting = asyncio.wrap_future(future)
        try:
            while not waiting.done():
                await asyncio.wait({waiting}, timeout=POOL_CHECK_SECONDS)
                if not waiting.done() and not pool.active:
                    raise BrokenProcessPool("the pool stopped running with the sample in it")
            return waiting.result()
        finally:
            if not waiting.done():
                waiting.cancel()

    async def _in_pool(self, completion: str, reference: str) -> tuple[float, dict[str, float], float]:
        """(raw, stats, seconds) from a pool worker. A broken pool is rebuilt and a worker that died
        under the sample replaced (by pebble), and the sample tried again, POOL_RETRIES times at most.
        Then ProcessExpired where the sample's worker died every time (the function's doing, scored 0
        as an error), RewardPoolError where the pool itself would not run."""
        for attempt in range(POOL_RETRIES + 1):
            pool = self._pool
            try:
                if not pool.active:  # starts a new pool's workers; False once it broke
                    raise BrokenProcessPool("the pool is no longer running")
                future = pool.schedule(_call, (completion, reference), timeout=self.timeout)
            except Exception as e:  # noqa: BLE001 - scheduling only queues the task: what it raises is the pool's
                failure: BaseException = e
            else:
                try:
                    return await self._result(pool, future)
                except pebble.ProcessExpired as e:
                    if attempt == POOL_RETRIES:
                        raise
                    log.warning("reward node %s: its worker died scoring a sample (%s, exit code %s): "
                                "trying the sample again (%d of %d)", self.name, e, e.exitcode, attempt + 1, POOL_RETRIES)
                    continue
                except BrokenProcessPool as e:
                    failure = e
            if attempt == POOL_RETRIES:
                raise RewardPoolError(f"{self._pool_name()} broke and could not be rebuilt ({POOL_RETRIES} rebuilds "
                                      f"for one sample): {type(failure).__name__}: {failure}") from failure
            log.warning("%s broke (%s: %s): rebuilding it and trying the sample again (%d of %d)",
                        self._pool_name(), type(failure).__name__, failure, attempt + 1, POOL_RETRIES)
            await self._rebuild(pool)
        raise AssertionError("unreachable")

    async def score(self, completion: str, reference: str) -> Score:
        t0 = time.monotonic()
        timeout = error = 0.0
        try:
            if self._async_fn is not None:
                raw, stats = _normalise(await asyncio.wait_for(self._async_fn(completion, reference), self.timeout))
                seconds = time.monotonic() - t0
            else:
                raw, stats, seconds = await self._in_pool(completion, reference)
        except RewardPoolError:
            raise  # no score can be trusted: the caller fails loudly
        except (FutureTimeout, asyncio.TimeoutError):
            raw, stats, timeout, seconds = 0.0, {}, 1.0, self.timeout
            log.warning("reward node %s: a sample took over %.0f s (timeout): scored 0", self.name, self.timeout)
        except Exception as e:  # noqa: BLE001 - a broken function, or a sample that killed its worker each try, scores 0, counted
            raw, stats, error, seconds = 0.0, {}, 1.0, 0.0
            log.warning("reward node %s: %s scoring a sample: %s", self.name, type(e).__name__, e)
        return Score(self.shaping(raw), raw, {**stats, "timeout": timeout, "error": error, "seconds": seconds,
                                              "latency": time.monotonic() - t0})

    def close(self) -> None:
        if self._pool is not None:
            _stop_pool(self._pool)


def _stop_pool(pool: pebble.ProcessPool) -> None:
    pool.stop()
    pool.join()


class RewardService:
    """The scorers of a graph's reward nodes, by node name (`fn: agent` nodes only shape: `given`)."""

    def __init__(self, nodes, sandbox: SandboxConfig):
        self.shaping = {n.name: Shaping(n.scale, n.bias, n.clip) for n in nodes}
        self.scorers = {n.name: NodeScorer(n.name, n.fn, n.workers, n.timeout, self.shaping[n.name], sandbox)
                        for n in nodes if n.fn != AGENT_FN}

    async def score(self, node: str, completion: str, reference: str) -> Score:
        return await self.scorers[node].score(completion, reference)

    def given(self, node: str, raw: float) -> Score:
        """A reward computed elsewhere (the agent's), shaped by the node."""
        return Score(self.shaping[node](raw), raw, {"timeout": 0.0, "error": 0.0, "seconds": 0.0, "latency": 0.0})

    def close(self) -> None:
        for s in self.scorers.values():
            s.close()
