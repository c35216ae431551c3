"""An environment for the end-to-end test of multi-turn runs: it answers every turn with the same
nudge and is never done, so every trajectory takes its max_turns (or its budget) with observation
tokens between its turns, whatever the tiny model writes."""

from areal_flow.envs.base import Environment, Step


class Nudge(Environment):
    figures = ("nudges",)

    async def step(self, turn: str) -> Step:
        return Step("\n# again\n", figures={"nudges": 1.0})
