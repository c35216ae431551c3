"""How each new policy version reaches the generation servers: one channel per medium, chosen once
from `rollout.weight_update_mode` (`make_channel`), and one update sequence for all of them.

| mode | channel | the trainer ranks | the servers |
|---|---|---|---|
| disk, shm | files.py | write a Hugging Face directory after each step | load it (`/update_weights_from_disk`) |
| distributed | broadcast.py | rank 0 broadcasts buckets over a gloo/NCCL group when asked | receive them (`/update_weights_from_distributed`) |
| ipc | ipc.py | rank 0 sends CUDA IPC handles of its own tensors when asked | copy from them (`/update_weights_from_tensor`) |

update.py pauses the servers, has the channel deliver, and continues them (channel.py has the
contract). The controller, the trainer and the router call the channel and never look at the mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_flow.weights.channel import UpdateFlags, WeightChannel

if TYPE_CHECKING:
    from areal_flow.config.schema import RunConfig
    from areal_flow.runtime.spec import RunSpec

__all__ = ["UpdateFlags", "WeightChannel", "make_channel"]


def make_channel(cfg: RunConfig, spec: RunSpec) -> WeightChannel:
    """The run's channel (both ends: every trainer rank and the controller make the same one)."""
    from areal_flow.runtime.security import LOOPBACK

    rollout, mode = cfg.rollout, cfg.rollout.weight_update_mode
    if mode in ("disk", "shm"):
        from areal_flow.weights.files import FileChannel

        # Real SGLang loads whole models from disk (its own LoRA serving is not wired in): a LoRA
        # trainer writes its merged weights for it, the adapters alone for the embedded engine.
        return FileChannel(mode, spec.weights(), rollout.keep_weights_every,
                           adapters=cfg.generation.backend == "embedded")
    from areal_flow.weights.sender import Server

    # A real SGLang server joins a group with each of its TP ranks (rank_offset + tp_rank); the
    # embedded engine, whose tp_size is its torch threads, is one rank.
    ranks = cfg.generation.tp_size if cfg.generation.backend == "sglang" else 1
    servers = [Server(name, url, ranks) for name, url in zip(spec.gen_names, spec.gen_urls)]
    common = dict(bucket_bytes=rollout.weight_bucket_mb << 20, timeout=rollout.request_timeout, api_key=spec.api_key,
                  adapters=cfg.generation.backend == "embedded")
    if mode == "distributed":
        from areal_flow.weights.broadcast import BACKENDS, BroadcastChannel

        return BroadcastChannel(servers, backend=BACKENDS[cfg.cluster.device_type],
                                master_address=spec.hosts.get("trainer0", LOOPBACK), **common)
    if mode == "ipc":
        from areal_flow.weights.ipc import IpcChannel

        return IpcChannel(servers, **common)
    raise ValueError(f"rollout.weight_update_mode={mode!r} is not one of disk, shm, distributed, ipc")
