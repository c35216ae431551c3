"""Two agents of one policy (recipe tiny_arith_solve_check): a solver and a checker.

The solver answers the problem (`/v1/completions`, tiny_arith's scratchpad and `#### sum`); the
checker is asked whether the solver's claim is the sum (`check a+b=claim`), works the sum out and
says yes or no. Each role is rewarded for its own part: the solver for a right answer, the checker
for a right verdict. The runner (graph.generate.agent_roles: [solver, checker]) gives each role a
client of its own, records their calls apart, and trains each role's trajectory as a sample whose
advantage is compared only with its own role's (docs/agents.md, "Several roles").
"""

from __future__ import annotations

import openai

from areal_flow.data import arith


async def run(clients: dict[str, openai.AsyncOpenAI], row: dict) -> dict[str, float]:
    a, b = arith.operands(row["prompt"])
    solved = await clients["solver"].completions.create(model="policy", prompt=row["prompt"])
    said = solved.choices[0].text
    claim = arith.extract_answer(said)
    claim = claim if claim is not None and claim >= 0 else 0  # no answer: the checker is asked about 0
    checked = await clients["checker"].completions.create(model="policy", prompt=arith.check_prompt_text(a, b, claim))
    return {"solver": arith.arith_reward(said, row["answer"]),
            "checker": arith.check_reward(checked.choices[0].text, claim == a + b)}
