"""The off-policy corrections against their papers' formulas on hand-computed weights, the launch
checks of their keys, and the mismatch figures a step reports."""

import math

import pytest
import torch

from areal_flow.algorithms import corrections as c
from areal_flow.algorithms.diagnostics import MISMATCH, mismatch_metrics, mismatch_sums
from areal_flow.config.schema import AlgorithmConfig, RunConfig
from areal_flow.run.checks import correction_problems

W = [1.0, 3.0, 0.25, 6.0, 1.5]
LOG_W = torch.log(torch.tensor(W, dtype=torch.float64))
ALL = torch.ones(5, dtype=torch.bool)
SEQ = torch.tensor([0, 0, 1, 1, 1])  # answer 0: w = 1, 3 (ρ = 3); answer 1: 0.25, 6, 1.5 (ρ = 2.25)


def check(result, weights, changed):
    w, outside = result
    assert w.tolist() == pytest.approx(weights)
    assert outside.tolist() == changed


@pytest.mark.parametrize("name,params,weights,changed", [
    # AReaL (arXiv 2505.24298): w·1[w ≤ 5]; with a floor, two-sided
    ("areal", dict(high=5.0), [1, 3, 0.25, 0, 1.5], [0, 0, 0, 1, 0]),
    ("areal", dict(high=5.0, low=0.5), [1, 3, 0, 0, 1.5], [0, 0, 1, 1, 0]),
    ("areal", dict(high=None), W, [0] * 5),  # v0.3.0's uncapped weight
    # IcePop (Ring-1T): w·1[0.5 ≤ w ≤ 5]
    ("icepop", dict(low=0.5, high=5.0), [1, 3, 0, 0, 1.5], [0, 0, 1, 1, 0]),
    # TIS: min(w, 2); MIS: w·1[w ≤ 2]; V-trace: min(1, w)
    ("tis", dict(high=2.0), [1, 2, 0.25, 2, 1.5], [0, 1, 0, 1, 0]),
    ("mis", dict(high=2.0), [1, 0, 0.25, 0, 1.5], [0, 1, 0, 1, 0]),
    ("vtrace", dict(high=1.0), [1, 1, 0.25, 1, 1], [0, 1, 0, 1, 1]),
    # |log w| = 0, 1.10, 1.39, 1.79, 0.41: only w = 1 and 1.5 are within ln 2
    ("mismatch_mask", dict(tau=math.log(2)), [1, 0, 0, 0, 1.5], [0, 1, 1, 1, 0]),
    # (log w)² = 0, 1.21, 1.92, 3.21, 0.16 (mean 1.30): dropping 3.21 leaves 0.82, then 1.92 leaves 0.46 ≤ 0.5
    ("m2po", dict(tau=0.5), [1, 3, 0, 0, 1.5], [0, 0, 1, 1, 0]),
])
def test_token_level_corrections_match_their_formulas(name, params, weights, changed):
    resolved = c.Params(**params, levels=c.DEFAULTS[name].levels)
    check(c.apply(name, LOG_W, ALL, resolved), weights, [bool(x) for x in changed])


def test_sequence_level_tis_and_mis_weigh_each_answer_by_the_product_of_its_weights():
    tis = c.Params(high=2.0, levels=("token", "sequence"))
    check(c.apply("tis", LOG_W, ALL, tis, level="sequence", seq_ids=SEQ), [2.0] * 5, [True] * 5)
    roomy = c.Params(high=4.0, levels=("token", "sequence"))
    check(c.apply("tis", LOG_W, ALL, roomy, level="sequence", seq_ids=SEQ), [3, 3, 2.25, 2.25, 2.25], [False] * 5)
    mis = c.Params(high=2.5, levels=("token", "sequence"))  # answer 0 (ρ = 3) is dropped whole
    check(c.apply("mis", LOG_W, ALL, mis, level="sequence", seq_ids=SEQ), [0, 0, 2.25, 2.25, 2.25],
          [True, True, False, False, False])
    # A masked token does not enter its answer's product: answer 1 without the 0.25 has ρ = 9.
    mask = torch.tensor([True, True, False, True, True])
    w, outside = c.apply("tis", LOG_W, mask, c.Params(high=10.0, levels=("sequence",)), level="sequence", seq_ids=SEQ)
    assert w[3].item() == pytest.approx(9.0) and not outside.any()


