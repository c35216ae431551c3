"""The controller process: the run's control plane. It decides, from metadata only, and never
touches a sample's tokens (docs/architecture.md has the life of a sample).

One socket takes every other process's messages, each handed to its handler from one table
(`mailbox.py`, `Controller.table`): rollout workers offer generation slots, which the controller
fills with prompt groups (`admission.py` under the staleness rule, `staleness.py`); reward workers
report scored groups and are told which trainer rank takes each (`outcomes.py`, `intake.py`);
trainer ranks answer what the step loop asks of them (`peers.py`).

This module keeps the step loop: batch → step → publish → checkpoint. A step's plan is
`trainer_pool.py`, its weights go out through `publisher.py` while the next step trains, its row is
`step_metrics.py`; the held-out evaluation is `evaluator.py`, checkpoints `checkpointing.py`, a
trainer resize `trainer_resize.py`, and the watchdog that fails a stalled run `watchdog.py`. None
of them holds the controller.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import asdict
from functools import partial

import zmq
import zmq.asyncio

from areal_flow.config.schema import RunConfig
from areal_flow.controller import state as run_state
from areal_flow.controller.adapter_check import AdapterCheck
from areal_flow.controller.admission import Admission
from areal_flow.controller.checkpointing import Checkpoints
from areal_flow.controller.ending import record_failure, run_summary, why_it_ended, write_summary
from areal_flow.controller.evaluator import Evaluator
from areal_flow.controller.intake import Intake
from areal_flow.controller.ledger import Ledger
from areal_flow.controller.kept import KeptTrajectories
from areal_flow.controller.mailbox import Handler, Mailbox
from areal_flow.controller.outcomes import Outcomes
from areal_flow.controller.peers import Peers
from areal_flow.controller.prompts import PromptStream, load_datasets
from areal_flow.controller.rollout_failures import RolloutFailures
from areal_flow.controller.run_metrics import RunClock, reward_wait
from areal_flow.controller.servers import Servers
from areal_flow.controller.staleness import StalenessManager
from areal_flow.controller.state import for_ranks
from areal_flow.controller.step_metrics import Batch, StepMetrics, Trained
from areal_flow.controller.trainer_pool import merge_results, plan_step
from areal_flow.controller.trainer_resize import TrainerResize
from areal_flow.controller.watchdog import Progress, StalledRun, Wait, until_stalled
from areal_flow.graph.dag import graph_from_config
from areal_flow.graph.placement import infer_name
from areal_flow.metrics.writer import MetricsWriter
from areal_flow.models.tokenizer import load_tokenizer
from areal_flow.rollout import live
from areal_flow.rollout.runners import runner_of
from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.spec import RunSpec, read_spec
from areal_flow.transport.channels import make_socket, send_to
from areal_flow.transport.messages import (AdmitRequest, Admitted, GroupMeta, Hello, Joined, Live, Ready, Released, Resend,
                                           Route, Saved, StepDone, WeightsPublished)
from areal_flow.weights.files import record_loaded

log = logging.getLogger("areal_flow.controller")


class Controller:
    """The step loop and the handlers of the mailbox's table; each other concern is a component it holds."""

    def __init__(self, cfg: RunConfig, spec: RunSpec):
        self.cfg, self.spec = cfg, spec
        graph, algo = graph_from_config(cfg), cfg.algorithm
        # What a checkpoint saves; a resumed run's groups that were generating are admitted again.
        self.state, running = run_state.resume(spec.resume, spec.n_trainers) if spec.resume else \
            (run_state.new_state(cfg, graph, spec.n_trainers), {})
        tokenizer = load_tokenizer(spec.model_path)
        train, held_out, raw_rows, judge_fields = load_datasets(cfg, spec, graph, tokenizer)
        prompts = PromptStream(train, cfg.dataset.seed)
        prompts.seek(self.state.epoch, self.state.cursor)
        self.metrics = MetricsWriter(spec.path(rd.METRICS), cfg.metrics, run_name=cfg.recipe, config=asdict(cfg))
        self.ledger = Ledger(spec.path(rd.LEDGER))
        self.clock, self.progress = RunClock(), Progress()
        self.changed = asyncio.Event()  # a group finished or was dropped: a batch may be ready
        self.stop_requested = False  # the launcher asked for a checkpoint and a clean stop (SIGUSR1)
        self.wall_time_reached = False  # the step loop stopped at max_wall_seconds
        socket = make_socket(zmq.asyncio.Context(), zmq.ROUTER, bind=spec.endpoint("controller", spec.controller_port),
                             security=spec.security)
        # The multi-turn trajectories its checkpoint kept, continued where they were (controller/kept.py).
        self.kept = KeptTrajectories(partial(send_to, socket), {
            g: (running[g], kept) for g, kept in (live.load(spec.resume) if spec.resume else {}).items()
            if g in running and kept})
        self.admission = Admission(self.state, prompts, algo.group_size, self.ledger, raw_rows=raw_rows,
                                   judge_fields=judge_fields, readmit=list(running), kept=self.kept)
        self.outcomes = Outcomes(self.state, self.ledger, RolloutFailures.of(cfg.rollout.failed_groups_stall, graph.generate),
                                 success_rate_range=algo.success_rate_range,
                                 filter_stall_batches=algo.filter_stall_batches, batch_size=algo.batch_size)
        self.peers = Peers(partial(send_to, socket), self.progress)
        self.servers = Servers.of(cfg, spec, graph, self.peers.send_weights)
        # Held-out trajectories take turns too, or are an agent's rollouts.
        self.evaluator = Evaluator(cfg, graph, self.servers.policy.pool, tokenizer, held_out,
                                   runner_of(graph.generate, cfg, spec.model_path), run_dir=spec.run_dir,
                                   metrics=self.metrics, clock=self.clock, progress=self.progress, wake=self.changed.set)
        self.step_metrics = StepMetrics(algo, self.metrics, self.progress, self.servers.counts,
                                        reward_key=self.intake.reward_key, output_key=self.intake.output_keys[0],
                                        max_staleness=cfg.rollout.max_staleness, suspect_warn=cfg.metrics.suspect_warn,
                                        judges=list(self.servers.judges), reward_nodes=graph.rewards)
        self.checkpoints = Checkpoints(cfg.checkpoint, spec.run_dir, self.peers, self.clock, self.metrics, self.progress,
                                       saved=(self.state.step, self.state.train_elapsed), path=spec.resume)
        self.resize = TrainerResize(spec.run_dir, cfg.launcher.start_timeout + cfg.step_timeout, self.peers,
                                    self.progress, self.ledger, self.metrics)
        self.loading: Trained | None = None  # the last trained step, while its weights load
        # LoRA: each answer's adapters against the trainer's (real SGLang gets merged weights: no adapters to report).
        self.adapter_check = AdapterCheck(active=cfg.generation.backend == "embedded")
        self.mailbox = Mailbox(socket, self.table())

    def table(self) -> dict[type, Handler]:
        """Every message another process sends the controller, by type."""
        return {
            AdmitRequest: self.admission.joined,  # a rollout worker offers its slots
            Joined: self.reward_joined,  # a reward worker starts
            GroupMeta: self.route,  # a reward worker has scored a group
            Hello: self.peers.hello,  # a trainer rank starts
            Ready: self.peers.ready,  # an inference process (a node on a mesh of its own) is ready
            StepDone: self.peers.reply, WeightsPublished: self.peers.reply, Saved: self.peers.reply,
            Live: self.kept.reply,  # a rollout worker's trajectories in flight, for a checkpoint
        }

    @property
    def staleness(self) -> StalenessManager:
        return self.state.staleness

    @property
    def intake(self) -> Intake:
        return self.state.intake

    def request_stop(self) -> None:
        """SIGUSR1 from the launcher: save a checkpoint at the end of the current step, then stop
        (a Slurm job's script sends it again until the controller ends: said once)."""
        if self.stop_requested:
            return
        log.info("stop requested: the run stops after the current step%s",
                 ", with a checkpoint" if self.cfg.checkpoint.at_stop else "")
        self.stop_requested = True
        self.changed.set()

    # ---- the control plane: the handlers of other processes' messages --------------------------

    async def reward_joined(self, ident: bytes, msg: Joined) -> None:
        """A reward worker starts. Once the launcher restarted it, the groups it held are lost: every
        rollout worker sends the generated groups it still keeps again: a copy of a group routed but
        not yet trained goes to its rank again, any other copy of a group no longer running is
        dropped (in_transit.py)."""
        if self.peers.joined(msg):
            log.warning("controller: %s restarted; the rollout workers send their unrouted groups again", msg.worker)
            for worker in self.admission.slots.free:
                await self.mailbox.send(worker, Resend())

    async def grant(self) -> None:
        """Fill free rollout slots with prompt groups (admission.py); each worker gets its groups in one message."""
        for ident, groups in self.admission.grant().items():
            await self.mailbox.send(ident, Admitted(groups))

    async def route(self, ident: bytes, meta: GroupMeta) -> None:
        """Tell the reward worker which trainer rank takes a scored group, or to drop it (outcomes.py)."""
        for proc, n in meta.traffic.items():  # each process's running total: reported again, it counts once
            self.step_metrics.traffic.report(proc, n)
        if problem := self.adapter_check.check(meta):  # the run stops at its next batch (next_batch)
            log.error("controller: %s", problem)
            self.changed.set()
        if self.resize.hold(ident, meta):  # the trainer ranks are being resized: routed once they are
            return
        if meta.group_id not in self.staleness.running:  # a copy, after a reward worker restarted
            await self.mailbox.send(ident, Route(meta.group_id, self.admission.in_transit.again(meta.group_id)))
            return
        rank = self.outcomes.decide(meta)
        await self.mailbox.send(ident, Route(meta.group_id, rank))
        await self.release(self.admission.routed(meta.group_id, rank))
        self.changed.set()

    async def release(self, copies: dict[bytes, list[int]]) -> None:
        """The rollout workers may let go of these groups' copies (controller/in_transit.py)."""
        for owner, group_ids in copies.items():
            await self.mailbox.send(owner, Released(group_ids))

    # ---- the step loop -------------------------------------------------------------------------

    async def train(self) -> int:
        """The step loop: batch → step → publish → checkpoint. A step's new weights go to the
        generation servers while the trainer already trains the next step: a batch needs only
        finished groups, and the staleness rule counts versions at admission, so nothing waits for
        the load but the admissions at the new version. Where the trainer ranks send the weights
        themselves, and colocated, each update ends before the next step starts."""
        await self.step_metrics.restart()
        step = self.state.step
        try:
            while (batch := await self.batch_for(step)) is not None:
                trained = await self.train_step(step, batch)
                await self.publish(trained)
                step = self.state.step = step + 1
                if self.checkpoints.due(step):
                    await self.save_checkpoint(step)
            await self.settle()
            if self.checkpoints.saved[0] != step and (self.cfg.checkpoint.at_stop or not self.stop_requested):
                await self.save_checkpoint(step)  # the run's last state, to extend or resume it
        finally:
            if self.loading is not None and not self.loading.update.done():
                self.loading.update.cancel()
        return step

    async def batch_for(self, step: int) -> Batch | None:
        """Step `step`'s batch, or None where the loop ends: total_steps trained, a stop request, the
        wall-time limit. A trainer resize asked for goes first, between steps as a checkpoint."""
        cfg = self.cfg
        while step < cfg.total_steps and not self.stop_requested:
            if cfg.max_wall_seconds and self.clock.elapsed() > cfg.max_wall_seconds:
                self.wall_time_reached = True
                return None
            if self.resize.asked is not None:
                await self.settle()
                await self.resize_trainers(step)
            waited_from = time.time()  # wall clock, as the groups' stage times
            if (groups := await self.next_batch(step)) is not None:
                return Batch(groups, reward_wait([meta for meta, _, _ in groups.values()], waited_from))
        return None

    async def next_batch(self, step: int) -> dict[int, tuple[GroupMeta, int, int]] | None:
        """The groups step `step` trains (staleness.py decides which), waiting for them if needed:
        group id -> (metadata, rank holding it, tokens); None when a stop request or a trainer
        resize ends the wait. A failed weight update or evaluation ends it too (each sets
        `changed` when it ends), with its error."""
        self.progress.waits(Wait.BATCH, step=step)
        self.adapter_check.raise_if_mismatched()  # a server answered with adapters not trained
        if why := self.outcomes.failures.stopped():  # even with a batch ready: the groups keep failing
            raise StalledRun(why)
        while (ids := self.staleness.pick_batch(step)) is None:
            if self.stop_requested or self.resize.asked is not None:
                return None
            if why := self.outcomes.filter_stalled() or self.outcomes.failures.stopped():
                raise StalledRun(why)
            if self.loading is not None and self.loading.update.done():
                self.loading.update.result()  # raises a failed update's error
            self.adapter_check.raise_if_mismatched()
            self.evaluator.check()
            self.changed.clear()
            await self.changed.wait()
        self.staleness.trained(ids)
        self.ledger.write("train", step=step, groups=ids)
        return self.intake.take(ids)

    async def train_step(self, step: int, batch: Batch) -> Trained:
        """Each rank trains the groups the plan gives it, where their data already is."""
        t0, publisher = time.monotonic(), self.servers.policy
        plans = plan_step(step, {g: (rank, tokens) for g, (_, rank, tokens) in batch.groups.items()},
                          len(self.peers.ranks))
        if publisher.colocated:  # generation gives the trainer the devices (docs/colocation.md)
            self.progress.waits(Wait.MEMORY, step=step)
            await publisher.trainers_turn()
        self.progress.waits(Wait.STEP, step=step)
        t1 = time.monotonic()
        done = await self.peers.ask(plans.__getitem__, StepDone, f"step {step}")
        self.state.trainer_seconds += time.monotonic() - t1
        await self.release(self.admission.in_transit.trained(batch.groups))
        if publisher.colocated:
            await publisher.generations_turn()
        for d in done:
            self.step_metrics.traffic.report(f"trainer{d.rank}", d.sent_bytes)
        stats, weights = merge_results(done)
        self.adapter_check.trained(step + 1, min(done, key=lambda d: d.rank).adapter_digest)  # the version it loads as
        self.evaluator.step_trained()
        return Trained(step, batch, stats, time.monotonic() - t0, self.clock.elapsed(), await self.step_metrics.end(),
                       weights)

    async def publish(self, trained: Trained) -> None:
        """Load the step's weights on the servers, the step before closed first (its row comes
        first); the next step trains meanwhile where the publisher overlaps training."""
        await self.settle()
        trained.update = asyncio.create_task(self.update(trained.weights, trained.step + 1))
        trained.update.add_done_callback(lambda _: self.changed.set())  # next_batch sees a failure
        self.loading = trained
        if not self.servers.policy.overlaps_training:
            await self.settle()

    async def update(self, weights: str, version: int) -> float:
        """Load `version` on the generation servers, then admit at it; the seconds the load took.
        An evaluation beside training holds the servers at its version: the load waits for it."""
        await self.evaluator.before_load(version)
        seconds = await self.servers.policy.publish(weights, version)
        if not self.servers.policy.channel.sent_by_trainers:  # files: a restarted server starts from them
            record_loaded(self.spec.run_dir, weights, version)
        self.ledger.write("loaded", version=version, seconds=round(seconds, 4))
        self.staleness.set_version(version)
        await self.grant()
        return seconds

    async def settle(self) -> None:
        """Close the step whose weights are loading, if any: its row once they are loaded, and the
        held-out evaluation when due."""
        if self.loading is None:
            return
        done, state = self.loading, self.state
        self.progress.waits(Wait.LOAD, version=done.step + 1)
        update_seconds = await done.update
        self.step_metrics.log(self.step_metrics.row(
            done, update_seconds, self.cfg.algorithm.batch_size * self.cfg.algorithm.group_size, state.generated_tokens,
            dict(elapsed=self.clock.elapsed(), buffered=len(self.intake), running=len(self.staleness.running),
                 filtered_groups=state.filtered - state.filtered_logged,
                 **self.outcomes.failures.step_figures())))  # env/errors, env/error_share
        state.generated_tokens, state.filtered_logged = 0, state.filtered
        self.ledger.flush()
        self.loading = None
        self.evaluator.check()
        if self.evaluator.due(done.step + 1) and await self.evaluator.beside(done.step + 1):
            await self.step_metrics.restart()  # not training time: the rates restart after it
        self.progress.made()

    async def save_checkpoint(self, step: int) -> str:
        """A resumable checkpoint after `step` steps (checkpointing.py), between steps: the step
        whose weights load is closed first."""
        await self.settle()
        kept = await self.kept.collect(list(self.admission.slots.free))
        return await self.checkpoints.save(step, self.snapshot, {live.FILE: live.encode(kept)})

    def snapshot(self) -> tuple[bytes, int, dict[int, list[int]]]:
        """The run state as it is now, encoded; its version; the scored groups each rank holds."""
        state, prompts = self.state, self.admission.prompts
        self.ledger.flush()
        state.ledger_bytes, state.metrics_bytes = self.ledger.tell(), self.metrics.tell()
        state.epoch, state.cursor = prompts.epoch, prompts.cursor
        state.train_elapsed = self.clock.elapsed()
        held = {rank: sorted(g for g, r in state.intake.location.items() if r == rank) for rank in self.peers.ranks}
        versions = {g: version for g, (version, _) in self.kept.pending.items()}
        return run_state.encode(state, self.admission.readmit, versions), state.staleness.version, held

    async def resize_trainers(self, step: int) -> None:
        """Go on with the number of trainer ranks the launcher asks for (trainer_resize.py), then route
        the scored groups held meanwhile."""
        async def checkpoint(step: int) -> str:
            return self.checkpoints.of_step(step) or await self.save_checkpoint(step)

        def regroup(n: int) -> None:
            self.spec = read_spec(self.spec.run_dir)  # the new ranks' inboxes, written by the launcher
            for_ranks(self.state, n)  # the groups old rank k held, each new rank k mod n loaded

        held = await self.resize.run(step, checkpoint, regroup)
        await self.release(self.admission.in_transit.all_held())  # the new ranks loaded every group routed
        for ident, meta in held:
            await self.route(ident, meta)
        self.progress.made()

    # ---- start and finish ----------------------------------------------------------------------

    async def wait_for_processes(self) -> None:
        """Every generation server healthy, then every trainer rank and inference process reported."""
        timeout, spec = self.cfg.launcher.start_timeout, self.spec
        await self.servers.healthy(spec, timeout)
        replicas = {infer_name(node, i) for node, ports in spec.infer_ports.items() for i in range(len(ports))}
        await self.peers.until_reported(spec.n_trainers, replicas, self.mailbox.receive, timeout)

    async def watched(self, work):
        """`work` under the watchdog: a run where no step completes within step_timeout fails."""
        return await until_stalled(work, self.progress, self.cfg.step_timeout, self.situation)

    async def situation(self) -> str:
        """What a stalled run's error says after what the step loop waits for."""
        frozen, algo = await self.servers.unresponsive(), self.cfg.algorithm
        filtered = self.state.filtered - self.state.filtered_logged
        return (f"; {len(self.staleness.finished)} prompt group(s) finished, {len(self.staleness.running)} generating"
                + (f"; dynamic filtering dropped {filtered} group(s) since the last step: their success rates fell "
                   f"outside algorithm.success_rate_range={algo.success_rate_range} (widen it, or null to train "
                   "every group)" if filtered else "")
                + (f"; {', '.join(frozen)} does not answer /health" if frozen else ""))

    async def run(self) -> None:
        await self.wait_for_processes()
        cfg, state = self.cfg, self.state
        self.metrics.log("start", total_steps=cfg.total_steps, batch_size=cfg.algorithm.batch_size,
                         group_size=cfg.algorithm.group_size, max_staleness=cfg.rollout.max_staleness)
        if state.resumes:
            self.ledger.write("resume", step=state.step, checkpoint=self.spec.resume)
            self.metrics.log("resume", step=state.step, checkpoint=self.spec.resume, resumes=state.resumes)
        first = state.step == 0 and not state.resumes
        acc_start = await self.evaluator.at("start", 0) if cfg.eval_at_start and first else None
        background = [asyncio.create_task(self.mailbox.serve(self.grant)), asyncio.create_task(self.resize.watch(
            self.changed.set)), *self.servers.follow(self.spec.run_dir, self.ledger)]
        self.clock.start(already=state.train_elapsed)
        await self.grant()
        steps = await self.watched(self.train())
        if self.evaluator.task is not None:  # an evaluation beside training still running: its row belongs to the run
            await self.watched(self.evaluator.last())
        train_wall = self.clock.elapsed()
        self.admission.closing = True  # no new admissions; running groups finish or stay accounted for
        stopped = self.stop_requested and steps < cfg.total_steps
        acc_end = await self.evaluator.at("end", steps) if cfg.eval_at_end and not stopped else None
        checkpoint = None if stopped else await self.checkpoints.export(self.spec.path(rd.EXPORT))
        for task in background:
            task.cancel()
        reason = why_it_ended(cfg, steps, wall_time=self.wall_time_reached)
        log.info("the run ended: %s", reason["message"])
        write_summary(self.metrics, self.spec.run_dir, run_summary(
            self.state, cfg.algorithm.group_size, self.spec.run_dir, steps, stopped=stopped,
            accuracy=(acc_start, acc_end), train_wall=train_wall, checkpoint=checkpoint, reason=reason))
        # The launcher stops every other process once the controller has exited cleanly.
        self.metrics.close()
        await self.servers.close()


def main(cfg: RunConfig, spec: RunSpec, name: str, rank: int) -> None:
    async def run() -> None:  # sockets and events are made inside the loop they belong to
        controller = Controller(cfg, spec)
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, controller.request_stop)
        try:
            await controller.run()
        except Exception as e:  # whatever ended the run is its recorded reason (the launcher prints it)
            log.error("the run ended: %s", record_failure(controller.metrics, e)["message"])
            raise
        finally:  # a failed run keeps the record of what it did
            controller.ledger.close()
            controller.evaluator.close()

    asyncio.run(run())
