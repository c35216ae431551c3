"""Long answers through the paged cache: --requests requests of --new-tokens tokens each (16,384 by
default: the paper generates up to 27k) at a Qwen2 shape with random weights, all submitted at
once to one embedded engine. Reported: decode tokens/s, the decode step, the KV budget and the
memory the run peaked at, and the preemptions (rows retracted when the running ones outgrew the
KV budget, prefilled again later with their tokens so far) with the tokens those prefills
recomputed.

    python tools/bench_long.py --device cuda [--shape 1.5b] [--requests 16] [--new-tokens 16384]
                               [--prompt-tokens 128] [--mem-fraction 0.3 | --max-total-tokens N]
    python tools/bench_long.py --shape tiny --requests 4 --new-tokens 256 --max-total-tokens 700   # CPU, preempts

Every request samples at temperature 1 with ignore_eos, so each makes exactly --new-tokens tokens.
On CUDA in bfloat16 and the KV budget from --mem-fraction (SGLang's --mem-fraction-static) unless
--max-total-tokens caps it; "peak memory" is torch's peak allocation on the GPU (the weights, the
KV pool, the CUDA graphs' pool and activations), on the CPU the process's peak resident set.
tools/gpu_check.sh runs it at the 1.5B shape.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time

import torch
import transformers
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from _bench import machine
from areal_flow.generation.engine.generation_engine import GenerationEngine
from areal_flow.generation.engine.kv_budget import kv_bytes_per_token
from areal_flow.runtime.devices import compute_dtype, local_device
from bench_engine import SHAPES
from bench_generation import save_random_model


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def run(args, console: Console) -> dict:
    device, dtype = local_device(args.device), compute_dtype("auto", args.device)
    context = args.prompt_tokens + args.new_tokens
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, args.shape)
        with console.status(f"building the {args.shape} model"):
            save_random_model(args.shape, path, device, dtype, context)
        engine = GenerationEngine(path, max_batch_size=args.requests, device=str(device), dtype=dtype,
                                  max_total_tokens=args.max_total_tokens,
                                  mem_fraction=args.mem_fraction if device.type == "cuda" else None)
    try:
        vocab, token_bytes = engine.vocab_size, kv_bytes_per_token(engine.model.config, dtype)
        generator = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(vocab, (args.requests, args.prompt_tokens), generator=generator).tolist()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        total = args.requests * args.new_tokens
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console)
        before = engine.stats()
        started = time.perf_counter()
        futures = [engine.submit(p, max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True,
                                 seed=args.seed + i) for i, p in enumerate(prompts)]
        with progress:
            task = progress.add_task("tokens", total=total)
            while not all(f.done() for f in futures):
                progress.update(task, completed=engine.stats()["generated_tokens"] - before["generated_tokens"])
                time.sleep(0.5)
            progress.update(task, completed=total)
        results = [f.result() for f in futures]
        seconds = time.perf_counter() - started
        after = engine.stats()
    finally:
        engine.shutdown()
    made = sum(len(r.output_ids) for r in results)
    assert made == total, (made, total)
    steps = after["decode_steps"] - before["decode_steps"]
    return {
        "seconds": seconds, "tokens": made, "tokens_per_s": made / seconds,
        "step_ms": 1e3 * (after["decode_seconds"] - before["decode_seconds"]) / max(steps, 1),
        "kv_budget": engine.max_total_tokens, "kv_needed": args.requests * context,
        "kv_gib": (engine.max_total_tokens or args.requests * context) * token_bytes / 2**30,
        "peak_gib": peak_memory_gib(device), "preemptions": sum(r.retractions for r in results),
        "preempted": sum(r.retractions > 0 for r in results),
        "prefill_tokens": after["prefill_tokens"] - before["prefill_tokens"],
        "device": device.type, "dtype": str(dtype).removeprefix("torch."),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--shape", default="1.5b", choices=list(SHAPES))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=16384)
    ap.add_argument("--mem-fraction", type=float, default=0.3, help="cuda: the KV budget's share of the GPU")
    ap.add_argument("--max-total-tokens", type=int, default=None, help="cap the KV budget (tokens)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if min(args.requests, args.prompt_tokens, args.new_tokens) < 1:
        ap.error("--requests, --prompt-tokens and --new-tokens must be at least 1")
    console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)
    r = run(args, console)
    budget = "none" if r["kv_budget"] is None else f"{r['kv_budget']:,}"
    table = Table(title=f"{args.requests} requests of {args.prompt_tokens} + {args.new_tokens:,} tokens, "
                        f"{args.shape}, {r['dtype']} on {r['device']}")
    for col in ("tokens/s", "decode ms/step", "KV budget tokens", "KV needed tokens", "KV pool GiB", "peak GiB",
                "preemptions", "rows preempted", "prefill tokens", "seconds"):
        table.add_column(col, justify="right")
    table.add_row(f"{r['tokens_per_s']:,.0f}", f"{r['step_ms']:.3f}", budget, f"{r['kv_needed']:,}",
                  f"{r['kv_gib']:.1f}", f"{r['peak_gib']:.1f}", str(r["preemptions"]), str(r["preempted"]),
                  f"{r['prefill_tokens']:,}", f"{r['seconds']:.1f}")
    console.print(f"machine: {machine()}")
    cap = f"--max-total-tokens {args.max_total_tokens}" if args.max_total_tokens else f"--mem-fraction {args.mem_fraction}"
    console.print(f"command: python tools/bench_long.py --device {args.device} --shape {args.shape} --requests "
                  f"{args.requests} --prompt-tokens {args.prompt_tokens} --new-tokens {args.new_tokens} {cap}")
    console.print(table)
    console.print(f"long answers: {r['tokens_per_s']:,.0f} tokens/s, {r['step_ms']:.3f} ms a decode step, "
                  f"peak {r['peak_gib']:.1f} GiB, {r['preemptions']} preemption(s) of {r['preempted']} row(s), "
                  f"{r['prefill_tokens'] - args.requests * args.prompt_tokens:,} tokens prefilled again")


if __name__ == "__main__":
    main()
