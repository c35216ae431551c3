"""The torch engine: a Hugging Face causal LM on plain PyTorch, data parallel with FSDP2.

With a process group of more than one rank the model is sharded with
`torch.distributed.fsdp.fully_shard` (each decoder layer, then the root): parameters, gradients and
optimizer state are split across the ranks, and every forward and backward gathers and
reduce-scatters through the group (gloo on CPU, NCCL on GPU). Gradients are SUMMED across ranks
(`set_gradient_divide_factor(1)`), because the loss is already divided by the global valid-token
count. With one rank the model is used as it is.

Packing: the sequences of a micro-batch are concatenated into ONE row with no padding, and
`position_ids` restart at 0 for each sequence. Attention (`attention`, training/attention.py)
confines each token to its own sequence: varlen/flex get the sequences' boundaries from those
positions once per forward (no dense mask); "sdpa" leaves it to transformers, which builds a dense
block-diagonal causal mask from them. Tests pin packed == unpacked and every attention == sdpa.

Checkpoints and the weights' way out are torch_checkpoint.py, the model's building hf_model.py.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from areal_flow.algorithms.packing import ffd_allocate
from areal_flow.metrics.profile import Phases
from areal_flow.runtime.devices import to_device
from areal_flow.training import attention as attention_impl
from areal_flow.training import hf_attention, lora
from areal_flow.training.engine import EngineOptions, LossFn, OptimSpec, Seq, routed_forward
from areal_flow.training.hf_model import HEADS, build_optimizer, load_model, routable_lm_head, shard, whole
from areal_flow.training.logprobs import chunked_logprobs, full_logprobs
from areal_flow.training.micro_batches import (
    StepBatch,
    agreed_micro_batches,
    by_sequence_on_host,
    micro_batch_data,
    pack_row,
    seq_lengths,
    step_batch,
)
from areal_flow.training.lora import LoraSpec
from areal_flow.training.step_stats import accumulate_all_stats, merge_stats, step_report
from areal_flow.training.torch_checkpoint import TorchCheckpoints


@dataclass(frozen=True)
class TorchOptions(EngineOptions):
    """The torch engine's options beside every engine's."""

    row_tokens: int | None = None
    """Split each micro-batch into rows of at most this many tokens, run as one [rows, length] call
    (None: one row per micro-batch; see `TorchEngine._packed_logprobs`)."""
    head: str = "lm"
    """lm: the causal LM; value: the same backbone with a value head (a critic)."""
    lora: LoraSpec | None = None
    """Train low-rank adapters (training/lora.py) instead of every weight; None: every weight."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head not in HEADS:
            raise ValueError(f"head must be one of {', '.join(HEADS)}, got {self.head!r}")


