"""What a weight update costs: the trainer's wait, and the time to the first token of the new weights.

Two parts, on one embedded generation server in this process (one thread, as a server on one core):

1. Handing over the weights, with the server idle: the trainer's engine writes a Hugging Face
   directory (`TorchEngine.save_weights`, which writes through `save_pretrained` once and the same
   files directly after that; `save_pretrained` alone is timed beside it) and the server loads it
   (`/update_weights_from_disk`), once on the disk (a directory under --work-dir) and once in shared
   memory (/dev/shm, a RAM file system: SGLang's same endpoint, no disk). Median of --repeats.
2. Updating while --requests answers are being generated (the rollout worker's loop, which resubmits
   aborted answers): the three ways the publisher can do it:
   - drain:   `/update_weights_from_disk` alone: waits until the running answers finish;
   - abort:   pause → update with abort_all_requests → continue (AReaL): answers come back aborted and
              are resubmitted with their tokens so far;
   - retract: pause(mode=retract) → update → continue (SGLang's retract): the server requeues the
              running answers itself and prefills them again under the new weights.
   For each: the trainer's wait (the update sequence, start to return), the time from the start to the
   end of the first forward under the new weights (a new request is sent as soon as the update
   returns, as a rollout worker would), and until every answer is done.

    python tools/bench_weight_update.py [--hidden 512 --layers 4] [--requests 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time

import torch
from rich.console import Console
from rich.table import Table
from transformers import Qwen2Config, Qwen2ForCausalLM

from _bench import machine
from areal_flow.generation.client.generation_client import GenerationClient
from areal_flow.generation.client.router import ServerPool
from areal_flow.generation.http.server import GenerationServer, serve
from areal_flow.rollout.requests import generate_sample
from areal_flow.training.engine import OptimSpec
from areal_flow.training.torch_engine import TorchEngine

SHM = "/dev/shm"


def make_model(hidden: int, layers: int, vocab: int, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 4,
                         num_hidden_layers=layers, num_attention_heads=max(hidden // 64, 1),
                         num_key_value_heads=max(hidden // 256, 1), max_position_embeddings=4096,
                         tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).eval()


def hand_over(server: GenerationServer, engine: TorchEngine, root: str, repeats: int, version: int
              ) -> tuple[float, float, float, int]:
    """Median seconds for the trainer's engine to save the weights under `root`, for
    `save_pretrained` to save them, and for the idle server to load them."""
    saves, pretrained, loads = [], [], []

    async def load(path: str, v: int) -> None:
        async with GenerationClient(server.url) as client:
            await client.update_weights_from_disk(path, v)

    engine.save_weights(os.path.join(root, "first"))  # the one call that goes through save_pretrained
    shutil.rmtree(os.path.join(root, "first"))
    for i in range(repeats):
        path = os.path.join(root, f"v{version + i}")
        t0 = time.perf_counter()
        engine.model.save_pretrained(path)
        pretrained.append(time.perf_counter() - t0)
        shutil.rmtree(path)
        t0 = time.perf_counter()
        engine.save_weights(path)
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        asyncio.run(load(path, version + i))
        loads.append(time.perf_counter() - t0)
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        shutil.rmtree(path)
    return statistics.median(saves), statistics.median(pretrained), statistics.median(loads), size


async def update_in_flight(server: GenerationServer, path: str, version: int, mode: str, requests: int,
                           max_new_tokens: int) -> dict[str, float]:
    first_new: list[float] = []

    def after_forward(*_: object) -> None:
        if not first_new and server.engine.version == version:
            first_new.append(time.perf_counter())

    # The output layer ends every forward, prefill or decode step (which bypasses the model's own forward).
    hook = server.engine.model.get_output_embeddings().register_forward_hook(after_forward)
    params = {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True}
    try:
        async with ServerPool([server.url]) as pool, GenerationClient(server.url) as admin:
            answers = [asyncio.create_task(generate_sample(pool, [3, 4, 5, 6 + i % 5], params, f"{mode}-{i}", mode))
                       for i in range(requests)]
            start_tokens = server.engine.stats()["generated_tokens"]
            while server.engine.stats()["generated_tokens"] < start_tokens + requests * max_new_tokens // 4:
                await asyncio.sleep(0.005)  # a quarter of the way in
            t0 = time.perf_counter()
            if mode == "drain":
                await admin.update_weights_from_disk(path, version)
            else:
                await admin.pause_generation(mode=mode)
                await admin.update_weights_from_disk(path, version, abort_all_requests=mode == "abort")
                await admin.continue_generation()
            waited = time.perf_counter() - t0
            # The next request a rollout worker sends: under drain, the first work of the new weights.
            answers.append(asyncio.create_task(generate_sample(pool, [3, 4, 5], params, f"{mode}-next", mode)))
            outs = await asyncio.gather(*answers)
            done = time.perf_counter() - t0
    finally:
        hook.remove()
    assert all(len(o["output_ids"]) == max_new_tokens for o in outs)  # nothing lost, nothing duplicated
    new_tokens = sum(o["versions"].count(version) for o in outs[:-1])
    return {"wait": waited, "first": first_new[0] - t0, "done": done, "new_share": new_tokens / (requests * max_new_tokens)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work-dir", default=tempfile.gettempdir(), help="the disk side of part 1")
    args = ap.parse_args()
    torch.set_num_threads(1)
    console = Console()
    disk = tempfile.mkdtemp(prefix="areal_flow_bench_", dir=args.work_dir)
    shm = tempfile.mkdtemp(prefix="areal_flow_bench_", dir=SHM)
    try:
        with console.status("building the models"):
            start, new = make_model(args.hidden, args.layers, args.vocab, 0), make_model(args.hidden, args.layers,
                                                                                      args.vocab, 1)
            start.save_pretrained(os.path.join(disk, "start"))
            new.save_pretrained(os.path.join(shm, "new"))
            trainer = TorchEngine(os.path.join(shm, "new"), optim=OptimSpec(lr=1e-4))
        params = sum(p.numel() for p in start.parameters())
        server, thread = serve(os.path.join(disk, "start"), max_batch_size=64, num_threads=1)
        try:
            transfer = {}
            for name, root in (("disk", disk), ("shared memory", shm)):
                with console.status(f"handing over through {name}"):
                    transfer[name] = hand_over(server, trainer, root, args.repeats, 100 if name == "disk" else 200)
            runs = {}
            for i, mode in enumerate(("drain", "abort", "retract")):
                with console.status(f"updating with {args.requests} answers in flight: {mode}"):
                    runs[mode] = asyncio.run(update_in_flight(server, os.path.join(shm, "new"), 300 + i, mode,
                                                              args.requests, args.max_new_tokens))
        finally:
            server.stop()
            thread.join()
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)

    console.print(f"machine: {machine()}")
    console.print(f"command: python tools/bench_weight_update.py --hidden {args.hidden} --layers {args.layers} "
                  f"--vocab {args.vocab} --requests {args.requests} --max-new-tokens {args.max_new_tokens} "
                  f"--repeats {args.repeats}")
    size = next(iter(transfer.values()))[3]
    table = Table(title=f"1. handing over {params / 1e6:.1f}M parameters ({size / 2**20:.0f} MiB safetensors), server idle")
    for col in ("through", "trainer saves s", "save_pretrained s", "server loads s", "total s"):
        table.add_column(col, justify="left" if col == "through" else "right")
    for name, (save, pretrained, load, _) in transfer.items():
        table.add_row(name, f"{save:.4f}", f"{pretrained:.4f}", f"{load:.4f}", f"{save + load:.4f}")
    console.print(table)
    for name, (save, pretrained, _, _) in transfer.items():
        console.print(f"{name}: the trainer's save {pretrained / save:.2f}× faster than save_pretrained")
    disk_total, shm_total = (transfer[n][0] + transfer[n][2] for n in ("disk", "shared memory"))
    console.print(f"shared memory vs disk: {disk_total / shm_total:.2f}× faster hand-over")

    table = Table(title=f"2. an update with {args.requests} answers of {args.max_new_tokens} tokens in flight "
                        "(a quarter generated)")
    for col in ("publisher", "trainer waits s", "first new-weights forward s", "all answers done s",
                "tokens on new weights"):
        table.add_column(col, justify="left" if col == "publisher" else "right")
    for mode, r in runs.items():
        table.add_row(mode, f"{r['wait']:.3f}", f"{r['first']:.3f}", f"{r['done']:.2f}", f"{r['new_share']:.0%}")
    console.print(table)
    console.print(f"trainer wait, drain vs retract: {runs['drain']['wait'] / runs['retract']['wait']:.1f}×; "
                  f"retract vs abort, all answers done: {runs['abort']['done'] / runs['retract']['done']:.2f}×")


if __name__ == "__main__":
    main()
