"""Training engines against a plain Hugging Face step, in one run: logprob forward and train step
of (1) the HF model on unpacked rows of equal length (the baseline: no padding, flash sdpa, bf16
autocast over fp32 weights, fused AdamW), (2) the torch engine on packed long-tail sequences and
(3) the megatron engine on the same packed sequences, for each model shape. Prints tokens/s, MFU,
peak memory and each engine's ratio to the baseline.

    python tools/bench_engine.py [--shapes 0.5b 1.5b] [--tokens 32768] [--micro-batch-tokens 16384]

Every side runs the same number of tokens per micro-batch and per step. Models are Qwen2-shaped,
built from a config with random weights (no hub). MFU counts 2·N FLOPs a token forward and 6·N
forward + backward, N = the parameters that multiply (every weight but the embedding table, plus
the LM head, which a tied model shares with it), against the GPU's dense bf16 peak
(--peak-tflops; H100 SXM: 989); attention's own FLOPs are not counted. On a machine without a GPU
`--device cpu --shapes tiny` runs the same code on a small model (the suite's test of this script):
there MFU and peak memory are not measured.

`--profile` also runs one more train step of each engine under torch.profiler and prints its top
ops by device time (CPU time on the CPU), the device's busy time against the step's wall time (far
below it: the host is what the GPU waits for), and the step's host synchronisations, counted by
`torch.cuda.set_sync_debug_mode` on CUDA (on the CPU: the host's reads of tensor values, the
synchronisations they would be on a GPU), with the lines that made the most.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import transformers

from _bench import machine
from areal_flow.runtime.devices import TRAINER_BACKENDS
from areal_flow.training.engine import OptimSpec
from areal_flow.training.host_syncs import count_cuda_syncs, count_host_reads
from areal_flow.training.torch_engine import TorchEngine

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}
ENGINES = ("hf", "torch", "megatron")


@dataclass
class Row:
    shape: str
    engine: str
    what: str  # logprobs | train step
    tokens_per_s: float
    mfu: float | None
    peak_gib: float | None


def long_tail_batch(total_tokens: int, vocab: int, max_len: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Prompts of 64-512 tokens and answers from a long-tailed distribution (most short, a few at
    the limit), as reasoning rollouts are, until `total_tokens`; no sequence longer than `max_len`."""
    rng = np.random.default_rng(seed)
    seqs, n = [], 0
    while n < total_tokens:
        prompt = int(rng.integers(64, 513))
        answer = int(min(max_len - prompt, 4096, 64 + rng.exponential(700)))
        seqs.append((rng.integers(0, vocab, prompt), rng.integers(0, vocab, answer)))
        n += prompt + answer
    return seqs


