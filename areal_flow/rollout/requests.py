"""A sample's requests to the generation servers: a group's samples in one request, a sample's
resubmissions after an interruption (tokens so far, logprobs stitched, versions per token), and the
sampling seeds that keep each sample's random stream its own."""

from __future__ import annotations

import asyncio
import hashlib
import itertools

from areal_flow.generation.client.router import ServerPool, token_versions
from areal_flow.transport.messages import Finish


SEED_LIMIT = 2**31 - 1
"""Sampling seeds stay below this (and a group's seed + n - 1 too): SGLang holds them as int32."""


def group_seed(run_seed: int, group_id: int, group_size: int) -> int:
    """The sampling seed of prompt group `group_id`'s request: sample i of the group draws from
    seed + i (the server's rule for `n` samples: generation/http/generate_api.py, as SGLang), so every
    sample of the run has a seed of its own, whatever server or batch serves it. A hash of the run's
    seed offsets them, so runs of other seeds draw other streams."""
    offset = int.from_bytes(hashlib.blake2b(str(run_seed).encode(), digest_size=8).digest(), "little")
    return (offset + group_id * group_size) % (SEED_LIMIT - group_size + 1)


async def generate_group(pool: ServerPool, prompt_ids: list[int], params: dict, n: int, key: str,
                         seed: int | None = None) -> list[dict]:
    """A group's n samples from one request (`sampling_params.n`, SGLang's parallel sampling): one
    HTTP round trip and one prompt prefill for the group instead of n. An answer aborted by a
    weight update goes on alone (generate_sample). With a `seed`, sample i draws from seed + i."""
    answers = await pool.generate(prompt_ids, {**params, "n": n, **_seeded(seed)}, rid=key, key=key)
    answers = answers if isinstance(answers, list) else [answers]  # n = 1: one object, not an array
    return await asyncio.gather(*[generate_sample(pool, prompt_ids, params, f"{key}-{i}", key, first=answer,
                                                  seed=None if seed is None else seed + i)
                                  for i, answer in enumerate(answers)])


async def generate_sample(pool: ServerPool, prompt_ids: list[int], params: dict, rid: str, key: str,
                          first: dict | None = None, seed: int | None = None) -> dict:
    """One sample (from `first`, its answer so far, when given). When the server aborts it for a
    weight update (finish_reason abort), resubmit prompt + tokens so far with the remaining budget;
    each token keeps the version that made it. Every request names `key` (its prompt group), so the
    pool keeps the sample, its resubmissions and the rest of its group on one server while that
    server is up (ServerPool affinity). A resubmission keeps the sample's `seed`: a seeded token
    draws its random number from (seed, its position), so the stream goes on where it stopped and
    no position reuses one already drawn."""
    out_ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    budget = params["max_new_tokens"]
    for attempt in itertools.count():
        if attempt == 0 and first is not None:
            answer = first
        else:
            answer = await pool.generate(prompt_ids + out_ids, {**params, "max_new_tokens": budget - len(out_ids),
                                                                **_seeded(seed)}, rid=f"{rid}-{attempt}", key=key)
        meta = answer["meta_info"]
        out_ids += answer["output_ids"]
        logprobs += [lp for lp, _, _ in meta["output_token_logprobs"]]
        versions += token_versions(meta, len(answer["output_ids"]))
        reason = meta["finish_reason"]["type"]
        if reason != "abort" or len(out_ids) >= budget:
            # An abort that used the whole budget is a truncation like any other.
            finish = Finish.LENGTH if reason == "abort" else Finish(reason)
            return {"output_ids": out_ids, "behav_logprobs": logprobs, "versions": versions, "finish": finish}


def _seeded(seed: int | None) -> dict:
    return {} if seed is None else {"sampling_seed": seed}


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampling seed of a trajectory's turn: turn 0 keeps the sample's own seed, later turns draw
    fresh streams (a hash of both), so no turn replays another's random numbers."""
    if seed is None or turn == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_LIMIT
