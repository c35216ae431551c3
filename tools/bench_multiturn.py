"""The embedded engine on multi-turn rollouts: with its prefix cache against without, in one run.

Trajectories take `--turns` turns: each turn decodes a quarter to all of `--new-tokens` tokens
(drawn per turn), then the next turn's prompt is the whole history (prompt, every answer, every
observation) plus an observation of `--observation-tokens` tokens, sent as a new request, as the
rollout worker sends a multi-turn trajectory (rollout/turns.py). `--trajectories` in all, groups
of `--group` sharing a prompt, `--concurrent` groups at once: a group starts when one ends, so
the batch mixes trajectories at every turn, as in a run. A model of code_tiny's shape (hidden 192,
4 layers, 768 positions) with random weights decodes greedily, ignoring EOS, on one thread.

    python tools/bench_multiturn.py [--trajectories 64] [--turns 3]

Prints each setting's tokens/s, its prefill and cached tokens, and the ratio to the first (no
prefix cache: the engine before it); the last two settings differ in the decode attention alone
(torch's matmuls over a gathered copy of each row's context, or the C kernel reading the paged cache
in place). `--repeats` runs the settings again, alternating.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import threading
import time
from concurrent.futures import Future

import torch
from rich.console import Console
from rich.table import Table
from transformers import Qwen2Config, Qwen2ForCausalLM

from areal_flow.generation.engine.generation_engine import GenerationEngine, GenerationRequest, SamplingParams

# (name, engine keywords, environment): the first is the engine before the prefix cache; the last
# two differ in the decode attention only (AREAL_FLOW_CPU_KERNEL=0: torch's matmuls over each row's
# gathered context instead of the C kernel reading the paged cache in place, cpu_decode.py).
SETTINGS = (("no prefix cache, gathered attention", dict(prefix_cache=False), {"AREAL_FLOW_CPU_KERNEL": "0"}),
            ("prefix cache, gathered attention", dict(prefix_cache=True), {"AREAL_FLOW_CPU_KERNEL": "0"}),
            ("prefix cache, in-place attention", dict(prefix_cache=True), {"AREAL_FLOW_CPU_KERNEL": "1"}))


def build_model(path: str, context: int) -> None:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=101, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=context,
                         tie_word_embeddings=True, eos_token_id=1)
    Qwen2ForCausalLM(config).eval().save_pretrained(path)


def run(path: str, args: argparse.Namespace, **engine_kw) -> dict[str, float]:
    """Every trajectory to its last turn; the wall time and the engine's token counts."""
    engine = GenerationEngine(path, max_batch_size=128, num_threads=1, **engine_kw)
    rng = random.Random(args.seed)
    done, lock = threading.Event(), threading.Lock()
    groups = args.trajectories // args.group
    state = {"started": 0, "left": groups * args.group, "group_left": {}, "decoded": 0}

    def turn(history: tuple[int, ...], k: int, group: int) -> None:
        with lock:
            params = SamplingParams(max_new_tokens=rng.randint(args.new_tokens // 4, args.new_tokens),
                                    ignore_eos=True, temperature=0.0)
        future: Future = engine.submit_many([GenerationRequest(history, params)])[0]
        future.add_done_callback(lambda f: after(history + tuple(f.result().output_ids), k, group))

    def start_group() -> None:  # caller holds the lock
        group, state["started"] = state["started"], state["started"] + 1
        state["group_left"][group] = args.group
        prompt = tuple(rng.randrange(2, 101) for _ in range(args.prompt_tokens))
        for _ in range(args.group):
            threading.Thread(target=turn, args=(prompt, 0, group)).start()

    def after(history: tuple[int, ...], k: int, group: int) -> None:
        with lock:
            state["decoded"] += 1
            if k + 1 < args.turns:
                observation = tuple(rng.randrange(2, 101) for _ in range(args.observation_tokens))
            else:
                state["left"] -= 1
                state["group_left"][group] -= 1
                if state["group_left"][group] == 0 and state["started"] < groups:
                    start_group()
                if state["left"] == 0:
                    done.set()
                return
        turn(history + observation, k + 1, group)

    try:
        started = time.perf_counter()
        with lock:
            for _ in range(min(args.concurrent, groups)):
                start_group()
        if not done.wait(timeout=1800):
            raise TimeoutError("the trajectories did not finish in 30 minutes")
        seconds = time.perf_counter() - started
        stats = engine.stats()
    finally:
        engine.shutdown()
    return {"seconds": seconds, "tokens": stats["generated_tokens"], "prefill": stats["prefill_tokens"],
            "cached": stats["cached_tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trajectories", type=int, default=256)
    ap.add_argument("--group", type=int, default=8, help="trajectories sharing a prompt")
    ap.add_argument("--concurrent", type=int, default=12, help="groups generating at once")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=80)
    ap.add_argument("--new-tokens", type=int, default=100, help="tokens a turn decodes")
    ap.add_argument("--observation-tokens", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each setting, alternated")
    args = ap.parse_args()
    console = Console(width=120)
    context = args.prompt_tokens + args.turns * (args.new_tokens + args.observation_tokens)
    with tempfile.TemporaryDirectory() as path:
        build_model(path, context)
        results = []
        for repeat in range(args.repeats):
            for name, kw, env in SETTINGS:
                with console.status(f"{name} (run {repeat + 1} of {args.repeats}) ..."):
                    os.environ.update(env)  # read when the engine builds its decode step
                    results.append((name, run(path, args, **kw)))
    table = Table(title=f"{args.trajectories} trajectories ({args.concurrent} groups of {args.group} at once) × "
                        f"{args.turns} turns × up to {args.new_tokens} tokens (prompt {args.prompt_tokens}, "
                        f"observations {args.observation_tokens})")
    for column in ("setting", "seconds", "decoded tokens/s", "prefilled tokens", "cached tokens", "× first"):
        table.add_column(column)
    base = results[0][1]["tokens"] / results[0][1]["seconds"]
    for name, r in results:
        rate = r["tokens"] / r["seconds"]
        table.add_row(name, f"{r['seconds']:.1f}", f"{rate:.0f}", f"{r['prefill']:.0f}", f"{r['cached']:.0f}",
                      f"{rate / base:.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