def loss_fn(logprobs, batch, mask, n_valid_tokens):
    return -(logprobs * batch["advantages"] * mask).sum() / n_valid_tokens, {}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median seconds of `repeats` calls, after one warm-up call (compilation, allocator)."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class HFBaseline:
    """The plain step: a transformers model on [rows, row_length] with no packing and no padding,
    micro-batched by the same token budget, logprobs by gather - logsumexp over the logits."""

    def __init__(self, path: str, device: torch.device, micro_batch_tokens: int, row_length: int):
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                       attn_implementation="sdpa").to(device)
        self.model.eval()
        self.device = device
        self.rows_per_micro_batch = max(1, micro_batch_tokens // row_length)
        self.row_length = row_length
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-6, fused=True)

    def rows(self, seqs) -> torch.Tensor:
        """The batch's tokens as full rows of row_length (the last partial row dropped)."""
        stream = np.concatenate([np.concatenate([p, o]) for p, o in seqs])
        n = len(stream) // self.row_length
        return torch.as_tensor(stream[: n * self.row_length].reshape(n, self.row_length), device=self.device)

    def _logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = self.model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        return logits.gather(-1, ids[:, 1:, None])[..., 0] - torch.logsumexp(logits, dim=-1)

    def logprobs(self, ids: torch.Tensor) -> None:
        with torch.no_grad():
            for mb in ids.split(self.rows_per_micro_batch):
                self._logprobs(mb)

    def train_step(self, ids: torch.Tensor) -> None:
        n = ids[:, 1:].numel()
        for mb in ids.split(self.rows_per_micro_batch):
            (-self._logprobs(mb).sum() / n).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def multiplying_parameters(config: transformers.PretrainedConfig) -> int:
    """N of the MFU: every weight of the layers and the final norm, plus the LM head (V·H)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    return body + config.vocab_size * config.hidden_size


@contextlib.contextmanager
def one_rank_group(device: torch.device):
    """A process group of this process alone, which megatron's parallel state needs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The trainers' own backends: megatron sums its token counts over CPU tensors (gloo) on CUDA too.
    dist.init_process_group(TRAINER_BACKENDS[device.type], init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def profile_report(title: str, step: Callable[[], object], device: torch.device, top: int = 15) -> str:
    """One step's synchronisations, then one step under torch.profiler: its top ops and the
    device's busy share of the wall time. Runs after the timed steps (warm)."""
    cuda = device.type == "cuda"
    if cuda:
        with count_cuda_syncs() as where:
            step()
        syncs, how = sum(where.values()), "synchronisations (torch.cuda sync debug mode)"
    else:
        with count_host_reads() as reads:
            step()
        where, syncs = reads.by_module, reads.total
        how = "host reads of tensor values (synchronisations on a GPU)"
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        step()
        synchronize(device)
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    busy = sum(getattr(e, key) for e in events) / 1e6  # microseconds
    if cuda:
        share = busy / wall
        verdict = "device-bound" if share > 0.9 else "host-bound: the GPU waits for launches or synchronisations"
        busy_line = f"CUDA kernels {1000 * busy:.1f} ms = {100 * share:.0f}% of wall ({verdict})"
    else:
        busy_line = f"CPU time in ops {1000 * busy:.1f} ms = {100 * busy / wall:.0f}% of wall (the rest: Python)"
    lines = [f"### profile: {title}", f"wall {1000 * wall:.1f} ms (under the profiler); {busy_line}",
             f"{syncs} {how} in one step; most: "
             + (", ".join(f"{k} x{n}" for k, n in where.most_common(5)) or "none"),
             events.table(sort_by=key, row_limit=top)]
    return "\n".join(lines)


def make_engine(name: str, path: str, args: argparse.Namespace, device: torch.device):
    bf16 = device.type == "cuda"
    optim = OptimSpec(lr=1e-6)
    if name == "hf":
        return HFBaseline(path, device, args.micro_batch_tokens, args.row_length)
    if name == "torch":
        return TorchEngine(path, optim=optim, micro_batch_tokens=args.micro_batch_tokens, device=str(device),
                           bf16=bf16, attention=args.attention,
                           activation_checkpointing=args.activation_checkpointing)
    from areal_flow.training.megatron.engine import MegatronEngine  # imports megatron-core (seconds)

    return MegatronEngine(path, optim=optim, micro_batch_tokens=args.micro_batch_tokens, device=str(device),
                          bf16=bf16, attention=args.attention, activation_checkpointing=args.activation_checkpointing)


def measure(shape: str, name: str, path: str, seqs, data, args, device: torch.device, n_params: int) -> list[Row]:
    engine = make_engine(name, path, args, device)
    if name == "hf":
        ids = engine.rows(seqs)
        tokens = ids.numel()
        forward, step = (lambda: engine.logprobs(ids)), (lambda: engine.train_step(ids))
    else:
        tokens = sum(len(p) + len(o) for p, o in seqs)
        forward, step = (lambda: engine.logprobs(seqs)), (lambda: engine.train_step(seqs, data, loss_fn))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    rows = []
    for what, fn, flops in (("logprobs", forward, 2), ("train step", step, 6)):
        tps = tokens / timed(fn, args.repeats, device)
        mfu = flops * n_params * tps / 1e12 / args.peak_tflops if device.type == "cuda" else None
        rows.append(Row(shape, name, what, tps, mfu, None))
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        for row in rows:
            row.peak_gib = peak
    if args.profile:  # after the peak is read: the profiler's own memory is not the engine's
        print(profile_report(f"{shape} {name} train step", step, device, args.profile_top), flush=True)
    return rows  # the engine goes with this frame: the caller then frees its memory


def table(rows: list[Row]) -> str:
    base = {(r.shape, r.what): r.tokens_per_s for r in rows if r.engine == "hf"}
    lines = ["| shape | engine | pass | tokens/s | vs hf | MFU | peak GiB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r.tokens_per_s / base[(r.shape, r.what)]:.2f}" if (r.shape, r.what) in base else "—"
        mfu = "—" if r.mfu is None else f"{100 * r.mfu:.1f}%"
        peak = "—" if r.peak_gib is None else f"{r.peak_gib:.1f}"
        lines.append(f"| {r.shape} | {r.engine} | {r.what} | {r.tokens_per_s:,.0f} | {ratio} | {mfu} | {peak} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["0.5b", "1.5b"])
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per batch (one train step)")
    ap.add_argument("--micro-batch-tokens", type=int, default=16384, help="tokens per micro-batch, every engine")
    ap.add_argument("--row-length", type=int, default=2048, help="the baseline's unpacked row length")
    ap.add_argument("--attention", default="auto", help="the engines' attention (auto | varlen | flex | sdpa)")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--profile", action="store_true",
                    help="also profile one train step of each engine: top ops, device busy vs wall, synchronisations")
    ap.add_argument("--profile-top", type=int, default=15, help="ops listed per profiled step")
    args = ap.parse_args()
    device = torch.device(args.device)
    if not args.row_length <= args.micro_batch_tokens <= args.tokens:
        raise SystemExit(f"bench_engine: needs --row-length ({args.row_length}) <= --micro-batch-tokens "
                         f"({args.micro_batch_tokens}) <= --tokens ({args.tokens})")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_engine: --device cuda, but torch sees no CUDA device here (use --device cpu --shapes tiny)")
    rows: list[Row] = []
    group = one_rank_group(device) if "megatron" in args.engines else contextlib.nullcontext()
    with group, tempfile.TemporaryDirectory() as root:
        for shape in args.shapes:
            torch.manual_seed(0)
            config = transformers.Qwen2Config(**SHAPES[shape], max_position_embeddings=8192)
            path = f"{root}/{shape}"
            transformers.Qwen2ForCausalLM(config).save_pretrained(path)
            seqs = long_tail_batch(args.tokens, config.vocab_size, min(args.micro_batch_tokens, 4096 + 512))
            data = {"advantages": [np.ones(len(o), np.float32) for _, o in seqs]}
            n_params = multiplying_parameters(config)
            for name in args.engines:
                rows += measure(shape, name, path, seqs, data, args, device, n_params)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                print(f"done: {shape} {name}", flush=True)
    print(f"\nmachine: {machine()}")
    print(f"command: python tools/bench_engine.py --device {device.type} --shapes {' '.join(args.shapes)} "
          f"--engines {' '.join(args.engines)} --tokens {args.tokens} --micro-batch-tokens {args.micro_batch_tokens} "
          f"--row-length {args.row_length} --attention {args.attention}"
          + (" --activation-checkpointing" if args.activation_checkpointing else "")
          + (" --profile" if args.profile else ""))
    print(f"bf16 compute over fp32 master weights: {device.type == 'cuda'}; packed engines: long-tail sequences "
          f"under {args.micro_batch_tokens} tokens a micro-batch; hf: rows of {args.row_length}\n")
    print(table(rows))


if __name__ == "__main__":
    main()
