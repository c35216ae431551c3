"""The controller process: admits prompt groups, collects scored groups, fires the batch nodes on
the oldest ones, and publishes each new policy version to the generation servers.

It holds the policy version and the sample buffer; it never runs a model. Three coroutines share
one event loop: `admission_loop` (rollout workers ask for work), `results_loop` (scored groups
arrive) and `train_loop` (the steps). `changed` wakes the train loop when the buffer or the
running set changes, so nothing polls.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Sequence

import numpy as np
import zmq
import zmq.asyncio

from areal_flow.controller.buffer import GroupBuffer
from areal_flow.controller.evaluation import held_out_accuracy
from areal_flow.controller.prompts import PromptStream
from areal_flow.controller.staleness import StalenessManager
from areal_flow.data.dataset import load_jsonl
from areal_flow.generation.client import GenerationClient, wait_healthy
from areal_flow.graph.dag import Node, graph_from_config
from areal_flow.metrics.writer import MetricsWriter
from areal_flow.models.tokenizer import load_tokenizer
from areal_flow.rewards.functions import REWARD_FNS
from areal_flow.runtime.spec import RunSpec
from areal_flow.transport.channels import endpoint, make_socket, recv, recv_from, send_to
from areal_flow.transport.messages import (
    AdmitRequest,
    GroupDone,
    Hello,
    NodeResult,
    Message,
    PromptGroup,
    RunNode,
    Sample,
    SaveCheckpoint,
    Saved,
)

log = logging.getLogger("areal_flow.controller")


class Controller:
    def __init__(self, cfg, spec: RunSpec):
        self.cfg, self.spec = cfg, spec
        self.graph = graph_from_config(cfg)
        algo = cfg.algorithm
        self.B, self.G = algo.batch_size, algo.group_size
        self.staleness = StalenessManager(algo.batch_size, cfg["async"].max_staleness, cfg["async"].max_concurrent)
        self.buffer = GroupBuffer()
        fields = list(cfg.dataset.fields)
        self.prompts = PromptStream(load_jsonl(spec.train_path, fields), cfg.dataset.seed)
        self.eval_rows = load_jsonl(spec.eval_path, fields)
        self.tokenizer = load_tokenizer(spec.model_path)
        reward_node = self.graph.rewards[0]
        self.reward_fn = REWARD_FNS[reward_node.fn]
        self.reward_key = reward_node.outputs[0]
        self.prompt_key = self.graph.dataset_input(self.graph.generate)
        self.reference_key = self.graph.dataset_input(reward_node)

        ctx = zmq.asyncio.Context()
        self.admission = make_socket(ctx, zmq.ROUTER, bind=endpoint(spec.admission_port))
        self.results = make_socket(ctx, zmq.PULL, bind=endpoint(spec.results_port))
        self.trainers = make_socket(ctx, zmq.ROUTER, bind=endpoint(spec.trainer_port))
        self.trainer_ids: dict[int, bytes] = {}
        self.pending: collections.deque[bytes] = collections.deque()  # admission requests waiting
        self.changed = asyncio.Event()
        self.closing = False
        self.next_group = 0
        self.gen_clients = [GenerationClient(url) for url in spec.gen_urls]
        self.metrics = MetricsWriter(spec.path("metrics.jsonl"), cfg.metrics.wandb, cfg.metrics.wandb_project,
                                     cfg.recipe)
        self.ledger = open(spec.path("ledger.jsonl"), "a", buffering=1)
        self.generated_tokens = 0
        self.trainer_busy = 0.0
        self.eval_seconds = 0.0  # spent on held-out evaluation, not counted as training time
        self.dropped = 0  # groups that came back unusable

    # ---- admission (DESIGN §4.1) -------------------------------------------------------

    async def admission_loop(self) -> None:
        while True:
            ident, msg = await recv_from(self.admission, "controller admission")
            if isinstance(msg, AdmitRequest):
                self.pending.append(ident)
                await self.grant()
            else:
                log.error("admission socket: unexpected %s, dropped", type(msg).__name__)

    async def grant(self) -> None:
        while self.pending and not self.closing and self.staleness.can_admit():
            ident = self.pending.popleft()
            row = self.prompts.next()
            gid, self.next_group = self.next_group, self.next_group + 1
            version = self.staleness.admit(gid)
            group = PromptGroup(gid, row["id"], row, self.G, time.time())
            self._ledger("admit", group=gid, prompt_id=row["id"], version=version)
            await send_to(self.admission, ident, group)

    async def results_loop(self) -> None:
        while True:
            msg = await recv(self.results, "controller results")
            if not isinstance(msg, GroupDone):
                log.error("results socket: unexpected %s, dropped", type(msg).__name__)
                continue
            if msg.group_id not in self.staleness.running:
                log.error("results socket: group %d is not running (a duplicate?), dropped", msg.group_id)
                continue
            if problem := group_problem(msg, self.G, self.graph.generate.outputs, self.reward_key):
                # Unusable, but accounted for: the group leaves the running set (else the staleness
                # rule would wait for it forever) and the ledger and summary say it was dropped.
                log.error("results socket: group %d dropped: %s", msg.group_id, problem)
                self.staleness.abandon(msg.group_id)
                self.dropped += 1
                self._ledger("drop", group=msg.group_id, reason=problem)
                self.changed.set()
                continue
            self.staleness.finish(msg.group_id)
            self.buffer.add(msg.group_id, msg.samples)
            self.generated_tokens += sum(s.n_tokens() for s in msg.samples)
            self._ledger("finish", group=msg.group_id)
            self.changed.set()
            await self.grant()

    # ---- batch nodes ------------------------------------------------------------------

    async def next_batch(self, step: int) -> list[list[Sample]]:
        while (ids := self.staleness.pick_batch(step)) is None:
            self.changed.clear()
            await self.changed.wait()
        self.staleness.trained(ids)
        return self.buffer.take(ids)

    async def from_every_rank(self, kind: type, what: str) -> dict[int, Message]:
        """One reply of type `kind` from each trainer rank, by rank."""
        replies: dict[int, Message] = {}
        while len(replies) < len(self.trainer_ids):
            _, msg = await recv_from(self.trainers, "controller trainers")
            if isinstance(msg, kind):
                replies[msg.rank] = msg
            else:
                log.error("trainer socket: unexpected %s while %s, dropped", type(msg).__name__, what)
        return replies

    async def run_node(self, node: Node, groups: list[list[Sample]], step: int) -> NodeResult:
        """Send each trainer rank its share of whole groups (balanced by tokens) and gather results."""
        shards = shard_groups(groups, len(self.trainer_ids))
        for rank, ident in self.trainer_ids.items():
            msg_samples = [s for g in shards[rank] for s in g]
            await send_to(self.trainers, ident, RunNode(node=node.name, step=step, samples=msg_samples))
        results = await self.from_every_rank(NodeResult, f"running {node.name}")
        by_uid = {s.uid: s for g in groups for s in g}
        for res in results.values():
            for uid, arrays in res.outputs.items():
                by_uid[uid].arrays.update(arrays)
        return results[0]

    async def publish(self, weights_path: str, version: int) -> float:
        """Load the new weights on every generation server (the client raises on a refusal)."""
        t0 = time.time()
        await asyncio.gather(*[c.update_weights_from_disk(weights_path, version) for c in self.gen_clients])
        return time.time() - t0

    async def train_loop(self) -> int:
        cfg, start, eval_before = self.cfg, time.time(), self.eval_seconds
        last, gen_busy_last = start, await self.gen_busy_seconds()
        step = 0
        for step in range(cfg.total_steps):
            training = time.time() - start - (self.eval_seconds - eval_before)  # evaluations do not count
            if cfg.max_wall_seconds and training > cfg.max_wall_seconds:
                log.info("wall-time limit reached after %d steps", step)
                break
            groups = await self.next_batch(step)
            self._ledger("train", step=step, groups=[g[0].group_id for g in groups])
            t0 = time.time()
            results = {node.type: await self.run_node(node, groups, step) for node in self.graph.batch_nodes}
            result = results["train"]
            train_seconds = time.time() - t0
            self.trainer_busy += train_seconds
            update_seconds = await self.publish(result.weights_path, step + 1)
            self.staleness.set_version(step + 1)
            await self.grant()
            now, gen_busy = time.time(), await self.gen_busy_seconds()
            self.metrics.log("step", step=step + 1, **self.step_metrics(groups, step, result.stats),
                             step_seconds=now - last, train_seconds=train_seconds, update_seconds=update_seconds,
                             samples_per_second=self.B * self.G / (now - last),
                             gen_tokens_per_second=self.generated_tokens / (now - last),
                             train_tokens_per_second=result.stats.get("n_tokens", 0.0) / train_seconds,
                             trainer_idle=1 - train_seconds / (now - last),
                             generator_idle=None if gen_busy is None else 1 - (gen_busy - gen_busy_last) / (now - last),
                             elapsed=now - start, buffered=len(self.buffer), running=len(self.staleness.running))
            self.generated_tokens, last, gen_busy_last = 0, now, gen_busy
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0:
                await self.evaluate(f"step {step + 1}", step + 1)
                # Evaluation is not training time: the next step's rates start after it.
                last, gen_busy_last = time.time(), await self.gen_busy_seconds()
        else:
            step = cfg.total_steps
        return step

    def step_metrics(self, groups: list[list[Sample]], step: int, stats: dict[str, float]) -> dict:
        samples = [s for g in groups for s in g]
        rewards = np.array([s.scalars[self.reward_key] for s in samples])
        staleness = np.concatenate([step - s.array("versions") for s in samples if "versions" in s.arrays] or [[0]])
        lengths = np.array([s.n_tokens() for s in samples])
        return {
            "reward": float(rewards.mean()),
            "accuracy": float((rewards >= 1).mean()),
            "staleness_mean": float(staleness.mean()),
            "staleness_max": int(staleness.max()),
            "staleness_hist": np.bincount(staleness.astype(np.int64), minlength=1).tolist(),
            "response_length": float(lengths.mean()),
            **{f"train/{k}": v for k, v in stats.items()},
        }

    async def gen_busy_seconds(self) -> float | None:
        infos = await asyncio.gather(*[c.get_server_info() for c in self.gen_clients])
        busy = [i.get("busy_seconds") for i in infos]
        return None if None in busy else sum(busy) / len(busy)

    async def evaluate(self, when: str, step: int) -> float:
        t0 = time.time()
        acc = await held_out_accuracy(self.gen_clients, self.tokenizer, self.eval_rows, self.reward_fn,
                                      self.prompt_key, self.reference_key, self.cfg.algorithm.max_new_tokens)
        self.eval_seconds += time.time() - t0
        self.metrics.log("eval", when=when, step=step, accuracy=acc, seconds=time.time() - t0)
        log.info("held-out accuracy at %s: %.1f%%", when, 100 * acc)
        return acc

    # ---- start and finish -------------------------------------------------------------

    async def wait_for_processes(self) -> None:
        timeout = self.cfg.launcher.start_timeout
        await asyncio.gather(*[asyncio.to_thread(wait_healthy, url, timeout) for url in self.spec.gen_urls])
        deadline = time.time() + timeout
        while len(self.trainer_ids) < self.spec.n_trainers:
            try:
                ident, msg = await asyncio.wait_for(recv_from(self.trainers, "controller trainers"),
                                                    max(0.1, deadline - time.time()))
            except asyncio.TimeoutError:
                missing = sorted(set(range(self.spec.n_trainers)) - set(self.trainer_ids))
                raise TimeoutError(f"trainer ranks {missing} did not report within {timeout:.0f} s "
                                   "(launcher.start_timeout)") from None
            if isinstance(msg, Hello):
                self.trainer_ids[msg.rank] = ident
            else:
                log.error("trainer socket: unexpected %s before start, dropped", type(msg).__name__)

    async def save_checkpoint(self) -> str:
        path = self.spec.path("checkpoint")
        for ident in self.trainer_ids.values():
            await send_to(self.trainers, ident, SaveCheckpoint(path))
        await self.from_every_rank(Saved, "saving the checkpoint")
        return path

    async def run(self) -> None:
        await self.wait_for_processes()
        self.metrics.log("start", total_steps=self.cfg.total_steps, batch_size=self.B, group_size=self.G,
                         max_staleness=self.cfg["async"].max_staleness)
        acc_start = await self.evaluate("start", 0) if self.cfg.eval_at_start else None
        loops = [asyncio.create_task(self.admission_loop()), asyncio.create_task(self.results_loop())]
        t0, eval_before = time.time(), self.eval_seconds
        steps = await self.train_loop()
        train_wall = time.time() - t0 - (self.eval_seconds - eval_before)
        self.closing = True  # no new admissions; running groups finish or stay accounted for
        acc_end = await self.evaluate("end", steps) if self.cfg.eval_at_end else None
        checkpoint = await self.save_checkpoint()
        for t in loops:
            t.cancel()
        trained = len(self.buffer.taken)
        summary = {
            "steps": steps,
            "accuracy_start": acc_start,
            "accuracy_end": acc_end,
            "train_wall_seconds": train_wall,
            "trained_samples": trained * self.G,
            "samples_per_second": trained * self.G / train_wall if train_wall else 0.0,
            "trainer_busy_fraction": self.trainer_busy / train_wall if train_wall else 0.0,
            "admitted_groups": self.next_group,
            "trained_groups": trained,
            "running_groups_at_end": len(self.staleness.running),
            "buffered_groups_at_end": len(self.buffer),
            "dropped_groups": self.dropped,
            "checkpoint": checkpoint,
        }
        self.metrics.log("summary", **summary)
        with open(self.spec.path("summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        # The launcher stops every other process once the controller has exited cleanly.
        self.metrics.close()
        for c in self.gen_clients:
            await c.close()

    def _ledger(self, event: str, **fields) -> None:
        self.ledger.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")


def group_problem(group: GroupDone, group_size: int, generated: Sequence[str], reward_key: str) -> str | None:
    """What makes a scored group untrainable, if anything: a wrong sample count, a missing key,
    or per-token arrays of one sample that disagree in length."""
    if len(group.samples) != group_size:
        return f"{len(group.samples)} samples, want {group_size}"
    for s in group.samples:
        missing = [k for k in generated if k not in s.arrays] + ([] if reward_key in s.scalars else [reward_key])
        if missing:
            return f"sample {s.uid} lacks {missing}"
        lengths = {len(s.arrays[k]) for k in generated if k != "prompt_ids"}
        if len(lengths) > 1:
            return f"sample {s.uid} has per-token arrays of different lengths {sorted(lengths)}"
    return None


def shard_groups(groups: list[list[Sample]], n: int) -> list[list[list[Sample]]]:
    """Whole groups to n ranks, largest first onto the rank with the fewest tokens so far."""
    shards: list[list[list[Sample]]] = [[] for _ in range(n)]
    load = [0] * n
    tokens = lambda g: sum(s.n_tokens("output_ids") + s.n_tokens("prompt_ids") for s in g)  # noqa: E731
    for g in sorted(groups, key=tokens, reverse=True):
        rank = load.index(min(load))
        shards[rank].append(g)
        load[rank] += tokens(g)
    return shards


def main(cfg, spec: RunSpec, name: str, rank: int) -> None:
    async def run() -> None:  # sockets and events are made inside the loop they belong to
        await Controller(cfg, spec).run()

    asyncio.run(run())
