"""A trainer rank's engines, built from the run's config: one per model role of the graph's
trainer-mesh nodes, torch or megatron as the node names, with the run's optimizer settings for the
trained roles. An inference process (inference.py) builds its one frozen engine the same way.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from areal_flow.config.schema import RunConfig
from areal_flow.graph.dag import Graph
from areal_flow.graph.node import Node
from areal_flow.runtime.child import torchrun_rank
from areal_flow.runtime.devices import TRAINER_BACKENDS, compute_dtype, local_device
from areal_flow.runtime.security import LOOPBACK
from areal_flow.runtime.spec import RunSpec
from areal_flow.training.engine import Engine, OptimSpec
from areal_flow.training.lora import LoraSpec
from areal_flow.training.torch_engine import TorchEngine
from areal_flow.transport.messages import Array

CRITIC_DIR = "critic"
"""A checkpoint's sub-directory holding the critic (a Hugging Face token-classification model)."""


def process_group_init(spec: RunSpec, rank: int) -> dict[str, object]:
    """How this rank joins the trainers' process group: torchrun's rendezvous when torchrun started
    it (launcher.type=slurm), else the store on trainer 0's node at the spec's dist_port."""
    if (env_rank := torchrun_rank()) is not None:
        world = int(os.environ["WORLD_SIZE"])
        # torchrun numbers ranks node by node; the placement must agree, or groups would go to the
        # wrong ranks' inboxes.
        if world != spec.n_trainers or env_rank != rank:
            raise RuntimeError(f"torchrun started rank {env_rank} of {world}, but the run spec has {spec.n_trainers} "
                               f"trainer ranks and this process is trainer{rank}")
        return {"init_method": "env://", "rank": env_rank, "world_size": world}
    # Rank 0's node: its store listens there (on loopback when the run is on one host).
    return {"init_method": f"tcp://{spec.hosts.get('trainer0', LOOPBACK)}:{spec.dist_port}", "rank": rank,
            "world_size": spec.n_trainers}


def make_engines(cfg: RunConfig, spec: RunSpec, graph: Graph, rank: int) -> dict[str, Engine]:
    """One engine per model role on this trainer rank, as the graph's trainer-mesh nodes name them
    (a node on a mesh of its own has its model in its inference processes)."""
    nodes = {n.role: n for n in graph.trainer_nodes}
    layout = graph.train.layout
    megatron = any(n.engine == "megatron" for n in nodes.values())
    device_type = cfg.cluster.device_type
    # megatron's parallel state needs a process group even for one rank.
    if spec.n_trainers > 1 or megatron:
        dist.init_process_group(TRAINER_BACKENDS[device_type], **process_group_init(spec, rank))
    engines: dict[str, Engine] = {}
    trained = {n.role for n in graph.trainer_nodes if n.type == "train"}
    training = cfg.training
    for role, node in nodes.items():
        optim = optim_spec(cfg, role) if role in trained else None
        if node.engine == "megatron":
            from areal_flow.training.megatron.engine import (
                MegatronEngine,  # imports megatron-core (seconds)
            )

            engines[role] = MegatronEngine(spec.model_path, optim=optim, tp=layout.tp, pp=layout.pp,
                                           distributed_optimizer=training.distributed_optimizer,
                                           sequence_parallel=training.sequence_parallel,
                                           **engine_options(cfg, trained=optim is not None))
        else:
            engines[role] = torch_engine(cfg, spec, role, optim,
                                         process_group=dist.group.WORLD if spec.n_trainers > 1 else None)
    return engines


def engine_options(cfg: RunConfig, trained: bool) -> dict[str, object]:
    """What every engine takes from the config: this process's device (the launcher made its GPU
    the only one it sees), number format, attention, and the chunked logprobs' settings."""
    training, device_type = cfg.training, cfg.cluster.device_type
    return dict(temperature=cfg.algorithm.temperature, device=str(local_device(device_type)),
                bf16=compute_dtype(training.dtype, device_type) == torch.bfloat16, attention=training.attention,
                activation_checkpointing=training.activation_checkpointing,
                logprob_chunk_tokens=training.logprob_chunk_tokens, entropy=training.entropy and trained)


def torch_engine(cfg: RunConfig, spec: RunSpec, role: str, optim: OptimSpec | None,
                 process_group: dist.ProcessGroup | None) -> TorchEngine:
    """A role's torch engine from the run's model (`optim` None: frozen, logprobs only), over
    `process_group`'s ranks, or alone (a trainer rank of one, an inference process's replica)."""
    # The critic: the actor's backbone with a value head, or a critic saved beside a checkpoint.
    critic_dir = os.path.join(spec.model_path, CRITIC_DIR)
    path = critic_dir if role == "critic" and os.path.isdir(critic_dir) else spec.model_path
    # training.lora adapts the trained policy; a critic and the frozen roles keep every weight.
    adapted = LoraSpec.of(cfg.training.lora) if role != "critic" and optim is not None else None
    return TorchEngine(path, optim=optim, process_group=process_group, head="value" if role == "critic" else "lm",
                       lora=adapted, **engine_options(cfg, trained=optim is not None))


def configured(engine: Engine, node: Node) -> Engine:
    """`engine` packing micro-batches under `node`'s own token budgets."""
    engine.micro_batch_tokens = node.micro_batch_tokens
    if node.engine == "torch":  # the megatron engine packs one THD row (the graph refuses row_tokens)
        engine.row_tokens = node.row_tokens
    return engine


def node_outputs(engine: Engine, graph: Graph, node: Node, arrays: Sequence[Mapping[str, Array]]) -> list[np.ndarray]:
    """An inference node's output for each sample (`arrays`: a sample's arrays by key): per-token
    logprobs of its answer (values, for a critic) under `engine`, packed under the node's budgets."""
    prompt, output = graph.input(node, "prompt_ids"), graph.input(node, "output_ids")
    return configured(engine, node).logprobs([(a[prompt].numpy(), a[output].numpy()) for a in arrays])


def optim_spec(cfg: RunConfig, role: str = "actor") -> OptimSpec:
    """A trained role's optimizer settings (the critic's own LR); the LR schedule counts optimizer steps."""
    algo = cfg.algorithm
    decay = algo.lr_decay_steps if algo.lr_decay_steps is not None else cfg.total_steps * algo.n_minibatches * algo.ppo_epochs
    lr = algo.critic_lr if role == "critic" and algo.critic_lr is not None else algo.lr
    return OptimSpec(lr=lr, betas=tuple(algo.betas), weight_decay=algo.weight_decay, grad_clip=algo.grad_clip,
                     schedule=algo.lr_schedule, warmup_steps=algo.lr_warmup_steps, decay_steps=decay,
                     min_lr_ratio=algo.lr_min_ratio, max_nan_steps=algo.max_nan_steps)
