"""The controller process: the run's control plane. It decides, from metadata only, and never
touches a sample's tokens (docs/architecture.md has the life of a sample).

One ROUTER socket takes every other process's messages: rollout workers offer generation slots,
which the controller fills with prompt groups (admission, `staleness.py`, `slots.py`), reward workers report scored groups and are told which trainer rank
to send them to (`intake.py`), trainer ranks report each step. The step loop picks a batch by id
under the staleness rule, tells each rank which groups to train (`trainer_pool.py`), publishes the
new weights (`publisher.py`) while the next step trains, and logs the step (`run_metrics.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import time
from dataclasses import asdict, dataclass, replace

import msgspec
import zmq
import zmq.asyncio

from areal_flow.algorithms.correction_table import configured_bounds
from areal_flow.checkpoint import store
from areal_flow.config.schema import RunConfig
from areal_flow.controller.ending import record_failure, run_summary, why_it_ended, write_summary
from areal_flow.controller.evaluation import Evaluation, VersionPin, held_out_accuracy, write_answers
from areal_flow.controller.intake import FilterStreak, Intake, outside_range
from areal_flow.controller.ledger import Ledger
from areal_flow.controller.prompts import PromptStream
from areal_flow.controller.publisher import WeightPublisher, server_counts
from areal_flow.controller.in_transit import InTransit
from areal_flow.controller.rollout_failures import RolloutFailures
from areal_flow.controller.suspect_alarm import SuspectAlarm
from areal_flow.controller.weight_alarm import WeightAlarm
from areal_flow.controller.run_metrics import RunClock, Traffic, batch_metrics, reward_busy, reward_wait, train_metrics
from areal_flow.controller.slots import RolloutSlots
from areal_flow.controller.staleness import StalenessManager
from areal_flow.controller import state as run_state
from areal_flow.controller.state import RunState, for_ranks
from areal_flow.controller.trainer_pool import merge_results, plan_step
from areal_flow.data.dataset import load_rows
from areal_flow.data.loading import load_prompts, prompt_room, row_format
from areal_flow.generation.client.generation_client import wait_healthy
from areal_flow.generation.compute_counts import COMPUTE_COUNTS
from areal_flow.generation.client.membership import follow, servers_of
from areal_flow.generation.client.router import ServerPool
from areal_flow.weights import UpdateFlags, make_channel
from areal_flow.weights.files import record_loaded
from areal_flow.weights.update import WeightUpdateError
from areal_flow.graph.dag import graph_from_config
from areal_flow.graph.placement import infer_name
from areal_flow.graph.keys import KEYS
from areal_flow.metrics.writer import MetricsWriter
from areal_flow.models.tokenizer import load_tokenizer
from areal_flow.rewards.service import AGENT_FN, RewardService
from areal_flow.rollout.agent import runner_of
from areal_flow.runtime import resize
from areal_flow.runtime.disk import writing
from areal_flow.runtime.spec import RunSpec, read_spec
from areal_flow.transport.channels import make_socket, recv_from, send_to, sent_bytes
from areal_flow.transport.messages import (
    DROP,
    AdmitRequest,
    Admitted,
    GroupMeta,
    Hello,
    Joined,
    Message,
    PromptGroup,
    Ready,
    Route,
    PublishWeights,
    Released,
    Resend,
    Saved,
    SaveCheckpoint,
    StepDone,
    Trainers,
    WeightsPublished,
)

log = logging.getLogger("areal_flow.controller")


def token_versions(meta: GroupMeta) -> dict[str, int]:
    """A group's answer tokens by the policy version that generated them (JSON keys)."""
    counts: dict[str, int] = {}
    for s in meta.samples:
        for version, n in s.versions.items():
            counts[str(version)] = counts.get(str(version), 0) + n
    return counts


class StalledRun(RuntimeError):
    """No train step completed within `step_timeout`; the message says what the run waited for."""


class _Resize(Exception):
    """The launcher asks for another number of trainer ranks: resize before the next step."""


class _Stop(Exception):
    """The launcher asked the run to stop (SIGUSR1) while the step loop waited for a batch."""


@dataclass
class _Trained:
    """A trained step, until its weights are loaded and its metrics row written."""

    step: int
    batch: dict[int, tuple[GroupMeta, int, int]]
    stats: dict[str, float]
    seconds: float  # the trainer's step, dispatch to the last rank's reply
    at: float  # training-clock seconds when it ended
    # The step's window, from the end of the previous step to the end of this one: its seconds, the
    # servers' counts over it (Publisher.server_counts) and the controller's CPU seconds in it.
    window: tuple[float, dict[str, float], float] = (0.0, {}, 0.0)
    update: asyncio.Task | None = None  # loading its weights on the generation servers
    reward_wait: float = 0.0  # seconds of the wait for its batch that went to rewards (run_metrics.reward_wait)


