"""Sampling one token per row, with the logprob SGLang reports and the trainer recomputes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

GREEDY_TEMPERATURE = 1e-6
"""Temperatures below this decode greedily (SGLang's threshold)."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    """Generate at most this many tokens (0: answer at once with no tokens)."""
    temperature: float = 1.0
    """Softmax temperature; below 1e-6 the engine decodes greedily."""
    top_p: float = 1.0
    """Sample from the smallest set of tokens whose probability reaches top_p; in (0, 1]."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1 turns it off."""
    stop_token_ids: tuple[int, ...] = ()
    """Ids that end the request besides the model's eos; the stop token is kept in the output."""
    ignore_eos: bool = False
    """Do not stop on the model's eos ids (nor on stop_token_ids: the request runs to max_new_tokens)."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one; in [0, 1], 0 turns it off."""
    stop: tuple[str, ...] = ()
    """Strings that end the request once the decoded output contains one; its tokens stay in the output."""
    seed: int | None = None
    """This request's own sampling seed: the same seed, prompt and weights give the same tokens
    (the token at position p draws its random number from (seed, p): `seeded_uniforms`)."""


def sample_next_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generator: torch.Generator | None = None,
    *,
    min_p: torch.Tensor | None = None,
    seeds: Sequence[int | None] | None = None,
    positions: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return (tokens [B] int64, logprobs [B] float32).

    logits [B, V] float32; temperature, top_p and min_p [B] float32; top_k [B] int64 (-1 = off).
    The logprob is log_softmax(logits / T) over the full vocabulary, taken before top-p/top-k/min-p
    truncation (SGLang's semantics, and what the trainer recomputes). Rows with T < 1e-6 take the
    argmax and report log_softmax(logits). The other rows draw from `generator`, except a row with
    a seed in `seeds` (a seeded request): it inverts its distribution's CDF at a uniform number of
    its own, drawn from (seed, the position of the token it samples: `positions`), so its draw
    depends on nothing else in the batch.
    """
    greedy = temperature < GREEDY_TEMPERATURE
    logprobs = scaled_logprobs(logits, temperature)
    tokens = logprobs.argmax(dim=-1)
    rows = (~greedy).nonzero().squeeze(1)
    if rows.numel() > 0:
        kept = _truncate(logprobs[rows], top_p[rows], top_k[rows], None if min_p is None else min_p[rows])
        probs = kept.softmax(dim=-1)
        tokens[rows] = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        own = [(j, seeds[r], positions[r]) for j, r in enumerate(rows.tolist())
               if seeds is not None and seeds[r] is not None]
        if own:  # the seeded rows: the inverse of their CDF at their own uniform number
            j, row_seeds, row_positions = (list(column) for column in zip(*own))
            uniform = torch.from_numpy(seeded_uniforms(row_seeds, row_positions)).to(probs.device)
            cdf = probs[j].double().cumsum(dim=-1)
            # The first token whose CDF exceeds u·total (u ≤ 1 - 2^-32 keeps that below the total in
            # float64): never a token of probability 0.
            tokens[rows[j]] = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).squeeze(1)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def seeded_uniforms(seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """One uniform number in [0, 1 - 2^-32] per (seed, position), float64: a hash of the two
    (splitmix64's mixer), as SGLang's seeded sampling hashes (seed, position). A request's stream
    is the same whatever else is decoded, and goes on where it was when the request is resubmitted
    with its tokens so far (the same positions draw the same numbers)."""
    seed = np.array([s % 2**64 for s in seeds], dtype=np.uint64)
    position = np.array(positions, dtype=np.uint64)
    key = _mix64(seed + np.uint64(0x9E3779B97F4A7C15))
    bits = _mix64(key ^ ((position + np.uint64(1)) * np.uint64(0xC2B2AE3D27D4EB4F)))
    return (bits >> np.uint64(32)).astype(np.float64) / 2**32


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def scaled_logprobs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T) [B, V] over the full vocabulary: the distribution a row samples from
    (before truncation) and reports logprobs of. Greedy rows (T < 1e-6) take T = 1."""
    scale = torch.where(temperature < GREEDY_TEMPERATURE, torch.ones_like(temperature), temperature)
    return torch.log_softmax(logits / scale[:, None], dim=-1)


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[float, int]]:
    """The k largest entries of one row of logprobs [V], as (logprob, token id), most likely first."""
    values, ids = logprobs.topk(k)
    return list(zip(values.tolist(), ids.tolist()))


def _truncate(logprobs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor,
              min_p: torch.Tensor | None) -> torch.Tensor:
    """Set logprobs outside each row's top-k, top-p and min-p sets to -inf; the best token always
    stays. As in SGLang, top-p and min-p are measured on the untruncated distribution."""
    no_min_p = min_p is None or bool((min_p <= 0).all())
    if no_min_p and bool(((top_k < 0) & (top_p >= 1.0)).all()):
        return logprobs  # nothing to cut: skip the sort
    vocab = logprobs.shape[-1]
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logprobs.device).expand_as(sorted_lp)
    drop = rank >= torch.where(top_k < 0, vocab, top_k)[:, None]
    probs = sorted_lp.exp()
    drop |= (probs.cumsum(dim=-1) - probs) > top_p[:, None]
    if not no_min_p:
        drop |= probs < min_p[:, None] * probs[:, :1]
    sorted_lp = sorted_lp.masked_fill(drop, -math.inf)
    return torch.full_like(logprobs, -math.inf).scatter(1, order, sorted_lp)
