"""The other processes as the controller knows them: each trainer rank's socket identity and its
replies to what the controller asks of every rank, the reward workers that joined, and the
inference processes (nodes on a mesh of their own) that are ready."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from areal_flow.controller.watchdog import Progress, Wait
from areal_flow.transport.messages import Hello, Joined, Message, PublishWeights, Ready, WeightsPublished
from areal_flow.weights import UpdateFlags
from areal_flow.weights.update import WeightUpdateError

log = logging.getLogger("areal_flow.controller")

Send = Callable[[bytes, Message], Awaitable[None]]


class Peers:
    def __init__(self, send: Send, progress: Progress):
        self.send, self._progress = send, progress  # to one process, by its socket identity
        self.ranks: dict[int, bytes] = {}  # trainer rank -> socket identity
        self.reward_workers: set[str] = set()  # the reward workers that have joined
        self.replicas: set[str] = set()  # the inference processes that are ready
        self._replies: asyncio.Queue[Message] = asyncio.Queue()  # StepDone, WeightsPublished, Saved
        self._hello = asyncio.Event()  # a rank said Hello

    # ---- the mailbox's handlers ----------------------------------------------------------------

    def hello(self, ident: bytes, msg: Hello) -> None:
        """A trainer rank starts: at the run's start, or a new rank of a trainer resize."""
        self.ranks[msg.rank] = ident
        self._hello.set()

    def reply(self, ident: bytes, msg: Message) -> None:
        """A rank's answer to what the controller asked every rank (`gather` takes it)."""
        self._replies.put_nowait(msg)

    def ready(self, ident: bytes, msg: Ready) -> None:
        self.replicas.add(msg.worker)

    def joined(self, msg: Joined) -> bool:
        """A reward worker starts; whether it had joined before (the launcher restarted it)."""
        again = msg.worker in self.reward_workers
        self.reward_workers.add(msg.worker)
        return again

    # ---- asking the ranks ----------------------------------------------------------------------

    async def ask(self, make: Callable[[int], Message], kind: type, what: str) -> list:
        """Send every rank its message (`make(rank)`), then gather one reply of type `kind` from each."""
        for rank, ident in self.ranks.items():
            await self.send(ident, make(rank))
        return await self.gather(kind, what)

    async def gather(self, kind: type, what: str) -> list:
        """One reply of type `kind` from every trainer rank, in rank order; while some are missing,
        the step loop waits for them by name."""
        got: dict[int, Message] = {}
        while len(got) < len(self.ranks):
            msg = await self._replies.get()
            if isinstance(msg, kind):
                got[msg.rank] = msg
                if missing := ", ".join(f"trainer{r}" for r in sorted(set(self.ranks) - set(got))):
                    self._progress.waits(Wait.RANKS, missing=missing, what=what)
            else:
                log.error("controller: unexpected %s from a trainer rank while waiting for %s, dropped",
                          type(msg).__name__, what)
        return [got[r] for r in sorted(got)]

    async def send_weights(self, version: int, flags: UpdateFlags) -> None:
        """Once the publisher has paused the servers, for channels whose trainers send: every trainer
        rank takes part in sending `version`, rank 0 sends it to the servers. Raises
        WeightUpdateError with rank 0's account of what failed (server, bucket, tensor)."""
        self._progress.waits(Wait.SEND_WEIGHTS, version=version)
        done = await self.ask(lambda rank: PublishWeights(version, flags.abort_all_requests, flags.keep_cache),
                              WeightsPublished, f"sending weight version {version}")
        if errors := [d.error for d in done if d.error]:
            raise WeightUpdateError("; ".join(errors))

    # ---- who is there --------------------------------------------------------------------------

    async def until_reported(self, n_ranks: int, replicas: set[str], receive: Callable[[], Awaitable[None]],
                             timeout: float) -> None:
        """Take messages (`receive`) until `n_ranks` trainer ranks said Hello and every inference
        process of `replicas` is ready; a TimeoutError naming the missing ones after `timeout` seconds."""
        async def reported() -> None:
            while len(self.ranks) < n_ranks or replicas - self.replicas:
                await receive()

        try:
            await asyncio.wait_for(reported(), timeout)
        except asyncio.TimeoutError:
            missing = [f"trainer ranks {self.missing(n_ranks)}"] if len(self.ranks) < n_ranks else []
            missing += [f"inference processes {sorted(replicas - self.replicas)}"] if replicas - self.replicas else []
            raise TimeoutError(f"{' and '.join(missing)} did not report within {timeout:.0f} s "
                               "(launcher.start_timeout)") from None

    def missing(self, n: int) -> list[int]:
        """The ranks of `n` that have not said Hello."""
        return sorted(set(range(n)) - set(self.ranks))

    async def until_ranks(self, n: int, timeout: float) -> None:
        """Wait for the Hello of `n` ranks; asyncio.TimeoutError after `timeout` seconds."""
        async def all_there() -> None:
            while len(self.ranks) < n:
                self._hello.clear()
                await self._hello.wait()

        await asyncio.wait_for(all_there(), max(0.1, timeout))

    def forget_ranks(self) -> None:
        """A trainer resize: the old ranks are gone, each new rank's Hello fills `ranks` again."""
        self.ranks = {}
