"""An agent with a bug: it calls the policy and forgets its `return` (tests/test_agent_recipe.py)."""


async def run(client, row):
    await client.completions.create(model="policy", prompt=row["prompt"], max_tokens=8)
