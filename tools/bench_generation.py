"""Generation on the long tail: the embedded engine vs `transformers` `generate` in static batches.

The workload: --prompts tiny_arith prompts, each with its own answer length drawn from a long tail
(most short, a few long: --short-range for 85%, --long-range for the rest), decoded with sampling at
temperature 1 and ignore_eos, so both sides make exactly the same number of useful tokens. The
engine gets every request at once and batches them continuously (up to --max-batch-size running);
`generate` runs static batches of --static-batch prompts in arrival order, each running until its
longest answer is done (a padded row keeps decoding after its own length: wasted work). Same model,
one thread each (as a generation server on one pinned core). The engine runs twice: with its own
decode step (generation/decode.py) and with every decode step through the transformers forward.
Useful tokens/s = answer tokens / time; the sides run alternately --repeats times and the best run
of each is reported.

    python tools/bench_generation.py [--prompts 256] [--static-batch 64] [--max-batch-size 128] [--repeats 3]
                                     [--device cuda]

With --device cuda both sides run on the first GPU, in bfloat16 (tools/gpu_check.sh runs it there).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table
from transformers import AutoModelForCausalLM

from _bench import machine
from areal_flow.data.arith import prompt_text, sample_operands
from areal_flow.generation.engine import GenerationEngine
from areal_flow.models.bootstrap import ensure_base_model
from areal_flow.models.tokenizer import load_tokenizer
from areal_flow.runtime.devices import compute_dtype, local_device


def workload(tokenizer, n: int, short: tuple[int, int], long: tuple[int, int], seed: int):
    rng = random.Random(seed)
    prompts, lengths = [], []
    for _ in range(n):
        prompts.append(tokenizer.encode(prompt_text(*sample_operands(rng))))
        lengths.append(rng.randint(*(short if rng.random() < 0.85 else long)))
    return prompts, lengths


def run_engine(engine: GenerationEngine, prompts, lengths) -> float:
    start = time.perf_counter()
    futures = [engine.submit(p, max_new_tokens=n, temperature=1.0, ignore_eos=True) for p, n in zip(prompts, lengths)]
    made = sum(len(f.result().output_ids) for f in futures)
    seconds = time.perf_counter() - start
    assert made == sum(lengths), (made, sum(lengths))
    return seconds


@torch.inference_mode()
def run_static(model, prompts, lengths, batch: int, pad_id: int) -> float:
    device = next(model.parameters()).device
    start = time.perf_counter()
    for s in range(0, len(prompts), batch):
        rows, budget = prompts[s:s + batch], max(lengths[s:s + batch])
        width = max(len(p) for p in rows)
        ids = torch.full((len(rows), width), pad_id)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, p in enumerate(rows):  # left padding, as generate wants for decoder-only models
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True, temperature=1.0,
                             top_p=1.0, top_k=0, max_new_tokens=budget, min_new_tokens=budget, pad_token_id=pad_id)
        out.cpu()  # waits for the device
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--static-batch", type=int, default=64)
    ap.add_argument("--max-batch-size", type=int, default=128)
    ap.add_argument("--short-range", type=int, nargs=2, default=[8, 24])
    ap.add_argument("--long-range", type=int, nargs=2, default=[64, 96])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each side; the best of each is reported")
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "areal_flow_bench_cache"))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both sides run (cuda: bfloat16)")
    args = ap.parse_args()
    device, dtype = str(local_device(args.device)), compute_dtype("auto", args.device)
    torch.set_num_threads(1)
    console = Console()
    with console.status("preparing the model"):
        model_dir = ensure_base_model(os.path.join(args.cache_dir, "models"), steps=20, progress=False)
    tokenizer = load_tokenizer(model_dir)
    prompts, lengths = workload(tokenizer, args.prompts, tuple(args.short_range), tuple(args.long_range), args.seed)
    useful = sum(lengths)
    on = dict(max_batch_size=args.max_batch_size, num_threads=1, device=device, dtype=dtype)
    engines = {"own": GenerationEngine(model_dir, **on),
               "transformers": GenerationEngine(model_dir, fast_decode=False, **on)}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad_id = tokenizer.pad_token_id or 0
    runs: dict[str, list[float]] = {"generate": [], **{name: [] for name in engines}}
    try:
        for engine in engines.values():
            engine.submit(prompts[0], max_new_tokens=4).result()  # warm-up
        # Alternated, best of --repeats each: the machine's other load hits every side alike.
        for _ in track(range(args.repeats), description="generate and both engines, alternated", console=console):
            runs["generate"].append(run_static(model, prompts, lengths, args.static_batch, pad_id))
            for name, engine in engines.items():
                runs[name].append(run_engine(engine, prompts, lengths))
    finally:
        for engine in engines.values():
            engine.shutdown()
    console.print("runs (s): " + "; ".join(f"{name} " + " ".join(f"{s:.2f}" for s in times)
                                           for name, times in runs.items()))
    best = {name: min(times) for name, times in runs.items()}
    table = Table(title=f"{args.prompts} prompts, {useful:,} useful answer tokens "
                        f"(85% of answers {args.short_range[0]}-{args.short_range[1]} tokens, "
                        f"15% {args.long_range[0]}-{args.long_range[1]})")
    for col in ("generator", "seconds", "useful tokens/s", "vs generate"):
        table.add_column(col, justify="left" if col == "generator" else "right")
    rows = [(f"transformers generate, static batches of {args.static_batch}", best["generate"]),
            (f"engine, decode steps through the transformers forward (max {args.max_batch_size})",
             best["transformers"]),
            (f"engine, its own decode step (max {args.max_batch_size})", best["own"])]
    for label, seconds in rows:
        table.add_row(label, f"{seconds:.2f}", f"{useful / seconds:,.0f}", f"{best['generate'] / seconds:.2f}×")
    console.print(f"machine: {machine()}")
    console.print(f"command: python tools/bench_generation.py --prompts {args.prompts} --static-batch "
                  f"{args.static_batch} --max-batch-size {args.max_batch_size} --repeats {args.repeats} "
                  f"--device {args.device}")
    console.print(table)
    console.print(f"engine vs generate: {best['generate'] / best['own']:.2f}× (target ≥ 3×); its own decode step "
                  f"vs the transformers forward: {best['transformers'] / best['own']:.2f}×")


if __name__ == "__main__":
    main()
