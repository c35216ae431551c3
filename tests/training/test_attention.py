"""Packed attention without a dense mask (training/attention.py): each implementation against the
dense-mask reference, the torch engine with each `attention` against transformers' sdpa, no
[T, T] mask on the new paths, and megatron's THD core attention. CUDA checks are marked `gpu`."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from engine_helpers import EXACT, assert_all_close, assert_same_weights, full_weights, make_seqs, make_token_data, \
    ppo_loss_fn, reference_logprobs, save_tiny_qwen2

from areal_flow.training import attention as A
from areal_flow.training import documents as D
from areal_flow.training.torch_engine import TorchEngine

CASES = {
    "short_and_long": [5, 130, 1, 7, 200, 40],  # under and over one 128-token flex block
    "single": [77],
    "one_token_docs": [1] * 150,
    "exact_blocks": [128, 128],
}


def _cu(lengths) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def _qkv(total: int, dtype=torch.float32, device="cpu", heads=4, kv_heads=2, dim=16):
    gen = torch.Generator(device=device).manual_seed(total)
    return [torch.randn(total, h, dim, generator=gen, device=device, dtype=dtype).requires_grad_()
            for h in (heads, kv_heads, kv_heads)]


def _forward_and_grads(implementation: str, lengths, scale=None, dtype=torch.float32, device="cpu"):
    q, k, v = _qkv(sum(lengths), dtype, device)
    cu = _cu(lengths).to(device)
    packing = D.packing_from_cu_seqlens(cu, max(lengths), sum(lengths), implementation)
    out = A.IMPLEMENTATIONS[implementation](q, k, v, packing, scale)
    weights = torch.linspace(-1, 1, out.numel(), device=device).view_as(out)  # every output counts differently
    grads = torch.autograd.grad((out.float() * weights).sum(), (q, k, v))
    return [out.detach().float(), *(g.float() for g in grads)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("implementation", ["varlen", "flex"])
def test_each_implementation_matches_the_dense_mask_forward_and_gradients(implementation, case):
    lengths = CASES[case]
    got = _forward_and_grads(implementation, lengths, scale=0.3)
    want = _forward_and_grads("sdpa", lengths, scale=0.3)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0, msg=f"{implementation} {case} {name}")
    # The comparison can fail: attention across the documents gives another result.
    if len(lengths) > 1:
        leaky = _forward_and_grads("sdpa", [sum(lengths)], scale=0.3)
        assert (leaky[0] - want[0]).abs().max() > 1e-2


def test_the_flex_block_mask_marks_exactly_the_blocks_the_dense_mask_needs():
    """Eager (CPU) flex reads only the mask function; the compiled kernel trusts the block mask, so
    it is checked here block by block: no needed block missing, a full block only where all of it
    is visible (the kernel skips the mask function there)."""
    for lengths in [*CASES.values(), [127, 1, 256, 3], [300]]:
        total = sum(lengths)
        bm = D.document_block_mask(_cu(lengths), total)
        padded = bm.seq_lengths[0]
        assert padded % D.FLEX_BLOCK == 0 and padded - total < D.FLEX_BLOCK
        n = padded // D.FLEX_BLOCK
        blocks = A.dense_mask(_cu(lengths), padded).view(n, D.FLEX_BLOCK, n, D.FLEX_BLOCK).transpose(1, 2)
        listed = {}
        for kind, num, idx in (("partial", bm.kv_num_blocks, bm.kv_indices),
                               ("full", bm.full_kv_num_blocks, bm.full_kv_indices)):
            listed[kind] = torch.zeros(n, n, dtype=torch.bool)
            for i in range(n):
                listed[kind][i, idx[0, 0, i, :num[0, 0, i]].long()] = True
        assert not (listed["partial"] & listed["full"]).any()
        assert torch.equal(listed["partial"] | listed["full"], blocks.any(-1).any(-1)), lengths
        assert torch.equal(listed["full"], blocks.all(-1).all(-1)), lengths


def test_document_boundaries_come_from_restarting_positions_of_every_row():
    positions = np.array([[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]])  # row 2 starts a document too
    np.testing.assert_array_equal(D.cu_seqlens_from_positions(positions), [0, 3, 5, 6, 8, 12])
    groups = D.document_groups([0, 3, 5, 6, 8, 12])
    assert len(groups.index) < 5  # documents of similar length share one SDPA call


def test_resolve_picks_a_cpu_implementation_and_names_the_choices_for_an_unknown_one():
    assert A.resolve("auto", "cpu") == A.CPU_AUTO == "sdpa"
    assert [A.resolve(a, "cpu") for a in ("sdpa", "varlen", "flex", "flex_attention")] == \
        ["sdpa", "varlen", "flex", "flex"]
    with pytest.raises(ValueError, match=r"attention must be one of auto, sdpa, varlen, flex, got 'flash'"):
        A.resolve("flash", "cpu")


# ---------------------------------------------------------------------------- the torch engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"))


def _seqs():
    # Some sequences longer than a 16-token row, so rows and the dummy fill both occur.
    return make_seqs(7, 10) + [(np.arange(9) % 18, np.arange(14) % 18)]


@pytest.mark.parametrize("row_tokens", [None, 16])
@pytest.mark.parametrize("attention", ["varlen", "flex", "auto"])
def test_the_engine_gives_sdpa_logprobs_and_updates_with_each_attention(model_dir, attention, row_tokens):
    seqs = _seqs()
    data = make_token_data(seqs, 7)
    engines = {a: TorchEngine(model_dir, micro_batch_tokens=10_000, row_tokens=row_tokens, attention=a, **EXACT)
               for a in ("sdpa", attention)}
    assert engines[attention].attention == A.resolve(attention, "cpu")
    got, want = engines[attention].logprobs(seqs), engines["sdpa"].logprobs(seqs)
    assert_all_close(got, want, atol=1e-5)
    # The registered attention also runs a plain forward (no packing given, one sequence per row).
    assert_all_close(reference_logprobs(engines[attention].model, seqs[:3]), want[:3], atol=1e-5)
    stats = {a: e.train_step(seqs, data, ppo_loss_fn) for a, e in engines.items()}
    for key in ("loss", "grad_norm"):
        assert stats[attention][key] == pytest.approx(stats["sdpa"][key], rel=1e-5, abs=1e-7), key
    assert_same_weights(full_weights(engines[attention]), full_weights(engines["sdpa"]))


def test_the_critic_with_varlen_gives_sdpa_values_and_updates(model_dir):
    seqs = _seqs()
    returns = {"returns": [np.linspace(-1, 1, len(o)) for _, o in seqs]}

    def value_loss(values, batch, mask, n):
        return (((values - batch["returns"].float()) ** 2) * mask).sum() / n, {}

    engines = {a: TorchEngine(model_dir, micro_batch_tokens=10_000, head="value", attention=a, **EXACT)
               for a in ("sdpa", "varlen")}
    for e in engines.values():  # a value head that is not zero, so that attention reaches the values
        with torch.no_grad():
            e.model.score.weight.normal_(generator=torch.Generator().manual_seed(0))
    assert_all_close(engines["varlen"].logprobs(seqs), engines["sdpa"].logprobs(seqs), atol=1e-5)
    for e in engines.values():
        e.train_step(seqs, returns, value_loss)
    assert_same_weights(full_weights(engines["varlen"]), full_weights(engines["sdpa"]))


@pytest.mark.parametrize("attention", ["varlen", "flex"])
def test_no_dense_mask_is_built_on_the_packed_paths(model_dir, monkeypatch, attention):
    """Spies on every SDPA call: the packed paths pass no mask (only is_causal over one document),
    while transformers' sdpa, the control, passes a [T, T] one."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *args, **kwargs):
        calls.append((q.shape[-2], None if attn_mask is None else tuple(attn_mask.shape[-2:])))
        return sdpa(q, k, v, attn_mask, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(A, "dense_mask", lambda *a: pytest.fail("the dense reference mask was built"))
    built = []
    real = D.packing_from_positions
    monkeypatch.setattr(D, "packing_from_positions", lambda *a: built.append(a) or real(*a))
    seqs = _seqs()
    total = sum(len(p) + len(o) for p, o in seqs)
    TorchEngine(model_dir, micro_batch_tokens=10_000, attention=attention).logprobs(seqs)
    assert len(built) == 1  # one forward: the packing is built once, not per layer
    assert all(mask is None for _, mask in calls)
    if attention == "varlen":  # batched per document: no call sees the whole row
        assert calls and max(n for n, _ in calls) < total
    calls.clear()
    TorchEngine(model_dir, micro_batch_tokens=10_000, attention="sdpa").logprobs(seqs)
    assert (total, (total, total)) in calls


def test_an_unknown_attention_is_refused_naming_the_choices(model_dir):
    with pytest.raises(ValueError, match=r"attention must be one of auto, sdpa, varlen, flex, got 'eager'"):
        TorchEngine(model_dir, attention="eager")


# ---------------------------------------------------------------------------- megatron


@pytest.mark.parametrize("attention", ["varlen", "flex", "auto"])
def test_megatron_thd_core_attention_matches_the_dense_mask(attention, monkeypatch):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig

    from areal_flow.training.megatron.model import SDPACoreAttention

    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               kv_channels=16, use_cpu_initialization=True)
    lengths = CASES["short_and_long"]
    cu = _cu(lengths)

    def run(name):
        layers = [SDPACoreAttention(config, i + 1, None, "self", attention=name) for i in range(2)]
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                                 max_seqlen_kv=max(lengths))
        q, k, v = _qkv(sum(lengths))
        out = layers[1](*(layers[0](q, k, v, None, packed_seq_params=params).view(q.shape), k, v), None,
                        packed_seq_params=params)
        assert out.shape == (sum(lengths), 4 * 16)
        return [out.detach(), *torch.autograd.grad((out * out).sum(), (q, k, v))]

    built = []
    real = D.packing_from_cu_seqlens
    monkeypatch.setattr(D, "packing_from_cu_seqlens", lambda *a: built.append(a) or real(*a))
    got = run(attention)
    assert len(built) == 1  # once per forward, shared by the layers
    for g, w in zip(got, run("sdpa")):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- CUDA


