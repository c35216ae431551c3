"""The engine interface every inference and train node uses, and what all engines share.

An engine is one rank of a model role (actor, ref): it computes per-token logprobs of given tokens,
runs a train step over packed sequences with a loss function, saves a Hugging Face directory with
its training state beside it (so that a resumed run continues exactly), and exports its weights
under Hugging Face names for the generation servers. `torch_engine.py` is the engine on plain
PyTorch (FSDP2 for data parallel), `megatron/engine.py` the one on megatron-core;
docs/architecture.md ("Training engines") has the contract.

Here are the options every engine takes (`EngineOptions`, checked when made) and the state every
engine keeps beside its model (`EngineBase`). What else both engines share lives beside this
module: packing a step into micro-batches (`micro_batches.py`), its statistics (`step_stats.py`)
and the files of their checkpoints (`checkpoint_files.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from areal_flow.weights.digest import weights_digest

Seq = tuple[np.ndarray, np.ndarray]
"""(prompt_ids, output_ids), 1-D integer arrays."""

LossFn = Callable[
    [torch.Tensor, dict[str, torch.Tensor], torch.Tensor, float],
    tuple[torch.Tensor, dict[str, torch.Tensor]],
]
"""loss_fn(logprobs [T_mb], batch {key: [T_mb]}, mask bool [T_mb], n_valid_tokens) -> (loss, stats)."""

LOSS_MASK_KEY = "loss_mask"
"""token_data key that, when present, is the per-output-token loss mask (default: all True)."""

LOSS_SHARE_KEY = "loss_share"
"""token_data key that, when present, is each token's share of the loss denominator: the loss
function gets the global sum of the valid tokens' shares instead of their count (a sequence mean
gives each of a sequence's n valid tokens 1/n, so the denominator counts sequences)."""


@dataclass(frozen=True)
class OptimSpec:
    """How a trainable role is optimised: AdamW, an LR schedule over optimizer steps, clipping."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0  # AdamW's decoupled decay, on weight matrices only (not biases or norms)
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping (the norm is still reported)
    schedule: str = "constant"  # constant | linear | cosine (training/schedule.py)
    warmup_steps: int = 0
    decay_steps: int = 0  # optimizer steps over which linear/cosine reach min_lr_ratio; 0 = constant after warm-up
    min_lr_ratio: float = 0.0
    max_nan_steps: int = 3  # non-finite steps in a row (each skipped) before train_step raises NonFiniteLoss


@dataclass(frozen=True)
class EngineOptions:
    """What every engine takes besides its model, optimizer and ranks; checked when made, so that a
    wrong value fails naming its key before any model is loaded."""

    micro_batch_tokens: int = 4096
    """Tokens per packed micro-batch on one device (first-fit-decreasing under this budget)."""
    temperature: float = 1.0
    """Logprobs are those of log_softmax(logits / temperature), as generation samples."""
    device: str = "cpu"
    """Where this rank's weights, optimizer state and activations live."""
    bf16: bool = False
    """Compute in bfloat16 with fp32 master weights and fp32 gradient reduction."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them."""
    attention: str = "auto"
    """How packed sequences attend (training/attention.py): auto, varlen, flex or sdpa."""
    logprob_chunk_tokens: int = 1024
    """The LM head's logprobs are computed this many tokens at a time, never holding the
    [tokens, vocab] fp32 logits (0: one chunk; training/logprobs.py)."""
    entropy: bool = False
    """Train steps also compute each token's entropy and pass it to the loss function as
    batch["entropy"] (with its gradient)."""

    def __post_init__(self) -> None:
        if self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {self.micro_batch_tokens}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.logprob_chunk_tokens < 0:
            raise ValueError(f"logprob_chunk_tokens must be >= 0 (0: one chunk), got {self.logprob_chunk_tokens}")


class NonFiniteLoss(RuntimeError):
    """Too many train steps in a row had a non-finite loss or gradient; none of them changed the model."""


@contextlib.contextmanager
def routed_forward(module: torch.nn.Module, forward: Callable) -> Iterator[None]:
    """`module.forward` is `forward` on this instance while entered, the class's again on exit.
    How the engines put chunked logprobs in place of the LM head inside the model's own forward,
    where FSDP and megatron have the weight at hand."""
    module.forward = forward
    try:
        yield
    finally:
        del module.forward


class OutOfMemory(RuntimeError):
    """A micro-batch did not fit the device's memory; the message names the token budget to lower."""


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's out-of-memory error, or the CPU allocator's failure (a plain RuntimeError)."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


