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

Weights enter and leave as Hugging Face tensors (convert.py): `load` and the constructor read a
Hugging Face directory on every rank, `export_weights` and `save` gather the shards (TP) and
stages (PP) under Hugging Face names.

The fast path, each a constructor option, each running on a GPU and on the CPU alike (tests:
tests/training/test_megatron_fast_path.py):

- `bf16`: megatron's mixed precision. Parameters and compute in bfloat16 (Float16Module), gradients
  reduced and accumulated in fp32 buffers (`main_grad`), fp32 master weights in the optimizer, which
  the checkpoints' optimizer state keeps (exported weights are the bf16 parameters, as fp32).
- `distributed_optimizer`: megatron's DistributedOptimizer: the Adam state and master weights
  sharded over the DP ranks (gradients reduce-scattered, parameters all-gathered after the step).
  Checkpoints keep each rank's shard, so they resume on the same layout and options only.
- `activation_checkpointing`: full recomputation, one layer at a time, in training passes.
- `sequence_parallel` (tp > 1): the activations outside the tensor-parallel layers split over the
  sequence across the TP ranks; each packed row is padded to a multiple of tp with a dummy
  sequence of its own.

Every step clips with megatron's gradient norm and clipping (over TP, PP and the distributed
optimizer's shards), and a step whose norm is not finite on some rank is skipped on all of them.

On a machine without a GPU each call runs inside `cpu_compat.cpu_mode()`; docs/architecture.md
("Training engines") says what that changes.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator, Sequence
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, PreTrainedTokenizerBase

from areal_flow.algorithms.packing import ffd_allocate
from areal_flow.graph.layout import Layout, layout_problems, parse_layout
from areal_flow.metrics.profile import Phases
from areal_flow.runtime.disk import torch_save
from areal_flow.training.engine import (
    RANK_RNG,
    RESUMABLE_META,
    TRAIN_STATE,
    CheckpointError,
    LossFn,
    OptimSpec,
    Seq,
    accumulate_stats,
    atomic_write_dir,
    bucketed,
    check_budget,
    check_engine_args,
    check_hf_checkpoint,
    check_sharded_state,
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
    routed_forward,
    seq_lengths,
    write_sharded_state,
)
from areal_flow.training.logprobs import vocab_parallel_logprobs
from areal_flow.training.megatron import convert
from areal_flow.training.megatron.cpu_compat import cpu_mode, seed_rng_tracker
from areal_flow.training.megatron.model import build_model, check_hf_config, head_dim, transformer_config
from areal_flow.training.schedule import lr_factor
from areal_flow.training.torch_engine import expected_tensors


def check_fast_path_args(*, tp: int, sequence_parallel: bool) -> None:
    """Refuse what megatron's fast path cannot do with this layout, naming the values."""
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel=True needs tensor parallelism (tp > 1); this layout has tp=1 "
                         "(sequence parallelism splits the activations over the TP ranks)")


