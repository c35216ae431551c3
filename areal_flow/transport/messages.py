"""The wire format: every message between areal_flow processes is one of these msgspec Structs.

Arrays (token ids, logprobs, versions) travel as raw little-endian bytes inside an `Array`,
never as Python lists and never as pickle. `encode`/`decode` are the only way in and out, so a
message that does not decode raises `msgspec.DecodeError`, which receivers log and drop.
"""

from __future__ import annotations

import enum
from typing import Optional

import msgspec
import numpy as np


# The element types that travel; anything else is rejected when the message is decoded.
DTYPES = {"<i4": 4, "<i8": 8, "<f4": 4, "<f8": 8, "|u1": 1, "|b1": 1}


class Array(msgspec.Struct, array_like=True):
    """A 1-D numpy array as raw little-endian bytes."""

    dtype: str
    data: bytes

    def __post_init__(self) -> None:
        # Runs on decode too, so a malformed array fails there (and is dropped by the receiver)
        # instead of deep inside whoever reads it.
        if self.dtype not in DTYPES:
            raise ValueError(f"array dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if len(self.data) % DTYPES[self.dtype]:
            raise ValueError(f"{len(self.data)} bytes is not a whole number of {self.dtype} elements")

    def __len__(self) -> int:
        return len(self.data) // DTYPES[self.dtype]

    @classmethod
    def of(cls, a) -> "Array":
        a = np.ascontiguousarray(np.asarray(a))
        if a.ndim != 1:
            raise ValueError(f"Array.of expects a 1-D array, got shape {a.shape}")
        le = a.dtype.newbyteorder("<")
        return cls(le.str, a.astype(le, copy=False).tobytes())

    def numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype))


class Finish(str, enum.Enum):
    """How generation of a sample ended (SGLang's finish_reason types)."""

    STOP = "stop"  # end-of-sequence or a stop token: a finished answer
    LENGTH = "length"  # cut at max_new_tokens: truncated
    ABORT = "abort"  # the server gave up on it and the budget left no room to resume


class Stage(str, enum.Enum):
    """How far along the graph's streaming nodes a sample has come."""

    GENERATED = "generated"  # rollout worker: tokens, behaviour logprobs, versions
    SCORED = "scored"  # reward worker: every reward/combine node has written its key
    # A group the controller finds unusable is dropped at the reward worker, never trained, and
    # recorded in the ledger with the reason; it has no stage because it goes nowhere.


class Served(msgspec.Struct, array_like=True, frozen=True):
    """A server's account of one request of a sample: its name, the weight version it reported, and
    the digest of the LoRA adapters it had applied ("" for none: weights/adapter.py). The controller
    checks the digest against the trainer's for that version (controller/adapter_check.py)."""

    server: str
    version: int
    adapters: str = ""


class Sample(msgspec.Struct, kw_only=True):
    """One answer to one prompt, with its provenance. Identified by `uid`, never by queue position.

    `fields` holds the dataset's text fields (e.g. `prompt`, `answer`); `arrays` holds every
    per-token key a graph node wrote, under the name the recipe gave it (`prompt_ids`,
    `output_ids`, `behav_logprobs`, `versions`, `prox_logprobs`, ...); `scalars` holds per-sample
    numbers (`rewards`, ...).
    """

    uid: str
    prompt_id: str
    group_id: int
    index: int
    birth_time: float
    fields: dict[str, str] = {}
    arrays: dict[str, Array] = {}
    scalars: dict[str, float] = {}
    finish: Finish = Finish.STOP
    stage: Stage = Stage.GENERATED
    served: list[Served] = []  # the servers' accounts of its requests (/generate rollouts)

    def array(self, key: str) -> np.ndarray:
        return self.arrays[key].numpy()

    def n_tokens(self, key: str = "output_ids") -> int:
        return len(self.arrays[key])


class SampleMeta(msgspec.Struct, array_like=True):
    """What the controller knows of a sample: sizes, versions and scores, never its tokens."""

    uid: str
    index: int
    lengths: dict[str, int]  # per-token key -> number of values
    versions: dict[int, int]  # policy version -> answer tokens it generated
    scalars: dict[str, float]
    finish: Finish
    served: list[Served] = []

    @classmethod
    def of(cls, s: Sample, versions_key: str | None) -> "SampleMeta":
        counts: dict[int, int] = {}
        if versions_key and versions_key in s.arrays:
            values, n = np.unique(s.array(versions_key), return_counts=True)
            counts = {int(v): int(c) for v, c in zip(values, n)}
        return cls(s.uid, s.index, {k: len(a) for k, a in s.arrays.items()}, counts, dict(s.scalars), s.finish,
                   list(s.served))


# ---- rollout worker <-> controller ------------------------------------------------------


