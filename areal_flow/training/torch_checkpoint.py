"""The torch engine's weights out and in: export to the generation servers, Hugging Face
directories with or without training state, and resumable checkpoints of sharded state.

Under FSDP2 the full weights are gathered onto rank 0 (which writes) while a resumable checkpoint
has every rank write its own shards of the model and optimizer state with
`torch.distributed.checkpoint`: no rank ever holds the whole optimizer state. checkpoint_files.py
names the files; docs/architecture.md ("Training engines") has the contract.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import partial

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from areal_flow.runtime.disk import torch_save
from areal_flow.training.checkpoint_files import (
    RANK_RNG,
    RESUMABLE_META,
    SavedLayout,
    atomic_write_dir,
    check_hf_checkpoint,
    check_sharded_state,
    read_rank_rng,
    read_resumable_meta,
    read_sharded_state,
    read_train_state,
    saved_layout,
    write_hf_files,
    write_like,
    write_sharded_state,
)
from areal_flow.training import lora
from areal_flow.training.engine import CheckpointError, EngineBase, bucketed
from areal_flow.training.hf_model import whole
from areal_flow.training.lora import LoraSpec
from areal_flow.weights import adapter as adapter_files

LORA_DIR = "adapter"
"""Beside a checkpoint's merged Hugging Face weights: the trained adapters as a PEFT adapter directory."""