@pytest.fixture
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["short_and_long", "one_token_docs"])
@pytest.mark.parametrize("implementation", ["varlen", "flex"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_match_the_dense_mask(implementation, case, dtype, no_tf32):
    """bf16 runs the flash varlen kernel (fp32: the per-document path) and compiled flex; both
    against the fp32 dense reference on the same (rounded) inputs."""
    lengths = CASES[case]
    got = _forward_and_grads(implementation, lengths, dtype=dtype, device="cuda")
    q, k, v = (x.detach().float().requires_grad_() for x in _qkv(sum(lengths), dtype, "cuda"))
    packing = D.packing_from_cu_seqlens(_cu(lengths).cuda(), max(lengths), sum(lengths), "sdpa")
    out = A.sdpa_attention(q, k, v, packing)
    weights = torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)
    want = [out.detach(), *torch.autograd.grad((out * weights).sum(), (q, k, v))]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, atol=1e-5, rtol=0, msg=name)
        else:  # bf16 keeps ~3 significant digits: the error relative to the largest value (a
            # one-token document's q and k get no gradient at all: there the error itself stays tiny)
            assert float((g - w).abs().max()) < 0.03 * max(float(w.abs().max()), 1e-2), name


@pytest.mark.gpu
def test_auto_on_cuda_resolves_to_a_working_kernel_and_the_engine_agrees_with_sdpa(model_dir, no_tf32):
    chosen = A.resolve("auto", "cuda")
    assert chosen == ("varlen" if A.varlen_kernel_works("cuda") else "flex")
    got = _forward_and_grads(chosen, CASES["short_and_long"], dtype=torch.bfloat16, device="cuda")
    assert all(torch.isfinite(t).all() for t in got)
    seqs = _seqs()
    auto, sdpa = (TorchEngine(model_dir, micro_batch_tokens=10_000, device="cuda", attention=a) for a in ("auto", "sdpa"))
    assert_all_close(auto.logprobs(seqs), sdpa.logprobs(seqs), atol=1e-5)
    bf16 = TorchEngine(model_dir, micro_batch_tokens=10_000, device="cuda", attention="auto", bf16=True)
    assert_all_close(bf16.logprobs(seqs), sdpa.logprobs(seqs), atol=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
def test_the_varlen_probe_gives_the_same_answer_when_first_asked_without_gradients(context):
    """Megatron's first forward on the H200 was a logprob pass under no_grad: the probe's backward
    failed there and "auto" fell back to flex. The probe turns gradients on for itself."""
    with_grad = A._varlen_probe.__wrapped__("cuda:0")
    with getattr(torch, context)():
        assert A._varlen_probe.__wrapped__("cuda:0") == with_grad


@pytest.mark.gpu
def test_flex_on_cuda_with_heads_narrower_than_compiled_flex_takes_matches_sdpa(no_tf32):
    """Compiled flex refuses head dims under 16 on CUDA (the tiny test models have 8): the
    per-document loop runs instead, with the same result."""
    lengths = CASES["short_and_long"]
    q, k, v = (x[..., :8].detach().requires_grad_() for x in _qkv(sum(lengths), device="cuda"))
    cu = _cu(lengths).cuda()
    got = A.flex_attention(q, k, v, D.packing_from_cu_seqlens(cu, max(lengths), sum(lengths), "flex"))
    want = A.sdpa_attention(q, k, v, D.packing_from_cu_seqlens(cu, max(lengths), sum(lengths), "sdpa"))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kernel_gqa", ["takes", "refuses", "misreads"])
def test_varlen_without_enable_gqa_hands_the_kernel_kv_heads_as_they_are_where_it_takes_them(monkeypatch, kernel_gqa):
    """torch 2.11's varlen kernel (the GPU image's) has no enable_gqa: K and V were expanded to the
    query heads in every layer. A probe now asks the kernel once per device whether it takes fewer
    KV heads as they are (the flash kernel does) and expands only where it refuses them or reads
    them otherwise. The CUDA kernel cannot run here: a stand-in with its 2.11 signature, computing
    per-document SDPA, that takes grouped heads, raises on them, or pairs query head h with KV head
    h mod 2 instead of h // 2."""
    heads_seen = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        assert window_size == (-1, 0)  # causal
        heads_seen.append(k.shape[1])
        if k.shape[1] != q.shape[1]:
            if kernel_gqa == "refuses":
                raise RuntimeError("number of heads in key/value must equal the query's")
            if kernel_gqa == "misreads":
                k, v = k.repeat(1, 2, 1), v.repeat(1, 2, 1)  # heads 0 1 0 1, not 0 0 1 1
        return A.per_document_attention(q, k, v, D.Packing(cu_q, max_q, int(cu_q[-1])), scale)

    monkeypatch.setattr(A, "_varlen_kernel", lambda: (kernel, frozenset({"scale", "window_size"})))
    A._varlen_native_gqa.cache_clear()
    try:
        lengths = CASES["short_and_long"]
        q, k, v = _qkv(sum(lengths))
        packing = D.Packing(_cu(lengths), max(lengths), sum(lengths))
        out = A._varlen_kernel_call(q, k, v, packing, 0.3)
        native = kernel_gqa == "takes"
        assert heads_seen[-1] == (2 if native else 4)  # the layer's own call, after the probe's
        assert A._varlen_native_gqa("cpu") is native
        expected = A.per_document_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), packing, 0.3)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    finally:
        A._varlen_native_gqa.cache_clear()