class AdmitRequest(msgspec.Struct, tag=True):
    """A rollout worker offers `slots` generation slots, once, at start. The controller fills them
    with prompt groups as admission allows, and a slot comes back to the worker when its group is
    scored or dropped, so no message per group is needed to ask for the next one."""

    worker: str
    slots: int


class KeptTrajectory(msgspec.Struct, kw_only=True):
    """A multi-turn trajectory in flight, as a checkpoint keeps it (rollout/live.py): its tokens so
    far, at a turn's boundary, with what its environment needs to go on. A resumed run continues it
    from there instead of generating it again from its prompt."""

    index: int  # the sample's place in its group
    prompt_ids: list[int]
    output_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    answer_starts: list[int]
    served: list[Served] = []
    stepped: bool  # False: the last answer is not yet answered by the environment (a tool call running)
    env_state: dict  # Environment.snapshot()
    figures: dict[str, float] = {}  # the environment's figures summed so far
    rewards: list[Optional[float]] = []  # each turn's reward from the environment so far


class PromptGroup(msgspec.Struct):
    """An admitted prompt group: generate `group_size` samples for it."""

    group_id: int
    prompt_id: str
    fields: dict[str, str]
    group_size: int
    birth_time: float
    # The dataset fields a judge reads, before dataset.prompt_template/chat_template (empty without judges).
    raw: dict[str, str] = {}
    # The policy version the generation servers had when the group was sent: a server that comes
    # back serving an older one is not used until it has this one (ServerPool.newest).
    policy_version: int = -1
    # A resumed run's group that was generating: the trajectories its checkpoint kept, continued.
    kept: list[KeptTrajectory] = []


class Admitted(msgspec.Struct, tag=True):
    """The prompt groups admitted to one rollout worker at once (one message, however many)."""

    groups: list[PromptGroup]


class Released(msgspec.Struct, tag=True):
    """Controller -> the rollout worker that generated these groups: they are scored and routed, so
    it no longer keeps its copy (which it keeps to send again should a reward worker die)."""

    group_ids: list[int]


class Resend(msgspec.Struct, tag=True):
    """Controller -> every rollout worker: a reward worker restarted, and the groups it held are
    lost; send every generated group not yet released to the reward workers again."""


class Joined(msgspec.Struct, tag=True):
    """A reward worker announces itself at start; the same name again means it was restarted."""

    worker: str


# ---- rollout worker -> reward worker -> trainer rank (the data plane) -----------------------


class GeneratedGroup(msgspec.Struct, tag=True):
    """A prompt group's samples, generated (rollout worker -> reward worker)."""

    group_id: int
    samples: list[Sample]
    traffic: dict[str, int] = {}  # bytes sent so far by the process that generated it (a metric)
    times: dict[str, float] = {}  # wall clock (time.time()) of its stages so far: requested, generated
    problem: str = ""  # why it cannot be trained, said where it was made (an agent that failed): dropped


class ScoredGroup(msgspec.Struct, tag=True):
    """A prompt group's samples, scored (reward worker -> the trainer rank the controller chose,
    and between trainer ranks when a step's plan moves it)."""

    group_id: int
    samples: list[Sample]


# ---- reward worker -> inference process -> trainer rank (a node on a mesh of its own) -------


class InferRequest(msgspec.Struct, tag=True):
    """Reward worker -> one replica of an inference node on a mesh of its own (graph.<node>.mesh):
    compute the node's output for a routed group, for the trainer rank `rank` that holds it. Only
    the arrays the node reads travel."""

    group_id: int
    rank: int
    node: str
    indices: list[int]  # each sample's index in its group
    inputs: list[dict[str, Array]]  # per sample, in `indices` order: the node's input arrays by key

    @classmethod
    def for_group(cls, group: ScoredGroup, rank: int, node: str, inputs: list[str]) -> InferRequest:
        """The request for node `node` (reading the keys `inputs`) of `group`, held by trainer rank `rank`."""
        return cls(group.group_id, rank, node, [s.index for s in group.samples],
                   [{k: s.arrays[k] for k in inputs} for s in group.samples])


class Inferred(msgspec.Struct, tag=True):
    """An inference process -> the trainer rank of an InferRequest: the node's output key for each
    sample of the group, which the rank joins to the group (training/join.py)."""

    group_id: int
    node: str
    key: str  # the key the node writes
    indices: list[int]
    arrays: list[Array]  # per sample, in `indices` order
    worker: str  # the inference process that computed it
    seconds: float = 0.0  # the group's share of the forward call that computed it


class Ready(msgspec.Struct, tag=True):
    """An inference process announces itself to the controller once its model is loaded."""

    worker: str


