"""Routing over several generation servers: least load, affinity, retries, health, weight fan-out.

`ServerPool` holds one `GenerationClient` per server and sends each request to one of them:

- **least load**: the server with the fewest requests this pool has in flight on it (ties go
  round-robin, starting with the first server);
- **affinity**: a request may name a `key` (a sample or prompt-group id); later requests with the
  same key go to the same server while it is up, where the prompt prefix is already cached;
- **retries**: a connection error, a timeout or a 5xx answer marks the server down and the request
  is retried (with backoff) on the least-loaded server still up; a 4xx is the request's fault and
  is raised at once with the server's message; a streamed call (`stream`: the agent gateway's) is
  retried only before its first event, since its reader has the events already;
- **health**: a server marked down is skipped; every `health_interval` seconds a `/health` check
  brings back the ones that answer. When every server is down, a request waits up to
  `down_timeout` for one to come back, then fails naming each server and its last error
  (the timeouts, retries and intervals are `rollout.*` settings: config/schema.py, RolloutConfig);
- **weight updates**: the primitives weights/update.py pauses, delivers and continues with
  (`servers_up`, `call_each`), and a server that comes back gets the last version first (`loaded`);
- **elastic**: a server may join a running pool (`add`: it takes requests once /health answers and
  it serves current weights, as one that comes back) and leave it (`leave`: no new request goes
  to it, but weight updates still do while it finishes what it runs; `forget`: it is gone).

AReaL's client picks servers round-robin, remembers a server per request id and retries on the same
server; slime's router picks the server with the fewest open requests. This pool does both, and
moves a request off a server that fails.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from areal_flow.config.schema import RolloutConfig
from areal_flow.config.validate import check_ranges
from areal_flow.generation.client.generation_client import (ClientClosed, GenerationClient, GenerationError,
                                                             describe_error, one_prompt)
from areal_flow.generation.client.readmission import serves_again
from areal_flow.generation.client.versions import answer_version

log = logging.getLogger("areal_flow.generation.client.router")

AFFINITY_KEYS = 4096
"""Keys remembered for affinity, the least recently used forgotten first: well above the prompt
groups one rollout worker has in flight."""

CONTROL_TIMEOUT = 5.0
"""Seconds a /health check or the abort of a left request may take."""

MAX_BACKOFF = 5.0
"""Longest wait between two tries of a request."""


class ServerPoolError(RuntimeError):
    """No server could answer a request: every try failed, or every server stayed down."""


class StreamCut(ServerPoolError):
    """A streamed call's server failed after some of its events went out: it cannot be tried again."""


@dataclass(eq=False)
class Server:
    name: str
    client: GenerationClient
    in_flight: int = 0
    """Requests this pool has sent to the server and not yet had answered."""
    up: bool = True
    last_error: str = ""
    leaving: bool = False
    """No new request goes to it (`leave`); weight updates still do, until it is forgotten."""
    joined: bool = True
    """Whether it has served in this pool (False: added by a scale, not yet taken)."""

    @property
    def usable(self) -> bool:
        return self.up and not self.leaving

    def describe(self) -> str:
        return f"{self.name} ({self.client.base_url}): {self.last_error or 'no error seen'}"


