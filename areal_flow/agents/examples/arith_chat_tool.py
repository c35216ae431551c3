"""`tiny_arith_tool`'s task as a chat agent with a tool, written against the `openai` client as its
documentation shows (recipe tiny_arith_chat_agent).

The agent asks the problem as the user's message, declaring one function tool, `python`. When the
answer calls it, the agent runs the code in the sandbox, sends the printed output back as the
tool's message and asks again; an answer without a call is the final one, which it scores itself
(the `####` line against the row's answer). It uses OpenAI's chat API alone: the answer's message
is appended as the client returned it, the tool result as a `tool` message. The gateway maps that
history back onto the policy's tokens (agents/chat_map.py), so the calls link into one trajectory
token for token and `agent/drift_rate` stays 0.
"""

from __future__ import annotations

import json

import openai

from areal_flow.config.schema import SandboxConfig
from areal_flow.data.arith import arith_reward
from areal_flow.data.observations import PYTHON_FUNCTION
from areal_flow.envs.python_tool import ToolSettings, tool_output, tool_sandbox

SETTINGS = ToolSettings(concurrency=4)
SANDBOX = tool_sandbox(SandboxConfig(), SETTINGS.wall_seconds)
MAX_CALLS = 3  # a call, its answer, one more call allowed: tiny_arith_tool's max_turns


async def run(client: openai.AsyncOpenAI, row: dict) -> float:
    messages: list = [{"role": "user", "content": row["prompt"]}]
    for _ in range(MAX_CALLS):
        try:
            out = await client.chat.completions.create(model="policy", messages=messages, tools=[PYTHON_FUNCTION])
        except openai.BadRequestError:  # no room left in the model's context: the answer so far stands
            return 0.0
        message = out.choices[0].message
        if not message.tool_calls:
            return arith_reward(message.content or "", row["answer"])
        messages.append(message)
        for call in message.tool_calls:
            try:
                code = json.loads(call.function.arguments).get("code", "")
            except (json.JSONDecodeError, AttributeError):
                code = ""
            printed, _ = await tool_output(str(code), SETTINGS, SANDBOX)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": printed})
    return 0.0  # every call used on tools: no final answer
