"""The well-known keys of the graph, and the node kinds: what each node type reads and writes.

A key's meaning is declared by the node that writes it, never guessed from a role: a generate or
inference node writes a well-known key under its own name, or under another name given by the
node's `keys` map (`keys: {prox_logprobs: old_logp}` makes its output `old_logp` mean
`prox_logprobs`); whatever a reward or combine node writes is a reward. A consumer finds its inputs
by meaning, so a recipe may rename any key and the runtime follows. docs/architecture.md explains
how the keys travel.

The node kinds are a registry, as the losses are (`algorithms/registry.py`): each kind is a name and
a `NodeKind` spec, registered with `register("node", name)(spec)`, and graph validation
(`graph/dataflow.py`) reads a node's rules from its kind's spec alone. The five built-ins are registered
below. A kind of your own is validated against its spec, then refused: no process of this version
would run it (`RUNTIME_KINDS`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

TEXT = "text"
"""The meaning of a dataset field (a prompt, a reference answer)."""


@dataclass(frozen=True)
class KeySpec:
    """What a well-known key holds."""

    dtype: str  # numpy dtype string on the wire
    per: str  # 'prompt' (per prompt token), 'output' (per output token), 'sample', or 'judge' (per judge token)
    doc: str


KEYS: dict[str, KeySpec] = {
    "prompt_ids": KeySpec("<i4", "prompt", "token ids of the prompt"),
    "output_ids": KeySpec("<i4", "output", "token ids of the answer"),
    "behav_logprobs": KeySpec("<f4", "output", "log π_behav: logprob of each answer token under the policy that sampled it"),
    "versions": KeySpec("<i4", "output", "policy version that generated each answer token"),
    "prox_logprobs": KeySpec("<f4", "output", "log π_prox: the trained role's logprobs before this update"),
    "ref_logprobs": KeySpec("<f4", "output", "logprobs under the reference model (KL)"),
    "values": KeySpec("<f4", "output", "the critic's value of the state before each answer token, before this update"),
    "loss_mask": KeySpec("|u1", "output", "1 on each answer token the policy generated, 0 on tokens an environment or "
                         "tool added (observations): the loss, advantages, KL and entropy count only the 1s"),
    "rewards": KeySpec("<f4", "sample", "one reward per sample"),
    "judge_ids": KeySpec("<i4", "judge", "token ids of a judge's answer (a generate node of role judge)"),
}

AGENT_REWARD = "agent/reward"
"""The sample scalar holding what a rollout's agent returned (agents/runner.py); a reward node with
`fn: agent` trains on it."""

JUDGE_STATS = ("seconds", "tokens", "cut", "truncated")
"""The scalars a judge writes for each sample, as `<judge>_<stat>` (rollout/judge.py): seconds to
answer, answer tokens, whether the policy's answer was cut to fit, whether the verdict hit its budget."""


@dataclass(frozen=True)
class NodeKind:
    """A node kind's spec: what its nodes read and write, by meaning, and how they run."""

    streaming: bool  # works on single groups as they come (else: a batch node, which fires on a batch)
    reads: tuple[str, ...] = ()  # meanings it must read
    may_read: tuple[str, ...] = ()  # meanings it may read
    writes: tuple[str, ...] = ()  # meanings it may write under a chosen name
    must_write: tuple[str, ...] = ()
    dataset_field: str = ""  # the one dataset field it reads, in words (generate: its prompt); "" = none
    n_outputs: int | None = None  # exact number of outputs, when fixed
    roles: tuple[str, ...] = ()  # model roles it may run on; a node with a role needs a mesh (none: no model)
    outputs_mean: str | None = None  # what every output means, whatever its name (reward, combine: rewards)
    weighted: bool = False  # reads two or more inputs and weighs each (graph.<node>.weights): combine
    role_writes: tuple[tuple[str, str], ...] = ()  # (meaning, the one role whose node may write it)
    by_role: tuple[tuple[str, "NodeKind"], ...] = ()  # a role whose nodes follow another spec
    reference_from: tuple[str, ...] = ()  # meanings a node may read instead of its dataset field as its reference text
    any_dataset_fields: bool = False  # reads one or more dataset fields (dataset_field says which, in words)


