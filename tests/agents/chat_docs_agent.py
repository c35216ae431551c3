"""A chat agent as OpenAI's documentation writes one, for tests/test_agent_recipe.py: three calls,
each appending the message the client returned and a message of its own, whatever the answers."""

from areal_flow.data.arith import arith_reward
from areal_flow.data.observations import PYTHON_FUNCTION


async def run(client, row) -> float:
    messages: list = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        out = await client.chat.completions.create(model="policy", messages=messages, tools=[PYTHON_FUNCTION],
                                                   max_tokens=12)
        message = out.choices[0].message
        messages += [message, {"role": "user", "content": "Go on."}]
    return arith_reward(message.content or "", row["answer"])
