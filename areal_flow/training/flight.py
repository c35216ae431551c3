"""The flight record: what each trainer rank trained at each step, exactly, so that the trainer's side
of an asynchronous run can be replayed bit for bit (`python -m areal_flow.replay`).

At η > 0 what a step trains depends on timing: which groups made the batch, at which versions, where
updates cut answers. None of that can be recomputed afterwards, so each rank keeps it, one file a
step, `<run_dir>/flight/step-NNNNNNNN-rankR.msgpack` (NNNNNNNN: the step as the metrics rows count
it, from 1), written whole (a temporary file renamed) after the step's weights are out:

    step, rank            the step (from 0, as the weights' versions count) and the trainer rank
    samples               the rank's samples as the step got them, in the order it trained them:
                          every token, its version and behaviour logprob, the rewards (msgspec)
    prox_source           where the step's π_prox came from (algorithms/prox.py), and its version
    kl_coef               the KL coefficient the step used (an adaptive one moves between steps)
    rng                   torch's CPU generator state at the step's start (and CUDA's, on a GPU)
    threads               torch's intra-op threads (a sum's order depends on them on the CPU)
    digest                blake2b of the rank's trained weights after the step (its own shard)
    stats                 the step's training statistics (loss, gradient norm, ...)

The minibatch split needs no record: it is a pure function of the samples' groups (training/updates.py).
A resume rewinds the record with the logs (checkpoint/store.py `rewind`): the files of steps the
checkpoint had not reached go to `flight/discarded/`, so a resumed run's steps are recorded once.
"""

from __future__ import annotations

import glob
import os

import msgspec
import torch

from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.disk import write_atomic
from areal_flow.transport.messages import Sample

FLIGHT = rd.FLIGHT


class RecordError(ValueError):
    """A flight record that is not one (names the file)."""


class FlightStep(msgspec.Struct, kw_only=True):
    """One step of one rank (the module docstring)."""

    step: int
    rank: int
    samples: list[Sample]
    prox_source: str | None
    prox_version: int
    kl_coef: float
    rng: bytes
    cuda_rng: bytes | None = None
    threads: int = 1
    digest: str = ""
    stats: dict[str, float] = {}


def path_of(run_dir: str, step: int, rank: int) -> str:
    """The record of step `step` (from 0; the name counts from 1) by `rank`."""
    return os.path.join(run_dir, rd.FLIGHT_STEP.format(step=step + 1, rank=rank))


def begin(step: int, rank: int, samples: list[Sample], prox_source: str | None, prox_version: int,
          kl_coef: float) -> FlightStep:
    """A step's record as the step starts: its samples encoded now (the step's nodes write their
    outputs into them), the generators' states before anything draws."""
    copied = msgspec.msgpack.decode(msgspec.msgpack.encode(samples), type=list[Sample])
    on_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    cuda = torch.cuda.get_rng_state().numpy().tobytes() if on_cuda else None
    return FlightStep(step=step, rank=rank, samples=copied, prox_source=prox_source, prox_version=prox_version,
                      kl_coef=float(kl_coef), rng=torch.get_rng_state().numpy().tobytes(), cuda_rng=cuda,
                      threads=torch.get_num_threads())


def end(run_dir: str, record: FlightStep, digest: str, stats: dict[str, float]) -> int:
    """Write a step's record with the weights it ended with; returns the bytes written."""
    record.digest = digest
    record.stats = {k: float(v) for k, v in stats.items() if isinstance(v, (int, float))}
    data = msgspec.msgpack.encode(record)
    path = path_of(run_dir, record.step, record.rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, data)
    return len(data)


def read(run_dir: str, step: int, rank: int = 0) -> FlightStep:
    path = path_of(run_dir, step, rank)
    try:
        with open(path, "rb") as f:
            return msgspec.msgpack.decode(f.read(), type=FlightStep)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no flight record of step {step + 1} (rank {rank}); was the run made with "
                                "flight.record=true, and did it reach that step?") from None
    except msgspec.DecodeError as e:
        raise RecordError(f"{path}: not a flight record ({e})") from None


def recorded_steps(run_dir: str, rank: int = 0) -> list[int]:
    """The steps (from 0) rank `rank` has records of, in order."""
    return sorted(step for step, ranks in recorded_ranks(run_dir).items() if rank in ranks)


def recorded_ranks(run_dir: str) -> dict[int, set[int]]:
    """The ranks with a record of each step (from 0)."""
    ranks: dict[int, set[int]] = {}
    for path in glob.glob(os.path.join(run_dir, FLIGHT, "step-*.msgpack")):
        if match := rd.FLIGHT_STEP_NAME.match(os.path.basename(path)):
            ranks.setdefault(int(match.group(1)) - 1, set()).add(int(match.group(2)))
    return ranks


def restore_rng(record: FlightStep) -> None:
    """Set torch's generators (and its threads) to what they were when the step started."""
    torch.set_num_threads(record.threads)
    torch.set_rng_state(torch.frombuffer(bytearray(record.rng), dtype=torch.uint8))
    if record.cuda_rng is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(record.cuda_rng), dtype=torch.uint8))
