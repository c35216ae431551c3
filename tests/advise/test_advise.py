"""The allocation advisor: the simulation against hand-computed cases, the staleness rule it
follows, the fit from a run's metrics, and the CLI's answers to bad input."""

import json
import random
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from areal_flow.advise.__main__ import candidates, main, presets
from areal_flow.advise.cost_file import load_cost_file
from areal_flow.advise.costs import (
    AdviseError,
    Candidates,
    Costs,
    GenCosts,
    Latency,
    Lengths,
    TrainCosts,
    UpdateCosts,
    Workload,
    lognormal_from_max,
    lognormal_from_truncation,
)
from areal_flow.advise.fit import fit_runs
from areal_flow.advise.prediction import Candidate, Prediction
from areal_flow.advise.report import recommend
from areal_flow.advise.simulate import simulate

REPO = Path(__file__).resolve().parents[2]


def make(gen=GenCosts(0.01, 0.001, prefill_per_token_s=0.0), train=TrainCosts(0.0, 0.0), update=UpdateCosts(0.0),
         workload=Workload(batch_size=2, group_size=4, prompt_tokens=10), lengths=Lengths(100, mean=50),
         latency=Latency()) -> Costs:
    return Costs(gen, train, update, workload, lengths, latency)


def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """main(argv)'s exit status (argparse's own errors included), stdout and stderr."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- the simulation against cases computed by hand ---------------------------------------------

def test_with_free_training_and_a_large_eta_throughput_is_the_generation_rate():
    a, b = 0.01, 0.002
    # Two servers, two groups of 4 answers each (max_concurrent 4 groups), every answer 50 tokens:
    # each server always decodes 8 answers that finish together, 50 steps of a + 8b.
    costs = make(gen=GenCosts(a, b, prefill_per_token_s=0.0),
                 workload=Workload(batch_size=2, group_size=4, prompt_tokens=10, max_concurrent=4))
    p = simulate(costs, Candidate(2, 1, eta=16), steps=30)
    assert p.samples_per_s == pytest.approx(2 * 8 / (50 * (a + 8 * b)), rel=1e-9)
    assert p.gen_idle == pytest.approx(0.0, abs=1e-9)
    assert p.train_idle == pytest.approx(1.0, abs=1e-9)


def test_handing_answers_back_and_the_control_paths_delays_leave_the_servers_idle():
    a, b, h, admit, deliver = 0.01, 0.002, 0.003, 0.02, 0.05
    # As above; after each 50 steps a server hands its 8 answers back (8h), the controller hears
    # of the groups `deliver` later, and their replacements reach the server `admit` after that.
    costs = make(gen=GenCosts(a, b, prefill_per_token_s=0.0, answer_s=h),
                 workload=Workload(batch_size=2, group_size=4, prompt_tokens=10, max_concurrent=4),
                 latency=Latency(admit_s=admit, deliver_s=deliver))
    p = simulate(costs, Candidate(2, 1, eta=16), steps=30)
    cycle = 50 * (a + 8 * b) + 8 * h + deliver + admit
    assert p.samples_per_s == pytest.approx(2 * 8 / cycle, rel=1e-9)
    assert p.gen_idle == pytest.approx((8 * h + deliver + admit) / cycle, rel=1e-6)  # not computing


def test_with_free_generation_throughput_is_the_training_rate():
    c, d, w = 0.5, 0.001, 0.1
    costs = make(gen=GenCosts(0.0, 0.0, prefill_per_token_s=0.0), train=TrainCosts(c, d), update=UpdateCosts(w))
    tokens = 2 * 4 * (10 + 50)  # B·G answers of prompt + answer
    # The trainer trains the next step while the servers load the weights: never idle.
    p = simulate(costs, Candidate(1, 2, eta=2), steps=10)
    assert p.samples_per_s == pytest.approx(8 / (c + d * tokens / 2), rel=1e-9)  # two data-parallel devices
    assert p.train_idle == pytest.approx(0.0, abs=1e-9)
    # Waiting for each update (weights by broadcast), the pause adds to every step.
    waits = replace(costs, update=UpdateCosts(w, trainer_waits=True))
    p = simulate(waits, Candidate(1, 2, eta=2), steps=10)
    step = c + d * tokens / 2 + w
    assert p.samples_per_s == pytest.approx(8 / step, rel=1e-9)
    assert p.train_idle == pytest.approx(w / step, rel=1e-6)
    # An update longer than a train step: at most one step per update (one update at a time), yet
    # more than one after the other.
    slow = simulate(replace(costs, update=UpdateCosts(2.0)), Candidate(1, 2, eta=2), steps=12)
    assert 8 / (c + d * tokens / 2 + 2.0) < slow.samples_per_s <= 8 / 2.0 + 1e-9


def test_dynamic_filtering_trains_the_kept_share_of_what_generation_finishes():
    # As above, generation bound: the servers finish groups at the same rate, and filtering drops
    # about f of them, so trained samples/s fall to about (1 − f) of the unfiltered rate.
    a, b = 0.01, 0.002
    costs = make(gen=GenCosts(a, b, prefill_per_token_s=0.0),
                 workload=Workload(batch_size=2, group_size=4, prompt_tokens=10, max_concurrent=4))
    full = simulate(costs, Candidate(2, 1, eta=16), steps=1000)
    for f in (0.25, 0.6):
        kept = simulate(replace(costs, workload=replace(costs.workload, filtered_fraction=f)),
                        Candidate(2, 1, eta=16), steps=1000)
        assert kept.samples_per_s == pytest.approx((1 - f) * full.samples_per_s, rel=0.05)
        assert kept.gen_idle == pytest.approx(0.0, abs=1e-9)  # the servers never wait: a filtered group frees its slot
    # Training bound, the generator's slack absorbs filtering: the same steps/s.
    slow_train = replace(costs, train=TrainCosts(1.0, 0.0))  # 8 samples/s against 12.3 generated
    filtered = replace(slow_train, workload=replace(costs.workload, filtered_fraction=0.25))
    assert simulate(filtered, Candidate(2, 1, eta=16), steps=50).samples_per_s == pytest.approx(
        simulate(slow_train, Candidate(2, 1, eta=16), steps=50).samples_per_s, rel=0.02)


def test_with_several_seeds_a_prediction_is_the_mean_of_their_simulations():
    costs = make(lengths=Lengths(100, mean=40, sigma=0.5),
                 workload=Workload(batch_size=2, group_size=4, prompt_tokens=10, filtered_fraction=0.3))
    cand = Candidate(1, 1, eta=2)
    each = [simulate(costs, cand, steps=15, seed=s) for s in (3, 4, 5)]
    assert len({p.samples_per_s for p in each}) == 3  # the draws differ
    mean = simulate(costs, cand, steps=15, seed=3, seeds=3)
    for name in ("samples_per_s", "tokens_per_s", "gen_idle", "train_idle", "staleness_mean", "step_s"):
        assert getattr(mean, name) == pytest.approx(statistics.mean(getattr(p, name) for p in each))
    assert mean.staleness_max == max(p.staleness_max for p in each) and mean.steps == 15
    with pytest.raises(AdviseError, match="--seeds must be at least 1"):
        simulate(costs, cand, seeds=0)


def test_eta_0_is_the_synchronous_loop_computed_by_hand():
    costs = make(gen=GenCosts(0.01, 0.001, prefill_per_token_s=1e-4), train=TrainCosts(1.0, 0.001),
                 update=UpdateCosts(0.5, colocated_switch_s=0.3))
    # One server: two prompts prefilled (10 tokens each), then 50 decode steps of 8 answers;
    # train 8 answers of 60 tokens on one device; the update pause.
    gen = 2 * 10 * 1e-4 + 50 * (0.01 + 0.001 * 8)
    step = gen + (1.0 + 0.001 * 480) + 0.5
    p = simulate(costs, Candidate(1, 1, eta=0), steps=5)
    assert p.samples_per_s == pytest.approx(8 / step, rel=1e-9)
    assert p.staleness_max == 0
    # Colocated on 2 devices: a group per server, 4 answers a step; training on both; the switch.
    gen2 = 10 * 1e-4 + 50 * (0.01 + 0.001 * 4)
    step2 = gen2 + (1.0 + 0.001 * 480 / 2) + 0.5 + 0.3
    p2 = simulate(costs, Candidate(2, 2, eta=0, colocated=True), steps=5)
    assert p2.samples_per_s == pytest.approx(8 / step2, rel=1e-9)


# ---- colocated: generation and training take turns on every device --------------------------------

# A step's generation on one server (16 answers of ~50 tokens at ~1 ms a token) and its training on
# one device (0.4 s + 960 tokens at 0.42 ms) both take about 0.8 s.
BALANCED = dict(gen=GenCosts(0.001, 0.001, prefill_per_token_s=1e-5), train=TrainCosts(0.4, 0.00042),
                update=UpdateCosts(0.1), workload=Workload(batch_size=4, group_size=4, prompt_tokens=10),
                lengths=Lengths(100, mean=50, sigma=0.3))


def best_split(costs: Costs, devices: int, etas=(0, 1, 2, 4)) -> Prediction:
    return max((simulate(costs, Candidate(gen, devices - gen, eta), steps=20) for gen in range(1, devices)
                for eta in etas), key=lambda p: p.samples_per_s)


def best_colocated(costs: Costs, devices: int, etas=(0, 1, 2, 4)) -> Prediction:
    return max((simulate(costs, Candidate(devices, devices, eta, colocated=True), steps=20) for eta in etas),
               key=lambda p: p.samples_per_s)


def test_colocated_is_slower_than_a_split_whose_two_sides_overlap_in_balance():
    """On 2 devices, a 1:1 split whose generation and training take about as long each: with η > 0
    they overlap, a step takes about the longer of the two. Colocated they alternate, each on both
    devices, but what does not halve with the devices (c) and the update come on top."""
    costs = make(**BALANCED)
    split = simulate(costs, Candidate(1, 1, eta=4), steps=20)
    sync = simulate(costs, Candidate(1, 1, eta=0), steps=20)
    assert split.gen_idle < 0.2 and split.train_idle < 0.2  # balanced: neither side waits much
    assert split.samples_per_s > 1.5 * sync.samples_per_s  # asynchrony overlaps them
    assert best_split(costs, 2).candidate.eta == 4
    assert best_colocated(costs, 2).samples_per_s < 0.9 * split.samples_per_s


def test_colocated_beats_every_split_of_two_devices_when_generation_costs_far_more():
    """Generation 3× training: the 1:1 split's trainer waits most of each step on its device;
    colocated, generation has both devices for its turn and the trainer its short one."""
    costs = make(**{**BALANCED, "train": TrainCosts(0.1, 0.00019)})  # 0.28 s on one device
    split, colocated = best_split(costs, 2), best_colocated(costs, 2)
    assert split.train_idle > 0.55  # the split wastes the trainer's device
    # About 0.42 s of generation on two servers + 0.19 s of training on two devices + the 0.1 s
    # update, against the split's ~0.84 s of generation on one server.
    assert colocated.samples_per_s > 1.15 * split.samples_per_s


def test_a_colocated_step_is_the_generation_turn_the_train_step_and_the_update_one_after_the_other(tmp_path):
    """A deterministic cost file: nothing overlaps and nothing waits, so a step is the servers'
    busy time plus the train step on both devices plus the load and the switch; at η = 0 the
    generation turn is the synchronous loop's, on both devices, computed by hand."""
    path = tmp_path / "costs.yaml"
    path.write_text(yaml.safe_dump({
        "generation": {"step_fixed_s": 0.01, "step_per_seq_s": 0.001, "prefill_per_token_s": 1e-4},
        "training": {"step_fixed_s": 1.0, "per_token_s": 0.001},
        "weights": {"pause_s": 0.5, "colocated_switch_s": 0.3},
        "workload": {"batch_size": 2, "group_size": 4, "prompt_tokens": 10, "max_new_tokens": 100,
                     "interrupt": True, "lengths": {"constant": 50}},
    }))
    costs, _ = load_cost_file(path)
    train, update = 1.0 + 0.001 * 2 * 4 * (10 + 50) / 2, 0.5 + 0.3  # 8 answers of 60 tokens on 2 devices
    for eta in (0, 1, 2):
        p = simulate(costs, Candidate(2, 2, eta=eta, colocated=True), steps=12)
        gen_turn = (1 - p.gen_idle) * p.step_s  # the mean server's decode and prefill seconds per step
        assert (1 - p.train_idle) * p.step_s == pytest.approx(train, rel=1e-9)  # on both devices
        assert p.step_s == pytest.approx(gen_turn + train + update, rel=1e-6)
        if eta == 0:  # one group per server: 2 prefills of 10 tokens, 50 decode steps of 4 answers
            assert gen_turn == pytest.approx(10 * 1e-4 + 50 * (0.01 + 0.001 * 4), rel=1e-9)
    # A split of the same devices with η > 0 overlaps generation with training instead.
    split = simulate(costs, Candidate(1, 1, eta=2), steps=12)
    assert (1 - split.gen_idle) + (1 - split.train_idle) > 1.2


