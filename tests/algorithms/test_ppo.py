import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_flow.algorithms.diagnostics import BEHAV_WEIGHT_BIN, behav_weight_edges
from areal_flow.algorithms.ppo import (
    AGGREGATIONS,
    IMPORTANCE_LEVELS,
    LOSS_KINDS,
    aggregation_weight,
    decoupled_ppo_loss,
)


def _random_inputs(shape, seed):
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(shape, generator=g, dtype=torch.float64) * 3
    logp = prox + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)  # ratios around 1, some clipped
    behav = prox + 0.5 * torch.randn(shape, generator=g, dtype=torch.float64)  # weights spread around 1
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    mask = torch.rand(shape, generator=g) < 0.8
    return logp, prox, behav, adv, mask


def _reference(logp, prox, behav, adv, mask, eps, eps_hi, cap, n_valid):
    """Per-token loop straight from the formula in docs/architecture.md; also the expected d loss / d logp per token."""
    flat = [t.reshape(-1).tolist() if t is not None else None for t in (logp, prox, behav, adv, mask)]
    lp, px, bh, a, m = flat
    eps_hi = eps if eps_hi is None else eps_hi
    n = max(sum(m), 1) if n_valid is None else n_valid
    total, grads = 0.0, []
    stats = dict(
        n_tokens=0, clipped_tokens=0, capped_tokens=0, ratio_sum=0.0, behav_weight_sum=0.0, behav_weight_max=0.0
    )
    for t in range(len(lp)):
        if not m[t]:
            grads.append(0.0)
            continue
        anchor = px[t] if px is not None else bh[t]
        r = math.exp(lp[t] - anchor)
        w = math.exp(px[t] - bh[t]) if px is not None else 1.0
        stats["n_tokens"] += 1
        stats["ratio_sum"] += r
        stats["behav_weight_sum"] += w
        stats["behav_weight_max"] = max(stats["behav_weight_max"], w)
        if px is not None and cap is not None and w > cap:
            stats["capped_tokens"] += 1
            w = 0.0
        r_clip = min(max(r, 1 - eps), 1 + eps_hi)
        is_clipped = -a[t] * r_clip > -a[t] * r
        stats["clipped_tokens"] += int(is_clipped)
        total += -w * min(r * a[t], r_clip * a[t])
        grads.append(0.0 if is_clipped else -a[t] * r * w / n)
    return total / n, torch.tensor(grads, dtype=torch.float64).reshape(logp.shape), stats


@pytest.mark.parametrize("shape", [(64,), (4, 16)])
@pytest.mark.parametrize(
    "eps_hi,cap,use_prox",
    [(None, None, True), (0.28, None, True), (None, 1.5, True), (0.28, 2.0, True), (None, None, False)],
)
def test_loss_stats_and_gradient_match_a_per_token_loop(shape, eps_hi, cap, use_prox):
    logp, prox, behav, adv, mask = _random_inputs(shape, seed=len(shape) + 10 * int(10 * (cap or 0)))
    prox = prox if use_prox else None
    logp.requires_grad_(True)
    loss, stats = decoupled_ppo_loss(
        logp, prox, behav, adv, mask, eps_clip=0.2, eps_clip_high=eps_hi, behav_weight_cap=cap
    )
    ref_loss, ref_grad, ref_stats = _reference(logp.detach(), prox, behav, adv, mask, 0.2, eps_hi, cap, None)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-10, abs=1e-12)
    for key, value in ref_stats.items():
        assert stats[key].item() == pytest.approx(value, rel=1e-10), key
        assert stats[key].ndim == 0 and not stats[key].requires_grad
    # The inputs must exercise every branch, or this test would prove little.
    assert 0 < ref_stats["clipped_tokens"] < ref_stats["n_tokens"]
    if cap is not None and use_prox:
        assert 0 < ref_stats["capped_tokens"] < ref_stats["n_tokens"]
    loss.backward()
    torch.testing.assert_close(logp.grad, ref_grad, rtol=1e-10, atol=1e-14)


def test_behaviour_weight_is_always_applied():
    logp, prox, _, adv, mask = _random_inputs((32,), seed=1)
    on_policy, _ = decoupled_ppo_loss(logp, prox, prox, adv, mask, eps_clip=0.2)
    # The same tokens sampled by an older policy that gave each of them e^0.5 less probability.
    stale, stats = decoupled_ppo_loss(logp, prox, prox - 0.5, adv, mask, eps_clip=0.2)
    assert stale.item() == pytest.approx(on_policy.item() * math.exp(0.5), rel=1e-10)
    assert stats["behav_weight_max"].item() == pytest.approx(math.exp(0.5))


def test_capped_tokens_are_dropped_but_stay_in_the_denominator():
    logp = torch.tensor([-1.0, -1.0, -1.0, -1.0], dtype=torch.float64, requires_grad=True)
    prox = torch.full((4,), -1.0, dtype=torch.float64)
    behav = torch.tensor([-1.0, -1.0, -4.0, -4.0], dtype=torch.float64)  # w = 1, 1, e^3, e^3
    adv = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    mask = torch.ones(4, dtype=torch.bool)
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2, behav_weight_cap=5.0)
    # r = 1 everywhere: only tokens 0 and 1 count, divided by all 4 valid tokens.
    assert loss.item() == pytest.approx(-(1.0 + 2.0) / 4)
    assert stats["capped_tokens"].item() == 2
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1 / 4, -2 / 4, 0.0, 0.0])


