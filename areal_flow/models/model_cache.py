"""The bootstrap's cache on disk: a model directory built once, published whole, reused after.

Crash and race safety: a directory is built in a private temporary directory beside it and renamed
into place only when complete, so a crash never leaves a directory that would be reused. A lock
file makes a second process wait for the first instead of building the same directory twice; if
locks do not work (some network file systems), the loser of the rename discards its copy and uses
the winner's. What goes into a directory, and its name, are the caller's (models/bootstrap.py).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from typing import Iterator

INFO_FILE = "bootstrap.json"
"""Written last into the directory: settings, per-step losses and timing of the run."""
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    INFO_FILE,
)


def built_once(final: str, prepare: Callable[[], Callable[[str], None]]) -> str:
    """`final`, complete: the directory already there, or one built now.

    Only when it must be built, and under the lock, `prepare()` runs and returns the function that
    writes the directory's files into the temporary directory it is given; `prepare` runs before
    that directory exists, so slow imports in it leave nothing behind when interrupted (a Ctrl-C
    inside an import can be swallowed by a library's bare `except:` around an optional import)."""
    if os.path.isdir(final):  # fast path: no lock, nothing imported
        return checked(final)
    cache_dir = os.path.dirname(final)
    os.makedirs(cache_dir, exist_ok=True)
    with exclusive(final + ".lock"):
        if os.path.isdir(final):  # another process finished it while we waited
            return checked(final)
        build = prepare()
        tmp = tempfile.mkdtemp(dir=cache_dir, prefix=f".tmp-{os.path.basename(final)}-")
        try:
            build(tmp)
            publish_dir(tmp, final)
        finally:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def missing_files(model_dir: str) -> list[str]:
    """The files of a complete bootstrap directory that `model_dir` lacks."""
    return [f for f in REQUIRED_FILES if not os.path.isfile(os.path.join(model_dir, f))]


def checked(model_dir: str) -> str:
    # Directories appear only by an atomic rename of a complete one, so a gap means someone
    # deleted files by hand; retraining over it silently could hide that, so say so instead.
    missing = missing_files(model_dir)
    if missing:
        raise RuntimeError(
            f"{model_dir}: bootstrap directory is incomplete (missing {', '.join(missing)}); "
            "delete it to retrain"
        )
    return model_dir


@contextmanager
def exclusive(lock_path: str) -> Iterator[None]:
    """Hold an exclusive flock on `lock_path`; the kernel releases it if the process dies."""
    with open(lock_path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def publish_dir(tmp: str, final: str) -> None:
    """Rename the complete directory `tmp` to `final`, atomically.

    If `final` already exists and is complete (another process won a race the lock did not
    prevent), `tmp` is discarded and the existing directory stands.
    """
    for name in os.listdir(tmp):  # make the contents durable before they become visible
        path = os.path.join(tmp, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    try:
        os.rename(tmp, final)
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or missing_files(final):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
