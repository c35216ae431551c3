"""Generation: the embedded engine, its SGLang-compatible HTTP server, and the client side.

- `engine/` — `GenerationEngine`: a background thread that decodes queued requests in batches
  over its own KV cache, tags every token with the weight version that produced it, and swaps
  weights between steps.
- `http/` — SGLang's native HTTP API subset (`/generate`, `/update_weights_from_disk`, ...) and
  OpenAI's, on FastAPI and uvicorn as SGLang serves it; `server.py` here is its command line,
  `python -m areal_flow.generation.server`.
- `client/` — the asyncio client of that API, the pool of servers and their membership.
- `sglang_backend.py` — `generation.backend=sglang`: the `sglang.launch_server` command line and
  environment the launcher starts instead of the embedded server, and the checks of `generation.*`.
- `compute_counts.py` — the engine's compute counts, as servers report them and the controller
  and the advisor read them; `limits.py` — API limits the launcher checks a config against.

Nothing is imported here, so that rollout workers can import the client without loading torch.
"""
