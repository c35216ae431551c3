"""Chunked logprobs and entropy (training/logprobs.py) against the full [T, V] computation, alone,
vocabulary-parallel over gloo ranks, and inside the torch and megatron engines."""

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from engine_helpers import (EXACT, assert_all_close, assert_same_weights, full_weights, make_seqs, make_token_data,
                            ppo_loss_fn, reference_logprobs, run_ranks, save_tiny_qwen2)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from areal_flow.algorithms.ppo import decoupled_ppo_loss
from areal_flow.training import logprobs as L
from areal_flow.training.logprobs import chunked_logprobs, full_logprobs, vocab_parallel_logprobs
from areal_flow.training.torch_engine import TorchEngine

T, H, V = 23, 8, 30


def _inputs(seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g).requires_grad_()
    weight = (0.5 * torch.randn(V, H, generator=g)).requires_grad_()
    b = (0.1 * torch.randn(V, generator=g)).requires_grad_() if bias else None
    targets = torch.randint(0, V, (T,), generator=g)
    return hidden, weight, b, targets, torch.randn(T, generator=g), torch.randn(T, generator=g)  # and g_lp, g_ent


def _values_and_grads(fn, hidden, weight, bias, g_lp, g_ent):
    """(logp, entropy, d hidden, d weight, d bias) of the loss Σ g_lp·logp + g_ent·entropy."""
    lp, ent = fn(hidden, weight, bias)
    params = [t for t in (hidden, weight, bias) if t is not None]
    return [lp, ent, *torch.autograd.grad((g_lp * lp + g_ent * ent).sum(), params)]


def _full(temperature, targets):
    return lambda h, w, b: full_logprobs(h @ w.T + (0 if b is None else b), targets, temperature=temperature,
                                         entropy=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 7, T, T + 5, 0])
