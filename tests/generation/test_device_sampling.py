"""`sample`: sampling as device tensor ops with no host sync, against host references (the numpy
seeded uniforms, a per-row CDF inversion, the distribution a row should draw from)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from areal_flow.generation.engine.sampling import (
    RowSampling,
    SamplingParams,
    device_seeded_uniforms,
    sample,
    sample_next_tokens,
    seeded_uniforms,
)

EDGE_SEEDS = [0, 1, 2, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 1, -1, -2, -(2**63), -(2**63) + 1]


def _as_int64(seeds):
    return torch.tensor([(s + 2**63) % 2**64 - 2**63 for s in seeds], dtype=torch.int64)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype == np.float64 and np.array_equal(a.view(np.uint64), b.view(np.uint64))


def test_the_device_uniforms_equal_the_numpy_ones_bit_for_bit():
    rng = random.Random(0)
    seeds = EDGE_SEEDS + [rng.randrange(-(2**63), 2**64) for _ in range(3000)]
    positions = [0, 1, 2, 10**6 - 1, 10**6] + [rng.randrange(0, 10**6 + 1) for _ in range(40)]
    grid_seeds = [s for s in seeds for _ in positions]
    grid_positions = positions * len(seeds)
    expected = seeded_uniforms(grid_seeds, grid_positions)
    got = device_seeded_uniforms(_as_int64(grid_seeds), torch.tensor(grid_positions)).numpy()
    assert _same_bits(got, expected)
    for seed in EDGE_SEEDS:  # every position 0..2^16 of the edge seeds (the lists' ints are slow beyond)
        every = np.arange(2**16 + 1)
        got = device_seeded_uniforms(_as_int64([seed]).expand(len(every)), torch.from_numpy(every)).numpy()
        assert _same_bits(got, seeded_uniforms([seed] * len(every), every.tolist()))
    # seeds equal mod 2^64 (2^64 - 1 and -1, 2^63 and -2^63) draw the same numbers, others differ
    assert len(set(seeded_uniforms(EDGE_SEEDS, [3] * len(EDGE_SEEDS)).tolist())) == len({s % 2**64 for s in EDGE_SEEDS})


def test_row_sampling_of_params():
    params = [SamplingParams(temperature=0.0, top_k=5), SamplingParams(seed=2**64 - 1),
              SamplingParams(seed=-(2**63)), SamplingParams(seed=2**63, min_p=0.0)]
    rows = RowSampling.of(params, "cpu")
    assert rows.seeds.tolist() == [0, -1, -(2**63), -(2**63)]
    assert rows.seeded.tolist() == [False, True, True, True]
    assert rows.top_k.dtype == torch.int64 and rows.temperature.dtype == torch.float32
    assert not rows.truncate  # only the greedy row cuts, and a greedy row never samples
    assert rows.sampled
    assert RowSampling.of([SamplingParams()], "cpu").seeded is None
    assert RowSampling.of([SamplingParams(top_p=0.9)], "cpu").truncate
    assert RowSampling.of([SamplingParams(min_p=0.1)], "cpu").truncate
    assert not RowSampling.of([SamplingParams(temperature=0.0)] * 2, "cpu").sampled
    picked = rows.select([3, 1])
    assert picked.seeds.tolist() == [-(2**63), -1] and picked.seeded.tolist() == [True, True]
    assert picked.select(torch.tensor([1])).seeds.tolist() == [-1]


def _reference_probs(logits_row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled row draws from: softmax(logits / T) cut to its top-k, top-p and
    min-p sets measured on the uncut distribution, renormalised, computed for the row alone."""
    lp = torch.log_softmax(logits_row / p.temperature, dim=-1)
    probs = lp.exp()
    order = probs.argsort(descending=True, stable=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    before = 0.0
    for rank, i in enumerate(order.tolist()):
        if (p.top_k < 0 or rank < p.top_k) and (p.top_p >= 1 or before <= p.top_p) \
                and probs[i] >= p.min_p * probs[order[0]]:
            keep[i] = True
        before += float(probs[i])
    return torch.softmax(lp.masked_fill(~keep, -math.inf), dim=-1)


def _mixed_batch(n=64, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(n, vocab, generator=g)
    rng = random.Random(seed)
    params = []
    for i in range(n):
        kind = i % 4
        params.append(SamplingParams(
            temperature=0.0 if kind == 0 else rng.choice([0.5, 1.0, 1.7]),
            top_k=rng.choice([-1, -1, 1, 4, 20]), top_p=rng.choice([1.0, 1.0, 0.9, 0.3]),
            min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
            seed=rng.choice(EDGE_SEEDS + [rng.randrange(2**64)]) if kind in (0, 1, 2) else None))
    positions = [rng.randrange(0, 10**6) for _ in range(n)]
    return logits, params, positions


def test_greedy_and_seeded_rows_match_a_per_row_reference():
    logits, params, positions = _mixed_batch()
    rows = RowSampling.of(params, "cpu")
    assert rows.truncate and rows.seeded is not None
    tokens, logprobs = sample(logits, rows, torch.tensor(positions), torch.Generator().manual_seed(0))
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    for r, p in enumerate(params):
        if p.temperature == 0.0:
            full = torch.log_softmax(logits[r], dim=-1)
            assert tokens[r].item() == full.argmax().item()
        else:
            full = torch.log_softmax(logits[r] / p.temperature, dim=-1)
            probs = _reference_probs(logits[r], p)
            assert probs[tokens[r]] > 0  # never a token outside the row's cut
            if p.seed is not None:  # the numpy CDF inversion at the numpy uniform
                cdf = np.cumsum(probs.double().numpy())
                u = seeded_uniforms([p.seed], [positions[r]])[0]
                assert tokens[r].item() == int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        torch.testing.assert_close(logprobs[r], full[tokens[r]], rtol=0, atol=1e-6)  # before truncation


def test_the_wrapper_and_row_selection_give_the_same_seeded_and_greedy_tokens():
    logits, params, positions = _mixed_batch(seed=1)
    rows = RowSampling.of(params, "cpu")
    tokens, logprobs = sample(logits, rows, torch.tensor(positions), torch.Generator().manual_seed(0))
    wrapped, wrapped_lp = sample_next_tokens(
        logits, rows.temperature, rows.top_p, rows.top_k, torch.Generator().manual_seed(7), min_p=rows.min_p,
        seeds=[p.seed for p in params], positions=positions)
    fixed = [r for r, p in enumerate(params) if p.seed is not None or p.temperature == 0.0]
    assert len(fixed) > 30
    assert wrapped[fixed].tolist() == tokens[fixed].tolist()
    torch.testing.assert_close(wrapped_lp[fixed], logprobs[fixed], rtol=0, atol=0)
    index = fixed[::-3]
    alone, alone_lp = sample(logits[index], rows.select(index), torch.tensor(positions)[index],
                             torch.Generator().manual_seed(3))
    assert alone.tolist() == tokens[index].tolist()
    torch.testing.assert_close(alone_lp, logprobs[index], rtol=0, atol=0)


def test_top_k_one_is_greedy():
    logits = torch.randn(500, 40, generator=torch.Generator().manual_seed(2))
    for seed in (None, 11):
        rows = RowSampling.of([SamplingParams(temperature=0.8, top_k=1, seed=seed)] * 500, "cpu")
        tokens, _ = sample(logits, rows, torch.arange(500), torch.Generator().manual_seed(0))
        assert tokens.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("seeded", [False, True])
def test_tokens_outside_top_p_and_min_p_are_never_drawn(seeded):
    n = 20000
    logits = torch.randn(1, 16, generator=torch.Generator().manual_seed(4)).repeat(n, 1)
    for p in (SamplingParams(temperature=0.9, top_p=0.6), SamplingParams(temperature=0.9, min_p=0.25)):
        params = [SamplingParams(temperature=p.temperature, top_p=p.top_p, min_p=p.min_p,
                                 seed=i if seeded else None) for i in range(n)]
        tokens, _ = sample(logits, RowSampling.of(params, "cpu"), torch.full((n,), 9),
                           torch.Generator().manual_seed(5))
        allowed = set((_reference_probs(logits[0], p) > 0).nonzero().squeeze(1).tolist())
        assert 1 < len(allowed) < 16  # a real cut
        assert set(tokens.tolist()) == allowed


@pytest.mark.parametrize("seeded", [False, True])
def test_drawn_rows_follow_their_distribution_and_never_draw_probability_zero(seeded):
    n = 20000
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -math.inf, -200.0])  # the last two: p = 0 in float32
    probs = torch.softmax(row, dim=-1)
    assert probs[6] == 0 and probs[7] == 0
    params = [SamplingParams(seed=i if seeded else None) for i in range(n)]
    tokens, logprobs = sample(row.repeat(n, 1), RowSampling.of(params, "cpu"), torch.full((n,), 17),
                              torch.Generator().manual_seed(6))
    counts = torch.bincount(tokens, minlength=8).double()
    assert counts[6] == 0 and counts[7] == 0
    expected = n * probs[:6].double()
    chi2 = float(((counts[:6] - expected) ** 2 / expected).sum())
    assert chi2 < 25.7  # 5 degrees of freedom: p < 1e-4
    assert torch.isfinite(logprobs).all()