def test_colocated_answers_that_outlive_their_batch_keep_their_tokens():
    """η = 2 with a long tail: the batch is taken while long answers still run; they are retracted
    for the train step with their tokens so far and go on after, so every trained answer has tokens
    of more than one version, and colocated beats its own synchronous loop (η = 0)."""
    costs = make(gen=GenCosts(0.002, 0.0005, prefill_per_token_s=1e-5), train=TrainCosts(0.05, 2e-5),
                 update=UpdateCosts(0.02), workload=Workload(batch_size=4, group_size=4, prompt_tokens=20),
                 lengths=LONG_TAIL)
    sync = simulate(costs, Candidate(2, 2, eta=0, colocated=True), steps=15)
    ahead = simulate(costs, Candidate(2, 2, eta=2, colocated=True), steps=15)
    assert sync.staleness_max == 0 and 0 < ahead.staleness_mean and ahead.staleness_max == 2
    assert ahead.samples_per_s > 1.2 * sync.samples_per_s


def test_one_device_has_colocated_as_its_only_candidate(tmp_path, capsys):
    only = candidates(Candidates(splits=((1, 1), (3, 1)), etas=(0, 2), devices=1), [True, False])
    assert only == [Candidate(1, 1, 0, True, colocated=True), Candidate(1, 1, 2, True, colocated=True)]
    # With several devices: each split × η × interrupt, then colocated on all of them × η, interrupting.
    four = candidates(Candidates(splits=((3, 1), (1, 1)), etas=(0, 2), devices=4), [False])
    assert [c.label for c in four] == ["3:1", "3:1", "2:2", "2:2", "colocated (4)", "colocated (4)"]
    assert all(c.interrupt for c in four if c.colocated) and not any(c.interrupt for c in four if not c.colocated)
    assert len(candidates(Candidates(splits=((3, 1),), etas=(0,), devices=4, colocated=False), [True])) == 1

    path = tmp_path / "costs.yaml"
    path.write_text(yaml.safe_dump({"workload": {"batch_size": 2, "group_size": 2, "max_new_tokens": 64,
                                                 "lengths": {"constant": 20}}}))
    code, out, _ = cli(["--costs", str(path), "--devices", "1", "--etas", "0", "1", "--steps", "3"], capsys)
    assert code == 0 and out.count("colocated (1)") == 2 and "1:1" not in out
    assert "recommended: colocated on all 1 device(s)" in out
    code, _, err = cli(["--costs", str(path), "--devices", "1", "--no-colocated"], capsys)
    assert code == 2 and "--devices 1: one device cannot be split" in err


