"""The flight record (training/flight.py): a step's samples as they were when it started, its
generators' states, the digest of the weights it ended with, written whole and read back exactly;
a resume's rewind moves the records of the steps it redoes aside (checkpoint/store.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from areal_flow.checkpoint import store
from areal_flow.runtime import run_dir as rd
from areal_flow.training import flight
from areal_flow.transport.messages import Array, Sample
from areal_flow.weights.digest import weights_digest


def samples() -> list[Sample]:
    return [Sample(uid=f"g{g}-{i}", prompt_id=f"p{g}", group_id=g, index=i, birth_time=0.0,
                   arrays={"output_ids": Array.of(np.arange(5) + i), "behav_logprobs": Array.of(np.full(5, -0.5 * i, np.float32)),
                           "versions": Array.of(np.array([3, 3, 4, 4, 4]))}, scalars={"rewards": float(i)})
            for g in (0, 1) for i in range(2)]


def test_a_step_is_read_back_as_it_started_whatever_the_step_wrote_into_its_samples(tmp_path):
    batch = samples()
    record = flight.begin(6, 0, batch, "data", 6, 0.05)
    drawn = torch.rand(3)
    batch[0].arrays["prox_logprobs"] = Array.of(np.zeros(5, np.float32))  # what the step's nodes write
    batch[1].arrays["behav_logprobs"] = Array.of(np.zeros(5, np.float32))
    written = flight.end(str(tmp_path), record, "abc123", {"loss": 0.25, "grad_norm": 1.5, "note": "text"})
    path = tmp_path / "flight" / "step-00000007-rank0.msgpack"
    assert path.stat().st_size == written
    assert flight.recorded_steps(str(tmp_path)) == [6] and flight.recorded_steps(str(tmp_path), rank=1) == []
    back = flight.read(str(tmp_path), 6)
    assert (back.step, back.rank, back.prox_source, back.prox_version, back.kl_coef) == (6, 0, "data", 6, 0.05)
    assert back.digest == "abc123" and back.stats == {"loss": 0.25, "grad_norm": 1.5}
    original = samples()
    assert [s.uid for s in back.samples] == [s.uid for s in original]
    for got, want in zip(back.samples, original):
        assert got.arrays.keys() == want.arrays.keys()  # no prox_logprobs: it was written after the start
        for key in want.arrays:
            assert got.arrays[key].data == want.arrays[key].data
    flight.restore_rng(back)  # the generator as the step started: the same draws again
    assert torch.equal(torch.rand(3), drawn)
    assert back.threads == torch.get_num_threads()


def test_a_missing_or_broken_record_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"step-00000003-rank0.msgpack.*flight.record=true"):
        flight.read(str(tmp_path), 2)
    (tmp_path / "flight").mkdir()
    (tmp_path / "flight" / "step-00000003-rank0.msgpack").write_bytes(b"\x93not a record")
    with pytest.raises(ValueError, match=r"step-00000003-rank0.msgpack: not a flight record"):
        flight.read(str(tmp_path), 2)


def test_the_weights_digest_changes_with_any_bit_and_only_then():
    a = {"w": torch.randn(4, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}
    digest = weights_digest(list(a.items()))
    assert weights_digest([(k, v.clone()) for k, v in a.items()]) == digest
    nudged = a["w"].clone()
    nudged[2, 1] = torch.nextafter(nudged[2, 1], torch.tensor(float("inf")))  # one ulp
    assert weights_digest([("w", nudged), ("b", a["b"])]) != digest
    assert weights_digest([("w", a["w"].T.contiguous().T), ("b", a["b"])]) == digest  # layout is not content
    assert weights_digest([("w2", a["w"]), ("b", a["b"])]) != digest  # nor the names
    assert weights_digest([("w", a["w"].view(3, 4)), ("b", a["b"])]) != digest  # the shapes count


def test_a_resume_moves_the_records_of_the_steps_it_redoes_aside(tmp_path):
    for step in range(5):
        for rank in (0, 1):
            flight.end(str(tmp_path), flight.begin(step, rank, samples(), None, step, 0.0), f"d{step}", {})
    moved = store.discard_flight(str(tmp_path), 3)  # a checkpoint after 3 steps: steps 4 and 5 are redone
    assert moved == ["step-00000004-rank0.msgpack", "step-00000004-rank1.msgpack",
                     "step-00000005-rank0.msgpack", "step-00000005-rank1.msgpack"]
    assert flight.recorded_steps(str(tmp_path)) == [0, 1, 2]
    assert sorted(os.listdir(tmp_path / rd.FLIGHT_DISCARDED)) == moved
    assert store.discard_flight(str(tmp_path), 0) and flight.recorded_steps(str(tmp_path), rank=1) == []


def test_an_answers_versions_split_into_the_spans_each_version_made():
    from areal_flow.generation.engine.scoring import spans_of

    assert spans_of(np.array([3, 3, 4, 4, 4, 5])) == [(3, 2), (4, 3), (5, 1)]
    assert spans_of(np.array([7])) == [(7, 1)] and spans_of(np.array([], dtype=np.int64)) == []


def test_a_record_that_cannot_be_written_is_logged_and_the_step_goes_on(tmp_path, caplog):
    from types import SimpleNamespace

    from areal_flow.training.worker import ModelWorker

    blocked = tmp_path / "run"
    blocked.mkdir()
    (blocked / "flight").write_text("a file where the folder should be")  # the write fails (OSError)
    worker = object.__new__(ModelWorker)
    worker.__dict__.update(name="trainer0", spec=SimpleNamespace(run_dir=str(blocked)))
    stats = {"loss": 0.5}
    trained = SimpleNamespace(weights_digest=lambda: "d")
    with caplog.at_level("ERROR"):
        worker.record_flight(flight.begin(4, 0, samples(), None, 4, 0.0), trained, stats)
    assert "flight record of step 5 was not written" in caplog.text and "flight_bytes" not in stats


def test_a_replay_of_several_ranks_refuses_steps_not_recorded_by_exactly_the_runs_ranks(tmp_path):
    from areal_flow.training.replay_ranks import RanksError, check_ranks

    for step, rank in [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (3, 0), (3, 1), (3, 2)]:
        record = flight.begin(step, rank, samples(), "data", step, 0.0)
        flight.end(str(tmp_path), record, "d", {})
    assert flight.recorded_ranks(str(tmp_path)) == {0: {0, 1}, 1: {0, 1}, 2: {0}, 3: {0, 1, 2}}
    check_ranks(str(tmp_path), range(2), 2)
    with pytest.raises(RanksError, match=r"step 3 was recorded by rank\(s\) 0, but the run has 2 trainer rank"):
        check_ranks(str(tmp_path), range(3), 2)
    with pytest.raises(RanksError, match=r"step 4 was recorded by rank\(s\) 0, 1, 2, but the run has 2"):
        check_ranks(str(tmp_path), [3], 2)  # trained before the run's trainers were resized to 2
    with pytest.raises(RanksError, match=r"step 9 was recorded by rank\(s\) none"):
        check_ranks(str(tmp_path), [8], 2)
