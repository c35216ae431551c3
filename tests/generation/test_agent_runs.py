"""An agent's rollouts (agents/runner.py) against a real server, through the runner's gateway: the
agent's calls become one sample with what it added between them masked and its reward kept; the
run's sampling is forced on every call; a drifting agent's sample is its last trajectory only; and
an agent that raises, never returns, makes no call or returns no reward fails its rollout by name,
run again before its group is given up, with nothing left behind on the gateway."""

from __future__ import annotations

import asyncio
import time

import pytest
from generation_helpers import running_server, save_chat_model

from areal_flow.generation.client.router import ServerPool
from areal_flow.agents.runner import AgentFailed, AgentRunner

pytest.importorskip("openai")  # the agents extra's; not on the GPU image
pytestmark = pytest.mark.slow  # a server and Hydra composes: 8-11 s; the fast tier keeps its 3 minutes

ADDED = " tool: 5\n"  # what the agents add between calls (a tool's result)
PARAMS = {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tokenizer = save_chat_model(path)
    with running_server(str(path)) as server:
        yield str(path), tokenizer, server


async def two_calls(client, row, edit: bool = False, **kw) -> float:
    kw = {"model": "policy", **kw}
    first = await client.completions.create(prompt=row["prompt"], **kw)
    said = first.choices[0].text
    if edit:  # its own answer changed before it is sent back: what a history-rewriting template does
        said = said[:1] + "!" + said[2:]
    await client.completions.create(prompt=row["prompt"] + said + ADDED, **kw)
    return 0.75


def rollouts(model_path, server, agent, n=1, retries=1, wall=30.0, params=PARAMS, seed=7, roles=(),
             on_drift="last_segment"):
    runner = AgentRunner(agent, "tests:agent", model_path, wall, retries, roles, on_drift=on_drift)

    async def go():
        async with ServerPool([server.url]) as pool:
            try:
                got = await runner.run_group(pool, None, {"prompt": "Q: 2+3"}, [], params, n, "g0", seed)
            finally:
                assert not runner.gateway.recorders and not runner.gateway.sampling  # nothing left behind
                await runner.close()
            return got

    return asyncio.run(go())


def test_an_agent_s_calls_become_one_sample_with_what_it_added_masked_and_its_reward(served):
    model, tokenizer, server = served
    (got,) = rollouts(model, server, two_calls)
    assert got.prompt_ids == tokenizer.encode("Q: 2+3", add_special_tokens=False)
    added = tokenizer.encode(ADDED, add_special_tokens=False)
    assert got.loss_mask == [1] * 4 + [0] * len(added) + [1] * 4
    assert got.output_ids[4:4 + len(added)] == added
    assert len(got.logprobs) == len(got.versions) == len(got.output_ids)
    assert got.scalars == pytest.approx({"agent/reward": 0.75, "agent/calls": 2, "agent/drifts": 0,
                                            "agent/drift_rate": 0, "agent/segments_per_rollout": 1, "agent/failed_runs": 0,
                                            "agent/dropped_tokens": 0,
                                            "agent/resumes": 0, "agent/seconds": got.scalars["agent/seconds"]})
    assert got.drift is None


def test_the_run_s_sampling_is_forced_on_every_call_whatever_the_agent_asks(served):
    model, _, server = served

    async def hot(client, row):  # another model name and a hot temperature: both replaced
        return await two_calls(client, row, model="not-the-policy", temperature=1.9)

    greedy = {**PARAMS, "temperature": 0.0}
    a, b = (rollouts(model, server, hot, params=greedy, seed=s)[0].output_ids for s in (1, 2))
    assert a == b  # greedy, whatever the seed: the run's temperature 0 was used
    c, d = (rollouts(model, server, hot, params=PARAMS, seed=s)[0].output_ids for s in (1, 2))
    assert c == rollouts(model, server, hot, params=PARAMS, seed=1)[0].output_ids != d  # seeded by the rollout


def test_a_drifting_agent_s_sample_is_its_last_trajectory_only_with_the_drift_counted_and_warned(served, caplog):
    """The segment before the drift is not trained: its answer's tokens are counted as dropped, and
    the worker warns once, naming the agent and where the history left the recorded tokens."""
    model, tokenizer, server = served

    async def drifting(client, row):
        return await two_calls(client, row, edit=True)

    with caplog.at_level("WARNING", logger="areal_flow.rollout"):
        (got,) = rollouts(model, server, drifting, n=2)[:1]
    assert got.scalars["agent/drifts"] == 1 and got.scalars["agent/drift_rate"] == 0.5
    assert got.scalars["agent/segments_per_rollout"] == 2 and got.scalars["agent/dropped_tokens"] == 4
    warned = [r.getMessage() for r in caplog.records if "a drift" in r.getMessage()]
    assert len(warned) == 1, warned  # once a worker, though both rollouts drifted
    assert warned[0].startswith("agent tests:agent: a call's history left the recorded tokens at token ")
    assert "4 policy tokens dropped" in warned[0]
    # The edited history is the sample's prompt, never trained; only the last answer is the policy's.
    prompt = tokenizer.decode(got.prompt_ids)
    assert prompt[len("Q: 2+3") + 1] == "!" and prompt.endswith(ADDED)
    assert got.loss_mask == [1] * 4 and len(got.output_ids) == 4
    assert got.drift["position"] == len(tokenizer.encode("Q: 2+3", add_special_tokens=False)) + 1


def test_with_agent_drift_drop_a_drifting_rollout_fails_naming_the_drift_and_nothing_of_it_is_trained(served):
    model, _, server = served

    async def drifting(client, row):
        return await two_calls(client, row, edit=True)

    with pytest.raises(AgentFailed, match=r"rollout g0-0 failed 2 run\(s\) .*agent tests:agent: a call's history "
                                          r"left the recorded tokens at token \d+ \(a drift; "
                                          r"graph.generate.agent_drift=drop\)"):
        rollouts(model, server, drifting, on_drift="drop")
    (got,) = rollouts(model, server, two_calls, on_drift="drop")  # no drift: trained as always
    assert got.scalars["agent/drifts"] == 0 and got.scalars["agent/calls"] == 2


def test_an_agent_that_raises_is_run_again_then_fails_its_group_by_name(served):
    model, _, server = served
    runs = []

    async def once_broken(client, row):
        runs.append(1)
        if len(runs) == 1:
            raise RuntimeError("the tool server is down")
        return await two_calls(client, row)

    (got,) = rollouts(model, server, once_broken)
    assert got.scalars["agent/failed_runs"] == 1 and got.scalars["agent/calls"] == 2

    async def broken(client, row):
        await client.completions.create(model="policy", prompt=row["prompt"], max_tokens=2)
        raise RuntimeError("the tool server is down")

    with pytest.raises(AgentFailed, match=r"rollout g0-\d failed 3 run\(s\) \(graph.generate.agent_retries=2\): "
                                          r"agent tests:agent: RuntimeError: the tool server is down"):
        rollouts(model, server, broken, n=2, retries=2)


def test_an_agent_that_never_returns_is_cut_at_its_wall_time(served):
    model, _, server = served

    async def stuck(client, row):
        await client.completions.create(model="policy", prompt=row["prompt"], max_tokens=2)
        await asyncio.sleep(3600)

    t0 = time.monotonic()
    with pytest.raises(AgentFailed, match=r"agent tests:agent did not return within 0.5 s "
                                          r"\(graph.generate.agent_wall_seconds\)"):
        rollouts(model, server, stuck, retries=1, wall=0.5)
    assert time.monotonic() - t0 < 10  # two runs of 0.5 s, not an hour


@pytest.mark.parametrize("agent, why", [
    (lambda: "yes", r"returned 'yes', not a reward"),
    (lambda: float("nan"), r"not finite"),
    (lambda: 1.0, r"returned 1.0 without calling the policy"),
])
def test_an_agent_with_no_reward_or_no_call_fails_by_name(served, agent, why):
    model, _, server = served

    async def run(client, row):
        if agent() != 1.0:
            await client.completions.create(model="policy", prompt=row["prompt"], max_tokens=2)
        return agent()

    with pytest.raises(AgentFailed, match=why):
        rollouts(model, server, run, retries=0)


def test_per_turn_rewards_are_summed(served):
    model, _, server = served

    async def per_turn(client, row):
        await two_calls(client, row)
        return [0.5, 0.25, 1]

    (got,) = rollouts(model, server, per_turn)
    assert got.scalars["agent/reward"] == 1.75


async def solver_and_checker(clients, row):
    """Two roles of one policy: the checker reads the solver's answer."""
    said = (await clients["solver"].completions.create(model="policy", prompt=row["prompt"])).choices[0].text
    await clients["checker"].completions.create(model="policy", prompt=f"check {said}")
    return {"solver": 1.0, "checker": 0.25}


def test_two_roles_give_a_sample_each_a_rollout_the_group_role_by_role(served):
    model, tokenizer, server = served
    got = rollouts(model, server, solver_and_checker, n=4, roles=("solver", "checker"))
    prompts = [tokenizer.decode(g.prompt_ids) for g in got]
    assert prompts[:2] == ["Q: 2+3"] * 2 and all(p.startswith("check ") for p in prompts[2:])  # 2 rollouts x 2 roles
    assert [g.scalars["agent/reward"] for g in got] == [1.0, 1.0, 0.25, 0.25]  # each its role's reward
    assert all(g.scalars["agent/reward/solver"] == 1.0 and g.scalars["agent/reward/checker"] == 0.25
               and g.scalars["agent/calls"] == 1 for g in got)
    assert got[0].output_ids != got[1].output_ids  # rollouts seeded apart
    solver_said = [tokenizer.decode(g.output_ids) for g in got[:2]]
    assert prompts[2:] == [f"check {s}" for s in solver_said]  # the checker's sample is its own call's

    async def one_role(clients, row):
        await solver_and_checker(clients, row)
        return {"solver": 1.0}

    with pytest.raises(AgentFailed, match=r"returned \{'solver': 1.0\}, not a reward for each role of "
                                          r"graph.generate.agent_roles \(solver, checker\)"):
        rollouts(model, server, one_role, n=2, roles=("solver", "checker"), retries=0)


async def from_openai_docs(client, row) -> float:
    """An agent that uses only OpenAI's fields: no skip_special_tokens, no matched_stop. It stops
    each answer at a stop string, writes it back itself and adds a tool's result, as a ReAct agent does."""
    prompt = row["prompt"]
    for _ in range(3):
        out = await client.completions.create(model="policy", prompt=prompt, max_tokens=8, stop=["="])
        prompt += out.choices[0].text + "=" + ADDED
    return 1.0


def group_of_16(agent, served, seed: int = 11) -> list:
    """A group of 16 rollouts of `agent` (8-token answers) on the served model."""
    model, tokenizer, server = served
    runner = AgentRunner(agent, "tests:docs_agent", model, 30.0, 0)

    async def go():
        async with ServerPool([server.url]) as pool:
            try:
                return await runner.run_group(pool, tokenizer, {"prompt": "Q: 2+3"}, [], PARAMS | {
                    "max_new_tokens": 8}, 16, "g0", seed)
            finally:
                await runner.close()
    return asyncio.run(go())


def assert_no_drift_though_special_tokens_were_sampled(got: list, tokenizer) -> None:
    specials = {tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens} - {tokenizer.eos_token_id}
    sampled = sum(1 for s in got for t, m in zip(s.output_ids, s.loss_mask) if m and t in specials)
    assert sampled > 0  # the text of these answers left tokens out
    assert all(s.scalars["agent/drifts"] == 0 and s.scalars["agent/calls"] == 3 for s in got)
    # One trajectory a rollout, holding its three answers: nothing dropped.
    assert all(s.scalars["agent/dropped_tokens"] == 0 and s.scalars["agent/segments_per_rollout"] == 1 for s in got)


def test_an_agent_written_from_openai_s_docs_alone_does_not_drift_though_its_text_leaves_tokens_out(served,
                                                                                                    monkeypatch):
    """The policy samples special tokens (5 of the tokenizer's 101), which OpenAI's text leaves out, and
    stop strings, which it leaves out too: the gateway maps the text the agent sends back onto the
    tokens it stands for (agents/text_map.py), so no call drifts. Tokenizing the text instead, as
    before, the same rollouts drift."""
    from areal_flow.agents import text_map

    assert_no_drift_though_special_tokens_were_sampled(group_of_16(from_openai_docs, served), served[1])
    monkeypatch.setattr(text_map.TextMap, "tokens", lambda self, prompt, encode: encode(prompt))
    assert sum(s.scalars["agent/drifts"] for s in group_of_16(from_openai_docs, served)) > 0  # text tokenized again


async def chat_from_openai_docs(client, row) -> float:
    """A chat agent as OpenAI's documentation writes one: it appends the message the client returned
    and a message of its own, and calls again."""
    messages: list = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        out = await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
        messages += [out.choices[0].message, {"role": "user", "content": ADDED}]
    return 1.0


def test_a_chat_agent_written_from_openai_s_docs_does_not_drift_though_its_messages_leave_tokens_out(served,
                                                                                                   monkeypatch):
    """The messages the client returns leave out the special tokens the policy sampled, and the
    template ends each assistant turn with its own text where the policy stopped: the gateway maps
    the history back onto the policy's tokens (agents/chat_map.py), so no call drifts. Rendered by
    the server's template instead, the same rollouts drift."""
    from areal_flow.agents import chat_map

    assert_no_drift_though_special_tokens_were_sampled(group_of_16(chat_from_openai_docs, served), served[1])
    monkeypatch.setattr(chat_map.ChatMap, "tokens", lambda self, messages, tools: None)
    assert sum(s.scalars["agent/drifts"] for s in group_of_16(chat_from_openai_docs, served)) > 0  # rendered