def test_an_interrupting_update_pauses_for_its_own_cost_and_a_draining_one_for_w():
    costs = make(gen=GenCosts(0.01, 0.001, prefill_per_token_s=1e-4), train=TrainCosts(1.0, 0.001),
                 update=UpdateCosts(0.5, interrupt_pause_s=0.9))
    gen = 2 * 10 * 1e-4 + 50 * (0.01 + 0.001 * 8)  # as in the synchronous loop above
    for interrupt, pause in ((True, 0.9), (False, 0.5)):
        work = replace(costs.workload, interrupt=interrupt)
        p = simulate(replace(costs, workload=work), Candidate(1, 1, eta=0, interrupt=interrupt), steps=5)
        assert p.samples_per_s == pytest.approx(8 / (gen + 1.0 + 0.001 * 480 + pause), rel=1e-9)


def test_the_context_term_adds_each_answers_growing_kv_read():
    e = 1e-4
    costs = make(gen=GenCosts(0.01, 0.001, step_per_context_token_s=e, prefill_per_token_s=0.0),
                 workload=Workload(batch_size=1, group_size=4, prompt_tokens=10))
    step = sum(0.01 + 0.001 * 4 + e * 4 * (10 + j) for j in range(50))  # the context grows a token per step
    assert simulate(costs, Candidate(1, 1, eta=0), steps=3).step_s == pytest.approx(step, rel=1e-9)


def test_a_long_queue_joins_a_running_batch_only_in_groups():
    """The embedded engine admits queued answers into a running batch only once min(join_group,
    queued) have room (each join is a prefill). η = 0, one server of 4 answers, two groups of
    answers 10, 20, 30 and 40 tokens long: the second group waits in the queue."""
    def step(join_group: int) -> float:
        costs = make(gen=GenCosts(0.01, 0.001, prefill_per_token_s=0.0, prefill_fixed_s=0.005, max_running=4,
                                  join_group=join_group),
                     train=TrainCosts(0.1, 0.0), update=UpdateCosts(0.05),
                     lengths=Lengths(100, groups=((10, 20, 30, 40),)))
        return simulate(costs, Candidate(1, 1, eta=0), steps=4).step_s

    # Joining 4 at once: the second group starts when the first has ended, 40 steps of 4, 3, 2, 1
    # answers each; two prefills, the train step and the update.
    assert step(4) == pytest.approx(2 * (0.005 + 40 * 0.01 + 0.001 * (4 + 3 + 2 + 1) * 10) + 0.1 + 0.05, rel=1e-9)
    # By 2: answers 1, 2 of the second group join at step 20, 3, 4 at step 30; 70 steps of
    # 4, 3, 4, 4, 2 (20 steps), 1 answers, three prefills.
    assert step(2) == pytest.approx(0.005 * 3 + 70 * 0.01 + 0.001 * 10 * (4 + 3 + 4 + 4 + 2 * 2 + 1) + 0.1 + 0.05,
                                    rel=1e-9)


# ---- the staleness rule -------------------------------------------------------------------------

LONG_TAIL = Lengths(400, mean=80, sigma=1.0)


@pytest.mark.parametrize("eta", [0, 1, 3])
@pytest.mark.parametrize("interrupt,colocated", [(True, False), (False, False), (True, True)])
def test_realised_staleness_never_exceeds_eta(eta, interrupt, colocated):
    costs = make(gen=GenCosts(0.002, 0.0005, prefill_per_token_s=1e-5, max_running=12), train=TrainCosts(0.05, 2e-5),
                 update=UpdateCosts(0.02), workload=Workload(batch_size=4, group_size=4, prompt_tokens=20,
                                                             interrupt=interrupt), lengths=LONG_TAIL)
    cand = Candidate(2, 2, eta, interrupt, colocated=True) if colocated else Candidate(2, 1, eta, interrupt)
    p = simulate(costs, cand, steps=15)
    assert p.staleness_max <= eta
    if eta:
        assert p.staleness_max >= 1  # generation runs ahead: the bound is what holds it


