"""A megatron-core GPTModel for a Hugging Face Qwen2/Llama-family config, with a fast core attention,
and megatron's process groups it is built in (`init_parallel`).

The layer spec is megatron's local spec (no TransformerEngine) with one change: its core attention
is `SDPACoreAttention`, which calls `F.scaled_dot_product_attention` (causal, grouped-query). The
stock `DotProductAttention` materialises the full softmax and refuses packed sequences; measured on
an H100 (2026-11-23) it made megatron 2.7x slower than Hugging Face, and this one 0.85x. Packed micro-batches
arrive in megatron's THD layout (`PackedSeqParams` with the cumulative sequence lengths): the core
attention then confines attention to each sequence (block-diagonal causal) with one of
training/attention.py's implementations, which build no dense mask (`build_model(attention=...)`), and
megatron's rotary embedding restarts positions at every sequence start.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from transformers import PretrainedConfig

from areal_flow.graph.layout import Layout
from areal_flow.training import attention as packed_attention
from areal_flow.training import documents

SUPPORTED = ("qwen2", "llama")
"""Hugging Face model_type values the converter knows (Qwen2: q/k/v biases; Llama: none)."""


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


def check_hf_config(hf: PretrainedConfig, source: str) -> None:
    """Refuse what the conversion would get wrong, naming the config key."""
    if hf.model_type not in SUPPORTED:
        raise ValueError(f"{source}: model_type {hf.model_type!r} is not supported by the megatron engine "
                         f"(supported: {', '.join(SUPPORTED)}); use engine: torch")
    if hf.hidden_act != "silu":
        raise ValueError(f"{source}: hidden_act {hf.hidden_act!r}: the megatron engine builds SwiGLU (silu) only")
    rope = getattr(hf, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{source}: rope_parameters.rope_type {rope['rope_type']!r} (RoPE scaling) is not supported "
                         "by the megatron engine; use engine: torch")
    if getattr(hf, "mlp_bias", False):
        raise ValueError(f"{source}: mlp_bias=true is not supported by the megatron engine")
    if hf.model_type == "qwen2" and getattr(hf, "use_sliding_window", False):
        raise ValueError(f"{source}: use_sliding_window=true is not supported by the megatron engine")


def head_dim(hf: PretrainedConfig) -> int:
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def qkv_bias(hf: PretrainedConfig) -> bool:
    return hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False))


def rope_theta(hf: PretrainedConfig) -> float:
    rope = getattr(hf, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))


def transformer_config(hf: PretrainedConfig, *, tp: int, pp: int, bf16: bool, on_gpu: bool,
                       recompute: bool = False, sequence_parallel: bool = False) -> TransformerConfig:
    """The TransformerConfig of `hf` for a TP x PP layout. Fusions that need CUDA kernels are off on
    CPU; loss per token (`calculate_per_token_loss`) so that gradients are summed, not averaged,
    over micro-batches and data-parallel ranks: the loss function already divides by the global
    token count, as in every engine.

    `bf16`: parameters in bfloat16 (the engine wraps the model in megatron's Float16Module; the
    optimizer keeps fp32 master weights). `recompute`: full activation recomputation, one layer at a
    time: a layer keeps only its input and recomputes the rest in backward. Selective recomputation
    (megatron's "core_attn") would save nothing here: the SDPA core attention stores no
    sequence x sequence softmax, so recomputing it only costs time. `sequence_parallel`: with TP,
    the activations outside the tensor-parallel layers (norms, residuals) are split over the
    sequence across the TP ranks."""
    dtype = torch.bfloat16 if bf16 else torch.float32
    recompute_args = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads,
        kv_channels=head_dim(hf),
        layernorm_epsilon=hf.rms_norm_eps,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias(hf),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype,
        params_dtype=dtype,  # the fp32 master weights are the optimizer's
        bf16=bf16,
        sequence_parallel=sequence_parallel,
        **(recompute_args if recompute else {}),
        calculate_per_token_loss=True,
        variable_seq_lengths=True,  # packed micro-batches differ in length (pipeline p2p sends shapes)
        moe_token_dispatcher_type="alltoall",  # no experts; the default "allgather" refuses variable lengths
        use_cpu_initialization=not on_gpu,
        # Every weight is then loaded from the Hugging Face checkpoint, but megatron 0.16 marks
        # the tensor-parallel weights (which the gradient norm counts once per shard) only while
        # initialising them: without it, TP shards beyond rank 0 are left out of the norm.
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        deallocate_pipeline_outputs=on_gpu,
    )


class SDPACoreAttention(MegatronModule):
    """Core attention on `F.scaled_dot_product_attention`: causal within each sequence.

    Unpacked input is [s, b, heads, dim]; packed (THD) input is [t, heads, dim] with the
    sequences' cumulative lengths in `packed_seq_params`, and then attention is block-diagonal
    causal, by `attention` (training/attention.py's CHOICES; the layer spec's) resolved for the input's device at the first
    forward. The sequences' boundaries (`attention.Packing`) are built once per forward and kept on
    its PackedSeqParams for the other layers. Key/value heads are this rank's query groups
    (grouped-query attention)."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None,
                 attention: str = "auto"):
        super().__init__(config=config)
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.attention = attention
        packed_attention.resolve(self.attention, "cpu")  # fail at build time on an unknown name
        self._implementation: str | None = None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params: PackedSeqParams | None = None):
        if packed_seq_params is not None:
            if self._implementation is None:
                self._implementation = packed_attention.resolve(self.attention, query.device)
            packing = thd_packing(packed_seq_params, query.shape[0], self._implementation)
            run = packed_attention.IMPLEMENTATIONS[self._implementation]
            out = run(query, key, value, packing, self.scale)  # [t, h, d]
            return out.reshape(out.shape[0], -1)  # [t, h*d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)  # [s, b, h*d]


