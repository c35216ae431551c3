"""Stand-in for `python -m sglang.launch_server`, for tests on machines where SGLang cannot be
installed (it pins a CUDA build of torch). The tests put its folder on PYTHONPATH, so the launcher
starts it exactly as it starts real SGLang.

It parses the flags areal_flow passes with SGLang's spellings (an unknown or misspelled flag fails
as in SGLang), checks the environment SGLang's CPU engine reads, appends what it was given to the
JSON-lines file $SGLANG_STANDIN_RECORD, and serves areal_flow's embedded engine, answering as real
SGLang does where the two differ: no `meta_info.output_token_versions` (an areal_flow extension),
the initial weight version labelled "default", no `busy_seconds`, `load_seconds` or compute counts
in /server_info, and with --skip-tokenizer-init no tokenizer (answers carry no text). --api-key
guards the routes as SGLang's. Its OpenAI endpoints answer as SGLang 0.5.13's: no token fields
unless asked (`return_prompt_token_ids`: the choice's `prompt_token_ids`; `return_meta_info` with
logprobs on: the choice's `meta_info`, `/generate`'s fields).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading

from areal_flow.generation.compute_counts import COMPUTE_COUNTS
from areal_flow.generation.engine.generation_engine import GenerationEngine
from areal_flow.generation.http import routes
from areal_flow.generation.http.context import Route
from areal_flow.generation.http.server import GenerationServer, optional_tokenizer

DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang.launch_server")
    p.add_argument("--model-path", "--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--device", choices=("cuda", "xpu", "hpu", "npu", "cpu", "musa"), default=None)
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tool-call-parser", choices=("hermes", "qwen25", "qwen", "llama3", "mistral", "pythonic"))
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def check_cpu_binding(args: argparse.Namespace) -> None:
    """SGLang's CPU engine gives TP rank r the r-th '|'-separated core list of
    SGLANG_CPU_OMP_THREADS_BIND: a missing share fails there, so it fails here."""
    bind = os.environ.get("SGLANG_CPU_OMP_THREADS_BIND")
    if args.device == "cpu" and bind is not None and len(bind.split("|")) != args.tp_size:
        sys.exit(f"SGLANG_CPU_OMP_THREADS_BIND={bind!r} does not give each of the {args.tp_size} TP ranks its cores")


def rewrite(route: Route, fix) -> Route:
    """`route` with `fix` applied to every JSON object it answers."""
    async def wrapped(server, call):
        status, payload = await route(server, call)
        for answer in payload if isinstance(payload, list) else [payload]:
            if isinstance(answer, dict):
                fix(answer)
        return status, payload
    return wrapped


# The engine's first label is "default", as SGLang's is (the launcher passes no --weight-version).
def fix_generate(answer: dict) -> None:
    del answer["meta_info"]["output_token_versions"]


def fix_server_info(answer: dict) -> None:
    for key in ("busy_seconds", "load_seconds", *COMPUTE_COUNTS):
        answer.pop(key, None)


EXTENSIONS = ("token_ids", "output_token_logprobs", "output_token_versions", "weight_version", "matched_stop")


def openai_as_sglang(route: Route) -> Route:
    """An OpenAI route answering as SGLang's: its token fields only when asked, where SGLang puts them."""
    async def wrapped(server, call):
        body = json.loads(call.body)
        meta, prompt_ids = body.pop("return_meta_info", False), body.pop("return_prompt_token_ids", False)
        logprobs = body.get("logprobs") not in (None, False) and ("messages" in body or body["logprobs"] > 0)
        answer = await route(server, dataclasses.replace(call, body=json.dumps(body).encode()))
        if not isinstance(answer, tuple) or answer[0] != 200:
            return answer
        status, payload = answer
        ids = payload.pop("prompt_token_ids")
        for choice in payload["choices"]:
            fields = {key: choice.pop(key) for key in EXTENSIONS}
            if prompt_ids:
                choice["prompt_token_ids"] = ids
            if meta:
                reason = choice["finish_reason"]
                choice["meta_info"] = {
                    "weight_version": fields["weight_version"], "completion_tokens": len(fields["token_ids"]),
                    "finish_reason": {"type": "stop" if reason == "tool_calls" else reason,
                                      **({"matched": fields["matched_stop"]} if fields["matched_stop"] is not None else {})}}
                if logprobs:
                    choice["meta_info"]["output_token_logprobs"] = [
                        [lp, t, None] for lp, t in zip(fields["output_token_logprobs"], fields["token_ids"])]
        return status, payload
    return wrapped


def main(argv: list[str]) -> None:
    args = parse(argv)
    check_cpu_binding(args)
    record = os.environ.get("SGLANG_STANDIN_RECORD")
    if record:
        env = {k: v for k, v in os.environ.items() if k.startswith("SGLANG_") and k != "SGLANG_STANDIN_RECORD"}
        with open(record, "a") as f:
            f.write(json.dumps({"argv": argv, "env": env, "cores": sorted(os.sched_getaffinity(0))}) + "\n")

    for path, fix in (("/generate", fix_generate), ("/server_info", fix_server_info),
                      ("/get_server_info", fix_server_info)):
        methods, route = routes.ROUTES[path]
        routes.ROUTES[path] = (methods, rewrite(route, fix))
    for path in ("/v1/chat/completions", "/v1/completions"):
        methods, route = routes.ROUTES[path]
        routes.ROUTES[path] = (methods, openai_as_sglang(route))

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    tokenizer = None if args.skip_tokenizer_init else optional_tokenizer(args.model_path)
    engine = GenerationEngine(args.model_path, tokenizer=tokenizer, max_batch_size=args.max_running_requests or 128,
                              seed=args.random_seed or 0, num_threads=args.tp_size,
                              max_total_tokens=args.max_total_tokens)
    if args.context_length is not None:
        engine.context_length = args.context_length
    # As SGLang: an empty key means none.
    # SGLang's parser names are the embedded server's (or its aliases); without the flag, hermes.
    server = GenerationServer((args.host, args.port), engine, tokenizer, args.model_path, args.api_key or None,
                              tool_call_parser=args.tool_call_parser or "hermes")
    server.start()
    print(f"The server is fired up and ready to roll! ({server.url})", flush=True)
    stop.wait()
    server.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
