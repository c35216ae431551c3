"""The torch engine's model: a Hugging Face causal LM (or, with head "value", the same backbone with
a value head), checked against its checkpoint before loading, sharded with FSDP2 over a process
group, and its AdamW optimizer with the LR schedule.

transformers builds the model; this module decides only what the engine needs of it: which class
a head is, which tensors a checkpoint must hold, whether the LM head can be routed to the chunked
logprobs, and how FSDP2 splits it (one unit per decoder layer).
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

from areal_flow.training.checkpoint_files import check_hf_checkpoint, require_config
from areal_flow.training.engine import OptimSpec, decays
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


def load_model(model_path: str, head: str, hf_attention: str, device: str, *, trains: bool,
               activation_checkpointing: bool) -> torch.nn.Module:
    """The model of `model_path` in fp32 on `device`, in eval mode (dropout would make the trained
    logprobs differ from the ones that `logprobs` reports and that generation samples from), its
    parameters trainable when `trains`. A missing or misshapen tensor fails naming it first."""
    # A critic may start from the actor's checkpoint, which has no value head: it starts at 0.
    held = check_hf_checkpoint(model_path, expected_tensors(model_path, head),
                               optional=(VALUE_HEAD,) if head == "value" else ())
    model = model_class(head).from_pretrained(model_path, config=model_config(model_path, head), dtype=torch.float32,
                                              attn_implementation=hf_attention)
    if head == "value" and not any(k.startswith(VALUE_HEAD) for k in held):
        with torch.no_grad():
            for p in model.score.parameters():
                p.zero_()
    model.to(device)
    model.eval()
    model.requires_grad_(trains)
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    return model


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (transformers runs them in train
    mode, so the model must have no attention dropout)."""
    if getattr(model.config, "attention_dropout", 0.0):
        raise ValueError("activation_checkpointing needs attention_dropout 0 (it runs the layers in train mode)")
    # The newer name where transformers has it (the older one warns there); 5.17, the GPU
    # image's, has only the older.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def build_optimizer(model: torch.nn.Module, optim: OptimSpec
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the model's trainable parameters (weight decay on `decays` ones only) and its LR
    schedule over optimizer steps."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if decays(n, p)], "weight_decay": optim.weight_decay},
              {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}]
    # fused: one kernel over all parameters; torch's default on CPU is a Python loop over
    # them (3.6 ms a step for the default recipe's 51 tensors, fused 0.6 ms).
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=optim.lr,
                                  betas=tuple(optim.betas), eps=optim.eps, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_factor, schedule=optim.schedule, warmup_steps=optim.warmup_steps,
        decay_steps=optim.decay_steps, min_ratio=optim.min_lr_ratio))
    return optimizer, scheduler


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


def whole(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of an FSDP-sharded DTensor (a collective), or `t` itself. torch.distributed
    (checkpoint, tensor) is imported only where it is used: it costs a second of every trainer's
    start, and without FSDP no tensor can be a DTensor."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.full_tensor() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


def shard(model: torch.nn.Module, group: dist.ProcessGroup, device_type: str, bf16: bool) -> None:
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
