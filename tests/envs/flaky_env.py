"""An environment with a bug, for the end-to-end tests of environment errors
(tests/test_env_failures.py): every `every`-th call of `step` in a worker process raises (1 in 8, a
tool that fails now and then; 1, one that always fails). A turn ends at any of the characters of
`stops`; a turn that does not end at ';' is the final answer, and the observation is empty."""

from areal_flow.envs.base import Environment, Step

CALLS = [0]  # step calls in this process


class Flaky(Environment):
    figures = ("tool_calls",)

    def __init__(self, row, *, sandbox=None, every: int = 8, stops: str = ";"):
        super().__init__(row)
        self.every, self.stop = every, tuple(stops)

    async def step(self, turn: str) -> Step:
        CALLS[0] += 1
        if CALLS[0] % self.every == 0:
            raise RuntimeError(f"the tool failed at call {CALLS[0]}")
        return Step("", figures={"tool_calls": 1.0}) if turn.endswith(";") else Step(done=True)
