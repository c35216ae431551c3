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
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, PreTrainedTokenizerBase

from areal_flow.algorithms.packing import ffd_allocate
from areal_flow.metrics.profile import Phases
from areal_flow.runtime.disk import torch_save
from areal_flow.training import attention as attention_impl
from areal_flow.training.engine import (
    RANK_RNG,
    RESUMABLE_META,
    TRAIN_STATE,
    CheckpointError,
    LossFn,
    OptimSpec,
    SavedLayout,
    Seq,
    accumulate_all_stats,
    agreed_micro_batches,
    atomic_write_dir,
    bucketed,
    check_engine_args,
    check_hf_checkpoint,
    check_sharded_state,
    decays,
    global_counts,
    kept_sequences,
    loss_masks,
    merge_stats,
    micro_batch_data,
    non_finite_step,
    pack_row,
    read_rank_rng,
    read_resumable_meta,
    read_sharded_state,
    read_train_state,
    require_config,
    routed_forward,
    saved_layout,
    seq_lengths,
    to_device,
    write_like,
    write_sharded_state,
)
from areal_flow.training.logprobs import chunked_logprobs, full_logprobs
from areal_flow.training.schedule import lr_factor



HEADS = ("lm", "value")
VALUE_HEAD = "score."
"""The prefix of the value head's tensors (transformers' token-classification head, one label)."""
VALUE_CONFIG = {"num_labels": 1, "classifier_dropout": 0.0}
"""One value per token, and no dropout even when activation checkpointing runs the model in train mode."""


def model_class(head: str):
    """The transformers class of a head: the causal LM, or the same backbone with a scalar per token."""
    if head not in HEADS:
        raise ValueError(f"head must be one of {', '.join(HEADS)}, got {head!r}")
    return AutoModelForCausalLM if head == "lm" else AutoModelForTokenClassification


def model_config(model_path: str, head: str):
    config = AutoConfig.from_pretrained(model_path)
    if head == "value":
        for key, value in VALUE_CONFIG.items():
            setattr(config, key, value)
    return config


