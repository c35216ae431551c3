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
import logging
import os
import random
import shutil
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from areal_flow.data.arith import (
    DATA_VERSION,
    arith_reward,
    completion_text,
    heldout_problems,
    prompt_text,
    sample_operands,
)
from areal_flow.models.tiny import build_tiny_qwen2, tiny_qwen2_config
from areal_flow.models.tokenizer import CHARS, build_char_tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

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
ADAM_BETAS = (0.9, 0.98)
CLIP_NORM = 1.0


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
) -> str:
    """Return a directory with the bootstrapped model and its tokenizer, training it if needed.

    `arch` overrides fields of the tiny Qwen2 shape (see `tiny_qwen2_config`). The schedule is
    AdamW (betas 0.9, 0.98), linear warm-up over `warmup_steps` then constant `lr`, gradient
    norm clipped to 1.0, `batch_size` fresh problems per step. `torch.set_num_threads` is left
    to the caller. The directory's `bootstrap.json` records the per-step losses.
    """
    if steps < 1 or batch_size < 1 or warmup_steps < 0 or lr <= 0:
        raise ValueError(
            "ensure_base_model: need steps >= 1, batch_size >= 1, warmup_steps >= 0, lr > 0; got "
            f"steps={steps}, batch_size={batch_size}, warmup_steps={warmup_steps}, lr={lr}"
        )
    settings = {
        "version": BOOTSTRAP_VERSION,
        "data_version": DATA_VERSION,
        "chars": CHARS,
        "heldout": list(heldout),  # (n_eval, seed) of the held-out set the bootstrap must not see
        "arch": dict(sorted((arch or {}).items())),
        "steps": steps,
        "lr": lr,
        "batch_size": batch_size,
        "warmup_steps": warmup_steps,
        "seed": seed,
    }
    final = os.path.join(cache_dir, settings_dir_name(settings))
    if os.path.isdir(final):  # fast path: no lock, no torch work
        return _checked(final)
    os.makedirs(cache_dir, exist_ok=True)
    with _exclusive(final + ".lock"):
        if os.path.isdir(final):  # another process finished it while we waited
            return _checked(final)
        tmp = tempfile.mkdtemp(dir=cache_dir, prefix=f".tmp-{os.path.basename(final)}-")
        try:
            _train_and_save(tmp, settings, progress)
            publish_dir(tmp, final)
        finally:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    return final


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


@contextmanager
def _hf_progress_bars(enabled: bool) -> Iterator[None]:
    was_enabled = hf_logging.is_progress_bar_enabled()
    if was_enabled and not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled and not enabled:
            hf_logging.enable_progress_bar()


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


def _train_and_save(out_dir: str, settings: dict[str, Any], progress: bool) -> None:
    tokenizer = build_char_tokenizer()
    # The initial weights are part of the cached settings; fork so the caller's RNG is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings["seed"])
        model = build_tiny_qwen2(tiny_qwen2_config(tokenizer, **settings["arch"]))
    start = time.perf_counter()
    losses = train_supervised(
        model,
        tokenizer,
        steps=settings["steps"],
        lr=settings["lr"],
        batch_size=settings["batch_size"],
        warmup_steps=settings["warmup_steps"],
        seed=settings["seed"],
        heldout=tuple(settings["heldout"]),
        progress=progress,
    )
    seconds = time.perf_counter() - start
    logger.info("bootstrap: %d steps in %.1f s, loss %.3f -> %.3f",
                len(losses), seconds, losses[0], losses[-1])
    with _hf_progress_bars(progress):  # HF's own "Writing model shards" bar follows `progress`
        model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    info = {
        "settings": settings,
        "losses": losses,
        "train_seconds": seconds,
        "torch_threads": torch.get_num_threads(),
    }
    with open(os.path.join(out_dir, INFO_FILE), "w") as f:
        json.dump(info, f, indent=1)


def supervised_batch(
    tokenizer: PreTrainedTokenizerFast, problems: list[tuple[int, int]]
) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask` and `labels` for prompt + completion + EOS.

    Labels are -100 on prompt and padding tokens, so the loss covers the completion and its EOS.
    """
    prompts = tokenizer([prompt_text(a, b) for a, b in problems], add_special_tokens=False)
    answers = tokenizer([completion_text(a, b) for a, b in problems], add_special_tokens=False)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    seqs = [(p, c + [eos]) for p, c in zip(prompts["input_ids"], answers["input_ids"])]
    width = max(len(p) + len(c) for p, c in seqs)
    input_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (p, c) in enumerate(seqs):
        n = len(p) + len(c)
        input_ids[i, :n] = torch.tensor(p + c)
        labels[i, len(p) : n] = torch.tensor(c)
        mask[i, :n] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def train_supervised(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    warmup_steps: int,
    seed: int,
    heldout: tuple[int, int] = (HELDOUT_N, HELDOUT_SEED),
    progress: bool = False,
) -> list[float]:
    """Train `model` in place on fresh problems (held-out prompts excluded); return step losses."""
    excluded = {prompt_text(a, b) for a, b in heldout_problems(*heldout)}
    rng = random.Random(f"bootstrap-{seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=ADAM_BETAS)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps else 1.0
    )
    model.train()
    losses: list[float] = []
    columns = (TextColumn("bootstrap"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn())
    with Progress(*columns, disable=not progress) as bar:
        task = bar.add_task("bootstrap", total=steps, loss="-")
        for _ in range(steps):
            problems: list[tuple[int, int]] = []
            while len(problems) < batch_size:
                a, b = sample_operands(rng)
                if prompt_text(a, b) not in excluded:
                    problems.append((a, b))
            loss = model(**supervised_batch(tokenizer, problems)).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
            opt.step()
            sched.step()
            losses.append(loss.item())
            bar.update(task, advance=1, loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


def greedy_completions(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    prompts: list[str],
    max_new_tokens: int = 96,
    batch_size: int = 100,
) -> list[str]:
    """Greedy completions of `prompts` (special tokens stripped) with `transformers` `generate`.

    Prompts are left-padded by hand, so each one ends where generation starts and the caller's
    tokenizer settings (`padding_side`) are left alone.
    """
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    texts: list[str] = []
    try:
        with torch.inference_mode():
            for start in range(0, len(prompts), batch_size):
                ids = tokenizer(prompts[start : start + batch_size],
                                add_special_tokens=False)["input_ids"]
                width = max(len(x) for x in ids)
                input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
                mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=eos,
                    pad_token_id=pad,
                )
                texts += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    finally:
        model.train(was_training)
    return texts


def greedy_accuracy(
    model_dir: str, rows: list[dict[str, str]], max_new_tokens: int = 96, batch_size: int = 100
) -> float:
    """Share of `rows` (with `prompt` and `answer`) that the model saved at `model_dir` answers
    right greedily, scored by `arith_reward`. Used to check checkpoints."""
    if not rows:
        raise ValueError("greedy_accuracy: no rows to evaluate")
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    texts = greedy_completions(
        model, tokenizer, [r["prompt"] for r in rows], max_new_tokens, batch_size
    )
    return sum(arith_reward(t, r["answer"]) for t, r in zip(texts, rows)) / len(rows)