@pytest.mark.parametrize("eta,max_concurrent,colocated", [(0, None, False), (2, None, False), (4, 6, False),
                                                         (2, None, True)])
def test_the_admission_cap_holds_at_every_admission(eta, max_concurrent, colocated):
    """Counts only grow at an admission (finishing moves a group from running to accepted, a new
    version raises the limit), so checking there checks every instant."""
    B = 4
    costs = make(gen=GenCosts(0.002, 0.0005, prefill_per_token_s=1e-5), train=TrainCosts(0.05, 2e-5),
                 update=UpdateCosts(0.02), workload=Workload(batch_size=B, group_size=3, prompt_tokens=20,
                                                             max_concurrent=max_concurrent), lengths=LONG_TAIL)
    trace: list = []
    simulate(costs, Candidate(2, 2 if colocated else 1, eta=eta, colocated=colocated), steps=12, trace=trace)
    assert len(trace) > 12 * B
    versions = [v for _, v, _, _, _ in trace]
    assert versions == sorted(versions) and versions[-1] >= 12
    for _, version, accepted, running, unfinished in trace:
        assert accepted + running <= (eta + version + 1) * B
        assert running <= (max_concurrent or running)
        assert unfinished == running  # the servers hold exactly the groups the manager counts as running


def test_interrupting_beats_draining_when_a_long_answer_is_in_flight():
    costs = make(gen=GenCosts(0.002, 0.0005, prefill_per_token_s=0.0), train=TrainCosts(0.05, 2e-5),
                 update=UpdateCosts(0.02), workload=Workload(batch_size=4, group_size=4, prompt_tokens=20),
                 lengths=LONG_TAIL)
    drain = simulate(replace(costs, workload=replace(costs.workload, interrupt=False)), Candidate(2, 1, 2, False))
    interrupt = simulate(costs, Candidate(2, 1, 2, True))
    # Free re-prefills: interrupting only saves the wait for the longest running answer.
    assert interrupt.samples_per_s > 1.1 * drain.samples_per_s
    assert drain.train_idle > interrupt.train_idle


def test_a_longer_tail_widens_the_async_over_sync_ratio():
    def ratio(values: list[int]) -> float:
        costs = make(gen=GenCosts(0.01, 0.0005, prefill_per_token_s=1e-5), train=TrainCosts(0.5, 1e-4),
                     update=UpdateCosts(0.2, 0.2), workload=Workload(batch_size=8, group_size=4, prompt_tokens=20),
                     lengths=Lengths(600, values=tuple(values)))
        async_ = simulate(costs, Candidate(3, 1, eta=4), steps=12)
        sync = simulate(costs, Candidate(4, 4, eta=0, colocated=True), steps=12)
        return async_.samples_per_s / sync.samples_per_s

    short, long = ratio([90, 110]), ratio([50] * 9 + [550])  # both average 100 tokens
    assert long > 1.2 * short


def test_ties_go_to_the_least_stale_candidate():
    def pred(eta: int, rate: float, staleness: float) -> Prediction:
        return Prediction(Candidate(1, 1, eta), rate, 0.0, 0.0, 0.0, staleness, eta, 1.0, 1.0, 1)

    preds = [pred(8, 100.0, 7.5), pred(2, 99.5, 1.8), pred(1, 90.0, 0.9)]
    assert recommend(preds, tolerance=0.01).candidate.eta == 2
    assert recommend(preds, tolerance=0.0).candidate.eta == 8


# ---- fitting from a run -------------------------------------------------------------------------

A, B_SEQ, C, D = 0.002, 0.0005, 0.3, 0.0002


