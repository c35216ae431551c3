"""A judge's prompt (rendered, fitted to its context) and its answers through a pool of its servers."""

import asyncio

import msgspec
import pytest
from judge_graphs import build, with_judge

from areal_flow.models.tokenizer import build_char_tokenizer
from areal_flow.rollout.judge import Judge, JudgeError, fit, prompt_ids, render
from areal_flow.transport.messages import PromptGroup

TOK = build_char_tokenizer()


def judge_node(template="{prompt}#{response}"):
    return build(with_judge(template=template)).nodes["judge"]


def test_the_prompt_renders_raw_fields_and_the_response():
    assert render("Q {prompt} A {response}", {"prompt": "1+2=", "answer": "3"}, "#### 3") == "Q 1+2= A #### 3"
    ids = prompt_ids(TOK, judge_node(), {"prompt": "1+2="}, "3")
    assert TOK.decode(ids) == "1+2=#3"


def test_a_response_too_long_for_the_judge_keeps_its_tail():
    node = judge_node()
    ids, cut = fit(TOK, node, {"prompt": "1+2="}, "1111111111#### 3", room=10)
    assert (TOK.decode(ids), cut) == ("1+2=#" + "### 3", True)  # one token a character: the last 5 of 16 kept
    assert fit(TOK, node, {"prompt": "1+2="}, "3", room=10) == (prompt_ids(TOK, node, {"prompt": "1+2="}, "3"), False)


class Pool:
    """Stands in for a ServerPool: records each request, answers from a script of finish reasons."""

    servers = [type("S", (), {"name": "judge_server0"})()]

    def __init__(self, reasons):
        self.reasons, self.requests = list(reasons), []

    async def generate(self, ids, params, *, rid, key, return_logprob):
        self.requests.append((rid, key, params, return_logprob))
        reason = self.reasons.pop(0) if self.reasons else "stop"
        return {"output_ids": [5, 6, 1], "meta_info": {"finish_reason": {"type": reason}}}


def test_each_sample_is_judged_on_the_groups_server_and_an_abort_is_asked_again():
    pool = Pool(["abort"])
    judge = Judge(judge_node(), pool, TOK, positions=64, max_new_tokens=8, retries=2)
    outs = asyncio.run(judge.group({"prompt": "1+2="}, ["#### 3", "#### 4"], group_id=12))
    assert [o["ids"] for o in outs] == [[5, 6, 1]] * 2 and outs[0]["tokens"] == 3.0 and outs[0]["cut"] == 0.0
    assert sorted(r[0] for r in pool.requests) == ["g12-0-judge-0", "g12-0-judge-1", "g12-1-judge-0"]
    assert {r[1] for r in pool.requests} == {"g12"} and not pool.requests[0][3]
    assert pool.requests[0][2] == {"max_new_tokens": 8, "temperature": 0.0, "top_p": 1.0}
    with pytest.raises(JudgeError, match=r"node 'judge': group 12 sample 0: aborted 3 times on its servers "
                                         r"\(judge_server0\)"):
        asyncio.run(Judge(judge_node(), Pool(["abort"] * 3), TOK, 64, 8, 2).sample({"prompt": "1"}, "", 12, 0))


def test_a_prompt_group_carries_the_raw_fields_and_an_old_one_decodes():
    group = PromptGroup(1, "p1", {"prompt": "Q: 1+2="}, 4, 0.0, raw={"prompt": "1+2="})
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(group), type=PromptGroup) == group
    old = msgspec.msgpack.encode({"group_id": 1, "prompt_id": "p1", "fields": {}, "group_size": 4, "birth_time": 0.0})
    assert msgspec.msgpack.decode(old, type=PromptGroup).raw == {}
