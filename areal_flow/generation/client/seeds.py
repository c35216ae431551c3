"""Sampling seeds that keep each sample's random stream its own: a prompt group's, a turn's, a
role's. The `/generate` rollouts (rollout/requests.py), an environment's turns (rollout/turns.py)
and an agent's calls (agents/runner.py) all draw them here."""

from __future__ import annotations

import hashlib

SEED_LIMIT = 2**31 - 1
"""Sampling seeds stay below this (and a group's seed + n - 1 too): SGLang holds them as int32."""


def group_seed(run_seed: int, group_id: int, group_size: int) -> int:
    """The sampling seed of prompt group `group_id`'s request: sample i of the group draws from
    seed + i (the server's rule for `n` samples: generation/http/generate_api.py, as SGLang), so every
    sample of the run has a seed of its own, whatever server or batch serves it. A hash of the run's
    seed offsets them, so runs of other seeds draw other streams."""
    offset = int.from_bytes(hashlib.blake2b(str(run_seed).encode(), digest_size=8).digest(), "little")
    return (offset + group_id * group_size) % (SEED_LIMIT - group_size + 1)


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampling seed of a trajectory's turn: turn 0 keeps the sample's own seed, later turns draw
    fresh streams (a hash of both), so no turn replays another's random numbers."""
    if seed is None or turn == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_LIMIT
