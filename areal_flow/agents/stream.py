"""A call with `stream: true` through the gateway, streamed for real: the server's chunks go to the
agent as they are generated, and the call is recorded as a whole call is (gateway.py).

The embedded server streams OpenAI's chunks with each choice's exact tokens (token_ids, their
logprobs and versions, matched_stop) in the choice's last chunk and the call's `prompt_token_ids`
beside it (generation/http/openai_answers.py: OpenAIStream). The relay forwards each chunk as it
comes, as bytes, and keeps what it needs: the text it sent of each choice and each choice's last
chunk. Once every choice ended, before the last of them goes out, the call is recorded (so an agent
that stops reading at the finish reason is recorded too); then come the usage chunk
(`stream_options.include_usage`, held until every choice ended) and `[DONE]`.

A choice a weight update cut (`finish_reason: abort`) is carried on in the same stream, as a whole
call's is (resume.py): the `abort` never goes out; the rest is asked for as a streamed
`/v1/completions` call on the exact token ids (streamed, so that the agent gets the rest's tokens
as they are made: a cut is no reason to wait for the whole answer), its text sent as more chunks of
the choice, and the choice's last chunk is derived from all its tokens (its text's rest, tool
calls, finish reason, `resumes`). Each choice is carried on by a task of its own, so that an update,
which cuts every choice at once, does not queue their continuations. The continuation's text is
the decoding of its own tokens; where that cannot be the rest of the whole text (a character split
at the cut, or chat with tools, whose text the server holds until the choice ends: whether it is a
tool call is known only then), the rest is held and sent whole at the end.

A server that fails before the first chunk is retried on another (ServerPool.stream); after chunks
went out, and for a continuation that fails, the agent gets an error event (OpenAI's client raises
APIError) and no `[DONE]`, and nothing is recorded: a cut stream would read as a whole answer. An
agent that closes its connection stops the relay: its tasks are cancelled, their connections to
the server close and the server aborts the requests; nothing is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import msgspec

from areal_flow.agents import resume
from areal_flow.generation.client.carry_on import CUT, Piece, carry_on
from areal_flow.generation.client.generation_client import GenerationError
from areal_flow.generation.client.router import ServerPoolError

log = logging.getLogger("areal_flow.agents.stream")

ENDED = object()
"""What a producer puts on the relay's queue when it is done."""


class StreamFailed(RuntimeError):
    """A streamed call that cannot end well: the agent gets an error event saying why."""


class Choice(msgspec.Struct):
    """What the gateway records of an answer's choice (the server's extension fields)."""

    token_ids: list[int]
    output_token_logprobs: list[float]
    output_token_versions: list[int]
    finish_reason: str | None = None
    text: str | None = None  # /v1/completions' (text_map.py learns it)
    message: dict | None = None  # /v1/chat/completions' (content and tool calls, as a whole answer's)


@dataclasses.dataclass
class Shown:
    """One choice of the stream: the text the agent was sent of it, and its last chunk's choice."""

    index: int
    held: bool  # later text waits for the choice's end (see the module's docstring)
    sent: str = ""
    last: dict | None = None
    resumes: int = 0


