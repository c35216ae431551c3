"""The shipped arithmetic agent, made to raise on every problem whose answer is odd (a tool server
that is down for half the problems): tests/test_agent_recipe.py runs it."""

from areal_flow.agents.examples import arith_tool


async def run(client, row):
    if int(row["answer"]) % 2:
        raise RuntimeError(f"no tool for {row['answer']}")
    return await arith_tool.run(client, row)
