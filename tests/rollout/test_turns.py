"""A multi-turn trajectory (rollout/turns.py) against a scripted /generate: the policy's turns and
the environment's observations as tokens, never re-tokenized, with their mask, logprobs and
versions; interruption inside a turn; and each way a trajectory ends."""

import asyncio
import dataclasses
import re

import pytest
from sglang_standin import StandIn, serving

from areal_flow.envs.base import Environment, Step
from areal_flow.generation.client.router import ServerPool
from areal_flow.models.tokenizer import CODE_CHARS, build_char_tokenizer
from areal_flow.rollout.turns import generate_trajectory, turn_seed
from areal_flow.transport.messages import Finish

TOK = build_char_tokenizer(CODE_CHARS, chat=True)


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


class Scripted(StandIn):
    """Answers request k with SCRIPT[k]: (text, finish reason, version)."""

    SCRIPT: list[tuple[str, str, str]] = []

    def answer(self, body: dict) -> object:
        text, reason, version = type(self).SCRIPT[len(type(self).calls) - 1]
        out = ids(text)
        return {"text": text, "output_ids": out, "meta_info": {
            "id": "x", "weight_version": version, "finish_reason": {"type": reason},
            "output_token_logprobs": [[-0.25, t, None] for t in out]}}


class Calculator(Environment):
    """Answers `<c>EXPR</c>` with `=VALUE;`; done on a turn without a call; 0.5 reward per call."""

    stop = ("</c>",)
    closed = 0

    async def step(self, turn: str) -> Step:
        if not turn.endswith("</c>"):
            return Step(done=True)
        expr = turn[turn.rfind("<c>") + 3:-4]
        return Step(f"={eval(expr)};", reward=0.5, figures={"tool_calls": 1.0})

    async def close(self) -> None:
        type(self).closed += 1


def run(script, prompt="Q:", max_turns=4, token_budget=200, max_new_tokens=50, env=None):
    Scripted.SCRIPT = script

    async def go(url):
        async with ServerPool([url]) as pool:
            return await generate_trajectory(pool, env or Calculator({}), TOK, ids(prompt),
                                             {"max_new_tokens": max_new_tokens, "temperature": 1.0},
                                             max_turns=max_turns, token_budget=token_budget, rid="r", key="g0",
                                             seed=7)

    with serving(Scripted) as url:
        return asyncio.run(go(url)), Scripted.calls


def test_observations_are_appended_as_their_own_tokens_masked_and_the_history_is_never_retokenized():
    got, calls = run([("<c>2+3</c>", "stop", "4"), ("#### 5", "stop", "5")])
    assert TOK.decode(got.trajectory.output_ids) == "<c>2+3</c>=5;#### 5"
    assert got.trajectory.loss_mask == [1] * 10 + [0] * 3 + [1] * 6
    assert got.trajectory.logprobs == [-0.25] * 10 + [0.0] * 3 + [-0.25] * 6
    # An observation carries its turn's version; each turn's tokens their own.
    assert got.trajectory.versions == [4] * 13 + [5] * 6
    assert (got.trajectory.finish, got.trajectory.calls, got.end) == (Finish.STOP, 2, "done")
    # The call's reward (0.5, below 1) and a last turn with none: a failure not repaired at turn 2.
    assert got.figures == {"env_reward": 0.5, "tool_calls": 1.0, "repair_turn2": 0.0}
    # The second request is the first's tokens plus the observation's, exactly; each turn asks to
    # stop at the environment's stop strings, with a seed of its own.
    assert calls[1]["input_ids"] == ids("Q:") + got.trajectory.output_ids[:13]
    assert [c["sampling_params"]["stop"] for c in calls] == [["</c>"]] * 2
    assert [c["sampling_params"]["sampling_seed"] for c in calls] == [7, turn_seed(7, 1)] and turn_seed(7, 1) != 7
    assert Calculator.closed >= 1


def test_an_interrupted_turn_is_resubmitted_with_its_tokens_and_its_versions_kept():
    got, calls = run([("<c>1", "abort", "1"), ("+1</c>", "stop", "2"), ("#### 2", "stop", "2")])
    assert TOK.decode(got.trajectory.output_ids) == "<c>1+1</c>=2;#### 2"
    assert calls[1]["input_ids"] == ids("Q:<c>1")
    assert got.trajectory.versions[:4] == [1] * 4 and got.trajectory.versions[4:10] == [2] * 6
    assert got.trajectory.loss_mask == [1] * 10 + [0] * 3 + [1] * 6


