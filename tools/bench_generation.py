"""Generation: the embedded engine vs `transformers` `generate`, on the long tail (the default) or on
fixed-length batches (--workload fixed).

The long tail (--workload longtail): --prompts tiny_arith prompts, each with its own answer length
drawn from a long tail (most short, a few long: --short-range for 85%, --long-range for the rest),
decoded with sampling at temperature 1 and ignore_eos, so both sides make exactly the same number of
useful tokens. The engine gets every request at once and batches them continuously (up to
--max-batch-size running); `generate` runs static batches of --static-batch prompts in arrival
order, each running until its longest answer is done (a padded row keeps decoding after its own
length: wasted work). Same model, one thread each (as a generation server on one pinned core). The
engine runs twice: with its own decode step (generation/engine/decode.py) and with every decode step
through the transformers forward. Useful tokens/s = answer tokens / time; the sides run alternately
--repeats times (default 3) and the best run of each is reported.

    python tools/bench_generation.py [--prompts 256] [--static-batch 64] [--max-batch-size 128] [--repeats 3]
                                     [--device cuda]

Fixed batches (--workload fixed), for the GPU: for each Qwen2 shape of --shapes (0.5b, 1.5b, or tiny
for a CPU smoke run; random weights, built from a config with tools/bench_engine.py's shapes) and
each batch size B of --batches, B prompts of --prompt-tokens random tokens each make exactly
--new-tokens tokens (sampling at temperature 1, ignore_eos): one `generate` call against the engine
given the same B requests at once, on the same model. Reported: the tokens/s of each side and their
ratio (target ≥ 10× at batch 256 on the 0.5b shape), and the engine's decode step (ms, from its
stats over the run: decode_seconds / decode_steps) against the read floor: the bytes a step must
read, the weights (tied embeddings once) plus the KV cache at the step's mean context (decode_kv /
decode_steps: the KV positions the rows attend over, as the engine counts them), over the memory
bandwidth measured in the same run by a large device-to-device copy (bytes read + written / time);
target ≤ 3× the floor. Best of --repeats (default 1) after a warm-up at each batch size (`generate`: a
few tokens; the engine: the full --new-tokens, so that every CUDA graph bucket the run meets is
captured before it, as a server captures each once in its life); on the CPU, torch's default threads.

Each shape and batch also gets a line splitting the engine's decode step (its best run, pure decode
steps only: generation/engine/step_timing.py) into host and device work, in mean ms per step: "host" is the
engine's own Python (scheduling, building the forward's inputs, answering rows), "forward call" and
"sampling call" the host's time in those calls (a graph replay or kernel launches on a GPU; the math
itself on the CPU), "readback" the wait for the sampled tokens (on a GPU: for the device to finish
the step's work), "loop" the decode thread's time between two steps; on CUDA, "device forward" and
"device sampling" are CUDA-event times of the same calls on the GPU. Then the CUDA graphs the run
replayed (of its decode steps) and captured, with their seconds (none after the warm-up, if all is well).

    python tools/bench_generation.py --workload fixed --device cuda [--shapes 0.5b 1.5b] [--batches 64 256]
                                     [--prompt-tokens 128] [--new-tokens 512] [--repeats 1]
    python tools/bench_generation.py --workload fixed --shapes tiny --batches 4 --new-tokens 8 --prompt-tokens 16

With --device cuda both sides run on the first GPU, in bfloat16 (float32 on the CPU);
tools/gpu_check.sh runs both workloads there.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import transformers
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, track
from rich.table import Table
from transformers import AutoModelForCausalLM

from _bench import machine
from areal_flow.data.arith import prompt_text, sample_operands
from areal_flow.generation.engine.generation_engine import GenerationEngine
from areal_flow.generation.engine.kv_budget import kv_bytes_per_token
from areal_flow.generation.engine.step_timing import per_step_ms
from areal_flow.models.bootstrap import ensure_base_model
from areal_flow.models.tokenizer import load_tokenizer
from areal_flow.runtime.devices import compute_dtype, local_device
from bench_engine import SHAPES  # the Qwen2 shapes (tiny, 0.5b, 1.5b) of the training benchmark


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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of a copy of `nbytes` from one buffer on `device` to another (bytes read + written
    / time), the best of `repeats` after one warm-up copy."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)  # written: pages mapped, not the zero page
    dst = torch.zeros_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def save_random_model(shape: str, path: str, device: torch.device, dtype: torch.dtype, context: int) -> None:
    """A Qwen2 model of one of tools/bench_engine.py's shapes with random weights, saved as an HF
    directory in `dtype` (built on `device`: seconds on a GPU where the CPU takes tens at 1.5B)."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**SHAPES[shape], max_position_embeddings=max(8192, context))
    with torch.device(device):
        model = transformers.Qwen2ForCausalLM(config)
    model.to(dtype).save_pretrained(path)


