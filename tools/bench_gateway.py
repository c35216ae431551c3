"""What the agents' gateway costs a call: chat completions through it against the same calls sent
straight to the generation server, in one run.

`--agents` agents at once each make `--calls` calls (a prompt of about 60 tokens, `--max-tokens`
greedy tokens) with the official `openai` client, first straight to an embedded server, then
through the gateway (agents/gateway.py: routing, the call recorded into trajectories), alternated
`--repeats` times. A model of code_tiny's shape with random weights, one server thread.

    python tools/bench_gateway.py [--agents 16] [--calls 8] [--max-tokens 16]

Prints each side's mean seconds a call and calls/s, and the gateway's overhead a call.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

import torch
from rich.console import Console
from rich.table import Table
from transformers import Qwen2Config, Qwen2ForCausalLM

from areal_flow.agents.gateway import Gateway
from areal_flow.generation.router import ServerPool
from areal_flow.generation.server import serve
from areal_flow.models.tokenizer import CODE_CHARS, build_char_tokenizer


def build(path: str) -> None:
    tokenizer = build_char_tokenizer(CODE_CHARS, chat=True)
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    Qwen2ForCausalLM(config).save_pretrained(path)


async def agents(base_url, model: str, args: argparse.Namespace) -> float:
    """Seconds for every agent's calls; `base_url(i)` is agent i's."""
    import openai  # the dev extra's: not on the GPU image, whose checks import every tool

    async def one(i: int) -> None:
        client = openai.AsyncOpenAI(base_url=base_url(i), api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": f"Agent {i}: add the numbers 123 and 456, then explain."}]
        for _ in range(args.calls):
            answer = await client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens,
                                                          temperature=0)
            messages = messages[:1] + [{"role": "assistant", "content": answer.choices[0].message.content},
                                       {"role": "user", "content": "go on"}]
        await client.close()

    started = time.perf_counter()
    await asyncio.gather(*[one(i) for i in range(args.agents)])
    return time.perf_counter() - started


async def bench(url: str, model: str, args: argparse.Namespace) -> list[tuple[str, float]]:
    async with ServerPool([url]) as pool:
        gateway = Gateway(pool)
        await gateway.start()
        try:
            await agents(lambda i: f"{url}/v1", model, args)  # warm both paths up
            out = []
            for _ in range(args.repeats):
                out.append(("straight to the server", await agents(lambda i: f"{url}/v1", model, args)))
                out.append(("through the gateway", await agents(lambda i: gateway.base_url(f"a{i}"), model, args)))
            return out
        finally:
            await gateway.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--agents", type=int, default=16)
    ap.add_argument("--calls", type=int, default=8, help="calls an agent makes, one after another")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    console = Console(width=120)
    with tempfile.TemporaryDirectory() as path:
        build(path)
        server, thread = serve(path, num_threads=1)
        try:
            with console.status("agents calling ..."):
                results = asyncio.run(bench(server.url, path, args))
        finally:
            server.stop()
            thread.join()
    calls = args.agents * args.calls
    table = Table(title=f"{args.agents} agents × {args.calls} calls of {args.max_tokens} tokens, one server thread")
    for column in ("path", "seconds", "calls/s", "ms a call (mean over agents)"):
        table.add_column(column)
    means = {}
    for name, seconds in results:
        table.add_row(name, f"{seconds:.2f}", f"{calls / seconds:.1f}", f"{1000 * seconds / args.calls:.1f}")
        means.setdefault(name, []).append(seconds)
    console.print(table)
    direct, gated = (sum(means[k]) / len(means[k]) for k in ("straight to the server", "through the gateway"))
    console.print(f"gateway overhead: {100 * (gated / direct - 1):+.1f}% a call "
                  f"({1000 * (gated - direct) / args.calls:.1f} ms a call of an agent)")


if __name__ == "__main__":
    main()
