"""Agents written against OpenAI's client, trained as they are (docs/agents.md).

- `gateway.py`: OpenAI's endpoints in front of the generation servers, one base URL per rollout,
  recording every call's exact tokens; `stream.py` relays a streamed call's chunks as they are
  generated (`sse.py`: a whole answer sent as a stream, in front of SGLang), `resume.py` is the
  OpenAI wire's side of carrying an answer a weight update cut on to its end
  (generation/client/carry_on.py, the loop `/generate` samples use too), and
  `sglang_wire.py` asks SGLang for the same token fields the embedded server returns.
- `text_map.py` and `chat_map.py`: an agent's history (its text, its messages) mapped back onto
  the policy's tokens, so an agent written from OpenAI's documentation does not drift.
- `trajectories.py`: the recorder that links a rollout's calls into trajectories, token for token,
  and counts drift.
- `check_template.py`: does a model's chat template keep the tokens of a multi-turn conversation?
- `runner.py`: the runner that calls an agent for each rollout, beside its gateway; the rollout
  worker picks it (rollout/runners.py) for a generate node that names an agent.
- `examples/`: agents the recipes name.
"""
