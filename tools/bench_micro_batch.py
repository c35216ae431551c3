"""Train-step time of one 64-sample tiny_arith batch for several packed micro-batch budgets.

On CPU, SDPA attends a packed micro-batch through a dense block-diagonal mask, so its cost grows
with the square of the micro-batch length; this measures where the budget should sit.

    python tools/bench_micro_batch.py [--budgets 4096 1024 512 256 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

import numpy as np
import torch

from _bench import machine
from areal_flow.data.arith import completion_text, prompt_text, sample_operands
from areal_flow.models.bootstrap import ensure_base_model
from areal_flow.models.tokenizer import load_tokenizer
from areal_flow.training.engine import OptimSpec
from areal_flow.training.torch_engine import TorchEngine


def batch(tokenizer, n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = random.Random(seed)
    seqs = []
    for _ in range(n):
        a, b = sample_operands(rng)
        seqs.append((np.array(tokenizer.encode(prompt_text(a, b))),
                     np.array(tokenizer.encode(completion_text(a, b)) + [tokenizer.eos_token_id])))
    return seqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[4096, 1024, 512, 256, 128])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "areal_flow_bench_cache"))
    args = ap.parse_args()
    torch.set_num_threads(1)  # as the trainer process: one pinned core
    model = ensure_base_model(os.path.join(args.cache_dir, "models"), steps=20, progress=False)
    tok = load_tokenizer(model)
    seqs = batch(tok, 64, seed=0)
    data = {"advantages": [np.ones(len(o), np.float32) for _, o in seqs]}

    def loss_fn(lp, b, mask, n):
        return -(lp * b["advantages"] * mask).sum() / n, {}

    rows = []
    for budget in args.budgets:
        engine = TorchEngine(model, optim=OptimSpec(), micro_batch_tokens=budget)
        engine.logprobs(seqs), engine.train_step(seqs, data, loss_fn)  # warm-up
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            engine.logprobs(seqs)  # the prox-logprob node
            engine.train_step(seqs, data, loss_fn)  # the train node
            times.append(time.perf_counter() - t0)
        rows.append((budget, statistics.median(times)))
    tokens = sum(len(p) + len(o) for p, o in seqs)
    print(f"machine: {machine()}")
    print(f"command: python tools/bench_micro_batch.py --budgets {' '.join(map(str, args.budgets))}")
    print(f"batch: 64 samples, {tokens} tokens; time = prox logprobs + one train step, median of {args.repeats}\n")
    print("| micro_batch_tokens | seconds | tokens/s | speed-up vs largest |\n|---|---|---|---|")
    for budget, t in rows:
        print(f"| {budget} | {t:.3f} | {tokens / t:,.0f} | {rows[0][1] / t:.2f}× |")


if __name__ == "__main__":
    main()
