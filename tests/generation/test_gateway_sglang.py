"""The gateway in front of SGLang (agents/sglang_wire.py): each call asks SGLang for its exact
tokens, and the answer is put where the gateway reads the embedded server's. Against the SGLang
stand-in as a real subprocess (tests/generation/sglang_standin: SGLang 0.5.13's OpenAI answers), an
agent's conversation is recorded exactly as the same conversation through the embedded server."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from generation_helpers import running_server, save_chat_model

from areal_flow.agents import sglang_wire
from areal_flow.agents.gateway import Gateway
from areal_flow.generation.client.generation_client import wait_healthy
from areal_flow.generation.client.router import ServerPool
from areal_flow.runtime.ports import free_ports

openai = pytest.importorskip("openai")

STANDIN = Path(__file__).resolve().parent / "sglang_standin"
TOOLS = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object", "properties": {}}}}]


def sglang_choice(**meta) -> dict:
    return {"index": 0, "message": {"role": "assistant", "content": "ab"}, "finish_reason": "stop",
            "logprobs": {"content": []}, "prompt_token_ids": [5, 6, 7],
            "meta_info": {"output_token_logprobs": [[-0.5, 11, None], [-0.25, 12, None]], "weight_version": "3",
                          "finish_reason": {"type": "stop", "matched": 2}, **meta}}


def test_each_call_asks_sglang_for_its_tokens_keeping_the_agent_s_own_logprobs():
    chat = sglang_wire.ask({"messages": [], "logprobs": None})
    assert chat["logprobs"] is True and chat["return_meta_info"] is True and chat["return_prompt_token_ids"] is True
    assert sglang_wire.ask({"prompt": "x"})["logprobs"] == 1  # completions: a count, 0 may read as none
    assert sglang_wire.ask({"prompt": "x", "logprobs": 3})["logprobs"] == 3


def test_an_sglang_answer_gets_the_embedded_server_s_token_fields():
    answer = sglang_wire.normalised({"choices": [sglang_choice(), sglang_choice(
        weight_versions=[{"start": 1, "end": 2, "version": "4"}])]}, asked_logprobs=None)
    assert answer["prompt_token_ids"] == [5, 6, 7]
    first, second = answer["choices"]
    assert first["token_ids"] == [11, 12] and first["output_token_logprobs"] == [-0.5, -0.25]
    assert first["output_token_versions"] == [3, 3] and second["output_token_versions"] == [3, 4]
    assert first["matched_stop"] == 2 and first["weight_version"] == "3"
    assert "meta_info" not in first and "prompt_token_ids" not in first
    assert first["logprobs"] is None  # the agent asked for none
    kept = sglang_wire.normalised({"choices": [sglang_choice()]}, asked_logprobs=True)["choices"][0]
    assert kept["logprobs"] == {"content": []}


@pytest.mark.parametrize("drop", ["meta_info", "prompt_token_ids"])
def test_an_sglang_too_old_to_return_token_ids_is_named(drop):
    choice = sglang_choice()
    del choice[drop]
    with pytest.raises(sglang_wire.SGLangAnswerError, match=r"choice 0 .* SGLang 0\.5\.13 or later"):
        sglang_wire.normalised({"choices": [choice]}, None)


def standin(model: str):
    port, = free_ports(1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(STANDIN), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port),
                             "--device", "cpu", "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=60)
    except BaseException:
        proc.kill()
        raise
    return proc, url


async def agent(client, model: str) -> tuple:
    """A tool-calling conversation of two calls, then a completions call."""
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    first = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=6,
                                                 temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "tool", "content": "5"}]
    second = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=6,
                                                  temperature=0, logprobs=True)
    text = await client.completions.create(model=model, prompt="def f(", max_tokens=4, temperature=0)
    return first, second, text


def through_gateway(url: str, model: str, tokenizer, backend: str):
    async def main():
        async with ServerPool([url]) as pool:
            gateway = Gateway(pool, tokenizer=tokenizer, backend=backend)
            await gateway.start()
            try:
                client = openai.AsyncOpenAI(base_url=gateway.base_url("k"), api_key="unused", max_retries=0)
                return await agent(client, model), gateway.take("k")
            finally:
                await gateway.stop()

    return asyncio.run(main())


@pytest.mark.slow
def test_an_agent_through_the_gateway_to_sglang_is_recorded_as_through_the_embedded_server(tmp_path):
    model = str(tmp_path / "m")
    tokenizer = save_chat_model(tmp_path / "m")
    proc, url = standin(model)
    try:
        (first, second, text), sglang = through_gateway(url, model, tokenizer, "sglang")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    with running_server(model) as server:
        (e_first, e_second, e_text), embedded = through_gateway(server.url, model, tokenizer, "embedded")

    # The agent's answers are the embedded server's: text, tool calls, finish reasons ...
    assert first.choices[0].message.content == e_first.choices[0].message.content
    assert second.choices[0].message == e_second.choices[0].message and text.choices[0].text == e_text.choices[0].text
    assert first.choices[0].logprobs is None and second.choices[0].logprobs.content  # as each call asked
    assert "meta_info" not in first.choices[0].model_extra
    # ... and the record is token for token the same: one trajectory of the two chat calls, the tool's
    # result masked, the completions call a trajectory of its own.
    assert sglang.calls == 3 and sglang.drifts == 0 and len(sglang.trajectories) == 2
    for ours, theirs in zip(sglang.trajectories, embedded.trajectories, strict=True):
        assert ours.prompt_ids == theirs.prompt_ids and ours.output_ids == theirs.output_ids
        assert ours.loss_mask == theirs.loss_mask and ours.versions == theirs.versions == [0] * len(ours.versions)
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-4)
    assert sglang.trajectories[0].loss_mask.count(0) > 0 and sglang.trajectories[0].calls == 2
