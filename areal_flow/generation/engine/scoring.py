"""Logprobs of given tokens through the engine's own forward, computed as a batch-invariant server
computed them while it sampled those tokens: the zero-mismatch mode's π_prox
(training/exact_prox.py, docs/algorithms.md "Zero mismatch").

A server that sampled an answer did so in requests: each prefilled its sequence (the prompt, plus
the answer's tokens so far when an update cut the answer and it went on) whole, took the first
token's logprob from the prefill's last logits, and then fed each sampled token back as one decode
step, whose logits gave the next token's logprob. `score` does exactly that for each `Forced`
request, with the given tokens in place of sampled ones: the keys and values of every position are
then those the server computed, through the same operations (decode attention over the paged cache,
prompts through SDPA, every projection padded to GEMM_ROWS rows), and with `batch_invariant` a row's
logits do not depend on which other rows share its forward. So its logprobs equal the server's bit
for bit, on the same weights, number format and threads (tests/generation/test_scoring.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from areal_flow.generation.engine.decode import Chunk, DecodeStep, Forward
from areal_flow.generation.engine.paged import BlockPool
from areal_flow.generation.engine.paged_inputs import spans
from areal_flow.generation.engine.sampling import scaled_logprobs


@dataclass(frozen=True)
class Forced:
    """One request as a server ran it: `prefix` prefilled whole, then `tokens` (at least one) each
    sampled after the one before it was fed."""

    prefix: Sequence[int]
    tokens: Sequence[int]

    @property
    def length(self) -> int:
        """Positions whose keys and values the request writes (its last token is never fed)."""
        return len(self.prefix) + len(self.tokens) - 1


def spans_of(versions: np.ndarray) -> list[tuple[int, int]]:
    """Runs of equal versions in an answer's tokens: (version, length), in order. Each run is a
    request a server ran (an update that cut the answer ended one, and the rest went on under the
    new weights as another: generation/client/carry_on.py)."""
    spans: list[tuple[int, int]] = []
    for v in np.asarray(versions).tolist():
        if spans and spans[-1][0] == v:
            spans[-1] = (v, spans[-1][1] + 1)
        else:
            spans.append((v, 1))
    return spans


def requests_of(prompt: Sequence[int], answer: Sequence[int], versions: np.ndarray) -> list[Forced]:
    """The requests that sampled `answer` to `prompt`, one per run of equal `versions`: each on the
    prompt plus the answer's tokens before its run."""
    requests, start = [], 0
    for _, n in spans_of(versions):
        requests.append(Forced(list(prompt) + list(answer[:start]), list(answer[start: start + n])))
        start += n
    return requests


def pool_for(step: DecodeStep, block_size: int) -> BlockPool:
    """A growable paged cache for `step`'s model, without a prefix cache (a batch-invariant server
    keeps none: every request prefills its whole sequence)."""
    weight = step.embed.weight
    return BlockPool(layers=len(step.layers), kv_heads=step.kv_heads, head_dim=step.head_dim, block_size=block_size,
                     num_blocks=None, dtype=weight.dtype, device=weight.device)


@torch.no_grad()
def score(step: DecodeStep, pool: BlockPool, requests: Sequence[Forced], temperature: float,
          wave_tokens: int) -> list[np.ndarray]:
    """Per request, float32 log_softmax(logits / T) of each of its tokens (the sampler's logprob),
    the requests run together in waves of about `wave_tokens` positions."""
    if not step.batch_invariant:
        raise ValueError("score needs a batch-invariant DecodeStep: a row's logits would depend on its batch")
    for i, r in enumerate(requests):
        if not r.prefix or not r.tokens:
            raise ValueError(f"request {i}: a prefix of {len(r.prefix)} and {len(r.tokens)} tokens; both must be non-empty")
    out: list[np.ndarray] = [np.empty(0, np.float32)] * len(requests)
    wave: list[int] = []
    used = 0
    for i, r in enumerate(requests):
        if wave and used + r.length > wave_tokens:
            _wave(step, pool, requests, wave, temperature, out)
            wave, used = [], 0
        wave.append(i)
        used += r.length
    if wave:
        _wave(step, pool, requests, wave, temperature, out)
    return out


