"""What both engines share of a train step: the sequences it runs and its global counts
(`step_batch`), one copy of the outputs to the host (`by_sequence_on_host`), and the engine's keys
of its statistics (`step_report`)."""

import time

import numpy as np
import pytest
import torch

from areal_flow.metrics.profile import Phases
from areal_flow.training.engine import LOSS_MASK_KEY, LOSS_SHARE_KEY
from areal_flow.training.micro_batches import by_sequence_on_host, step_batch
from areal_flow.training.step_stats import step_report


def _seqs(*outputs: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.array([1, 2]), np.arange(n)) for n in outputs]


def test_a_skipped_sequence_counts_in_the_denominator_but_is_not_run():
    seqs = _seqs(3, 2, 4)
    data = {"advantages": [np.full(n, i, np.float32) for i, n in enumerate((3, 2, 4))],
            LOSS_MASK_KEY: [np.array([1, 1, 0], bool), np.ones(2, bool), np.ones(4, bool)]}
    batch = step_batch(seqs, data, [False, True, False], group=None)
    assert [len(out) for _, out in batch.seqs] == [3, 4]
    assert [a[0] for a in batch.token_data["advantages"]] == [0.0, 2.0]
    assert batch.skipped_tokens == 2  # the skipped sequence's valid tokens
    assert (batch.n_valid, batch.n_tokens, batch.denominator) == (8.0, 15, 8.0)  # all three sequences
    assert batch.loss_denominator == 8.0


def test_loss_shares_make_the_denominator_and_a_step_without_valid_tokens_divides_by_one():
    seqs = _seqs(2, 4)
    shares = {LOSS_SHARE_KEY: [np.full(2, 0.5), np.full(4, 0.25)]}
    assert step_batch(seqs, shares, None, group=None).denominator == pytest.approx(2.0)  # two sequences
    none_valid = {LOSS_MASK_KEY: [np.zeros(2, bool), np.zeros(4, bool)]}
    batch = step_batch(seqs, none_valid, None, group=None)
    assert (batch.denominator, batch.loss_denominator) == (0.0, 1.0)


def test_token_data_of_the_wrong_length_is_refused_naming_the_key_and_sequence():
    with pytest.raises(ValueError, match=r"token_data\['advantages'\]\[1\] has 3 values for 2 output tokens"):
        step_batch(_seqs(1, 2), {"advantages": [np.zeros(1), np.zeros(3)]}, None, group=None)


def test_outputs_come_back_per_sequence_in_the_callers_order_and_a_sequence_not_run_gets_none():
    # Two micro-batches: sequences 2 and 0 (2 and 1 values), then sequence 3 (3 values); 1 not run.
    tensors = [torch.tensor([20.0, 21.0, 0.0]), torch.tensor([30.0, 31.0, 32.0], dtype=torch.float64)]
    out = by_sequence_on_host(4, [2, 0, 3], tensors, [2, 1, 3])
    assert [o.tolist() for o in out] == [[0.0], [], [20.0, 21.0], [30.0, 31.0, 32.0]]
    assert all(o.dtype == np.float32 for o in out)
    assert [len(o) for o in by_sequence_on_host(2, [], [], [])] == [0, 0]


def test_the_engine_keys_of_a_step_report_take_precedence_over_the_loss_statistics():
    batch = step_batch(_seqs(2, 1), {}, None, group=None)
    phases = Phases()
    with phases("forward"):
        pass
    report = step_report({"loss": 1.5, "lr": -1.0}, batch, grad_norm=0.25, lr=1e-3, skipped=True,
                         n_micro_batches=2, start=time.perf_counter() - 1.0, phases=phases)
    assert report["loss"] == 1.5 and report["lr"] == 1e-3
    assert (report["grad_norm"], report["skipped_steps"], report["n_micro_batches"]) == (0.25, 1.0, 2.0)
    assert (report["n_tokens"], report["n_valid_tokens"]) == (7.0, 3.0)
    assert report["step_seconds"] >= 1.0 and "forward_seconds" in report
    assert phases.reset() == {}  # the phases were read and reset
