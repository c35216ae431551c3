"""A judge's prompt: its template over the dataset fields it reads and the policy's answer, as
token ids that fit the judge's context (docs/judge.md). No sockets: the launcher checks the
prompts with these before a process starts, and the rollout worker sends them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from areal_flow.graph.node import Node


class JudgeError(RuntimeError):
    """A judge could not answer a sample (its server aborted it more times than rollout.request_retries)."""


def render(template: str, raw: Mapping[str, str], response: str) -> str:
    """The judge's prompt text: `template` over the row's fields as in the data and `{response}`."""
    return template.format_map({**raw, "response": response})


def prompt_ids(tokenizer, node: Node, raw: Mapping[str, str], response: str) -> list[int]:
    """The judge's prompt as token ids, in its tokenizer's chat template when graph.<judge>.chat_template."""
    text = render(node.template or "", raw, response)
    if node.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def fit(tokenizer, node: Node, raw: Mapping[str, str], response: str, room: int) -> tuple[list[int], bool]:
    """(prompt ids, cut): the prompt within `room` tokens (the judge's context less its answer
    budget), keeping the tail of the response (where its final answer is) when the whole does not fit."""
    ids = prompt_ids(tokenizer, node, raw, response)
    if len(ids) <= room:
        return ids, False
    answer = tokenizer.encode(response, add_special_tokens=False)
    keep = len(answer) - (len(ids) - room)
    while keep > 0:
        ids = prompt_ids(tokenizer, node, raw, tokenizer.decode(answer[-keep:]))
        if len(ids) <= room:
            return ids, True
        keep -= len(ids) - room
    return prompt_ids(tokenizer, node, raw, ""), True


class Judge:
    """A judge as the rollout worker calls it: its servers' pool, tokenizer, context room and sampling."""

    def __init__(self, node: Node, pool, tokenizer, positions: int, max_new_tokens: int, retries: int):
        self.node, self.pool, self.tokenizer, self.retries = node, pool, tokenizer, retries
        self.room = positions - max_new_tokens
        self.params = {"max_new_tokens": max_new_tokens, "temperature": node.temperature, "top_p": 1.0}

    async def sample(self, raw: Mapping[str, str], response: str, group_id: int, index: int) -> dict:
        """The judge's answer to sample `index` of a group: `ids` (its token ids) and the scalars
        `seconds`, `tokens`, `cut` (the response was shortened to fit) and `truncated` (the answer
        hit its budget). All of a group's prompts go to one server (key `g<group>`), which shares
        their prefix. An answer aborted by a server (restarted under it) is asked again, whole."""
        ids, cut = fit(self.tokenizer, self.node, raw, response, self.room)
        rid, t0 = f"g{group_id}-{index}-{self.node.name}", time.perf_counter()
        for attempt in range(self.retries + 1):
            answer = await self.pool.generate(ids, self.params, rid=f"{rid}-{attempt}", key=f"g{group_id}",
                                              return_logprob=False)
            reason = answer["meta_info"]["finish_reason"]["type"]
            if reason != "abort":
                out = answer["output_ids"]
                return {"ids": out, "seconds": time.perf_counter() - t0, "tokens": float(len(out)),
                        "cut": float(cut), "truncated": float(reason == "length")}
        raise JudgeError(f"node '{self.node.name}': group {group_id} sample {index}: aborted {self.retries + 1} times "
                         f"on its servers ({', '.join(s.name for s in self.pool.servers)})")

    async def group(self, raw: Mapping[str, str], responses: list[str], group_id: int) -> list[dict]:
        """The judge's answers to a group's samples, side by side."""
        return await asyncio.gather(*[self.sample(raw, text, group_id, i) for i, text in enumerate(responses)])


def make_judge(cfg, spec, node: Node) -> Judge:
    """Judge `node` of a run: a pool of its servers, its model's tokenizer and context length."""
    from areal_flow.config.validate import model_context
    from areal_flow.generation.client.membership import servers_of
    from areal_flow.generation.client.router import ServerPool
    from areal_flow.models.tokenizer import load_tokenizer

    path = spec.judge_models[node.name]
    # The judge's servers serving now (a scaled run's: generation/client/membership.py), followed by the worker.
    names, urls = servers_of(spec.run_dir, spec.judge_names(node.name), spec.judge_urls(node.name), judge=node.name)
    pool = ServerPool(urls, names, cfg.rollout, api_key=spec.api_key)
    return Judge(node, pool, load_tokenizer(path), model_context(path),
                 node.max_new_tokens or cfg.algorithm.max_new_tokens, cfg.rollout.request_retries)