def init_parallel(tp: int, pp: int) -> Layout:
    """Megatron's process groups over the default group (dp = world / (tp·pp)); once per process,
    and a second call must ask for the same layout."""
    if not dist.is_initialized():
        raise RuntimeError("the megatron engine needs torch.distributed initialised first (every rank of the layout)")
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"tp·pp = {tp}·{pp} does not divide the {world} ranks of the process group")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise ValueError(f"this process already holds megatron layout tp={have[0]} pp={have[1]}; "
                             f"every model role on one mesh must use one layout (asked tp={tp} pp={pp})")
    else:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return Layout(dp=world // (tp * pp), tp=tp, pp=pp)


class MegatronEngine:
    """One rank of a Hugging Face Qwen2/Llama model on megatron-core: logprobs, train steps, save/load."""

    def __init__(
        self,
        model_path: str,
        *,
        optim: OptimSpec | None = None,
        micro_batch_tokens: int = 4096,
        temperature: float = 1.0,
        tp: int = 1,
        pp: int = 1,
        device: str = "cpu",
        bf16: bool = False,
        distributed_optimizer: bool = False,
        activation_checkpointing: bool = False,
        sequence_parallel: bool = False,
        logprob_chunk_tokens: int = 1024,
        entropy: bool = False,
        attention: str = "auto",
    ) -> None:
        """`optim` None makes a frozen role (ref). `tp`/`pp`: tensor and pipeline parallel sizes;
        the data-parallel size is what remains of the process group.

        `bf16`: megatron's mixed precision: parameters and compute in bfloat16 (Float16Module),
        gradients reduced and accumulated in fp32 (`main_grad`), fp32 master weights in the optimizer.
        `distributed_optimizer`: megatron's DistributedOptimizer, the optimizer state (and the fp32
        master weights) sharded over the data-parallel ranks; gradients are reduce-scattered and the
        updated parameters all-gathered. `activation_checkpointing`: full recomputation, layer by
        layer, in training passes. `sequence_parallel`: split the activations outside the TP layers
        over the sequence across TP ranks (needs tp > 1). All of them also run on the CPU.

        `logprob_chunk_tokens`: the output layer's logprobs are computed that many tokens at a time
        from the hidden states, never holding the [tokens, vocab/tp] logits (0: one chunk;
        training/logprobs.py). `entropy`: train steps pass each token's entropy to the loss function
        as batch["entropy"] (with its gradient). `attention`: the packed core attention
        (training/attention.py: auto, varlen, flex or sdpa, the dense-mask reference)."""
        if logprob_chunk_tokens < 0:
            raise ValueError(f"logprob_chunk_tokens must be >= 0 (0: one chunk), got {logprob_chunk_tokens}")
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.entropy = entropy
        check_engine_args(micro_batch_tokens, temperature)
        check_fast_path_args(tp=tp, sequence_parallel=sequence_parallel)
        self.device = torch.device(device)
        self._compat = cpu_mode if self.device.type == "cpu" else contextlib.nullcontext
        expected = expected_tensors(model_path)
        check_hf_checkpoint(model_path, expected)
        self.hf_config = AutoConfig.from_pretrained(model_path)
        check_hf_config(self.hf_config, f"{model_path}/config.json")
        problems = layout_problems(Layout(tp=tp, pp=pp), n_devices=None, model=self.hf_config, where=model_path)
        if problems:
            raise ValueError("; ".join(problems))
        self.micro_batch_tokens = micro_batch_tokens
        self.temperature = temperature
        self.version = 0
        self.optim = optim
        self.expected = expected
        self.heads = convert.Heads(self.hf_config.num_attention_heads, self.hf_config.num_key_value_heads,
                                   head_dim(self.hf_config))
        self._step = 0
        self._nan_in_a_row = 0
        self.extra_state: dict = {}  # the caller's training state (e.g. an adaptive KL coefficient), saved with it
        self._recompute = activation_checkpointing
        self._distributed = distributed_optimizer and optim is not None
        # What the optimizer state holds, saved with it: a resume must build the same optimizer.
        self._optimizer_kind = {"distributed_optimizer": self._distributed, "bf16": bf16}
        with self._compat():
            self.layout = init_parallel(tp, pp)
            self._dp_group = ps.get_data_parallel_group()
            self._dp_rank = ps.get_data_parallel_rank()
            self._tp_group = ps.get_tensor_model_parallel_group()
            self._pp_group = ps.get_pipeline_model_parallel_group()
            self._mp_group = ps.get_model_parallel_group()
            self.config = transformer_config(self.hf_config, tp=tp, pp=pp, bf16=bf16, on_gpu=self.device.type == "cuda",
                                             recompute=activation_checkpointing, sequence_parallel=sequence_parallel)
            self._first, self._last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
            if self.device.type == "cuda":
                tensor_parallel.model_parallel_cuda_manual_seed(1234)  # the GPU initialisation draws from it
            else:
                seed_rng_tracker(1234)  # the same tracker states (sequence parallelism forks them), on the CPU
            model = build_model(self.hf_config, self.config, pre_process=self._first, post_process=self._last,
                                attention=attention)
            model.to(self.device)
            self._rules = self._local_rules(model)
            self._load_weights(model, model_path)
            self._gpt = model  # the GPTModel inside the wrappers
            if bf16:
                model = Float16Module(self.config, model)  # bf16 parameters (the same Parameter objects)
            model.requires_grad_(optim is not None)
            self._optimizer = None
            if optim is not None:
                model, self._optimizer = self._wrap_for_training(model, optim, bf16)
            model.eval()  # no dropout: trained logprobs must equal reported ones
            self._model = model
            # Which pipeline stage owns each Hugging Face tensor (every rank needs the plan).
            owned = [hf for names, _, _ in self._rules.values() for hf in names if hf in expected]
            stages: list[list | None] = [None] * self.layout.pp
            dist.all_gather_object(stages, owned, group=self._pp_group)
            self._owner = {hf: stage for stage, names in enumerate(stages) for hf in names}

    def _wrap_for_training(self, model: torch.nn.Module, optim: OptimSpec,
                           bf16: bool) -> tuple[DistributedDataParallel, MegatronOptimizer]:
        """megatron's DistributedDataParallel (fp32 gradient buffers, `main_grad`) around `model`, and
        its optimizer: AdamW on fp32 (master) weights, sharded over DP with the distributed optimizer.
        Its clip_grad is 0: `_clip_and_step` calls megatron's clipping itself, after checking that the
        norm is finite (a non-finite step is skipped before anything is clipped)."""
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=self._distributed)
        model = DistributedDataParallel(self.config, ddp_config, model)
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.betas[0],
            adam_beta2=optim.betas[1], adam_eps=optim.eps, clip_grad=0.0, bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=self._distributed), [model])
        return model, optimizer

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

    # ------------------------------------------------------------------ weights in

    def _local_rules(self, model: torch.nn.Module) -> dict[str, tuple[tuple[str, ...], str, torch.nn.Parameter]]:
        """megatron name -> (Hugging Face names, conversion kind, parameter) for this rank."""
        global_layer = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
        rules = {}
        for name, param in model.named_parameters():
            rule = convert.rule(name, global_layer)
            rules[name] = (rule.hf_names, rule.kind, param)
        return rules

    def _load_weights(self, model: torch.nn.Module, path: str) -> None:
        """Copy this rank's shard of every parameter from the Hugging Face files at `path`."""
        tp, tp_rank = self.layout.tp, ps.get_tensor_model_parallel_rank()
        tied = bool(self.hf_config.tie_word_embeddings)
        with contextlib.ExitStack() as stack, torch.no_grad():
            files = {}  # Hugging Face name -> its open file, each file opened once
            for fname in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
                f = stack.enter_context(safe_open(os.path.join(path, fname), framework="pt"))
                files.update({key: f for key in f.keys()})
            for hf_names, kind, param in self._rules.values():
                if tied and hf_names == ("lm_head.weight",):
                    hf_names = ("model.embed_tokens.weight",)  # the last stage's copy of the tied embedding
                parts = [files[hf].get_tensor(hf).float() for hf in hf_names]
                param.copy_(convert.to_megatron(kind, parts, tp, tp_rank, self.heads))

    # ------------------------------------------------------------------ forward

    def logprobs(self, seqs: Sequence[Seq]) -> list[np.ndarray]:
        """Per sequence, float32 logprobs [len(output_ids)] of each output token under
        log_softmax(logits / temperature), on every rank (computed on the last pipeline stage)."""
        with self._compat(), torch.no_grad():
            micro = self._micro_batches(seqs, None, None)
            results = self._run(micro, forward_only=True, loss_fn=None, n_valid=1.0)
            out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(seqs)
            if self._last and micro:
                # One copy to the host for them all (one wait for the device, not one per sequence).
                host = torch.cat([res["logprobs"].float() for res in results]).cpu().numpy()
                index = [i for mb in micro for i in mb["index"]]
                ends = np.cumsum([n for mb in micro for n in mb["n_out"]])
                for i, lp in zip(index, np.split(host, ends[:-1])):
                    out[i] = lp
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
        block.training = self._recompute and not forward_only
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
            group=self._tp_group if self.layout.tp > 1 else None, temperature=self.temperature,
            chunk_tokens=self.logprob_chunk_tokens, entropy=self.entropy and "batch" in mb,  # train steps only
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
            masks = loss_masks(seqs, token_data)
            lengths = seq_lengths(seqs)
            n_valid_global, n_tokens_global, denominator = global_counts(masks, lengths, self._dp_group, token_data)
            seqs, token_data, masks, skipped_tokens = kept_sequences(seqs, token_data, masks, skip)
            phases = Phases()
            with phases("packing"):
                micro = self._micro_batches(seqs, token_data, masks)
            self._model.zero_grad_buffer()
            self._optimizer.zero_grad()
            # The pipeline schedule interleaves forward and backward passes: timed as one phase.
            with phases("forward_backward"):
                results = self._run(micro, forward_only=False, loss_fn=loss_fn, n_valid=max(denominator, 1.0))
                finalize_model_grads([self._model])  # DP all-reduce (SUM) and tied-embedding grads across stages
            sums: dict[str, float] = {}
            if self._last and ps.get_tensor_model_parallel_rank() == 0:
                sums["skipped_tokens"] = float(skipped_tokens)  # once per data-parallel rank, as the loss stats
                for stats in results:
                    accumulate_stats(sums, stats)
            lr = self.lr
            with phases("optimizer"):
                grad_norm, skipped = self._clip_and_step(lr)
            sums = merge_stats(sums, dist.group.WORLD)
        sums.update(grad_norm=grad_norm, lr=lr, skipped_steps=float(skipped), n_micro_batches=float(len(micro)),
                    n_tokens=float(n_tokens_global), n_valid_tokens=float(n_valid_global),
                    step_seconds=time.perf_counter() - start, **phases.reset())
        return sums

    def _clip_and_step(self, lr: float) -> tuple[float, bool]:
        """Clip to the global norm and step, or skip a non-finite step: (norm before clipping, skipped).
        Norm and clipping are megatron's: over TP and PP (each TP shard and each tied weight counted
        once) and, with the distributed optimizer, over the DP shards of the fp32 main gradients."""
        self._optimizer.prepare_grads()  # main_grad -> the optimizer's (fp32 main) gradients
        norm = float(self._optimizer.get_grad_norm())
        if not self._everywhere_finite(norm):
            self._model.zero_grad_buffer()
            self._optimizer.zero_grad()
            self._nan_in_a_row = non_finite_step(self._nan_in_a_row, self.optim.max_nan_steps)
            return norm, True
        self._nan_in_a_row = 0
        if self.optim.grad_clip > 0:  # scales by clip / (norm + 1e-6) when below 1, as torch's clip_grad_norm_
            for inner in self._inner_optimizers():
                params = inner.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(params, self.optim.grad_clip, norm)
        for group in self._optimizer.param_groups:
            group["lr"] = lr
            # megatron marks biases and norm scales with wd_mult 0 (the same rule as `decays`);
            # its own scheduler, which applies the mark, is not used here.
            group["weight_decay"] = self.optim.weight_decay * group.get("wd_mult", 1.0)
        self._optimizer.step_with_ready_grads()
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

    def _inner_optimizers(self) -> list:
        """megatron's optimizers under its ChainedOptimizer (one here: no experts)."""
        return list(getattr(self._optimizer, "chained_optimizers", [self._optimizer]))

    # ------------------------------------------------------------------ weights out

    def export_weights(self, bucket_bytes: int = 1 << 28) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The full fp32 weights under Hugging Face names (tied weights once, in the Hugging Face
        order), in buckets of at most `bucket_bytes`, on every rank. Collective: every rank must
        consume the whole iterator (TP shards are gathered, then each stage broadcasts its own)."""
        return bucketed(self._hf_tensors(), bucket_bytes)

    def _hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        by_hf = {hf: name for name, (names, _, _) in self._rules.items() for hf in names}
        converted: dict[str, torch.Tensor] = {}
        my_stage = ps.get_pipeline_model_parallel_rank()
        for hf, shape in self.expected.items():
            # The CPU mode is entered per tensor, never across a yield into the caller's code.
            with self._compat(), torch.no_grad():
                if self._owner[hf] == my_stage and hf not in converted:
                    hf_names, kind, param = self._rules[by_hf[hf]]
                    shards = [torch.empty_like(param) for _ in range(self.layout.tp)]
                    dist.all_gather(shards, param.detach().contiguous(), group=self._tp_group)
                    hf_parts = convert.to_hf(kind, shards, self.heads)  # fp32 (bf16 parameters exactly)
                    converted.update(zip(hf_names, (t.to("cpu", torch.float32) for t in hf_parts)))
                tensor = converted.pop(hf) if self._owner[hf] == my_stage else torch.empty(shape)
                if self.layout.pp > 1:
                    dist.broadcast(tensor, src=dist.get_global_rank(self._pp_group, self._owner[hf]), group=self._pp_group)
            yield hf, tensor

    def save_weights(self, path: str) -> None:
        """The current weights as a Hugging Face directory at `path` (atomically), for generation.
        Collective: every rank calls it; global rank 0 writes."""
        self._save(path, None, with_train_state=False)

    def save(self, path: str, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        """A Hugging Face directory with TRAIN_STATE beside the weights (every rank's optimizer
        state and RNG, the schedule's step, the layout). Collective; global rank 0 writes."""
        self._save(path, tokenizer, with_train_state=self._optimizer is not None)

    def _save(self, path: str, tokenizer: PreTrainedTokenizerBase | None, with_train_state: bool) -> None:
        state = dict(self._hf_tensors())
        train_state = self._train_state() if with_train_state else None

        def write(tmp: str) -> None:
            save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
            self.hf_config.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            if train_state is not None:
                torch_save(train_state, os.path.join(tmp, TRAIN_STATE))

        if dist.get_rank() == 0:
            atomic_write_dir(path, write)
        dist.barrier()  # no rank goes on before the checkpoint exists

    def _train_state(self) -> dict:
        mine = {"optimizer": self._optimizer_state(), "rng": torch.get_rng_state()}
        ranks: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        return {"layout": str(self.layout), "optimizer_kind": self._optimizer_kind, "ranks": ranks,
                "step": self._step, "version": self.version,
                "nan_in_a_row": self._nan_in_a_row, "extra": dict(self.extra_state)}

    def save_resumable(self, path: str, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        """A resumable checkpoint in the folder `path` (the caller's temporary one, renamed when
        every rank is done, so it is written in place): the Hugging Face weights (and `tokenizer`)
        by global rank 0, gathered as for `save`; SHARDED_STATE, each rank's own optimizer state
        under its own key `rank<r>`, written by that rank with `torch.distributed.checkpoint`;
        RANK_RNG by each rank; RESUMABLE_META (layout, step, version, ...) by rank 0. Collective."""
        weights = dict(self._hf_tensors())
        rank = dist.get_rank()
        if rank == 0:
            os.makedirs(path, exist_ok=True)
            save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
            self.hf_config.save_pretrained(path)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
        del weights
        if self._optimizer is not None:
            with self._compat():
                write_sharded_state(path, self._sharded_state(), None, alone=False)
            torch_save({"cpu": torch.get_rng_state()}, os.path.join(path, RANK_RNG.format(rank=rank)))
            if rank == 0:
                torch_save({"engine": "megatron", "layout": str(self.layout), "world_size": dist.get_world_size(),
                            "optimizer_kind": self._optimizer_kind,
                            "step": self._step, "version": self.version, "nan_in_a_row": self._nan_in_a_row,
                            "extra": dict(self.extra_state)}, os.path.join(path, RESUMABLE_META))
        dist.barrier()  # no rank goes on before the checkpoint is whole

    def _sharded_state(self) -> dict:
        """This rank's optimizer state under a key of its own (megatron's state is per rank, its
        parameters this rank's TP shards and PP stage, and its DP shard with the distributed
        optimizer): what DCP saves, and loads into in place."""
        return {f"rank{dist.get_rank()}": {"optimizer": self._optimizer_state()}}

    def _optimizer_state(self) -> dict:
        """This rank's whole optimizer state. megatron's own state_dict, except with the distributed
        optimizer, whose state_dict leaves out the state of the parameters (kept for its
        `save_parameter_state`): then, of each inner torch optimizer, its state_dict (Adam's moments
        of this rank's shard, live tensors that DCP loads into in place) and a copy of its parameters,
        the fp32 main weights of the shard (in fp32 they are views of the whole parameter buffer,
        which pickling would save whole)."""
        if not self._distributed:
            return self._optimizer.state_dict()
        return {"shards": [{"torch": inner.optimizer.state_dict(),
                            "main": [p.detach().clone() for group in inner.optimizer.param_groups
                                     for p in group["params"]]}
                           for inner in self._inner_optimizers()]}

    def _load_optimizer_state(self, state: dict) -> None:
        """Put back what `_optimizer_state` gave (after the weights are loaded: the fp32 main weights
        are the optimizer's, and win over the parameters they round to)."""
        if not self._distributed:
            self._optimizer.load_state_dict(state)
            return
        for inner, saved in zip(self._inner_optimizers(), state["shards"], strict=True):
            inner.optimizer.load_state_dict(saved["torch"])
            mains = [p for group in inner.optimizer.param_groups for p in group["params"]]
            with torch.no_grad():
                for main, value in zip(mains, saved["main"], strict=True):
                    main.copy_(value)

    def _check_optimizer_kind(self, source: str, saved: dict | None) -> None:
        """The optimizer state resumes only into the same kind of optimizer (else CheckpointError naming
        the options). A state saved before the kind was recorded held fp32 AdamW state, unsharded."""
        saved = saved or {"distributed_optimizer": False, "bf16": False}
        if saved != self._optimizer_kind:
            have = ", ".join(f"{k}={v}" for k, v in self._optimizer_kind.items())
            was = ", ".join(f"{k}={saved.get(k)}" for k in self._optimizer_kind)
            raise CheckpointError(f"{source}: optimizer state saved with {was}, this engine has {have}; "
                                  "it resumes only into the same optimizer")

    def _init_optimizer_state(self) -> None:
        """Adam's state tensors, which a fresh optimizer creates at its first step, made by a step of
        zero gradients at LR 0 (which changes no weight), so that DCP has tensors to load into."""
        # The torch optimizers megatron's wraps (one, or a chain's each).
        for wrapped in getattr(self._optimizer, "chained_optimizers", [self._optimizer]):
            inner = wrapped.optimizer
            if inner.state:
                continue
            params = [p for group in inner.param_groups for p in group["params"]]
            lrs = [group["lr"] for group in inner.param_groups]
            for p in params:
                p.grad = torch.zeros_like(p)
            for group in inner.param_groups:
                group["lr"] = 0.0
            inner.step()
            for group, lr in zip(inner.param_groups, lrs):
                group["lr"] = lr
            for p in params:
                p.grad = None

    def load_resumable(self, path: str) -> None:
        """Load a checkpoint written by `save_resumable`: the weights from its Hugging Face files,
        and when this role trains, this rank's optimizer state, RNG and the schedule's step. The
        optimizer state is per rank, so it resumes only on the layout that saved it (else
        CheckpointError naming both, and nothing is changed), or on another data-parallel size of
        a layout without TP or PP and without the distributed optimizer, where every rank holds the
        same whole state: each rank loads rank 0's (a trainer resize). Collective."""
        check_hf_checkpoint(path, self.expected)
        meta = rng = None
        source = dist.get_rank()  # the saved rank whose optimizer state this rank loads
        if self._optimizer is not None:
            meta = read_resumable_meta(path, "megatron")
            self._check_optimizer_kind(os.path.join(path, RESUMABLE_META), meta.get("optimizer_kind"))
            if meta.get("layout") != str(self.layout):
                if not self._replicated(meta.get("layout")):
                    raise CheckpointError(f"{os.path.join(path, RESUMABLE_META)}: saved by layout {meta.get('layout')}, "
                                          f"this run is {self.layout}; the optimizer state resumes only on the same "
                                          "layout, or on another data-parallel size without tp, pp or the "
                                          "distributed optimizer")
                source = 0
            rng = read_rank_rng(path, dist.get_rank() if dist.get_rank() < meta.get("world_size", 1) else source)
        with self._compat():
            module = self._model.module if isinstance(self._model, DistributedDataParallel) else self._model
            if meta is not None:
                self._init_optimizer_state()
                state = {f"rank{source}": self._sharded_state()[f"rank{dist.get_rank()}"]}
                check_sharded_state(path, state)
                read_sharded_state(path, state, None, alone=False)
            self._load_weights(module, path)
            if meta is not None:
                self._load_optimizer_state(state[f"rank{source}"]["optimizer"])
                torch.set_rng_state(rng["cpu"])
                self._step = meta["step"]
                self.version = meta["version"]
                self._nan_in_a_row = meta["nan_in_a_row"]
                self.extra_state = dict(meta.get("extra", {}))

    def _replicated(self, saved_layout: str | None) -> bool:
        """Whether a state saved by `saved_layout` is whole on each of its ranks and fits this layout
        but for the data-parallel size: neither has TP or PP, and the optimizer is not distributed."""
        try:
            saved = parse_layout(saved_layout, "the checkpoint's layout")
        except ValueError:
            return False
        return not self._distributed and saved.tp == saved.pp == self.layout.tp == self.layout.pp == 1

    def load(self, path: str) -> None:
        """Load a checkpoint written by `save` (or any Hugging Face directory of this model's
        shape): weights, and the training state when present and this role trains. Optimizer
        state is per rank, so it resumes only on the layout that saved it (else CheckpointError).
        Collective."""
        check_hf_checkpoint(path, self.expected)
        train_state = read_train_state(path) if self._optimizer is not None else None
        if train_state is not None and train_state.get("layout") != str(self.layout):
            raise CheckpointError(f"{os.path.join(path, TRAIN_STATE)}: saved by layout {train_state.get('layout')}, "
                                  f"this run is {self.layout}; the optimizer state resumes only on the same layout")
        if train_state is not None:
            self._check_optimizer_kind(os.path.join(path, TRAIN_STATE), train_state.get("optimizer_kind"))
        with self._compat():
            module = self._model.module if isinstance(self._model, DistributedDataParallel) else self._model
            self._load_weights(module, path)
            if train_state is None and self._optimizer is not None:
                self._optimizer.reload_model_params()  # fp32 main weights (bf16, distributed) from the new ones
            if train_state is not None:
                mine = train_state["ranks"][dist.get_rank()]
                self._load_optimizer_state(mine["optimizer"])
                torch.set_rng_state(mine["rng"])
                self._step = train_state["step"]
                self.version = train_state["version"]
                self._nan_in_a_row = train_state["nan_in_a_row"]
                self.extra_state = dict(train_state.get("extra", {}))
