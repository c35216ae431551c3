"""An answer that a weight update cut short (finish reason `abort`), carried on to its end: the one
loop both wires use, `/generate` (rollout/requests.py) and OpenAI's (agents/gateway.py).

The tokens so far are the policy's and are kept, each with its logprob and the version that made
it. The rest is asked for on the prompt plus the tokens so far, with the budget left; the wire's
`ask` keeps the sample's seed, so that a seeded token draws from (seed, its position) and the stream
goes on where it stopped. An abort that used the whole budget is a truncation like any other
(`length`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

CUT = "abort"
"""The finish reason of an answer an update cut short."""


@dataclasses.dataclass
class Piece:
    """An answer, or the part of one a request got: its tokens, their logprobs and versions, how it
    ended, and the wire's other end fields (the last piece's win)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: str
    end: dict = dataclasses.field(default_factory=dict)
    served: list = dataclasses.field(default_factory=list)  # the servers' accounts of its requests (messages.Served)

    @property
    def cut(self) -> bool:
        return self.finish == CUT

    def then(self, more: "Piece") -> "Piece":
        """This piece followed by `more`: the tokens joined, `more`'s end."""
        return Piece(self.token_ids + more.token_ids, self.logprobs + more.logprobs,
                     self.versions + more.versions, more.finish, dict(more.end), self.served + more.served)


async def carry_on(first: Piece, budget: int | None, ask: Callable[[Piece, int | None], Awaitable[Piece]], *,
                   limit: int | None = None, going: Callable[[], bool] = lambda: True) -> tuple[Piece, int]:
    """The whole answer from `first` and its continuations, and how many were asked for.

    `ask(so_far, left)` requests the rest of the answer `so_far` with `left` tokens of budget (None:
    no limit, the server's rule when the call set none). At most `limit` continuations are asked for
    (None: no limit), and none once `going()` is false; an answer still cut then comes back cut."""
    whole, resumes = first, 0
    while whole.cut and (budget is None or len(whole.token_ids) < budget) \
            and (limit is None or resumes < limit) and going():
        whole = whole.then(await ask(whole, None if budget is None else budget - len(whole.token_ids)))
        resumes += 1
    if whole.cut and budget is not None and len(whole.token_ids) >= budget:
        whole = dataclasses.replace(whole, finish="length")
    return whole, resumes
