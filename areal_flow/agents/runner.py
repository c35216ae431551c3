"""Rollouts run by an agent: any async function `run(client, row) -> reward` that talks to the
policy through the official OpenAI client, trained on the exact tokens its calls sent and got.

The rollout worker (rollout/worker.py) runs it for a generate node that names an agent. Each
rollout opens a key on the worker's gateway (gateway.py), hands the agent an
`openai.AsyncOpenAI` client pointed at it and the dataset row, and waits for its reward within
`agent_wall_seconds`. The gateway links the calls into trajectories (trajectories.py); the
rollout's sample is the trajectory of its last call, the one that ends with the final answer: its
first prompt is the sample's prompt, what the agent added between calls (tool results) are
observation tokens (loss mask 0). Other trajectories a rollout made (a drift's earlier segments, a
second conversation) are not trained: they are counted (`agent/segments_per_rollout`), their policy
tokens too (`agent/dropped_tokens`), and the worker warns at its first drift, naming the agent and
showing where the history left the recorded tokens.

With roles (`agent_roles: [solver, checker]`), the agent is `run(clients: {role: client}, row) ->
{role: reward}`: each role's calls go through a key (and a client) of its own, and each role's last
trajectory is a sample of its own, rewarded with its role's reward; a group of n samples is
n / roles rollouts, its samples role by role, so that the trainer normalises each role's block of
the group apart (algorithms/inputs.py: train_inputs).

A rollout fails when the agent raises, outlasts its wall time, makes no call or returns no number:
it runs again, `agent_retries` times, then its group is dropped with the failure named
(`AgentFailed`; the ledger records the drop). Nothing an agent does ends the worker. An agent must
not block the event loop (a synchronous sleep or busy loop would stall every rollout of the worker,
and no wall time can cut it): blocking work goes to `asyncio.to_thread`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import math
import time
from collections.abc import Sequence
from typing import Any, Callable

from areal_flow.agents.gateway import Gateway, Sampling
from areal_flow.config.import_path import resolve_named
from areal_flow.generation.client.router import ServerPool
from areal_flow.generation.client.seeds import turn_seed
from areal_flow.graph.keys import AGENT_REWARD
from areal_flow.transport.trajectory import Trajectory

log = logging.getLogger("areal_flow.rollout")

ROLE_SEEDS = 10**6
"""Role i's calls draw seeds from turn_seed(seed, ROLE_SEEDS * i): roles never share a random stream."""


def drift_warning(agent: str, example: Any, dropped: int, tokenizer: Any) -> str:
    """The warning of an agent's first drift: where its history left the recorded tokens, as text."""
    def text(tokens: list[int]) -> str:
        return repr(tokenizer.decode(tokens)) if tokenizer is not None else str(tokens)

    return (f"agent {agent}: a call's history left the recorded tokens at token {example.position} (a drift): "
            f"recorded {text(example.recorded)}, sent {text(example.sent)}. The rollout's earlier segments are not "
            f"trained ({dropped} policy tokens dropped in this one; agent/dropped_tokens counts them each step): "
            "send each answer's text back as it came, then what the agent adds (docs/agents.md, The text an agent "
            "sends back), or check the chat template (python -m areal_flow.agents.check_template)")


class AgentFailed(Exception):
    """A rollout whose every run failed; the message names the agent and the last failure."""


def load_agent(path: str, where: str) -> Callable:
    """The async function `path` names ('package.module:function'); ValueError naming `where`."""
    fn = resolve_named(path, {}, where=where, unknown=lambda: f"{where}: expected 'module:function'")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"{where}: {path!r} is not an async function: an agent is "
                         "`async def run(client: openai.AsyncOpenAI, row: dict) -> float`")
    return fn


def import_openai() -> Any:
    try:
        import openai
    except ImportError:
        raise ValueError("an agent's client is the `openai` package: pip install 'areal_flow[agents]'") from None
    return openai


