"""Generation: the embedded engine and its SGLang-compatible HTTP API.

- `engine.py` — `GenerationEngine`: a background thread that decodes queued requests in batches
  with its own KV-cache loop, tags every token with the weight version that produced it, and swaps
  weights between batches (its parts: engine_options, inbox, decode_loop, scheduler, stepper and
  its two backends, sampler).
- `http/` — the SGLang native HTTP API subset (`/generate`, `/update_weights_from_disk`, ...) and
  OpenAI's, on FastAPI and uvicorn, as SGLang serves it; `server.py` here is its command line,
  `python -m areal_flow.generation.server`.
- `client.py` — an asyncio client for that API (aiohttp); it talks to real SGLang just as well.
- `sglang_backend.py` — `generation.backend=sglang`: the `sglang.launch_server` command line and
  environment the launcher starts instead of the embedded server, and the checks of `generation.*`.

Nothing is imported here, so that rollout workers can import the client without loading torch.
"""
