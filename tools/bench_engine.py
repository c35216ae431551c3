"""Training-engine throughput on one GPU: the torch engine, bf16, a Qwen2-shaped model built from a
config (random weights), long-tail packed batches. Prints tokens/s and MFU of the logprob pass and of
the train step, with and without activation checkpointing, and peak memory.

    python tools/bench_engine.py [--shape 0.5b] [--tokens 65536] [--micro-batch-tokens 8192]

MFU counts 2·N FLOPs per token forward and 6·N forward+backward (N = parameters without the
embedding table), against the GPU's dense bf16 peak (--peak-tflops, H100 SXM: 989).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch
import transformers

from _bench import machine
from areal_flow.training.engine import OptimSpec
from areal_flow.training.torch_engine import TorchEngine

SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}


def long_tail_batch(total_tokens: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Prompts of 64-512 tokens and answers from a long-tailed distribution (most short, a few at the
    limit), as reasoning rollouts are, until `total_tokens`."""
    rng = np.random.default_rng(seed)
    seqs, n = [], 0
    while n < total_tokens:
        prompt = int(rng.integers(64, 513))
        answer = int(min(4096, 64 + rng.exponential(700)))
        seqs.append((rng.integers(0, 150_000, prompt), rng.integers(0, 150_000, answer)))
        n += prompt + answer
    return seqs


def loss_fn(logprobs, batch, mask, n_valid_tokens):
    return -(logprobs * batch["advantages"] * mask).sum() / n_valid_tokens, {}


def timed(fn, repeats: int) -> float:
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(path: str, seqs: list, data: dict, args: argparse.Namespace, attention: str,
            checkpointing: bool) -> tuple[int, list]:
    """(parameters without embeddings, rows of the table) for one engine setting."""
    engine = TorchEngine(path, optim=OptimSpec(lr=1e-6), micro_batch_tokens=args.micro_batch_tokens,
                         device="cuda", bf16=True, activation_checkpointing=checkpointing, attention=attention)
    n_params = sum(p.numel() for n, p in engine.model.named_parameters() if "embed_tokens" not in n)
    engine.logprobs(seqs[:4]), engine.train_step(seqs[:4], {k: v[:4] for k, v in data.items()}, loss_fn)  # warm-up
    torch.cuda.reset_peak_memory_stats()
    fwd = timed(lambda: engine.logprobs(seqs), args.repeats)
    step = timed(lambda: engine.train_step(seqs, data, loss_fn), args.repeats)
    peak = torch.cuda.max_memory_allocated() / 2**30
    tokens = sum(len(p) + len(o) for p, o in seqs)
    rows = []
    for what, seconds, flops in (("logprobs", fwd, 2), ("train step", step, 6)):
        tps = tokens / seconds
        rows.append((what, attention, "on" if checkpointing else "off", tps, flops * n_params * tps / 1e12 / args.peak_tflops, peak))
    return n_params, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--tokens", type=int, default=65536, help="tokens per batch")
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    args = ap.parse_args()
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**SHAPES[args.shape], max_position_embeddings=8192)
    with tempfile.TemporaryDirectory() as path:
        transformers.Qwen2ForCausalLM(config).save_pretrained(path)
        seqs = long_tail_batch(args.tokens)
        tokens = sum(len(p) + len(o) for p, o in seqs)
        data = {"advantages": [np.ones(len(o), np.float32) for _, o in seqs]}
        rows = []
        for attention, checkpointing in (("sdpa", False), ("sdpa", True), ("flex_attention", False)):
            n_params, measured = measure(path, seqs, data, args, attention, checkpointing)
            rows += measured
            torch.cuda.empty_cache()
    print(f"machine: {machine()}")
    print(f"command: python tools/bench_engine.py --shape {args.shape} --tokens {args.tokens} "
          f"--micro-batch-tokens {args.micro_batch_tokens}")
    print(f"model: Qwen2 {args.shape} shape ({n_params / 1e6:.0f}M parameters without embeddings), bf16 compute, fp32 "
          f"master weights; batch: {len(seqs)} sequences, {tokens} tokens, packed under {args.micro_batch_tokens}\n")
    print("| pass | attention | activation checkpointing | tokens/s | MFU | peak GiB |\n|---|---|---|---|---|---|")
    for what, attention, ckpt, tps, mfu, peak in rows:
        print(f"| {what} | {attention} | {ckpt} | {tps:,.0f} | {100 * mfu:.1f}% | {peak:.1f} |")


if __name__ == "__main__":
    main()
