"""Generation on the long tail: the embedded engine vs `transformers` `generate` in static batches.

The workload: --prompts tiny_arith prompts, each with its own answer length drawn from a long tail
(most short, a few long: --short-range for 85%, --long-range for the rest), decoded with sampling at
temperature 1 and ignore_eos, so both sides make exactly the same number of useful tokens. The
engine gets every request at once and batches them continuously (up to --max-batch-size running);
`generate` runs static batches of --static-batch prompts in arrival order, each running until its
longest answer is done (a padded row keeps decoding after its own length: wasted work). Same model,
one thread each (as a generation server on one pinned core). Useful tokens/s = answer tokens / time.

    python tools/bench_generation.py [--prompts 256] [--static-batch 64] [--max-batch-size 128]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM

from _bench import machine
from areal_flow.data.arith import prompt_text, sample_operands
from areal_flow.generation.engine import GenerationEngine
from areal_flow.models.bootstrap import ensure_base_model
from areal_flow.models.tokenizer import load_tokenizer


def workload(tokenizer, n: int, short: tuple[int, int], long: tuple[int, int], seed: int):
    rng = random.Random(seed)
    prompts, lengths = [], []
    for _ in range(n):
        prompts.append(tokenizer.encode(prompt_text(*sample_operands(rng))))
        lengths.append(rng.randint(*(short if rng.random() < 0.85 else long)))
    return prompts, lengths


def run_engine(model_dir: str, prompts, lengths, max_batch_size: int) -> float:
    engine = GenerationEngine(model_dir, max_batch_size=max_batch_size, num_threads=1)
    try:
        engine.submit(prompts[0], max_new_tokens=4).result()  # warm-up
        start = time.perf_counter()
        futures = [engine.submit(p, max_new_tokens=n, temperature=1.0, ignore_eos=True)
                   for p, n in zip(prompts, lengths)]
        made = sum(len(f.result().output_ids) for f in futures)
        seconds = time.perf_counter() - start
    finally:
        engine.shutdown()
    assert made == sum(lengths), (made, sum(lengths))
    return seconds


@torch.inference_mode()
def run_static(model_dir: str, prompts, lengths, batch: int, pad_id: int) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    start = time.perf_counter()
    for s in range(0, len(prompts), batch):
        rows, budget = prompts[s:s + batch], max(lengths[s:s + batch])
        width = max(len(p) for p in rows)
        ids = torch.full((len(rows), width), pad_id)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, p in enumerate(rows):  # left padding, as generate wants for decoder-only models
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                       max_new_tokens=budget, min_new_tokens=budget, pad_token_id=pad_id)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--static-batch", type=int, default=64)
    ap.add_argument("--max-batch-size", type=int, default=128)
    ap.add_argument("--short-range", type=int, nargs=2, default=[8, 24])
    ap.add_argument("--long-range", type=int, nargs=2, default=[64, 96])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "areal_flow_bench_cache"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    console = Console()
    with console.status("preparing the model"):
        model_dir = ensure_base_model(os.path.join(args.cache_dir, "models"), steps=20, progress=False)
    tokenizer = load_tokenizer(model_dir)
    prompts, lengths = workload(tokenizer, args.prompts, tuple(args.short_range), tuple(args.long_range), args.seed)
    useful = sum(lengths)
    with console.status("embedded engine"):
        engine_s = run_engine(model_dir, prompts, lengths, args.max_batch_size)
    with console.status("transformers generate"):
        static_s = run_static(model_dir, prompts, lengths, args.static_batch, tokenizer.pad_token_id or 0)
    table = Table(title=f"{args.prompts} prompts, {useful:,} useful answer tokens "
                        f"(85% of answers {args.short_range[0]}-{args.short_range[1]} tokens, "
                        f"15% {args.long_range[0]}-{args.long_range[1]})")
    for col in ("generator", "seconds", "useful tokens/s", "vs generate"):
        table.add_column(col, justify="left" if col == "generator" else "right")
    table.add_row(f"transformers generate, static batches of {args.static_batch}", f"{static_s:.2f}",
                  f"{useful / static_s:,.0f}", "1.00×")
    table.add_row(f"embedded engine, continuous batching (max {args.max_batch_size})", f"{engine_s:.2f}",
                  f"{useful / engine_s:,.0f}", f"{static_s / engine_s:.2f}×")
    console.print(f"machine: {machine()}")
    console.print(f"command: python tools/bench_generation.py --prompts {args.prompts} --static-batch "
                  f"{args.static_batch} --max-batch-size {args.max_batch_size}")
    console.print(table)
    console.print(f"engine vs generate: {static_s / engine_s:.2f}× (target ≥ 3×)")


if __name__ == "__main__":
    main()
