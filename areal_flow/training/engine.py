"""The engine interface every inference and train node uses, and what all engines share.

An engine is one rank of a model role (actor, ref): it computes per-token logprobs of given tokens,
runs a train step over packed sequences with a loss function, saves a Hugging Face directory with
its training state beside it (so that a resumed run continues exactly), and exports its weights
under Hugging Face names for the generation servers. `torch_engine.py` is the engine on plain
PyTorch (FSDP2 for data parallel); docs/architecture.md ("Training engines") has the contract.

Per-node packing: a micro-batch is the concatenation of whole sequences under the node's token
budget (first-fit-decreasing), and every data-parallel rank runs the same number of micro-batches
(`agreed_micro_batches`), because each forward and backward runs collectives. The loss is
normalised by the valid-token count of the whole global batch, so the SUM of the ranks' gradients
is the gradient of the global token mean.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from areal_flow.algorithms.packing import ffd_allocate
from areal_flow.runtime.devices import to_device  # noqa: F401  (imported from here too)

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

TRAIN_STATE = "train_state.pt"
"""The file beside a checkpoint's Hugging Face files that holds what an exact resume needs."""

SHARDED_STATE = "dcp"
"""A resumable checkpoint's folder (beside its Hugging Face files) of model and optimizer state,
written by `torch.distributed.checkpoint`: each rank writes its own shards (`__<rank>_0.distcp`)."""

RESUMABLE_META = "meta.pt"
"""A resumable checkpoint's small state, written by rank 0: the engine, its layout and world size,
the LR schedule, the version, the non-finite step count and the caller's `extra_state`."""

RANK_RNG = "rng-rank{rank}.pt"
"""A resumable checkpoint's RNG state of one rank, written by that rank."""


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
        """A Hugging Face directory at `path` (atomically) with TRAIN_STATE beside the weights."""

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

    def export_weights(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The full weights under Hugging Face names, in buckets of about `bucket_bytes`."""


# ---- shared by every engine ---------------------------------------------------------------------


def check_engine_args(micro_batch_tokens: int, temperature: float) -> None:
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def decays(name: str, param: torch.Tensor) -> bool:
    """Whether weight decay applies: to weight matrices and embeddings, not to biases and norm
    scales (megatron's rule, and the field's convention)."""
    return param.ndim > 1 and not name.endswith(".bias")


def non_finite_step(in_a_row: int, max_nan_steps: int) -> int:
    """Counts one more skipped non-finite step; raises NonFiniteLoss when there were too many."""
    in_a_row += 1
    if in_a_row >= max_nan_steps:
        raise NonFiniteLoss(f"{in_a_row} train steps in a row had a non-finite loss or gradient "
                            f"(max_nan_steps={max_nan_steps}); none of them changed the weights")
    return in_a_row


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


def read_train_state(path: str) -> dict | None:
    """The TRAIN_STATE beside a checkpoint's weights, or None when it has none."""
    state_file = os.path.join(path, TRAIN_STATE)
    if not os.path.exists(state_file):
        return None
    try:
        return torch.load(state_file, weights_only=True)  # a checkpoint cannot run code
    except Exception as exc:
        raise CheckpointError(f"{state_file}: unreadable training state: {exc}") from exc


def _read_small(file: str) -> dict:
    try:
        return torch.load(file, weights_only=True)  # a checkpoint cannot run code
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing (not a resumable checkpoint written by save_resumable)") from None
    except Exception as exc:
        raise CheckpointError(f"{file}: unreadable: {exc}") from exc


def read_resumable_meta(path: str, engine: str) -> dict:
    """RESUMABLE_META of the resumable checkpoint `path`, checked to have been written by `engine`
    with its SHARDED_STATE present; else a CheckpointError naming the file."""
    meta = _read_small(os.path.join(path, RESUMABLE_META))
    if meta.get("engine") != engine:
        raise CheckpointError(f"{os.path.join(path, RESUMABLE_META)}: written by the {meta.get('engine')} engine, "
                              f"this is the {engine} engine")
    if not os.path.isfile(os.path.join(path, SHARDED_STATE, ".metadata")):
        raise CheckpointError(f"{os.path.join(path, SHARDED_STATE)}: no .metadata (an incomplete sharded state)")
    return meta


def read_rank_rng(path: str, rank: int) -> dict:
    return _read_small(os.path.join(path, RANK_RNG.format(rank=rank)))


def write_sharded_state(path: str, state: dict, group: dist.ProcessGroup | None, alone: bool) -> None:
    """`state` into SHARDED_STATE under `path` with `torch.distributed.checkpoint`: each rank of
    `group` (None: the default one) writes the shards it holds, rank 0 the index (`.metadata`).
    `alone`: this process is the only rank (no process group needed)."""
    import torch.distributed.checkpoint as dcp

    folder = os.path.join(path, SHARDED_STATE)
    os.makedirs(folder, exist_ok=True)
    with warnings.catch_warnings():  # one process alone is what `alone` says; DCP warns of it
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=folder, process_group=group, no_dist=alone)