def test_without_prox_it_is_plain_ppo_against_behaviour():
    logp, _, behav, adv, mask = _random_inputs((48,), seed=2)
    plain, stats = decoupled_ppo_loss(logp, None, behav, adv, mask, eps_clip=0.2, behav_weight_cap=0.5)
    # prox = behav makes w = 1 and r = exp(logp - behav): the same objective.
    same, _ = decoupled_ppo_loss(logp, behav, behav, adv, mask, eps_clip=0.2)
    assert plain.item() == pytest.approx(same.item(), rel=1e-12)
    assert stats["capped_tokens"].item() == 0 and stats["behav_weight_sum"].item() == mask.sum().item()
    # ...which is not the decoupled loss when prox differs from behav.
    _, prox, _, _, _ = _random_inputs((48,), seed=2)
    decoupled, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2)
    assert decoupled.item() != pytest.approx(plain.item(), rel=1e-3)


def test_masked_positions_with_garbage_contribute_nothing_and_no_nan():
    logp, prox, behav, adv, mask = _random_inputs((40,), seed=3)
    clean, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2)
    dirty = [t.clone() for t in (logp, prox, behav, adv)]
    garbage = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=torch.float64)
    for k, t in enumerate(dirty):
        t[~mask] = garbage[(torch.arange((~mask).sum()) + k) % 3]
    dirty[0].requires_grad_(True)
    loss, stats = decoupled_ppo_loss(*dirty, mask, eps_clip=0.2, behav_weight_cap=3.0)
    assert loss.item() == pytest.approx(
        decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2, behav_weight_cap=3.0)[0].item()
    )
    assert all(torch.isfinite(v) for v in stats.values())
    loss.backward()
    assert torch.isfinite(dirty[0].grad).all()
    assert (dirty[0].grad[~mask] == 0).all()
    assert torch.isfinite(clean)


def test_global_token_count_makes_micro_batch_losses_add_up_to_the_full_mean():
    logp, prox, behav, adv, mask = _random_inputs((50,), seed=4)
    full, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2)
    n = mask.sum().item()
    parts = [
        decoupled_ppo_loss(logp[s], prox[s], behav[s], adv[s], mask[s], eps_clip=0.2, n_valid_tokens=n)[0]
        for s in (slice(0, 17), slice(17, 50))
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), rel=1e-12)


def test_an_all_masked_batch_gives_zero_loss():
    logp = torch.full((5,), float("nan"), requires_grad=True)
    loss, stats = decoupled_ppo_loss(
        logp, logp.detach(), logp.detach(), torch.ones(5), torch.zeros(5, dtype=torch.bool), eps_clip=0.2
    )
    assert loss.item() == 0.0 and stats["n_tokens"].item() == 0 and stats["behav_weight_max"].item() == 0
    loss.backward()
    assert (logp.grad == 0).all()


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="advantages has shape"):
        decoupled_ppo_loss(
            torch.zeros(4), None, torch.zeros(4), torch.zeros(3), torch.ones(4, dtype=torch.bool),
            eps_clip=0.2,
        )


# --- The policy-loss family: dual clip, CISPO, GSPO, behaviour-weight floor/clamp, aggregation -------------------

F64 = torch.float64


def _t(values, dtype=F64, grad=False):
    return torch.tensor(values, dtype=dtype, requires_grad=grad)


def _loss_and_grad(logp, *args, **kwargs):
    logp = logp.detach().clone().requires_grad_(True)
    loss, stats = decoupled_ppo_loss(logp, *args, **kwargs)
    loss.backward()
    return loss.item(), logp.grad, stats


def _runs(seq_ids):
    """Index lists of the maximal runs of equal ids."""
    runs, last = [], object()
    for t, i in enumerate(seq_ids):
        if i != last:
            runs.append([])
            last = i
        runs[-1].append(t)
    return runs


