"""A micro-batch that does not fit memory stops with the budget to lower, named by its config key."""

import numpy as np
import pytest
import torch
from engine_helpers import make_seqs, neg_mean_logprob, save_tiny_qwen2

from areal_flow.training.engine import OptimSpec, OutOfMemory, budget_named
from areal_flow.training.torch_engine import TorchEngine

KEY = "graph.actor_train.micro_batch_tokens"


def exhaust_memory(*_):
    """A real allocation failure: the CPU allocator refuses a petabyte (CUDA raises OutOfMemoryError)."""
    torch.empty(1 << 50, dtype=torch.uint8)


def test_an_allocation_failure_in_a_train_step_names_the_budget_and_its_key(tmp_path):
    engine = TorchEngine(save_tiny_qwen2(tmp_path), optim=OptimSpec(lr=1e-3), micro_batch_tokens=64)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.model.model.layers[1].register_forward_hook(exhaust_memory)
    seqs = make_seqs(0, 6)
    with pytest.raises(OutOfMemory) as info, budget_named(KEY, 64, engine.device):
        engine.train_step(seqs, {"advantages": [np.ones(len(o), np.float32) for _, o in seqs]}, neg_mean_logprob)
    message = str(info.value)
    assert message.startswith(f"{KEY}=64: out of memory")
    assert "Lower graph.actor_train.micro_batch_tokens" in message and "can't allocate memory" in message
    # Nothing was stepped: the weights are those before the failed step.
    assert all(torch.equal(v, engine.model.state_dict()[k]) for k, v in before.items())


def test_cuda_out_of_memory_is_named_too_and_other_errors_pass_unchanged():
    with pytest.raises(OutOfMemory, match=r"^graph.ref.micro_batch_tokens=4096: out of memory"):
        with budget_named("graph.ref.micro_batch_tokens", 4096, torch.device("cpu")):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.27 GiB")
    with pytest.raises(RuntimeError, match="^shape mismatch$"):
        with budget_named(KEY, 64, torch.device("cpu")):
            raise RuntimeError("shape mismatch")