NODE_KINDS: dict[str, NodeKind] = {}
"""The registered node kinds by name, in the order they were registered."""

RUNTIME_KINDS = ("generate", "reward", "combine", "inference", "train")
"""The kinds this version's processes run: generate (rollout/worker.py), reward and combine
(rewards/worker.py), inference and train (training/worker.py)."""


def register(registry: str, name: str) -> Callable[[NodeKind], NodeKind]:
    """`register("node", "my_kind")(NodeKind(...))`: `graph.<node>.type: my_kind` then names it. The
    same call as `algorithms.registry.register("policy_loss", ...)`, here because a spec is the
    graph's data (and `algorithms/` sits below `graph/`)."""
    if registry != "node":
        raise ValueError(f"unknown registry {registry!r}: this one holds node kinds ('node'); policy losses, "
                         "advantage estimators and reward shapers are in areal_flow.algorithms.registry")

    def add(spec: NodeKind) -> NodeKind:
        if not isinstance(spec, NodeKind):
            raise TypeError(f"node kind {name!r}: a spec is a NodeKind, not {type(spec).__name__}")
        known = NODE_KINDS.get(name)
        if known is not None and known != spec:
            raise ValueError(f"node kind {name!r} is already registered, with another spec")
        NODE_KINDS[name] = spec
        return spec

    return add


def node_kinds() -> dict[str, NodeKind]:
    """Every registered kind, by name (read at each call: a kind registered later counts)."""
    return NODE_KINDS


# A generate node of role judge is a frozen model that answers a prompt rendered from the policy's
# answer and dataset fields (docs/judge.md); its answer is a reward node's reference text.
JUDGE = NodeKind(
    streaming=True, reads=("output_ids",), writes=("judge_ids",), must_write=("judge_ids",), n_outputs=1,
    any_dataset_fields=True, dataset_field="the fields its template names", roles=("judge",))
register("node", "generate")(NodeKind(
    streaming=True, writes=("prompt_ids", "output_ids", "behav_logprobs", "versions", "loss_mask"),
    must_write=("output_ids",),
    dataset_field="its prompt", roles=("actor", "judge"), by_role=(("judge", JUDGE),)))
register("node", "reward")(NodeKind(
    streaming=True, reads=("output_ids",), may_read=("judge_ids",), writes=("rewards",), must_write=("rewards",),
    dataset_field="the reference answer", n_outputs=1, outputs_mean="rewards", reference_from=("judge_ids",)))
register("node", "combine")(NodeKind(
    streaming=True, may_read=("rewards",), writes=("rewards",), must_write=("rewards",), n_outputs=1,
    outputs_mean="rewards", weighted=True))
# π_prox is the trained actor's, ref_logprobs the reference model's, values the critic's.
register("node", "inference")(NodeKind(
    streaming=False, reads=("prompt_ids", "output_ids"), writes=("prox_logprobs", "ref_logprobs", "values"),
    n_outputs=1, roles=("actor", "ref", "critic"),
    role_writes=(("prox_logprobs", "actor"), ("ref_logprobs", "ref"), ("values", "critic"))))
register("node", "train")(NodeKind(
    streaming=False, reads=("prompt_ids", "output_ids", "behav_logprobs", "rewards"),
    may_read=("prox_logprobs", "ref_logprobs", "versions", "values", "loss_mask"), roles=("actor", "critic")))

ROLES = ("actor", "ref", "critic", "judge")


def final_turn(output_ids: Sequence[int], loss_mask: Sequence[int]) -> list[int]:
    """A trajectory's last policy turn: the tokens after its last observation (loss_mask 0). The
    reward of a multi-turn trajectory reads it (the answer after the tools), as AReaL's multi-turn
    workflow scores the last turn; with no observation it is the whole answer."""
    observed = [i for i, m in enumerate(loss_mask) if not m]
    return list(output_ids[observed[-1] + 1:] if observed else output_ids)