def _general_reference(logp, prox, behav, adv, mask, *, eps_clip, eps_clip_high=None, c_clip=None, kind="ppo",
                       importance_level="token", seq_ids=None, correction="areal", behav_weight_cap=None,
                       behav_weight_floor=None, token_weights=None, n_valid_tokens=None):
    """Per-token loop over the whole family, written from the docstring's formulas; also d loss / d logp."""
    lp, bh, a, m = (t.reshape(-1).tolist() for t in (logp, behav, adv, mask))
    px = prox.reshape(-1).tolist() if prox is not None else None
    tw = token_weights.reshape(-1).tolist() if token_weights is not None else [1.0] * len(lp)
    hi = eps_clip if eps_clip_high is None else eps_clip_high
    cap, floor = behav_weight_cap, behav_weight_floor
    anchor = px if px is not None else bh
    n = max(sum(w for w, v in zip(tw, m) if v), 1.0) if n_valid_tokens is None else max(n_valid_tokens, 1.0)
    seq_ratio = [None] * len(lp)
    if importance_level == "sequence":
        for run in _runs(seq_ids.reshape(-1).tolist()):
            valid = [t for t in run if m[t]]
            s = math.exp(sum(lp[t] - anchor[t] for t in valid) / len(valid)) if valid else 1.0
            for t in run:
                seq_ratio[t] = s
    keys = ("n_tokens", "clipped_tokens", "dual_clipped_tokens", "capped_tokens", "ratio_sum", "behav_weight_sum",
            "behav_weight_max", "behav_weight_sq_sum")
    edges = behav_weight_edges(cap, floor)  # the histogram of w: bin i holds e_i < w <= e_{i+1}, the last open
    stats = dict.fromkeys(keys + tuple(BEHAV_WEIGHT_BIN.format(i) for i in range(len(edges) - 1)), 0.0)
    total, grads = 0.0, [0.0] * len(lp)
    for t in range(len(lp)):
        if not m[t]:
            continue
        r = math.exp(lp[t] - anchor[t]) if seq_ratio[t] is None else seq_ratio[t]
        dr = r  # d r / d logp_t: r itself at token level, s_i in the GSPO-token form
        w = math.exp(px[t] - bh[t]) if px is not None else 1.0
        stats["n_tokens"] += 1
        stats["ratio_sum"] += r
        stats["behav_weight_sum"] += w
        stats["behav_weight_max"] = max(stats["behav_weight_max"], w)
        stats["behav_weight_sq_sum"] += w * w
        stats[BEHAV_WEIGHT_BIN.format(sum(w > e for e in edges[1:-1]))] += 1
        if px is not None and ((cap is not None and w > cap) or (floor is not None and w < floor)):
            stats["capped_tokens"] += 1
            w = min(w, cap) if correction in ("tis", "vtrace") else 0.0  # truncated, or masked
        rc = min(max(r, 1 - eps_clip), 1 + hi)
        if kind == "ppo":
            if -a[t] * rc > -a[t] * r:
                stats["clipped_tokens"] += 1
                pg, g = -a[t] * rc, 0.0
            else:
                pg, g = -a[t] * r, -a[t] * dr
            if c_clip is not None and pg > c_clip * abs(a[t]):
                stats["dual_clipped_tokens"] += 1
                pg, g = c_clip * abs(a[t]), 0.0
        else:
            stats["clipped_tokens"] += int(rc != r)
            pg, g = -rc * a[t] * lp[t], -rc * a[t]
        total += tw[t] * w * pg
        grads[t] = tw[t] * w * g / n
    return total / n, torch.tensor(grads, dtype=F64).reshape(logp.shape), stats


def _wide_inputs(n, seed):
    """Ratios and behaviour weights spread far enough that every branch (clip, dual clip, cap, floor) is taken."""
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(n, generator=g, dtype=F64) * 3
    logp = prox + 0.6 * torch.randn(n, generator=g, dtype=F64)
    behav = prox + 0.8 * torch.randn(n, generator=g, dtype=F64)
    adv = torch.randn(n, generator=g, dtype=F64)
    mask = torch.rand(n, generator=g) < 0.8
    lengths = torch.randint(1, 7, (n,), generator=g).tolist()
    seq_ids = torch.repeat_interleave(torch.arange(n), torch.tensor(lengths))[:n]
    token_weights = 0.2 + torch.rand(n, generator=g, dtype=F64)
    return logp, prox, behav, adv, mask, seq_ids, token_weights


@pytest.mark.parametrize(
    "options",
    [
        dict(c_clip=2.0),
        dict(c_clip=1.5, eps_clip_high=0.28, behav_weight_cap=2.0),
        dict(behav_weight_cap=2.0, behav_weight_floor=0.5),
        dict(correction="tis", behav_weight_cap=2.0),
        dict(correction="vtrace", behav_weight_cap=1.0),
        dict(kind="cispo", eps_clip_high=0.28, behav_weight_cap=2.0),
        dict(importance_level="sequence", c_clip=1.5),
        dict(importance_level="sequence", kind="cispo", correction="tis", behav_weight_cap=2.0),
    ],
)
@pytest.mark.parametrize("use_prox,use_weights", [(True, False), (True, True), (False, True)])
def test_family_matches_a_per_token_loop(options, use_prox, use_weights):
    logp, prox, behav, adv, mask, seq_ids, token_weights = _wide_inputs(128, seed=len(options))
    kwargs = dict(eps_clip=0.2, seq_ids=seq_ids, token_weights=token_weights if use_weights else None, **options)
    prox = prox if use_prox else None
    loss, grad, stats = _loss_and_grad(logp, prox, behav, adv, mask, **kwargs)
    ref_loss, ref_grad, ref_stats = _general_reference(logp, prox, behav, adv, mask, **kwargs)
    assert loss == pytest.approx(ref_loss, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-14)
    assert set(stats) == set(ref_stats)
    for key, value in ref_stats.items():
        assert stats[key].item() == pytest.approx(value, rel=1e-10), key
        assert stats[key].ndim == 0 and not stats[key].requires_grad
    # The inputs must take the branches the options are about, or this test would prove little.
    assert 0 < ref_stats["clipped_tokens"] < ref_stats["n_tokens"]
    if options.get("c_clip"):
        assert ref_stats["dual_clipped_tokens"] > 0
    if use_prox and ("behav_weight_cap" in options or "behav_weight_floor" in options):
        assert 0 < ref_stats["capped_tokens"] < ref_stats["n_tokens"]


