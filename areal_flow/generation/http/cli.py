"""The command line of a generation server, `python -m areal_flow.generation.server`: SGLang's
flags where SGLang has one (the embedded engine's settings: engine/options.py), then serve until
SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import faulthandler
import gc
import logging
import os
import signal
import threading
from typing import Any

from areal_flow.generation import tool_parsers
from areal_flow.generation.engine.options import LORA_DECODE
from areal_flow.generation.http import bodies
from areal_flow.generation.http.server import serve
from areal_flow.runtime.devices import DTYPES, compute_dtype, local_device
from areal_flow.runtime.security import API_KEY_ENV

logger = logging.getLogger(__name__)

DESCRIPTION = "SGLang's native HTTP API (the subset RL trainers use) in front of the embedded engine."


def parser() -> argparse.ArgumentParser:
    """The flags, with SGLang's spellings (the launcher passes the same to real SGLang)."""
    parser = argparse.ArgumentParser(prog="python -m areal_flow.generation.server", description=DESCRIPTION)
    parser.add_argument("--model-path", required=True, help="Hugging Face model directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (loopback unless placed on other hosts)")
    parser.add_argument("--port", type=int, default=30000, help="port to bind (0: any free port)")
    parser.add_argument("--max-batch-size", type=int, default=128, help="most requests decoded together")
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help="KV cache budget in tokens: requests wait while the blocks they need are taken, and "
                             "the newest are retracted when the running ones outgrow it (default: no budget)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per block of the paged KV cache")
    parser.add_argument("--chunked-prefill-size", type=int, default=None,
                        help="prompt tokens prefilled per forward beside the decoding rows (-1 or unset: whole prompts)")
    parser.add_argument("--disable-radix-cache", action="store_true",
                        help="keep no prefix cache: every request prefills its whole prompt (SGLang's flag; the "
                             "embedded engine's prefix cache is hash-chained blocks, generation/engine/paged.py)")
    parser.add_argument("--disable-cuda-graph", action="store_true",
                        help="cuda: run decode steps eagerly instead of replaying captured CUDA graphs")
    parser.add_argument("--disable-overlap-schedule", action="store_true",
                        help="read each step's sampled tokens back before launching the next forward (SGLang's "
                             "flag); by default the forward is launched first and the host's work overlaps it")
    parser.add_argument("--lora-decode", default="lowrank", choices=LORA_DECODE,
                        help="LoRA updates: add each adapter's low-rank path to its projection at decode (lowrank: "
                             "an update copies the adapters alone), or merge them into the weights in fp32")
    parser.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where weights, KV cache and sampling live (cuda: the first GPU this process sees)")
    parser.add_argument("--dtype", default="auto", choices=sorted(DTYPES) + ["auto"],
                        help="number format of the weights and KV cache; auto = bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--mem-fraction-static", type=float, default=None,
                        help="cuda, without --max-total-tokens: the KV budget is what is left of this share of the "
                             "GPU's memory after the weights (SGLang's flag)")
    parser.add_argument("--enable-deterministic-inference", action="store_true",
                        help="batch-invariant decoding (SGLang's flag): a request's tokens and logprobs do not "
                             "depend on what else is in the batch, so a seeded request answers bit-identically "
                             "however requests arrive; slower (generation/engine/decode.py)")
    parser.add_argument("--weight-version", default="default",
                        help="label of the initial weights (digits also set the integer token version)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help="requests need `Authorization: Bearer API_KEY` (all but /health* and /metrics), as "
                             f"SGLang's; default: the {API_KEY_ENV} environment variable, which unlike the command "
                             "line other users cannot read")
    parser.add_argument("--max-request-bytes", type=int, default=bodies.MAX_REQUEST_BYTES,
                        help="larger request bodies are refused (413) before they are read or parsed "
                             f"(generation.max_request_bytes; default {bodies.MAX_REQUEST_BYTES})")
    parser.add_argument("--tool-call-parser", default="auto", choices=tool_parsers.NAMES,
                        help="the format of the model's tool calls in chat answers (SGLang's flag and names; "
                             "generation.tool_call_parser); auto: the one the chat template writes")
    parser.add_argument("--log-level", default="INFO")
    return parser


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """`serve`'s keyword arguments (the engine's options among them) from the parsed flags."""
    return dict(
        max_batch_size=args.max_batch_size, seed=args.seed, num_threads=args.num_threads,
        max_total_tokens=args.max_total_tokens, weight_label=args.weight_version, api_key=args.api_key or None,
        max_request_bytes=args.max_request_bytes,
        device=str(local_device(args.device)), dtype=compute_dtype(args.dtype, args.device),
        mem_fraction=args.mem_fraction_static, batch_invariant=args.enable_deterministic_inference,
        page_size=args.page_size, chunked_prefill_size=args.chunked_prefill_size,
        cuda_graphs=not args.disable_cuda_graph, prefix_cache=not args.disable_radix_cache,
        overlap=not args.disable_overlap_schedule, lora_decode=args.lora_decode,
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    faulthandler.enable()  # a native crash prints every thread's stack into the log, as the roles' (runtime/child.py)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep the server log to log lines

    # Handlers first: a SIGTERM during model loading then still ends in a clean shutdown.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server, thread = serve(args.model_path, args.host, args.port, tool_call_parser=args.tool_call_parser,
                           **engine_settings(args))
    # Never the key itself: logs are read by more people than the run's owner.
    logger.info("serving %s at %s%s", args.model_path, server.url,
                " (requests need the API key)" if args.api_key else "")
    stop.wait()
    logger.info("shutting down")
    server.stop()
    thread.join()
    # The interpreter's last garbage collection walks every object torch and transformers made:
    # 1-2 s of a run's stop on 2 cores (py-spy: gc_collect_main). Frozen objects are not walked.
    gc.freeze()
    return 0
