"""Supervised bootstrap of the tiny base model, cached on disk by its settings.

RL needs a policy that already gets some answers right. `ensure_base_model` trains the tiny Qwen2
on fresh arithmetic problems (loss on completion + EOS only) and saves a Hugging Face directory
(model + tokenizer) named by a hash of every setting that changes the weights. A later call with
the same settings returns that directory at once.

Crash and race safety: training writes into a private temp directory that is renamed into place
only when complete, so a crash never leaves a directory that would be reused. A lock file makes a
second process wait for the first instead of training the same model twice; if locks do not work
(some network file systems), the loser of the rename discards its copy and uses the winner's.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator

from areal_flow.models.tasks import bootstrap_task

# Bump when the training procedure changes, so directories trained the old way are not reused.
BOOTSTRAP_VERSION = 1
# Written last into the directory: settings, per-step losses and timing of the run.
INFO_FILE = "bootstrap.json"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    INFO_FILE,
)
# The held-out set the bootstrap must never train on: the default one of `ensure_arith_data`.
HELDOUT_N, HELDOUT_SEED = 200, 0


def ensure_base_model(
    cache_dir: str,
    *,
    arch: dict[str, Any] | None = None,
    steps: int = 250,
    lr: float = 3e-3,
    batch_size: int = 64,
    warmup_steps: int = 100,
    seed: int = 0,
    heldout: tuple[int, int] = (HELDOUT_N, HELDOUT_SEED),
    progress: bool = True,
    device: str = "cpu",
    task: str = "tiny_arith",
) -> str:
    """Return a directory with the bootstrapped model and its tokenizer, training it if needed.

    `arch` overrides fields of the tiny Qwen2 shape (see `tiny_qwen2_config`). The schedule is
    AdamW (betas 0.9, 0.98), linear warm-up over `warmup_steps` then constant `lr`, gradient
    norm clipped to 1.0, `batch_size` fresh problems per step. `torch.set_num_threads` is left
    to the caller. The directory's `bootstrap.json` records the per-step losses. `device` "cuda"
    trains on the first GPU this process sees (bf16 autocast, fp32 weights), in a child process
    of its own, so that the caller (the launcher, which lives as long as the run) holds no GPU
    memory; the device is not one of the settings (a model trained on either is reused on both).
    `task` (models/tasks.py) says what it learns: its characters, data and chat template.
    """
    if steps < 1 or batch_size < 1 or warmup_steps < 0 or lr <= 0:
        raise ValueError(
            "ensure_base_model: need steps >= 1, batch_size >= 1, warmup_steps >= 0, lr > 0; got "
            f"steps={steps}, batch_size={batch_size}, warmup_steps={warmup_steps}, lr={lr}"
        )
    spec = bootstrap_task(task)
    settings = {
        "version": BOOTSTRAP_VERSION,
        "data_version": spec.data_version,
        "chars": spec.chars,
        "heldout": list(heldout),  # (n_eval, seed) of the held-out set the bootstrap must not see
        "arch": dict(sorted((arch or {}).items())),
        "steps": steps,
        "lr": lr,
        "batch_size": batch_size,
        "warmup_steps": warmup_steps,
        "seed": seed,
    }
    if spec.name != "tiny_arith":  # the arithmetic model's directory keeps the name it always had
        settings["task"] = spec.name
    if spec.words:
        settings["words"] = list(spec.words)
    final = os.path.join(cache_dir, settings_dir_name(settings))
    if os.path.isdir(final):  # fast path: no lock, no torch work
        return _checked(final)
    os.makedirs(cache_dir, exist_ok=True)
    with _exclusive(final + ".lock"):
        if os.path.isdir(final):  # another process finished it while we waited
            return _checked(final)
        # Imported here: torch and transformers take seconds to import, and the launcher calls this
        # on every run, where the model is almost always cached already. Before the temporary
        # directory (the model's module too, which transformers would import on first use), so that
        # it appears once training is about to start: a Ctrl-C inside these imports can be swallowed
        # by a library's bare `except:` around an optional import.
        import transformers.models.qwen2.modeling_qwen2  # noqa: F401  (transformers imports it lazily)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the bootstrap has a progress bar of its own

        from areal_flow.models.supervised import train_and_save

        tmp = tempfile.mkdtemp(dir=cache_dir, prefix=f".tmp-{os.path.basename(final)}-")
        try:
            if device == "cpu":
                train_and_save(tmp, settings, progress)
            else:
                _in_child(train_and_save, tmp, settings, progress, device)
            publish_dir(tmp, final)
        finally:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _in_child(fn: Any, *args: Any) -> None:
    """Run fn(*args) in a fresh process (spawned: CUDA cannot be used after fork) and wait for it."""
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(target=fn, args=args, name="bootstrap")
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"the bootstrap's training process exited with code {child.exitcode} (its traceback is "
                           "printed above)")


def settings_dir_name(settings: dict[str, Any]) -> str:
    """`tiny-qwen2-<12 hex>`: a hash of the settings, so different settings never share a dir."""
    try:
        blob = json.dumps(settings, sort_keys=True)
    except TypeError as e:
        raise ValueError(f"bootstrap settings must be JSON values: {e}") from None
    return "tiny-qwen2-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


def missing_files(model_dir: str) -> list[str]:
    """The files of a complete bootstrap directory that `model_dir` lacks."""
    return [f for f in REQUIRED_FILES if not os.path.isfile(os.path.join(model_dir, f))]


def _checked(model_dir: str) -> str:
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
def _exclusive(lock_path: str) -> Iterator[None]:
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