def test_dual_clip_bounds_negative_advantage_tokens_and_stops_their_gradient():
    # prox = behav (w = 1), r = 4, 2, 4, 0.5, 5 and N = 5.
    prox = torch.full((5,), -2.0, dtype=F64)
    logp = prox + torch.log(_t([4.0, 2.0, 4.0, 0.5, 5.0]))
    adv = _t([-1.0, -1.0, 1.0, 1.0, -2.0])
    mask = torch.ones(5, dtype=torch.bool)
    loss, grad, stats = _loss_and_grad(logp, prox, prox, adv, mask, eps_clip=0.2, c_clip=3.0)
    # A<0, r=4>c: 3*|A|; A<0, r=2<c: |A|*r; A>0, r=4: clipped at 1.2; A>0, r=0.5: unclipped; A=-2, r=5: 3*2.
    assert loss == pytest.approx((3.0 + 2.0 - 1.2 - 0.5 + 6.0) / 5)
    assert grad.tolist() == pytest.approx([0.0, 2.0 / 5, 0.0, -0.5 / 5, 0.0])
    assert stats["dual_clipped_tokens"].item() == 2 and stats["clipped_tokens"].item() == 1
    # Without the dual clip, the two large-ratio negative tokens keep their unbounded loss and gradient.
    loss, grad, stats = _loss_and_grad(logp, prox, prox, adv, mask, eps_clip=0.2)
    assert loss == pytest.approx((4.0 + 2.0 - 1.2 - 0.5 + 10.0) / 5)
    assert grad.tolist() == pytest.approx([4.0 / 5, 2.0 / 5, 0.0, -0.5 / 5, 10.0 / 5])
    assert stats["dual_clipped_tokens"].item() == 0


def test_asymmetric_clip():
    prox = torch.full((4,), -1.0, dtype=F64)
    logp = prox + torch.log(_t([1.25, 1.3, 0.85, 0.75]))
    adv = _t([1.0, 1.0, -1.0, -1.0])
    mask = torch.ones(4, dtype=torch.bool)
    loss, grad, stats = _loss_and_grad(logp, prox, prox, adv, mask, eps_clip=0.2, eps_clip_high=0.28)
    # 1.25 < 1.28 is kept, 1.3 is clipped to 1.28; 0.85 > 0.8 is kept, 0.75 is clipped up to 0.8.
    assert loss == pytest.approx((-1.25 - 1.28 + 0.85 + 0.8) / 4)
    assert grad.tolist() == pytest.approx([-1.25 / 4, 0.0, 0.85 / 4, 0.0])
    assert stats["clipped_tokens"].item() == 2
    # The symmetric clip at 0.2 also clips 1.25.
    _, grad, stats = _loss_and_grad(logp, prox, prox, adv, mask, eps_clip=0.2)
    assert grad.tolist() == pytest.approx([0.0, 0.0, 0.85 / 4, 0.0])
    assert stats["clipped_tokens"].item() == 3


@pytest.mark.parametrize(
    "floor,cap,correction,expected_weights",
    [
        (0.1, 5.0, "areal", [1.0, 0.0, 0.0]),
        (0.1, 5.0, "icepop", [1.0, 0.0, 0.0]),
        (0.1, None, "areal", [1.0, math.exp(3), 0.0]),
        (None, 5.0, "tis", [1.0, 5.0, math.exp(-3)]),
        (None, 1.0, "vtrace", [1.0, 1.0, math.exp(-3)]),
    ],
)
def test_behaviour_weight_floor_cap_mask_and_truncate(floor, cap, correction, expected_weights):
    logp = torch.full((3,), -1.0, dtype=F64)
    prox = logp.clone()  # r = 1: never clipped, loss_t = -w_t * A_t
    behav = _t([-1.0, -4.0, 2.0])  # w = 1, e^3, e^-3
    adv = _t([1.0, 2.0, 3.0])
    mask = torch.ones(3, dtype=torch.bool)
    loss, grad, stats = _loss_and_grad(
        logp, prox, behav, adv, mask, eps_clip=0.2, behav_weight_cap=cap, behav_weight_floor=floor,
        correction=correction,
    )
    expected = [-w * a / 3 for w, a in zip(expected_weights, [1.0, 2.0, 3.0])]
    assert loss == pytest.approx(sum(expected))
    assert grad.tolist() == pytest.approx(expected)  # masked tokens lose the gradient, clamped ones keep it
    assert stats["capped_tokens"].item() == (2 if cap is not None and floor is not None else 1)
    assert stats["n_tokens"].item() == 3  # dropped tokens stay in the denominator
    assert stats["behav_weight_max"].item() == pytest.approx(math.exp(3))


