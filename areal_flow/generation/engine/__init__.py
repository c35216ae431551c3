"""The embedded generation engine: `generation_engine.GenerationEngine` and what it is made of.

- `generation_engine.py` — the public API: submit requests, update weights, abort, pause, stats;
  `options.py` — its settings, checked when made; `requests.py` — what a request is and answers.
- `inbox.py` — what callers hand the decode thread; `decode_loop.py` — that thread's loop;
  `scheduler.py` — which queued requests join the batch, which an abort hits (pure code);
  `commands.py` — weight updates and aborts as the thread receives them.
- `stepper.py` — the contract of a step backend: `paged_stepper.py` (the engine's own forward,
  `decode.py`, `triton_decode.py`, `cuda_graphs.py`, over the paged cache of `paged.py` and
  `paged_batch.py`) and `dense_stepper.py` (the transformers forward over `kv_batch.py`'s
  left-padded cache); `sampler.py` and `sampling.py` — sampled tokens into their rows.
- `checkpoint.py` — loading the model and new weights; `kv_budget.py` — the KV cache's size;
  `request_checks.py` — what a request may ask; `step_timing.py` — host/device time per step.

Nothing is imported here: import the module that holds what you need.
"""
