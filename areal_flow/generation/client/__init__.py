"""The client side of generation servers, used by the rollout workers, the controller, the agents'
gateway and the weight publishers; free of torch.

- `generation_client.py` — `GenerationClient`: one server's API over aiohttp (it talks to real
  SGLang just as well), `wait_healthy`, `GenerationError`.
- `router.py` — `ServerPool`: requests spread over several servers by load, a group on one
  server, retries and health, weight updates to all.
- `membership.py` — which servers serve: the membership file an elastic run's launcher writes and
  the pools follow.

Nothing is imported here: import the module that holds what you need.
"""