def test_chunked_logprobs_entropy_and_gradients_equal_the_full_computation(chunk, temperature):
    hidden, weight, bias, targets, g_lp, g_ent = _inputs()
    chunked = lambda h, w, b: chunked_logprobs(h, w, targets, temperature=temperature, chunk_tokens=chunk,  # noqa: E731
                                               entropy=True, bias=b)
    got = _values_and_grads(chunked, hidden, weight, bias, g_lp, g_ent)
    want = _values_and_grads(_full(temperature, targets), hidden, weight, bias, g_lp, g_ent)
    for name, a, b in zip(("logp", "entropy", "d_hidden", "d_weight", "d_bias"), got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)
    assert (want[1] > 0).all() and not torch.allclose(want[2], torch.zeros_like(want[2]))  # not a vacuous check
    # Without grad mode (the inference nodes): the same values, no autograd node.
    with torch.no_grad():
        lp, ent = chunked_logprobs(hidden, weight, targets, temperature=temperature, chunk_tokens=chunk,
                                   entropy=True, bias=bias)
    assert lp.grad_fn is None and ent.grad_fn is None
    torch.testing.assert_close(lp, want[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, want[1], atol=1e-5, rtol=0)


def test_only_the_outputs_asked_for_are_computed_and_differentiated():
    hidden, weight, _, targets, _, g_ent = _inputs(bias=False)
    lp, ent = chunked_logprobs(hidden, weight, targets, chunk_tokens=5)
    assert ent is None
    torch.testing.assert_close(lp, full_logprobs(hidden @ weight.T, targets)[0], atol=1e-5, rtol=0)
    # A loss of the entropy alone: the logprob's gradient is None inside, and skipped.
    _, ent = chunked_logprobs(hidden, weight, targets, chunk_tokens=5, entropy=True)
    got = torch.autograd.grad((g_ent * ent).sum(), (hidden, weight))
    want = torch.autograd.grad((g_ent * full_logprobs(hidden @ weight.T, targets, entropy=True)[1]).sum(),
                               (hidden, weight))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_under_bf16_autocast_the_logits_are_bf16_and_the_results_fp32():
    hidden, weight, _, targets, g_lp, _ = _inputs(bias=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = chunked_logprobs(hidden, weight, targets, chunk_tokens=4)
        want, _ = full_logprobs(hidden @ weight.T, targets)  # autocast: a bf16 matmul, then fp32
    got = torch.autograd.grad((g_lp * lp).sum(), (hidden, weight))
    assert lp.dtype == torch.float32 and all(g.dtype == torch.float32 for g in got)
    torch.testing.assert_close(lp, want, atol=1e-5, rtol=0)  # the same bf16 logits, upcast alike
    assert not torch.allclose(lp, full_logprobs(hidden @ weight.T, targets)[0], atol=1e-4)  # and not fp32 ones


def test_bad_shapes_are_refused_naming_them():
    hidden, weight, _, targets, _, _ = _inputs()
    with pytest.raises(ValueError, match=r"targets has shape \(22,\), hidden has 23 tokens"):
        chunked_logprobs(hidden, weight, targets[1:])
    with pytest.raises(ValueError, match=r"weight \(30, 7\)"):
        chunked_logprobs(hidden, weight[:, 1:], targets)


class LargestTensor(TorchDispatchMode):
    """The largest number of elements of any tensor an op made while entered (backward included)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_no_op_makes_a_tensor_of_tokens_times_vocabulary():
    n, vocab, chunk = 64, 300, 4  # T·V = 19,200 elements; chunk·V and V·H = 1,200 and 2,400
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, H, generator=g, requires_grad=True)
    weight = torch.randn(vocab, H, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), generator=g)
    bound = max(chunk * vocab, vocab * H, n * H)
    with LargestTensor() as seen:
        lp, ent = chunked_logprobs(hidden, weight, targets, chunk_tokens=chunk, entropy=True)
        (lp.sum() + ent.sum()).backward()
    assert seen.numel <= bound < n * vocab
    with LargestTensor() as old:  # the old path, logits of every token at once, fails the same bound
        lp, ent = full_logprobs(hidden @ weight.T, targets, entropy=True)
        (lp.sum() + ent.sum()).backward()
    assert old.numel >= n * vocab


def test_the_policy_loss_reports_the_entropy_of_valid_tokens_and_adds_no_term():
    g = torch.Generator().manual_seed(0)
    logp = (-1 - torch.rand(6, generator=g)).requires_grad_()
    behav, adv = logp.detach() + 0.1, torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, 1.0])
    mask = torch.tensor([True, True, False, True, True, False])
    entropy = torch.tensor([1.0, 2.0, float("nan"), 3.0, 4.0, float("inf")], requires_grad=True)
    plain, plain_stats = decoupled_ppo_loss(logp, None, behav, adv, mask, eps_clip=0.2)
    loss, stats = decoupled_ppo_loss(logp, None, behav, adv, mask, eps_clip=0.2, entropy=entropy)
    assert stats["entropy_sum"].item() == 10.0 and "entropy_sum" not in plain_stats  # masked NaN/inf left out
    assert torch.equal(loss, plain) and not stats["entropy_sum"].requires_grad
    with pytest.raises(ValueError, match=r"entropy has shape \(5,\)"):
        decoupled_ppo_loss(logp, None, behav, adv, mask, eps_clip=0.2, entropy=entropy[:5])


# ---------------------------------------------------------------- vocabulary-parallel (run on two ranks below)


def _vocab_parallel_checks(rank):
    """vocab_parallel_logprobs over the default group equals chunked_logprobs on one rank."""
    world = dist.get_world_size()
    for temperature, chunk in ((1.0, 7), (0.7, 1), (0.7, 0)):
        hidden, weight, bias, targets, g_lp, g_ent = _inputs()
        rows = slice(rank * V // world, (rank + 1) * V // world)
        want = _values_and_grads(lambda h, w, b: chunked_logprobs(h, w, targets, temperature=temperature,
                                                                 chunk_tokens=chunk, entropy=True, bias=b),
                                 hidden, weight, bias, g_lp, g_ent)
        w_shard, b_shard = weight.detach()[rows].requires_grad_(), bias.detach()[rows].requires_grad_()
        got = _values_and_grads(lambda h, w, b: vocab_parallel_logprobs(
            h, w, targets, vocab_start=rows.start, group=dist.group.WORLD, temperature=temperature,
            chunk_tokens=chunk, entropy=True, bias=b), hidden, w_shard, b_shard, g_lp, g_ent)
        # The hidden's gradient is this rank's part: the sum over the group is the whole.
        dist.all_reduce(got[2])
        for name, a, b in zip(("logp", "entropy", "d_hidden", "d_weight", "d_bias"), got,
                              [*want[:3], want[3][rows], want[4][rows]]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=f"{name} T={temperature} chunk={chunk}")
    assert len(set(targets.div(V // world, rounding_mode="floor").tolist())) == world  # both shards hold targets


# ---------------------------------------------------------------- torch engine


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {tied: save_tiny_qwen2(root / f"tied{tied}", tie_word_embeddings=tied) for tied in (False, True)}


def _full_path(engine: TorchEngine) -> TorchEngine:
    """The engine on the path that computes the whole [tokens, vocab] logits (the old one)."""
    engine._routable_head = False
    return engine


def entropy_loss_fn(logprobs, batch, mask, n_valid_tokens):
    """The PPO loss minus 0.1 × the mean entropy: a gradient through both outputs."""
    loss, stats = decoupled_ppo_loss(
        logprobs, batch["prox_logprobs"].float(), batch["behav_logprobs"].float(), batch["advantages"].float(), mask,
        eps_clip=0.2, behav_weight_cap=2.0, n_valid_tokens=n_valid_tokens, entropy=batch["entropy"])
    return loss - 0.1 * (batch["entropy"] * mask).sum() / n_valid_tokens, stats


@pytest.mark.parametrize("tied", [False, True])
def test_the_engine_computes_and_trains_with_chunks_as_with_the_whole_logits(model_dirs, tied):
    seqs = make_seqs(3, 8)
    data = make_token_data(seqs, 3)
    kw = dict(micro_batch_tokens=60, temperature=0.7, entropy=True, **EXACT)
    chunked = TorchEngine(model_dirs[tied], logprob_chunk_tokens=3, **kw)
    whole = _full_path(TorchEngine(model_dirs[tied], **kw))
    assert chunked._routable_head
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dirs[tied], dtype=torch.float32)
    assert_all_close(chunked.logprobs(seqs), reference_logprobs(hf, seqs, 0.7), atol=1e-5)
    assert_all_close(chunked.logprobs(seqs), whole.logprobs(seqs), atol=1e-5)
    for _ in range(2):
        got, want = chunked.train_step(seqs, data, entropy_loss_fn), whole.train_step(seqs, data, entropy_loss_fn)
        for key in ("loss", "grad_norm", "entropy_sum", "clipped_tokens", "behav_weight_sum"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert got["entropy_sum"] > 0
    assert_same_weights(full_weights(chunked), full_weights(whole))


def test_the_entropy_the_loss_function_gets_is_that_of_the_whole_logits(model_dirs):
    import transformers

    seqs = make_seqs(4, 5)
    engine = TorchEngine(model_dirs[False], temperature=0.7, logprob_chunk_tokens=2, entropy=True, **EXACT)
    seen = []

    def record(logprobs, batch, mask, n_valid_tokens):
        seen.append((batch["token"], batch["entropy"].detach()))
        return (logprobs * 0).sum(), {}

    starts = np.cumsum([0] + [len(o) for _, o in seqs])
    engine.train_step(seqs, {"token": [np.arange(len(o)) + s for (_, o), s in zip(seqs, starts)]}, record)
    token = torch.cat([t for t, _ in seen])
    got = torch.empty(len(token))
    got[token] = torch.cat([e for _, e in seen])  # back in the order of the sequences
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dirs[False], dtype=torch.float32)
    want = []
    with torch.no_grad():
        for prompt, output in seqs:
            logits = hf(torch.from_numpy(np.concatenate([prompt, output]))[None]).logits[0, len(prompt) - 1:-1]
            want.append(full_logprobs(logits, torch.from_numpy(output), temperature=0.7, entropy=True)[1])
    torch.testing.assert_close(got, torch.cat(want), atol=1e-5, rtol=0)


def test_the_engine_never_makes_the_tokens_times_vocabulary_logits(tmp_path):
    model_dir = save_tiny_qwen2(tmp_path / "m", vocab_size=512)
    seqs = make_seqs(5, 8)
    n_out = sum(len(o) for _, o in seqs)
    bound = 512 * 32  # the LM head's weight [V, H], the largest tensor a chunk of 4 tokens needs
    assert n_out * 512 > bound
    for chunk, within in ((4, True), (0, False)):  # 0: one chunk, all the logits at once
        engine = TorchEngine(model_dir, logprob_chunk_tokens=chunk, **EXACT)
        with LargestTensor() as seen:
            engine.logprobs(seqs)
            engine.train_step(seqs, make_token_data(seqs, 5), ppo_loss_fn)
        assert (seen.numel <= bound) is within, (chunk, seen.numel)


def test_a_model_that_transforms_its_logits_takes_the_full_path(tmp_path):
    model_dir = save_tiny_qwen2(tmp_path / "m")
    engine = TorchEngine(model_dir)
    assert engine._routable_head
    engine._model.config.final_logit_softcapping = 30.0  # as Gemma's
    from areal_flow.training.hf_model import routable_lm_head

    assert not routable_lm_head(engine._model)
    with pytest.raises(ValueError, match="logprob_chunk_tokens must be >= 0"):
        TorchEngine(model_dir, logprob_chunk_tokens=-1)


# ---------------------------------------------------------------- FSDP2 and megatron TP


def _fsdp_tied_rank(rank, model_dir, out_dir):
    seqs = make_seqs(6, 8)
    data = make_token_data(seqs, 6)
    engine = TorchEngine(model_dir, micro_batch_tokens=40, logprob_chunk_tokens=3, entropy=True,
                         process_group=dist.group.WORLD, **EXACT)
    lo, hi = (0, 3) if rank == 0 else (3, len(seqs))
    result = {"logprobs": engine.logprobs(seqs[lo:hi]),
              "stats": engine.train_step(seqs[lo:hi], {k: v[lo:hi] for k, v in data.items()}, entropy_loss_fn)}
    result["weights"] = full_weights(engine)
    torch.save(result, os.path.join(out_dir, f"fsdp{rank}.pt"))


@pytest.mark.slow  # processes of its own: the full suite runs it, the fast tier does not
def test_fsdp2_with_tied_embeddings_trains_through_the_chunked_head_like_the_whole_logits(model_dirs, tmp_path):
    run_ranks(_fsdp_tied_rank, 2, model_dirs[True], str(tmp_path))
    seqs = make_seqs(6, 8)
    data = make_token_data(seqs, 6)
    whole = _full_path(TorchEngine(model_dirs[True], micro_batch_tokens=40, entropy=True, **EXACT))
    expected = whole.logprobs(seqs)
    want = whole.train_step(seqs, data, entropy_loss_fn)
    ranks = [torch.load(tmp_path / f"fsdp{r}.pt", weights_only=False) for r in range(2)]
    assert_all_close(ranks[0]["logprobs"] + ranks[1]["logprobs"], expected, atol=1e-5)
    for key in ("loss", "grad_norm", "entropy_sum"):
        assert ranks[0]["stats"][key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    for r in ranks:
        assert_same_weights(r["weights"], full_weights(whole))


def _megatron_rank(rank, model_dir, out_dir):
    from areal_flow.training.megatron.engine import MegatronEngine

    _vocab_parallel_checks(rank)  # in these processes: each start of a group of ranks costs seconds
    seqs = make_seqs(8, 8)
    data = make_token_data(seqs, 8)
    for sp in (False, True):  # sequence parallel: the hidden states are gathered over the sequence first
        engine = MegatronEngine(model_dir, micro_batch_tokens=40, temperature=0.7, tp=2, logprob_chunk_tokens=3,
                                entropy=True, sequence_parallel=sp, **EXACT)
        result = {"logprobs": engine.logprobs(seqs), "stats": engine.train_step(seqs, data, entropy_loss_fn)}
        result["weights"] = full_weights(engine)
        torch.save(result, os.path.join(out_dir, f"megatron{rank}_sp{sp}.pt"))


@pytest.mark.slow  # processes of its own: the full suite runs it, the fast tier does not
def test_vocab_parallel_and_megatron_tp2_with_small_chunks_equal_one_rank_and_the_whole_logits(model_dirs, tmp_path):
    """Two gloo ranks: vocab_parallel_logprobs against one rank's (values and gradients), then a TP=2
    megatron engine (tied embeddings: the shared embedding's vocabulary shard), without and with
    sequence parallelism, with chunks of 3 tokens and entropy in the loss against the torch engine's
    whole-logits path."""
    run_ranks(_megatron_rank, 2, model_dirs[True], str(tmp_path), timeout=240)
    seqs = make_seqs(8, 8)
    data = make_token_data(seqs, 8)
    whole = _full_path(TorchEngine(model_dirs[True], micro_batch_tokens=40, temperature=0.7, entropy=True, **EXACT))
    expected = whole.logprobs(seqs)
    want = whole.train_step(seqs, data, entropy_loss_fn)
    for r, sp in ((0, False), (1, False), (0, True), (1, True)):
        result = torch.load(tmp_path / f"megatron{r}_sp{sp}.pt", weights_only=False)
        assert_all_close(result["logprobs"], expected, atol=1e-5)
        for key in ("loss", "grad_norm", "entropy_sum"):
            assert result["stats"][key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        assert_same_weights(result["weights"], full_weights(whole))


# ---------------------------------------------------------------- the compiled chunk


def _chunk_case(dtype):
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(48, 500, generator=g)).to(dtype)
    lse = torch.logsumexp(logits.float() / 0.7, dim=-1)
    ent = torch.rand(48, generator=g)
    return (logits, torch.randint(0, 500, (48,), generator=g), lse, ent, torch.randn(48, generator=g),
            torch.randn(48, generator=g))


@pytest.mark.slow  # two compilations: about 10 s
def test_the_chunk_math_compiles_whole_and_agrees_with_the_eager_math():
    """On CUDA the head's per-chunk statistics and gradient run compiled (their fp32 passes fused);
    here the same functions compile whole (fullgraph: no graph break, no Python fallback) with
    inductor's CPU backend and agree with the eager ones, in bf16 at temperature 0.7 with entropy."""
    logits, local, lse, ent, g_lp, g_ent = _chunk_case(torch.bfloat16)
    stats, grad = L._compiled()
    for want, got in zip(L._chunk_stats(logits.clone(), local, 0.7, True), stats(logits.clone(), local, 0.7, True)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    args = (lse, ent, g_lp, g_ent, local, g_lp.clone(), 0.7)
    want, got = L._chunk_grad(logits.clone(), *args), grad(logits.clone(), *args)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0.02)  # one bf16 step at most


def test_a_compiled_chunk_that_fails_falls_back_to_the_eager_math_warning_once(monkeypatch):
    logits, local, lse, ent, g_lp, g_ent = _chunk_case(torch.float32)
    monkeypatch.setattr(L, "_compile_failed", False)

    def broken(*args):
        raise RuntimeError("inductor could not lower it")

    with pytest.warns(UserWarning, match="the compiled LM-head chunk failed .*inductor could not lower it.*eagerly"):
        got = L._guarded(broken, 0)(logits.clone(), local, 0.7, True)
    assert L._compile_failed is True and L._kernels(torch.device("cuda")) == L._EAGER
    for a, b in zip(got, L._chunk_stats(logits.clone(), local, 0.7, True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert L._kernels(torch.device("cpu")) == L._EAGER


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_on_cuda_the_compiled_chunk_is_taken_and_agrees_with_the_eager_one():
    """bf16 autocast, forward and backward with entropy at temperature 0.7: the compiled chunk math
    (the path on CUDA) against `COMPILE_ON_CUDA = False`; no compilation failed."""
    n, hidden_size, vocab = 4096, 512, 32000
    g = torch.Generator(device="cuda").manual_seed(1)
    inputs = [torch.randn(n, hidden_size, device="cuda", generator=g),
              0.05 * torch.randn(vocab, hidden_size, device="cuda", generator=g)]
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    results = {}
    for compiled in (True, False):
        L.COMPILE_ON_CUDA = compiled
        try:
            hidden, weight = (t.clone().requires_grad_() for t in inputs)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                lp, ent = chunked_logprobs(hidden, weight, targets, chunk_tokens=1024, entropy=True, temperature=0.7)
            (lp.sum() + 0.5 * ent.sum()).backward()
            results[compiled] = [lp.detach(), ent.detach(), hidden.grad, weight.grad]
        finally:
            L.COMPILE_ON_CUDA = True
    assert not L._compile_failed
    for got, want in zip(results[True], results[False]):
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)



@pytest.mark.gpu
def test_on_cuda_the_peak_memory_is_a_chunks_not_the_logits_and_bf16_agrees():
    """16k tokens of a 152k vocabulary: the fp32 logits alone would take 10 GB. Chunked under bf16
    autocast, forward and backward (with entropy) stay under half of that; the values agree with
    the full bf16-autocast computation."""
    n, hidden_size, vocab, chunk = 16384, 1024, 152064, 512
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, hidden_size, device="cuda", generator=g).requires_grad_()
    weight = (0.02 * torch.randn(vocab, hidden_size, device="cuda", generator=g)).requires_grad_()
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    logits_bytes = n * vocab * 4
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lp, ent = chunked_logprobs(hidden, weight, targets, chunk_tokens=chunk, entropy=True)
    (lp.sum() + ent.sum()).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < logits_bytes / 2, f"peak {peak / 2**30:.2f} GiB"
    assert weight.grad.dtype == torch.float32 and torch.isfinite(weight.grad).all() and torch.isfinite(hidden.grad).all()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        rows = slice(0, 2048)  # the full computation on a slice: its logits in bf16, then fp32
        want_lp, want_ent = full_logprobs(hidden[rows] @ weight.T, targets[rows], entropy=True)
    torch.testing.assert_close(lp[rows].detach(), want_lp, atol=0.02, rtol=0)
    torch.testing.assert_close(ent[rows].detach(), want_ent, atol=0.02, rtol=0)
