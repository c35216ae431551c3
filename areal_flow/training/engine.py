"""The plain-PyTorch training engine: one data-parallel rank of a Hugging Face causal LM.

Per-node packing: the sequences of a micro-batch are concatenated into ONE row with no
padding, and `position_ids` restart at 0 for each sequence. Given `position_ids` and no
`attention_mask`, transformers' `masking_utils.find_packed_sequence_indices` detects the sequence
boundaries (a position that does not follow its predecessor by +1) and builds the block-diagonal
causal mask for whichever attention implementation is loaded (sdpa here; flash-attention turns the
same inputs into varlen kernels). Tests pin down that packed logprobs equal unpacked ones.

Data parallel is hand-written: each rank runs forward/backward on its own micro-batches and the
gradients are all-reduced once per step as one flat buffer. The loss is normalised by the global
valid-token count, so the SUM of the ranks' gradients is the gradient of the global token mean.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from areal_flow.algorithms.packing import ffd_allocate

Seq = tuple[np.ndarray, np.ndarray]
"""(prompt_ids, output_ids), 1-D integer arrays."""

LossFn = Callable[
    [torch.Tensor, dict[str, torch.Tensor], torch.Tensor, float],
    tuple[torch.Tensor, dict[str, torch.Tensor]],
]
"""loss_fn(logprobs [T_mb], batch {key: [T_mb]}, mask bool [T_mb], n_valid_tokens) -> (loss, stats)."""

LOSS_MASK_KEY = "loss_mask"
"""token_data key that, when present, is the per-output-token loss mask (default: all True)."""


class TorchEngine:
    """One data-parallel rank of a Hugging Face causal LM: logprobs, packed train steps, save."""

    def __init__(
        self,
        model_path: str,
        *,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        micro_batch_tokens: int = 4096,
        temperature: float = 1.0,
        trainable: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self._model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation="sdpa"
        )
        # Always eval mode: dropout would make the trained logprobs differ from the ones that
        # `logprobs` reports and that generation samples from.
        self._model.eval()
        self._model.requires_grad_(trainable)
        self.micro_batch_tokens = micro_batch_tokens
        self.temperature = temperature
        self.grad_clip = grad_clip
        self._group = process_group
        self._params = [p for p in self._model.parameters() if p.requires_grad]
        self._optimizer = (
            torch.optim.AdamW(self._params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
            if trainable
            else None
        )
        if self._group is not None:
            # Every rank loaded the same checkpoint; broadcasting rank 0's copy makes that a guarantee.
            flat = torch.cat([p.detach().reshape(-1) for p in self._model.parameters()])
            dist.broadcast(flat, src=dist.get_global_rank(self._group, 0), group=self._group)
            self._unflatten_into(flat, list(self._model.parameters()), grads=False)

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @property
    def rank(self) -> int:
        return 0 if self._group is None else dist.get_rank(self._group)

    # ------------------------------------------------------------------ forward

    def logprobs(self, seqs: Sequence[Seq]) -> list[np.ndarray]:
        """Per sequence, float32 logprobs [len(output_ids)] of each output token under
        log_softmax(logits / temperature); no grad, micro-batched under `micro_batch_tokens`."""
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(seqs)
        with torch.no_grad():
            for group in ffd_allocate(_lengths(seqs), self.micro_batch_tokens):
                if not group:
                    continue
                for i, lp in zip(group, self._packed_logprobs([seqs[i] for i in group])):
                    out[i] = lp.numpy().astype(np.float32)
        return out

    def _packed_logprobs(self, seqs: Sequence[Seq]) -> list[torch.Tensor]:
        """One packed forward over `seqs`. Returns, per sequence, logprobs [len(output_ids)]."""
        ids, positions, keep, targets, n_out = [], [], [], [], []
        offset = 0
        for prompt, output in seqs:
            prompt = np.asarray(prompt, dtype=np.int64)
            output = np.asarray(output, dtype=np.int64)
            if len(prompt) == 0:
                raise ValueError("every sequence needs at least one prompt token to predict its first output")
            n = len(prompt) + len(output)
            ids.append(np.concatenate([prompt, output]))
            positions.append(np.arange(n))
            # The logits at position t predict token t + 1: output token j is predicted at P - 1 + j.
            keep.append(offset + len(prompt) - 1 + np.arange(len(output)))
            targets.append(output)
            n_out.append(len(output))
            offset += n
        input_ids = torch.from_numpy(np.concatenate(ids))[None]
        position_ids = torch.from_numpy(np.concatenate(positions))[None]
        logits = self._model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,  # a cache would also switch off the packed-sequence detection
            logits_to_keep=torch.from_numpy(np.concatenate(keep)),  # lm_head only where needed
        ).logits[0]
        logits = logits.float() / self.temperature
        target = torch.from_numpy(np.concatenate(targets))
        # gather - logsumexp avoids materialising a second [T, vocab] log_softmax tensor.
        lp = logits.gather(-1, target[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
        return list(torch.split(lp, n_out))

    # ------------------------------------------------------------------ train

    def train_step(
        self, seqs: Sequence[Seq], token_data: dict[str, list[np.ndarray]], loss_fn: LossFn
    ) -> dict[str, float]:
        """One optimizer step over this rank's shard.

        token_data[key][i] is a per-output-token array for sequence i (behav_logprobs, advantages
        broadcast per token, ...), passed on with its dtype; the optional key "loss_mask" is the
        valid-token mask. Each micro-batch calls
        loss_fn(logprobs [T_mb], batch {key: [T_mb]}, mask [T_mb], n_valid_tokens)
        on its output tokens packed in one dimension, where n_valid_tokens counts the valid tokens
        of ALL ranks and micro-batches (at least 1).

        Returns loss_fn's stats and `loss`, summed over micro-batches and ranks (keys ending in
        `_max` take the max), plus grad_norm (before clipping), n_micro_batches (per rank, equal on
        all), n_tokens (prompt + output tokens, all ranks), n_valid_tokens and step_seconds.
        These engine keys take precedence over loss stats of the same name.
        """
        if self._optimizer is None:
            raise RuntimeError("train_step on an engine built with trainable=False")
        start = time.perf_counter()
        masks = self._loss_masks(seqs, token_data)
        lengths = _lengths(seqs)
        n_valid_global, n_tokens_global = self._global_counts(masks, lengths)
        groups = self._micro_batches(lengths)

        self._optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for group in groups:
            if not group:
                # Padding from an equalised count. Skipping it is safe: no collective runs per
                # micro-batch, only the one gradient all-reduce per step.
                continue
            logp = torch.cat(self._packed_logprobs([seqs[i] for i in group]))
            batch = {
                k: torch.from_numpy(np.concatenate([np.asarray(v[i]) for i in group]))
                for k, v in token_data.items()
                if k != LOSS_MASK_KEY
            }
            mask = torch.from_numpy(np.concatenate([masks[i] for i in group]))
            # Clamped so that a step without valid tokens gives loss 0, not 0/0.
            loss, stats = loss_fn(logp, batch, mask, max(n_valid_global, 1.0))
            loss.backward()
            accumulate_stats(sums, {"loss": loss.detach(), **stats})

        grad_norm = self._sync_and_step()
        sums = self._all_reduce_stats(sums)
        sums.update(
            grad_norm=grad_norm,
            n_micro_batches=float(len(groups)),
            n_tokens=float(n_tokens_global),
            n_valid_tokens=float(n_valid_global),
            step_seconds=time.perf_counter() - start,
        )
        return sums

    def _loss_masks(self, seqs: Sequence[Seq], token_data: dict[str, list[np.ndarray]]) -> list[np.ndarray]:
        """Checks token_data against the output lengths; returns the per-sequence bool masks."""
        for key, arrays in token_data.items():
            if len(arrays) != len(seqs):
                raise ValueError(f"token_data[{key!r}] has {len(arrays)} entries for {len(seqs)} sequences")
            for i, (a, (_, output)) in enumerate(zip(arrays, seqs)):
                if len(a) != len(output):
                    raise ValueError(
                        f"token_data[{key!r}][{i}] has {len(a)} values for {len(output)} output tokens"
                    )
        if LOSS_MASK_KEY in token_data:
            return [np.asarray(m, dtype=bool) for m in token_data[LOSS_MASK_KEY]]
        return [np.ones(len(output), dtype=bool) for _, output in seqs]

    def _global_counts(self, masks: list[np.ndarray], lengths: list[int]) -> tuple[float, int]:
        """(valid tokens, prompt+output tokens) summed over all ranks."""
        counts = torch.tensor([sum(int(m.sum()) for m in masks), sum(lengths)], dtype=torch.int64)
        if self._group is not None:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self._group)
        return float(counts[0]), int(counts[1])

    def _micro_batches(self, lengths: list[int]) -> list[list[int]]:
        """FFD micro-batches, the same number on every rank.

        Ranks whose natural count is below the largest re-run FFD with that count as min_groups,
        which spreads their sequences instead of adding empty passes. That can, rarely, make FFD
        need more groups than asked, so the ranks agree again until max == min. Every rank sees the
        same reduced values and so runs the same collectives. It terminates: the max only grows, and
        once it reaches a rank's number of sequences that rank returns exactly the max.
        """
        groups = ffd_allocate(lengths, self.micro_batch_tokens)
        if self._group is None:
            return groups
        while True:
            # One all-reduce yields both the max and (negated) the min of the counts.
            counts = torch.tensor([len(groups), -len(groups)], dtype=torch.int64)
            dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self._group)
            most, fewest = int(counts[0]), -int(counts[1])
            if most == fewest:
                return groups
            groups = ffd_allocate(lengths, self.micro_batch_tokens, min_groups=most)

    def _sync_and_step(self) -> float:
        """All-reduces gradients (SUM: the loss is already divided by the global count), clips, steps."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        if self._group is not None:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self._group)
            self._unflatten_into(flat, self._params, grads=True)
        else:
            for p, g in zip(self._params, grads):
                p.grad = g
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self._params, max_norm)
        self._optimizer.step()
        return float(grad_norm)

    @staticmethod
    def _unflatten_into(flat: torch.Tensor, params: list[torch.Tensor], *, grads: bool) -> None:
        offset = 0
        with torch.no_grad():
            for p in params:
                chunk = flat[offset : offset + p.numel()].view_as(p)
                if grads:
                    p.grad = chunk  # a view: the reduced buffer is the gradient, no second copy
                else:
                    p.copy_(chunk)
                offset += p.numel()

    def _all_reduce_stats(self, sums: dict[str, float]) -> dict[str, float]:
        """Merges the ranks' stat sums (max for `_max` keys). A rank without data has no keys, so
        the dicts are gathered as objects rather than reduced as one tensor of agreed layout."""
        if self._group is None:
            return sums
        gathered: list[dict[str, float] | None] = [None] * dist.get_world_size(self._group)
        dist.all_gather_object(gathered, sums, group=self._group)
        merged: dict[str, float] = {}
        for part in gathered:
            accumulate_stats(merged, part or {})
        return merged

    # ------------------------------------------------------------------ save

    def save_hf(self, path: str, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        """Writes a Hugging Face directory (safetensors + config [+ tokenizer]) at `path`, atomically.

        The files go to a temporary directory beside `path`, which then takes the place of `path`;
        a failure leaves `path` as it was (absent, or the previous checkpoint). Replacing an
        existing directory takes two renames, so a reader racing the swap can briefly find nothing:
        publish to a new path per version when readers poll. Not a collective: with data parallel
        the weights are identical on every rank, so call it on one rank (rank 0) only.
        """
        _atomic_write_dir(path, lambda tmp: self._write_hf(tmp, tokenizer))

    def save_weights(self, path: str) -> None:
        """save_hf without a tokenizer: publishes the current weights for generation, atomically."""
        self.save_hf(path)

    def _write_hf(self, directory: str, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self._model.save_pretrained(directory)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)


def _lengths(seqs: Sequence[Seq]) -> list[int]:
    return [len(prompt) + len(output) for prompt, output in seqs]


def accumulate_stats(into: dict[str, float], stats: dict) -> None:
    """Add `stats` into `into`: keys ending in _max (and grad_norm) keep the largest, others sum."""
    for key, value in stats.items():
        value = float(value)
        if key not in into:
            into[key] = value
        elif key.endswith("_max") or key == "grad_norm":
            into[key] = max(into[key], value)
        else:
            into[key] += value


def _atomic_write_dir(path: str, write: Callable[[str], None]) -> None:
    """Runs write(tmp_dir) and moves tmp_dir to `path`; on any failure removes tmp_dir and re-raises."""
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
