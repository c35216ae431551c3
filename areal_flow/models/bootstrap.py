"""Supervised bootstrap of the tiny base model, cached on disk by its settings.

RL needs a policy that already gets some answers right. `ensure_base_model` trains the tiny Qwen2
on fresh problems of its task (loss on completion + EOS only; models/supervised.py) and saves a
Hugging Face directory (model + tokenizer) named by a hash of every setting that changes the
weights. A later call with the same settings returns that directory at once. The directory is
built once and published whole, whatever crashes or races (models/model_cache.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable

from areal_flow.models.model_cache import built_once
from areal_flow.models.tasks import HELDOUT_N, HELDOUT_SEED, BootstrapTask, bootstrap_task

# Bump when the training procedure changes, so directories trained the old way are not reused.
BOOTSTRAP_VERSION = 1


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
    settings = bootstrap_settings(bootstrap_task(task), heldout=heldout, arch=arch or {}, steps=steps, lr=lr,
                                  batch_size=batch_size, warmup_steps=warmup_steps, seed=seed)
    final = os.path.join(cache_dir, settings_dir_name(settings))
    return built_once(final, lambda: _trainer(settings, progress, device))


def bootstrap_settings(spec: BootstrapTask, *, heldout: tuple[int, int], arch: dict[str, Any], steps: int,
                       lr: float, batch_size: int, warmup_steps: int, seed: int) -> dict[str, Any]:
    """Every setting that changes the weights, as JSON values: what names the cache directory and
    what `train_and_save` trains by."""
    settings = {
        "version": BOOTSTRAP_VERSION,
        "data_version": spec.data_version,
        "chars": spec.chars,
        "heldout": list(heldout),  # (n_eval, seed) of the held-out set the bootstrap must not see
        "arch": dict(sorted(arch.items())),
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
    return settings


def _trainer(settings: dict[str, Any], progress: bool, device: str) -> Callable[[str], None]:
    """The function that trains the model into a directory, once torch and transformers are imported.

    Imported here: they take seconds to import, and the launcher calls `ensure_base_model` on every
    run, where the model is almost always cached already. The model's module too, which
    transformers would import on first use: every import ends before the temporary directory
    appears (`built_once`)."""
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401  (transformers imports it lazily)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the bootstrap has a progress bar of its own

    from areal_flow.models.supervised import train_and_save

    if device == "cpu":
        return lambda out_dir: train_and_save(out_dir, settings, progress)
    return lambda out_dir: _in_child(train_and_save, out_dir, settings, progress, device)


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
