"""`write_atomic`, the one way a file another process may read is rewritten: whole or not at all."""

import os

import pytest

from areal_flow.runtime import disk
from areal_flow.runtime.disk import write_atomic


def test_text_and_bytes_replace_the_file_whole_and_leave_nothing_beside_it(tmp_path):
    path = tmp_path / "processes.json"
    write_atomic(str(path), "é\n")
    assert path.read_bytes() == "é\n".encode()
    write_atomic(str(path), b"{}")
    assert path.read_bytes() == b"{}" and os.listdir(tmp_path) == ["processes.json"]
    # The mode `open` gives a new file (the umask's), not a private temporary file's 0600.
    with open(tmp_path / "plain", "w"):
        pass
    assert path.stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_a_write_that_fails_keeps_the_old_file_and_removes_its_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "weights_loaded.json"
    path.write_text("old")

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(disk.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(str(path), "new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["weights_loaded.json"]


def test_the_data_is_on_disk_before_the_rename(tmp_path, monkeypatch):
    order = []
    monkeypatch.setattr(disk.os, "fsync", lambda fd: order.append("fsync"))
    real = os.replace
    monkeypatch.setattr(disk.os, "replace", lambda a, b: (order.append("rename"), real(a, b)))
    write_atomic(str(tmp_path / "ack"), b"3")
    assert order == ["fsync", "rename"]
