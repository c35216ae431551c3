"""The reward worker: takes generated groups from the rollout workers, runs every reward node of
the graph on each sample, and pushes the scored group to the controller."""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from areal_flow.graph.dag import Graph, graph_from_config
from areal_flow.models.tokenizer import load_tokenizer
from areal_flow.rewards.functions import REWARD_FNS
from areal_flow.runtime.spec import RunSpec
from areal_flow.transport.channels import endpoint, make_socket, recv, send
from areal_flow.transport.messages import GroupDone

log = logging.getLogger("areal_flow.reward")


def score_group(group: GroupDone, graph: Graph, tokenizer) -> GroupDone:
    """Write each reward node's output key into every sample's scalars."""
    for sample in group.samples:
        text = tokenizer.decode(sample.array("output_ids").tolist(), skip_special_tokens=True)
        for node in graph.rewards:
            reference = sample.fields[graph.dataset_input(node)]
            sample.scalars[node.outputs[0]] = float(REWARD_FNS[node.fn](text, reference))
    return group


async def serve(cfg, spec: RunSpec, name: str) -> None:
    graph = graph_from_config(cfg)
    tokenizer = load_tokenizer(spec.model_path)
    ctx = zmq.asyncio.Context()
    inbox = make_socket(ctx, zmq.PULL, connect=[endpoint(p) for p in spec.rollout_ports])
    outbox = make_socket(ctx, zmq.PUSH, connect=endpoint(spec.results_port))
    log.info("%s scoring with %s", name, [n.fn for n in graph.rewards])
    while True:  # until the launcher stops this process
        msg = await recv(inbox, f"{name} inbox")
        if not isinstance(msg, GroupDone):
            log.error("%s: unexpected %s on its inbox, dropped", name, type(msg).__name__)
            continue
        await send(outbox, score_group(msg, graph, tokenizer))


def main(cfg, spec: RunSpec, name: str, rank: int) -> None:
    asyncio.run(serve(cfg, spec, name))