class CriticBatch(msgspec.Struct, tag=True):
    """A trainer rank -> the critic's process (a critic on a mesh of its own, training/critic.py):
    the critic's loss inputs for this rank's share of step `step` (empty for a rank that trains no
    samples of its own, e.g. a tensor-parallel follower). The process trains once every rank's is in."""

    step: int
    rank: int
    group_ids: list[int]  # per sample: its group, which whole-group minibatches split by
    prompts: list[Array]
    outputs: list[Array]
    token_data: dict[str, list[Array]]  # per key, per sample: the value loss's per-token inputs, loss mask included


class CriticTrained(msgspec.Struct, tag=True):
    """The critic's process -> every trainer rank: it trained step `step` (its stats, the engine's
    already reduced; trainer rank 0 reports them)."""

    step: int
    version: int
    stats: dict[str, float]
    worker: str


class CriticSaved(msgspec.Struct, tag=True):
    """The critic's process -> trainer rank 0: it wrote the critic of a SaveCheckpoint under `path`."""

    path: str
    worker: str


# ---- reward worker <-> controller (the control plane) -------------------------------------


class GroupMeta(msgspec.Struct, tag=True):
    """A scored group's metadata; the reward worker holds the samples until the Route comes."""

    group_id: int
    worker: str
    samples: list[SampleMeta]
    traffic: dict[str, int] = {}  # bytes sent so far by each process the group passed through (a metric)
    times: dict[str, float] = {}  # wall clock of its stages: requested, generated (rollout), scored (reward)
    problem: str = ""  # why it cannot be trained, from the rollout worker (GeneratedGroup.problem)


class Route(msgspec.Struct, tag=True):
    """Where a scored group goes: the trainer rank that will hold it, or DROP (the ledger says why)."""

    group_id: int
    rank: int


DROP = -1


# ---- controller <-> model workers ---------------------------------------------------------


class RunStep(msgspec.Struct, tag=True):
    """Run the graph's batch nodes for step `step` on the groups `groups` (this rank's share).
    First send each group in `moves` (group id -> rank) that this rank holds to that rank."""

    step: int
    groups: list[int]
    moves: dict[int, int] = {}


class StepDone(msgspec.Struct, tag=True):
    """A rank finished RunStep: statistics, where the new weights are, and its traffic so far."""

    rank: int
    step: int
    stats: dict[str, float] = {}
    weights_path: str = ""
    sent_bytes: int = 0
    adapter_digest: str = ""  # LoRA: the digest of the adapters of the version it trained (weights/adapter.py)


class PublishWeights(msgspec.Struct, tag=True):
    """rollout.weight_update_mode=distributed: send the trained role's weights to every generation
    server as `version` over the weights group (rank 0 broadcasts; every rank takes part in
    gathering them). The controller has paused the servers."""

    version: int
    abort_all_requests: bool = False
    keep_cache: bool = False  # requests held in place keep their KV cache: the servers must not flush it


class WeightsPublished(msgspec.Struct, tag=True):
    """A rank finished PublishWeights; rank 0 says how it went (`error` names the server and the
    bucket when it failed)."""

    rank: int
    version: int
    error: str = ""
    buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0


class SaveCheckpoint(msgspec.Struct, tag=True):
    """Write the Hugging Face checkpoint of every trained role to `path` (atomically). `groups`:
    a resumable checkpoint's part of this rank (docs/reliability.md): the trained roles under
    `path/<role>`, and the scored groups it holds, these ids, which it waits for if they are still
    on their way; None: the Hugging Face export at the end of a run."""

    path: str
    groups: list[int] | None = None


class Saved(msgspec.Struct, tag=True):
    """A rank finished SaveCheckpoint."""

    rank: int
    path: str


class KeepLive(msgspec.Struct, tag=True):
    """Controller -> rollout workers, as it saves a checkpoint: the trajectories in flight, please."""

    request: int


class Live(msgspec.Struct, tag=True):
    """A rollout worker -> the controller: its trajectories in flight at a turn's boundary, by group."""

    request: int
    groups: dict[int, list[KeptTrajectory]]


class Hello(msgspec.Struct, tag=True):
    """A trainer rank announces itself to the controller once its model is loaded."""

    rank: int


class Trainers(msgspec.Struct, tag=True):
    """The controller to a reward worker: the trainer ranks were resized to `n_trainers` (`scale
    RUN_DIR trainers=N`); read their inboxes from spec.json again before the next Route, which
    names a rank of the new size."""

    n_trainers: int


Message = (AdmitRequest | Admitted | Released | Resend | Joined | GeneratedGroup | ScoredGroup | GroupMeta | Route
           | RunStep | StepDone | PublishWeights | WeightsPublished | SaveCheckpoint | Saved | Hello | Trainers | InferRequest
           | Inferred | Ready | CriticBatch | CriticTrained | CriticSaved | KeepLive | Live)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Decode one message; raises msgspec.DecodeError (or ValidationError) on anything else."""
    return _decoder.decode(data)