def test_cispo_keeps_a_clipped_constant_weight_and_every_gradient():
    prox = _t([-1.0, -2.0, -0.5, -1.5, -3.0])
    r = [1.0, 2.0, 0.5, 1.1, 0.9]
    w = [1.0, 1.0, 2.0, 1.0, 0.5]
    tw = [1.0, 0.5, 1.0, 2.0, 1.0]
    logp = prox + torch.log(_t(r))
    behav = prox - torch.log(_t(w))
    adv = _t([1.0, 1.0, -1.0, -1.0, 2.0])
    mask = torch.ones(5, dtype=torch.bool)
    kwargs = dict(eps_clip=0.2, eps_clip_high=0.28, token_weights=_t(tw))
    loss, grad, stats = _loss_and_grad(logp, prox, behav, adv, mask, kind="cispo", **kwargs)
    clipped = [1.0, 1.28, 0.8, 1.1, 0.9]
    n = sum(tw)
    a = adv.tolist()
    expected_grad = [-clipped[t] * a[t] * w[t] * tw[t] / n for t in range(5)]
    assert grad.tolist() == pytest.approx(expected_grad)
    assert loss == pytest.approx(sum(g * lp for g, lp in zip(expected_grad, logp.tolist())))
    assert stats["clipped_tokens"].item() == 2
    # PPO clips the same two tokens away: no gradient there. CISPO's gradient is nonzero on every token.
    _, ppo_grad, _ = _loss_and_grad(logp, prox, behav, adv, mask, **kwargs)
    assert ppo_grad[1].item() == 0 and ppo_grad[2].item() == 0
    assert (grad != 0).all()


def test_cispo_and_dual_clip_arguments_are_checked():
    x = torch.zeros(3)
    m = torch.ones(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="c_clip"):
        decoupled_ppo_loss(x, None, x, x, m, eps_clip=0.2, c_clip=3.0, kind="cispo")
    for c in (1.0, 0.5):
        with pytest.raises(ValueError, match="c_clip must be > 1"):
            decoupled_ppo_loss(x, None, x, x, m, eps_clip=0.2, c_clip=c)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(kind="grpo"), r"kind 'grpo'.*'ppo', 'cispo'"),
        (dict(importance_level="seq"), r"importance_level 'seq'.*'token', 'sequence'"),
        (dict(correction="drop"), r"correction 'drop'.*'areal', 'tis'"),
        (dict(correction="tis"), "correction 'tis' needs behav_weight_cap"),
        (dict(correction="m2po"), "correction 'm2po' needs correction_tau"),
        (dict(correction="icepop", behav_weight_cap=5.0), "correction 'icepop' needs behav_weight_floor"),
        (dict(correction="areal", correction_level="sequence", seq_ids=torch.zeros(3, dtype=torch.long)),
         "'areal' is defined at level token"),
        (dict(clip_behav=True, kind="cispo"), "clip_behav.*cispo"),
        (dict(clip_behav=True, importance_level="sequence", seq_ids=torch.zeros(3, dtype=torch.long)),
         "clip_behav.*sequence"),
        (dict(importance_level="sequence"), "needs seq_ids"),
        (dict(behav_weight_floor=2.0, behav_weight_cap=1.5), r"behav_weight_floor \(2.0\) > behav_weight_cap"),
        (dict(seq_ids=torch.zeros(4, dtype=torch.long)), "seq_ids has shape"),
        (dict(token_weights=torch.ones(2)), "token_weights has shape"),
        (dict(prox_logprobs=torch.zeros(1, 3)), "prox_logprobs has shape"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, message):
    x = torch.zeros(3)
    prox = kwargs.pop("prox_logprobs", x)
    with pytest.raises(ValueError, match=message):
        decoupled_ppo_loss(x, prox, x, x, torch.ones(3, dtype=torch.bool), eps_clip=0.2, **kwargs)


def _gspo_inputs():
    seq_ids = torch.tensor([0, 0, 0, 1, 1, 2])
    mask = torch.tensor([True, True, False, True, True, True])
    prox = torch.full((6,), -1.0, dtype=F64)
    logp = prox + _t([0.1, 0.3, float("nan"), -0.2, 0.0, 0.5])  # the masked token's ratio must not count
    s = [math.exp(0.2), math.exp(-0.1), math.exp(0.5)]  # geometric means over the valid tokens
    return seq_ids, mask, prox, logp, s


def test_gspo_ratio_is_the_geometric_mean_of_each_sequence():
    seq_ids, mask, prox, logp, s = _gspo_inputs()
    adv = -torch.ones(6, dtype=F64)  # loss_t = r_t, d loss_t / d logp_t = s_i
    kwargs = dict(eps_clip=10.0, importance_level="sequence", seq_ids=seq_ids)
    loss, grad, stats = _loss_and_grad(logp, prox, prox, adv, mask, **kwargs)
    assert grad.tolist() == pytest.approx([s[0] / 5, s[0] / 5, 0.0, s[1] / 5, s[1] / 5, s[2] / 5])
    assert loss == pytest.approx((2 * s[0] + 2 * s[1] + s[2]) / 5)
    assert stats["ratio_sum"].item() == pytest.approx(2 * s[0] + 2 * s[1] + s[2])
    # Whatever the masked token holds, nothing changes.
    for garbage in (5.0, float("inf"), -float("inf")):
        other = logp.clone()
        other[2] = garbage
        loss2, grad2, _ = _loss_and_grad(other, prox, prox, adv, mask, **kwargs)
        assert loss2 == pytest.approx(loss, rel=1e-12) and torch.equal(grad2, grad)