def _wave(step: DecodeStep, pool: BlockPool, requests: Sequence[Forced], wave: list[int], temperature: float,
          out: list[np.ndarray]) -> None:
    """Prefill the wave's prefixes in one forward, then feed their tokens a decode step at a time."""
    pool.reset()
    device, size = pool.device, pool.block_size
    rows = [requests[i] for i in wave]
    tables = [pool.allocate(pool.blocks_for(r.length)) for r in rows]
    temp = torch.full((len(rows),), float(temperature), device=device)
    scored = [[] for _ in rows]

    def slot(row: int, position: int) -> int:
        return tables[row][position // size] * size + position % size

    # The prefill: each prefix a chunk of its own, causal over itself.
    tokens, positions, write, chunks, last = [], [], [], [], []
    for row, r in enumerate(rows):
        n = len(r.prefix)
        slots = [slot(row, p) for p in range(n)]
        chunks.append(Chunk(len(tokens), n, torch.tensor(slots, device=device),
                            torch.ones(n, n, dtype=torch.bool, device=device).tril_()))
        tokens += r.prefix
        positions += range(n)
        write += slots
        last.append(len(tokens) - 1)
    none = np.zeros((0, 0), dtype=np.int64)
    logits = step.forward(_forward(tokens, positions, write, [], none, size, chunks, last, device), pool)
    _take(logits, temp, [r.tokens[0] for r in rows], range(len(rows)), scored)
    # The decode steps: row by row, the token fed at step j is the answer's (j-1)th.
    for j in range(1, max(len(r.tokens) for r in rows)):
        live = [row for row, r in enumerate(rows) if len(r.tokens) > j]
        fed = [rows[row].tokens[j - 1] for row in live]
        where = [len(rows[row].prefix) + j - 1 for row in live]
        slots = [slot(row, p) for row, p in zip(live, where)]
        width = max(where) + 1
        table = np.zeros((len(live), pool.blocks_for(width)), dtype=np.int64)
        for k, row in enumerate(live):
            table[k, : len(tables[row])] = tables[row][: table.shape[1]]
        logits = step.forward(_forward(fed, where, slots, [p + 1 for p in where], table, size, [],
                                       list(range(len(live))), device), pool)
        _take(logits, temp[: len(live)], [rows[row].tokens[j] for row in live], live, scored)
    for row, i in enumerate(wave):
        out[i] = np.array(scored[row], dtype=np.float32)
    pool.reset()


def _forward(tokens: list[int], positions: list[int], write: list[int], lengths: list[int], table: np.ndarray,
             size: int, chunks: list[Chunk], logits_at: list[int], device: torch.device) -> Forward:
    """The step's Forward: `lengths` and `table` [rows, blocks] are its decode rows' (none in a prefill)."""
    decode = len(lengths)
    return Forward(tokens=torch.tensor(tokens, dtype=torch.int64, device=device),
                   positions=torch.tensor(positions, dtype=torch.int64, device=device),
                   write=torch.tensor(write, dtype=torch.int64, device=device), decode=decode,
                   decode_table=torch.from_numpy(table).to(device),
                   decode_lengths=torch.tensor(lengths, dtype=torch.int64, device=device),
                   decode_width=max(lengths, default=0), block_size=size,
                   spans=spans(list(lengths)) if decode else None, chunks=chunks,
                   logits_at=torch.tensor(logits_at, dtype=torch.int64, device=device))


def _take(logits: torch.Tensor, temperature: torch.Tensor, tokens: list[int], rows, scored: list[list[float]]) -> None:
    """Each row's logprob of its token under the sampler's log_softmax(logits / T)."""
    index = torch.tensor(tokens, dtype=torch.int64, device=logits.device)[:, None]
    values = scaled_logprobs(logits, temperature).gather(1, index)[:, 0].float().cpu().tolist()
    for row, value in zip(rows, values):
        scored[row].append(value)