def thd_packing(params: PackedSeqParams, total: int, implementation: str) -> documents.Packing:
    """The `Packing` of a THD micro-batch, built by its first layer and kept on its PackedSeqParams
    (one object per micro-batch forward) for the others."""
    cache = params.__dict__.setdefault("_areal_packing", {})
    if implementation not in cache:
        cu = params.cu_seqlens_q
        max_len = params.max_seqlen_q
        if max_len is None:
            max_len = int((cu[1:] - cu[:-1]).max())
        cache[implementation] = documents.packing_from_cu_seqlens(cu, int(max_len), total, implementation)
    return cache[implementation]


def layer_spec(attention: str = "auto"):
    """megatron's local layer spec with `SDPACoreAttention` (packed by `attention`) as its core attention."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(module=SDPACoreAttention,
                                                                          params={"attention": attention})
    return spec


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, as megatron's local spec builds it without Apex, that also runs under sequence
    parallelism (megatron's wrapper of it refuses to): each TP rank then normalises its own part of the
    sequence, so the weight is marked `sequence_parallel` and megatron's finalize_model_grads sums
    its gradient over the TP ranks."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


def decoder_spec(config: TransformerConfig, attention: str = "auto") -> TransformerBlockSubmodules:
    """This stage's decoder: `layer_spec()` for each of its layers, every norm (the layers' and the
    final one) an `RMSNorm`."""
    spec = layer_spec(attention)
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = RMSNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=RMSNorm)


def build_model(hf: PretrainedConfig, config: TransformerConfig, *, pre_process: bool, post_process: bool,
                attention: str = "auto") -> GPTModel:
    """This pipeline stage's GPTModel (embedding on the first stage, output layer on the last), its
    packed core attention `attention` (training/attention.py's CHOICES)."""
    return GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec(config, attention),
        vocab_size=hf.vocab_size,
        max_sequence_length=hf.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=bool(hf.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf),
    )