@dataclass
class FixedRow:
    shape: str
    batch: int
    generate_s: float
    engine_s: float
    tokens: int  # new tokens made by each side
    step_ms: float  # the engine's decode step, mean over its best run
    steps: int  # its decode steps in that run
    kv_positions: float  # KV positions a step reads, mean over the run (decode_kv / decode_steps)
    floor_ms: float  # (weight bytes + KV bytes at kv_positions) / bandwidth
    split: dict[str, float]  # the engine's decode step in host and device parts (step_timing.per_step_ms)
    graphs: dict[str, float]  # CUDA graph replays and captures in that run (empty: no graphs, off CUDA)
    serial_ms: float  # the decode step without the overlap schedule (--disable-overlap-schedule), best run

    @property
    def speedup(self) -> float:
        return self.generate_s / self.engine_s

    @property
    def over_floor(self) -> float:
        return self.step_ms / self.floor_ms


GRAPH_COUNTS = ("replays", "captures", "capture_seconds")


def graph_counts(engine: GenerationEngine) -> dict[str, float]:
    runner = engine.cuda_graphs
    return {} if runner is None else {key: getattr(runner, key) for key in GRAPH_COUNTS}


def run_fixed_engine(engine: GenerationEngine, prompts, new_tokens: int
                     ) -> tuple[float, dict[str, float], dict[str, float], dict[str, float]]:
    """Seconds for the engine to answer `prompts`, the change of its stats meanwhile, its decode
    step's host/device split (step_timing.per_step_ms) and its CUDA graph counts over the run."""
    before, timing, graphs = engine.stats(), engine.step_timing(), graph_counts(engine)
    seconds = run_engine(engine, prompts, [new_tokens] * len(prompts))
    after, graphs_after = engine.stats(), graph_counts(engine)
    return (seconds, {k: after[k] - before[k] for k in ("decode_steps", "decode_seconds", "decode_kv")},
            per_step_ms(timing, engine.step_timing()), {k: graphs_after[k] - graphs[k] for k in graphs})