def read_sharded_state(path: str, state: dict, group: dist.ProcessGroup | None, alone: bool) -> None:
    """Load SHARDED_STATE under `path` into `state` in place (each rank reads the parts of the
    files its tensors cover: DCP reshards). Check it first with `check_sharded_state`."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=os.path.join(path, SHARDED_STATE), process_group=group, no_dist=alone)


def check_sharded_state(path: str, state: dict) -> None:
    """Fail naming the tensor when the SHARDED_STATE at `path` lacks one of the tensors of `state`
    (a nested state dict as `torch.distributed.checkpoint.load` takes it) or holds it in another
    shape, before anything is loaded: `load` copies into the model's own tensors as it goes."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = os.path.join(path, SHARDED_STATE)
    try:
        saved = FileSystemReader(folder).read_metadata().state_dict_metadata
    except Exception as exc:
        raise CheckpointError(f"{folder}: unreadable sharded state: {exc}") from exc

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, torch.Tensor):
            shape = tuple(value.shape)  # a DTensor's shape is its global one
            found = saved.get(prefix)
            if not isinstance(found, TensorStorageMetadata):
                raise CheckpointError(f"{folder}: tensor {prefix} is missing")
            if tuple(found.size) != shape:
                raise CheckpointError(f"{folder}: tensor {prefix} has shape {list(found.size)}, this model wants "
                                      f"{list(shape)}")

    walk("", state)


# ---- packing ------------------------------------------------------------


def seq_lengths(seqs: Sequence[Seq]) -> list[int]:
    return [len(prompt) + len(output) for prompt, output in seqs]


def check_budget(lengths: list[int], budget: int) -> None:
    """A sequence longer than the micro-batch budget cannot be packed: say so with both numbers."""
    longest = max(lengths, default=0)
    if longest > budget:
        raise ValueError(f"a sequence of {longest} tokens does not fit the micro-batch budget of {budget} tokens "
                         "(micro_batch_tokens): raise the budget to at least the longest sequence")


def agreed_micro_batches(lengths: list[int], budget: int, group: dist.ProcessGroup | None) -> list[list[int]]:
    """FFD micro-batches of sequence indices, the same number on every rank of `group`.

    Ranks whose natural count is below the largest re-run FFD with that count as min_groups,
    which spreads their sequences instead of adding empty passes (a rank with fewer sequences than
    the count still gets empty ones, which the engine must run too). That can, rarely, make FFD
    need more groups than asked, so the ranks agree again until max == min. Every rank sees the
    same reduced values and so runs the same collectives. It terminates: the max only grows, and
    once it reaches a rank's number of sequences that rank returns exactly the max.
    """
    check_budget(lengths, budget)
    groups = ffd_allocate(lengths, budget)
    if group is None:
        return groups
    while True:
        # One all-reduce yields both the max and (negated) the min of the counts.
        counts = torch.tensor([len(groups), -len(groups)], dtype=torch.int64)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
        most, fewest = int(counts[0]), -int(counts[1])
        if most == fewest:
            return groups
        groups = ffd_allocate(lengths, budget, min_groups=most)


@dataclass(frozen=True)
class PackedRow:
    """Sequences concatenated in one row without padding (every engine's micro-batch)."""

    ids: np.ndarray  # [T] prompt + output tokens of every sequence
    cu_seqlens: np.ndarray  # [n + 1] where each sequence starts, then the total
    keep: np.ndarray  # [K] positions whose logits predict an output token
    targets: np.ndarray  # [K] those output tokens
    n_out: list[int]  # output tokens per sequence (to split the K logprobs back)

    @property
    def positions(self) -> np.ndarray:
        """Positions restarting at 0 for each sequence."""
        starts = np.repeat(self.cu_seqlens[:-1], np.diff(self.cu_seqlens))
        return np.arange(len(self.ids)) - starts


def pack_row(seqs: Sequence[Seq]) -> PackedRow:
    ids, keep, targets, n_out, cu = [], [], [], [], [0]
    for prompt, output in seqs:
        prompt = np.asarray(prompt, dtype=np.int64)
        output = np.asarray(output, dtype=np.int64)
        if len(prompt) == 0:
            raise ValueError("every sequence needs at least one prompt token to predict its first output")
        ids.append(np.concatenate([prompt, output]))
        # The logits at position t predict token t + 1: output token j is predicted at P - 1 + j.
        keep.append(cu[-1] + len(prompt) - 1 + np.arange(len(output)))
        targets.append(output)
        n_out.append(len(output))
        cu.append(cu[-1] + len(prompt) + len(output))
    return PackedRow(np.concatenate(ids), np.array(cu, dtype=np.int64), np.concatenate(keep),
                     np.concatenate(targets), n_out)


