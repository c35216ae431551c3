"""Training on tiny_arith batches on CPU: packed vs padded, and the torch vs the megatron engine.

One 64-sample tiny_arith batch, one train step (forward, backward, AdamW) on the bootstrapped tiny
Qwen2, each variant in its own process (for its own peak memory), median of --repeats:

- padded: Hugging Face forward/backward on padded rows of --pad-rows sequences (attention mask),
  as a trainer without packing runs it; its speed counts every padded position;
- packed, one row: the torch engine, each micro-batch of --micro-batch-tokens one packed row;
- packed, rows: the torch engine as the tiny_arith recipe runs it, micro-batches of
  --rows-micro-batch-tokens split into packed rows of --row-tokens, one call each;
- megatron TP=1 and TP=2: the megatron engine on the same packed micro-batches (TP=2: two gloo
  processes, one core each).

Speeds are REAL (non-padding) tokens per second unless they say padded. The packing target: packed
(rows) real tokens/s >= 0.9 x the padded run's padded tokens/s (padding then costs what it would save).
Peak memory is the largest resident-set growth during the step over the process's size before it.

    python tools/bench_packing.py [--repeats 5] [--micro-batch-tokens 256] [--rows-micro-batch-tokens 4096]
                                  [--row-tokens 128] [--pad-rows 8]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import threading
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_micro_batch import batch
from rich.console import Console
from rich.table import Table

from _bench import machine
from areal_flow.training.engine import OptimSpec


ONE_ROW, ROWS = "packed: torch engine, one row per micro-batch", "packed: torch engine, rows per call"


def loss_fn(lp, b, mask, n):
    return -(lp * b["advantages"] * mask).sum() / n, {}


class PeakRss:
    """The largest growth of this process's resident set while entered, sampled every millisecond."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def grown_mib(self) -> float:
        return (self.peak - self.base) / 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure(step, repeats: int) -> tuple[float, float]:
    step()  # warm-up
    times, peak = [], 0.0
    for _ in range(repeats):
        with PeakRss() as mem:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        peak = max(peak, mem.grown_mib)
    return statistics.median(times), peak


def padded_step(model_dir: str, seqs, pad_rows: int):
    """A plain HF trainer's step: rows of `pad_rows` sequences padded to the longest, masked."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    n_valid = sum(len(o) for _, o in seqs)

    def step():
        opt.zero_grad()
        for start in range(0, len(seqs), pad_rows):
            rows = seqs[start:start + pad_rows]
            width = max(len(p) + len(o) for p, o in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            attn = torch.zeros(len(rows), width, dtype=torch.long)
            target_mask = torch.zeros(len(rows), width, dtype=torch.bool)
            for r, (p, o) in enumerate(rows):
                n = len(p) + len(o)
                ids[r, :n] = torch.from_numpy(np.concatenate([p, o]))
                attn[r, :n] = 1
                target_mask[r, len(p):n] = True
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
            lp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
            loss = -(lp * target_mask[:, 1:]).sum() / n_valid
            loss.backward()
        opt.step()

    return step, sum(len(rows) * max(len(p) + len(o) for p, o in rows)
                     for rows in (seqs[s:s + pad_rows] for s in range(0, len(seqs), pad_rows)))


def _variant(rank: int, world: int, port: int, name: str, model_dir: str, seqs, args, out: dict) -> None:
    warnings.filterwarnings("ignore", module="megatron")  # "Apex is not installed" and the like
    torch.set_num_threads(1)  # as a trainer process: one pinned core
    data = {"advantages": [np.ones(len(o), np.float32) for _, o in seqs]}
    optim = OptimSpec(lr=1e-4)
    padded_tokens = None
    if name == "padded":
        step, padded_tokens = padded_step(model_dir, seqs, args.pad_rows)
    elif name.startswith("packed"):
        from areal_flow.training.torch_engine import TorchEngine

        rows = name == ROWS
        engine = TorchEngine(model_dir, optim=optim, row_tokens=args.row_tokens if rows else None,
                             micro_batch_tokens=args.rows_micro_batch_tokens if rows else args.micro_batch_tokens)
        step = lambda: engine.train_step(seqs, data, loss_fn)  # noqa: E731
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        from areal_flow.training.megatron.engine import MegatronEngine

        engine = MegatronEngine(model_dir, optim=optim, micro_batch_tokens=args.micro_batch_tokens, tp=world)
        step = lambda: engine.train_step(seqs, data, loss_fn)  # noqa: E731
    seconds, peak = _measure(step, args.repeats)
    if rank == 0:
        out[name] = (seconds, peak, padded_tokens)
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--micro-batch-tokens", type=int, default=256)
    ap.add_argument("--rows-micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--row-tokens", type=int, default=128)
    ap.add_argument("--pad-rows", type=int, default=8)
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "areal_flow_bench_cache"))
    args = ap.parse_args()
    from areal_flow.models.bootstrap import ensure_base_model
    from areal_flow.models.tokenizer import load_tokenizer

    model_dir = ensure_base_model(os.path.join(args.cache_dir, "models"), steps=20, progress=False)
    seqs = batch(load_tokenizer(model_dir), 64, seed=0)
    real = sum(len(p) + len(o) for p, o in seqs)
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    variants = [("padded", 1), (ONE_ROW, 1), (ROWS, 1), ("megatron TP=1", 1), ("megatron TP=2", 2)]
    console = Console()
    with console.status("measuring") as status:
        for name, world in variants:
            status.update(f"measuring {name}")
            port = _free_port()
            procs = [ctx.Process(target=_variant, args=(r, world, port, name, model_dir, seqs, args, results))
                     for r in range(world)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            if any(p.exitcode for p in procs):
                raise SystemExit(f"{name}: a process failed (exit codes {[p.exitcode for p in procs]})")

    pad_seconds, _, padded_tokens = results["padded"]
    table = Table(title=f"one train step, 64 tiny_arith samples: {real:,} real tokens "
                        f"({padded_tokens:,} when padded in rows of {args.pad_rows}, "
                        f"{1 - real / padded_tokens:.0%} padding)")
    for col in ("variant", "seconds", "real tokens/s", "vs padded", "peak MiB"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for name, _ in variants:
        seconds, peak, _ = results[name]
        table.add_row(name, f"{seconds:.3f}", f"{real / seconds:,.0f}", f"{pad_seconds / seconds:.2f}×", f"{peak:.0f}")
    console.print(f"machine: {machine()}")
    console.print(f"command: python tools/bench_packing.py --repeats {args.repeats} "
                  f"--micro-batch-tokens {args.micro_batch_tokens} --rows-micro-batch-tokens "
                  f"{args.rows_micro_batch_tokens} --row-tokens {args.row_tokens} --pad-rows {args.pad_rows}")
    console.print(table)
    packed = real / results[ROWS][0]
    target = 0.9 * padded_tokens / pad_seconds
    console.print(f"packing target: packed {packed:,.0f} real tokens/s vs 0.9 × padded {padded_tokens / pad_seconds:,.0f} "
                  f"padded tokens/s = {target:,.0f}: ratio {packed / target:.2f} ({'met' if packed >= target else 'NOT met'})")
    tp1, tp2 = results["megatron TP=1"][0], results["megatron TP=2"][0]
    console.print(f"megatron TP=2 vs TP=1 (two cores vs one): {tp1 / tp2:.2f}×; "
                  f"megatron TP=1 vs torch engine, same packing: {results[ONE_ROW][0] / tp1:.2f}×")


def _free_port() -> int:
    from areal_flow.runtime.ports import free_ports

    return free_ports(1)[0]


if __name__ == "__main__":
    main()
