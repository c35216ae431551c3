"""The megatron engine's optimizer: megatron's DistributedDataParallel and optimizer around the
model, its per-rank state for checkpoints, and the step after a finite gradient norm.

The state is this rank's own: its parameters are this rank's TP shards and PP stage, and with the
distributed optimizer (`distributed`) the Adam state and fp32 master weights of its DP shard only.
A resume must build the same kind of optimizer (`OptimizerKind`).
"""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.transformer import TransformerConfig

from areal_flow.training.engine import CheckpointError, OptimSpec


def wrap_for_training(model: torch.nn.Module, config: TransformerConfig, optim: OptimSpec, *, bf16: bool,
                      distributed: bool) -> tuple[DistributedDataParallel, MegatronOptimizer]:
    """megatron's DistributedDataParallel (fp32 gradient buffers, `main_grad`) around `model`, and
    its optimizer: AdamW on fp32 (master) weights, sharded over DP with the distributed optimizer.
    Its clip_grad is 0: the engine clips with `step_clipped` itself, after checking that the norm is
    finite (a non-finite step is skipped before anything is clipped)."""
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=distributed)
    model = DistributedDataParallel(config, ddp_config, model)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1], adam_eps=optim.eps, clip_grad=0.0, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=distributed), [model])
    return model, optimizer


def inner_optimizers(optimizer: MegatronOptimizer) -> list:
    """megatron's optimizers under its ChainedOptimizer (one here: no experts)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def step_clipped(optimizer: MegatronOptimizer, optim: OptimSpec, lr: float, norm: float) -> None:
    """The optimizer step after a finite global gradient `norm` (megatron's: over TP and PP, each TP
    shard and tied weight once, and with the distributed optimizer over the DP shards): clip to
    `optim.grad_clip`, then step at `lr`."""
    if optim.grad_clip > 0:  # scales by clip / (norm + 1e-6) when below 1, as torch's clip_grad_norm_
        for inner in inner_optimizers(optimizer):
            params = inner.get_parameters()
            if params:
                clip_grad_by_total_norm_fp32(params, optim.grad_clip, norm)
    for group in optimizer.param_groups:
        group["lr"] = lr
        # megatron marks biases and norm scales with wd_mult 0 (the same rule as `decays`);
        # its own scheduler, which applies the mark, is not used here.
        group["weight_decay"] = optim.weight_decay * group.get("wd_mult", 1.0)
    optimizer.step_with_ready_grads()


def optimizer_state(optimizer: MegatronOptimizer, distributed: bool) -> dict:
    """This rank's whole optimizer state. megatron's own state_dict, except with the distributed
    optimizer, whose state_dict leaves out the state of the parameters (kept for its
    `save_parameter_state`): then, of each inner torch optimizer, its state_dict (Adam's moments
    of this rank's shard, live tensors that DCP loads into in place) and a copy of its parameters,
    the fp32 main weights of the shard (in fp32 they are views of the whole parameter buffer,
    which pickling would save whole)."""
    if not distributed:
        return optimizer.state_dict()
    return {"shards": [{"torch": inner.optimizer.state_dict(),
                        "main": [p.detach().clone() for group in inner.optimizer.param_groups
                                 for p in group["params"]]}
                       for inner in inner_optimizers(optimizer)]}


def load_optimizer_state(optimizer: MegatronOptimizer, distributed: bool, state: dict) -> None:
    """Put back what `optimizer_state` gave (after the weights are loaded: the fp32 main weights
    are the optimizer's, and win over the parameters they round to)."""
    if not distributed:
        optimizer.load_state_dict(state)
        return
    for inner, saved in zip(inner_optimizers(optimizer), state["shards"], strict=True):
        inner.optimizer.load_state_dict(saved["torch"])
        mains = [p for group in inner.optimizer.param_groups for p in group["params"]]
        with torch.no_grad():
            for main, value in zip(mains, saved["main"], strict=True):
                main.copy_(value)


def check_optimizer_kind(kind: dict, source: str, saved: dict | None) -> None:
    """The optimizer state resumes only into the same kind of optimizer (else CheckpointError naming
    the options). A state saved before the kind was recorded held fp32 AdamW state, unsharded."""
    saved = saved or {"distributed_optimizer": False, "bf16": False}
    if saved != kind:
        have = ", ".join(f"{k}={v}" for k, v in kind.items())
        was = ", ".join(f"{k}={saved.get(k)}" for k in kind)
        raise CheckpointError(f"{source}: optimizer state saved with {was}, this engine has {have}; "
                              "it resumes only into the same optimizer")


def init_optimizer_state(optimizer: MegatronOptimizer) -> None:
    """Adam's state tensors, which a fresh optimizer creates at its first step, made by a step of
    zero gradients at LR 0 (which changes no weight), so that DCP has tensors to load into."""
    for wrapped in inner_optimizers(optimizer):  # the torch optimizers megatron's wraps
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