@pytest.mark.parametrize("script, kwargs, end, finish, turns", [
    ([("<c>1</c>", "stop", "0")] * 2, dict(max_turns=2), "max_turns", Finish.STOP, 2),
    ([("<c>1+", "length", "0")], {}, "turn_length", Finish.LENGTH, 1),
    # Prompt 2 + turn 8 + observation 3 = 13 tokens: a budget of 13 has no room for it.
    ([("<c>1</c>", "stop", "0")], dict(token_budget=13), "observation_too_long", Finish.STOP, 1),
    ([], dict(token_budget=2), "budget", Finish.STOP, 0),  # the prompt fills it
])
def test_each_way_a_trajectory_ends_is_recorded_and_it_never_passes_its_token_budget(script, kwargs, end, finish,
                                                                                     turns):
    got, calls = run(script, **kwargs)
    assert (got.end, got.trajectory.finish, got.trajectory.calls) == (end, finish, turns)
    assert len(ids("Q:")) + len(got.trajectory.output_ids) <= kwargs.get("token_budget", 200)
    t = got.trajectory
    assert len(t.loss_mask) == len(t.output_ids) == len(t.versions) == len(t.logprobs)
    # No turn asks for more tokens than the trajectory has room for.
    for call in calls:
        room = kwargs.get("token_budget", 200) - len(call["input_ids"])
        assert call["sampling_params"]["max_new_tokens"] <= room


def test_a_held_out_evaluation_takes_turns_and_scores_the_final_one():
    """With an environment the held-out answers are trajectories too (greedy), scored on their final
    turn as the reward node scores them, each answer's env figures kept and averaged."""
    from areal_flow.config.schema import SandboxConfig
    from areal_flow.controller.evaluation import held_out_accuracy
    from areal_flow.rollout.turns import Turns

    Scripted.SCRIPT = [("<c>2+3</c>", "stop", "3"), ("#### 5", "stop", "3")]
    turns = Turns(Calculator, {}, SandboxConfig(), max_turns=3, token_budget=200)
    scored = []

    async def score(text, reference):
        scored.append(text)
        return float(text == reference)

    async def go(url):
        async with ServerPool([url]) as pool:
            return await held_out_accuracy(pool, TOK, [{"q": "Q:", "a": "#### 5"}], score, "q", "a", 50, turns)

    with serving(Scripted) as url:
        result = asyncio.run(go(url))
        calls = Scripted.calls
    assert scored == ["#### 5"] and result.accuracy == 1.0 and result.versions == {3: 1}
    assert all(c["sampling_params"]["temperature"] == 0.0 for c in calls) and len(calls) == 2
    (answer,) = result.answers
    assert answer["answer"] == "<c>2+3</c>=5;#### 5" and answer["score"] == 1.0
    assert answer["env/turns"] == 2.0 and answer["env/tool_calls"] == 1.0 and answer["env/end_done"] == 1.0
    assert result.figures["env/tool_calls"] == 1.0 and result.figures["env/env_reward"] == 0.5


class Grader(Environment):
    """Rewards 1 and ends on a turn that says "ok"; else 0 and asks again."""

    async def step(self, turn: str) -> Step:
        return Step(done=True, reward=1.0) if turn.endswith("ok") else Step("\nagain: ", reward=0.0)


def test_repairs_count_the_failures_at_turn_k_fixed_at_turn_k_plus_1():
    got, _ = run([("bad", "stop", "1"), ("bad", "stop", "1"), ("ok", "stop", "1")], env=Grader({}))
    assert (got.trajectory.calls, got.end) == (3, "done")
    assert got.figures == {"env_reward": 1.0, "repair_turn2": 0.0, "repair_turn3": 1.0}
    got, _ = run([("ok", "stop", "1")], env=Grader({}))
    assert got.figures == {"env_reward": 1.0}  # no failure: no repair figure (a step's mean leaves it out)
    got, _ = run([("bad", "stop", "1"), ("bad", "stop", "1")], env=Grader({}), max_turns=2)
    assert got.figures == {"env_reward": 0.0, "repair_turn2": 0.0}  # the last failure had no next turn


class ByPrompt(StandIn):
    """Answers "ok" to A's first turn and to any retry, "bad" to B's first turn."""

    def answer(self, body: dict) -> object:
        seen = TOK.decode(body["input_ids"])
        text = "bad" if seen == "B:" else "ok"
        out = ids(text)
        return {"text": text, "output_ids": out, "meta_info": {
            "id": "x", "weight_version": "1", "finish_reason": {"type": "stop"},
            "output_token_logprobs": [[-0.25, t, None] for t in out]}}


