"""Weight transfer, trainer to generation servers: through disk, by broadcast over gloo, by handle.

A Qwen2-shaped set of weights (random values, Hugging Face names; `--shape 0.5b` is Qwen2-0.5B's,
494M parameters) is handed from this process, standing as trainer rank 0, to embedded generation
servers running as processes of their own (one torch thread each), in each `--dtypes` and to each
number of `--servers`:

- disk (`rollout.weight_update_mode: disk`): the trainer writes model.safetensors under
  --work-dir, then every server loads it (`/update_weights_from_disk`, all at once). The load reads
  the file the trainer has just written, from the page cache, as in a run.
- broadcast (`rollout.weight_update_mode: distributed`): the trainer sends the weights in buckets
  of --bucket-mb over a gloo group with every server (`/update_weights_from_distributed` per
  bucket, then the broadcast); the group is made once, before the timings (its cost is printed).
- ipc (`rollout.weight_update_mode: ipc`, for colocated servers): the trainer posts handles to its
  own tensors per bucket (`/update_weights_from_tensor`: shared-memory files on the CPU, CUDA IPC
  handles on a GPU) and every server copies them straight from its memory.

Each time is from the first byte written or sent until every server has the weights in its model;
best of --repeats (the disk side's save and load are those of its best total). GB/s is the size of the weights over that time (every server gets all of them).
After each dtype, one greedy answer from every server must be the same after each way (the same
weights came through all three).

    python tools/bench_weight_transfer.py [--shape 0.5b|small] [--dtypes bf16 fp32] [--servers 1 2]
                                          [--bucket-mb 512] [--repeats 3] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from safetensors.torch import save_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from _bench import machine
from areal_flow.generation.client.generation_client import GenerationClient, wait_healthy
from areal_flow.runtime.ports import free_ports
from areal_flow.training.engine import bucketed
from areal_flow.weights.ipc import IpcSender
from areal_flow.weights.sender import Server, WeightSender

SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "small": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=False),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PROMPT = [11, 12, 13, 14]


def random_weights(config: Qwen2Config) -> dict[str, torch.Tensor]:
    """fp32 weights of every parameter (a tied output layer once), as the trainer exports them."""
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Qwen2ForCausalLM(config).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    return {name: torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.02
            for name, shape in shapes.items()}


def write(state: dict[str, torch.Tensor], config: Qwen2Config, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)


async def load_everywhere(urls: list[str], path: str, version: int) -> None:
    async def one(url: str) -> None:
        async with GenerationClient(url) as client:
            await client.update_weights_from_disk(path, version)

    await asyncio.gather(*[one(url) for url in urls])


async def greedy_answers(urls: list[str]) -> list[list[int]]:
    async def one(url: str) -> list[int]:
        async with GenerationClient(url) as client:
            answer = await client.generate(PROMPT, {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
            return answer["output_ids"]

    return list(await asyncio.gather(*[one(url) for url in urls]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    ap.add_argument("--servers", nargs="+", type=int, default=[1, 2], help="numbers of servers to send to")
    ap.add_argument("--bucket-mb", type=int, default=512, help="rollout.weight_bucket_mb")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work-dir", default=tempfile.gettempdir(), help="where the disk side writes")
    args = ap.parse_args()
    torch.set_num_threads(1)
    console = Console(width=150)
    config = Qwen2Config(**SHAPES[args.shape], max_position_embeddings=4096)
    work = Path(tempfile.mkdtemp(prefix="areal_flow_bench_", dir=args.work_dir))
    procs: list[subprocess.Popen] = []
    results: dict[tuple[str, int], dict[str, float]] = {}
    try:
        with console.status(f"writing the {args.shape} start weights and starting {max(args.servers)} server(s)"):
            state = random_weights(config)
            n_params = sum(t.numel() for t in state.values())
            write(state, config, work / "start")
            ports = free_ports(max(args.servers))
            for i, port in enumerate(ports):
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "areal_flow.generation.server", "--model-path", str(work / "start"),
                     "--port", str(port), "--num-threads", "1", "--max-batch-size", "4", "--weight-version", "0",
                     "--log-level", "WARNING"], stdout=subprocess.DEVNULL, stderr=open(work / f"server{i}.log", "w")))
            urls = [f"http://127.0.0.1:{port}" for port in ports]
            for url in urls:
                wait_healthy(url, timeout=600)
        senders, connect_seconds = {}, {}
        for n in args.servers:
            t0 = time.perf_counter()
            senders[n] = WeightSender([Server(f"gen_server{i}", url) for i, url in enumerate(urls[:n])],
                                      group_name=f"bench_{n}_servers", timeout=600)
            senders[n].connect()
            connect_seconds[n] = time.perf_counter() - t0
        version = 0
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("transfers", total=len(args.dtypes) * len(args.servers) * 3 * args.repeats)
            for dtype_name in args.dtypes:
                weights = {name: t.to(DTYPES[dtype_name]) for name, t in state.items()}
                size = sum(t.numel() * t.element_size() for t in weights.values())
                answers = {}
                for n in args.servers:
                    times = {"save": [], "load": [], "disk": [], "broadcast": [], "ipc": []}
                    ipc = IpcSender([Server(f"gen_server{i}", url) for i, url in enumerate(urls[:n])], timeout=600)
                    for _ in range(args.repeats):
                        progress.update(task, description=f"{dtype_name}, {n} server(s): disk")
                        version += 1
                        path = work / f"v{version}"
                        t0 = time.perf_counter()
                        write(weights, config, path)
                        t1 = time.perf_counter()
                        asyncio.run(load_everywhere(urls[:n], str(path), version))
                        t2 = time.perf_counter()
                        shutil.rmtree(path)
                        times["save"].append(t1 - t0)
                        times["load"].append(t2 - t1)
                        times["disk"].append(t2 - t0)
                        progress.advance(task)
                        answers["disk"] = asyncio.run(greedy_answers(urls[:n]))

                        progress.update(task, description=f"{dtype_name}, {n} server(s): broadcast")
                        version += 1
                        t0 = time.perf_counter()
                        report = senders[n].send(bucketed(iter(weights.items()), args.bucket_mb << 20), version)
                        times["broadcast"].append(time.perf_counter() - t0)
                        progress.advance(task)
                        answers["broadcast"] = asyncio.run(greedy_answers(urls[:n]))

                        progress.update(task, description=f"{dtype_name}, {n} server(s): ipc")
                        version += 1
                        t0 = time.perf_counter()
                        ipc.send(bucketed(iter(weights.items()), args.bucket_mb << 20), version)
                        times["ipc"].append(time.perf_counter() - t0)
                        progress.advance(task)
                        answers["ipc"] = asyncio.run(greedy_answers(urls[:n]))
                        if not answers["disk"] == answers["broadcast"] == answers["ipc"]:
                            raise SystemExit(f"{dtype_name}, {n} server(s): greedy answers differ after disk, "
                                             f"broadcast and ipc: {answers}")
                    best = min(range(args.repeats), key=lambda i: times["disk"][i])  # its save and load
                    results[(dtype_name, n)] = {"save": times["save"][best], "load": times["load"][best],
                                                "disk": times["disk"][best], "broadcast": min(times["broadcast"]),
                                                "ipc": min(times["ipc"]),
                                                "bytes": size, "buckets": report.buckets}
        for sender in senders.values():
            sender.close()
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)
        shutil.rmtree(work, ignore_errors=True)

    console.print(f"machine: {machine()}")
    console.print(f"command: python tools/bench_weight_transfer.py --shape {args.shape} --dtypes {' '.join(args.dtypes)} "
                  f"--servers {' '.join(map(str, args.servers))} --bucket-mb {args.bucket_mb} --repeats {args.repeats}")
    console.print("making the gloo group once: " + ", ".join(f"{n} server(s) {s:.2f} s" for n, s in
                                                             connect_seconds.items()))
    table = Table(title=f"{args.shape}: {n_params / 1e6:.0f}M parameters to embedded servers, best of {args.repeats}")
    for col in ("dtype", "servers", "GB", "disk: save s", "load s", "total s", "GB/s", "broadcast s",
                "buckets", "GB/s", "broadcast vs disk", "ipc s", "GB/s", "ipc vs disk"):
        table.add_column(col, justify="left" if col == "dtype" else "right")
    for (dtype_name, n), r in results.items():
        gb = r["bytes"] / 1e9
        table.add_row(dtype_name, str(n), f"{gb:.2f}", f"{r['save']:.2f}", f"{r['load']:.2f}", f"{r['disk']:.2f}",
                      f"{gb / r['disk']:.2f}", f"{r['broadcast']:.2f}", str(r["buckets"]), f"{gb / r['broadcast']:.2f}",
                      f"{r['disk'] / r['broadcast']:.2f}×", f"{r['ipc']:.2f}", f"{gb / r['ipc']:.2f}",
                      f"{r['disk'] / r['ipc']:.2f}×")
    console.print(table)


if __name__ == "__main__":
    main()
