"""Agents written against OpenAI's client, trained as they are (docs/agents.md).

- `gateway.py`: OpenAI's endpoints in front of the generation servers, one base URL per rollout,
  recording every call's exact tokens; `sse.py` streams a whole answer back to an agent that asked
  for a stream, `resume.py` carries an answer a weight update cut on to its end, and
  `sglang_wire.py` asks SGLang for the same token fields the embedded server returns.
- `trajectories.py`: the recorder that links a rollout's calls into trajectories, token for token,
  and counts drift.
- `check_template.py`: does a model's chat template keep the tokens of a multi-turn conversation?
- `examples/`: agents the recipes name.

The runner that calls an agent for each rollout is `rollout/agent.py`.
"""