def test_gspo_gradient_matches_autograd_on_a_hand_loop():
    seq_ids, mask, prox, logp, s = _gspo_inputs()
    logp[2] = -1.0
    adv = _t([1.0, 1.0, 0.0, -0.5, -0.5, 1.0])
    behav = prox - _t([0.0, 0.1, 0.0, -0.2, 0.3, 0.0])
    kwargs = dict(eps_clip=0.2, eps_clip_high=0.3, importance_level="sequence", seq_ids=seq_ids)
    loss, grad, stats = _loss_and_grad(logp, prox, behav, adv, mask, **kwargs)

    x = logp.detach().clone().requires_grad_(True)
    total = 0.0
    for run in ([0, 1], [3, 4], [5]):  # the valid tokens of each sequence
        log_s = torch.stack([x[t] - prox[t] for t in run]).mean().detach()
        for t in run:
            r = torch.exp(x[t] - x[t].detach() + log_s)
            a = adv[t].item()
            w = math.exp(prox[t].item() - behav[t].item())
            r_clip = r.clamp(0.8, 1.3)
            total = total + w * (-a * r_clip if -a * r_clip.item() > -a * r.item() else -a * r)
    (total / 5).backward()
    assert loss == pytest.approx((total / 5).item(), rel=1e-12)
    torch.testing.assert_close(grad, x.grad, rtol=1e-12, atol=1e-15)
    # Sequence 2 (s = e^0.5 > 1.3, A > 0) is clipped as a whole; sequence 0 (e^0.2 < 1.3) is not.
    assert grad[5].item() == 0 and grad[0].item() == pytest.approx(-s[0] * 1.0 / 5)
    assert grad[1].item() == pytest.approx(-s[0] * math.exp(0.1) / 5)
    assert stats["clipped_tokens"].item() == 1


# --- aggregation ----------------------------------------------------------------------------------------------------


def test_aggregation_weight_table():
    assert aggregation_weight("token-mean", 4) == (1.0, 1.0)
    assert aggregation_weight("seq-mean-token-mean", 4) == (0.25, 0.25)
    assert aggregation_weight("seq-mean-token-sum", 4) == (1.0, 0.25)
    assert aggregation_weight("seq-mean-token-sum-norm", 4, norm_length=16) == (1 / 16, 0.25)
    for mode in AGGREGATIONS:
        assert aggregation_weight(mode, 0, norm_length=16) == (0.0, 0.0)
    with pytest.raises(ValueError, match="'token-mean', 'seq-mean-token-mean'.*'seq-mean-token-sum-norm'"):
        aggregation_weight("sum", 3)
    with pytest.raises(ValueError, match="norm_length"):
        aggregation_weight("seq-mean-token-sum-norm", 3)


def _aggregation_tensors(lengths, mask, mode, norm_length):
    weights, shares = [], []
    start = 0
    for n in lengths:
        tw, share = aggregation_weight(mode, int(mask[start:start + n].sum()), norm_length)
        weights += [tw] * n
        shares += [share] * n
        start += n
    return _t(weights), float((_t(shares) * mask).sum())


def test_seq_mean_token_mean_weighs_a_short_and_a_long_sequence_equally():
    lengths = [1, 3]
    logp = torch.full((4,), -1.0, dtype=F64)  # r = 1, w = 1: loss_t = -A_t
    adv = _t([2.0, 0.0, 3.0, 6.0])
    mask = torch.ones(4, dtype=torch.bool)
    weights, denom = _aggregation_tensors(lengths, mask, "seq-mean-token-mean", None)
    assert denom == pytest.approx(2.0)
    loss, grad, _ = _loss_and_grad(logp, logp, logp, adv, mask, eps_clip=0.2, token_weights=weights)
    assert loss == pytest.approx(-(2.0 + 3.0) / 2)  # the default denominator is the number of sequences
    assert grad.tolist() == pytest.approx([-2.0 / 2, 0.0, -3.0 / 6, -6.0 / 6])
    token_mean, _ = decoupled_ppo_loss(logp, logp, logp, adv, mask, eps_clip=0.2)
    assert token_mean.item() == pytest.approx(-11.0 / 4)


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_micro_batches_with_the_global_denominator_add_up_for_every_aggregation(mode):
    lengths = [3, 1, 5, 2, 4, 6]
    n = sum(lengths)
    logp, prox, behav, adv, mask, _, _ = _wide_inputs(n, seed=7)
    mask[3:4] = False  # the one-token sequence has no valid token
    weights, denom = _aggregation_tensors(lengths, mask, mode, norm_length=8)
    kwargs = dict(eps_clip=0.2, c_clip=3.0, behav_weight_cap=2.0, n_valid_tokens=denom)
    full, full_grad, _ = _loss_and_grad(logp, prox, behav, adv, mask, token_weights=weights, **kwargs)
    # The definition straight from the mode's name, from each token's own loss (a one-token call, denominator 1).
    options = {k: v for k, v in kwargs.items() if k != "n_valid_tokens"}
    token_loss = [
        decoupled_ppo_loss(logp[t:t + 1], prox[t:t + 1], behav[t:t + 1], adv[t:t + 1], mask[t:t + 1],
                           n_valid_tokens=1, **options)[0].item()
        for t in range(n)
    ]
    seqs, start = [], 0
    for length in lengths:
        valid = mask[start:start + length].sum().item()
        if valid:
            seqs.append((sum(token_loss[start:start + length]), valid))
        start += length
    expected = {
        "token-mean": sum(total for total, _ in seqs) / mask.sum().item(),
        "seq-mean-token-mean": sum(total / valid for total, valid in seqs) / len(seqs),
        "seq-mean-token-sum": sum(total for total, _ in seqs) / len(seqs),
        "seq-mean-token-sum-norm": sum(total / 8 for total, _ in seqs) / len(seqs),
    }[mode]
    assert full == pytest.approx(expected, rel=1e-12)
    parts, grads = 0.0, []
    for lo, hi in ((0, 4), (4, 9), (9, n)):  # micro-batch boundaries on sequence boundaries
        s = slice(lo, hi)
        part, part_grad, _ = _loss_and_grad(
            logp[s], prox[s], behav[s], adv[s], mask[s], token_weights=weights[s], **kwargs
        )
        parts += part
        grads.append(part_grad)
    assert parts == pytest.approx(full, rel=1e-12)
    torch.testing.assert_close(torch.cat(grads), full_grad, rtol=1e-12, atol=1e-15)
    if mode in ("token-mean", "seq-mean-token-mean"):
        default, _ = decoupled_ppo_loss(
            logp, prox, behav, adv, mask, eps_clip=0.2, c_clip=3.0, behav_weight_cap=2.0, token_weights=weights
        )
        assert default.item() == pytest.approx(full, rel=1e-12)


