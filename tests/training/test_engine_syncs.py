"""What a GPU train step pays beyond its kernels, checked where it can be on the CPU: the packed
attention runs in the compute dtype under bf16 autocast (else varlen leaves the flash kernel for
the per-document loop on CUDA), and the host reads tensor values a bounded number of times per
step, however many micro-batches and layers there are (each read is a device synchronisation on
a GPU). tools/bench_engine.py --profile counts the real synchronisations on CUDA."""

import numpy as np
import pytest
import torch
from engine_helpers import make_seqs, make_token_data, ppo_loss_fn, save_tiny_qwen2

from areal_flow.training import attention as A
from areal_flow.training.engine import OptimSpec
from areal_flow.training.host_syncs import count_host_reads
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


def _reads_per_step(path: str, micro_batch_tokens: int, attention: str):
    seqs = make_seqs(0, 12)
    data = make_token_data(seqs, 1)
    engine = TorchEngine(path, optim=OptimSpec(), micro_batch_tokens=micro_batch_tokens, attention=attention)
    engine.train_step(seqs, data, ppo_loss_fn)  # first-step work (optimizer state) is not the steady state
    with count_host_reads() as reads:
        stats = engine.train_step(seqs, data, ppo_loss_fn)
    return reads, int(stats["n_micro_batches"])


@pytest.mark.parametrize("attention", ["varlen", "sdpa"])
def test_a_train_step_reads_the_device_twice_however_many_micro_batches_and_layers(tmp_path, attention):
    """The engine's own reads per step: the gradient norm (to skip a non-finite step) and the
    micro-batches' loss statistics, all in one copy. Before: a read of the statistics and one for
    the behaviour-weight histogram's boolean mask per micro-batch. transformers reads once per
    forward (its packed-sequence check, masking_utils.find_packed_sequence_indices), outside the
    engine: counted apart, and bounded by the number of forwards."""
    for layers in (1, 3):
        path = save_tiny_qwen2(tmp_path / f"layers{layers}", num_hidden_layers=layers)
        for budget in (512, 24):
            reads, micro_batches = _reads_per_step(path, budget, attention)
            assert micro_batches == (1 if budget == 512 else 7)
            assert reads.outside("transformers.") == 2, (layers, budget, reads)
            assert reads.total - reads.outside("transformers.") <= micro_batches, (layers, budget, reads)


def test_a_logprob_pass_copies_to_the_host_once(model_dir):
    engine = TorchEngine(model_dir, micro_batch_tokens=24)
    seqs = make_seqs(0, 12)
    want = engine.logprobs(seqs)
    with count_host_reads() as reads:
        got = engine.logprobs(seqs)
    assert reads.outside("transformers.") == 2  # .cpu() and .numpy() of the whole call's logprobs
    assert [len(x) for x in got] == [len(o) for _, o in seqs]
    assert all(np.array_equal(x, y) for x, y in zip(got, want))


@pytest.mark.gpu
def test_a_bf16_train_step_on_cuda_synchronises_about_once_per_extra_micro_batch(model_dir):
    """Every synchronisation torch makes, copies included. Per micro-batch there remain
    transformers' packed-sequence check and, in torch, embedding's backward (it reads its segment
    count); before, each input copy (about ten per micro-batch), the statistics and the histogram's
    mask were one each."""
    from areal_flow.training.host_syncs import count_cuda_syncs

    seqs = make_seqs(0, 12)
    data = make_token_data(seqs, 1)
    syncs = {}
    for budget in (512, 24):
        engine = TorchEngine(model_dir, optim=OptimSpec(), micro_batch_tokens=budget, device="cuda", bf16=True)
        engine.train_step(seqs, data, ppo_loss_fn)  # warm: optimizer state, pinned host blocks
        with count_cuda_syncs() as where:
            stats = engine.train_step(seqs, data, ppo_loss_fn)
        syncs[int(stats["n_micro_batches"])] = where
    (one, few), (many, lots) = sorted(syncs.items())
    assert (one, many) == (1, 7)
    assert sum(lots.values()) - sum(few.values()) <= 2 * (many - one), (dict(few), dict(lots))
