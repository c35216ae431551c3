"""The run's generation servers as the controller watches them: the policy's, through the weight
publisher that loads each new version on them, and each judge's (frozen models: counted and
watched, never sent weights). A scaled run's servers are those its membership files name
(generation/client/membership.py), followed while it runs."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import partial

from areal_flow.config.schema import RunConfig
from areal_flow.controller.ledger import Ledger
from areal_flow.controller.publisher import WeightPublisher, server_counts
from areal_flow.generation.client.generation_client import wait_healthy
from areal_flow.generation.client.membership import follow, servers_of
from areal_flow.generation.client.router import ServerPool
from areal_flow.runtime.spec import RunSpec
from areal_flow.weights import make_channel
from areal_flow.weights.channel import SendByTrainers


@dataclass
class Servers:
    policy: WeightPublisher
    judges: dict[str, ServerPool]  # judge node -> its servers

    @classmethod
    def of(cls, cfg: RunConfig, spec: RunSpec, graph, trainers: SendByTrainers) -> Servers:
        """The run's servers; `trainers`: has the trainer ranks send a version (publisher.py)."""
        names, urls = servers_of(spec.run_dir, spec.gen_names, spec.gen_urls)
        publisher = WeightPublisher(urls, names, make_channel(cfg, spec), interrupt=cfg.rollout.interrupt,
                                    pause_mode=cfg.rollout.pause_mode, config=cfg.rollout, api_key=spec.api_key,
                                    trainers=trainers, colocated=graph.colocated)
        judges = {n.name: ServerPool(*reversed(servers_of(spec.run_dir, spec.judge_names(n.name), spec.judge_urls(n.name),
                                                          judge=n.name)), cfg.rollout, api_key=spec.api_key)
                  for n in graph.judges}
        return cls(publisher, judges)

    def pools(self) -> dict[str, ServerPool]:
        """Every pool by judge name, the policy's as ""."""
        return {"": self.policy.pool, **self.judges}

    async def healthy(self, spec: RunSpec, timeout: float) -> None:
        """Wait until each server the launcher started (the policy's, the judges') answers /health."""
        urls = {**dict(zip(spec.gen_names, spec.gen_urls)),
                **{name: url for node in self.judges for name, url in zip(spec.judge_names(node), spec.judge_urls(node))}}
        await asyncio.gather(*[asyncio.to_thread(wait_healthy, url, timeout, spec.api_key, name)
                               for name, url in urls.items()])

    def follow(self, run_dir: str, ledger: Ledger) -> list[asyncio.Task]:
        """Follow the servers a scale adds or removes (`python -m areal_flow.scale`), each change a
        `scale` event of the ledger. The policy's pool ("") takes a new server while it joins: it
        loads the current weights on it."""
        def record(epoch: int, changes: dict, judge: str) -> None:
            ledger.write("scale", **({"judge": judge} if judge else {}), epoch=epoch, **changes)

        return [asyncio.create_task(follow(pool, run_dir, "controller", partial(record, judge=judge),
                                           joining=not judge, judge=judge))
                for judge, pool in self.pools().items()]

    async def counts(self) -> dict[str, float]:
        """The policy's servers' counts so far (publisher.server_counts), and each judge's as
        `<judge>/<count>`."""
        counts = await self.policy.server_counts()
        for name, pool in self.judges.items():
            counts.update({f"{name}/{k}": v for k, v in (await server_counts(pool.clients)).items()})
        return counts

    async def unresponsive(self) -> list[str]:
        """The servers, the judges' included, that do not answer /health."""
        frozen = await self.policy.unresponsive()
        for pool in self.judges.values():
            frozen += await pool.unresponsive()
        return frozen

    async def close(self) -> None:
        await self.policy.close()
        for pool in self.judges.values():
            await pool.close()
