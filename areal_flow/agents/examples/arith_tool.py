"""`tiny_arith_tool`'s task as an agent written against the OpenAI client (recipe tiny_arith_agent).

The agent asks the policy to continue the problem's text (`/v1/completions`) until it closes a
`<python>` call; it runs the code in the sandbox, as the python_tool environment does, appends what
it printed and asks again; a turn without a call is the final answer, which it scores itself (the
`####` line against the row's answer). It uses OpenAI's fields alone: the text it sends back leaves
out what OpenAI's text leaves out (special tokens the policy sampled, the stop string, which it
writes back itself), and the gateway maps that text back onto the policy's tokens
(agents/text_map.py), so its calls link into one trajectory token for token: `agent/drift_rate`
stays 0.
"""

from __future__ import annotations

import openai

from areal_flow.config.schema import SandboxConfig
from areal_flow.data.arith import arith_reward
from areal_flow.envs.python_tool import ToolSettings, run_tool, tool_sandbox

SETTINGS = ToolSettings(concurrency=4)
SANDBOX = tool_sandbox(SandboxConfig(), SETTINGS.wall_seconds)
MAX_CALLS = 3  # a call, its answer, one more call allowed: tiny_arith_tool's max_turns


async def run(client: openai.AsyncOpenAI, row: dict) -> float:
    text = row["prompt"]
    for _ in range(MAX_CALLS):
        try:
            out = await client.completions.create(model="policy", prompt=text, stop=[SETTINGS.close])
        except openai.BadRequestError:  # no room left in the model's context: the answer so far stands
            return 0.0
        choice = out.choices[0]
        text += choice.text
        # A call is a `<python>` left open: the answer stopped at the close tag (OpenAI's text leaves
        # the stop string out). Anything else is the final answer.
        opened = choice.text.rfind(SETTINGS.open)
        if choice.finish_reason != "stop" or opened < 0 or SETTINGS.close in choice.text[opened:]:
            return arith_reward(choice.text, row["answer"])
        code = choice.text[opened + len(SETTINGS.open):]
        observation, _ = await run_tool(code, SETTINGS, SANDBOX)
        text += SETTINGS.close + observation
    return 0.0  # every call used on tools: no final answer
