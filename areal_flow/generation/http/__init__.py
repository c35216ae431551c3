"""The generation server's HTTP side, SGLang's native API and OpenAI's over the embedded engine.

- `server.py` — `GenerationServer` and `serve`: the app on uvicorn on its own thread; `cli.py` its
  command line (`python -m areal_flow.generation.server`).
- `app.py` — the plumbing: bodies read within their limit, answers and errors in SGLang's (or
  OpenAI's) envelope, the API-key guard.
- `routes.py` — the routes and the table of them; `weight_routes.py` the weight updates (from disk,
  by broadcast over a weights group: `weight_groups.py`, by handle).
- `generate_api.py` — `/generate` bodies in SGLang's shapes, `generate_answers.py` its answers,
  streams included; `openai_api.py` and `openai_answers.py` the same for the OpenAI routes;
  `bodies.py` a body's size limit and JSON parsing (large ones off the event loop);
  `load_report.py` `/v1/loads` and `/metrics`.
- `context.py` — what a route is given; `errors.py` — what a route raises to answer an error.
"""