def test_generator_rows_follow_the_generator():
    logits = torch.randn(300, 30, generator=torch.Generator().manual_seed(8))
    rows = RowSampling.of([SamplingParams()] * 300, "cpu")
    at = torch.zeros(300, dtype=torch.int64)
    first, _ = sample(logits, rows, at, torch.Generator().manual_seed(1))
    again, _ = sample(logits, rows, at, torch.Generator().manual_seed(1))
    other, _ = sample(logits, rows, at, torch.Generator().manual_seed(2))
    assert first.tolist() == again.tolist() and first.tolist() != other.tolist()


def test_a_batch_of_seeded_rows_runs_no_race_and_draws_what_it_draws_beside_unseeded_rows():
    """Every sampled row seeded (as a run's rollouts are): the exponential race, whose draws they
    would overwrite, is skipped, the generator is left as it was, and each row's token is the one
    it draws in a batch that races for unseeded rows beside it."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(4))
    seeded = [SamplingParams(seed=s, temperature=t) for s, t in ((3, 1.0), (4, 0.7), (5, 1.0), (6, 1.3))]
    mixed = seeded + [SamplingParams(), SamplingParams(temperature=0.0)]
    at = torch.arange(6, dtype=torch.int64)
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    rows = RowSampling.of(seeded + [SamplingParams(seed=9, temperature=0.0)] * 2, "cpu")
    assert rows.raced is False and RowSampling.of(mixed, "cpu").raced is True
    with OpNames() as seen:
        alone, alone_lp = sample(logits, rows, at, generator)
    assert not {"uniform_", "exponential_"} & seen.names and torch.equal(generator.get_state(), state)
    beside, beside_lp = sample(logits, RowSampling.of(mixed, "cpu"), at, torch.Generator().manual_seed(1))
    assert alone[:4].tolist() == beside[:4].tolist() and torch.equal(alone_lp[:4], beside_lp[:4])


class OpNames(TorchDispatchMode):
    """The names of the aten ops run while entered."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