class TorchEngine(TorchCheckpoints):
    """One data-parallel rank of a Hugging Face causal LM (or, with head="value", of the same
    backbone with a value head: a critic): per-token outputs, packed train steps, save/load
    (torch_checkpoint.py)."""

    def __init__(self, model_path: str, *, optim: OptimSpec | None = None,
                 process_group: dist.ProcessGroup | None = None, **options) -> None:
        """`optim` None makes a frozen role (ref): logprobs only. `process_group` of more than one
        rank shards the model with FSDP2 over it. `options` are `TorchOptions`' fields: with `bf16`
        FSDP's mixed precision (sharded) or autocast (alone) computes in bfloat16 over fp32 master
        weights; `attention` "auto" is the fastest available on the device ("flex_attention", the
        older name, means flex); varlen and flex build no [T, T] mask."""
        opts = TorchOptions(**options)
        super().__init__(opts, optim)
        self.attention = attention_impl.resolve(opts.attention, opts.device)
        model = load_model(model_path, opts.head, hf_attention.hf_implementation(self.attention), opts.device,
                           trains=optim is not None, activation_checkpointing=opts.activation_checkpointing)
        self._model_path = model_path
        self._lora = opts.lora if optim is not None else None  # a frozen role has nothing to adapt
        if self._lora is not None:
            lora.inject(model, self._lora)  # before sharding: FSDP2 shards the adapters with their layers
        # Dropout on the adapters' input in the train step's forwards only (the model runs in eval mode).
        self._lora_dropouts = [m for n, m in model.named_modules() if ".lora_dropout." in f".{n}."
                               and isinstance(m, torch.nn.Dropout)]
        self._routable_head = opts.head == "lm" and routable_lm_head(model)
        self.row_tokens = opts.row_tokens  # like micro_batch_tokens, a graph node may change it
        self.device = torch.device(opts.device)
        self.phases = Phases()  # where train_step's time goes, reported with its stats
        self._group = process_group if process_group is not None and dist.get_world_size(process_group) > 1 else None
        if self._group is not None:
            shard(model, self._group, self.device.type, opts.bf16)
        self._model = model
        # Tied weights once, as saved; with adapters, the names of the model they merge into.
        self._weight_names = [lora.hf_name(name) for name, _ in model.named_parameters() if not lora.is_adapter(name)]
        self._generation_layout = None  # what the first save_weights wrote (rank 0)
        self._layout_checked = False
        self._optimizer, self._scheduler = build_optimizer(model, optim) if optim is not None else (None, None)

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @property
    def rank(self) -> int:
        return 0 if self._group is None else dist.get_rank(self._group)

    data_leader = True  # every rank trains its own data

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """The ranks that share the batch between them (None: this rank alone)."""
        return self._group

    def data_parallel_batch(self, items: list) -> list:
        return items

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step will use."""
        return self._optimizer.param_groups[0]["lr"] if self._optimizer else 0.0

    # ------------------------------------------------------------------ forward

    def logprobs(self, seqs: Sequence[Seq]) -> list[np.ndarray]:
        """Per sequence, float32 logprobs [len(output_ids)] of each output token under
        log_softmax(logits / temperature) (the value head: the value of the state before each);
        no grad, micro-batched under `micro_batch_tokens`."""
        done: list[int] = []
        on_device: list[torch.Tensor] = []
        with torch.no_grad():
            for group in agreed_micro_batches(seq_lengths(seqs), self.micro_batch_tokens, self._group):
                if not group:
                    self._idle_pass(backward=False)
                    continue
                done += group
                on_device += self._packed_logprobs([seqs[i] for i in group])[0]
        return by_sequence_on_host(len(seqs), done, on_device, [len(t) for t in on_device])

    def _packed_logprobs(self, seqs: Sequence[Seq], entropy: bool = False
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """One packed forward over `seqs`. Returns, per sequence, logprobs [len(output_ids)], and with
        `entropy` the entropy of each of those tokens' distributions (else None). They stay separate
        tensors: an entropy the loss does not differentiate costs no backward work.

        Without `row_tokens` the sequences are one row. With it they are packed first-fit-decreasing
        into rows of at most `row_tokens` (a longer sequence gets a row of its own), stacked into one
        [rows, length] call. A shorter row is filled at its end with a dummy sequence: attention is
        causal, so no real token sees it, and its positions restart at 0, so transformers' packed
        detection keeps it a sequence of its own; no padding mask is needed. Why rows: with a dense
        block-diagonal mask (sdpa on CPU) attention costs the square of the row length, and each
        call has a fixed cost, so several short rows per call beat one long row or many calls
        (docs/benchmarks.md). On GPU, flash-attention varlen makes one long row the fast path.
        """
        with self.phases("packing"):
            lengths = seq_lengths(seqs)
            rows = ffd_allocate(lengths, self.row_tokens) if self.row_tokens and sum(lengths) > self.row_tokens \
                else [list(range(len(seqs)))]
            packed = [pack_row([seqs[i] for i in row]) for row in rows]
            width = max(len(r.ids) for r in packed)
            ids = np.zeros((len(rows), width), np.int64)
            positions = np.zeros((len(rows), width), np.int64)
            for r, row in enumerate(packed):
                n = len(row.ids)
                ids[r, :n] = row.ids
                positions[r, :n] = row.positions
                positions[r, n:] = np.arange(width - n)  # the dummy sequence
            # Logits only at the columns some row needs: transformers' logits_to_keep picks columns.
            keep_rows = np.concatenate([np.full(len(r.keep), i) for i, r in enumerate(packed)])
            keep_cols = np.concatenate([r.keep for r in packed])
            columns = np.unique(keep_cols)
        with self.phases("forward"):
            picked = (to_device(keep_rows, self.device), to_device(np.searchsorted(columns, keep_cols), self.device))
            if self.options.head == "value":  # the value of the state before each output token
                lp, ent = self._forward(ids, positions, columns)[picked][:, 0].float(), None
            else:
                target = to_device(np.concatenate([r.targets for r in packed]), self.device)
                lp, ent = self._lm_logprobs(ids, positions, columns, picked, target, entropy)
        order = [i for row in rows for i in row]
        sizes = [n for r in packed for n in r.n_out]

        def by_seq(t: torch.Tensor) -> list[torch.Tensor]:
            split = dict(zip(order, torch.split(t, sizes)))
            return [split[i] for i in range(len(seqs))]

        return by_seq(lp), None if ent is None else by_seq(ent)

    def _lm_logprobs(self, ids: np.ndarray, positions: np.ndarray, columns: np.ndarray,
                     picked: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor, entropy: bool
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs [K] of `target` at the kept positions `picked` (row, index into `columns`) under
        log_softmax(logits / temperature), and with `entropy` the entropy [K] of each (else None).

        The LM head is routed to `chunked_logprobs` for the duration of the model's forward: inside it
        FSDP has gathered the head's weight (a sharded DTensor outside) and autocast is on, and the
        gradient reaches the weight (the embedding's, when tied). So the [K, vocab] fp32 logits are
        never held, only chunks of `logprob_chunk_tokens` (training/logprobs.py). A model that
        transforms its logits after the head (soft-capping, scaling) takes the full path."""
        if not self._routable_head:
            logits = self._forward(ids, positions, columns)[picked]
            return full_logprobs(logits, target, temperature=self.options.temperature, entropy=entropy)
        lm_head = self._model.lm_head
        made: list[tuple[torch.Tensor, torch.Tensor | None]] = []

        def head(hidden: torch.Tensor) -> torch.Tensor:  # hidden [rows, len(columns), H]
            made.append(chunked_logprobs(hidden[picked], lm_head.weight, target, temperature=self.options.temperature,
                                         chunk_tokens=self.options.logprob_chunk_tokens, entropy=entropy, bias=lm_head.bias))
            return made[-1][0]  # the model's output; the entropy comes beside it, not through it

        out = self._forward(ids, positions, columns, head=head)
        if not made or out is not made[-1][0]:  # the model changed what its head returned
            raise RuntimeError(f"{type(self._model).__name__} transforms the output of its lm_head; the chunked "
                               "logprobs cannot be routed through it (routable_lm_head should have said so)")
        return made[-1]

    def _forward(self, ids: np.ndarray, positions: np.ndarray, keep: np.ndarray | None,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [rows, len(keep), vocab] of packed rows [rows, length] (all columns when keep is None);
        the value head's [rows, len(keep), 1]. With `head`, the LM head's forward is `head` for this
        call: what it returns of the hidden states [rows, len(keep), H] is returned instead."""
        as_tensor = functools.partial(to_device, device=self.device)  # no synchronisation on CUDA
        # Activation checkpointing in transformers works in train mode only (no dropout here).
        self._model.train(self.options.activation_checkpointing and torch.is_grad_enabled())
        for dropout in self._lora_dropouts:
            dropout.train(torch.is_grad_enabled())
        # With FSDP, bf16 is its mixed-precision policy; unsharded, autocast does the same.
        autocast = self.options.bf16 and self._group is None
        routed = contextlib.nullcontext() if head is None else routed_forward(self._model.lm_head, head)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast), routed:
            if self.options.head == "value":  # one scalar per position: no need to pick the columns first
                out = self._model(input_ids=as_tensor(ids), position_ids=as_tensor(positions), use_cache=False,
                                  **self._attention_kwargs(positions)).logits
                return out if keep is None else out[:, as_tensor(keep)]
            return self._model(
                input_ids=as_tensor(ids),
                position_ids=as_tensor(positions),
                use_cache=False,  # a cache would also switch off the packed-sequence detection
                logits_to_keep=0 if keep is None else as_tensor(keep),  # lm_head only where needed
                **self._attention_kwargs(positions),
            ).logits

    def _attention_kwargs(self, positions: np.ndarray) -> dict:
        """The packed attention's per-forward metadata (the sequences' boundaries, from the restarted
        positions; flex: its block mask), built once and handed to every layer; none for sdpa."""
        return hf_attention.packed_forward_kwargs(positions, self.attention, self.device)

    def _idle_pass(self, backward: bool) -> None:
        """A one-token pass with no effect, on a rank with fewer sequences than the agreed number of
        micro-batches: under FSDP every forward and backward runs collectives all ranks must join."""
        if self._group is None:
            return
        logits = self._forward(np.zeros((1, 1), np.int64), np.zeros((1, 1), np.int64), None)
        if backward:
            (logits.float().sum() * 0.0).backward()

    # ------------------------------------------------------------------ train

    def train_step(self, seqs: Sequence[Seq], token_data: dict[str, list[np.ndarray]], loss_fn: LossFn,
                   skip: Sequence[bool] | None = None) -> dict[str, float]:
        """One optimizer step over this rank's shard.

        token_data[key][i] is a per-output-token array for sequence i (behav_logprobs, advantages
        broadcast per token, ...), passed on with its dtype; the optional key "loss_mask" is the
        valid-token mask. Each micro-batch calls
        loss_fn(logprobs [T_mb], batch {key: [T_mb]}, mask [T_mb], n_valid_tokens)
        on its output tokens packed in one dimension, where n_valid_tokens is the loss denominator:
        the valid tokens of ALL ranks and micro-batches (at least 1), or the sum of their shares
        under "loss_share" (engine.LOSS_SHARE_KEY); gradients accumulate over the micro-batches.
        Sequences marked in `skip` (whose loss terms and gradients are exactly 0: library.zero_gradient)
        count in that denominator and in n_tokens but are not run; `skipped_tokens` counts their valid tokens.

        A step whose gradient norm is not finite (a NaN or inf loss) changes nothing: it is skipped
        and counted (`skipped_steps`); `optim.max_nan_steps` of them in a row raise NonFiniteLoss.

        Returns loss_fn's stats and `loss`, summed over micro-batches and ranks (keys ending in
        `_max` take the max), plus grad_norm (before clipping), lr, skipped_steps,
        n_micro_batches (per rank, equal on all), n_tokens (prompt + output tokens, all ranks),
        n_valid_tokens and step_seconds. These engine keys take precedence over loss stats.
        """
        if self._optimizer is None:
            raise RuntimeError("train_step on an engine built without optim (a frozen role)")
        start = time.perf_counter()
        self.phases.reset()  # logprobs() calls since the last step are not this step's
        batch = step_batch(seqs, token_data, skip, self._group)
        groups = agreed_micro_batches(seq_lengths(batch.seqs), self.micro_batch_tokens, self._group)

        self._optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {"skipped_tokens": float(batch.skipped_tokens)}
        pending: list[dict] = []  # each micro-batch's stats, on the device until the step's end
        for group in groups:
            if not group:
                self._idle_pass(backward=True)
                continue
            pending.append(self._micro_batch_pass(group, batch, loss_fn))

        # Read once per step (one device synchronisation), in micro-batch order as before.
        accumulate_all_stats(sums, pending)
        lr = self.lr
        with self.phases("optimizer"):
            grad_norm, skipped = self._clip_and_step()
        return step_report(merge_stats(sums, self._group), batch, grad_norm=grad_norm, lr=lr, skipped=skipped,
                           n_micro_batches=len(groups), start=start, phases=self.phases)

    def _micro_batch_pass(self, group: list[int], batch: StepBatch, loss_fn: LossFn) -> dict:
        """Forward, loss and backward of the sequences `group` of `batch`; the loss function's stats
        (and `loss`), still on the device."""
        entropy = self.options.entropy and self.options.head == "lm"
        logps, entropies = self._packed_logprobs([batch.seqs[i] for i in group], entropy=entropy)
        logp = torch.cat(logps)
        with self.phases("forward"):
            data, mask = micro_batch_data(group, batch.token_data, batch.masks, self.device)
            if entropies is not None:  # the loss function reads it (with its gradient) or only reports it
                data["entropy"] = torch.cat(entropies)
            loss, stats = loss_fn(logp, data, mask, batch.loss_denominator)
        with self.phases("backward"):
            loss.backward()
        return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in {"loss": loss, **stats}.items()}

    def _clip_and_step(self) -> tuple[float, bool]:
        """Clip to the global norm and step, or skip a non-finite step: (norm before clipping, skipped)."""
        params = [p for p in self._model.parameters() if p.requires_grad]
        for p in params:  # a parameter that no micro-batch reached (none on a rank) has no gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        max_norm = self.optim.grad_clip if self.optim.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        norm = float(whole(norm))
        if not math.isfinite(norm):
            # Every rank sees the same global norm, so all of them skip together.
            self._optimizer.zero_grad(set_to_none=True)
            self._count_non_finite()
            return norm, True
        self._nan_in_a_row = 0
        self._optimizer.step()
        self._scheduler.step()
        return norm, False
