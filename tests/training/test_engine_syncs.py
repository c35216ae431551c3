"""What a GPU train step pays beyond its kernels, checked where it can be on the CPU: the packed
attention runs in the compute dtype under bf16 autocast (else varlen leaves the flash kernel for
the per-document loop on CUDA), and the host reads tensor values a bounded number of times per
step, however many micro-batches and layers there are (each read is a device synchronisation on
a GPU). tools/bench_engine.py --profile counts the real synchronisations on CUDA."""

import pytest
import torch
from engine_helpers import make_seqs, make_token_data, ppo_loss_fn, save_tiny_qwen2

from areal_flow.training import attention as A
from areal_flow.training.torch_engine import TorchEngine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


def test_under_bf16_autocast_the_packed_attention_gets_q_k_and_v_in_bf16(model_dir, monkeypatch):
    """transformers' rotary embedding hands q and k over in fp32 (the residual stream's dtype over
    fp32 weights), v in bf16. On CUDA varlen_attention runs the flash kernel only for a bf16 q."""
    seen = []
    real = A.per_document_attention  # varlen's path on the CPU: it sees what the kernel would

    def spy(q, k, v, packing, scale=None):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, packing, scale)

    monkeypatch.setattr(A, "per_document_attention", spy)
    TorchEngine(model_dir, attention="varlen", bf16=True).logprobs(make_seqs(0, 3))
    assert seen and set(seen) == {(torch.bfloat16,) * 3}
    seen.clear()
    TorchEngine(model_dir, attention="varlen").logprobs(make_seqs(0, 3))  # fp32: nothing is cast
    assert set(seen) == {(torch.float32,) * 3}


@pytest.mark.gpu
def test_the_bf16_engine_on_cuda_runs_the_varlen_kernel_and_never_the_per_document_loop(model_dir, monkeypatch):
    if not A.varlen_kernel_works("cuda"):  # probed first: the probe itself runs both paths
        pytest.skip("torch's varlen kernel does not run here")
    calls = []
    real = A._varlen_kernel_call
    monkeypatch.setattr(A, "_varlen_kernel_call", lambda *a: calls.append(a[0].dtype) or real(*a))
    monkeypatch.setattr(A, "per_document_attention", lambda *a: pytest.fail("the per-document loop ran"))
    seqs = make_seqs(0, 6)
    engine = TorchEngine(model_dir, optim=None, device="cuda", attention="varlen", bf16=True)
    engine.logprobs(seqs)
    assert calls and set(calls) == {torch.bfloat16}
