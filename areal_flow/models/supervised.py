"""Supervised training of a tiny model on its task (models/tasks.py), and greedy scoring of a
saved arithmetic model.

The bootstrap (`areal_flow.models.bootstrap`) calls `train_and_save` when its cache has no
directory for the settings; the tests and tools score checkpoints with `greedy_accuracy`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from areal_flow.data.arith import arith_reward
from areal_flow.models.model_cache import INFO_FILE
from areal_flow.models.tasks import HELDOUT_N, HELDOUT_SEED, BootstrapTask, Completion, bootstrap_task
from areal_flow.models.tiny import build_tiny_qwen2, tiny_qwen2_config
from areal_flow.models.tokenizer import build_char_tokenizer, load_tokenizer
from areal_flow.runtime.devices import local_device

logger = logging.getLogger("areal_flow.models.bootstrap")  # its lines are the bootstrap's

ADAM_BETAS = (0.9, 0.98)
CLIP_NORM = 1.0


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


def train_and_save(out_dir: str, settings: dict[str, Any], progress: bool, device: str = "cpu") -> None:
    """Train the tiny model `settings` describe (see `ensure_base_model`) on `device` and save it,
    its tokenizer and `bootstrap.json` into `out_dir`."""
    task = bootstrap_task(settings.get("task", "tiny_arith"))
    tokenizer = build_char_tokenizer(task.chars, chat=task.chat, words=task.words, eos=task.eos)
    # The initial weights are part of the cached settings; fork so the caller's RNG is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings["seed"])
        model = build_tiny_qwen2(tiny_qwen2_config(tokenizer, **settings["arch"]))
    start = time.perf_counter()
    losses = train_supervised(
        model,
        tokenizer,
        task=task,
        steps=settings["steps"],
        lr=settings["lr"],
        batch_size=settings["batch_size"],
        warmup_steps=settings["warmup_steps"],
        seed=settings["seed"],
        heldout=tuple(settings["heldout"]),
        progress=progress,
        device=device,
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
    tokenizer: PreTrainedTokenizerFast, pairs: list[tuple[str, Completion]]
) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask` and `labels` for prompt + completion + EOS, from
    (prompt, completion) texts. A completion is a text, or its parts as (text, trained) pairs, each
    tokenized alone as a multi-turn rollout does (a tool's answer: trained False).

    Labels are -100 on prompt and padding tokens and on untrained parts, so the loss covers the
    completion's trained parts and its EOS.
    """
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    seqs = []
    for p, completion in zip(prompts, (c for _, c in pairs)):
        parts = [(completion, True)] if isinstance(completion, str) else completion
        ids, labels = list(p), [-100] * len(p)
        for text, trained in parts:
            part = tokenizer.encode(text, add_special_tokens=False)
            ids += part
            labels += part if trained else [-100] * len(part)
        seqs.append((ids + [eos], labels + [eos]))
    width = max(len(ids) for ids, _ in seqs)
    input_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (ids, labs) in enumerate(seqs):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.tensor(labs)
        mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def train_supervised(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    *,
    task: BootstrapTask | None = None,
    steps: int,
    lr: float,
    batch_size: int,
    warmup_steps: int,
    seed: int,
    heldout: tuple[int, int] = (HELDOUT_N, HELDOUT_SEED),
    progress: bool = False,
    device: str = "cpu",
) -> list[float]:
    """Train `model` in place on fresh problems of `task` (default arithmetic; held-out prompts
    excluded); return step losses. On "cuda" it trains on the first visible GPU with bf16 autocast
    over fp32 weights, and leaves the model on the CPU."""
    on = local_device(device)
    model.to(on)
    pairs = (task or bootstrap_task("tiny_arith")).pairs(seed, heldout)
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
            problems = [next(pairs) for _ in range(batch_size)]
            batch = {k: v.to(on) for k, v in supervised_batch(tokenizer, problems).items()}
            with torch.autocast(on.type, dtype=torch.bfloat16, enabled=on.type == "cuda"):
                loss = model(**batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
            opt.step()
            sched.step()
            losses.append(loss.item())
            bar.update(task, advance=1, loss=f"{losses[-1]:.3f}")
    model.eval().to("cpu")
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