class Controller:
    def __init__(self, cfg: RunConfig, spec: RunSpec):
        self.cfg, self.spec = cfg, spec
        graph = self.graph = graph_from_config(cfg)
        algo, gen, train = cfg.algorithm, graph.generate, graph.train
        self.B, self.G = algo.batch_size, algo.group_size
        keys = {graph.meaning[k]: k for k in gen.outputs}
        # Everything the control plane counts and decides from, in one object a checkpoint saves.
        self.state = RunState(
            staleness=StalenessManager(self.B, cfg.rollout.max_staleness, cfg.rollout.max_concurrent),
            intake=Intake(
                self.G, spec.n_trainers, token_keys=[*gen.outputs, *(k for j in graph.judges for k in j.outputs)],
                output_keys=[keys["output_ids"]] + [k for m, k in keys.items() if KEYS[m].per == "output" and m != "output_ids"],
                prompt_key=keys["prompt_ids"], reward_key=graph.input(train, "rewards"),
            ))
        self.filter_streak = FilterStreak(algo.filter_stall_batches * self.B)
        self.weight_alarm = WeightAlarm(algo.stale_warn_capped, algo.stale_warn_ess, algo.stale_warn_steps,
                                        cfg.rollout.max_staleness)
        self.suspect_alarm = SuspectAlarm(cfg.metrics.suspect_warn)
        self.failures = RolloutFailures.of(cfg.rollout.failed_groups_stall, gen)  # rollouts that fail stop the run
        self.readmit: list[int] = []  # groups a resumed run admits again (they were generating), in order
        # Groups a restarted rollout worker was running: still admitted (their versions kept), given
        # to a worker again; a copy that comes back first wins, a later one is refused as not running.
        self.regenerate: list[int] = []
        self.reward_workers: set[str] = set()  # the reward workers that have joined
        self.replicas: set[str] = set()  # the inference processes (nodes on a mesh of their own) that are ready
        if spec.resume:
            self.restore(spec.resume)
        self.tokenizer = load_tokenizer(spec.model_path)
        # Held-out trajectories take turns too, or are an agent's rollouts.
        self.turns = runner_of(graph.generate, cfg, spec.model_path)
        # The prompt templates are applied here only: rollout workers and the held-out evaluation
        # read the prompt field of these rows as it is.
        ds, prompt_key = cfg.dataset, graph.dataset_input(gen)
        # Prompts over the model's context were refused at launch, or are left out here as they were counted there.
        room, skipped = prompt_room(cfg, spec.model_path), []
        self.prompts = PromptStream(load_prompts(ds, spec.train_path, ds.train_split, prompt_key, self.tokenizer,
                                                 room, skipped), ds.seed)
        self.prompts.seek(self.state.epoch, self.state.cursor)
        self.eval_rows = load_prompts(ds, spec.eval_path, ds.eval_split, prompt_key, self.tokenizer, room)
        # The fields judges read, as in the data (before the prompt templates), row by row as self.prompts.rows.
        self.judge_fields = sorted({k for j in graph.judges for k in graph.dataset_inputs(j)})
        places: list[str] = []
        raw_rows = load_rows(spec.train_path, list(ds.fields), row_format(ds.name), ds.train_split, places) \
            if self.judge_fields else []
        left_out = set(skipped)
        self.raw_rows = [row for row, where in zip(raw_rows, places) if where not in left_out]
        names, urls = servers_of(spec.run_dir, spec.gen_names, spec.gen_urls)  # a scaled run's (membership.py)
        self.publisher = WeightPublisher(urls, names, make_channel(cfg, spec), interrupt=cfg.rollout.interrupt,
                                         pause_mode=cfg.rollout.pause_mode, config=cfg.rollout, api_key=spec.api_key,
                                         trainers=self.send_weights)
        # The judges' servers: watched and counted here, never sent weights (their models are frozen).
        self.judge_pools = {n.name: ServerPool(*reversed(servers_of(spec.run_dir, spec.judge_names(n.name),
                                                                    spec.judge_urls(n.name), judge=n.name)),
                                               cfg.rollout, api_key=spec.api_key) for n in graph.judges}
        self.metrics = MetricsWriter(spec.path("metrics.jsonl"), cfg.metrics, run_name=cfg.recipe, config=asdict(cfg))
        self.ledger = Ledger(spec.path("ledger.jsonl"))
        self.eval_rewards: RewardService | None = None  # the held-out evaluation's reward workers
        self.pin = VersionPin()  # the version an evaluation beside training holds the servers at
        self.eval_task: asyncio.Task | None = None  # that evaluation
        self.steps_trained = 0  # train steps this process ran (an evaluation's row counts those meanwhile)
        self.clock, self.traffic = RunClock(), Traffic()
        self.socket = make_socket(zmq.asyncio.Context(), zmq.ROUTER, bind=spec.endpoint("controller", spec.controller_port),
                                  security=spec.security)
        # A restarted worker connects with its old identity: the new connection takes it over.
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.ranks: dict[int, bytes] = {}  # trainer rank -> socket identity
        self.replies: asyncio.Queue[Message] = asyncio.Queue()  # Hello, StepDone, Saved from the ranks
        self.slots = RolloutSlots()  # rollout workers' free generation slots
        self.changed = asyncio.Event()  # a group finished or was dropped: a batch may be ready
        self.closing = False
        self.stop_requested = False  # the launcher asked for a checkpoint and a clean stop (SIGUSR1)
        self.wall_time_reached = False  # the step loop stopped at max_wall_seconds
        self.waiting_for = "start-up"  # what the step loop waits for now, for a stalled run's error
        self.last_progress = 0.0  # monotonic time the last step finished
        self.saved: tuple[int, float] = (self.state.step, self.state.train_elapsed)  # the last checkpoint: step, clock
        self.saved_path = spec.resume  # ... and its folder
        self.resize_asked: dict | None = None  # a trainer resize the launcher asks for (runtime/resize.py)
        self.held_routes: list[tuple[bytes, GroupMeta]] | None = None  # scored groups that arrive while it runs
        self.in_transit = InTransit()  # routed to a rank, not yet trained: a copy is routed again
        # Where the next step's window starts: monotonic time, the servers' counts
        # (Publisher.server_counts), controller CPU seconds.
        self.mark: tuple[float, dict[str, float], float] = (0.0, {}, 0.0)

    @property
    def staleness(self) -> StalenessManager:
        return self.state.staleness

    @property
    def intake(self) -> Intake:
        return self.state.intake

    def restore(self, folder: str) -> None:
        """Continue from the resumable checkpoint `folder`: its run state, with the groups that were
        generating queued to be admitted again (the launcher has cut the ledger and the metrics
        back to what they held then: checkpoint/store.py `rewind`)."""
        state = run_state.load(folder)
        if store.read_manifest(folder)["n_trainers"] != self.spec.n_trainers:
            for_ranks(state, self.spec.n_trainers)
        self.readmit = sorted(state.staleness.running)
        state.staleness.running = {}
        state.resumes += 1
        self.state = state

    def request_stop(self) -> None:
        """SIGUSR1 from the launcher: save a checkpoint at the end of the current step, then stop."""
        log.info("stop requested: the run stops after the current step%s",
                 ", with a checkpoint" if self.cfg.checkpoint.at_stop else "")
        self.stop_requested = True
        self.changed.set()

    # ---- the control plane: every message from every other process ----------------------------

    async def inbox(self) -> None:
        while True:
            ident, msg = await recv_from(self.socket, "controller")
            if isinstance(msg, AdmitRequest):
                self.rollout_joined(ident, msg)
            elif isinstance(msg, Joined):
                await self.reward_joined(msg.worker)
            elif isinstance(msg, GroupMeta):
                for proc, n in msg.traffic.items():
                    self.traffic.report(proc, n)
                await self.route(ident, msg)
            elif isinstance(msg, (Hello, StepDone, WeightsPublished, Saved)):
                if isinstance(msg, Hello):  # a new rank of a trainer resize
                    self.ranks[msg.rank] = ident
                self.replies.put_nowait(msg)
            elif isinstance(msg, Ready):
                self.replicas.add(msg.worker)
            else:
                log.error("controller: a %s is not for the controller, dropped", type(msg).__name__)
            await self.grant()

    def rollout_joined(self, ident: bytes, msg: AdmitRequest) -> None:
        """A rollout worker offers its slots: at start, or again once the launcher restarted it, when
        the groups it was running are given to a worker again (they keep their admission versions)."""
        if ident in self.slots.free:
            lost = sorted(g for g, worker in self.slots.owner.items() if worker == ident)
            for g in lost:
                del self.slots.owner[g]
            self.slots.free[ident] = 0
            self.regenerate += [g for g in lost if g in self.staleness.running]
            log.warning("controller: %s restarted; its %d running group(s) are generated again", msg.worker, len(lost))
        self.slots.offer(ident, msg.slots)

    async def reward_joined(self, worker: str) -> None:
        """A reward worker starts. Once the launcher restarted it, the groups it held are lost: every
        rollout worker sends the generated groups it still keeps again (a copy scored twice is
        refused the second time, as not running)."""
        if worker in self.reward_workers:
            log.warning("controller: %s restarted; the rollout workers send their unrouted groups again", worker)
            for ident in self.slots.free:
                await send_to(self.socket, ident, Resend())
        self.reward_workers.add(worker)

    async def grant(self) -> None:
        """Fill free rollout slots with prompt groups while the staleness rule admits them; each
        worker gets its groups in one message. A restarted worker's groups go first: they are
        admitted already."""
        admitted: dict[bytes, list[PromptGroup]] = {}
        state = self.state
        while self.slots and not self.closing:
            again = {}
            if self.regenerate:
                gid = self.regenerate.pop(0)
                if gid not in self.staleness.running:  # a copy came back meanwhile
                    continue
                version, again = self.staleness.running[gid], {"again": "its rollout worker restarted"}
            elif not self.staleness.can_admit():
                break
            elif self.readmit:  # a resumed run's groups that were generating, first and in order
                gid, again = self.readmit.pop(0), {"resumed": True}
                version = self.staleness.admit(gid)
            else:
                gid = state.next_group
                state.next_group += 1
                state.running_prompts[gid] = self.prompts.next_index()
                version = self.staleness.admit(gid)
            row = self.prompts.rows[state.running_prompts[gid]]
            self.ledger.write("admit", group=gid, prompt_id=row["id"], version=version, **again)
            raw = {k: self.raw_rows[state.running_prompts[gid]][k] for k in self.judge_fields}
            admitted.setdefault(self.slots.take(gid), []).append(PromptGroup(
                gid, row["id"], row, self.G, time.time(), raw=raw, policy_version=self.staleness.version))
        for ident, groups in admitted.items():
            await send_to(self.socket, ident, Admitted(groups))

    async def route(self, ident: bytes, meta: GroupMeta) -> None:
        """Tell the reward worker which trainer rank takes a scored group, or to drop it."""
        if self.held_routes is not None:  # the trainer ranks are being resized: routed once they are
            self.held_routes.append((ident, meta))
            return
        if meta.group_id not in self.staleness.running:
            if (rank := self.in_transit.rank_again(meta.group_id)) is not None:
                log.warning("controller: group %d scored again after a reward worker restarted: routed to trainer "
                            "rank %d again (a rank holding it drops the copy)", meta.group_id, rank)
                await send_to(self.socket, ident, Route(meta.group_id, rank))
                return
            log.error("controller: group %d is not running (a duplicate?), dropped", meta.group_id)
            await send_to(self.socket, ident, Route(meta.group_id, -1))
            return
        rank, problem = self.intake.accept(meta)
        self.failures.observe(meta, problem)
        # Each answer's length and the group's stage times go to the ledger: what the advisor fits
        # generation from (advise/fit.py), the filtered groups' answers included.
        out = self.intake.output_keys[0]
        stats = {"lengths": [s.lengths.get(out, 0) for s in meta.samples], **meta.times}
        if problem is None and (why := outside_range(meta, self.intake.reward_key, self.cfg.algorithm.success_rate_range)):
            # Trainable, but it would teach little (all right or all wrong gives no advantage): it
            # leaves the intake and the running set, so admission opens for a group in its place.
            self.intake.take([meta.group_id])
            self.staleness.abandon(meta.group_id)
            self.state.filtered += 1
            self.filter_streak.dropped(meta, self.intake.reward_key)
            if self.filter_streak.stalled:
                self.changed.set()  # next_batch ends the run
            self.ledger.write("filter", group=meta.group_id, reason=why, **stats)
            self.state.generated_tokens += sum(stats["lengths"])
            rank = DROP
        elif problem:
            # Unusable, but accounted for: it leaves the running set (else the staleness rule would
            # wait for it forever) and the ledger and summary say it was dropped.
            log.error("controller: group %d dropped: %s", meta.group_id, problem)
            self.staleness.abandon(meta.group_id)
            self.ledger.write("drop", group=meta.group_id, reason=problem, **stats)
        else:
            self.staleness.finish(meta.group_id)
            self.filter_streak.kept()
            self.state.generated_tokens += sum(stats["lengths"])
            # Its answer tokens by the version that made them: the audit checks each against η.
            self.ledger.write("finish", group=meta.group_id, rank=rank, tokens=token_versions(meta), **stats)
        self.state.running_prompts.pop(meta.group_id, None)
        owner = self.slots.release(meta.group_id)
        await send_to(self.socket, ident, Route(meta.group_id, rank))
        if rank == DROP:
            await send_to(self.socket, owner, Released([meta.group_id]))  # its copy is no longer needed
        else:  # kept until a step trains it: its reward worker may die before it sends it on
            self.in_transit.routed(meta.group_id, rank, owner)
        self.changed.set()

    # ---- the step loop -------------------------------------------------------------------------

    async def train(self) -> int:
        """The step loop. A step's new weights go to the generation servers while the trainer already
        trains the next step: a batch needs only finished groups, and the staleness rule counts
        versions at admission, so nothing waits for the load but the admissions at the new version.
        Where the trainer ranks send the weights themselves (a channel's `overlaps_training`), and
        colocated (generation is paused from the trainer's turn until the load), each update ends
        before the next step starts."""
        cfg = self.cfg
        overlap = self.publisher.channel.overlaps_training and not self.graph.colocated
        await self.restart_window()
        done: _Trained | None = None  # the last trained step, its weights maybe still loading
        step = self.state.step
        try:
            while step < cfg.total_steps and not self.stop_requested:
                if cfg.max_wall_seconds and self.clock.elapsed() > cfg.max_wall_seconds:
                    self.wall_time_reached = True
                    break
                if self.resize_asked is not None:  # between steps, no weights in flight, as a checkpoint
                    if done is not None:
                        await self.close_step(done)
                        done = None
                    await self.resize_trainers(step)
                waited_from = time.time()  # wall clock, as the groups' stage times
                try:
                    batch = await self.next_batch(step, done.update if done else None)
                except _Stop:
                    break
                except _Resize:
                    continue
                t0 = time.monotonic()
                stats, weights = await self.run_step(step, batch)
                self.steps_trained += 1
                trained = _Trained(step, batch, stats, time.monotonic() - t0, self.clock.elapsed(),
                                   await self.end_window(),
                                   reward_wait=reward_wait([meta for meta, _, _ in batch.values()], waited_from))
                if done is not None:
                    await self.close_step(done)
                trained.update = asyncio.create_task(self.update(weights, step + 1))
                trained.update.add_done_callback(lambda _: self.changed.set())  # next_batch sees a failure
                done = trained
                if not overlap:
                    await self.close_step(done)
                    done = None
                step = self.state.step = step + 1
                if self.checkpoint_due(step):
                    if done is not None:  # a checkpoint is taken between steps, no weights in flight
                        await self.close_step(done)
                        done = None
                    await self.save_checkpoint(step)
            if done is not None:
                await self.close_step(done)
                done = None
            if self.saved[0] != step and (cfg.checkpoint.at_stop or not self.stop_requested):
                await self.save_checkpoint(step)  # the run's last state, to extend or resume it
        finally:
            if done is not None and not done.update.done():
                done.update.cancel()
        return step

    async def update(self, weights: str, version: int) -> float:
        """Load `version` on the generation servers, then admit at it; the seconds the load took.
        An evaluation beside training holds the servers at its version: the load waits for it."""
        if self.pin.held:
            self.waiting_for = f"the held-out evaluation at version {self.pin.version} before loading version {version}"
            await self.pin.wait()
        seconds = await self.publisher.publish(weights, version)
        if not self.publisher.channel.sent_by_trainers:  # files: a restarted server starts from them
            record_loaded(self.spec.run_dir, weights, version)
        self.ledger.write("loaded", version=version, seconds=round(seconds, 4))
        self.staleness.set_version(version)
        await self.grant()
        return seconds

    async def restart_window(self) -> None:
        """The next step's window starts now."""
        self.mark = (time.monotonic(), await self.server_counts(), time.process_time())

    async def server_counts(self) -> dict[str, float]:
        """The policy's servers' counts so far (publisher.server_counts), and each judge's as
        `<judge>/<count>`."""
        counts = await self.publisher.server_counts()
        for name, pool in self.judge_pools.items():
            counts.update({f"{name}/{k}": v for k, v in (await server_counts(pool.clients)).items()})
        return counts

    async def end_window(self) -> tuple[float, dict[str, float], float]:
        """A step has trained: its window (seconds, the servers' counts over it, controller CPU) ends
        now, and the next step's starts. A step's row then covers that step's own training and what
        generation did meanwhile, the last step's too (its weights' load comes after)."""
        self.waiting_for = "the generation servers' counts of the step (/get_server_info)"
        (last, before, cpu), now, counts = self.mark, time.monotonic(), await self.server_counts()
        self.mark = (now, counts, time.process_time())
        return now - last, {key: value - before[key] for key, value in counts.items() if key in before}, \
            time.process_time() - cpu

    async def close_step(self, done: _Trained) -> None:
        """Once a step's weights are loaded: its metrics row, and the held-out evaluation when due."""
        self.waiting_for = f"the generation servers to load the weights of version {done.step + 1}"
        update_seconds = await done.update
        seconds, servers, cpu = done.window
        self.log_step(done, seconds, update_seconds, servers, cpu)
        self.check_evaluation()
        if self.cfg.eval.every_versions and (done.step + 1) % self.cfg.eval.every_versions == 0:
            await self.evaluate_beside(done.step + 1)
        self.last_progress = time.monotonic()

    async def watchdog(self) -> None:
        """Fail the run when no step completes within step_timeout, naming what the loop waits for
        and any generation server that no longer answers (a frozen process holds no socket error)."""
        while True:
            await asyncio.sleep(min(1.0, self.cfg.step_timeout / 4))
            if time.monotonic() - self.last_progress > self.cfg.step_timeout:
                frozen = await self.publisher.unresponsive()
                for pool in self.judge_pools.values():
                    frozen += await pool.unresponsive()
                filtered = self.state.filtered - self.state.filtered_logged
                raise StalledRun(
                    f"no train step completed within {self.cfg.step_timeout:.0f} s (step_timeout); the controller "
                    f"waits for {self.waiting_for}; {len(self.staleness.finished)} prompt group(s) finished, "
                    f"{len(self.staleness.running)} generating"
                    + (f"; dynamic filtering dropped {filtered} group(s) since the last step: their success rates fell "
                       f"outside algorithm.success_rate_range={self.cfg.algorithm.success_rate_range} (widen "
                       "it, or null to train every group)" if filtered else "")
                    + (f"; {', '.join(frozen)} does not answer /health" if frozen else ""))

    def filter_stalled(self) -> str:
        streak, batches, bounds = self.filter_streak, self.cfg.algorithm.filter_stall_batches, \
            self.cfg.algorithm.success_rate_range
        return (f"the run trains nothing: dynamic filtering dropped the last {streak.count} prompt groups in a row, "
                f"none kept ({batches} batches' worth, algorithm.filter_stall_batches={batches}); their success "
                f"rates fell outside algorithm.success_rate_range={bounds} ({streak.describe()}): widen it, or null "
                "to train every group")

    async def next_batch(self, step: int, update: asyncio.Task | None = None) -> dict[int, tuple[GroupMeta, int, int]]:
        """The groups step `step` trains (staleness.py decides which), waiting for them if needed:
        group id -> (metadata, rank holding it, tokens). `update`: the weight update in flight,
        whose failure ends the wait (it sets `changed` when it ends)."""
        self.waiting_for = f"finished prompt groups to train step {step}"
        if why := self.failures.stopped():  # even with a batch ready: the groups keep failing
            raise StalledRun(why)
        while (ids := self.staleness.pick_batch(step)) is None:
            if self.stop_requested:
                raise _Stop
            if self.resize_asked is not None:
                raise _Resize
            if self.filter_streak.stalled:
                raise StalledRun(self.filter_stalled())
            if why := self.failures.stopped():
                raise StalledRun(why)
            if update is not None and update.done():
                update.result()  # raises a failed update's error
            self.check_evaluation()
            self.changed.clear()
            await self.changed.wait()
        self.staleness.trained(ids)
        self.ledger.write("train", step=step, groups=ids)
        return self.intake.take(ids)

    async def run_step(self, step: int, batch: dict[int, tuple[GroupMeta, int, int]]) -> tuple[dict[str, float], str]:
        """Each rank trains the groups the plan gives it, where their data already is."""
        plans = plan_step(step, {g: (rank, tokens) for g, (_, rank, tokens) in batch.items()}, len(self.ranks))
        if self.graph.colocated:  # generation gives the trainer the devices (docs/colocation.md)
            self.waiting_for = f"the generation servers to free their memory for step {step}"
            await self.publisher.trainers_turn()
        self.waiting_for = f"the trainer ranks to finish step {step}"
        t0 = time.monotonic()
        for rank, plan in enumerate(plans):
            await send_to(self.socket, self.ranks[rank], plan)
        done = await self.replies_from_ranks(StepDone, f"step {step}")
        self.state.trainer_seconds += time.monotonic() - t0
        await self.release(self.in_transit.trained(batch))
        if self.graph.colocated:
            await self.publisher.generations_turn()
        for d in done:
            self.traffic.report(f"trainer{d.rank}", d.sent_bytes)
        return merge_results(done)

    async def release(self, copies: dict[bytes, list[int]]) -> None:
        """The rollout workers may let go of these groups' copies."""
        for owner, group_ids in copies.items():
            await send_to(self.socket, owner, Released(group_ids))

    async def send_weights(self, version: int, flags: UpdateFlags) -> None:
        """Once the publisher has paused the servers, for channels whose trainers send: every trainer
        rank takes part in sending `version`, rank 0 sends it to the servers. Raises
        WeightUpdateError with rank 0's account of what failed (server, bucket, tensor)."""
        self.waiting_for = f"the trainer ranks to send weight version {version}"
        for ident in self.ranks.values():
            await send_to(self.socket, ident, PublishWeights(version, flags.abort_all_requests, flags.keep_cache))
        done = await self.replies_from_ranks(WeightsPublished, f"sending weight version {version}")
        if errors := [d.error for d in done if d.error]:
            raise WeightUpdateError("; ".join(errors))

    async def replies_from_ranks(self, kind: type, what: str) -> list:
        """One reply of type `kind` from every trainer rank."""
        got: dict[int, Message] = {}
        while len(got) < len(self.ranks):
            msg = await self.replies.get()
            if isinstance(msg, kind):
                got[msg.rank] = msg
                if missing := ", ".join(f"trainer{r}" for r in sorted(set(self.ranks) - set(got))):
                    self.waiting_for = f"{missing} to finish {what}"
            else:
                log.error("controller: unexpected %s from a trainer rank while waiting for %s, dropped",
                          type(msg).__name__, what)
        return [got[r] for r in sorted(got)]

    async def watch_resize(self) -> None:
        """Look for a trainer resize the launcher asks for (`scale RUN_DIR trainers=N`)."""
        while True:
            if self.resize_asked is None and (ask := resize.asked(self.spec.run_dir)) is not None \
                    and resize.answered(self.spec.run_dir, resize.DONE, ask["id"]) is None:
                self.resize_asked = ask
                self.changed.set()  # next_batch stops waiting
            await asyncio.sleep(0.5)

    async def resize_trainers(self, step: int) -> None:
        """Go on with the number of trainer ranks the launcher asks for (runtime/resize.py): hold the
        scored groups that arrive, save the run's checkpoint (each old rank's models and groups),
        let the launcher start the new ranks from it, then route to them. Generation goes on
        meanwhile; no version is published, so the staleness rule holds admissions as it would."""
        ask, t0, run_dir = self.resize_asked, time.monotonic(), self.spec.run_dir
        n, before = ask["n"], len(self.ranks)
        self.held_routes = []
        log.warning("controller: resizing the trainer ranks from %d to %d after step %d", before, n, step)
        path = self.saved_path if self.saved[0] == step and self.saved_path else await self.save_checkpoint(step)
        self.ranks = {}  # each new rank's Hello fills it (inbox)
        resize.answer(run_dir, resize.SAVED, ask["id"], checkpoint=path, step=step, n_before=before)
        self.waiting_for = f"{n} new trainer rank(s) to start from the checkpoint {path} (a trainer resize)"
        deadline = t0 + self.cfg.launcher.start_timeout + self.cfg.step_timeout
        while len(self.ranks) < n:
            try:
                msg = await asyncio.wait_for(self.replies.get(), max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise TimeoutError(f"trainer resize to {n} rank(s): trainer ranks {sorted(set(range(n)) - set(self.ranks))} "
                                   "did not report in time (launcher.start_timeout + step_timeout)") from None
            if not isinstance(msg, Hello):
                log.error("controller: unexpected %s during a trainer resize, dropped", type(msg).__name__)
        self.spec = read_spec(run_dir)  # the new ranks' inboxes, written by the launcher
        for_ranks(self.state, n)  # the groups old rank k held, each new rank k mod n loaded
        for worker in sorted(self.reward_workers):  # before any Route that names a new rank
            await send_to(self.socket, worker.encode(), Trainers(n))
        seconds = time.monotonic() - t0
        self.ledger.write("scale", trainers={"from": before, "to": n}, step=step, checkpoint=path,
                          seconds=round(seconds, 3))
        self.metrics.log("resize", step=step, trainers_before=before, trainers=n, checkpoint=path, seconds=seconds)
        resize.answer(run_dir, resize.DONE, ask["id"], n=n, seconds=round(seconds, 3))
        await self.release(self.in_transit.all_held())
        held, self.held_routes, self.resize_asked = self.held_routes, None, None
        for ident, meta in held:
            await self.route(ident, meta)
        self.last_progress = time.monotonic()

    def log_step(self, done: _Trained, seconds: float, update_seconds: float, servers: dict[str, float],
                 controller_cpu: float) -> None:
        """The step's metrics row; `servers`: the generation servers' counts over the step (per
        server, those every server reports: Publisher.server_counts)."""
        step, batch, stats, train_seconds = done.step, done.batch, done.stats, done.seconds
        algo = self.cfg.algorithm
        self.traffic.report("controller", sent_bytes())
        traffic = self.traffic.step()
        row = dict(
            step=step + 1,
            **batch_metrics([meta for meta, _, _ in batch.values()], step, self.intake.reward_key, self.intake.output_keys[0],
                            max_new_tokens=algo.max_new_tokens, judges=list(self.judge_pools)),
            **reward_busy([meta for meta, _, _ in batch.values()], self.graph.rewards, seconds),
            # train/<stat>, and the step's diagnostics finished from their sums (by_length/*, histograms)
            **train_metrics(stats, *reversed(configured_bounds(algo))),
            **{f"sent_bytes/{p}": n for p, n in traffic.items()},
            step_seconds=seconds, train_seconds=train_seconds, update_seconds=update_seconds, trained_at=done.at,
            samples_per_second=self.B * self.G / seconds, gen_tokens_per_second=self.state.generated_tokens / seconds,
            train_tokens_per_second=stats.get("n_tokens", 0.0) / train_seconds,
            trainer_idle=1 - train_seconds / seconds,
            trainer_reward_wait=done.reward_wait / seconds,
            generator_idle=1 - servers["busy_seconds"] / seconds if "busy_seconds" in servers else None,
            generator_load=servers["load_seconds"] / seconds if "load_seconds" in servers else None,
            # Each judge's servers' idle share of the step, as generator_idle (SGLang reports none).
            **{f"judge_idle/{j}": 1 - servers[f"{j}/busy_seconds"] / seconds for j in self.judge_pools
               if f"{j}/busy_seconds" in servers},
            **{f"gen/{key}": servers[key] for key in (*COMPUTE_COUNTS, "memory_releases") if key in servers},
            controller_cpu_fraction=controller_cpu / seconds,
            elapsed=self.clock.elapsed(), buffered=len(self.intake), running=len(self.staleness.running),
            filtered_groups=self.state.filtered - self.state.filtered_logged,
            **self.failures.step_figures(),  # env/errors, env/error_share
        )
        warnings = [(kind, alarm.observe(row)) for kind, alarm in (("staleness", self.weight_alarm),
                                                                   ("reward_hacking", self.suspect_alarm))]
        self.metrics.log("step", **row, stale_trouble_steps=self.weight_alarm.in_a_row)
        for kind, warning in warnings:
            if warning:
                log.warning("controller: %s", warning)
                self.metrics.log("warning", step=step + 1, kind=kind, message=warning)
        self.state.generated_tokens, self.state.filtered_logged = 0, self.state.filtered
        self.ledger.flush()

    async def evaluate(self, when: str, version: int) -> float:
        """Held-out greedy accuracy at the start or end of the run; training time stops meanwhile."""
        self.waiting_for = f"the held-out evaluation at {when}"
        with self.clock.paused():
            return await self.held_out(when, version, self.steps_trained)

    async def evaluate_beside(self, version: int) -> None:
        """Held-out accuracy on `version`'s weights, loaded now, while the trainer trains on: the
        servers stay at `version` until it ends (`update` waits for the pin). Colocated, generation
        and training take turns on the devices, so the evaluation runs in generation's turn, before
        the next step. One evaluation at a time: a version due while one runs is skipped."""
        if self.pin.held:  # held from the start of an evaluation to its end
            log.warning("held-out evaluation at version %d skipped: the one at version %s still runs",
                        version, self.pin.version)
            self.metrics.log("eval_skipped", step=version, version=version, running=self.pin.version)
            return
        self.pin.hold(version)

        async def run(steps_before: int) -> None:
            try:
                await self.held_out(f"version {version}", version, steps_before)
            finally:
                self.pin.release()

        self.eval_task = asyncio.create_task(run(self.steps_trained))
        self.eval_task.add_done_callback(lambda _: self.changed.set())  # next_batch sees a failure
        if self.graph.colocated:
            await self.eval_task
            await self.restart_window()  # not training time: the rates restart after it

    def check_evaluation(self) -> None:
        """Raise the error of an evaluation beside training that failed."""
        if self.eval_task is not None and self.eval_task.done() and not self.eval_task.cancelled():
            self.eval_task.result()

    async def held_out(self, when: str, version: int, steps_before: int) -> float:
        """Evaluate on the servers' current weights (`version`) and log the `eval` row: accuracy,
        the versions the answers came from, the train steps since `steps_before` and a few answers."""
        t0 = time.monotonic()
        reward = self.graph.eval_reward  # a reward with a dataset reference: evaluation calls no judge
        if self.eval_rewards is None:  # worker processes start at the first evaluation
            self.eval_rewards = RewardService([reward], self.cfg.sandbox)

        async def score(text: str, reference: str) -> float:
            return (await self.eval_rewards.score(reward.name, text, reference)).raw

        result: Evaluation = await held_out_accuracy(
            self.publisher.pool, self.tokenizer, self.eval_rows, score, self.graph.dataset_input(self.graph.generate),
            self.graph.reference(reward), self.cfg.algorithm.max_new_tokens, self.turns, reward.fn == AGENT_FN)
        write_answers(self.spec.run_dir, version, result.answers)
        if set(result.versions) != {version}:
            log.warning("held-out evaluation at %s: answers came from versions %s, not only %d", when,
                        result.versions, version)
        self.metrics.log("eval", when=when, step=version, version=version, accuracy=result.accuracy, n=result.n,
                         answer_versions={str(v): n for v, n in sorted(result.versions.items())},
                         trainer_steps_meanwhile=self.steps_trained - steps_before,
                         seconds=time.monotonic() - t0, samples=result.samples, **result.figures)
        log.info("held-out accuracy at %s: %.1f%%", when, 100 * result.accuracy)
        return result.accuracy

    # ---- start and finish ----------------------------------------------------------------------

    async def wait_for_processes(self) -> None:
        timeout = self.cfg.launcher.start_timeout
        servers = {**dict(zip(self.spec.gen_names, self.spec.gen_urls)),
                   **{name: url for node in self.judge_pools
                      for name, url in zip(self.spec.judge_names(node), self.spec.judge_urls(node))}}
        await asyncio.gather(*[asyncio.to_thread(wait_healthy, url, timeout, self.spec.api_key, name)
                               for name, url in servers.items()])
        deadline = time.monotonic() + timeout
        replicas = {infer_name(node, i) for node, ports in self.spec.infer_ports.items() for i in range(len(ports))}
        while len(self.ranks) < self.spec.n_trainers or replicas - self.replicas:
            try:
                ident, msg = await asyncio.wait_for(recv_from(self.socket, "controller"),
                                                    max(0.1, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                missing = [f"trainer ranks {sorted(set(range(self.spec.n_trainers)) - set(self.ranks))}"] \
                    if len(self.ranks) < self.spec.n_trainers else []
                missing += [f"inference processes {sorted(replicas - self.replicas)}"] if replicas - self.replicas else []
                raise TimeoutError(f"{' and '.join(missing)} did not report within {timeout:.0f} s "
                                   "(launcher.start_timeout)") from None
            if isinstance(msg, Hello):
                self.ranks[msg.rank] = ident
            elif isinstance(msg, Ready):
                self.replicas.add(msg.worker)
            elif isinstance(msg, AdmitRequest):
                self.slots.offer(ident, msg.slots)  # filled once training starts
            elif isinstance(msg, Joined):
                self.reward_workers.add(msg.worker)
            else:
                log.error("controller: unexpected %s before start, dropped", type(msg).__name__)

    async def until_stalled(self, loop):
        """Run the step loop under the watchdog; a stalled run raises StalledRun."""
        self.last_progress = time.monotonic()
        if not self.cfg.step_timeout:
            return await loop
        work, watchdog = asyncio.create_task(loop), asyncio.create_task(self.watchdog())
        await asyncio.wait({work, watchdog}, return_when=asyncio.FIRST_COMPLETED)
        for task in (work, watchdog):
            if not task.done():
                task.cancel()
        return work.result() if work.done() else watchdog.result()

    def checkpoint_due(self, step: int) -> bool:
        """Whether the state after `step` steps is saved: every checkpoint.every_steps steps, or once
        checkpoint.every_minutes of training passed since the last checkpoint."""
        every, minutes = self.cfg.checkpoint.every_steps, self.cfg.checkpoint.every_minutes
        return bool(every and step % every == 0) or \
            bool(minutes and self.clock.elapsed() - self.saved[1] >= 60 * minutes)

    async def save_checkpoint(self, step: int) -> str:
        """A resumable checkpoint of the run after `step` steps (checkpoint/store.py): the run state
        as it is now, and each trainer rank's models and the scored groups the state places on it.
        Taken between steps, with no weights in flight: the state is consistent as encoded here,
        and whatever happens while the ranks write (groups finishing) is after it, so a resumed run
        does it again."""
        self.waiting_for = f"the trainer ranks to save the checkpoint of step {step}"
        t0 = time.monotonic()
        state = self.state
        self.ledger.flush()
        state.ledger_bytes, state.metrics_bytes = self.ledger.tell(), self.metrics.tell()
        state.epoch, state.cursor = self.prompts.epoch, self.prompts.cursor
        state.train_elapsed = self.clock.elapsed()
        # Groups a resumed run has yet to admit again are still running, as far as a later resume goes.
        running = {**state.staleness.running, **{g: state.staleness.version for g in self.readmit}}
        encoded = msgspec.json.encode(replace(state, staleness=replace(state.staleness, running=running)))
        tmp = store.begin(self.spec.run_dir, step)
        held = {rank: sorted(g for g, r in state.intake.location.items() if r == rank) for rank in self.ranks}
        for rank, ident in self.ranks.items():
            await send_to(self.socket, ident, SaveCheckpoint(tmp, held[rank]))
        await self.replies_from_ranks(Saved, f"saving the checkpoint of step {step}")
        with writing("the checkpoint", tmp):
            with open(os.path.join(tmp, run_state.FILE), "wb") as f:
                f.write(encoded)
            shutil.copy(self.spec.path("config.yaml"), os.path.join(tmp, "config.yaml"))
            path = store.commit(tmp, step, version=state.staleness.version, n_trainers=len(self.ranks))
        removed = store.prune(self.spec.run_dir, self.cfg.checkpoint.keep_last)
        self.saved, self.saved_path = (step, self.clock.elapsed()), path
        seconds = time.monotonic() - t0
        size = sum(store.read_manifest(path)["files"].values())
        self.metrics.log("checkpoint", step=step, path=path, seconds=seconds, bytes=size, removed=removed)
        log.info("checkpoint of step %d: %s (%.1f MB, %.2f s)", step, path, size / 1e6, seconds)
        self.last_progress = time.monotonic()
        return path

    async def export(self) -> str:
        """The trained model as a Hugging Face directory, RUN_DIR/checkpoint, at the end of the run."""
        path = self.spec.path("checkpoint")
        for ident in self.ranks.values():
            await send_to(self.socket, ident, SaveCheckpoint(path))
        await self.replies_from_ranks(Saved, "saving the checkpoint")
        return path

    async def run(self) -> None:
        await self.wait_for_processes()
        self.metrics.log("start", total_steps=self.cfg.total_steps, batch_size=self.B, group_size=self.G,
                         max_staleness=self.cfg.rollout.max_staleness)
        state = self.state
        if state.resumes:
            self.ledger.write("resume", step=state.step, checkpoint=self.spec.resume)
            self.metrics.log("resume", step=state.step, checkpoint=self.spec.resume, resumes=state.resumes)
        first = state.step == 0 and not state.resumes
        acc_start = await self.evaluate("start", 0) if self.cfg.eval_at_start and first else None
        inbox = asyncio.create_task(self.inbox())
        # The servers a scale adds or removes (`python -m areal_flow.scale`), recorded in the ledger.
        # The policy's pool ("") takes a new server while it joins: it loads the current weights on it.
        following = [asyncio.create_task(follow(
            pool, self.spec.run_dir, "controller",
            lambda epoch, changes, judge=judge: self.ledger.write("scale", **({"judge": judge} if judge else {}),
                                                                  epoch=epoch, **changes),
            joining=not judge, judge=judge)) for judge, pool in {"": self.publisher.pool, **self.judge_pools}.items()]
        resizes = asyncio.create_task(self.watch_resize())
        self.clock.start(already=state.train_elapsed)
        await self.grant()
        steps = await self.until_stalled(self.train())
        if self.eval_task is not None:  # an evaluation beside training still running: its row belongs to the run
            self.waiting_for = f"the held-out evaluation at version {self.pin.version}"
            await self.until_stalled(asyncio.wait_for(self.eval_task, None))
        train_wall = self.clock.elapsed()
        self.closing = True  # no new admissions; running groups finish or stay accounted for
        stopped = self.stop_requested and steps < self.cfg.total_steps
        acc_end = await self.evaluate("end", steps) if self.cfg.eval_at_end and not stopped else None
        checkpoint = None if stopped else await self.export()
        inbox.cancel()
        for task in [*following, resizes]:
            task.cancel()
        reason = why_it_ended(self.cfg, steps, wall_time=self.wall_time_reached)
        log.info("the run ended: %s", reason["message"])
        write_summary(self, run_summary(self, steps, stopped=stopped, accuracy=(acc_start, acc_end),
                                        train_wall=train_wall, checkpoint=checkpoint, reason=reason))
        # The launcher stops every other process once the controller has exited cleanly.
        self.metrics.close()
        await self.publisher.close()
        for pool in self.judge_pools.values():
            await pool.close()


def main(cfg: RunConfig, spec: RunSpec, name: str, rank: int) -> None:
    async def run() -> None:  # sockets and events are made inside the loop they belong to
        controller = Controller(cfg, spec)
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, controller.request_stop)
        try:
            await controller.run()
        except Exception as e:  # whatever ended the run is its recorded reason (the launcher prints it)
            log.error("the run ended: %s", record_failure(controller, e)["message"])
            raise
        finally:  # a failed run keeps the record of what it did
            controller.ledger.close()
            if controller.eval_rewards is not None:
                controller.eval_rewards.close()

    asyncio.run(run())