def write_run(run: Path, interrupt: bool = False, eta: int = 1, colocated: bool = False) -> None:
    """A run directory as launch.py and the controller leave it: config.yaml and metrics.jsonl,
    its step rows made from known costs (colocated: training on generation's device 0)."""
    run.mkdir()
    config = {
        "algorithm": {"batch_size": 4, "group_size": 2, "max_new_tokens": 100, "ppo_epochs": 1},
        "rollout": {"max_staleness": eta, "max_concurrent": 8, "interrupt": interrupt},
        "generation": {"backend": "embedded", "tp_size": 1, "max_batch_size": None},
        "graph": {"generate": {"type": "generate", "mesh": "0"}, "reward": {"type": "reward"},
                  "actor_train": {"type": "train", "mesh": "0" if colocated else "1"}},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    rows = [{"event": "start", "batch_size": 4, "group_size": 2, "max_staleness": eta}]
    for i in range(13):
        running = 2 + i % 6  # groups: n = 2·running answers on the one server
        tokens, trained = 300 + 37 * i, 400 + 53 * (i % 5)
        busy = A * tokens / (2 * running) + B_SEQ * tokens
        seconds = busy + 0.5
        rows.append({"event": "step", "step": i + 1, "step_seconds": seconds, "generator_idle": 1 - busy / seconds,
                     "gen_tokens_per_second": tokens / seconds, "running": running,
                     "train_seconds": C + D * trained, "train/n_tokens": trained, "train/prox_seconds": 0.0,
                     "update_seconds": 0.04 + 0.01 * (i % 3), "response_length": 40.0 + i % 2,
                     "truncated_fraction": 0.05})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_from_run_fits_the_costs_from_metrics(tmp_path, capsys):
    write_run(tmp_path / "run")
    base, _ = load_cost_file(REPO / "conf" / "advise" / "example.yaml")
    fitted = fit_runs([str(tmp_path / "run")], base)
    gen, train = fitted.costs.gen, fitted.costs.train
    assert gen.step_fixed_s == pytest.approx(A, rel=1e-6)
    assert gen.step_per_seq_s == pytest.approx(B_SEQ, rel=1e-6)
    assert gen.max_running == 128 and gen.join_group == 16  # the embedded engine's default batch, and its joins
    assert (train.step_fixed_s, train.per_token_s) == pytest.approx((C, D), rel=1e-6)
    assert fitted.costs.update.pause_s == pytest.approx(0.04)  # without interruption: the least update
    assert fitted.split == (1, 1) and fitted.eta == 1
    assert fitted.costs.workload.batch_size == 4 and fitted.costs.workload.interrupt is False
    assert fitted.costs.lengths.sigma > 0 and fitted.costs.lengths.mean == pytest.approx(40.5)
    # What the metrics cannot give is named, with where it came from.
    assert any("p = 8e-06 s/token from the cost file" in n for n in fitted.notes)

    code, out, _ = cli(["--costs", str(REPO / "conf" / "advise" / "example.yaml"), "--from-run",
                        str(tmp_path / "run"), "--etas", "0", "1", "--steps", "3"], capsys)
    assert code == 0
    assert "fit:" in out and "1:1" in out and "recommended" in out


def test_a_colocated_run_is_predicted_colocated_on_its_devices(tmp_path, capsys):
    """Training on generation's mesh: the run's own allocation is colocated on that one device,
    so --from-run predicts it (at each η) and no split, unless splits are asked for."""
    write_run(tmp_path / "run", interrupt=True, eta=2, colocated=True)
    base, _ = load_cost_file(REPO / "conf" / "advise" / "example.yaml")
    fitted = fit_runs([str(tmp_path / "run")], base)
    assert fitted.colocated and fitted.split == (1, 1)
    # Its train_seconds run from the servers' release to their resume: c holds the switch, not the cost file.
    assert base.update.colocated_switch_s == 5.0 and fitted.costs.update.colocated_switch_s == 0.0
    write_run(tmp_path / "split")
    assert not fit_runs([str(tmp_path / "split")], base).colocated
    code, out, _ = cli(["--from-run", str(tmp_path / "run"), "--etas", "0", "2", "--steps", "3"], capsys)
    assert code == 0 and out.count("colocated (1)") == 2 and "1:1" not in out
    code, out, _ = cli(["--from-run", str(tmp_path / "run"), "--etas", "2", "--splits", "1:1", "--steps", "3"], capsys)
    assert code == 0 and "1:1" in out and "colocated (2)" in out


def test_the_share_of_groups_dynamic_filtering_drops_is_fitted_from_the_step_rows(tmp_path):
    write_run(tmp_path / "run")
    base, _ = load_cost_file(REPO / "conf" / "advise" / "example.yaml")
    assert fit_runs([str(tmp_path / "run")], base).costs.workload.filtered_fraction == 0.0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for i, row in enumerate(r for r in rows if r["event"] == "step"):
        row["filtered_groups"] = 2 + i % 3  # beside the batch's 4 groups trained
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fitted = fit_runs([str(tmp_path / "run")], base)
    # The first step row (start-up) is left out: steps 2..13 filtered 3,4,2,3,... groups.
    filtered = sum(2 + i % 3 for i in range(1, 13))
    assert fitted.costs.workload.filtered_fraction == pytest.approx(filtered / (filtered + 4 * 12))
    assert any(f"dynamic filtering dropped {filtered} groups beside 48 trained" in n for n in fitted.notes)


def test_the_train_cost_comes_from_the_phase_timers_when_tokens_hardly_vary(tmp_path):
    """A fixed batch shape gives nearly the same tokens every step, so totals cannot separate c from
    d; the trainer's phase timers can: forward and backward scale with tokens, the rest is per step."""
    write_run(tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows[1:]):
        trained = 1000 + i % 2  # tokens per step all but constant
        row.update({"train/n_tokens": trained, "train/forward_seconds": 0.4 * D * trained,
                    "train/backward_seconds": 0.6 * D * trained, "train/optimizer_seconds": C / 2,
                    "train/prox_seconds": 0.05, "train_seconds": C + D * trained + 0.05})
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base, _ = load_cost_file(REPO / "conf" / "advise" / "example.yaml")
    fitted = fit_runs([str(tmp_path / "run")], base)
    assert (fitted.costs.train.step_fixed_s, fitted.costs.train.per_token_s) == pytest.approx((C, D), rel=1e-6)
    assert any("phase timers" in n for n in fitted.notes)
    # Without the timers the same steps fall back to the cost file's c.
    for row in rows[1:]:
        del row["train/forward_seconds"], row["train/backward_seconds"]
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert any("vary too little" in n for n in fit_runs([str(tmp_path / "run")], base).notes)


P_TOKEN, P0 = 3e-5, 0.004


def add_compute_counts(run: Path, slowdown: float = 0.0, train_slowdown: float = 0.0, kv: float | None = None,
                       width: Callable[[int], int] = lambda j: 10 + 7 * j % 23) -> list[dict]:
    """The servers' compute counts (`gen/*`) in a written run's step rows, from A, B_SEQ and P_TOKEN
    (each second `slowdown` more for the share of the step the trainer trains, each train second
    `train_slowdown` more for the share the generator is busy: what sharing a machine adds); returns the rows.
    With `kv` (e, seconds per KV position), the engine's counts of what it reads: decode step j
    reads its n answers × width(j) positions, and prefills of different sizes cost P0 + P_TOKEN·m."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows[1:]):
        sizes = [1 + (i + j) % 9 for j in range(40)]  # 40 decode steps of 1 to 9 answers
        kvs = [n * width(j) for j, n in enumerate(sizes)] if kv is not None else [0] * len(sizes)
        seconds = [A + B_SEQ * n + (kv or 0.0) * k for n, k in zip(sizes, kvs)]
        prefills, tokens = 2 + i % 3, 50 + 13 * i
        # With kv: prefills of m = 20, 50, 80, ... positions (padding included), each P0 + P_TOKEN·m.
        sizes_m = [20 + 30 * j + i for j in range(prefills)] if kv is not None else []
        positions = sum(sizes_m) if kv is not None else tokens
        fixed = P0 if kv is not None else A
        row["train_seconds"] *= 1 + train_slowdown * (1 - row["generator_idle"])
        slower = 1 + slowdown * min(1.0, row["train_seconds"] / row["step_seconds"])
        row.update({"gen/decode_steps": len(sizes), "gen/decode_rows": sum(sizes),
                    "gen/decode_rows_sq": sum(n * n for n in sizes),
                    "gen/decode_seconds": slower * sum(seconds),
                    "gen/decode_row_seconds": slower * sum(n * t for n, t in zip(sizes, seconds)),
                    "gen/prefills": prefills, "gen/prefill_tokens": tokens,
                    "gen/prefill_seconds": slower * (fixed * prefills + P_TOKEN * positions)})
        if kv is not None:
            row.update({"gen/decode_kv": sum(kvs), "gen/decode_kv_sq": sum(k * k for k in kvs),
                        "gen/decode_rows_kv": sum(n * k for n, k in zip(sizes, kvs)),
                        "gen/decode_kv_seconds": slower * sum(k * t for k, t in zip(kvs, seconds)),
                        "gen/prefill_positions": positions, "gen/prefill_positions_sq": sum(m * m for m in sizes_m),
                        "gen/prefill_position_seconds": slower * sum(m * (P0 + P_TOKEN * m) for m in sizes_m)})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_the_servers_compute_counts_give_the_decode_and_prefill_costs(tmp_path):
    """Where the servers count their own decode steps and prefills (the embedded engine), a and b
    come from those, not from the step's busy share, and p from the prefills beyond a's fixed cost."""
    write_run(tmp_path / "run", interrupt=True)  # interrupting: without counts, a and b could not come from it
    rows = add_compute_counts(tmp_path / "run")
    base, _ = load_cost_file(REPO / "conf" / "advise" / "example.yaml")
    fitted = fit_runs([str(tmp_path / "run")], base)
    gen = fitted.costs.gen
    assert (gen.step_fixed_s, gen.step_per_seq_s) == pytest.approx((A, B_SEQ), rel=1e-6)
    assert (gen.prefill_fixed_s, gen.prefill_per_token_s) == pytest.approx((A, P_TOKEN), rel=1e-6)
    assert gen.max_running == 128
    assert any("compute counts" in n for n in fitted.notes)
    # Steps all of one size cannot separate a from b: the mean step is a, and b is 0.
    for row in rows[1:]:
        row["gen/decode_rows_sq"] = row["gen/decode_rows"] ** 2 / row["gen/decode_steps"]
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    flat = fit_runs([str(tmp_path / "run")], base)
    assert flat.costs.gen.step_per_seq_s == 0 and any("vary too little in size" in n for n in flat.notes)


def test_the_servers_time_outside_compute_and_waits_is_fitted_per_answer_handed_back(tmp_path):
    write_run(tmp_path / "run")
    rows = add_compute_counts(tmp_path / "run")
    base, _ = load_cost_file(REPO / "conf" / "advise" / "example.yaml")
    assert fit_runs([str(tmp_path / "run")], base).costs.gen.answer_s == base.gen.answer_s  # not counted: the file's
    h = 0.0004
    for i, row in enumerate(rows[1:]):
        row["generator_load"] = 0.01
        row["gen/answered"] = 20 + 3 * i
        row["gen/waited"] = (row["step_seconds"] * 0.99 - row["gen/decode_seconds"] - row["gen/prefill_seconds"]
                             - h * row["gen/answered"])
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fitted = fit_runs([str(tmp_path / "run")], base)
    assert fitted.costs.gen.answer_s == pytest.approx(h, rel=1e-6)
    assert any("answer_s = 0.0004 s" in n for n in fitted.notes)


def test_the_kv_positions_a_decode_step_reads_are_fitted_apart_from_its_answers(tmp_path):
    """The embedded engine counts the KV positions each decode step reads (its answers × the padded
    width) and the positions each prefill computes: e, and p0 and p per position, come out by least
    squares, and the costs say the batch is padded."""
    write_run(tmp_path / "run")
    add_compute_counts(tmp_path / "run", kv=2e-6)
    base, _ = load_cost_file(REPO / "conf" / "advise" / "example.yaml")
    fitted = fit_runs([str(tmp_path / "run")], base)
    gen = fitted.costs.gen
    assert (gen.step_fixed_s, gen.step_per_seq_s, gen.step_per_context_token_s) == pytest.approx((A, B_SEQ, 2e-6), rel=1e-6)
    assert (gen.prefill_fixed_s, gen.prefill_per_token_s) == pytest.approx((P0, P_TOKEN), rel=1e-6) and gen.padded
    assert any("KV position" in n for n in fitted.notes)


def test_a_width_that_never_changes_leaves_the_kv_read_inside_b(tmp_path):
    """Every step reading 30 positions per answer: k = 30·n cannot be told from n, so e = 0 and b
    holds the read."""
    write_run(tmp_path / "run")
    add_compute_counts(tmp_path / "run", kv=2e-6, width=lambda j: 30)
    base, _ = load_cost_file(REPO / "conf" / "advise" / "example.yaml")
    fitted = fit_runs([str(tmp_path / "run")], base)
    gen = fitted.costs.gen
    assert (gen.step_fixed_s, gen.step_per_seq_s, gen.step_per_context_token_s) == pytest.approx(
        (A, B_SEQ + 30 * 2e-6, 0.0), rel=1e-6, abs=1e-12)
    assert any("too close to n·const" in n for n in fitted.notes)


def test_padding_costs_only_where_the_answers_differ_in_length():
    """One group at a time with answers all of one length: every answer has the longest context,
    so padding adds nothing. Lengths that differ, or groups of different ages in one batch, pay for it."""
    gen = GenCosts(0.002, 1e-4, step_per_context_token_s=1e-5, prefill_per_token_s=1e-5)
    same = make(gen=gen, lengths=Lengths(100, mean=60),
                workload=Workload(batch_size=2, group_size=4, prompt_tokens=10, max_concurrent=1))
    padded = replace(same, gen=replace(gen, padded=True))
    cand = Candidate(1, 1, eta=2)
    assert simulate(padded, cand, steps=6) == simulate(same, cand, steps=6)
    varied = replace(same, lengths=Lengths(100, mean=60, sigma=0.6), workload=replace(same.workload, max_concurrent=8))
    varied_padded = replace(varied, gen=replace(gen, padded=True))
    assert simulate(varied_padded, cand, steps=6).samples_per_s < simulate(varied, cand, steps=6).samples_per_s


@pytest.mark.parametrize("eta,colocated", [(0, False), (2, True)])
def test_a_synchronous_run_gives_the_costs_alone_and_the_asynchronous_ones_what_overlapping_adds(tmp_path, eta,
                                                                                                colocated):
    """Sharing a machine, each side runs slower while the other works; at η = 0, or colocated at
    any η, they take turns."""
    write_run(tmp_path / "sync", eta=eta, interrupt=colocated, colocated=colocated)
    add_compute_counts(tmp_path / "sync")
    write_run(tmp_path / "async", eta=4)
    add_compute_counts(tmp_path / "async", slowdown=0.25, train_slowdown=0.1)
    base, _ = load_cost_file(REPO / "conf" / "advise" / "example.yaml")
    costs = fit_runs([str(tmp_path / "async"), str(tmp_path / "sync")], base).costs
    assert (costs.gen.step_fixed_s, costs.gen.step_per_seq_s, costs.gen.prefill_per_token_s) == pytest.approx(
        (A, B_SEQ, P_TOKEN), rel=1e-6)
    assert (costs.train.step_fixed_s, costs.train.per_token_s) == pytest.approx((C, D), rel=1e-6)
    assert (costs.gen.shared_slowdown, costs.train.shared_slowdown) == pytest.approx((0.25, 0.1), rel=1e-6)
    # Asynchronous runs alone cannot tell: no slowdown, and the costs are what they measured, which
    # is slower than alone but not by the whole slowdown (the trainer trained part of each step).
    alone = fit_runs([str(tmp_path / "async")], base)
    assert alone.costs.gen.shared_slowdown == 0 and any("no synchronous or colocated run" in n for n in alone.notes)
    assert 1.05 * A < alone.costs.gen.step_fixed_s < 1.25 * A


def test_sharing_slows_only_what_overlaps():
    """At η = 0 generation and training never overlap, so the slowdowns change nothing; with η = 4
    they overlap, and the pipeline is slower, yet no slower than with every op slowed."""
    gen, train = GenCosts(0.01, 0.001, prefill_per_token_s=0.0), TrainCosts(0.2, 0.0005)
    plain = make(gen=gen, train=train, lengths=Lengths(100, mean=50, sigma=0.4))
    shared = replace(plain, gen=replace(gen, shared_slowdown=0.5), train=replace(train, shared_slowdown=0.3))
    assert simulate(shared, Candidate(1, 1, eta=0), steps=8) == simulate(plain, Candidate(1, 1, eta=0), steps=8)
    fast, slow = simulate(plain, Candidate(1, 1, eta=4), steps=20), simulate(shared, Candidate(1, 1, eta=4), steps=20)
    assert fast.samples_per_s / 1.5 <= slow.samples_per_s < 0.95 * fast.samples_per_s


def test_each_kind_of_update_is_fitted_from_the_runs_of_its_kind(tmp_path):
    write_run(tmp_path / "drain")
    write_run(tmp_path / "interrupt", interrupt=True)  # the same update_seconds: 0.04, 0.05, 0.06, ...
    base, _ = load_cost_file(REPO / "conf" / "advise" / "example.yaml")
    update = fit_runs([str(tmp_path / "drain"), str(tmp_path / "interrupt")], base).costs.update
    assert update.pause_s == pytest.approx(0.04)  # the least: the load without the drain
    assert update.interrupt_pause_s == pytest.approx(0.05)  # the median
    only = fit_runs([str(tmp_path / "interrupt")], base).costs.update
    assert only.pause_s == only.interrupt_pause_s == pytest.approx(0.05)


def test_the_longest_answer_of_each_step_gives_sigma_when_no_answer_is_truncated(tmp_path):
    write_run(tmp_path / "run")  # 4 prompts x 2 answers a step, max_new_tokens 100
    true = Lengths(100, mean=40.0, sigma=0.3)
    draw = true.sampler(random.Random(7))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    longest = [max(draw() for _ in range(8)) for _ in range(2000)]
    for i, row in enumerate(rows[1:]):
        row.update({"truncated_fraction": 0.0, "response_length": 40.0, "response_length_max": longest[i]})
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # The run's 12 steps say little; the mean longest over many steps pins sigma closely.
    base, _ = load_cost_file(REPO / "conf" / "advise" / "example.yaml")
    lengths = fit_runs([str(tmp_path / "run")], base).costs.lengths
    assert lengths.mean == 40.0 and 0.1 < lengths.sigma < 0.6
    fitted = lognormal_from_max(40.0, statistics.mean(longest), 8, 100)
    assert fitted.sigma == pytest.approx(0.3, rel=0.1)
    assert lognormal_from_max(40.0, 39.0, 8, 100) is None  # a longest answer below the mean says nothing


def test_recorded_groups_are_drawn_whole_and_a_filtered_one_from_the_filtered():
    lengths = Lengths(100, groups=((1, 2, 3, 4), (5, 6, 7, 8)), filtered_groups=((90, 95, 99, 150),))
    draw = lengths.group_sampler(random.Random(0), 4)
    kept = [tuple(draw(False)) for _ in range(50)]
    assert set(kept) == {(1, 2, 3, 4), (5, 6, 7, 8)}  # whole groups, never a mix
    assert {tuple(draw(True)) for _ in range(10)} == {(90, 95, 99, 100)}  # clipped at max_new_tokens
    # Another group size: each answer on its own from every recorded answer.
    draw_pair = lengths.group_sampler(random.Random(1), 2)
    pairs = [draw_pair(False) for _ in range(200)]
    assert all(len(p) == 2 for p in pairs)
    assert {n for p in pairs for n in p} == {1, 2, 3, 4, 5, 6, 7, 8, 90, 95, 99, 100}
    assert lengths.describe() == "recorded, 2 groups, mean 4; 1 filtered groups, mean 96; 8.3% at max 100"  # 1 of 12


def test_filtered_groups_are_drawn_from_their_own_lengths_and_a_step_trains_the_kept_ones():
    # Filtering drops half the groups. Recorded: the trained groups' answers are 20 tokens, the
    # filtered ones' 80 (on tiny_arith the all-wrong answers run long).
    work = Workload(batch_size=2, group_size=4, prompt_tokens=10, max_concurrent=4, filtered_fraction=0.5)
    costs = make(gen=GenCosts(0.01, 0.001, prefill_per_token_s=0.0), workload=work)
    cand = Candidate(1, 1, eta=2, interrupt=False)
    long_filtered = simulate(replace(costs, lengths=Lengths(100, groups=((20,) * 4,), filtered_groups=((80,) * 4,))),
                             cand, steps=200)
    short_filtered = simulate(replace(costs, lengths=Lengths(100, groups=((20,) * 4,), filtered_groups=((20,) * 4,))),
                              cand, steps=200)
    # A step trains the trained groups' answers: prompt + 20 tokens each.
    assert long_filtered.tokens_per_s / long_filtered.samples_per_s == pytest.approx(10 + 20)
    # Generation bound: per trained answer the server decodes 20 + 80 tokens instead of 20 + 20.
    assert long_filtered.samples_per_s < 0.75 * short_filtered.samples_per_s


def test_the_ledger_gives_every_generated_groups_answer_lengths(tmp_path):
    write_run(tmp_path / "run")
    times = {0: (1.0, 1.002, 1.9), 1: (1.1, 1.106, 2.4)}  # admitted, requested, generated
    events = [*({"event": "admit", "time": t[0], "group": g, "prompt_id": f"p{g}", "version": 0} for g, t in times.items()),
              {"event": "finish", "time": 2.0, "group": 0, "rank": 0, "lengths": [3, 4], "requested": 1.002,
               "generated": 1.9, "scored": 1.95},
              {"event": "filter", "time": 2.5, "group": 1, "reason": "success rate 0.00", "lengths": [9, 9],
               "requested": 1.106, "generated": 2.4, "scored": 2.45},
              {"event": "drop", "time": 2.6, "group": 2, "reason": "bad", "lengths": [1, 0]},
              {"event": "finish", "time": 3.0, "group": 3, "rank": 0, "lengths": [5, 6]}]  # an older run's: no times
    ledger = tmp_path / "run" / "ledger.jsonl"
    ledger.write_text("".join(json.dumps(e) + "\n" for e in events))
    base, _ = load_cost_file(REPO / "conf" / "advise" / "example.yaml")
    fitted = fit_runs([str(tmp_path / "run")], base)
    assert fitted.costs.lengths.groups == ((3, 4), (5, 6)) and fitted.costs.lengths.filtered_groups == ((9, 9),)
    assert any("2 groups finished for training and 1 filtered, from the runs' ledgers" in n for n in fitted.notes)
    # The control path's delays: the means over the groups timed.
    assert fitted.costs.latency.admit_s == pytest.approx((0.002 + 0.006) / 2)
    assert fitted.costs.latency.deliver_s == pytest.approx((0.1 + 0.1) / 2)
    (tmp_path / "run" / "ledger.jsonl").rename(tmp_path / "elsewhere.jsonl")
    assert fit_runs([str(tmp_path / "run")], base).costs.latency == base.latency  # no ledger: the cost file's
    (tmp_path / "elsewhere.jsonl").rename(ledger)
    ledger.write_text(ledger.read_text() + '{"event": "finish", "lengths": [3,\n')
    with pytest.raises(AdviseError, match=r"ledger.jsonl' has a line that is not JSON"):
        fit_runs([str(tmp_path / "run")], base)


def test_lognormal_from_truncation_recovers_mean_and_tail():
    lengths = lognormal_from_truncation(3000.0, 0.08, 8192)
    assert lengths is not None and lengths.sigma > 0
    assert "8.0% at max 8192" in lengths.describe() and "mean 3000" in lengths.describe()
    assert lognormal_from_truncation(3000.0, 0.0, 8192) is None


# ---- the CLI --------------------------------------------------------------------------------------

def test_the_cli_recommends_and_plots(tmp_path, capsys):
    png = tmp_path / "advise.png"
    code, out, _ = cli(["--preset", "example", "--splits", "1:1", "--devices", "4", "--etas", "0", "2",
                        "--colocated", "--steps", "3", "--plot", str(png)], capsys)
    assert code == 0 and png.stat().st_size > 0
    assert "2:2" in out and "colocated (4)" in out and "recommended:" in out


def test_every_preset_reads():
    assert {"example", "areal_1.5b", "areal_7b", "areal_small"} <= set(presets())
    for path in presets().values():
        costs, cands = load_cost_file(path)
        assert costs.workload.batch_size > 0 and cands.etas


@pytest.mark.parametrize("argv,names", [
    (["--preset", "example", "--splits", "3-1"], "--splits: '3-1'"),
    (["--preset", "example", "--splits", "0:1"], "--splits: '0:1'"),
    (["--preset", "example", "--devices", "10", "--splits", "3:1"], "--devices 10"),
    (["--costs", "does/not/exist.yaml"], "'does/not/exist.yaml' does not exist"),
    (["--preset", "example", "--lengths-file", "no_lengths.txt"], "--lengths-file: lengths file 'no_lengths.txt'"),
    (["--from-run", "no_run_dir"], "--from-run: 'no_run_dir' has no metrics.jsonl"),
    (["--preset", "nope"], "--preset: no preset 'nope'"),
    (["--preset", "example", "--etas", "-1"], "--etas"),
    (["--preset", "example", "--batch", "0"], "--batch"),
    (["--preset", "example", "--seeds", "0"], "--seeds"),
    (["--preset", "example", "--costs", "x.yaml"], "--costs"),
    ([], "--costs FILE, --preset NAME or --from-run RUN_DIR"),
])
def test_bad_flags_fail_with_status_2_naming_the_flag(argv, names, capsys):
    code, _, err = cli(argv, capsys)
    assert code == 2 and names in err


@pytest.mark.parametrize("section,key,value,names", [
    ("training", "per_token_s", -1e-5, "training.per_token_s: must be a cost ≥ 0, got -1e-05"),
    ("generation", "step_fixed_s", "fast", "generation.step_fixed_s: expected a number"),
    ("generation", "batch", 3, "generation: unknown key(s) 'batch'"),
    ("workload", "batch_size", 0, "workload.batch_size: must be positive"),
    ("workload", "lengths", {"lognormal": {"mean": 10}}, "workload.lengths"),
    ("workload", "filtered_fraction", 1.0, "workload.filtered_fraction=1 must be below 1"),
    ("latency", "admit_s", -0.01, "latency.admit_s: must be a cost ≥ 0, got -0.01"),
    ("latency", "deliver", 0.01, "latency: unknown key(s) 'deliver'"),
])
def test_a_bad_cost_file_fails_naming_the_key(tmp_path, capsys, section, key, value, names):
    path = tmp_path / "costs.yaml"
    path.write_text(yaml.safe_dump({section: {key: value}}))
    code, _, err = cli(["--costs", str(path)], capsys)
    assert code == 2 and names in err


def test_the_module_exits_2_on_bad_input():
    r = subprocess.run([sys.executable, "-m", "areal_flow.advise", "--preset", "example", "--splits", "three:one"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--splits" in r.stderr and "Traceback" not in r.stderr


def test_colocated_needs_interrupting_updates():
    with pytest.raises(AdviseError, match="colocated: .* rollout.interrupt must be true"):
        simulate(make(), Candidate(2, 2, eta=1, interrupt=False, colocated=True))


def test_a_run_with_a_judge_is_refused_by_name(tmp_path):
    from areal_flow.advise.runs import read_run

    write_run(tmp_path / "run")
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    config["graph"]["judge"] = {"type": "generate", "role": "judge", "mesh": "2"}
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(AdviseError, match="advise: node 'judge' is a judge, whose time the model does not have"):
        read_run(tmp_path / "run")
