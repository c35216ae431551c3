"""Weights by broadcast over a process group of trainer rank 0 and every server (gloo on the CPU,
NCCL on GPUs): SGLang's `/init_weights_update_group` and `/update_weights_from_distributed`.
sender.py is rank 0's end, group.py the group itself; the server's end is in generation/http/weight_routes.py."""

from __future__ import annotations

from areal_flow.weights.group import BACKENDS
from areal_flow.weights.sender import WeightSender
from areal_flow.weights.trainer_sent import TrainerSent

__all__ = ["BACKENDS", "BroadcastChannel"]


class BroadcastChannel(TrainerSent):
    """rollout.weight_update_mode=distributed."""

    name = "distributed"

    def __init__(self, *args, backend: str = "gloo", master_address: str = "127.0.0.1", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.backend, self.master_address = backend, master_address

    def make_sender(self) -> WeightSender:
        # The servers reach rank 0 where it listens: its node's address, or loopback on one host.
        return WeightSender(self.servers, backend=self.backend, master_address=self.master_address,
                            timeout=self.timeout, api_key=self.api_key)

    def source(self, location: str) -> str:
        return "by broadcast"
