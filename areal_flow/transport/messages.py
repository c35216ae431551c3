"""The wire format: every message between areal_flow processes is one of these msgspec Structs.

Arrays (token ids, logprobs, versions) travel as raw little-endian bytes inside an `Array`,
never as Python lists and never as pickle. `encode`/`decode` are the only way in and out, so a
message that does not decode raises `msgspec.DecodeError`, which receivers log and drop.
"""

from __future__ import annotations

import numpy as np
import msgspec


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


class Sample(msgspec.Struct, kw_only=True):
    """One answer to one prompt, with its provenance. Identified by `uid`, never by queue position.

    `fields` holds the dataset's text fields (e.g. `prompt`, `answer`); `arrays` holds every
    per-token key a graph node wrote (`prompt_ids`, `output_ids`, `behav_logprobs`, `versions`,
    `prox_logprobs`, ...); `scalars` holds per-sample numbers (`rewards`, ...).
    """

    uid: str
    prompt_id: str
    group_id: int
    index: int
    birth_time: float
    fields: dict[str, str] = {}
    arrays: dict[str, Array] = {}
    scalars: dict[str, float] = {}
    finish_reason: str = ""

    def array(self, key: str) -> np.ndarray:
        return self.arrays[key].numpy()

    def n_tokens(self, key: str = "output_ids") -> int:
        return len(self.arrays[key])


# ---- rollout worker <-> controller ------------------------------------------------------


class AdmitRequest(msgspec.Struct, tag=True):
    """A rollout worker asks for one prompt group to generate; answered when admission allows."""

    worker: str


class PromptGroup(msgspec.Struct, tag=True):
    """An admitted prompt group: generate `group_size` samples for it."""

    group_id: int
    prompt_id: str
    fields: dict[str, str]
    group_size: int
    birth_time: float


# ---- rollout worker -> reward workers -> controller --------------------------------------


class GroupDone(msgspec.Struct, tag=True):
    """A generated (and, after the reward node, scored) prompt group."""

    group_id: int
    samples: list[Sample]


# ---- controller <-> model workers ---------------------------------------------------------


class RunNode(msgspec.Struct, tag=True):
    """Run a batch node (`inference` or `train`) on this rank's shard of a batch."""

    node: str
    step: int
    samples: list[Sample]


class NodeResult(msgspec.Struct, tag=True):
    """A rank's answer to RunNode: the keys it wrote per sample uid, and statistics."""

    node: str
    rank: int
    outputs: dict[str, dict[str, Array]] = {}
    stats: dict[str, float] = {}
    weights_path: str = ""  # train nodes: where the new weights were published


class SaveCheckpoint(msgspec.Struct, tag=True):
    """Write the Hugging Face checkpoint of every trained role to `path` (atomically)."""

    path: str


class Saved(msgspec.Struct, tag=True):
    """A rank finished SaveCheckpoint."""

    rank: int
    path: str


class Hello(msgspec.Struct, tag=True):
    """A trainer rank announces itself to the controller once its model is loaded."""

    rank: int


Message = AdmitRequest | PromptGroup | GroupDone | RunNode | NodeResult | SaveCheckpoint | Saved | Hello

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Decode one message; raises msgspec.DecodeError (or ValidationError) on anything else."""
    return _decoder.decode(data)
