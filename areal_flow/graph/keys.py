"""The well-known keys of the graph and what each node type reads and writes.

A key's meaning is declared by the node that writes it, never guessed from a role: a generate or
inference node writes a well-known key under its own name, or under another name given by the
node's `keys` map (`keys: {prox_logprobs: old_logp}` makes its output `old_logp` mean
`prox_logprobs`); whatever a reward or combine node writes is a reward. A consumer finds its inputs
by meaning, so a recipe may rename any key and the runtime follows. docs/architecture.md explains
how the keys travel.
"""

from __future__ import annotations

from dataclasses import dataclass

TEXT = "text"
"""The meaning of a dataset field (a prompt, a reference answer)."""


@dataclass(frozen=True)
class KeySpec:
    """What a well-known key holds."""

    dtype: str  # numpy dtype string on the wire
    per: str  # 'prompt' (one value per prompt token), 'output' (per output token) or 'sample'
    doc: str


KEYS: dict[str, KeySpec] = {
    "prompt_ids": KeySpec("<i4", "prompt", "token ids of the prompt"),
    "output_ids": KeySpec("<i4", "output", "token ids of the answer"),
    "behav_logprobs": KeySpec("<f4", "output", "log π_behav: logprob of each answer token under the policy that sampled it"),
    "versions": KeySpec("<i4", "output", "policy version that generated each answer token"),
    "prox_logprobs": KeySpec("<f4", "output", "log π_prox: the trained role's logprobs before this update"),
    "ref_logprobs": KeySpec("<f4", "output", "logprobs under the reference model (KL)"),
    "values": KeySpec("<f4", "output", "the critic's value of the state before each answer token, before this update"),
    "rewards": KeySpec("<f4", "sample", "one reward per sample"),
}


@dataclass(frozen=True)
class NodeKind:
    """What a node type reads and writes, by meaning."""

    streaming: bool  # works on single groups as they come (else: fires on a batch)
    reads: tuple[str, ...] = ()  # meanings it must read
    may_read: tuple[str, ...] = ()  # meanings it may read
    writes: tuple[str, ...] = ()  # meanings it may write under a chosen name
    must_write: tuple[str, ...] = ()
    dataset_fields: int = 0  # dataset fields it reads: generate its prompt, reward the reference answer
    n_outputs: int | None = None  # exact number of outputs, when fixed
    roles: tuple[str, ...] = ()  # model roles it may run on (none: no model)


NODE_KINDS: dict[str, NodeKind] = {
    "generate": NodeKind(streaming=True, writes=("prompt_ids", "output_ids", "behav_logprobs", "versions"),
                         must_write=("output_ids",), dataset_fields=1, roles=("actor",)),
    "reward": NodeKind(streaming=True, reads=("output_ids",), writes=("rewards",), must_write=("rewards",),
                       dataset_fields=1, n_outputs=1),
    "combine": NodeKind(streaming=True, may_read=("rewards",), writes=("rewards",), must_write=("rewards",), n_outputs=1),
    "inference": NodeKind(streaming=False, reads=("prompt_ids", "output_ids"),
                          writes=("prox_logprobs", "ref_logprobs", "values"), n_outputs=1,
                          roles=("actor", "ref", "critic")),
    "train": NodeKind(streaming=False, reads=("prompt_ids", "output_ids", "behav_logprobs", "rewards"),
                      may_read=("prox_logprobs", "ref_logprobs", "versions", "values"), roles=("actor", "critic")),
}

WRITER_ROLE = {"prox_logprobs": "actor", "ref_logprobs": "ref", "values": "critic"}
"""The model role whose inference node may write a key: π_prox is the trained actor's, values the critic's."""

ROLES = ("actor", "ref", "critic")
