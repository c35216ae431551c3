"""The rollout worker: generates the prompt groups the controller admits to it, each sample with
one `/generate` request, survives interruptions, and pushes the generated group to the reward pool.

It offers the controller `slots` generation slots once, at start; the controller fills them as
admission allows and frees a slot when its group is scored, so the controller alone decides how far
generation runs ahead (controller/staleness.py, controller/slots.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import numpy as np
import zmq
import zmq.asyncio

from areal_flow.agents.runner import AgentFailed
from areal_flow.config.schema import RunConfig
from areal_flow.generation.client.membership import follow, servers_of
from areal_flow.generation.client.router import ServerPool
from areal_flow.generation.client.seeds import group_seed
from areal_flow.graph.dag import graph_from_config
from areal_flow.graph.keys import JUDGE_STATS, KEYS
from areal_flow.models.tokenizer import load_tokenizer
from areal_flow.rollout.judge import make_judge
from areal_flow.rollout.live import LiveGroup
from areal_flow.rollout.requests import generate_group
from areal_flow.rollout.runners import runner_of
from areal_flow.rollout.turns import Turns
from areal_flow.runtime.spec import RunSpec
from areal_flow.transport.channels import make_socket, recv, send, sent_bytes
from areal_flow.transport.trajectory import Trajectory
from areal_flow.transport.messages import (
    AdmitRequest,
    Admitted,
    Array,
    GeneratedGroup,
    PromptGroup,
    Released,
    KeepLive,
    Live,
    Resend,
    Sample,
)

log = logging.getLogger("areal_flow.rollout")


class RolloutWorker:
    def __init__(self, cfg: RunConfig, spec: RunSpec, name: str, rank: int):
        self.name = name
        self.seed = cfg.seed
        algo = cfg.algorithm
        self.params = {"max_new_tokens": algo.max_new_tokens, "temperature": algo.temperature, "top_p": algo.top_p}
        self.tokenizer = load_tokenizer(spec.model_path)
        # The servers serving now (a scaled run's, generation/client/membership.py), followed as they change.
        names, urls = servers_of(spec.run_dir, spec.gen_names, spec.gen_urls)
        self.pool = ServerPool(urls, names, config=cfg.rollout, api_key=spec.api_key)
        self.run_dir = spec.run_dir
        # Every worker holds an equal share of the concurrency the controller may grant.
        self.slots = max(1, cfg.rollout.max_concurrent // spec.n_rollout)
        ctx = zmq.asyncio.Context()
        self.controller = make_socket(ctx, zmq.DEALER, connect=spec.endpoint("controller", spec.controller_port), identity=name,
                                      security=spec.security)
        self.rewards = make_socket(ctx, zmq.PUSH, bind=spec.endpoint(f"rollout{rank}", spec.rollout_ports[rank]),
                                   security=spec.security)
        graph = graph_from_config(cfg)
        # Write what the recipe declares, under the names it gives: well-known key -> name.
        self.keys = {graph.meaning[k]: k for k in graph.generate.outputs}
        self.prompt_key = graph.dataset_input(graph.generate)
        # Each judge, and the key its answer goes under (docs/judge.md).
        self.judges = [(make_judge(cfg, spec, node), graph.output(node, "judge_ids")) for node in graph.judges]
        # None: one turn a sample; else an environment's turns or an agent's calls.
        self.turns = runner_of(graph.generate, cfg, spec.model_path)
        self.tasks: set[asyncio.Task] = set()
        self.error: BaseException | None = None
        # Generated groups not yet scored and routed: sent again should a reward worker die with them.
        self.kept: dict[int, GeneratedGroup] = {}
        self.released: set[int] = set()  # released before this worker finished them (a copy won)
        # Multi-turn groups generating, each trajectory's state at its last turn's boundary: what a
        # checkpoint keeps of them (rollout/live.py).
        self.live: dict[int, LiveGroup] = {}

    async def run(self) -> None:
        main_task = asyncio.current_task()

        def done(task: asyncio.Task) -> None:
            self.tasks.discard(task)
            if not task.cancelled() and task.exception() is not None:
                # A lost rollout would silently shrink the run: fail the whole process instead.
                self.error = task.exception()
                main_task.cancel()

        await send(self.controller, AdmitRequest(self.name, self.slots))
        following = [asyncio.create_task(follow(self.pool, self.run_dir, self.name)),
                     *(asyncio.create_task(follow(judge.pool, self.run_dir, self.name, judge=judge.node.name))
                       for judge, _ in self.judges)]
        for task in following:
            task.add_done_callback(done)
        try:
            while True:  # until the launcher stops this process
                msg = await recv(self.controller, f"{self.name} controller")
                if isinstance(msg, Released):
                    for g in msg.group_ids:
                        if self.kept.pop(g, None) is None:
                            self.released.add(g)
                    continue
                if isinstance(msg, KeepLive):  # the controller saves a checkpoint
                    await send(self.controller, Live(msg.request, {g: k for g, group in self.live.items()
                                                                   if (k := group.now())}))
                    continue
                if isinstance(msg, Resend):
                    log.warning("%s: a reward worker restarted: sending %d group(s) again", self.name, len(self.kept))
                    for group in list(self.kept.values()):
                        await send(self.rewards, group)
                    continue
                if not isinstance(msg, Admitted):
                    log.error("%s: a %s from the controller is not an admission, dropped", self.name, type(msg).__name__)
                    continue
                for group in msg.groups:
                    self.pool.newest(group.policy_version)
                    task = asyncio.create_task(self.rollout(group))
                    self.tasks.add(task)
                    task.add_done_callback(done)
        except asyncio.CancelledError:
            if self.error is not None:
                raise self.error from None
            raise
        finally:
            for t in [*following, *self.tasks]:
                t.cancel()

    def arrays(self, values: dict) -> dict[str, Array]:
        """The generated values the recipe declares, under its names and in their wire dtypes."""
        return {name: Array.of(np.asarray(values[known], dtype=KEYS[known].dtype)) for known, name in self.keys.items()}

    async def rollout(self, group: PromptGroup) -> None:
        prompt_ids = self.tokenizer.encode(group.fields[self.prompt_key], add_special_tokens=False)
        # One request for the group: it goes to the least-loaded server, which prefills the prompt once.
        requested = time.time()
        seed = group_seed(self.seed, group.group_id, group.group_size)
        if self.turns is None:
            outs = [Trajectory.one_turn(prompt_ids, o) for o in await generate_group(
                self.pool, prompt_ids, self.params, group.group_size, f"g{group.group_id}", seed=seed)]
        else:  # every sample its own trajectory: they part at the first turn's first token
            try:
                self.live[group.group_id] = live_group = LiveGroup([None] * group.group_size)
                outs = await self.turns.run_group(self.pool, self.tokenizer, group.fields, prompt_ids, self.params,
                                                  group.group_size, f"g{group.group_id}", seed, kept=group.kept,
                                                  group=live_group)
            except AgentFailed as e:  # dropped by name: the controller's ledger records why
                log.error("%s: group %d: %s", self.name, group.group_id, e)
                await self.finish(GeneratedGroup(group.group_id, [], times={"requested": requested}, problem=str(e)))
                return
            finally:
                self.live.pop(group.group_id, None)
        generated = time.time()
        # An environment that raised ended its trajectory: the group is dropped, naming the error,
        # and its samples go along for the controller to count (controller/rollout_failures.py).
        problem = self.turns.failed(outs) if isinstance(self.turns, Turns) else ""
        if problem:
            log.warning("%s: group %d: %s", self.name, group.group_id, problem)
        samples = [
            Sample(
                uid=f"g{group.group_id}-{i}",
                prompt_id=group.prompt_id,
                group_id=group.group_id,
                index=i,
                birth_time=group.birth_time,
                # An agent's rollout whose calls drifted shows where, in the sample dump.
                fields={**group.fields, "agent_drift": json.dumps(o.drift)} if o.drift else group.fields,
                arrays=self.arrays(o.arrays()),
                finish=o.finish,
                scalars=dict(o.scalars),
                served=o.served,
            )
            for i, o in enumerate(outs)
        ]
        # Stage times: the ledger's account of where a group's time goes (advise/fit.py reads them).
        times = {"requested": requested, "generated": generated}
        if self.judges:
            await self.judge(group, samples)
            times["judged"] = time.time()
        await self.finish(GeneratedGroup(group.group_id, samples, times=times, problem=problem))

    async def finish(self, group: GeneratedGroup) -> None:
        """Send a generated group to the reward pool, kept until the controller releases it."""
        if group.group_id in self.released:  # another copy was scored first (this worker restarted)
            self.released.discard(group.group_id)
            return
        group.traffic = {self.name: sent_bytes()}
        self.kept[group.group_id] = group
        await send(self.rewards, group)

    async def judge(self, group: PromptGroup, samples: list[Sample]) -> None:
        """Every judge's answer to each sample, side by side, under the judge's key with its scalars."""
        texts = [self.tokenizer.decode(s.array(self.keys["output_ids"]).tolist(), skip_special_tokens=True)
                 for s in samples]
        answers = await asyncio.gather(*[judge.group(group.raw, texts, group.group_id) for judge, _ in self.judges])
        for (judge, key), outs in zip(self.judges, answers):
            for sample, out in zip(samples, outs):
                sample.arrays[key] = Array.of(np.asarray(out["ids"], dtype=KEYS["judge_ids"].dtype))
                sample.scalars.update({f"{judge.node.name}_{stat}": out[stat] for stat in JUDGE_STATS})


def main(cfg: RunConfig, spec: RunSpec, name: str, rank: int) -> None:
    async def run() -> None:  # sockets are made inside the loop they belong to
        await RolloutWorker(cfg, spec, name, rank).run()

    asyncio.run(run())
