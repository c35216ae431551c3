"""The checkpoint directory: complete or absent, the newest complete one found, old ones pruned."""

import json
import logging
import os

import pytest

from areal_flow.checkpoint import store


def write(run_dir, step, files=None):
    tmp = store.begin(str(run_dir), step)
    for name, data in (files or {"actor/model.safetensors": b"x" * 100, "run_state.json": b"{}"}).items():
        os.makedirs(os.path.dirname(os.path.join(tmp, name)), exist_ok=True)
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(data)
    return store.commit(tmp, step, version=step, n_trainers=1)


def test_commit_names_the_checkpoint_and_lists_its_files(tmp_path):
    path = write(tmp_path, 3)
    assert os.path.basename(path) == "step-00000003"
    manifest = store.read_manifest(path)
    assert manifest["step"] == 3 and manifest["version"] == 3
    assert manifest["files"] == {"actor/model.safetensors": 100, "run_state.json": 2}
    assert store.problem(path) is None and store.latest(str(tmp_path)) == path


def test_a_write_that_never_completed_is_not_a_checkpoint(tmp_path):
    done = write(tmp_path, 2)
    tmp = store.begin(str(tmp_path), 4)  # a crash mid-write: no commit
    with open(os.path.join(tmp, "run_state.json"), "w") as f:
        f.write("{")
    assert store.latest(str(tmp_path)) == done
    store.begin(str(tmp_path), 6)  # the next write removes the leftover
    assert not os.path.exists(tmp)


def test_a_truncated_checkpoint_falls_back_to_the_previous_with_a_warning(tmp_path, caplog):
    older = write(tmp_path, 2)
    newer = write(tmp_path, 4)
    with open(os.path.join(newer, "actor/model.safetensors"), "r+b") as f:
        f.truncate(10)
    with caplog.at_level(logging.WARNING, "areal_flow.checkpoint"):
        assert store.latest(str(tmp_path)) == older
    assert "has 10 bytes, the manifest says 100" in caplog.text
    os.remove(os.path.join(older, store.MANIFEST))
    assert store.latest(str(tmp_path)) is None
    assert "no manifest.json" in caplog.text


def test_an_unreadable_or_foreign_manifest_is_refused(tmp_path):
    path = write(tmp_path, 1)
    with open(os.path.join(path, store.MANIFEST), "w") as f:
        f.write("{not json")
    assert "unreadable" in store.problem(path)
    with open(os.path.join(path, store.MANIFEST), "w") as f:
        json.dump({"format": 99, "files": {}}, f)
    assert "format 99" in store.problem(path)


def test_prune_keeps_the_newest_complete_ones(tmp_path):
    paths = [write(tmp_path, s) for s in (1, 2, 3, 4)]
    os.remove(os.path.join(paths[3], store.MANIFEST))  # the newest is incomplete: it counts for nothing
    removed = store.prune(str(tmp_path), keep_last=2)
    assert removed == paths[:1]
    assert store.listed(str(tmp_path)) == paths[1:]


def test_a_checkpoint_of_the_same_step_is_replaced(tmp_path):
    write(tmp_path, 5, {"a": b"1"})
    path = write(tmp_path, 5, {"b": b"22"})
    assert store.read_manifest(path)["files"] == {"b": 2}
    assert sorted(os.listdir(store.folder(str(tmp_path)))) == ["step-00000005"]


def test_rewind_cuts_the_logs_back_and_keeps_the_cut_lines(tmp_path):
    (tmp_path / "ledger.jsonl").write_text('{"a": 1}\n{"b": 2}\n')
    (tmp_path / "metrics.jsonl").write_text('{"m": 1}\n')
    (tmp_path / "trained-rank0.jsonl").write_text('{"u": 1}\n{"u": 2}\n')
    path = write(tmp_path, 1, {"run_state.json": json.dumps({"ledger_bytes": 9, "metrics_bytes": 9}).encode(),
                               "trainer-rank0.json": json.dumps({"trained_log_bytes": 0}).encode()})
    store.rewind(str(tmp_path), path)
    assert (tmp_path / "ledger.jsonl").read_text() == '{"a": 1}\n'
    assert (tmp_path / "ledger.discarded.jsonl").read_text() == '{"b": 2}\n'
    assert (tmp_path / "metrics.jsonl").read_text() == '{"m": 1}\n'
    assert not (tmp_path / "metrics.discarded.jsonl").exists()
    assert (tmp_path / "trained-rank0.jsonl").read_text() == ""
    assert (tmp_path / "trained-rank0.discarded.jsonl").read_text().count("\n") == 2


@pytest.mark.parametrize("resume", ["auto"])
def test_auto_without_a_checkpoint_starts_the_run(tmp_path, resume):
    from areal_flow.checkpoint.compat import find

    assert find(resume, str(tmp_path)) == (None, str(tmp_path))


def test_rewind_to_the_start_empties_every_log(tmp_path):
    for name in ("ledger.jsonl", "metrics.jsonl", "trained-rank1.jsonl"):
        (tmp_path / name).write_text('{"x": 1}\n')
    store.rewind(str(tmp_path), None)
    assert (tmp_path / "ledger.jsonl").read_text() == "" and (tmp_path / "trained-rank1.jsonl").read_text() == ""
    assert (tmp_path / "trained-rank1.discarded.jsonl").read_text() == '{"x": 1}\n'