class ServerPool:
    """Sends requests to the generation servers at `urls` (named `names` in errors and logs), with
    `api_key` as a bearer token when the servers want one (a secured run's)."""

    def __init__(self, urls: Sequence[str], names: Sequence[str] | None = None,
                 config: RolloutConfig | None = None, *, max_connections: int = 64, api_key: str | None = None) -> None:
        if not urls:
            raise ValueError("a ServerPool needs at least one server url")
        names = list(names) if names is not None else [f"gen_server{i}" for i in range(len(urls))]
        if len(names) != len(urls):
            raise ValueError(f"{len(names)} names for {len(urls)} server urls")
        config = config or RolloutConfig()
        if problems := check_ranges(config, "rollout."):
            raise ValueError("; ".join(problems))
        self._client = lambda url: GenerationClient(url, max_connections=max_connections,
                                                    timeout=config.request_timeout, api_key=api_key)
        self.servers = [Server(name, self._client(url)) for name, url in zip(names, urls)]
        self.retries = config.request_retries
        self.retry_backoff = config.retry_backoff
        self.health_interval = config.health_interval
        self.down_timeout = config.down_timeout
        self._affinity: OrderedDict[str, Server] = OrderedDict()
        self._turn = 0  # where the next tie between equally loaded servers starts
        self._some_up = asyncio.Event()
        self._some_up.set()
        self._watcher: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()  # aborts of left requests
        # The last version loaded, and how a server that missed it loads it (None: no copy to load).
        self._weights: tuple[Callable[[GenerationClient], Awaitable[Any]] | None, int] | None = None
        self._newest = -1  # the newest weight version an answer came from or `newest` was told (a pool that loads none)
        # Held by a weight update (weights/update.py) and by a server's return: one that comes back
        # while an update runs would be marked up after the update chose its servers, and miss it.
        self.updating = asyncio.Lock()
        self.on_up: Callable[[str], None] = lambda name: None
        """Called with a server's name when it is taken (back) into the pool (the controller tells the
        rollout workers that a new server is current: generation/client/membership.py)."""

    async def __aenter__(self) -> ServerPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def clients(self) -> list[GenerationClient]:
        return [s.client for s in self.servers]

    def newest(self, version: int) -> None:
        """`version` is loaded on the servers that are up (a rollout worker learns it from the groups
        the controller admits). A pool that loads no weights takes a server back only at the newest
        version it knows of: the answers' alone lag the load, and a server restarted from the weights
        it last loaded would otherwise decode groups admitted at a newer version on older weights."""
        self._newest = max(self._newest, version)

    def down(self) -> list[str]:
        """Names of the servers marked down."""
        return [s.name for s in self.servers if not s.up]

    # ---- elastic membership -----------------------------------------------------------------------

    def add(self, name: str, url: str) -> None:
        """Server `name` at `url` joins the pool: it takes requests once /health answers and it serves
        current weights (as a server that comes back: `_back` loads them on it where this pool loads
        weights, and waits for them otherwise)."""
        if any(s.name == name for s in self.servers):
            raise ValueError(f"generation server {name} is in the pool already")
        self.servers.append(Server(name, self._client(url), up=False, joined=False,
                                   last_error="joining: not yet healthy and current"))
        self._watch_down()

    def leave(self, name: str) -> None:
        """Server `name` leaves the pool: no new request goes to it (nor a key bound to it: the key
        moves to another server). What it runs goes on, on the current weights (updates still reach
        it), until it aborts them: each comes back to its caller, which sends the rest elsewhere."""
        server = self._named(name)
        server.leaving = True
        for key in [k for k, s in self._affinity.items() if s is server]:
            del self._affinity[key]

    def forget(self, name: str) -> None:
        """Drop server `name` (its process is gone): a request still on it fails over as on any
        server that cannot be reached."""
        server = self._named(name)
        self.leave(name)
        self.servers.remove(server)
        self._in_background(server.client.close())

    def _named(self, name: str) -> Server:
        for server in self.servers:
            if server.name == name:
                return server
        raise ValueError(f"no generation server {name} in the pool ({', '.join(s.name for s in self.servers)})")

    # ---- requests -------------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        rid: str | None = None,
        key: str | None = None,
        return_logprob: bool = True,
    ) -> dict:
        """One prompt on one server (GenerationClient.generate), retried on another when it fails."""
        return await self.post("/generate", lambda try_rid: one_prompt(input_ids, sampling_params, try_rid,
                                                                       return_logprob, stream=False), rid=rid, key=key)

    async def post(self, path: str, payload: Callable[[str], Any], *, rid: str | None = None, key: str | None = None,
                   abortable: bool = True) -> Any:
        """POST `payload(rid of the try)` to `path` of one server (the key's, or the least loaded),
        retried on another when it fails; a try that may still run where it left is aborted there
        when the request carries that rid (`abortable`: /generate's do, OpenAI bodies do not). A
        payload of bytes is sent as it is and the answer's body comes back as bytes."""
        rid = rid or uuid.uuid4().hex
        tries: list[str] = []
        for attempt in range(self.retries + 1):
            server = await self._pick(key, rid)
            # Each try has its own rid. A try that timed out or lost its connection may still be
            # decoding on the server it left: it is aborted there (best effort, in the background:
            # that server may be unreachable), and its answer could reach nobody since the
            # connection is gone. A fresh rid keeps the retry clear of it even when the retry lands
            # on the same server before the abort does (SGLang refuses a rid still in flight).
            try_rid = rid if attempt == 0 else f"{rid}.retry{attempt}"
            server.in_flight += 1
            try:
                body = payload(try_rid)
                if isinstance(body, bytes):
                    return await server.client.post_bytes(path, body)
                answer = await server.client.post(path, body)
                self._newest = max(self._newest, answer_version(answer))
                for one in answer if isinstance(answer, list) else [answer]:  # /generate's: who answered
                    if isinstance(one, dict) and isinstance(one.get("meta_info"), dict):
                        one["meta_info"][SERVED_BY] = server.name
                return answer
            except GenerationError as exc:
                if exc.status < 500:
                    raise  # the request is wrong: another server would refuse it too
                error: BaseException = exc
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                error = exc
                # It may have reached the server, unless it never left (no connection, or no client).
                if abortable and not isinstance(exc, (aiohttp.ClientConnectorError, ClientClosed)):
                    self._in_background(self._abort(server, try_rid))
            finally:
                server.in_flight -= 1
            self._mark_down(server, error)
            tries.append(f"{server.name}: {describe_error(error)}")
            if attempt < self.retries:
                await asyncio.sleep(min(self.retry_backoff * 2 ** attempt, MAX_BACKOFF))
        raise ServerPoolError(f"request {rid} failed on every try ({len(tries)}): " + "; ".join(tries))

    async def stream(self, path: str, data: bytes, *, key: str | None = None) -> AsyncIterator[bytes]:
        """POST the encoded call `data` (one with `stream: true`) to `path` of one server, chosen as
        `post` chooses it, and yield the data of each server-sent event as it comes
        (GenerationClient.post_stream). A server that fails before its first event is marked down
        and the call tried on another, as `post` tries it; once an event went out the call cannot
        be tried again (its reader has it), so a failure then raises StreamCut. Leaving the loop
        early closes the connection, and the server aborts the call."""
        rid, tries = uuid.uuid4().hex, []
        for attempt in range(self.retries + 1):
            server, began = await self._pick(key, rid), False
            server.in_flight += 1
            try:
                async for event in server.client.post_stream(path, data):
                    began = True
                    yield event
                return
            except GenerationError as exc:
                if exc.status < 500:
                    raise  # the call is wrong: another server would refuse it too (a 502 once it began)
                error: BaseException = exc
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                error = exc
            finally:
                server.in_flight -= 1
            self._mark_down(server, error)
            if began:
                raise StreamCut(f"{server.name} failed in the middle of a streamed call: {describe_error(error)}")
            tries.append(f"{server.name}: {describe_error(error)}")
            if attempt < self.retries:
                await asyncio.sleep(min(self.retry_backoff * 2 ** attempt, MAX_BACKOFF))
        raise ServerPoolError(f"streamed call {rid} failed on every try ({len(tries)}): " + "; ".join(tries))

    async def _pick(self, key: str | None, rid: str) -> Server:
        """The key's server while it is up, else the least-loaded server that is up (waiting for
        one to come back when none is). Nothing awaits once a server is chosen, so the requests of
        a group started together all see the server the first of them bound its key to."""
        await self._wait_until_some_up(f"request {rid}")
        if key is not None and (server := self._affinity.get(key)) is not None and server.usable:
            self._affinity.move_to_end(key)
            return server
        n = len(self.servers)
        i = min((i for i, s in enumerate(self.servers) if s.usable),
                key=lambda i: (self.servers[i].in_flight, (i - self._turn) % n))
        server, self._turn = self.servers[i], (i + 1) % n
        if key is not None:
            self._affinity[key] = server
            self._affinity.move_to_end(key)
            if len(self._affinity) > AFFINITY_KEYS:
                self._affinity.popitem(last=False)
        return server

    async def _wait_until_some_up(self, what: str) -> None:
        deadline = time.monotonic() + self.down_timeout
        # A loop: a server that came back may fail again before this waiter runs.
        while not any(s.usable for s in self.servers):
            try:
                await asyncio.wait_for(self._some_up.wait(), max(deadline - time.monotonic(), 0))
            except asyncio.TimeoutError:
                raise ServerPoolError(
                    f"{what}: every generation server is down and none came back within {self.down_timeout:g} s "
                    "(rollout.down_timeout); " + "; ".join(s.describe() for s in self.servers)) from None

    async def _abort(self, server: Server, rid: str) -> None:
        try:
            await asyncio.wait_for(server.client.abort_request(rid), CONTROL_TIMEOUT)
        except (aiohttp.ClientError, asyncio.TimeoutError, GenerationError) as exc:
            log.info("could not abort %s on %s, which was left for another server: %s", rid, server.name,
                     describe_error(exc))

    def _in_background(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- health ---------------------------------------------------------------------------------

    def _mark_down(self, server: Server, error: BaseException) -> None:
        server.last_error = describe_error(error)
        if server.up:
            log.warning("generation server %s is down: %s", server.name, server.last_error)
            server.up = False
        if not any(s.usable for s in self.servers):
            self._some_up.clear()
        self._watch_down()

    def _watch_down(self) -> None:
        """Start the watcher of the servers that are down, unless it runs."""
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        """Check the servers marked down every health_interval until every one is back."""
        while down := [s for s in self.servers if not s.up and not s.leaving]:
            await asyncio.sleep(self.health_interval)
            # /health without the lock (a stalled server's check takes CONTROL_TIMEOUT, and updates
            # go on meanwhile); the weights check, and a reload, under it.
            healthy = [s for s, ok in zip(down, await asyncio.gather(*[self._healthy(s) for s in down])) if ok]
            if not healthy:
                continue
            async with self.updating:
                answers = await asyncio.gather(*[self._back(s) for s in healthy])
                for server, back in zip(healthy, answers):
                    if back and not server.up:
                        log.warning("generation server %s %s", server.name, "is back" if server.joined else "has joined")
                        server.joined = True
                        server.up = True
                        self._some_up.set()
                        self.on_up(server.name)

    async def _back(self, server: Server) -> bool:
        return await serves_again(server, self._weights, self._newest, CONTROL_TIMEOUT)

    async def _healthy(self, server: Server) -> bool:
        """/health answers 200 (the server keeps as last_error the failure that marked it down)."""
        try:
            return await asyncio.wait_for(server.client.health(), CONTROL_TIMEOUT)
        except asyncio.TimeoutError:
            return False

    # ---- what a weight update (weights/update.py) needs ------------------------------------------

    async def servers_up(self, what: str) -> list[Server]:
        """The servers that are up, once some are (ServerPoolError naming each when none comes back
        within down_timeout). `what`: the operation waiting, for that message."""
        await self._wait_until_some_up(what)
        return [s for s in self.servers if s.up]  # a leaving server too: it may still be decoding

    async def call_each(self, step: str, targets: list[Server], call: Callable[[GenerationClient], Awaitable[Any]]
                        ) -> tuple[list[Server], list[str]]:
        """`call` on every target at once: (the targets that answered, a refusal naming each that
        answered with an error). A target that cannot be reached is marked down."""
        results = await asyncio.gather(*[call(s.client) for s in targets], return_exceptions=True)
        refusals = []
        for server, result in zip(targets, results):
            if isinstance(result, GenerationError):
                refusals.append(f"{server.name} refused to {step}: {describe_error(result)}")
            elif isinstance(result, (aiohttp.ClientError, asyncio.TimeoutError)):
                self._mark_down(server, result)
            elif isinstance(result, BaseException):
                raise result
        return [s for s, r in zip(targets, results) if not isinstance(r, BaseException)], refusals

    def loaded(self, version: int, reload: Callable[[GenerationClient], Awaitable[Any]] | None) -> None:
        """Every server that is up has `version` now; `reload` gives it to one that comes back
        without it (None: there is no copy to load, and such a server stays out)."""
        self._weights = (reload, version)

    def left_out(self, version: int) -> list[str]:
        """The servers that are down, logged as having missed `version`."""
        left_out = [s.name for s in self.servers if not s.up]
        if left_out:
            log.warning("weight version %d was not loaded on %s: down (%s)", version, ", ".join(left_out),
                        "; ".join(s.describe() for s in self.servers if not s.up))
        return left_out

    # ---- colocated training: the trainer's turn ----------------------------------------------------

    async def release_memory(self) -> None:
        """Pause every server that is up, retracting its running requests (they go on later in the
        same answers), and free its KV cache: the trainer on the same devices takes its turn. The
        next weight update continues them (after `resume_memory`)."""
        await self._on_all("free its KV cache", lambda c: c.pause_generation("retract"))
        await self._on_all("free its KV cache", lambda c: c.release_memory_occupation())

    async def resume_memory(self) -> None:
        """The trainer's turn is over: every server takes its memory back (still paused)."""
        await self._on_all("take its memory back", lambda c: c.resume_memory_occupation())

    async def _on_all(self, step: str, call: Callable[[GenerationClient], Awaitable[Any]]) -> None:
        servers = [s for s in self.servers if s.up]
        results = await asyncio.gather(*[call(s.client) for s in servers], return_exceptions=True)
        failed = [f"{s.name}: {describe_error(r)}" for s, r in zip(servers, results) if isinstance(r, BaseException)]
        if failed:
            raise ServerPoolError(f"a generation server did not {step} for the colocated trainer: "
                                    + "; ".join(failed))

    async def unresponsive(self, timeout: float = 5.0) -> list[str]:
        """Names of the servers that do not answer /health within `timeout` seconds."""
        async def answers(c: GenerationClient) -> bool:
            try:
                return await asyncio.wait_for(c.health(), timeout)
            except (asyncio.TimeoutError, OSError):
                return False

        ok = await asyncio.gather(*[answers(s.client) for s in self.servers])
        return [s.name for s, good in zip(self.servers, ok) if not good]

    async def close(self) -> None:
        for task in [self._watcher, *self._background]:
            if task is not None:
                task.cancel()
        for server in self.servers:
            await server.client.close()


SERVED_BY = "served_by"
"""The key of a /generate answer's meta_info under which the pool notes the server that answered."""
