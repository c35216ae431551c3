"""A sample's requests to the generation servers: a group's samples in one request, and a sample's
resubmissions after an interruption (tokens so far, logprobs stitched, versions per token). The
sampling seeds that keep each sample's random stream its own are generation/client/seeds.py's."""

from __future__ import annotations

import asyncio
import itertools

from areal_flow.generation.client.carry_on import CUT, Piece, carry_on
from areal_flow.generation.client.router import SERVED_BY, ServerPool
from areal_flow.generation.client.versions import token_versions, version_number
from areal_flow.transport.messages import Finish, Served


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
    weight update (finish_reason abort), it is carried on (generation/client/carry_on.py): prompt +
    tokens so far are sent again with the remaining budget; each token keeps the version that made
    it. Every request names `key` (its prompt group), so the pool keeps the sample, its
    resubmissions and the rest of its group on one server while that server is up (ServerPool
    affinity). A resubmission keeps the sample's `seed`: a seeded token draws its random number from
    (seed, its position), so the stream goes on where it stopped and no position reuses one already
    drawn."""
    attempts = itertools.count(0 if first is None else 1)

    async def ask(so_far: Piece, left: int | None) -> Piece:
        return _piece(await pool.generate(prompt_ids + so_far.token_ids, {**params, "max_new_tokens": left,
                                                                            **_seeded(seed)},
                                          rid=f"{rid}-{next(attempts)}", key=key))

    budget = params["max_new_tokens"]
    start = _piece(first) if first is not None else await ask(Piece([], [], [], CUT), budget)
    whole, _ = await carry_on(start, budget, ask)
    return {"output_ids": whole.token_ids, "behav_logprobs": whole.logprobs, "versions": whole.versions,
            "finish": Finish(whole.finish), "served": whole.served}


def _piece(answer: dict) -> Piece:
    """A `/generate` answer as a piece of a sample."""
    meta = answer["meta_info"]
    # The server's account, checked by the controller (controller/adapter_check.py): the adapters it
    # reports are those of the version it reports (the answer's last).
    served = Served(str(meta.get(SERVED_BY, "")), version_number(meta.get("weight_version")),
                    str(meta.get("adapter_digest") or ""))
    return Piece(list(answer["output_ids"]), [lp for lp, _, _ in meta["output_token_logprobs"]],
                 token_versions(meta, len(answer["output_ids"])), meta["finish_reason"]["type"], served=[served])


def _seeded(seed: int | None) -> dict:
    return {} if seed is None else {"sampling_seed": seed}
