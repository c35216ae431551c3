"""An environment for the fault tests of multi-turn runs: every turn that ends at ';' (a scratchpad
step of the arithmetic model) is a tool call that sleeps in the code sandbox, so a trajectory is
mid-tool-call most of its life. Its observation is empty; a trajectory ends at its max_turns or at
a turn without ';'."""

from areal_flow.envs.base import Environment, Step
from areal_flow.envs.python_tool import check_sandbox, shared_pool, tool_sandbox


class Sleepy(Environment):
    stop = (";",)
    figures = ("tool_calls",)

    def __init__(self, row, *, sandbox=None, seconds: float = 0.3):
        super().__init__(row)
        self.sandbox = tool_sandbox(sandbox, 5.0)
        self.seconds = seconds

    def check(self) -> None:
        check_sandbox(self.sandbox, "sleepy")

    def snapshot(self) -> dict:
        return {}  # nothing between turns: a checkpoint keeps its trajectories in flight (rollout/live.py)

    async def step(self, turn: str) -> Step:
        if not turn.endswith(";"):
            return Step(done=True)
        await shared_pool(self.sandbox, 4).run(f"import time\ntime.sleep({self.seconds})\nprint(1)")
        return Step("", figures={"tool_calls": 1.0})
