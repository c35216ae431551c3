"""Generation: the embedded engine and its SGLang-compatible HTTP API.

- `engine.py` — `GenerationEngine`: a background thread that decodes queued requests in batches
  with its own KV-cache loop, tags every token with the weight version that produced it, and swaps
  weights between batches.
- `server.py` — the SGLang native HTTP API subset (`/generate`, `/update_weights_from_disk`, ...)
  on FastAPI and uvicorn, as SGLang serves it, and the `python -m areal_flow.generation.server` CLI.
- `generate_api.py` — `/generate` bodies and answers in SGLang's shapes: batch, `n`, logprob
  fields, server-sent event streams. `load_report.py` — `/v1/loads` and Prometheus `/metrics`.
- `client.py` — an asyncio client for that API (aiohttp); it talks to real SGLang just as well.
- `sglang_backend.py` — `generation.backend=sglang`: the `sglang.launch_server` command line and
  environment the launcher starts instead of the embedded server, and the checks of `generation.*`.

Nothing is imported here, so that rollout workers can import the client without loading torch.
"""
