"""The megatron engine's weights out and in: export to the generation servers, Hugging Face
directories with or without training state, and resumable checkpoints.

The weights always travel as Hugging Face tensors (weights.py), gathered on every rank and
written by global rank 0. The optimizer state is per rank (optimizer.py), so it resumes on the
layout that saved it, or, where every rank holds the same whole state (no TP, PP or distributed
optimizer), on another data-parallel size. checkpoint_files.py names the files.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.optimizer import MegatronOptimizer
from safetensors.torch import save_file
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from areal_flow.graph.layout import Layout, parse_layout
from areal_flow.runtime.disk import torch_save
from areal_flow.training.checkpoint_files import (
    RANK_RNG,
    RESUMABLE_META,
    TRAIN_STATE,
    atomic_write_dir,
    check_hf_checkpoint,
    check_sharded_state,
    read_rank_rng,
    read_resumable_meta,
    read_sharded_state,
    read_train_state,
    write_hf_files,
    write_sharded_state,
)
from areal_flow.training.engine import CheckpointError, EngineBase, bucketed
from areal_flow.training.megatron.optimizer import (
    check_optimizer_kind,
    init_optimizer_state,
    load_optimizer_state,
    optimizer_state,
)
from areal_flow.training.megatron.weights import HfWeights


class MegatronCheckpoints(EngineBase):
    """The checkpoint half of MegatronEngine, which sets what it reads: `_weights` (this rank's
    parameters as Hugging Face tensors), `_model` (wrapped in DistributedDataParallel when it
    trains), `_optimizer` (None: a frozen role), `_distributed` and `_optimizer_kind` (what kind of
    optimizer state it holds), `_step` (the LR schedule's), the TP and PP groups, `layout`,
    `hf_config`, `expected` and `_compat`."""

    _weights: HfWeights
    _model: torch.nn.Module
    _optimizer: MegatronOptimizer | None
    _distributed: bool
    _optimizer_kind: dict[str, bool]
    _step: int
    _tp_group: dist.ProcessGroup
    _pp_group: dist.ProcessGroup
    _compat: Callable
    layout: Layout
    hf_config: PretrainedConfig
    expected: dict[str, tuple[int, ...]]

    # ------------------------------------------------------------------ weights out

    def export_weights(self, bucket_bytes: int = 1 << 28) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The full fp32 weights under Hugging Face names (tied weights once, in the Hugging Face
        order), in buckets of at most `bucket_bytes`, on every rank. Collective: every rank must
        consume the whole iterator (TP shards are gathered, then each stage broadcasts its own)."""
        return bucketed(self._hf_tensors(), bucket_bytes)

    def _hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._weights.tensors(self._tp_group, self._pp_group)

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
        if dist.get_rank() == 0:
            atomic_write_dir(path, partial(write_hf_files, write_weights=self._weights_writer(state),
                                           tokenizer=tokenizer, train_state=train_state))
        dist.barrier()  # no rank goes on before the checkpoint exists

    def _weights_writer(self, state: dict[str, torch.Tensor]) -> Callable[[str], None]:
        def write(folder: str) -> None:
            save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
            self.hf_config.save_pretrained(folder)

        return write

    def _train_state(self) -> dict:
        mine = {"optimizer": optimizer_state(self._optimizer, self._distributed), "rng": torch.get_rng_state()}
        ranks: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        return {"layout": str(self.layout), "optimizer_kind": self._optimizer_kind, "ranks": ranks,
                "step": self._step, **self._counters()}

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
            write_hf_files(path, self._weights_writer(weights), tokenizer)
        del weights
        if self._optimizer is not None:
            with self._compat():
                write_sharded_state(path, self._sharded_state(), None, alone=False)
            torch_save({"cpu": torch.get_rng_state()}, os.path.join(path, RANK_RNG.format(rank=rank)))
            if rank == 0:
                torch_save({"engine": "megatron", "layout": str(self.layout), "world_size": dist.get_world_size(),
                            "optimizer_kind": self._optimizer_kind, "step": self._step, **self._counters()},
                           os.path.join(path, RESUMABLE_META))
        dist.barrier()  # no rank goes on before the checkpoint is whole

    def _sharded_state(self) -> dict:
        """This rank's optimizer state under a key of its own (megatron's state is per rank, its
        parameters this rank's TP shards and PP stage, and its DP shard with the distributed
        optimizer): what DCP saves, and loads into in place."""
        return {f"rank{dist.get_rank()}": {"optimizer": optimizer_state(self._optimizer, self._distributed)}}

    # ------------------------------------------------------------------ weights in

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
            meta, source = self._resumable_meta(path)
            rng = read_rank_rng(path, dist.get_rank() if dist.get_rank() < meta.get("world_size", 1) else source)
        with self._compat():
            if meta is not None:
                init_optimizer_state(self._optimizer)
                state = {f"rank{source}": self._sharded_state()[f"rank{dist.get_rank()}"]}
                check_sharded_state(path, state)
                read_sharded_state(path, state, None, alone=False)
            self._weights.load(path)
            if meta is not None:
                load_optimizer_state(self._optimizer, self._distributed, state[f"rank{source}"]["optimizer"])
                torch.set_rng_state(rng["cpu"])
                self._step = meta["step"]
                self._restore_counters(meta)

    def _resumable_meta(self, path: str) -> tuple[dict, int]:
        """RESUMABLE_META of the checkpoint at `path`, checked to fit this engine, and the saved
        rank whose optimizer state this rank loads (its own, or rank 0's on a resize)."""
        meta = read_resumable_meta(path, "megatron")
        where = os.path.join(path, RESUMABLE_META)
        check_optimizer_kind(self._optimizer_kind, where, meta.get("optimizer_kind"))
        if meta.get("layout") == str(self.layout):
            return meta, dist.get_rank()
        if not self._replicated(meta.get("layout")):
            raise CheckpointError(f"{where}: saved by layout {meta.get('layout')}, this run is {self.layout}; the "
                                  "optimizer state resumes only on the same layout, or on another data-parallel "
                                  "size without tp, pp or the distributed optimizer")
        return meta, 0

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
            check_optimizer_kind(self._optimizer_kind, os.path.join(path, TRAIN_STATE), train_state.get("optimizer_kind"))
        with self._compat():
            self._weights.load(path)
            if train_state is None and self._optimizer is not None:
                self._optimizer.reload_model_params()  # fp32 main weights (bf16, distributed) from the new ones
            if train_state is not None:
                mine = train_state["ranks"][dist.get_rank()]
                load_optimizer_state(self._optimizer, self._distributed, mine["optimizer"])
                torch.set_rng_state(mine["rng"])
                self._step = train_state["step"]
                self._restore_counters(train_state)