class TorchCheckpoints(EngineBase):
    """The checkpoint half of TorchEngine, which sets what it reads: `_model` (FSDP2-sharded under a
    process group), `_optimizer` and `_scheduler` (None: a frozen role), `_group`, `rank`, `device`,
    and the two fields of the generation layout's cache."""

    _model: torch.nn.Module
    _optimizer: torch.optim.Optimizer | None
    _scheduler: torch.optim.lr_scheduler.LambdaLR | None
    _group: dist.ProcessGroup | None
    _weight_names: list[str]  # tied weights once, as saved (with adapters: the merged model's)
    _lora: LoraSpec | None  # the trained adapters (training/lora.py), or None
    _model_path: str  # the model it was built from: the base the adapters merge into
    _generation_layout: SavedLayout | None  # what the first save_weights wrote (rank 0)
    _layout_checked: bool
    device: torch.device
    rank: int
    _digest: tuple[int, str] | None = None  # (version, the digest of its adapters), computed once a version

    # ------------------------------------------------------------------ weights out

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights on the CPU under Hugging Face names; collective under FSDP, where only
        rank 0 gets them (the others get {})."""
        if self._group is None:
            return {k: v.detach().cpu() for k, v in self._model.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self._model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def _hf_state_dict(self) -> dict[str, torch.Tensor]:
        """`_full_state_dict` under the names of the model without adapters: with LoRA, every
        adapter merged into its base weight in fp32 (what the servers and `from_pretrained` load)."""
        state = self._full_state_dict()
        return dict(lora.merged(iter(state.items()), self._lora)) if self._lora is not None and state else state

    def _adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapters' full tensors on the CPU under their file names (`lora.adapter_name`);
        collective under FSDP: every rank gathers them."""
        return {lora.adapter_name(name): whole(p.detach()).cpu() for name, p in self._model.named_parameters()
                if lora.is_adapter(name)}

    def export_weights(self, bucket_bytes: int = 1 << 28) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The full weights under Hugging Face names (tied weights once), in buckets of at most
        `bucket_bytes` (a larger tensor travels alone), on every rank: for in-memory transfer to
        generation servers. Collective under FSDP: every rank must consume the whole iterator."""
        named = ((name, whole(p.detach())) for name, p in self._model.named_parameters())
        return bucketed(lora.merged(named, self._lora) if self._lora is not None else named, bucket_bytes)

    def save_weights(self, path: str) -> None:
        """The current weights as a Hugging Face directory at `path` (atomically), for generation.
        Collective: every rank calls it; rank 0 writes.

        The first call writes through `save_pretrained`; the later ones write the same files again
        from what it wrote (the config files' bytes, the same tensor names) with safetensors
        directly. This runs on the trainer's path every step: `save_pretrained` spends 7 ms of a
        600k-parameter model's 10 ms converting names and serialising the config each time
        (docs/benchmarks.md). A model whose tensors `save_pretrained` renames keeps it."""
        state = self._hf_state_dict()
        if self.rank == 0:
            layout = self._generation_layout
            if layout is not None:
                atomic_write_dir(path, lambda tmp: write_like(tmp, layout, {n: state[n] for n in self._weight_names}))
            else:
                atomic_write_dir(path, lambda tmp: self._model.save_pretrained(tmp, state_dict=state))
                if not self._layout_checked:
                    self._generation_layout = saved_layout(path, self._weight_names)
                    self._layout_checked = True
        self._barrier()  # no rank goes on before the directory exists

    def save_update(self, path: str) -> str | None:
        """With LoRA, the adapters alone as a PEFT adapter directory at `path` (atomically; rank 0
        writes), naming the base they merge into; their digest (weights/adapter.py), on every rank.
        Without, the weights (`save_weights`) and None. Collective."""
        if self._lora is None:
            return super().save_update(path)
        tensors = self._adapter_state()
        if self.rank == 0:
            atomic_write_dir(path, lambda tmp: lora.write_adapter_dir(tmp, tensors, self._lora, base=self._model_path))
        self._barrier()
        self._digest = (self.version, adapter_files.digest(tensors))
        return self._digest[1]

    def adapter_digest(self) -> str | None:
        """With LoRA, the digest of the adapters of this version (weights/adapter.py; once a version:
        `save_update` computes it too); None without. Collective (the adapters are gathered)."""
        if self._lora is None:
            return None
        if self._digest is None or self._digest[0] != self.version:
            self._digest = (self.version, adapter_files.digest(self._adapter_state()))
        return self._digest[1]

    def export_update(self, bucket_bytes: int) -> tuple[Iterator[list[tuple[str, torch.Tensor]]], dict | None]:
        """With LoRA, the adapters in one bucket (every rank gathers them) and their transfer config;
        without, `export_weights` and None. Collective."""
        if self._lora is None:
            return super().export_update(bucket_bytes)
        config = adapter_files.transfer_config(self._lora.peft_config(self._model_path).to_dict())
        return iter([list(self._adapter_state().items())]), config

    def save_hf(self, path: str, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        """A Hugging Face directory (weights, config, tokenizer) without training state."""
        self._save(path, tokenizer, with_train_state=False)

    def save(self, path: str, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        """A Hugging Face directory at `path` (atomically: a failure leaves the previous one) with
        TRAIN_STATE beside the weights: optimizer, LR schedule, each rank's RNG state, version.
        Collective: every rank calls it; rank 0 writes."""
        self._save(path, tokenizer, with_train_state=self._optimizer is not None)

    def _save(self, path: str, tokenizer: PreTrainedTokenizerBase | None, with_train_state: bool) -> None:
        state = self._hf_state_dict()
        train_state = self._train_state() if with_train_state else None
        adapter = self._adapter_state() if self._lora is not None else None
        if self.rank == 0:
            atomic_write_dir(path, partial(write_hf_files, write_weights=self._weights_writer(state, adapter),
                                           tokenizer=tokenizer, train_state=train_state))
        self._barrier()  # no rank goes on before the checkpoint exists

    def _weights_writer(self, state: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor] | None = None):
        """Writes the Hugging Face weights `state` into a folder, and with `adapter` the PEFT adapter
        directory LORA_DIR beside them."""
        def write(folder: str) -> None:
            self._model.save_pretrained(folder, state_dict=state)
            if adapter is not None:
                os.makedirs(os.path.join(folder, LORA_DIR))
                lora.write_adapter_dir(os.path.join(folder, LORA_DIR), adapter, self._lora, base=self._model_path)
        return write

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
        return {"optimizer": optimizer, "scheduler": self._scheduler.state_dict(), **self._counters(), "rng": rngs}

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
        weights = self._hf_state_dict()  # rank 0 only: the weights, never the optimizer state
        adapter = self._adapter_state() if self._lora is not None else None
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            write_hf_files(path, self._weights_writer(weights, adapter), tokenizer)
        del weights, adapter
        write_sharded_state(path, self._sharded_state(), self._group, alone=self._group is None)
        torch_save(self._rng_state(), os.path.join(path, RANK_RNG.format(rank=self.rank)))
        if self.rank == 0:
            torch_save({"engine": "torch", "world_size": self._world_size, **self._counters(),
                        "scheduler": None if self._scheduler is None else self._scheduler.state_dict()},
                       os.path.join(path, RESUMABLE_META))
        self._barrier()  # no rank goes on before the checkpoint is whole

    @property
    def _world_size(self) -> int:
        return 1 if self._group is None else dist.get_world_size(self._group)

    def _barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)

    # ------------------------------------------------------------------ weights in

    def load(self, path: str) -> None:
        """Load a checkpoint written by `save` (or any Hugging Face directory of this model's shape):
        the weights, and the training state when the directory has one and this role trains.
        Collective under FSDP. A missing or misshapen tensor fails naming it; nothing is changed then.
        Not with adapters: their merged weights cannot be split back (resume from `save_resumable`)."""
        if self._lora is not None:
            raise CheckpointError(f"{path}: an engine training LoRA adapters loads resumable checkpoints only "
                                  "(load_resumable): the merged weights of a Hugging Face directory cannot be split "
                                  "back into base and adapters")
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
            self._restore_counters(train_state)
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
        self._digest = None
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
            self._restore_counters(meta)
        else:
            set_model_state_dict(self._model, state["model"])
            self.version = meta["version"]
            self.extra_state = dict(meta.get("extra", {}))
        if rng is not None:
            self._set_rng_state(rng)
