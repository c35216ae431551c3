"""`tiny_arith_tool`'s task as an agent written against the OpenAI client (recipe tiny_arith_agent).

The agent asks the policy to continue the problem's text (`/v1/completions`) until it closes a
`<python>` call; it runs the code in the sandbox, as the python_tool environment does, appends what
it printed and asks again; a turn without a call is the final answer, which it scores itself (the
`####` line against the row's answer). Every text it sends extends the text it got, so the gateway
links the calls into one trajectory token for token: `agent/drift_rate` stays 0 (special tokens kept
in the text: `skip_special_tokens: false`).
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
            # Special tokens stay in the text (vLLM's and SGLang's field too): a sampled `<unk>` the
            # text left out would make the next prompt differ from the tokens (a drift).
            out = await client.completions.create(model="policy", prompt=text, stop=[SETTINGS.close],
                                                  extra_body={"skip_special_tokens": False})
        except openai.BadRequestError:  # no room left in the model's context: the answer so far stands
            return 0.0
        choice = out.choices[0]
        text += choice.text
        # The stop string is left out of OpenAI's text; the server says which one ended the answer.
        if choice.finish_reason != "stop" or getattr(choice, "matched_stop", None) != SETTINGS.close:
            return arith_reward(choice.text, row["answer"])  # the final answer
        code = choice.text[choice.text.rfind(SETTINGS.open) + len(SETTINGS.open):] \
            if SETTINGS.open in choice.text else ""
        observation, _ = await run_tool(code, SETTINGS, SANDBOX)
        text += SETTINGS.close + observation
    return 0.0  # every call used on tools: no final answer