def fixed(args, console: Console, device: torch.device, dtype: torch.dtype) -> None:
    context = args.prompt_tokens + args.new_tokens
    nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    with console.status("measuring the memory bandwidth"):
        bandwidth = memory_bandwidth(device, nbytes)
    transformers.utils.logging.disable_progress_bar()  # rich's progress below is the one shown
    rng = random.Random(args.seed)
    rows: list[FixedRow] = []
    warm = min(8, args.new_tokens)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console)
    with tempfile.TemporaryDirectory() as root, progress:
        task = progress.add_task("", total=len(args.shapes) * len(args.batches) * args.repeats)
        for shape in args.shapes:
            progress.update(task, description=f"{shape}: building the model")
            path = os.path.join(root, shape)
            save_random_model(shape, path, device, dtype, context)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
            config = model.config
            weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
            kv_token_bytes = kv_bytes_per_token(config, dtype)
            engine = GenerationEngine(path, max_batch_size=max(args.batches), device=str(device), dtype=dtype,
                                      time_steps=True)
            try:
                for batch in args.batches:
                    prompts = [[rng.randrange(config.vocab_size) for _ in range(args.prompt_tokens)]
                               for _ in range(batch)]
                    progress.update(task, description=f"{shape}, batch {batch}: warm-up")
                    run_static(model, prompts, [warm] * batch, batch, pad_id=0)
                    run_fixed_engine(engine, prompts, args.new_tokens)  # every graph bucket of the run
                    gen_runs, engine_runs, serial_runs = [], [], []
                    # Alternated, best of --repeats each: the machine's other load hits every side alike.
                    for r in range(args.repeats):
                        progress.update(task, description=f"{shape}, batch {batch}: generate and the engine")
                        gen_runs.append(run_static(model, prompts, [args.new_tokens] * batch, batch, pad_id=0))
                        engine_runs.append(run_fixed_engine(engine, prompts, args.new_tokens))
                        engine.overlap = False  # read between steps: the engine is idle here
                        serial_runs.append(run_fixed_engine(engine, prompts, args.new_tokens))
                        engine.overlap = True
                        progress.advance(task)
                    engine_s, counts, split, graphs = min(engine_runs, key=lambda run: run[0])
                    serial = min(serial_runs, key=lambda run: run[0])[1]
                    steps = int(counts["decode_steps"])
                    kv_positions = counts["decode_kv"] / steps
                    rows.append(FixedRow(shape, batch, min(gen_runs), engine_s, batch * args.new_tokens,
                                         1e3 * counts["decode_seconds"] / steps, steps, kv_positions,
                                         1e3 * (weight_bytes + kv_positions * kv_token_bytes) / bandwidth,
                                         split, graphs, 1e3 * serial["decode_seconds"] / serial["decode_steps"]))
                    console.print(f"{shape}, batch {batch}: generate " + " ".join(f"{s:.2f}" for s in gen_runs)
                                  + " s; engine " + " ".join(f"{run[0]:.2f}" for run in engine_runs) + " s")
            finally:
                engine.shutdown()
            del model, engine
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    table = Table(title=f"{args.prompt_tokens} random prompt tokens + {args.new_tokens} new tokens a request, "
                        f"{str(dtype).removeprefix('torch.')} on {device.type}; best of {args.repeats}")
    for col in ("shape", "batch", "generate tok/s", "engine tok/s", "engine / generate", "engine ms/step",
                "KV positions/step", "read floor ms", "step / floor"):
        table.add_column(col, justify="left" if col == "shape" else "right")
    for r in rows:
        table.add_row(r.shape, str(r.batch), f"{r.tokens / r.generate_s:,.0f}", f"{r.tokens / r.engine_s:,.0f}",
                      f"{r.speedup:.2f}×", f"{r.step_ms:.3f}", f"{r.kv_positions:,.0f}", f"{r.floor_ms:.3f}",
                      f"{r.over_floor:.2f}×")
    console.print(f"machine: {machine()}")
    console.print(f"command: python tools/bench_generation.py --workload fixed --device {device.type} "
                  f"--shapes {' '.join(args.shapes)} --batches {' '.join(map(str, args.batches))} "
                  f"--prompt-tokens {args.prompt_tokens} --new-tokens {args.new_tokens} --repeats {args.repeats}")
    console.print(f"memory bandwidth: {bandwidth / 1e9:,.1f} GB/s (a {nbytes >> 20} MiB copy on {device.type}, "
                  f"bytes read + written / time); read floor = (weight bytes + KV bytes at the step's mean "
                  f"context) / bandwidth")
    console.print(table)
    for r in rows:
        target = " (target ≥ 10×)" if (r.shape, r.batch) == ("0.5b", 256) else ""
        console.print(f"{r.shape}, batch {r.batch}: engine vs generate: {r.speedup:.2f}×{target}; engine decode "
                      f"step vs read floor: {r.step_ms:.3f} / {r.floor_ms:.3f} ms = {r.over_floor:.2f}× "
                      f"(target ≤ 3×; {r.steps} decode steps)")
    for r in rows:
        console.print(split_line(r))
    for r in rows:
        console.print(f"{r.shape}, batch {r.batch}: overlap schedule: decode step {r.step_ms:.3f} ms against "
                      f"{r.serial_ms:.3f} without (--disable-overlap-schedule): {r.serial_ms / r.step_ms:.2f}× faster")
    if not any((r.shape, r.batch) == ("0.5b", 256) for r in rows):
        console.print("(the tokens/s target, engine ≥ 10× generate, is for batch 256 on the 0.5b shape: not run here)")


