"""A disk that fills during a write, said in one line with the path: safetensors, torch and json
each report it their own way (safetensors as a Rust IoError with no path), deep in a traceback.
And a file written whole (`write_atomic`): every file of a run that another process reads while it
may be rewritten (membership, scale hand-offs, processes.json), and the datasets made here."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

FULL = (errno.ENOSPC, errno.EDQUOT)
FULL_WORDS = ("No space left on device", "Disk quota exceeded", "StorageFull")
"""How a full disk reads in an error that carries no errno (safetensors' SafetensorError)."""
NEARLY_FULL = 1 << 20
"""Free bytes under which a failed write is put down to the disk: torch's writer (under
torch.distributed.checkpoint too) says only 'unexpected pos', and the partial file is still there."""


class DiskFull(RuntimeError):
    """A write ran out of space; the message names what was written and where."""


def is_disk_full(e: BaseException | None) -> bool:
    """Whether `e`, or an error it was raised from (torch wraps Python's OSError), says the disk is full."""
    while e is not None:
        if getattr(e, "errno", None) in FULL or any(word in str(e) for word in FULL_WORDS):
            return True
        e = e.__cause__ or e.__context__
    return False


def out_of_space(path: str) -> bool:
    """Whether the file system holding `path` (or its nearest existing parent) has next to no room left."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or ".")
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < NEARLY_FULL


def torch_save(obj, path: str) -> None:
    """torch.save through a Python file: a full disk then reaches the caller as OSError ENOSPC
    inside torch's error; written to a path, torch says only 'basic_ios::clear: iostream error'."""
    import torch

    with open(path, "wb") as f:
        torch.save(obj, f)


@contextmanager
def writing(what: str, path: str) -> Iterator[None]:
    """Raise DiskFull naming `what` and `path` when the writes inside run out of space; the callers'
    writes go to a temporary directory renamed only when complete, so the previous one stays valid."""
    try:
        yield
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is not an Exception
        if not isinstance(e, (KeyboardInterrupt, SystemExit)) and (is_disk_full(e) or out_of_space(path)):
            raise DiskFull(f"no space left on device writing {what} at {path}") from None
        raise


def write_atomic(path: str, data: bytes | str) -> None:
    """Write `data` (text as UTF-8) to `path` whole: a reader sees the old file or the new one, never
    a part, and after a crash the disk holds one of them whole.

    It goes to a temporary file in the same folder (a rename is atomic only within one file system;
    hidden and named *.tmp, so that a reader listing or globbing the folder passes it by), which is
    fsynced and renamed over `path`; it is removed when anything fails, an interrupt included. The
    file gets the mode `open` would give it (the umask's)."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