def test_each_correction_reads_its_sources_values_unless_a_key_is_set():
    assert c.resolve("areal", low=None, high=None, tau=None).high == 5.0
    assert c.resolve("areal", low=None, high=math.inf, tau=None).high is None  # .inf: no cap
    assert (c.resolve("icepop", low=None, high=None, tau=None).low, c.resolve("icepop", low=None, high=None, tau=None).high) == (0.5, 5.0)
    assert c.resolve("tis", low=None, high=3.0, tau=None).high == 3.0
    assert c.resolve("m2po", low=None, high=None, tau=None).tau == 0.04
    assert c.resolve("vtrace", low=None, high=None, tau=None).high == 1.0
    with pytest.raises(ValueError, match="unknown correction 'x'"):
        c.resolve("x", low=None, high=None, tau=None)
    # the schema's choices are the corrections
    from areal_flow.config.schema import AlgorithmConfig as A
    import dataclasses
    choices = next(f for f in dataclasses.fields(A) if f.name == "correction").metadata["choices"]
    assert tuple(choices) == c.CORRECTIONS


@pytest.mark.parametrize("settings,message", [
    (dict(correction="tis", correction_tau=0.1), "algorithm.correction_tau=0.1 does not apply to algorithm.correction=tis"),
    (dict(correction="m2po", behav_weight_cap=3.0), "algorithm.behav_weight_cap=3.0 does not apply to algorithm.correction=m2po"),
    (dict(correction="vtrace", behav_weight_floor=0.5), "algorithm.behav_weight_floor=0.5 does not apply"),
    (dict(correction="icepop", correction_level="sequence"), "algorithm.correction_level=sequence: algorithm.correction=icepop"),
    (dict(correction="icepop", behav_weight_floor=6.0), "algorithm.behav_weight_floor=6.0 exceeds algorithm.behav_weight_cap=5.0"),
    (dict(clip_behav=True, policy_loss="cispo"), "algorithm.clip_behav=true: policy_loss=cispo"),
    (dict(clip_behav=True, importance_level="sequence"), "algorithm.clip_behav=true: importance_level=sequence"),
    (dict(clip_behav=True, decoupled=False), "algorithm.clip_behav=true: decoupled=false"),
])
def test_a_key_the_correction_does_not_read_is_refused_by_name(settings, message):
    problems = correction_problems(AlgorithmConfig(**settings))
    assert any(message in p for p in problems), problems


def test_the_default_and_well_formed_corrections_pass_the_checks():
    for settings in (dict(), dict(correction="tis", correction_level="sequence"), dict(correction="icepop"),
                     dict(clip_behav=True), dict(correction="mismatch_mask", correction_tau=0.2)):
        assert correction_problems(AlgorithmConfig(**settings)) == []
    assert RunConfig().algorithm.clip_behav is False and RunConfig().algorithm.correction == "areal"


def test_mismatch_sums_and_metrics_by_staleness():
    delta = torch.tensor([0.0, 1e-7, -0.2, 0.5, 2.0, -1.0, 9.0])
    mask = torch.tensor([True, True, True, True, True, True, False])
    staleness = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    past = torch.tensor([False, False, False, False, True, True, False])
    stats = {k: float(v) for k, v in mismatch_sums(staleness, mask, delta, past).items()}
    assert stats[MISMATCH.format("0", "tokens")] == 2 and stats[MISMATCH.format("2", "tokens")] == 2
    assert stats[MISMATCH.format("9+", "tokens")] == 0
    m = mismatch_metrics(stats)
    assert m["mismatch/1/abs_mean"] == pytest.approx(0.35) and m["mismatch/1/abs_max"] == pytest.approx(0.5)
    k3 = lambda d: math.exp(d) - 1 - d  # KL(π_behav ‖ π_start) from tokens π_behav sampled
    assert m["mismatch/2/k3"] == pytest.approx((k3(2.0) + k3(-1.0)) / 2)
    assert m["mismatch/2/past_fraction"] == 1.0 and m["mismatch/past_fraction"] == pytest.approx(2 / 6)
    assert m["mismatch/abs_max"] == 2.0  # the masked 9 is not counted
    assert m["mismatch/tokens"] == 6 and m["mismatch/0/abs_mean"] == pytest.approx(5e-8)
    # p99 is the upper edge of its histogram bin: 1e-6 for bucket 0 (0 and 1e-7), 3 for bucket 2 (2.0)
    assert m["mismatch/0/abs_p99"] == pytest.approx(1e-6) and m["mismatch/2/abs_p99"] == pytest.approx(3.0)
    assert "mismatch/9+/abs_mean" not in m and mismatch_metrics({}) == {}