def kept_sequences(seqs: Sequence[Seq], token_data: dict[str, list[np.ndarray]], masks: list[np.ndarray],
                   skip: Sequence[bool] | None) -> tuple[list[Seq], dict[str, list[np.ndarray]], list[np.ndarray], int]:
    """The sequences a train step runs (those `skip` does not mark), their token data and masks,
    and the number of valid tokens skipped."""
    if skip is None or not any(skip):
        return list(seqs), token_data, masks, 0
    if len(skip) != len(seqs):
        raise ValueError(f"skip has {len(skip)} flags for {len(seqs)} sequences")
    keep = [i for i, s in enumerate(skip) if not s]
    skipped = sum(int(masks[i].sum()) for i, s in enumerate(skip) if s)
    return ([seqs[i] for i in keep], {k: [v[i] for i in keep] for k, v in token_data.items()},
            [masks[i] for i in keep], skipped)


def micro_batch_data(group: list[int], token_data: dict[str, list[np.ndarray]], masks: list[np.ndarray],
                     device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The loss function's per-token inputs and mask for the sequences `group`, packed in order."""
    batch = {k: to_device(np.concatenate([np.asarray(v[i]) for i in group]), device)
             for k, v in token_data.items() if k != LOSS_MASK_KEY}
    return batch, to_device(np.concatenate([masks[i] for i in group]), device)


def loss_masks(seqs: Sequence[Seq], token_data: dict[str, list[np.ndarray]]) -> list[np.ndarray]:
    """Checks token_data against the output lengths; returns the per-sequence bool masks."""
    for key, arrays in token_data.items():
        if len(arrays) != len(seqs):
            raise ValueError(f"token_data[{key!r}] has {len(arrays)} entries for {len(seqs)} sequences")
        for i, (a, (_, output)) in enumerate(zip(arrays, seqs)):
            if len(a) != len(output):
                raise ValueError(f"token_data[{key!r}][{i}] has {len(a)} values for {len(output)} output tokens")
    if LOSS_MASK_KEY in token_data:
        return [np.asarray(m, dtype=bool) for m in token_data[LOSS_MASK_KEY]]
    return [np.ones(len(output), dtype=bool) for _, output in seqs]


def global_counts(masks: list[np.ndarray], lengths: list[int], group: dist.ProcessGroup | None,
                  token_data: dict[str, list[np.ndarray]] | None = None) -> tuple[float, int, float]:
    """(valid tokens, prompt+output tokens, the loss denominator) summed over all ranks. The
    denominator is the valid-token count, or the sum of their LOSS_SHARE_KEY shares."""
    shares = (token_data or {}).get(LOSS_SHARE_KEY)
    denom = (sum(float(np.asarray(s, dtype=np.float64)[m].sum()) for s, m in zip(shares, masks)) if shares is not None
             else float(sum(int(m.sum()) for m in masks)))
    valid = sum(int(m.sum()) for m in masks)
    if group is None:  # nothing to reduce: the host's own numbers
        return float(valid), sum(lengths), denom
    counts = torch.tensor([valid, sum(lengths), denom], dtype=torch.float64)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    return float(counts[0]), int(counts[1]), float(counts[2])


# ---- statistics ---------------------------------------------------------------------------------


def accumulate_stats(into: dict[str, float], stats: dict) -> None:
    """Add `stats` into `into`: keys ending in _max (and grad_norm) keep the largest, others sum.
    Tensor values come to the host in one copy: a loss's statistics (the behaviour weight's
    histogram bins among them) would otherwise cost one device synchronisation each."""
    accumulate_all_stats(into, [stats])


def accumulate_all_stats(into: dict[str, float], all_stats: Sequence[dict]) -> None:
    """`accumulate_stats` of each of `all_stats` in order, with every tensor value of all of them
    brought to the host in ONE copy: an engine keeps its micro-batches' statistics on the device
    and reads them once per step, not once per micro-batch (each read is a device
    synchronisation: the host waits for the backward and the GPU for the next forward's launch).
    The same float64 values in the same order as one `accumulate_stats` per micro-batch."""
    where = [(i, k) for i, stats in enumerate(all_stats) for k, v in stats.items() if isinstance(v, torch.Tensor)]
    host_stats = [dict(stats) for stats in all_stats]
    if where:
        device = all_stats[where[0][0]][where[0][1]].device
        host = torch.stack([all_stats[i][k].detach().reshape(()).to(device, torch.float64) for i, k in where]).tolist()
        for (i, k), value in zip(where, host):
            host_stats[i][k] = value
    for stats in host_stats:
        _accumulate_host(into, stats)


def _accumulate_host(into: dict[str, float], stats: dict) -> None:
    for key, value in stats.items():
        value = float(value)
        if key not in into:
            into[key] = value
        elif key.endswith("_max") or key == "grad_norm":
            into[key] = max(into[key], value)
        else:
            into[key] += value


def merge_stats(sums: dict[str, float], group: dist.ProcessGroup | None) -> dict[str, float]:
    """Merges the ranks' stat sums (max for `_max` keys). A rank without data has no keys, so the
    dicts are gathered as objects rather than reduced as one tensor of agreed layout."""
    if group is None:
        return sums
    gathered: list[dict[str, float] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, sums, group=group)
    merged: dict[str, float] = {}
    for part in gathered:
        accumulate_stats(merged, part or {})
    return merged


# ---- checkpoints --------------------------------------------------------------------------------


def require_config(path: str) -> None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointError(f"{path}: no config.json (not a Hugging Face model directory)")


def check_hf_checkpoint(path: str, expected: dict[str, tuple[int, ...]], optional: tuple[str, ...] = ()) -> set[str]:
    """Fail with the file or tensor at fault when `path` does not hold exactly the tensors
    `expected` (Hugging Face name -> shape). `from_pretrained` alone would initialise a missing
    tensor at random with only a warning, and a wrong shape fails deep inside it. Names starting
    with one of `optional` may be absent (a value head the caller initialises). Returns the names
    the checkpoint holds."""
    from safetensors import safe_open

    require_config(path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weight file")
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for name in files:
        try:
            with safe_open(os.path.join(path, name), framework="pt") as f:
                for key in f.keys():
                    found[key] = (tuple(f.get_slice(key).get_shape()), name)
        except Exception as exc:  # safetensors raises its own error types for a truncated file
            raise CheckpointError(f"{path}/{name}: unreadable safetensors file: {exc}") from exc
    missing = sorted(k for k in set(expected) - set(found) if not k.startswith(optional))
    if missing:
        raise CheckpointError(f"{path}: tensor {missing[0]} is missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for key, shape in expected.items():
        if key in found and found[key][0] != tuple(shape):
            raise CheckpointError(f"{path}/{found[key][1]}: tensor {key} has shape {list(found[key][0])}, "
                                  f"the model's config wants {list(shape)}")
    return set(found)


def atomic_write_dir(path: str, write: Callable[[str], None]) -> None:
    """Runs write(tmp_dir) and moves tmp_dir to `path`; on any failure removes tmp_dir and re-raises.

    A failure leaves `path` as it was (absent, or the previous checkpoint). Replacing an existing
    directory takes two renames, so a reader racing the swap can briefly find nothing: publish to a
    new path per version when readers poll.
    """
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; a server running as another user must read it
    old = None
    try:
        write(tmp)
        if os.path.exists(path):
            old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
            os.rmdir(old)  # only the unique name is wanted: rename needs the target to not exist
            os.rename(path, old)
        os.rename(tmp, path)
    except BaseException:
        if old is not None and not os.path.exists(path):
            os.rename(old, path)  # put the previous checkpoint back
            old = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class SavedLayout:
    """What `save_pretrained` wrote for a model's weights, to write the same directory again
    without it: the bytes of every other file (config.json, generation_config.json) and the weight
    file's metadata. The config does not change while training; only the tensors do."""

    files: dict[str, bytes]
    metadata: dict[str, str] | None


def saved_layout(path: str, names: Sequence[str]) -> SavedLayout | None:
    """The layout of the Hugging Face directory `path` if its weights are one file holding exactly
    the tensors `names` (the model's own parameter names) and the rest are plain files; None
    otherwise: sharded, or renamed on saving (transformers converts some architectures' tensors
    back to their original checkpoint names, e.g. Mixtral's fused experts)."""
    from safetensors import safe_open

    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        return None
    with safe_open(weights, framework="pt") as f:
        if sorted(f.keys()) != sorted(names):
            return None
        metadata = f.metadata()
    files = {}
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if name == WEIGHTS_FILE:
            continue
        if not os.path.isfile(full):
            return None
        with open(full, "rb") as f:
            files[name] = f.read()
    return SavedLayout(files, metadata)


def write_like(tmp: str, layout: SavedLayout, state: dict[str, torch.Tensor]) -> None:
    """Write `state` into the directory `tmp` as `save_pretrained` wrote the directory of `layout`."""
    from safetensors.torch import save_file

    save_file({name: t.contiguous() for name, t in state.items()}, os.path.join(tmp, WEIGHTS_FILE),
              metadata=layout.metadata)
    for name, data in layout.files.items():
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(data)
