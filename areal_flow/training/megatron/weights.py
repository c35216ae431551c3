"""The megatron engine's weights under Hugging Face names, both ways, for this rank's part.

Each rank holds its TP shard of the parameters of its pipeline stage. Loading reads this rank's
shard of every parameter from the Hugging Face files (convert.py's rule per megatron name);
exporting gathers the TP shards, converts them back, and has each stage broadcast the tensors it
owns, so that every rank yields every Hugging Face tensor in the checkpoint's order.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from safetensors import safe_open
from transformers import PretrainedConfig

from areal_flow.graph.layout import Layout
from areal_flow.training.megatron import convert
from areal_flow.training.megatron.model import head_dim

Rules = dict[str, tuple[tuple[str, ...], str, torch.nn.Parameter]]
"""megatron name -> (Hugging Face names, conversion kind, parameter) for this rank."""


def local_rules(model: torch.nn.Module) -> Rules:
    """The conversion rule of each of this rank's parameters (its layers numbered globally)."""
    global_layer = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    rules = {}
    for name, param in model.named_parameters():
        rule = convert.rule(name, global_layer)
        rules[name] = (rule.hf_names, rule.kind, param)
    return rules


class HfWeights:
    """This rank's parameters as Hugging Face tensors: `load` from a directory, `tensors` out.

    `expected`: Hugging Face name -> shape of every tensor of the whole model (tied weights once);
    `compat`: the context every conversion runs in (megatron's CPU mode off the GPU)."""

    def __init__(self, model: torch.nn.Module, hf_config: PretrainedConfig, layout: Layout,
                 expected: dict[str, tuple[int, ...]], compat: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.rules = local_rules(model)
        self.hf_config, self.layout, self.expected, self._compat = hf_config, layout, expected, compat
        self.heads = convert.Heads(hf_config.num_attention_heads, hf_config.num_key_value_heads,
                                   head_dim(hf_config))
        self._owner: dict[str, int] = {}

    def share_owners(self, pp_group: dist.ProcessGroup) -> None:
        """Learn which pipeline stage owns each Hugging Face tensor (every rank needs the plan to
        export). Collective over the pipeline group."""
        owned = [hf for names, _, _ in self.rules.values() for hf in names if hf in self.expected]
        stages: list[list | None] = [None] * self.layout.pp
        dist.all_gather_object(stages, owned, group=pp_group)
        self._owner = {hf: stage for stage, names in enumerate(stages) for hf in names}

    def load(self, path: str) -> None:
        """Copy this rank's shard of every parameter from the Hugging Face files at `path`."""
        tp, tp_rank = self.layout.tp, ps.get_tensor_model_parallel_rank()
        tied = bool(self.hf_config.tie_word_embeddings)
        with contextlib.ExitStack() as stack, torch.no_grad():
            files = {}  # Hugging Face name -> its open file, each file opened once
            for fname in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
                f = stack.enter_context(safe_open(os.path.join(path, fname), framework="pt"))
                files.update({key: f for key in f.keys()})
            for hf_names, kind, param in self.rules.values():
                if tied and hf_names == ("lm_head.weight",):
                    hf_names = ("model.embed_tokens.weight",)  # the last stage's copy of the tied embedding
                parts = [files[hf].get_tensor(hf).float() for hf in hf_names]
                param.copy_(convert.to_megatron(kind, parts, tp, tp_rank, self.heads))

    def tensors(self, tp_group: dist.ProcessGroup, pp_group: dist.ProcessGroup) -> Iterator[tuple[str, torch.Tensor]]:
        """Every Hugging Face tensor, fp32 on the CPU, in the checkpoint's order, on every rank.
        Collective: every rank must consume the whole iterator (TP shards are gathered, then each
        stage broadcasts its own)."""
        by_hf = {hf: name for name, (names, _, _) in self.rules.items() for hf in names}
        converted: dict[str, torch.Tensor] = {}
        my_stage = ps.get_pipeline_model_parallel_rank()
        for hf, shape in self.expected.items():
            # The CPU mode is entered per tensor, never across a yield into the caller's code.
            with self._compat(), torch.no_grad():
                if self._owner[hf] == my_stage and hf not in converted:
                    hf_names, kind, param = self.rules[by_hf[hf]]
                    shards = [torch.empty_like(param) for _ in range(self.layout.tp)]
                    dist.all_gather(shards, param.detach().contiguous(), group=tp_group)
                    hf_parts = convert.to_hf(kind, shards, self.heads)  # fp32 (bf16 parameters exactly)
                    converted.update(zip(hf_names, (t.to("cpu", torch.float32) for t in hf_parts)))
                tensor = converted.pop(hf) if self._owner[hf] == my_stage else torch.empty(shape)
                if self.layout.pp > 1:
                    dist.broadcast(tensor, src=dist.get_global_rank(pp_group, self._owner[hf]), group=pp_group)
            yield hf, tensor
