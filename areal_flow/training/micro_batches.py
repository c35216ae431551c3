"""Packing a step's sequences into micro-batches, the same way in every engine.

A micro-batch is the concatenation of whole sequences under the node's token budget
(first-fit-decreasing), and every data-parallel rank runs the same number of micro-batches
(`agreed_micro_batches`), because each forward and backward runs collectives. The loss is
normalised by the valid-token count of the whole global batch (`StepBatch`), so the SUM of the
ranks' gradients is the gradient of the global token mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from areal_flow.algorithms.packing import ffd_allocate
from areal_flow.runtime.devices import to_device
from areal_flow.training.engine import LOSS_MASK_KEY, LOSS_SHARE_KEY, Seq


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


@dataclass(frozen=True)
class StepBatch:
    """What one train step runs, and the global counts its loss is normalised by: the sequences
    `skip` does not mark, with their token data and loss masks; over every rank of the group, the
    valid tokens, the prompt + output tokens and the loss denominator (skipped sequences count)."""

    seqs: list[Seq]
    token_data: dict[str, list[np.ndarray]]
    masks: list[np.ndarray]
    skipped_tokens: int  # valid tokens of the skipped sequences, on this rank
    n_valid: float
    n_tokens: int
    denominator: float

    @property
    def loss_denominator(self) -> float:
        """The denominator the loss function gets: clamped, so that a step without valid tokens
        gives loss 0, not 0/0."""
        return max(self.denominator, 1.0)


def step_batch(seqs: Sequence[Seq], token_data: dict[str, list[np.ndarray]], skip: Sequence[bool] | None,
               group: dist.ProcessGroup | None) -> StepBatch:
    """The `StepBatch` of a train step's arguments (a collective over `group`: the counts)."""
    masks = loss_masks(seqs, token_data)
    n_valid, n_tokens, denominator = global_counts(masks, seq_lengths(seqs), group, token_data)
    kept, kept_data, kept_masks, skipped = kept_sequences(seqs, token_data, masks, skip)
    return StepBatch(kept, kept_data, kept_masks, skipped, n_valid, n_tokens, denominator)


def by_sequence_on_host(n_seqs: int, index: Sequence[int], tensors: Sequence[torch.Tensor],
                        sizes: Sequence[int]) -> list[np.ndarray]:
    """Per sequence, float32 values on the host: sequence `index[j]` gets the j-th run of `sizes[j]`
    values of `tensors` concatenated; a sequence not in `index` gets an empty array. One copy to the
    host for them all: a copy per sequence (or per micro-batch) is a device synchronisation each,
    and would keep the GPU idle while the host packs the next."""
    out: list[np.ndarray] = [np.zeros(0, np.float32)] * n_seqs
    if tensors:
        host = torch.cat([t.float() for t in tensors]).cpu().numpy()
        for i, part in zip(index, np.split(host, np.cumsum(sizes)[:-1])):
            out[i] = part
    return out
