"""The environment interface (envs/base.py) and `python_tool` (envs/python_tool.py): the policy's
code runs in the code sandbox, and whatever it does comes back as an observation."""

import asyncio
import os

import pytest

from areal_flow.envs.base import Environment, Step
from areal_flow.envs.registry import resolve_env
from areal_flow.data.observations import cut
from areal_flow.envs.python_tool import PythonTool, printable

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's namespaces need root, as on CI")


def steps(turns: list[str], **settings) -> list[Step]:
    """Each turn through one python_tool environment, in order, in an event loop of their own."""
    async def go():
        env = PythonTool({"question": "q"}, **settings)
        assert env.stop == (settings.get("close", "</python>"),)
        return [await env.step(t) for t in turns]

    return asyncio.run(go())


@needs_root
def test_a_tool_call_runs_in_the_sandbox_and_its_output_comes_back_in_tags():
    call, error, final = steps(["Let me add. <python>print(17 + 25)</python>",
                                "<python>import socket; socket.create_connection(('1.1.1.1', 53), timeout=1)</python>",
                                "The sum is 42."])
    assert call == Step("\n<output>\n42\n\n</output>\n", figures={**call.figures})
    assert call.figures["tool_calls"] == 1.0 and call.figures["tool_errors"] == 0.0 and not call.done
    # The network is not there: an error observation, not a crash of the rollout.
    assert error.observation.startswith("\n<output>\nerror: runtime_error: ") and error.figures["tool_errors"] == 1.0
    assert final == Step(done=True)  # no tool call: the final answer


@needs_root
def test_a_program_that_hangs_crashes_floods_or_prints_garbage_is_an_observation():
    hang, crash, flood, garbage, syntax, after = steps([
        "<python>while True: pass</python>",
        "<python>1 / 0</python>",
        "<python>print('x' * 5000)</python>",
        "<python>import sys; sys.stdout.write('a\\x00b\\xff\\tc')</python>",
        "<python>print(</python>",
        "<python>print('still here')</python>",
    ], wall_seconds=1.0, max_output_chars=100)
    assert "error: timeout after 1 s" in hang.observation and hang.figures["tool_errors"] == 1.0
    assert "error: runtime_error: ZeroDivisionError: division by zero" in crash.observation
    assert "x" * 100 + "\n[cut: 4901 more characters]\n</output>" in flood.observation
    assert "a?b? c" in garbage.observation  # a NUL, a non-ASCII character and a tab
    assert "error: runtime_error: SyntaxError" in syntax.observation
    assert "still here" in after.observation and after.figures["tool_errors"] == 0.0


@needs_root
def test_trajectories_share_the_workers_sandboxes_and_none_waits_on_another_s_failure():
    async def go():
        envs = [PythonTool({}, concurrency=2, wall_seconds=1.0) for _ in range(5)]
        turns = ["<python>import time; time.sleep(5)</python>"] + [f"<python>print({i} * 2)</python>" for i in range(4)]
        return await asyncio.gather(*(env.step(t) for env, t in zip(envs, turns)))

    slow, *fast = asyncio.run(go())
    assert "timeout" in slow.observation
    assert [s.observation.split("\n")[2] for s in fast] == ["0", "2", "4", "6"]


def test_tool_calls_are_read_from_the_end_of_the_turn_with_the_configured_tags():
    async def go():
        env = PythonTool({}, open="[[", close="]]")
        return env.tool_call("a [[print(1)]] b [[print(2)]]"), env.tool_call("no call"), env.tool_call("[[x]] after")

    assert asyncio.run(go()) == ("print(2)", None, None)


def test_text_is_made_printable_and_cut_with_a_marker():
    assert printable("ok\n\tα\x07") == "ok\n ??"
    assert cut("abcdef", 4) == "abcd\n[cut: 2 more characters]" and cut("abc", 4) == "abc"


class Echo(Environment):
    async def step(self, turn: str) -> Step:
        return Step(turn.upper(), done=True)


def test_environments_are_named_by_word_or_by_import_path_and_bad_names_are_refused():
    assert resolve_env("python_tool", "graph.generate.env") is PythonTool
    assert resolve_env(f"{__name__}:Echo", "graph.generate.env") is Echo
    with pytest.raises(ValueError, match=r"graph.generate.env: no environment 'calculator'; built in: code_feedback, python_tool"):
        resolve_env("calculator", "graph.generate.env")
    with pytest.raises(ValueError, match=r"graph.generate.env: cannot import 'no_such_pkg'"):
        resolve_env("no_such_pkg:Env", "graph.generate.env")
    with pytest.raises(ValueError, match=r"'os:getcwd' is not a subclass of areal_flow.envs.base.Environment"):
        resolve_env("os:getcwd", "graph.generate.env")


def test_bad_python_tool_settings_are_refused_by_name():
    async def make(**settings):
        return PythonTool({}, **settings)

    with pytest.raises(ValueError, match="python_tool: .*unexpected keyword argument 'timeout'"):
        asyncio.run(make(timeout=3))
    with pytest.raises(ValueError, match="python_tool: 'close' must be a non-empty string"):
        asyncio.run(make(close=""))
    with pytest.raises(ValueError, match="python_tool: wall_seconds must be > 0"):
        asyncio.run(make(wall_seconds=0))
    with pytest.raises(ValueError, match=r"concurrency in 1\.\.64"):
        asyncio.run(make(concurrency=65))


@needs_root
def test_the_bootstrap_traces_show_the_very_observation_the_tool_gives():
    """tiny_arith_tool's reference traces (models/tasks.py) teach the model to read the tool's answer:
    their observation is what python_tool gives back for the same call, character for character."""
    from areal_flow.models.tasks import tool_completion

    (call, trained), (observation, untrained), (final, _) = tool_completion(123, 4567)
    assert trained and not untrained and final == "#### 4690"
    (step,) = steps([call])
    assert step.observation == observation and step.figures["tool_errors"] == 0.0