def expected_tensors(model_path: str, head: str = "lm") -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor a checkpoint of this config must hold (tied
    weights once), from a model built on the meta device: no memory, no initialisation."""
    require_config(model_path)
    with torch.device("meta"):
        model = model_class(head).from_config(model_config(model_path, head))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


class TorchEngine:
    """One data-parallel rank of a Hugging Face causal LM (or, with head="value", of the same
    backbone with a value head: a critic): per-token outputs, packed train steps, save/load."""

    def __init__(
        self,
        model_path: str,
        *,
        optim: OptimSpec | None = None,
        micro_batch_tokens: int = 4096,
        row_tokens: int | None = None,
        temperature: float = 1.0,
        process_group: dist.ProcessGroup | None = None,
        device: str = "cpu",
        bf16: bool = False,
        activation_checkpointing: bool = False,
        attention: str = "auto",
        head: str = "lm",
        logprob_chunk_tokens: int = 1024,
        entropy: bool = False,
    ) -> None:
        """`optim` None makes a frozen role (ref): logprobs only. `row_tokens` splits each
        micro-batch into rows of at most that many tokens, run as one [rows, length] call (None: one
        row per micro-batch; see `_packed_logprobs`). `bf16` computes in bfloat16 with
        fp32 master weights and fp32 gradient reduction (GPU); `activation_checkpointing` recomputes
        each decoder layer's activations in backward instead of keeping them (GPU memory);
        `attention` is how packed sequences attend (training/attention.py): "varlen" (flash
        attention over the sequences' boundaries on CUDA; a causal SDPA call per sequence
        elsewhere), "flex" (FlexAttention with a block mask), "sdpa" (transformers' own, a dense
        block-diagonal mask: the reference) or "auto", the fastest available on the device ("flex_attention",
        the older name, means flex); varlen and flex build no [T, T] mask.
        `logprob_chunk_tokens`: the LM head's logprobs are computed that many tokens at a time, never
        holding the [tokens, vocab] fp32 logits (0: one chunk; training/logprobs.py). `entropy`: train steps also compute each token's entropy and pass it
        to the loss function as batch["entropy"] (with its gradient)."""
        check_engine_args(micro_batch_tokens, temperature)
        self.attention = attention_impl.resolve(attention, device)
        if logprob_chunk_tokens < 0:
            raise ValueError(f"logprob_chunk_tokens must be >= 0 (0: one chunk), got {logprob_chunk_tokens}")
        # A critic may start from the actor's checkpoint, which has no value head: it starts at 0.
        held = check_hf_checkpoint(model_path, expected_tensors(model_path, head),
                                   optional=(VALUE_HEAD,) if head == "value" else ())
        model = model_class(head).from_pretrained(model_path, config=model_config(model_path, head), dtype=torch.float32,
                                                  attn_implementation=attention_impl.hf_implementation(self.attention))
        if head == "value" and not any(k.startswith(VALUE_HEAD) for k in held):
            with torch.no_grad():
                for p in model.score.parameters():
                    p.zero_()
        self.head = head
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.entropy = entropy
        self._routable_head = head == "lm" and routable_lm_head(model)
        model.to(device)
        # Always eval mode: dropout would make the trained logprobs differ from the ones that
        # `logprobs` reports and that generation samples from.
        model.eval()
        model.requires_grad_(optim is not None)
        if activation_checkpointing:
            if getattr(model.config, "attention_dropout", 0.0):
                raise ValueError("activation_checkpointing needs attention_dropout 0 (it runs the layers in train mode)")
            # The newer name where transformers has it (the older one warns there); 5.17, the GPU
            # image's, has only the older.
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.micro_batch_tokens = micro_batch_tokens
        self.row_tokens = row_tokens
        self.temperature = temperature
        self.device = torch.device(device)
        self.bf16 = bf16
        self.activation_checkpointing = activation_checkpointing
        self.version = 0
        self.phases = Phases()  # where train_step's time goes, reported with its stats
        self.optim = optim
        self._group = process_group if process_group is not None and dist.get_world_size(process_group) > 1 else None
        if self._group is not None:
            _shard(model, self._group, self.device.type, bf16)
        self._model = model
        self._weight_names = [name for name, _ in model.named_parameters()]  # tied weights once, as saved
        self._generation_layout: SavedLayout | None = None  # what the first save_weights wrote (rank 0)
        self._layout_checked = False
        self._nan_in_a_row = 0
        self.extra_state: dict = {}  # the caller's training state (e.g. an adaptive KL coefficient), saved with it
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        if optim is not None:
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in named if decays(n, p)], "weight_decay": optim.weight_decay},
                      {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}]
            # fused: one kernel over all parameters; torch's default on CPU is a Python loop over
            # them (3.6 ms a step for the default recipe's 51 tensors, fused 0.6 ms).
            self._optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=optim.lr,
                                                betas=tuple(optim.betas), eps=optim.eps, fused=True)
            self._scheduler = torch.optim.lr_scheduler.LambdaLR(self._optimizer, functools.partial(
                lr_factor, schedule=optim.schedule, warmup_steps=optim.warmup_steps,
                decay_steps=optim.decay_steps, min_ratio=optim.min_lr_ratio))

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
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(seqs)
        done: list[int] = []
        on_device: list[torch.Tensor] = []
        with torch.no_grad():
            for group in agreed_micro_batches(seq_lengths(seqs), self.micro_batch_tokens, self._group):
                if not group:
                    self._idle_pass(backward=False)
                    continue
                done += group
                on_device += self._packed_logprobs([seqs[i] for i in group])[0]
        # One copy to the host for the whole call: a copy per sequence (or per micro-batch) is a
        # device synchronisation each, and would keep the GPU idle while the host packs the next.
        if on_device:
            host = torch.cat([lp.float() for lp in on_device]).cpu().numpy()
            for i, lp in zip(done, np.split(host, np.cumsum([len(t) for t in on_device[:-1]]))):
                out[i] = lp
        return out

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
            if self.head == "value":  # the value of the state before each output token
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
            return full_logprobs(logits, target, temperature=self.temperature, entropy=entropy)
        lm_head = self._model.lm_head
        made: list[tuple[torch.Tensor, torch.Tensor | None]] = []

        def head(hidden: torch.Tensor) -> torch.Tensor:  # hidden [rows, len(columns), H]
            made.append(chunked_logprobs(hidden[picked], lm_head.weight, target, temperature=self.temperature,
                                         chunk_tokens=self.logprob_chunk_tokens, entropy=entropy, bias=lm_head.bias))
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
        self._model.train(self.activation_checkpointing and torch.is_grad_enabled())
        # With FSDP, bf16 is its mixed-precision policy; unsharded, autocast does the same.
        autocast = self.bf16 and self._group is None
        routed = contextlib.nullcontext() if head is None else routed_forward(self._model.lm_head, head)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=autocast), routed:
            if self.head == "value":  # one scalar per position: no need to pick the columns first
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
        return attention_impl.packed_forward_kwargs(positions, self.attention, self.device)

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
        masks = loss_masks(seqs, token_data)
        lengths = seq_lengths(seqs)
        n_valid_global, n_tokens_global, denominator = global_counts(masks, lengths, self._group, token_data)
        seqs, token_data, masks, skipped_tokens = kept_sequences(seqs, token_data, masks, skip)
        groups = agreed_micro_batches(seq_lengths(seqs), self.micro_batch_tokens, self._group)

        self._optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {"skipped_tokens": float(skipped_tokens)}
        pending: list[dict] = []  # each micro-batch's stats, on the device until the step's end
        for group in groups:
            if not group:
                self._idle_pass(backward=True)
                continue
            entropy = self.entropy and self.head == "lm"
            logps, entropies = self._packed_logprobs([seqs[i] for i in group], entropy=entropy)
            logp = torch.cat(logps)
            with self.phases("forward"):
                batch, mask = micro_batch_data(group, token_data, masks, self.device)
                if entropies is not None:  # the loss function reads it (with its gradient) or only reports it
                    batch["entropy"] = torch.cat(entropies)
                # Clamped so that a step without valid tokens gives loss 0, not 0/0.
                loss, stats = loss_fn(logp, batch, mask, max(denominator, 1.0))
            with self.phases("backward"):
                loss.backward()
            pending.append({k: v.detach() if isinstance(v, torch.Tensor) else v
                            for k, v in {"loss": loss, **stats}.items()})

        # Read once per step (one device synchronisation), in micro-batch order as before.
        accumulate_all_stats(sums, pending)
        lr = self.lr
        with self.phases("optimizer"):
            grad_norm, skipped = self._clip_and_step()
        sums = merge_stats(sums, self._group)
        # This rank's own phase timings (not summed over ranks), as step_seconds.
        sums.update(grad_norm=grad_norm, lr=lr, skipped_steps=float(skipped), n_micro_batches=float(len(groups)),
                    n_tokens=float(n_tokens_global), n_valid_tokens=float(n_valid_global),
                    step_seconds=time.perf_counter() - start, **self.phases.reset())
        return sums

    def _clip_and_step(self) -> tuple[float, bool]:
        """Clip to the global norm and step, or skip a non-finite step: (norm before clipping, skipped)."""
        params = [p for p in self._model.parameters() if p.requires_grad]
        for p in params:  # a parameter that no micro-batch reached (none on a rank) has no gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        max_norm = self.optim.grad_clip if self.optim.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        norm = float(_whole(norm))
        if not math.isfinite(norm):
            # Every rank sees the same global norm, so all of them skip together.
            self._optimizer.zero_grad(set_to_none=True)
            self._nan_in_a_row = non_finite_step(self._nan_in_a_row, self.optim.max_nan_steps)
            return norm, True
        self._nan_in_a_row = 0
        self._optimizer.step()
        self._scheduler.step()
        return norm, False

    # ------------------------------------------------------------------ weights out

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights on the CPU under Hugging Face names; collective under FSDP, where only
        rank 0 gets them (the others get {})."""
        if self._group is None:
            return {k: v.detach().cpu() for k, v in self._model.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self._model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def export_weights(self, bucket_bytes: int = 1 << 28) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The full weights under Hugging Face names (tied weights once), in buckets of at most
        `bucket_bytes` (a larger tensor travels alone), on every rank: for in-memory transfer to
        generation servers. Collective under FSDP: every rank must consume the whole iterator."""
        return bucketed(((name, _whole(p.detach())) for name, p in self._model.named_parameters()), bucket_bytes)

    def save_weights(self, path: str) -> None:
        """The current weights as a Hugging Face directory at `path` (atomically), for generation.
        Collective: every rank calls it; rank 0 writes.

        The first call writes through `save_pretrained`; the later ones write the same files again
        from what it wrote (the config files' bytes, the same tensor names) with safetensors
        directly. This runs on the trainer's path every step: `save_pretrained` spends 7 ms of a
        600k-parameter model's 10 ms converting names and serialising the config each time
        (docs/benchmarks.md). A model whose tensors `save_pretrained` renames keeps it."""
        state = self._full_state_dict()
        if self.rank == 0:
            layout = self._generation_layout
            if layout is not None:
                atomic_write_dir(path, lambda tmp: write_like(tmp, layout, {n: state[n] for n in self._weight_names}))
            else:
                atomic_write_dir(path, lambda tmp: self._model.save_pretrained(tmp, state_dict=state))
                if not self._layout_checked:
                    self._generation_layout = saved_layout(path, self._weight_names)
                    self._layout_checked = True
        if self._group is not None:
            dist.barrier(group=self._group)  # no rank goes on before the directory exists

    def save_hf(self, path: str, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        """A Hugging Face directory (weights, config, tokenizer) without training state."""
        self._save(path, tokenizer, with_train_state=False)

    def save(self, path: str, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        """A Hugging Face directory at `path` (atomically: a failure leaves the previous one) with
        TRAIN_STATE beside the weights: optimizer, LR schedule, each rank's RNG state, version.
        Collective: every rank calls it; rank 0 writes."""
        self._save(path, tokenizer, with_train_state=self._optimizer is not None)

    def _save(self, path: str, tokenizer: PreTrainedTokenizerBase | None, with_train_state: bool) -> None:
        state = self._full_state_dict()
        train_state = self._train_state() if with_train_state else None

        def write(tmp: str) -> None:
            self._model.save_pretrained(tmp, state_dict=state)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            if train_state is not None:
                torch_save(train_state, os.path.join(tmp, TRAIN_STATE))

        if self.rank == 0:
            atomic_write_dir(path, write)
        if self._group is not None:
            dist.barrier(group=self._group)  # no rank goes on before the checkpoint exists

    def _train_state(self) -> dict:
        rng = self._rng_state()
        rngs = [rng]
        if self._group is not None:
            rngs = [None] * dist.get_world_size(self._group)
            dist.all_gather_object(rngs, rng, group=self._group)
        # cpu_offload gathers onto rank 0 only, which needs a process group.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=self._group is not None)
        optimizer = get_optimizer_state_dict(self._model, self._optimizer, options=options)
        return {"optimizer": optimizer, "scheduler": self._scheduler.state_dict(), "version": self.version,
                "nan_in_a_row": self._nan_in_a_row, "extra": dict(self.extra_state), "rng": rngs}

    def _sharded_state(self) -> dict:
        """Model and optimizer state under Hugging Face names, as this rank holds them (DTensor
        shards under FSDP2): what `torch.distributed.checkpoint` saves and loads into, in place."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self._optimizer is None:
            return {"model": get_model_state_dict(self._model)}
        model, optimizer = get_state_dict(self._model, self._optimizer)
        return {"model": model, "optimizer": optimizer}

    def _rng_state(self) -> dict:
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return rng

    def _set_rng_state(self, rng: dict) -> None:
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)

    def save_resumable(self, path: str, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        """A resumable checkpoint in the folder `path` (the caller's temporary one, renamed when
        every rank is done, so it is written in place): the Hugging Face weights (and `tokenizer`)
        by rank 0, for the generation servers; SHARDED_STATE, the model and optimizer state written
        with `torch.distributed.checkpoint`, each rank its own shards (no rank holds the whole
        optimizer state); RANK_RNG by each rank; RESUMABLE_META by rank 0. Collective: every rank
        calls it and returns once all have written."""
        weights = self._full_state_dict()  # rank 0 only: the weights, never the optimizer state
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            self._model.save_pretrained(path, state_dict=weights)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
        del weights
        write_sharded_state(path, self._sharded_state(), self._group, alone=self._group is None)
        torch_save(self._rng_state(), os.path.join(path, RANK_RNG.format(rank=self.rank)))
        if self.rank == 0:
            torch_save({"engine": "torch", "world_size": self._world_size, "version": self.version,
                        "nan_in_a_row": self._nan_in_a_row, "extra": dict(self.extra_state),
                        "scheduler": None if self._scheduler is None else self._scheduler.state_dict()},
                       os.path.join(path, RESUMABLE_META))
        if self._group is not None:
            dist.barrier(group=self._group)  # no rank goes on before the checkpoint is whole

    @property
    def _world_size(self) -> int:
        return 1 if self._group is None else dist.get_world_size(self._group)

    # ------------------------------------------------------------------ weights in

    def load(self, path: str) -> None:
        """Load a checkpoint written by `save` (or any Hugging Face directory of this model's shape):
        the weights, and the training state when the directory has one and this role trains.
        Collective under FSDP. A missing or misshapen tensor fails naming it; nothing is changed then."""
        check_hf_checkpoint(path, {k: tuple(v.shape) for k, v in self._model.named_parameters()})
        from safetensors.torch import load_file

        weights: dict[str, torch.Tensor] = {}
        for name in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
            weights.update(load_file(os.path.join(path, name)))
        train_state = read_train_state(path) if self._optimizer is not None else None
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        set_model_state_dict(self._model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
        if train_state is not None:
            set_optimizer_state_dict(self._model, self._optimizer, train_state["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))
            self._scheduler.load_state_dict(train_state["scheduler"])
            self.version = train_state["version"]
            self._nan_in_a_row = train_state["nan_in_a_row"]
            self.extra_state = dict(train_state.get("extra", {}))
            rngs = train_state["rng"]
            if len(rngs) == self._world_size:
                self._set_rng_state(rngs[self.rank])

    def load_resumable(self, path: str) -> None:
        """Load a checkpoint written by `save_resumable`, at any number of ranks: the sharded
        model and optimizer state (torch.distributed.checkpoint reshards it onto this data-parallel
        size; each rank reads only what it holds), the LR schedule, version, non-finite count and
        extra state, and this rank's RNG when the number of ranks is the saved one. Collective
        under FSDP. A missing file or tensor, or a tensor of another shape, fails naming it
        before anything is changed."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        meta = read_resumable_meta(path, "torch")
        trains = self._optimizer is not None
        if trains and meta.get("scheduler") is None:
            raise CheckpointError(f"{os.path.join(path, RESUMABLE_META)}: a frozen role's checkpoint has no "
                                  "optimizer state to train on from")
        rng = read_rank_rng(path, self.rank) if meta["world_size"] == self._world_size else None
        state = self._sharded_state()  # for a fresh optimizer, its state initialised by a step at lr 0
        check_sharded_state(path, state)
        read_sharded_state(path, state, self._group, alone=self._group is None)
        if trains:
            set_state_dict(self._model, self._optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
            self._scheduler.load_state_dict(meta["scheduler"])
            self._nan_in_a_row = meta["nan_in_a_row"]
        else:
            set_model_state_dict(self._model, state["model"])
        self.version = meta["version"]
        self.extra_state = dict(meta.get("extra", {}))
        if rng is not None:
            self._set_rng_state(rng)


LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config keys of transformers models that change the logits after the LM head (Gemma's
soft-capping, Cohere's and Granite's scaling): their logprobs take the full path."""


def routable_lm_head(model: torch.nn.Module) -> bool:
    """Whether the causal LM's logits are its `lm_head` (a Linear) applied to the hidden states and
    nothing more, so that the head's call can be routed to `chunked_logprobs`."""
    configs = [model.config]
    if hasattr(model.config, "get_text_config"):
        configs.append(model.config.get_text_config())
    transforms = any(getattr(c, key, None) is not None for c in configs for key in LOGIT_TRANSFORMS)
    return isinstance(getattr(model, "lm_head", None), torch.nn.Linear) and not transforms


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of an FSDP-sharded DTensor (a collective), or `t` itself. torch.distributed
    (checkpoint, tensor) is imported only where it is used: it costs a second of every trainer's
    start, and without FSDP no tensor can be a DTensor."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.full_tensor() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


def _shard(model: torch.nn.Module, group: dist.ProcessGroup, device_type: str, bf16: bool) -> None:
    """FSDP2: each decoder layer is one unit (gathered for its own forward and freed after), the
    root holds the rest (embeddings, final norm, LM head)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = DeviceMesh.from_group(group, device_type)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    # SUM, not mean: the loss is already divided by the global token count. Forcing plain SUM
    # collectives keeps gloo working (it has no PREMUL_SUM); with a factor of 1 nothing is divided.
    # Both are per FSDP unit: set on every one, not only the root.
    for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
