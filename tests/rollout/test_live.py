"""Multi-turn trajectories in flight, kept at each turn's boundary and continued from there after a
resume (rollout/live.py), against a scripted /generate as tests/rollout/test_turns.py."""

import asyncio

from sglang_standin import serving
from test_turns import TOK, Calculator, Scripted, ids

from areal_flow.envs.base import Environment, Step
from areal_flow.generation.client.router import ServerPool
from areal_flow.rollout import live
from areal_flow.rollout.turns import generate_trajectory

PARAMS = {"max_new_tokens": 50, "temperature": 1.0}


class Remembering(Calculator):
    """A calculator that counts its calls, and says so in its state."""

    def __init__(self, row, **settings):
        super().__init__(row, **settings)
        self.count = 0

    async def step(self, turn: str) -> Step:
        if turn.endswith("</c>"):
            self.count += 1
        return await super().step(turn)

    def snapshot(self) -> dict:
        return {"count": self.count}

    def restore(self, state: dict) -> None:
        self.count = state["count"]


def generate(script, env, kept=None, keep=None):
    Scripted.SCRIPT = script

    async def go(url):
        async with ServerPool([url]) as pool:
            return await generate_trajectory(pool, env, TOK, ids("Q:"), PARAMS, max_turns=4, token_budget=200,
                                             rid="r", key="g0", seed=7, kept=kept, keep=keep)

    with serving(Scripted) as url:
        return asyncio.run(go(url)), Scripted.calls


def test_each_boundary_is_kept_and_a_trajectory_goes_on_from_its_last_one_as_if_never_stopped():
    group = live.LiveGroup([None, None])
    seen = []

    def keep(*args):
        group.keeper(1)(*args)
        seen.append(group.kept[1])

    whole, _ = generate([("<c>2+3</c>", "stop", "4"), ("<c>5*2</c>", "stop", "5"), ("#### 10", "stop", "6")],
                        Remembering({}), keep=keep)
    # Kept after each answer (the environment not yet asked) and after each observation.
    assert [k.stepped for k in seen] == [False, True, False, True, False]
    assert [k.env_state for k in seen] == [{"count": 0}, {"count": 1}, {"count": 1}, {"count": 2}, {"count": 2}]
    assert group.now() == [seen[-1]] and seen[-1].index == 1
    assert live.tokens([seen[3]]) == len(ids("<c>2+3</c>=5;<c>5*2</c>=10;"))

    # Stopped after the first observation: the rest is the next turns only.
    env = Remembering({})
    got, calls = generate([("<c>5*2</c>", "stop", "5"), ("#### 10", "stop", "6")], env, kept=seen[1])
    assert got.trajectory.output_ids == whole.trajectory.output_ids
    assert got.trajectory.loss_mask == whole.trajectory.loss_mask and got.trajectory.versions == whole.trajectory.versions
    assert got.figures == whole.figures and env.count == 2 and got.end == "done"
    assert calls[0]["input_ids"] == ids("Q:<c>2+3</c>=5;")  # the kept tokens, exactly
    # Stopped while the second call's tool ran: the kept answer is read again, nothing regenerated for it.
    got, calls = generate([("#### 10", "stop", "6")], Remembering({}), kept=seen[2])
    assert got.trajectory.output_ids == whole.trajectory.output_ids and len(calls) == 1


def test_an_environment_that_cannot_say_its_state_keeps_nothing_and_one_whose_restore_raises_ends_its_trajectory():
    group = live.LiveGroup([None])
    generate([("<c>2+3</c>", "stop", "4"), ("#### 5", "stop", "5")], Calculator({}), keep=group.keeper(0))
    assert group.now() == []  # Environment.snapshot() is None by default

    kept = live.LiveGroup([None])
    generate([("<c>2+3</c>", "stop", "4"), ("#### 5", "stop", "5")], Remembering({}), keep=kept.keeper(0))

    class Broken(Remembering):
        def restore(self, state: dict) -> None:
            raise KeyError("count")

    got, calls = generate([], Broken({}), kept=kept.kept[0])
    assert got.end == "env_error" and "restore() raised at" in got.trajectory.error and not calls


def test_kept_trajectories_survive_a_checkpoint_file(tmp_path):
    group = live.LiveGroup([None])
    generate([("<c>2+3</c>", "stop", "4"), ("#### 5", "stop", "5")], Remembering({}), keep=group.keeper(0))
    (tmp_path / live.FILE).write_bytes(live.encode({12: group.now()}))
    assert live.load(str(tmp_path)) == {12: group.now()}
    assert live.load(str(tmp_path / "none")) == {}


def test_the_built_in_environments_say_their_state():
    from areal_flow.envs.code_feedback import CodeFeedback
    from areal_flow.envs.python_tool import PythonTool

    assert PythonTool({}).snapshot() == {} and CodeFeedback({}).snapshot() == {}
    assert Environment.snapshot(Calculator({})) is None
