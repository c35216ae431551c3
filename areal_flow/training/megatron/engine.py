"""The megatron engine: megatron-core GPTModel with tensor, pipeline and data parallelism.

Every rank of the default process group is one rank of a dp x pp x tp layout (megatron's
`parallel_state`, one layout per process). The ranks of one model-parallel group (same DP index)
must be given the SAME sequences: TP ranks split each layer, PP ranks split the layers, and the
first stage embeds the tokens while the last computes the loss. Different DP ranks get different
sequences and any number of them: gradients are summed over DP once per step by megatron's
DistributedDataParallel (`finalize_model_grads`), not in every forward as under FSDP.

A micro-batch is packed in megatron's THD layout: the sequences concatenated in one row, with
`PackedSeqParams` giving their boundaries, so attention and RoPE restart at each sequence
(model.py). Micro-batches are run by megatron's schedules: forward-only for logprobs, 1F1B when
pipelined; with several stages the activations of variable-length micro-batches travel with their
shapes. Logprobs of the output tokens are computed from the final hidden states in chunks of
tokens over each rank's vocabulary shard (training/logprobs.py, `vocab_parallel_logprobs`), in place
of the output layer: neither the [tokens, vocab/tp] logits nor their gathering across TP ranks.

Weights enter and leave as Hugging Face tensors (weights.py, convert.py): `load` and the
constructor read a Hugging Face directory on every rank, `export_weights` and `save` gather the
shards (TP) and stages (PP) under Hugging Face names (checkpoint.py). The fast path is a set of
options (`MegatronOptions`), each running on a GPU and on the CPU alike (tests:
tests/training/test_megatron_fast_path.py). Every step clips with megatron's gradient norm and
clipping (over TP, PP and the distributed optimizer's shards), and a step whose norm is not
finite on some rank is skipped on all of them (optimizer.py).

On a machine without a GPU each call runs inside `cpu_compat.cpu_mode()`; docs/architecture.md
("Training engines") says what that changes.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from transformers import AutoConfig

from areal_flow.algorithms.packing import ffd_allocate
from areal_flow.graph.layout import Layout, layout_problems
from areal_flow.metrics.profile import Phases
from areal_flow.training.checkpoint_files import check_hf_checkpoint
from areal_flow.training.engine import EngineOptions, LossFn, OptimSpec, Seq, routed_forward
from areal_flow.training.hf_model import expected_tensors
from areal_flow.training.logprobs import vocab_parallel_logprobs
from areal_flow.training.megatron.checkpoint import MegatronCheckpoints
from areal_flow.training.megatron.cpu_compat import cpu_mode, seed_rng_tracker
from areal_flow.training.megatron.model import build_model, check_hf_config, init_parallel, transformer_config
from areal_flow.training.megatron.optimizer import step_clipped, wrap_for_training
from areal_flow.training.megatron.weights import HfWeights
from areal_flow.training.micro_batches import (
    by_sequence_on_host,
    check_budget,
    micro_batch_data,
    pack_row,
    seq_lengths,
    step_batch,
)
from areal_flow.training.schedule import lr_factor
from areal_flow.training.step_stats import accumulate_stats, merge_stats, step_report


@dataclass(frozen=True)
class MegatronOptions(EngineOptions):
    """The megatron engine's options beside every engine's. There `bf16` is megatron's mixed
    precision: parameters and compute in bfloat16 (Float16Module), gradients reduced and
    accumulated in fp32 buffers (`main_grad`), fp32 master weights in the optimizer, which the
    checkpoints' optimizer state keeps (exported weights are the bf16 parameters, as fp32); and
    `activation_checkpointing` full recomputation, one layer at a time, in training passes."""

    tp: int = 1
    """Tensor-parallel size: each layer split over this many ranks."""
    pp: int = 1
    """Pipeline-parallel size: the layers split into this many stages (dp is what remains)."""
    distributed_optimizer: bool = False
    """megatron's DistributedOptimizer: the Adam state and master weights sharded over the DP ranks
    (gradients reduce-scattered, parameters all-gathered after the step). Checkpoints keep each
    rank's shard, so they resume on the same layout and options only."""
    sequence_parallel: bool = False
    """The activations outside the tensor-parallel layers split over the sequence across the TP
    ranks (needs tp > 1); each packed row is padded to a multiple of tp with a dummy sequence of
    its own."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel=True needs tensor parallelism (tp > 1); this layout has tp=1 "
                             "(sequence parallelism splits the activations over the TP ranks)")


SEED = 1234
"""The seed of megatron's model-parallel RNG tracker, which the initialisation draws from."""