def test_an_evaluation_averages_each_figure_over_the_answers_that_have_it():
    """A repair rate exists only where the turn before failed: the held-out mean is over those."""
    from areal_flow.config.schema import SandboxConfig
    from areal_flow.controller.evaluation import held_out_accuracy
    from areal_flow.rollout.turns import Turns

    turns = Turns(Grader, {}, SandboxConfig(), max_turns=3, token_budget=200)

    async def score(text, reference):
        return float(text == reference)

    async def go(url):
        async with ServerPool([url]) as pool:
            return await held_out_accuracy(pool, TOK, [{"q": "A:", "a": "ok"}, {"q": "B:", "a": "ok"}], score,
                                           "q", "a", 50, turns)

    with serving(ByPrompt) as url:
        result = asyncio.run(go(url))
    first, second = result.answers
    assert "env/repair_turn2" not in first and second["env/repair_turn2"] == 1.0
    assert result.figures["env/repair_turn2"] == 1.0  # over the one answer that has it, not 0.5
    assert result.figures["env/turns"] == 1.5 and result.accuracy == 1.0


class GroupFirst(StandIn):
    """The group's request (n = 3) answers ok, bad, bad; every later turn ok."""

    def answer(self, body: dict) -> object:
        def one(text):
            out = ids(text)
            return {"text": text, "output_ids": out, "meta_info": {
                "id": "x", "weight_version": "2", "finish_reason": {"type": "stop"},
                "output_token_logprobs": [[-0.5, t, None] for t in out]}}

        n = body["sampling_params"].get("n", 1)
        return [one(t) for t in ("ok", "bad", "bad")] if n == 3 else one("ok")


def test_a_groups_first_turns_come_from_one_request_and_each_trajectory_goes_on_alone():
    from areal_flow.config.schema import SandboxConfig
    from areal_flow.rollout.turns import Turns

    turns = Turns(Grader, {}, SandboxConfig(), max_turns=3, token_budget=200)

    async def go(url):
        async with ServerPool([url]) as pool:
            return await turns.run_group(pool, TOK, {}, ids("Q:"), {"max_new_tokens": 20, "temperature": 1.0},
                                         3, "g5", seed=100)

    with serving(GroupFirst) as url:
        got = asyncio.run(go(url))
        calls = GroupFirst.calls
    first, *later = calls
    assert first["sampling_params"]["n"] == 3 and first["sampling_params"]["sampling_seed"] == 100
    assert first["input_ids"] == ids("Q:") and len(later) == 2
    # Trajectories 1 and 2 go on alone, each from its own tokens, with its own turn-1 seed.
    assert sorted(c["sampling_params"]["sampling_seed"] for c in later) == sorted(turn_seed(100 + i, 1) for i in (1, 2))
    assert all(c["input_ids"] == ids("Q:bad\nagain: ") and "n" not in c["sampling_params"] for c in later)
    assert [TOK.decode(g.output_ids) for g in got] == ["ok", "bad\nagain: ok", "bad\nagain: ok"]
    assert [g.scalars["env/turns"] for g in got] == [1.0, 2.0, 2.0]
    assert "env/repair_turn2" not in got[0].scalars and got[1].scalars["env/repair_turn2"] == 1.0
    assert got[1].loss_mask == [1] * 3 + [0] * 8 + [1] * 2 and got[1].logprobs[:3] == [-0.5] * 3


class Buggy(Environment):
    """A user's environment with a bug: its second step raises (or, `bug`, another of its faults)."""

    stop = ("</c>",)
    closed = 0

    def __init__(self, row, *, sandbox=None, bug="step"):
        super().__init__(row)
        if bug == "init":
            raise KeyError("answer")
        self.bug, self.steps = bug, 0

    async def step(self, turn: str) -> Step:
        self.steps += 1
        if self.steps == 2 and self.bug == "step":
            raise RuntimeError("boom")
        if self.bug == "returns_none":
            return None
        return Step("=1;", figures={"tool_calls": 1.0})

    async def close(self) -> None:
        type(self).closed += 1
        if self.bug == "close":
            raise OSError("cannot close")