def split_line(r: FixedRow) -> str:
    """The engine's decode step split into host and device parts, and its CUDA graphs."""
    s = r.split
    line = (f"{r.shape}, batch {r.batch}: engine step split, mean ms over {s['steps']:.0f} pure decode steps: "
            f"host {s['host']:.3f} + forward call {s['forward']:.3f} + sampling call {s['sample']:.3f} + readback "
            f"{s['readback']:.3f} = {s['wall']:.3f}; loop between steps {s['loop']:.3f}")
    if s["device_forward"] == s["device_forward"]:  # not NaN: CUDA events were read
        line += f"; device forward {s['device_forward']:.3f}, device sampling {s['device_sample']:.3f}"
    if r.graphs:
        line += (f"; CUDA graphs: {r.graphs['replays']:.0f} replays of {r.steps} decode steps, "
                 f"{r.graphs['captures']:.0f} captured in the run ({r.graphs['capture_seconds']:.2f} s)")
    return line


def longtail(args, console: Console, device: str, dtype: torch.dtype) -> None:
    torch.set_num_threads(1)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="longtail", choices=("longtail", "fixed"),
                    help="longtail: tiny_arith prompts, long-tail answer lengths, static batches for generate "
                         "(the default); fixed: --batches of random prompts, --new-tokens each, at --shapes")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both sides run (cuda: bfloat16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs of each side; the best of each is reported (default: 3 longtail, 1 fixed)")
    longtail_args = ap.add_argument_group("--workload longtail")
    longtail_args.add_argument("--prompts", type=int, default=256)
    longtail_args.add_argument("--static-batch", type=int, default=64)
    longtail_args.add_argument("--max-batch-size", type=int, default=128)
    longtail_args.add_argument("--short-range", type=int, nargs=2, default=[8, 24])
    longtail_args.add_argument("--long-range", type=int, nargs=2, default=[64, 96])
    longtail_args.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "areal_flow_bench_cache"))
    fixed_args = ap.add_argument_group("--workload fixed")
    fixed_args.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["0.5b", "1.5b"],
                            help="Qwen2 shapes with random weights (tiny: a CPU smoke run)")
    fixed_args.add_argument("--batches", type=int, nargs="+", default=[64, 256], help="requests in each run")
    fixed_args.add_argument("--prompt-tokens", type=int, default=128, help="random prompt tokens a request")
    fixed_args.add_argument("--new-tokens", type=int, default=512, help="tokens each request makes (ignore_eos)")
    args = ap.parse_args()
    if args.repeats is None:
        args.repeats = 3 if args.workload == "longtail" else 1
    if min(args.repeats, args.prompt_tokens, args.new_tokens, *args.batches) < 1:
        ap.error("--repeats, --prompt-tokens, --new-tokens and --batches must be at least 1")
    device, dtype = local_device(args.device), compute_dtype("auto", args.device)
    # Piped (a log file), rich would wrap the tables at 80 columns.
    console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)
    if args.workload == "longtail":
        longtail(args, console, str(device), dtype)
    else:
        fixed(args, console, device, dtype)


if __name__ == "__main__":
    main()