class MegatronEngine(MegatronCheckpoints):
    """One rank of a Hugging Face Qwen2/Llama model on megatron-core: logprobs, train steps,
    save/load (checkpoint.py)."""

    def __init__(self, model_path: str, *, optim: OptimSpec | None = None, **options) -> None:
        """`optim` None makes a frozen role (ref). `options` are `MegatronOptions`' fields."""
        opts = MegatronOptions(**options)
        super().__init__(opts, optim)
        self.device = torch.device(opts.device)
        self._compat = cpu_mode if self.device.type == "cpu" else contextlib.nullcontext
        self.expected = expected_tensors(model_path)
        check_hf_checkpoint(model_path, self.expected)
        self.hf_config = AutoConfig.from_pretrained(model_path)
        check_hf_config(self.hf_config, f"{model_path}/config.json")
        problems = layout_problems(Layout(tp=opts.tp, pp=opts.pp), n_devices=None, model=self.hf_config,
                                   where=model_path)
        if problems:
            raise ValueError("; ".join(problems))
        self._step = 0
        self._distributed = opts.distributed_optimizer and optim is not None
        # What the optimizer state holds, saved with it: a resume must build the same optimizer.
        self._optimizer_kind = {"distributed_optimizer": self._distributed, "bf16": opts.bf16}
        with self._compat():
            self._join_layout(opts)
            model = self._build(model_path, opts)
            model.requires_grad_(optim is not None)
            self._optimizer = None
            if optim is not None:
                model, self._optimizer = wrap_for_training(model, self.config, optim, bf16=opts.bf16,
                                                           distributed=self._distributed)
            model.eval()  # no dropout: trained logprobs must equal reported ones
            self._model = model
            self._weights.share_owners(self._pp_group)

    def _join_layout(self, opts: MegatronOptions) -> None:
        """megatron's process groups for this layout, and this rank's place in them."""
        self.layout = init_parallel(opts.tp, opts.pp)
        self._dp_group = ps.get_data_parallel_group()
        self._dp_rank = ps.get_data_parallel_rank()
        self._tp_group = ps.get_tensor_model_parallel_group()
        self._pp_group = ps.get_pipeline_model_parallel_group()
        self._mp_group = ps.get_model_parallel_group()
        self._first, self._last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()

    def _build(self, model_path: str, opts: MegatronOptions) -> torch.nn.Module:
        """This rank's part of the model with the weights of `model_path` (in Float16Module with bf16)."""
        self.config = transformer_config(self.hf_config, tp=opts.tp, pp=opts.pp, bf16=opts.bf16,
                                         on_gpu=self.device.type == "cuda", recompute=opts.activation_checkpointing,
                                         sequence_parallel=opts.sequence_parallel)
        if self.device.type == "cuda":
            tensor_parallel.model_parallel_cuda_manual_seed(SEED)  # the GPU initialisation draws from it
        else:
            seed_rng_tracker(SEED)  # the same tracker states (sequence parallelism forks them), on the CPU
        model = build_model(self.hf_config, self.config, pre_process=self._first, post_process=self._last,
                            attention=opts.attention)
        model.to(self.device)
        self._weights = HfWeights(model, self.hf_config, self.layout, self.expected, self._compat)
        self._weights.load(model_path)
        self._gpt = model  # the GPTModel inside the wrappers
        # bf16 parameters (the same Parameter objects)
        return Float16Module(self.config, model) if opts.bf16 else model

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: ranks with the same index must be given the same data."""
        return self._dp_rank

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """The ranks that share the batch between them (one per model-parallel group)."""
        return self._dp_group

    @property
    def data_leader(self) -> bool:
        """The first rank of its model-parallel group (TP rank 0 of the first stage)."""
        return ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0

    def data_parallel_batch(self, items: list) -> list:
        """The union of what the ranks of this model-parallel group were given, in rank order:
        they must train the same sequences. Collective over the group."""
        if self.layout.tp * self.layout.pp == 1:
            return items
        parts: list[list | None] = [None] * (self.layout.tp * self.layout.pp)
        dist.all_gather_object(parts, items, group=self._mp_group)
        return [item for part in parts for item in part]

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step will use."""
        if self.optim is None:
            return 0.0
        return self.optim.lr * lr_factor(self._step, self.optim.schedule, self.optim.warmup_steps,
                                         self.optim.decay_steps, self.optim.min_lr_ratio)

    # ------------------------------------------------------------------ forward

    def logprobs(self, seqs: Sequence[Seq]) -> list[np.ndarray]:
        """Per sequence, float32 logprobs [len(output_ids)] of each output token under
        log_softmax(logits / temperature), on every rank (computed on the last pipeline stage)."""
        with self._compat(), torch.no_grad():
            micro = self._micro_batches(seqs, None, None)
            results = self._run(micro, forward_only=True, loss_fn=None, n_valid=1.0)
            out = by_sequence_on_host(len(seqs), [i for mb in micro for i in mb["index"]],
                                      [res["logprobs"] for res in results] if self._last else [],
                                      [n for mb in micro for n in mb["n_out"]])
            if self.layout.pp > 1:
                box = [out]
                dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(), group=self._pp_group)
                out = box[0]
            return out

    def _micro_batches(self, seqs: Sequence[Seq], token_data: dict | None, masks: list[np.ndarray] | None) -> list[dict]:
        """Packed micro-batches (first-fit-decreasing under the token budget) in THD layout."""
        lengths = seq_lengths(seqs)
        check_budget(lengths, self.micro_batch_tokens)
        batches = []
        for group in ffd_allocate(lengths, self.micro_batch_tokens):
            if not group:  # no sequences (every answer skipped): nothing to run
                continue
            row = pack_row([seqs[i] for i in group])
            ids, cu_seqlens, pad = self._sequence_parallel_padding(row.ids, row.cu_seqlens)
            as_tensor = partial(torch.as_tensor, device=self.device)
            mb = {"index": group, "n_out": row.n_out, "ids": as_tensor(ids),
                  "cu_seqlens": as_tensor(cu_seqlens, dtype=torch.int32),
                  "max_len": max(pad, *(lengths[i] for i in group)), "keep": as_tensor(row.keep),
                  "targets": as_tensor(row.targets)}
            if token_data is not None:
                mb["batch"], mb["mask"] = micro_batch_data(group, token_data, masks, self.device)
            batches.append(mb)
        return batches

    def _sequence_parallel_padding(self, ids: np.ndarray, cu_seqlens: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """With sequence parallelism the row is split evenly over the TP ranks, so its length must be a
        multiple of tp: padded with a dummy sequence of its own at the end (no real token attends to
        it, none of its tokens is kept). (ids, cu_seqlens, padding length)."""
        pad = -len(ids) % self.layout.tp if self.config.sequence_parallel else 0
        if not pad:
            return ids, cu_seqlens, 0
        return np.concatenate([ids, np.zeros(pad, ids.dtype)]), np.append(cu_seqlens, cu_seqlens[-1] + pad), pad

    @contextlib.contextmanager
    def _recomputing(self, forward_only: bool) -> Iterator[None]:
        """megatron recomputes activations only in a TransformerBlock in training mode; the engine keeps
        its model in eval mode, so a training pass sets the flag of the block alone (its layers stay in
        eval mode: no dropout, as ever)."""
        block = self._gpt.decoder
        block.training = self.options.activation_checkpointing and not forward_only
        try:
            yield
        finally:
            block.training = False

    def _run(self, micro: list[dict], *, forward_only: bool, loss_fn: LossFn | None, n_valid: float) -> list[dict]:
        """Megatron's schedule over the micro-batches; the last stage's per-micro-batch results."""
        if not micro:
            return []
        with self._recomputing(forward_only):
            return get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, loss_fn=loss_fn, n_valid=n_valid),
                data_iterator=iter(micro),
                model=[self._model],
                num_microbatches=len(micro),
                seq_length=max(len(mb["ids"]) for mb in micro),
                micro_batch_size=1,
                forward_only=forward_only,
            )

    def _forward_step(self, data_iterator, model, *, loss_fn: LossFn | None, n_valid: float):
        mb = next(data_iterator)
        total = len(mb["ids"])
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=mb["cu_seqlens"], cu_seqlens_kv=mb["cu_seqlens"],
                                 max_seqlen_q=mb["max_len"], max_seqlen_kv=mb["max_len"])
        positions = torch.arange(total, device=self.device)[None]  # unused by RoPE in THD (it restarts per sequence)
        # On the last stage the output layer's place is taken by the logprobs of this micro-batch.
        routed = routed_forward(self._gpt.output_layer, partial(self._output_logprobs, self._gpt.output_layer, mb)) \
            if self._last else contextlib.nullcontext()
        with routed:
            output = model(input_ids=mb["ids"][None], position_ids=positions, attention_mask=None,
                           packed_seq_params=packed)
        return output, partial(self._loss, mb, loss_fn=loss_fn, n_valid=n_valid)

    def _output_logprobs(self, layer: torch.nn.Module, mb: dict, hidden: torch.Tensor,
                         weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
                         ) -> tuple[torch.Tensor, None]:
        """The output layer's place in GPTModel: from the final hidden states [t, 1, H] (this rank's
        [t/tp, 1, H] under sequence parallelism) and this rank's vocabulary shard of the weight (the
        shared embedding's when tied: GPTModel passes it), the logprob of each kept
        position, [K, 1, 1], instead of the logits [t, 1, V/tp]. The entropy [K] (train steps with
        `entropy`) goes beside the model's output, in `mb["entropy"]`: one the loss does not
        differentiate then costs no backward work, which one stacked with the logprobs would.
        The hidden states enter as they enter megatron's ColumnParallelLinear, so their gradient is
        summed over the TP ranks exactly once: gathered over the sequence (backward: reduce-scatter)
        under sequence parallelism, else copied (backward: all-reduce)."""
        weight = layer.weight if weight is None else weight
        if layer.sequence_parallel:
            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True,
                                                                          group=self._tp_group)
        else:
            hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden, group=self._tp_group)
        lp, ent = vocab_parallel_logprobs(
            hidden[mb["keep"], 0], weight, mb["targets"],
            vocab_start=ps.get_tensor_model_parallel_rank() * weight.shape[0],
            group=self._tp_group if self.layout.tp > 1 else None, temperature=self.options.temperature,
            chunk_tokens=self.options.logprob_chunk_tokens, entropy=self.options.entropy and "batch" in mb,  # train steps only
            bias=layer.bias)
        if ent is not None:
            mb["entropy"] = ent
        return lp[:, None, None], None

    def _loss(self, mb: dict, output: torch.Tensor, *, loss_fn: LossFn | None, n_valid: float):
        """On the last stage: the loss (or just the logprobs) from the output tokens' logprobs [1, K, 1]
        that `_output_logprobs` made in place of the logits (and the entropy it left in `mb`)."""
        lp = output[0, :, 0]
        entropy = mb.pop("entropy", None)
        if loss_fn is None:
            return lp.sum() * 0.0, torch.tensor(0, dtype=torch.int), {"logprobs": lp.detach()}
        batch = mb["batch"] if entropy is None else {**mb["batch"], "entropy": entropy}
        loss, stats = loss_fn(lp, batch, mb["mask"], n_valid)
        stats = {"loss": loss.detach(), **{k: v.detach() if torch.is_tensor(v) else v for k, v in stats.items()}}
        return loss, torch.tensor(int(mb["mask"].sum()), dtype=torch.int), stats


    # ------------------------------------------------------------------ train

    def train_step(self, seqs: Sequence[Seq], token_data: dict[str, list[np.ndarray]], loss_fn: LossFn,
                   skip: Sequence[bool] | None = None) -> dict[str, float]:
        """One optimizer step; the same contract as TorchEngine.train_step (stats summed over DP
        ranks, loss stats from the last pipeline stage)."""
        if self._optimizer is None:
            raise RuntimeError("train_step on an engine built without optim (a frozen role)")
        start = time.perf_counter()
        with self._compat():
            batch = step_batch(seqs, token_data, skip, self._dp_group)
            phases = Phases()
            with phases("packing"):
                micro = self._micro_batches(batch.seqs, batch.token_data, batch.masks)
            self._model.zero_grad_buffer()
            self._optimizer.zero_grad()
            # The pipeline schedule interleaves forward and backward passes: timed as one phase.
            with phases("forward_backward"):
                results = self._run(micro, forward_only=False, loss_fn=loss_fn, n_valid=batch.loss_denominator)
                finalize_model_grads([self._model])  # DP all-reduce (SUM) and tied-embedding grads across stages
            sums: dict[str, float] = {}
            if self._last and ps.get_tensor_model_parallel_rank() == 0:
                sums["skipped_tokens"] = float(batch.skipped_tokens)  # once per data-parallel rank, as the loss stats
                for stats in results:
                    accumulate_stats(sums, stats)
            lr = self.lr
            with phases("optimizer"):
                grad_norm, skipped = self._clip_and_step(lr)
            sums = merge_stats(sums, dist.group.WORLD)
        return step_report(sums, batch, grad_norm=grad_norm, lr=lr, skipped=skipped, n_micro_batches=len(micro),
                           start=start, phases=phases)

    def _clip_and_step(self, lr: float) -> tuple[float, bool]:
        """Clip to the global norm and step, or skip a non-finite step: (norm before clipping, skipped)."""
        self._optimizer.prepare_grads()  # main_grad -> the optimizer's (fp32 main) gradients
        norm = float(self._optimizer.get_grad_norm())
        if not self._everywhere_finite(norm):
            self._model.zero_grad_buffer()
            self._optimizer.zero_grad()
            self._count_non_finite()
            return norm, True
        self._nan_in_a_row = 0
        step_clipped(self._optimizer, self.optim, lr, norm)
        self._step += 1
        return norm, False

    def _everywhere_finite(self, norm: float) -> bool:
        """Whether the norm is finite on every rank. megatron all-reduces it over its grad-stats group
        (the model-parallel ranks, or all of them with the distributed optimizer) and the DP replicas
        hold the same summed gradients, so the ranks agree already; one scalar all-reduce makes the
        skip decision collective by construction (a rank that stepped alone would leave its replicas)."""
        flag = torch.tensor([1.0 if math.isfinite(norm) else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())