@pytest.mark.parametrize("bug, turns, said", [
    ("step", 2, r"step\(\) raised at test_turns.py:\d+ in step: RuntimeError: boom"),
    ("returns_none", 1, r"step\(\) returned None, not a Step .*"),
    ("close", 4, r"close\(\) raised at test_turns.py:\d+ in close: OSError: cannot close"),
])
def test_an_environment_that_raises_ends_its_trajectory_only_naming_the_error_and_is_closed(bug, turns, said):
    Buggy.closed = 0
    got, calls = run([("<c>1</c>", "stop", "1")] * 4, env=Buggy({}, bug=bug))
    assert (got.end, got.trajectory.calls, len(calls)) == ("env_error", turns, turns)
    assert re.fullmatch(said, got.trajectory.error) and Buggy.closed == 1
    # The tokens so far stay whole: every per-token record as long as the answer.
    t = got.trajectory
    assert len(t.loss_mask) == len(t.output_ids) == len(t.versions) == len(t.logprobs)


def test_a_group_with_an_environment_error_is_dropped_by_name_and_counted_per_trajectory():
    """A group's trajectories go on when one's environment raises; the error is that trajectory's
    (env/error 1, absent elsewhere), and `failed` names it for the worker to drop the group. An
    environment that cannot be made ends its trajectory before any turn, generating nothing."""
    from areal_flow.config.schema import SandboxConfig
    from areal_flow.rollout.turns import Turns

    class OneBuggy(Buggy):
        made = 0

        def __init__(self, row, *, sandbox=None):
            type(self).made += 1
            super().__init__(row, bug="step" if type(self).made == 2 else "none")

    class Calls(StandIn):
        """Answers every request, a group's with n answers, `<c>1</c>`."""

        def answer(self, body: dict) -> object:
            out = ids("<c>1</c>")
            one = {"text": "<c>1</c>", "output_ids": out, "meta_info": {
                "id": "x", "weight_version": "1", "finish_reason": {"type": "stop"},
                "output_token_logprobs": [[-0.5, t, None] for t in out]}}
            n = body["sampling_params"].get("n", 1)
            return [one] * n if n > 1 else one

    params = {"max_new_tokens": 20, "temperature": 1.0}

    async def go(url, turns):
        async with ServerPool([url]) as pool:
            return await turns.run_group(pool, TOK, {}, ids("Q:"), params, 3, "g5", seed=100)

    turns = Turns(OneBuggy, {}, SandboxConfig(), max_turns=2, token_budget=200, name="my_envs:OneBuggy")
    with serving(Calls) as url:
        got = asyncio.run(go(url, turns))
    assert [g.error is not None for g in got] == [False, True, False]
    assert [g.scalars["env/end_max_turns"] for g in got] == [1.0, 0.0, 1.0]  # ended by its error
    assert [g.scalars.get("env/error") for g in got] == [None, 1.0, None]
    assert re.fullmatch(r"environment my_envs:OneBuggy raised in 1 of 3 trajectories: step\(\) raised at "
                        r"test_turns.py:\d+ in step: RuntimeError: boom", turns.failed(got))
    assert turns.failed([dataclasses.replace(g, error=None) for g in got]) == ""

    class Unmade(Buggy):
        def __init__(self, row, *, sandbox=None):
            super().__init__(row, bug="init")

    with serving(Calls) as url:
        got = asyncio.run(go(url, Turns(Unmade, {}, SandboxConfig(), max_turns=2, token_budget=200)))
        assert Calls.calls == []  # nothing generated for a group none of whose environments exists
    assert all(g.output_ids == [] and g.error and g.scalars["env/error"] == 1.0 for g in got)
    assert re.fullmatch(r"__init__ raised at test_turns.py:\d+ in __init__: KeyError: 'answer'", got[0].error)


def test_a_held_out_answer_whose_environment_raised_scores_0_and_the_share_is_logged():
    from areal_flow.config.schema import SandboxConfig
    from areal_flow.controller.evaluation import held_out_accuracy
    from areal_flow.rollout.turns import Turns

    Scripted.SCRIPT = [("<c>1</c>", "stop", "1")] * 20
    turns = Turns(Buggy, {}, SandboxConfig(), max_turns=3, token_budget=200)
    scored = []

    async def score(text, reference):
        scored.append(text)
        return 1.0

    async def go(url):
        async with ServerPool([url]) as pool:
            return await held_out_accuracy(pool, TOK, [{"q": "Q:", "a": "#### 5"}], score, "q", "a", 50, turns)

    with serving(Scripted) as url:
        result = asyncio.run(go(url))
    assert scored == [] and result.accuracy == 0.0 and result.answers[0]["score"] == 0.0
    assert result.figures["env/error"] == 1.0
