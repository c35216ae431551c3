"""The torch engine on CUDA: fp32 agrees with the CPU, bf16 mixed precision and activation
checkpointing train. Marked `gpu`: skipped where no GPU is present."""

import numpy as np
import pytest
import torch
from engine_helpers import SGD_LIKE, make_seqs, make_token_data, neg_mean_logprob, ppo_loss_fn, save_tiny_qwen2

from areal_flow.training.engine import OptimSpec
from areal_flow.training.torch_engine import TorchEngine

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


@pytest.fixture(autouse=True)
def no_tf32():
    """TF32 matmuls round to 10 mantissa bits: fp32 comparisons need it off."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_fp32_logprobs_and_updates_on_cuda_agree_with_the_cpu(model_dir):
    seqs = make_seqs(0, 8)
    data = make_token_data(seqs, 0)
    cpu = TorchEngine(model_dir, optim=SGD_LIKE, micro_batch_tokens=64)  # weights compared across reduction orders
    gpu = TorchEngine(model_dir, optim=SGD_LIKE, micro_batch_tokens=64, device="cuda")
    for a, b in zip(cpu.logprobs(seqs), gpu.logprobs(seqs)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    s_cpu, s_gpu = cpu.train_step(seqs, data, ppo_loss_fn), gpu.train_step(seqs, data, ppo_loss_fn)
    assert s_gpu["loss"] == pytest.approx(s_cpu["loss"], abs=1e-5)
    for bucket_c, bucket_g in zip(cpu.export_weights(), gpu.export_weights()):
        for (name, c), (_, g) in zip(bucket_c, bucket_g):
            torch.testing.assert_close(g.cpu(), c, atol=1e-5, rtol=0, msg=name)


def test_bf16_with_activation_checkpointing_trains_and_stays_near_fp32(model_dir):
    seqs = make_seqs(1, 16)
    fp32 = TorchEngine(model_dir, micro_batch_tokens=128, device="cuda")
    bf16 = TorchEngine(model_dir, optim=OptimSpec(lr=1e-2), micro_batch_tokens=128, device="cuda", bf16=True,
                       activation_checkpointing=True)
    for a, b in zip(fp32.logprobs(seqs), bf16.logprobs(seqs)):
        np.testing.assert_allclose(a, b, atol=0.05, rtol=0)  # bf16 keeps ~3 significant digits
    losses = [bf16.train_step(seqs, {}, neg_mean_logprob)["loss"] for _ in range(5)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    # The master weights stay fp32 under bf16 compute.
    assert all(t.dtype == torch.float32 for bucket in bf16.export_weights() for _, t in bucket)


def test_activation_checkpointing_gives_the_same_gradients(model_dir):
    seqs = make_seqs(2, 8)
    grads = []
    for checkpointing in (False, True):
        engine = TorchEngine(model_dir, optim=OptimSpec(lr=0.0, grad_clip=0), micro_batch_tokens=64, device="cuda",
                             activation_checkpointing=checkpointing)
        seen = {}
        engine._optimizer.register_step_pre_hook(
            lambda *_, e=engine, seen=seen: seen.update({n: p.grad.clone() for n, p in e.model.named_parameters()}))
        engine.train_step(seqs, {}, neg_mean_logprob)
        grads.append(seen)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-5, msg=name)