HOST_SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "masked_select", "multinomial",
                 "equal", "unique", "_unique2", "allclose"}


def test_sample_makes_no_host_sync():
    logits, params, positions = _mixed_batch()
    rows = RowSampling.of(params, "cpu")
    at, generator = torch.tensor(positions), torch.Generator().manual_seed(0)
    with OpNames() as seen:
        sample(logits, rows, at, generator)
    assert {"uniform_", "log1p_", "searchsorted", "sort"} <= seen.names  # every branch ran (the CPU's Exp(1) draws)
    assert not seen.names & HOST_SYNC_OPS, seen.names & HOST_SYNC_OPS
    with OpNames() as check:  # the mode does see a host read
        torch.ones(2).sum().item()
        bool(torch.ones(1))
    assert "_local_scalar_dense" in check.names


def test_sample_runs_on_the_meta_device():
    """Any op that reads a value on the host fails on meta tensors, which have none."""
    logits, params, positions = _mixed_batch(n=8)
    rows = RowSampling.of(params, "meta")
    tokens, logprobs = sample(logits.to("meta"), rows, torch.tensor(positions, device="meta"), None)
    assert tokens.shape == logprobs.shape == (8,) and tokens.dtype == torch.int64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sample_on_cuda_syncs_nothing_and_matches_the_cpu_for_seeded_rows():
    logits, params, positions = _mixed_batch(n=256, vocab=1000, seed=9)
    seeds = EDGE_SEEDS * 100
    every = torch.arange(len(seeds))
    assert _same_bits(device_seeded_uniforms(_as_int64(seeds).cuda(), every.cuda()).cpu().numpy(),
                      seeded_uniforms(seeds, every.tolist()))
    cpu, cpu_lp = sample(logits, RowSampling.of(params, "cpu"), torch.tensor(positions),
                         torch.Generator().manual_seed(0))
    rows, at = RowSampling.of(params, "cuda"), torch.tensor(positions, device="cuda")
    logits_cuda, generator = logits.cuda(), torch.Generator(device="cuda").manual_seed(0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens, logprobs = sample(logits_cuda, rows, at, generator)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    fixed = [r for r, p in enumerate(params) if p.seed is not None or p.temperature == 0.0]
    assert tokens.device.type == "cuda"
    assert tokens.cpu()[fixed].tolist() == cpu[fixed].tolist()
    torch.testing.assert_close(logprobs.cpu(), torch.log_softmax(
        logits / torch.tensor([p.temperature or 1.0 for p in params])[:, None], -1).gather(
        1, tokens.cpu()[:, None]).squeeze(1), rtol=0, atol=1e-5)
    torch.testing.assert_close(cpu_lp[fixed], logprobs.cpu()[fixed], rtol=0, atol=1e-5)


def test_nan_logits_give_a_nan_logprob_and_the_wrapper_raises():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(10))
    logits[1] = float("nan")
    rows = RowSampling.of([SamplingParams(), SamplingParams(), SamplingParams(seed=1)], "cpu")
    tokens, logprobs = sample(logits, rows, torch.zeros(3, dtype=torch.int64), torch.Generator().manual_seed(0))
    assert logprobs.isnan().tolist() == [False, True, False]
    with pytest.raises(RuntimeError, match="nan"):
        sample_next_tokens(logits, torch.ones(3), torch.ones(3), torch.full((3,), -1))
    greedy, _ = sample_next_tokens(logits, torch.zeros(3), torch.ones(3), torch.full((3,), -1))  # as before
    assert greedy[0] == logits[0].argmax()
