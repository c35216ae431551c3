"""The bootstrap's cache without training anything: a directory is built once, under the lock,
and a failed build leaves nothing that a later call would reuse."""

import os

import pytest

from areal_flow.models.model_cache import REQUIRED_FILES, built_once


def writer(calls: list):
    def prepare():
        calls.append("prepare")
        return lambda out_dir: [open(os.path.join(out_dir, f), "w").close() for f in REQUIRED_FILES]

    return prepare


def test_a_directory_is_built_once_then_reused_without_preparing_again(tmp_path):
    final = str(tmp_path / "cache" / "model")
    calls: list = []
    assert built_once(final, writer(calls)) == final
    assert sorted(os.listdir(final)) == sorted(REQUIRED_FILES) and calls == ["prepare"]
    assert built_once(final, writer(calls)) == final and calls == ["prepare"]
    assert sorted(os.listdir(tmp_path / "cache")) == ["model", "model.lock"]  # no temporary directory left


def test_a_build_that_fails_leaves_no_directory_and_the_next_call_builds_it(tmp_path):
    final = str(tmp_path / "model")

    def fails(out_dir):
        open(os.path.join(out_dir, "config.json"), "w").close()
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        built_once(final, lambda: fails)
    assert os.listdir(tmp_path) == ["model.lock"]
    assert built_once(final, writer([])) == final


def test_a_directory_missing_a_file_is_reported_not_rebuilt(tmp_path):
    final = tmp_path / "model"
    final.mkdir()
    (final / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="incomplete .missing generation_config.json, model.safetensors"):
        built_once(str(final), writer([]))
