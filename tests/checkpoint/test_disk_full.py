"""A disk that fills during a checkpoint or weight write: one line naming what and where, and the
previous checkpoint stays valid. On a real small tmpfs (skipped where mounting is not permitted)."""

import os
import subprocess
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from areal_flow.checkpoint import store
from areal_flow.launchers.local import ChildFailed, last_traceback
from areal_flow.runtime.disk import DiskFull, torch_save, writing


@contextmanager
def small_disk(mount: Path, size: str):
    """A tmpfs of `size` at `mount`, unmounted after; the test is skipped where mounting is not permitted."""
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", f"areal-test-{uuid.uuid4().hex[:6]}", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)  # lazy: a dead writer's open file does not block it


def test_a_full_disk_mid_checkpoint_is_one_line_with_the_path_and_the_previous_checkpoint_stays(tmp_path):
    with small_disk(tmp_path / "disk", "1m") as disk:
        check_full_checkpoint(str(disk))


def check_full_checkpoint(run_dir: str) -> None:
    first = store.begin(run_dir, 1)
    save_file({"w": torch.zeros(1000)}, os.path.join(first, "model.safetensors"))
    saved = store.commit(first, 1)
    tmp = store.begin(run_dir, 2)
    for write in (lambda: save_file({"w": torch.zeros(1 << 19)}, os.path.join(tmp, "model.safetensors")),
                  lambda: torch_save(torch.zeros(1 << 19), os.path.join(tmp, "state.pt"))):
        with pytest.raises(DiskFull) as e, writing("the checkpoint", tmp):
            write()
        assert str(e.value) == f"no space left on device writing the checkpoint at {tmp}"
    assert store.latest(run_dir) == saved and store.problem(saved) is None


def test_a_process_stopped_by_a_full_disk_is_reported_in_one_line(tmp_path):
    log = tmp_path / "trainer0.log"
    log.write_text("Traceback (most recent call last):\n  an earlier, handled one\nValueError: x\n"
                   "error: no space left on device writing the weights at /run/weights/v3\n")
    failed = ChildFailed("trainer0", 1, last_traceback(str(log)), str(log))
    assert str(failed) == "process 'trainer0' exited with code 1: no space left on device writing the weights at " \
                          f"/run/weights/v3; its log is {log}"
    log.write_text("Traceback (most recent call last):\nValueError: x\n")
    assert str(ChildFailed("trainer0", 1, last_traceback(str(log)), str(log))).count("\n") == 2  # as before


@pytest.mark.slow  # a real run
def test_a_run_whose_disk_fills_at_its_second_checkpoint_stops_in_one_line_keeping_the_first(tmp_path, run_cache):
    """20 MiB hold the tiny model's first checkpoint (~9 MB) beside its weight versions (~2.3 MB
    each), not the second."""
    from run_helpers import launch

    with small_disk(tmp_path / "disk", "20m") as disk:
        run_dir = disk / "run"
        r = launch(run_dir, run_cache, "checkpoint.every_steps=1", "total_steps=4")
        assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
        failed = [line for line in r.stdout.splitlines() if line.startswith("run failed:")]
        assert len(failed) == 1 and \
            f": no space left on device writing the checkpoint at {run_dir}/checkpoints/.tmp-step-00000002; its log " \
            "is" in failed[0], r.stdout
        assert "Traceback" not in r.stdout + r.stderr
        first = store.latest(str(run_dir))
        assert first == str(run_dir / "checkpoints" / "step-00000001") and store.problem(first) is None