# --- properties -----------------------------------------------------------------------------------------------------

_small = st.floats(-2.0, 2.0, allow_nan=False, allow_infinity=False)


@st.composite
def _batches(draw):
    """Small packed batches: contiguous sequences, random masks, and a random choice of loss options."""
    lengths = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    n = sum(lengths)
    floats = st.lists(_small, min_size=n, max_size=n)
    logp = _t([-abs(x) - 0.1 for x in draw(floats)])
    prox = logp + _t(draw(floats)) / 2
    behav = prox + _t(draw(floats)) / 2
    adv = _t(draw(floats))
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    kind = draw(st.sampled_from(LOSS_KINDS))
    correction = draw(st.sampled_from(["areal", "tis"]))
    options = dict(
        eps_clip=draw(st.sampled_from([0.2, 10.0])),
        eps_clip_high=draw(st.sampled_from([None, 0.28])),
        kind=kind,
        importance_level=draw(st.sampled_from(IMPORTANCE_LEVELS)),
        seq_ids=seq_ids,
        c_clip=draw(st.sampled_from([None, 2.0])) if kind == "ppo" else None,
        correction=correction,
        behav_weight_cap=draw(st.sampled_from([None, 1.5])) if correction == "areal" else 1.5,
        behav_weight_floor=draw(st.sampled_from([None, 0.7])) if correction == "areal" else None,
        token_weights=draw(st.sampled_from([None, 0.5 + torch.arange(n, dtype=F64) / n])),
    )
    return logp, prox, behav, adv, mask, options


@settings(max_examples=50, deadline=None)
@given(_batches(), st.booleans())
def test_property_zero_advantages_give_zero_loss_and_gradient(batch, use_prox):
    logp, prox, behav, adv, mask, options = batch
    loss, grad, stats = _loss_and_grad(logp, prox if use_prox else None, behav, torch.zeros_like(adv), mask, **options)
    assert loss == 0.0
    assert (grad == 0).all()
    # Nothing to bound either: a zero-advantage token is never counted as dual-clipped (nor PPO-clipped).
    assert stats["dual_clipped_tokens"].item() == 0
    if options["kind"] == "ppo":
        assert stats["clipped_tokens"].item() == 0


@settings(max_examples=50, deadline=None)
@given(_batches())
def test_property_on_policy_decoupled_loss_is_plain_ppo(batch):
    logp, _, _, adv, mask, options = batch
    options["token_weights"] = None  # token-mean
    same = logp.detach().clone()
    loss, grad, stats = _loss_and_grad(logp, same, same, adv, mask, **options)
    plain, plain_grad, _ = _loss_and_grad(logp, None, same, adv, mask, **options)
    assert loss == pytest.approx(plain, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad, plain_grad, rtol=1e-12, atol=1e-15)
    # r = w = 1: nothing is clipped or capped, and the gradient is -A / N on every valid token.
    n_valid = max(mask.sum().item(), 1)
    torch.testing.assert_close(grad, torch.where(mask, -adv, 0.0) / n_valid, rtol=1e-12, atol=1e-15)
    assert stats["clipped_tokens"].item() == stats["capped_tokens"].item() == 0
    if options["kind"] == "ppo":
        assert loss == pytest.approx(-adv[mask].sum().item() / n_valid, rel=1e-12, abs=1e-15)