class Relay:
    """Streams one call from the server to the agent (`events`) and records it through `gateway`
    (its `pool`, `tokenizer`, `rederived`, `record` and `going`)."""

    def __init__(self, gateway: Any, key: str, chat: bool, call: Any) -> None:
        self.gateway, self.key, self.chat, self.call = gateway, key, chat, call
        n = call.body.get("n")
        self.n = n if isinstance(n, int) and n > 0 else 1
        self.tools = chat and bool(call.body.get("tools")) and call.body.get("tool_choice") != "none"
        self.shown = {i: Shown(i, held=self.tools) for i in range(self.n)}
        self.head: dict = {}
        self.prompt_ids: list[int] = []
        self.usage: dict | None = None
        self.recorded: bool | str = False  # True once recorded; why not, if it could not be
        self.queue: asyncio.Queue = asyncio.Queue()  # events for the agent, from the producers' tasks
        self.tasks: set[asyncio.Task] = set()
        self.running = 0  # producers not yet ENDED: the server's stream, and a continuation per cut choice

    async def events(self, first: bytes, upstream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The agent's stream: the server's events from `first` on, through the producers' queue."""
        self._spawn(self._read(first, upstream))
        try:
            while self.running:
                item = await self.queue.get()
                if item is ENDED:
                    self.running -= 1
                elif isinstance(item, BaseException):
                    yield _error_event(item)
                    return
                else:
                    yield item
            for event in self._end():
                yield event
        finally:  # the stream ended, or the agent left: stop what still reads the server
            for task in self.tasks:
                task.cancel()

    def _spawn(self, coro: Coroutine) -> None:
        async def produce() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the agent is told (an error event), not left waiting
                self.queue.put_nowait(exc)
            finally:
                self.queue.put_nowait(ENDED)

        self.running += 1
        task = asyncio.ensure_future(produce())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _read(self, first: bytes, upstream: AsyncIterator[bytes]) -> None:
        async with contextlib.aclosing(upstream):
            self._chunk(first)
            async for event in upstream:
                self._chunk(event)

    def _chunk(self, event: bytes) -> None:
        """One event of the server's stream: forwarded, unless it ends a choice a weight update cut."""
        chunk = msgspec.json.decode(event)
        if not self.head:
            self.head = {k: chunk.get(k) for k in ("id", "object", "created", "model")}
        self.prompt_ids = chunk.get("prompt_token_ids", self.prompt_ids)
        choices = chunk.get("choices") or []
        if not choices:  # the usage chunk: sent once every choice ended (a cut one ends later)
            self.usage = chunk
            return
        # Without the tokenizer a cut choice cannot be derived again: it goes out cut (as a whole call's).
        resumable = self.gateway.tokenizer is not None
        passing = []
        for c in choices:
            shown = self.shown[c["index"]]
            if c.get("finish_reason") == CUT and resumable:
                self._text(shown, _text_of(c, self.chat), cut=True)
                self._spawn(self._carry(shown, c))
                continue
            passing.append(c)
            shown.sent += _text_of(c, self.chat)
            if c.get("finish_reason") is not None:
                shown.last = c
        self._record_once_ended()
        if len(passing) == len(choices):
            self.queue.put_nowait(b"data: " + event + b"\n\n")  # as the server sent it
        elif passing:
            self.queue.put_nowait(self._event(passing))

    def _text(self, shown: Shown, text: str, cut: bool = False) -> None:
        """Send `text` of a choice being carried on, unless its text is held; at a cut, a partly
        decoded character's bytes are held, and so is the rest (its continuation's text cannot
        follow it)."""
        if shown.held or not text:
            return
        safe = text.rstrip("\ufffd") if cut else text
        if safe != text:
            shown.held = True
        if safe:
            shown.sent += safe
            self.queue.put_nowait(self._event([self._piece(shown.index, safe)]))

    async def _carry(self, shown: Shown, first: dict) -> None:
        """Carry the cut choice `first` on to its end (resume.py), its text streamed as it comes."""
        body = {**self.call.body, "logprobs": self.call.asked}  # a rederived choice's OpenAI logprobs: as asked
        pool, prompt = self.gateway.pool, list(self.prompt_ids)

        async def ask(so_far: Piece, left: int | None) -> Piece:
            rest = {**resume.continuation(body, prompt, shown.index, so_far.token_ids, left), "stream": True}
            last = None
            async with contextlib.aclosing(pool.stream("/v1/completions", msgspec.json.encode(rest), key=self.key)) \
                    as events:
                async for event in events:
                    for c in msgspec.json.decode(event).get("choices") or ():
                        if c.get("finish_reason") is None:
                            self._text(shown, c.get("text") or "")
                        else:
                            last = c
            if last is None:
                raise StreamFailed("the continuation's stream ended without its last chunk")
            if last["finish_reason"] == CUT:  # cut again: its text so far, then the next continuation
                self._text(shown, last.get("text") or "", cut=True)
            return resume.piece(last)

        try:
            got, shown.resumes = await carry_on(resume.piece(first), resume.budget(body), ask,
                                                limit=resume.MAX_RESUMES, going=lambda: self.gateway.going(self.key))
        except Exception as exc:
            raise StreamFailed(f"{resume.CARRY_ON_FAILED}: {exc}") from exc
        whole = self.gateway.rederived(body, self.chat, shown.index, resume.stitched(first, got), self.head["model"])
        self._last(shown, whole)

    def _last(self, shown: Shown, whole: dict) -> None:
        """The last chunk of a choice carried on: the rest of its text, derived from all its tokens."""
        text = (whole["message"].get("content") or "") if self.chat else whole["text"]
        rest = text[len(shown.sent):]
        if not text.startswith(shown.sent):  # a tokenizer whose decoding differs at the seam
            rest = ""
            log.warning("choice %d of a streamed call carried on: the text streamed so far is not the start of "
                        "the text of all its tokens; the rest is left out of the stream (its tokens are exact)",
                        shown.index)
        piece = self._piece(shown.index, rest)
        if self.chat and whole["message"].get("tool_calls"):
            piece["delta"]["tool_calls"] = [{"index": k, **c} for k, c in enumerate(whole["message"]["tool_calls"])]
        piece.update({k: v for k, v in whole.items() if k not in ("index", "message", "text")},
                     resumes=shown.resumes)
        shown.sent += rest
        shown.last = piece
        self._record_once_ended()
        self.queue.put_nowait(self._event([piece], prompt_token_ids=self.prompt_ids))

    def _record_once_ended(self) -> None:
        """Record the call once every choice ended (before the last of them goes out)."""
        if self.recorded or any(s.last is None for s in self.shown.values()):
            return
        if not self.gateway.going(self.key):
            self.recorded = f"rollout {self.key!r} ended while this call ran: its answer is not recorded"
            return
        shown = [self.shown[i] for i in range(self.n)]
        self.gateway.record(self.key, self.call, self.prompt_ids, [
            Choice(s.last["token_ids"], s.last["output_token_logprobs"], s.last["output_token_versions"],
                   s.last["finish_reason"], None if self.chat else s.sent, self._message(s) if self.chat else None)
            for s in shown], resumes=sum(s.resumes for s in shown))
        self.recorded = True

    @staticmethod
    def _message(shown: Shown) -> dict:
        """A chat choice's message as the whole answer's: its content and tool calls."""
        delta = shown.last.get("delta") or {}
        calls = [{k: v for k, v in c.items() if k != "index"} for c in delta.get("tool_calls") or ()]
        if not calls:
            return {"role": "assistant", "content": shown.sent}
        return {"role": "assistant", "content": shown.sent or None, "tool_calls": calls}

    def _end(self) -> list[bytes]:
        """The stream's end: the usage chunk (its counts those of the whole answers) and `[DONE]`; an
        error event instead where the call was not recorded."""
        if self.recorded is not True:
            return [_error_event(StreamFailed(self.recorded or "the server's stream ended before every choice did"))]
        events = []
        if self.usage is not None:
            usage = self.usage.get("usage")
            if isinstance(usage, dict) and any(s.resumes for s in self.shown.values()):
                completion = sum(len(s.last["token_ids"]) for s in self.shown.values())
                usage.update(completion_tokens=completion, total_tokens=len(self.prompt_ids) + completion)
            events.append(b"data: " + msgspec.json.encode(self.usage) + b"\n\n")
        return [*events, b"data: [DONE]\n\n"]

    def _piece(self, index: int, text: str) -> dict:
        """A chunk's choice with `text` (none: an empty delta, to which the end's fields are added)."""
        if self.chat:
            return {"index": index, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": None}
        return {"index": index, "text": text, "logprobs": None, "finish_reason": None}

    def _event(self, choices: list[dict], **fields: Any) -> bytes:
        return b"data: " + msgspec.json.encode({**self.head, "choices": choices, **fields}) + b"\n\n"


def _text_of(choice: dict, chat: bool) -> str:
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _error_event(exc: BaseException) -> bytes:
    """An error event in OpenAI's envelope: OpenAI's client raises APIError on it."""
    if isinstance(exc, (StreamFailed, GenerationError, ServerPoolError)):
        log.warning("a streamed call failed: %s", exc)
    else:  # a bug: its traceback
        log.error("a streamed call failed", exc_info=exc)
    error = {"message": str(exc) or type(exc).__name__, "type": "server_error", "param": None, "code": None}
    return b"data: " + msgspec.json.encode({"error": error}) + b"\n\n"
