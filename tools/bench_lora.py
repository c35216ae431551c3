"""What LoRA saves: the bytes and seconds of one weight update, the trainer's memory, and what each way
of serving the adapters costs a decode step.

One Qwen2-shaped model (default 48M parameters), a trainer engine on it with every weight trained and
one with LoRA adapters (training.lora) on every projection, and three embedded generation servers in
this process (one thread each, as a server on one core): one takes every weight, one the adapters as
low-rank paths (generation.lora_decode=lowrank), one merges them (lora_decode=merge). Per way,
alternated --repeats times, after one update each that is not timed (a merging server reads its base's
weights once, at its first update):
- the bytes an update carries (the directory the trainer writes: the weights, or the adapters alone);
- the trainer's save (`save_update`), the server's load (`/update_weights_from_disk`: copying the
  weights in, copying the adapters into the low-rank paths, or merging them into its fp32 base), and both;
- then, alternated again, each server's decode speed with what it loaded: --decode-rows answers of
  --decode-tokens tokens decoded together;
- the trainer's memory for training: parameters, gradients and AdamW's two moments (bytes of the
  tensors, after one train step).

    python tools/bench_lora.py [--hidden 512 --layers 4 --vocab 32000] [--rank 8] [--targets q_proj v_proj]
                               [--repeats 5] [--decode-rows 16 --decode-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from functools import partial

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from _bench import machine
from bench_weight_update import make_model
from areal_flow.algorithms.library import objective
from areal_flow.config.schema import AlgorithmConfig
from areal_flow.generation.client.generation_client import GenerationClient
from areal_flow.generation.http.server import serve
from areal_flow.training.engine import OptimSpec
from areal_flow.training.lora import LoraSpec
from areal_flow.training.torch_engine import TorchEngine

LOSS = partial(objective, algo=AlgorithmConfig(), prox_source="data", prox_version=0, kl_coef=0.0)


def train_once(engine: TorchEngine, vocab: int) -> None:
    rng = np.random.default_rng(0)
    seqs = [(rng.integers(0, vocab, 16), rng.integers(0, vocab, 32)) for _ in range(4)]
    data = {"prox_logprobs": [np.full(32, -10.0, np.float32)] * 4, "behav_logprobs": [np.full(32, -10.0, np.float32)] * 4,
            "advantages": [np.full(32, a, np.float32) for a in (1.0, -1.0, 0.5, -0.5)]}
    engine.train_step(seqs, data, LOSS)


def memory(engine: TorchEngine) -> dict[str, int]:
    """Bytes of the trainer's parameters, gradients and optimizer state."""
    params = list(engine.model.parameters())
    state = [t for s in engine._optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return {"params": sum(p.numel() * p.element_size() for p in params),
            "grads": sum(p.numel() * p.element_size() for p in params if p.grad is not None),
            "optimizer": sum(t.numel() * t.element_size() for t in state)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", nargs="+", default=list(LoraSpec(rank=1, alpha=1.0).target_modules),
                    help="the adapted Linear layers (training.lora.target_modules)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-rows", type=int, default=16, help="answers decoded together after each update")
    ap.add_argument("--decode-tokens", type=int, default=32, help="tokens of each answer")
    ap.add_argument("--work-dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    torch.set_num_threads(1)
    console = Console()
    root = tempfile.mkdtemp(prefix="areal_flow_bench_lora_", dir=args.work_dir)
    try:
        with console.status("building the model and the trainers"):
            make_model(args.hidden, args.layers, args.vocab, 0).save_pretrained(os.path.join(root, "base"))
            base = os.path.join(root, "base")
            torch.manual_seed(0)
            trainers = {"every weight": TorchEngine(base, optim=OptimSpec(lr=1e-4)),
                        f"LoRA r={args.rank}": TorchEngine(base, optim=OptimSpec(lr=1e-4),
                                                           lora=LoraSpec(rank=args.rank, alpha=2.0 * args.rank,
                                                                         target_modules=tuple(args.targets),
                                                                         init="gaussian"))}
            for engine in trainers.values():
                train_once(engine, args.vocab)
        lora = f"LoRA r={args.rank}"
        ways = {"every weight": ("every weight", "lowrank"), f"{lora}, low-rank path": (lora, "lowrank"),
                f"{lora}, merged": (lora, "merge")}  # way -> (its trainer, its server's lora_decode)
        servers = {way: serve(base, max_batch_size=args.decode_rows, num_threads=1, lora_decode=mode)
                   for way, (_, mode) in ways.items()}
        figures: dict[str, dict[str, list[float]]] = {way: {"bytes": [], "save": [], "load": [], "decode": []}
                                                      for way in ways}
        version = 0

        async def load(url: str, path: str, v: int) -> None:
            async with GenerationClient(url) as client:
                await client.update_weights_from_disk(path, v)

        def decode(server) -> float:
            """Tokens a second of --decode-rows answers decoded together."""
            rng = np.random.default_rng(0)
            t0 = time.perf_counter()
            futures = [server.engine.submit(rng.integers(2, args.vocab, 8).tolist(), max_new_tokens=args.decode_tokens,
                                            ignore_eos=True) for _ in range(args.decode_rows)]
            tokens = sum(len(f.result(timeout=600).output_ids) for f in futures)
            return tokens / (time.perf_counter() - t0)

        try:
            # The updates back to back, then the decoding: decoding between updates slows the next
            # save of every weight (0.22 s instead of 0.04 s here: the files' pages are written back
            # meanwhile), which would flatter LoRA's ratio.
            for repeat in range(args.repeats + 1):  # the first of each way untimed
                order = list(ways) if repeat % 2 == 0 else list(reversed(ways))
                for way in order:
                    version += 1
                    path = os.path.join(root, f"v{version}")
                    server = servers[way][0]
                    with console.status(f"update {version}: {way}"):
                        t0 = time.perf_counter()
                        trainers[ways[way][0]].save_update(path)
                        t1 = time.perf_counter()
                        asyncio.run(load(server.url, path, version))
                        t2 = time.perf_counter()
                    if repeat:
                        f = figures[way]
                        f["bytes"].append(sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)))
                        f["save"].append(t1 - t0)
                        f["load"].append(t2 - t1)
                    shutil.rmtree(path)
            for repeat in range(args.repeats + 1):
                for way in list(ways) if repeat % 2 == 0 else list(reversed(ways)):
                    with console.status(f"decoding: {way}"):
                        speed = decode(servers[way][0])
                    if repeat:
                        figures[way]["decode"].append(speed)
        finally:
            for server, thread in servers.values():
                server.stop()
                thread.join()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    params = sum(p.numel() for p in make_model(args.hidden, args.layers, args.vocab, 0).parameters())
    console.print(f"machine: {machine()}")
    console.print(f"command: python tools/bench_lora.py --hidden {args.hidden} --layers {args.layers} "
                  f"--vocab {args.vocab} --rank {args.rank} --targets {' '.join(args.targets)} --repeats {args.repeats} "
                  f"--decode-rows {args.decode_rows} --decode-tokens {args.decode_tokens}")
    table = Table(title=f"one weight update of a {params / 1e6:.1f}M-parameter model through the disk, server idle, "
                        f"then {args.decode_rows} answers decoded together (median of {args.repeats}, alternated)")
    for col in ("way", "bytes", "trainer saves s", "server loads s", "total s", "decode tokens/s",
                "trainer memory MiB (params + grads + AdamW)"):
        table.add_column(col, justify="left" if col == "way" else "right")
    med = {way: {k: statistics.median(v) for k, v in f.items()} for way, f in figures.items()}
    mem = {name: memory(engine) for name, engine in trainers.items()}
    for way, m in med.items():
        mm = mem[ways[way][0]]
        table.add_row(way, f"{m['bytes'] / 2**20:.2f} MiB", f"{m['save']:.4f}", f"{m['load']:.4f}",
                      f"{m['save'] + m['load']:.4f}", f"{m['decode']:.0f}",
                      f"{sum(mm.values()) / 2**20:.0f} ({mm['params'] / 2**20:.0f} + "
                      f"{mm['grads'] / 2**20:.1f} + {mm['optimizer'] / 2**20:.1f})")
    console.print(table)
    full = med["every weight"]
    for way, m in list(med.items())[1:]:
        console.print(f"{way} / every weight: bytes {m['bytes'] / full['bytes']:.2%}, update time "
                      f"{(m['save'] + m['load']) / (full['save'] + full['load']):.2%}, decode "
                      f"{m['decode'] / full['decode']:.2f}×")
    console.print(f"trainer memory, LoRA / every weight: {sum(mem[lora].values()) / sum(mem['every weight'].values()):.2%}")


if __name__ == "__main__":
    main()