@settings(max_examples=50, deadline=None)
@given(_batches(), st.data())
def test_property_masked_positions_change_nothing(batch, data):
    logp, prox, behav, adv, mask, options = batch
    loss, grad, stats = _loss_and_grad(logp, prox, behav, adv, mask, **options)
    garbage = st.sampled_from([float("inf"), -float("inf"), float("nan"), 7.0, -30.0])
    dirty = [t.clone() for t in (logp, prox, behav, adv)]
    for t in dirty:
        for i in torch.nonzero(~mask).flatten().tolist():
            t[i] = data.draw(garbage)
    loss2, grad2, stats2 = _loss_and_grad(*dirty, mask, **options)
    assert loss2 == pytest.approx(loss, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(grad2[mask], grad[mask], rtol=1e-12, atol=1e-15)
    assert (grad2[~mask] == 0).all()
    for key, value in stats.items():
        assert stats2[key].item() == pytest.approx(value.item(), rel=1e-12, abs=1e-15), key


@settings(max_examples=50, deadline=None)
@given(_batches())
def test_property_gspo_with_one_token_per_sequence_is_token_level(batch):
    logp, prox, behav, adv, mask, options = batch
    options["seq_ids"] = torch.arange(len(logp))
    options["importance_level"] = "token"
    token, token_grad, token_stats = _loss_and_grad(logp, prox, behav, adv, mask, **options)
    options["importance_level"] = "sequence"
    seq, seq_grad, seq_stats = _loss_and_grad(logp, prox, behav, adv, mask, **options)
    assert seq == pytest.approx(token, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(seq_grad, token_grad, rtol=1e-12, atol=1e-15)
    for key, value in token_stats.items():
        assert seq_stats[key].item() == pytest.approx(value.item(), rel=1e-12, abs=1e-15), key


def test_m2po_drops_the_largest_log_weights_first_until_the_second_moment_fits():
    from areal_flow.algorithms.corrections import m2_keep

    lw = torch.tensor([0.1, -2.0, 0.0, 1.0, 0.3, 5.0])
    mask = torch.tensor([True, True, True, True, True, False])  # the 5.0 is not a valid token
    # Valid (log w)²: .01, 4, 0, 1, .09 (mean 1.02). Dropping 4 leaves mean .275; dropping 1 too, .0333.
    assert m2_keep(lw, mask, 0.04).tolist() == [True, False, True, False, True, False]
    assert m2_keep(lw, mask, 0.3).tolist() == [True, False, True, True, True, False]
    assert m2_keep(lw, mask, 2.0).tolist() == mask.tolist()  # already fits: nothing dropped
    kept = m2_keep(lw, mask, 0.0)
    assert kept.tolist() == [False, False, True, False, False, False]  # only log w = 0 fits τ = 0
    # Shapes [B, T] and an empty micro-batch.
    assert m2_keep(lw.reshape(2, 3), mask.reshape(2, 3), 0.04).reshape(-1).tolist() == [True, False, True, False, True, False]
    assert m2_keep(torch.zeros(0), torch.zeros(0, dtype=torch.bool), 0.04).numel() == 0


def test_m2po_masks_in_the_loss_and_counts_as_capped():
    logp = torch.tensor([-1.0, -1.0, -1.0, -1.0], requires_grad=True)
    behav = torch.tensor([-1.0, -3.0, -1.1, -1.0])  # log w = 0, 2, 0.1, 0
    adv = torch.ones(4)
    mask = torch.ones(4, dtype=torch.bool)
    loss, stats = decoupled_ppo_loss(logp, logp.detach(), behav, adv, mask, eps_clip=0.2, correction="m2po",
                                     correction_tau=0.04)
    loss.backward()
    assert float(stats["capped_tokens"]) == 1
    assert logp.grad[1] == 0 and all(logp.grad[i] != 0 for i in (0, 2, 3))  # the log w = 2 token is dropped
    assert float(loss) == pytest.approx(-(1 + math.exp(0.1) + 1) / 4)  # still in the denominator


def test_clip_behav_stops_the_gradient_where_naive_ppo_would_and_keeps_it_elsewhere():
    # Four tokens at r = 1 (the step's start), A > 0; the policy moved since sampling: w = 1, 1.1, 1.5, 0.5.
    behav = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    prox = torch.log(torch.tensor([0.5, 0.55, 0.75, 0.25]))
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0])
    mask = torch.ones(4, dtype=torch.bool)

    def grads(clip_behav: bool) -> torch.Tensor:
        logp = prox.clone().requires_grad_()
        loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2, clip_behav=clip_behav)
        loss.backward()
        return logp.grad, stats

    plain, _ = grads(False)
    both, stats = grads(True)
    assert all(plain != 0)  # the decoupled objective pushes every token at the step's start
    # w = 1.5 with A > 0 (moved past 1.2 in the advantage's direction) and w = 0.5 with A < 0: none.
    assert both[0] == plain[0] and both[1] == plain[1] and both[2] == 0 and both[3] == 0
    assert float(stats["clipped_tokens"]) == 2
    # Naive PPO (no prox) at the same point gives the same zeros: the clip is its own.
    logp = prox.clone().requires_grad_()
    decoupled_ppo_loss(logp, None, behav, adv, mask, eps_clip=0.2)[0].backward()
    assert logp.grad[2] == 0 and logp.grad[3] == 0 and logp.grad[1] != 0