@contextlib.contextmanager
def budget_named(key: str, budget: int, device: torch.device) -> Iterator[None]:
    """Turns an out-of-memory error inside into OutOfMemory naming the config `key` and its
    `budget` (tokens per micro-batch on one device) and what the device held, so that the run stops
    with what to change instead of a bare allocator trace. The process then exits; the launcher
    stops (or, with recover.retries, restarts) the run, so ranks waiting in a collective are not left
    hanging."""
    try:
        yield
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        held = ""
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            held = (f"; {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB peak of "
                    f"{total / 2**30:.1f} GiB on {device}")
        raise OutOfMemory(f"{key}={budget}: out of memory in a micro-batch of at most {budget} tokens{held}. "
                          f"Lower {key}, or set training.activation_checkpointing=true ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:200]})") from None


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as it is; the message names the file or tensor."""


class Engine(Protocol):
    """One rank of a model role. Collective calls (every rank of the role calls them, in the same
    order): logprobs, train_step, save, save_resumable, load_resumable, save_weights, export_weights."""

    version: int  # the policy version of the current weights (set by the caller, saved and restored)
    device: torch.device  # where this rank's weights, optimizer state and activations live
    data_leader: bool  # whether this rank speaks for the ranks that train the same data (logs it)
    data_parallel_group: dist.ProcessGroup | None  # the ranks that share the batch (None: this rank alone)
    extra_state: dict  # the caller's training state, saved and restored with the engine's own

    def data_parallel_batch(self, items: list) -> list:
        """What this rank trains, from what it was given: the union over the ranks that hold one
        copy of the model between them (megatron TP/PP), the same list on each; else `items`."""

    def logprobs(self, seqs: Sequence[Seq]) -> list[np.ndarray]:
        """Per sequence, float32 logprobs of each output token under log_softmax(logits / T)."""

    def train_step(self, seqs: Sequence[Seq], token_data: dict[str, list[np.ndarray]],
                   loss_fn: LossFn, skip: Sequence[bool] | None = None) -> dict[str, float]:
        """One optimizer step over this rank's share; stats summed over ranks. Sequences marked in
        `skip` (their loss terms and gradients are 0) count in the denominator but are not run."""

    def save(self, path: str, tokenizer=None) -> None:
        """A Hugging Face directory at `path` (atomically) with TRAIN_STATE (checkpoint_files.py)
        beside the weights."""

    def save_resumable(self, path: str, tokenizer=None) -> None:
        """A resumable checkpoint at `path` (a fresh folder the caller renames when complete): the
        Hugging Face weights (rank 0), SHARDED_STATE (every rank its own shards), RANK_RNG per rank
        and RESUMABLE_META. No rank gathers the optimizer state. Returns when every rank has written."""

    def load_resumable(self, path: str) -> None:
        """Load what `save_resumable` wrote at `path`: weights, optimizer, schedule, version, extra
        state, and this rank's RNG when the number of ranks is the saved one. A checkpoint that does
        not fit (missing files, other tensors, another engine or layout) is a CheckpointError."""

    def save_weights(self, path: str) -> None:
        """The current weights as a Hugging Face directory, for the generation servers."""

    def save_update(self, path: str) -> str | None:
        """What a weight update carries, as a directory at `path`: the weights (`save_weights`), or
        with LoRA the adapters alone (a PEFT adapter directory), whose digest it returns (None
        without LoRA: the servers report none to check)."""

    def export_update(self, bucket_bytes: int) -> tuple[Iterator[list[tuple[str, torch.Tensor]]], dict | None]:
        """What a weight update by broadcast or handle carries: the weights in buckets
        (`export_weights`) and None, or with LoRA the adapters in one bucket and the config a server
        merges them with (weights/adapter.py `transfer_config`). Collective."""

    def adapter_digest(self) -> str | None:
        """With LoRA, the digest of the adapters of this version, which the servers must report
        (weights/adapter.py); None without. Collective."""

    def weights_digest(self) -> str:
        """A digest of this rank's trained weights, equal iff they are bit for bit (training/flight.py)."""

    def export_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The full weights under Hugging Face names, in buckets of about `bucket_bytes`."""


# ---- shared by every engine ---------------------------------------------------------------------


def decays(name: str, param: torch.Tensor) -> bool:
    """Whether weight decay applies: to weight matrices and embeddings, not to biases and norm
    scales (megatron's rule, and the field's convention)."""
    return param.ndim > 1 and not name.endswith(".bias")


class EngineBase:
    """What every engine keeps beside its model: its options, the token budget of its micro-batches
    (which a graph node may change: worker.py `configured`), the policy version, the caller's
    `extra_state`, and the count of non-finite steps in a row; the last three travel with its
    checkpoints."""

    def __init__(self, options: EngineOptions, optim: OptimSpec | None) -> None:
        self.options = options
        self.optim = optim  # None: a frozen role (logprobs only)
        self.micro_batch_tokens = options.micro_batch_tokens
        self.version = 0
        self.extra_state: dict = {}  # the caller's training state (e.g. an adaptive KL coefficient), saved with it
        self._nan_in_a_row = 0

    def save_update(self, path: str) -> str | None:
        """The weights as `save_weights` writes them; an engine training adapters writes those alone."""
        self.save_weights(path)  # (both engines have it)
        return None

    def export_update(self, bucket_bytes: int) -> tuple[Iterator[list[tuple[str, torch.Tensor]]], dict | None]:
        """The weights as `export_weights` gives them; an engine training adapters gives those alone."""
        return self.export_weights(bucket_bytes), None  # (both engines have it)

    def adapter_digest(self) -> str | None:
        """None: an engine that trains every weight has no adapters to check."""
        return None

    def weights_digest(self) -> str:
        """A digest of this rank's trained weights (its own shard), equal iff the weights are bit for
        bit (training/flight.py)."""
        return weights_digest(list(self._model.named_parameters()))  # (both engines keep their model there)

    def _count_non_finite(self) -> None:
        """One more skipped non-finite step; NonFiniteLoss when there were `optim.max_nan_steps` in a row."""
        self._nan_in_a_row += 1
        if self._nan_in_a_row >= self.optim.max_nan_steps:
            raise NonFiniteLoss(f"{self._nan_in_a_row} train steps in a row had a non-finite loss or gradient "
                                f"(max_nan_steps={self.optim.max_nan_steps}); none of them changed the weights")

    def _counters(self) -> dict:
        """What a checkpoint saves of this state."""
        return {"version": self.version, "nan_in_a_row": self._nan_in_a_row, "extra": dict(self.extra_state)}

    def _restore_counters(self, saved: dict) -> None:
        """Put back what `_counters` saved (a checkpoint's training state or resumable meta)."""
        self.version = saved["version"]
        self._nan_in_a_row = saved["nan_in_a_row"]
        self.extra_state = dict(saved.get("extra", {}))


def bucketed(tensors: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Named tensors in buckets of at most `bucket_bytes` (a larger tensor travels alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