def reward_of(value: Any) -> float:
    """The rollout's reward from what the agent returned: a number, or per-turn numbers (summed).
    ValueError for anything else, or a number that is not finite."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        hint = ": does it end without a `return`?" if value is None else ""
        raise ValueError(f"returned {value!r}, not a reward (a number, or a list of per-turn numbers){hint}")
    reward = float(sum(values))
    if not math.isfinite(reward):
        raise ValueError(f"returned a reward that is not finite ({value!r})")
    return reward


@dataclasses.dataclass
class AgentRunner:
    """How the policy's generate node runs rollouts with an agent (graph.<node>.agent)."""

    fn: Callable
    name: str  # its import path, for messages
    model: str  # the policy's model name on the servers (forced on every call)
    wall_seconds: float
    retries: int
    roles: tuple[str, ...] = ()  # graph.<node>.agent_roles; empty: one role, run(client, row) -> reward
    backend: str = "embedded"  # generation.backend: the servers the gateway is in front of
    on_drift: str = "last_segment"  # graph.<node>.agent_drift: "drop" fails a drifted rollout
    tool_call_parser: str = "auto"  # generation.tool_call_parser: the gateway reads resumed answers' calls so
    gateway: Gateway | None = None
    http: Any = None  # the one HTTP client every rollout's openai client shares (in-process to the gateway)
    starting: asyncio.Future | None = None
    tokenizer: Any = None  # the policy's, to show a drift's text
    warned: bool = False  # of a drift, once a worker

    @classmethod
    def of(cls, node: Any, model_path: str, backend: str = "embedded",
           tool_call_parser: str = "auto") -> "AgentRunner | None":
        """The generate node's agent runner, or None when it names no agent."""
        if node.agent is None:
            return None
        return cls(load_agent(node.agent, f"graph.{node.name}.agent"), node.agent, model_path,
                   node.agent_wall_seconds, node.agent_retries, tuple(node.agent_roles), backend, node.agent_drift,
                   tool_call_parser)

    async def _gateway(self, pool: ServerPool, tokenizer: Any) -> Gateway:
        """The worker's gateway, started by the first rollout (in the loop that serves it); the
        rollouts that come while it starts wait for it."""
        if self.starting is None:
            self.starting = asyncio.ensure_future(self._start(pool, tokenizer))
        return await asyncio.shield(self.starting)

    async def _start(self, pool: ServerPool, tokenizer: Any) -> Gateway:
        self.tokenizer = tokenizer
        gateway = Gateway(pool, require_open=True, tokenizer=tokenizer, backend=self.backend,
                          tool_call_parser=self.tool_call_parser)
        await gateway.start()
        # Measured (py-spy, tiny_arith_agent): an openai client made for each rollout spent 47% of
        # the worker's CPU making its own HTTP client (an SSL context each). One shared client,
        # whose transport calls the gateway's app in this process (no socket, no HTTP parsing on
        # the gateway's side); the gateway's URL still serves agents' own clients.
        import httpx2  # openai 3's HTTP library

        self.http = import_openai().DefaultAsyncHttpxClient(transport=httpx2.ASGITransport(app=gateway.app))
        self.gateway = gateway
        return gateway

    async def close(self) -> None:
        if self.http is not None:
            await self.http.aclose()
        if self.gateway is not None:
            await self.gateway.stop()

    async def run(self, pool: ServerPool, tokenizer: Any, row: dict, prompt_ids: list[int], params: dict,
                  rid: str, key: str, seed: int | None) -> Trajectory:
        """One rollout, run once (a held-out answer: the first role's sample, every role's reward in
        its scalars): a failure is an empty answer with reward 0."""
        try:
            return (await self.attempt(await self._gateway(pool, tokenizer), row, params, key, seed))[0]
        except AgentFailed as e:
            log.warning("%s", e)
            return Trajectory(list(prompt_ids), scalars={AGENT_REWARD: 0.0, "agent/failed": 1.0})

    async def run_group(self, pool: ServerPool, tokenizer: Any, row: dict, prompt_ids: list[int], params: dict,
                        n: int, key: str, seed: int, kept: Sequence[Any] = (), group: Any = None) -> list[Trajectory]:
        """A group's n samples: n / roles rollouts, rollout j seeded seed + j, each giving a sample of
        every role; AgentFailed when one fails every run. The samples come role by role (the first
        role's of every rollout, then the next role's), so that each role's samples are one block of
        the group, whose advantages the trainer normalises apart (training/worker.py). `kept` and
        `group` (rollout/live.py) are ignored: an agent's rollout cannot be kept across a resume (its
        state is the agent's running code), it runs again from the start."""
        gateway = await self._gateway(pool, tokenizer)
        got = await asyncio.gather(*[self.rollout(gateway, row, params, f"{key}-{j}", seed + j)
                                     for j in range(n // len(self.role_names))], return_exceptions=True)
        for g in got:
            if isinstance(g, BaseException):
                raise g
        return [samples[r] for r in range(len(got[0])) for samples in got]

    async def rollout(self, gateway: Gateway, row: dict, params: dict, key: str, seed: int) -> list[Trajectory]:
        failures: list[str] = []
        for attempt in range(self.retries + 1):
            try:
                # A run again draws other random numbers: the same ones could fail the same way.
                got = await self.attempt(gateway, row, params, f"{key}-a{attempt}", turn_seed(seed, attempt * 1000))
            except AgentFailed as e:
                failures.append(str(e))
                log.warning("rollout %s, run %d of %d: %s", key, attempt + 1, self.retries + 1, e)
                continue
            for sample in got:
                sample.scalars["agent/failed_runs"] = float(attempt)
            return got
        raise AgentFailed(f"rollout {key} failed {len(failures)} run(s) (graph.generate.agent_retries="
                          f"{self.retries}): {failures[-1]}")

    @property
    def role_names(self) -> tuple[str | None, ...]:
        """The roles a rollout gives a sample of (one role: None)."""
        return self.roles or (None,)

    def _sampling(self, params: dict, seed: int | None) -> Sampling:
        return Sampling(forced={"model": self.model, "temperature": params["temperature"],
                                "top_p": params.get("top_p", 1.0)},
                        defaults={"max_tokens": params["max_new_tokens"]}, seeds=lambda call: turn_seed(seed, call))

    def _rewards(self, value: Any) -> dict[str | None, float]:
        """Each role's reward from what the agent returned (one role: None's)."""
        if not self.roles:
            return {None: reward_of(value)}
        if not isinstance(value, dict) or set(value) != set(self.roles):
            raise ValueError(f"returned {value!r}, not a reward for each role of graph.generate.agent_roles "
                             f"({', '.join(self.roles)})")
        return {role: reward_of(value[role]) for role in self.roles}

    async def attempt(self, gateway: Gateway, row: dict, params: dict, key: str, seed: int | None
                      ) -> list[Trajectory]:
        """One run of the agent: per role, its last call's trajectory, its reward and the `agent/`
        scalars. Each role has a key (and a client) of its own: its calls are recorded apart, and
        draw seeds of their own."""
        openai = import_openai()
        roles = self.role_names
        keys = {role: key if role is None else f"{key}.{role}" for role in roles}
        clients = {role: openai.AsyncOpenAI(
            base_url=gateway.open(keys[role], self._sampling(params, turn_seed(seed, ROLE_SEEDS * i))),
            api_key="areal_flow", max_retries=0, timeout=self.wall_seconds, http_client=self.http)
            for i, role in enumerate(roles)}
        t0 = time.monotonic()
        try:
            value = await asyncio.wait_for(self.fn(clients if self.roles else clients[None], dict(row)),
                                           self.wall_seconds)
            rewards = self._rewards(value)
        except asyncio.TimeoutError:
            raise AgentFailed(f"agent {self.name} did not return within {self.wall_seconds:g} s "
                              "(graph.generate.agent_wall_seconds)") from None
        except Exception as e:  # noqa: BLE001 - whatever the user's agent raises fails this rollout only
            raise AgentFailed(f"agent {self.name}: {type(e).__name__}: {e}") from e
        finally:
            records = {role: gateway.take(k) for role, k in keys.items()}  # the clients' HTTP client is shared
        seconds = time.monotonic() - t0
        each = {f"agent/reward/{role}": r for role, r in rewards.items() if role is not None}
        return [self._sample(records[role], role, value, {"reward": rewards[role], "seconds": seconds}, each)
                for role in roles]

    def _sample(self, recorder: Any, role: str | None, value: Any, figures: dict, each: dict) -> Trajectory:
        """A role's sample: the trajectory of its last call, and its scalars."""
        trajectory = recorder.last
        if trajectory is None:
            raise AgentFailed(f"agent {self.name} returned {value!r} without calling the policy"
                              + ("" if role is None else f" as role {role}"))
        dropped = recorder.dropped_tokens(trajectory)
        if recorder.drifts and self.on_drift == "drop":
            raise AgentFailed(f"agent {self.name}: a call's history left the recorded tokens at token "
                              f"{recorder.examples[0].position} (a drift; graph.generate.agent_drift=drop)")
        if recorder.drifts and not self.warned:
            self.warned = True
            log.warning("%s", drift_warning(self.name, recorder.examples[0], dropped, self.tokenizer))
        scalars = {**figures, "calls": float(recorder.calls), "drifts": float(recorder.drifts),
                   "drift_rate": recorder.drift_rate, "segments_per_rollout": float(len(recorder.trajectories)),
                   "dropped_tokens": float(dropped), "resumes": float(recorder.resumes)}
        return dataclasses.replace(
            trajectory, drift=dataclasses.asdict(recorder.examples[0]) if recorder.examples else None,
            scalars={**{f"agent/{name}": v for name, v in scalars.items()}, **each})
