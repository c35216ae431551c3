"""A discrete-event simulation of the asynchronous pipeline (docs/advise.md, "The model").

The controller's rules are the real ones: admission and batch choice are `StalenessManager`'s
(controller/staleness.py), called in the order `controller/main.py` calls them. Each generation
server decodes its running answers one token per step at `a + b·n (+ e·context)` seconds a step
and prefills at `p0 + p·tokens` (a new prompt once per group; `padded`: context and tokens count
the padding to the longest answer or sequence, as the embedded engine computes); a train step runs
`c + d·tokens / (devices · efficiency)`; each new version pauses the servers (interrupting: running
answers are aborted and prefilled again as prompt + tokens so far; not interrupting: each server
drains its running answers, admitting none, then loads), while the trainer may already train the
next step (not the one after; `trainer_waits`: none). Colocated (`Candidate.colocated`), generation
and training take turns on the same devices: from the moment a batch is taken every server stops at
its next step boundary, its running answers retracted as an interrupting update aborts them, the
trainer trains on all the devices once every server has stopped, and the servers load the new
weights and go on only then (docs/colocation.md). Dynamic filtering drops each finished group
with probability `filtered_fraction`, freeing its admission slot (a group's fate is drawn at
admission, and with recorded groups its lengths come from groups of that fate). A group reaches
its server `latency.admit_s` after its admission and the controller `latency.deliver_s` after its
last answer.

Between two events a server's batch does not change, so it advances many decode steps at once
(to its next finishing answer, or to the step boundary after something arrives): the cost of a
simulation grows with the number of answers, not tokens.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from operator import attrgetter
from typing import Any, Callable

from areal_flow.advise.costs import AdviseError, Costs
from areal_flow.advise.prediction import Candidate, Measured, Prediction, mean_prediction
from areal_flow.advise.sim_state import SimGroup, SimSeq, SimServer
from areal_flow.controller.staleness import StalenessManager

UNBOUNDED = 1 << 40
"""max_concurrent when none is given: only the staleness bound limits admission."""


class _Simulation:
    """One run of the event loop: the controller's rules, the servers and the trainer, until
    `warmup` + `steps` updates have ended (`Measured` records what the prediction needs)."""

    def __init__(self, costs: Costs, cand: Candidate, steps: int, warmup: int, seed: int, trace: list | None):
        self.costs, self.cand = costs, cand
        self.gen, self.work = costs.gen, costs.workload
        per_server = self.gen.devices_per_server
        if cand.gen_devices % per_server:
            raise AdviseError(f"--splits: {cand.gen_devices} generation devices are not a multiple of "
                              f"generation.devices_per_server={per_server}")
        self.servers = [SimServer(i) for i in range(cand.gen_devices // per_server)]
        self.B, self.G = self.work.batch_size, self.work.group_size
        self.colocated = cand.colocated
        if self.colocated and not (cand.interrupt and self.work.interrupt):
            raise AdviseError("colocated: generation hands the devices to the trainer by retracting its running "
                              "answers, so rollout.interrupt must be true")
        self.manager = StalenessManager(self.B, cand.eta, self.work.max_concurrent or UNBOUNDED)
        update = costs.update
        pause = update.interrupt_pause_s if self.work.interrupt and update.interrupt_pause_s is not None else update.pause_s
        self.pause_s = pause + (update.colocated_switch_s if self.colocated else 0.0)
        self.draw = costs.lengths.group_sampler(random.Random(seed), self.work.group_size)
        self.filter_draw = random.Random(f"filter-{seed}").random  # apart from the lengths' draws
        self.total, self.warmup = warmup + steps, warmup
        self.trace = trace
        self.heap: list[tuple[float, int, Callable, tuple]] = []
        self.order = itertools.count()
        self.now = 0.0
        self.groups: dict[int, SimGroup] = {}
        self.next_gid = 0
        self.step = 0  # the version the servers serve (steps whose update has ended)
        self.begun = 0  # train steps begun
        self.trainer = "waiting"  # waiting | releasing (colocated: the servers stopping) | training
        self.updating = False  # a weight update is under way
        self.update_due = False  # a trained step's update waits for the one under way
        # The controller trains the next step while the servers load the last one's weights, never
        # the one after (controller/main.py); with the trainer waiting for each update (weights by
        # broadcast, or colocated: the servers hold the devices until they have loaded), none ahead.
        self.ahead = 0 if costs.update.trainer_waits or self.colocated else 1
        self.waiting_for = 0  # servers the update (or a colocated train step) still waits for
        self.on_stopped: Callable[[], None] = lambda: None  # what follows once every server has paused
        self.measured = Measured()

    # ---- the event loop -------------------------------------------------------------------------

    def at(self, t: float, fn: Callable, *args: Any) -> None:
        heapq.heappush(self.heap, (t, next(self.order), fn, args))

    def after(self, delay: float, fn: Callable, *args: Any) -> None:
        """fn(*args) `delay` seconds from now; at once when there is no delay."""
        if delay > 0:
            self.at(self.now + delay, fn, *args)
        else:
            fn(*args)

    def run(self) -> None:
        self.grant()
        while len(self.measured.step_ends) < self.total:
            if not self.heap:
                raise RuntimeError(f"the simulation stalled at step {self.step} ({self.cand.label}, η={self.cand.eta})")
            self.now, _, fn, args = heapq.heappop(self.heap)
            fn(*args)

    # ---- the controller: admission, batch choice, the step loop ---------------------------------

    def grant(self) -> None:
        """Admit groups while StalenessManager allows; each goes whole to the least-loaded server."""
        while self.manager.can_admit():
            gid, self.next_gid = self.next_gid, self.next_gid + 1
            self.manager.admit(gid)
            # Its fate is drawn first: a group filtering will drop is drawn from the dropped ones' lengths.
            group = SimGroup(gid, self.G, filtered=self.filter_draw() < self.work.filtered_fraction)
            group.seqs = [SimSeq(group, i, n) for i, n in enumerate(self.draw(group.filtered))]
            self.groups[gid] = group
            server = min(self.servers, key=attrgetter("load"))  # the first of the least loaded
            server.load += self.G
            if self.trace is not None:
                self.trace.append((self.now, self.manager.version, self.manager.accepted, len(self.manager.running),
                                   sum(g.left > 0 for g in self.groups.values())))
            self.after(self.costs.latency.admit_s, self.arrived, server, group)

    def group_finished(self, group: SimGroup) -> None:
        if group.filtered:
            # Dynamic filtering drops it, as the controller does: it leaves the running set unaccepted.
            self.manager.abandon(group.gid)
            del self.groups[group.gid]
        else:
            self.manager.finish(group.gid)
        self.grant()
        if self.trainer == "waiting":
            self.try_batch()

    def try_batch(self) -> None:
        if self.trainer != "waiting" or self.begun > self.step + self.ahead:
            return
        step = self.begun
        ids = self.manager.pick_batch(step)
        if ids is None:
            return
        self.begun += 1
        self.manager.trained(ids)
        seqs = [s for g in ids for s in self.groups.pop(g).seqs]
        tokens = sum(self.work.prompt_tokens + s.length for s in seqs)
        hist: dict[int, int] = {}
        for s in seqs:
            for version, n in s.versions.items():
                hist[step - version] = hist.get(step - version, 0) + n
        train = self.costs.train
        stale = any(age > 0 and n for age, n in hist.items())  # the prox forward runs only then (training/worker.py)
        seconds = train.step_fixed_s + train.per_token_s * tokens * (1 + train.prox_fraction * stale) / (
            self.cand.train_devices * train.dp_efficiency)
        self.measured.hist.append(hist)
        self.measured.step_tokens.append(tokens)
        if self.colocated:  # the trainer's turn begins once every server has freed the devices
            self.trainer = "releasing"
            self.stop_servers(lambda: self.train(seconds))
        else:
            self.train(seconds)

    def train(self, seconds: float) -> None:
        if any(s.op in ("decode", "prefill") for s in self.servers):
            seconds *= 1 + self.costs.train.shared_slowdown
        self.measured.train_spans.append((self.now, self.now + seconds))
        self.trainer = "training"
        self.sharing_changed()
        self.at(self.now + seconds, self.trained)

    def trained(self) -> None:
        """A train step ended: its update starts, or waits for the one under way to end."""
        self.trainer = "waiting"
        self.sharing_changed()
        if self.updating:
            self.update_due = True
        else:
            self.start_update()
        self.try_batch()

    def start_update(self) -> None:
        """Publish version step + 1: pause (interrupting) or drain (not) every server; colocated,
        they have been paused since the batch was taken and load at once."""
        self.updating = True
        if self.colocated:
            self.at(self.now + self.pause_s, self.loaded_all)
        elif self.work.interrupt:
            self.stop_servers(lambda: self.at(self.now + self.pause_s, self.loaded_all))
        else:
            self.waiting_for = len(self.servers)
            for s in self.servers:
                s.draining = True
                self.next_op(s)

    def stop_servers(self, then: Callable[[], None]) -> None:
        """Pause every server at its next step boundary (`pause`); `then()` once all have."""
        self.waiting_for, self.on_stopped = len(self.servers), then
        for s in self.servers:
            s.pause_wanted = True
            if s.op is None:
                self.pause(s)
            elif s.op == "decode":
                self.cut(s)  # aborted between two decode steps, as the engine does

    def published(self) -> None:
        """Every server serves the new version: set it, admit, look for the next batch."""
        self.step += 1
        self.manager.set_version(self.step)
        self.measured.step_ends.append(self.now)
        if len(self.measured.step_ends) in (self.warmup, self.total):
            self.measured.busy_marks.append((sum(s.busy_until(self.now) for s in self.servers) / len(self.servers),
                                    sum(s.decoded for s in self.servers)))
        self.updating = False
        if len(self.measured.step_ends) == self.total:
            return
        self.grant()
        if self.update_due:
            self.update_due = False
            self.start_update()
        self.try_batch()

    def sharing_changed(self) -> None:
        """The trainer started or stopped: decode ops end at their next step boundary and go on at
        the cost that applies now (GenCosts.shared_slowdown)."""
        if self.gen.shared_slowdown:
            for s in self.servers:
                if s.op == "decode":
                    self.cut(s)

    # ---- a generation server ---------------------------------------------------------------------

    def arrived(self, s: SimServer, group: SimGroup) -> None:
        """A group's request reaches its server: it queues, and joins the batch at the next step."""
        s.queue.extend(group.seqs)
        if s.op is None:
            self.next_op(s)
        elif s.op == "decode" and not s.draining and self.room(s):
            self.cut(s)  # the new answers join at the next step boundary (continuous batching)

    def room(self, s: SimServer) -> int:
        """How many queued answers may join now: up to max_running, and while answers run, none
        until at least min(join_group, queued) can (GenCosts.join_group)."""
        cap = self.gen.max_running
        room = UNBOUNDED if cap is None else cap - len(s.running)
        return room if room >= (min(self.gen.join_group, len(s.queue)) if s.running else 1) else 0

    def begin(self, s: SimServer, op: str, seconds: float, steps: int = 0, step_cost: float = 0.0,
              step_growth: float = 0.0) -> None:
        s.op, s.op_start, s.op_end, s.op_steps = op, self.now, self.now + seconds, steps
        s.step_cost, s.step_growth = step_cost, step_growth
        s.wake += 1
        self.at(s.op_end, self.woken, s, s.wake)

    def cut(self, s: SimServer) -> None:
        """End the decode op at the first step boundary from now on."""
        if self.now >= s.op_end:
            return
        elapsed, first, growth = self.now - s.op_start, s.step_cost, s.step_growth
        if growth > 0:  # the smallest m with m·first + growth·m(m−1)/2 ≥ elapsed
            half = first - growth / 2
            m = (-half + math.sqrt(half * half + 2 * growth * elapsed)) / growth
        else:
            m = elapsed / first
        steps = min(s.op_steps, math.ceil(m - 1e-9))
        if steps < s.op_steps:
            s.op_steps, s.op_end = steps, s.op_start + _decode_seconds(steps, first, growth)
            s.wake += 1
            self.at(s.op_end, self.woken, s, s.wake)

    def next_op(self, s: SimServer) -> None:
        if s.op is not None or s.paused:
            return
        if s.draining and not s.running and not s.admitting:
            self.begin(s, "load", self.pause_s)
        elif not s.draining and s.queue and (room := self.room(s)):
            s.admitting = [s.queue.popleft() for _ in range(min(room, len(s.queue)))]
            # The G answers of a new prompt share its prefill (identical sequences are prefilled once).
            fresh = {id(q.group) for q in s.admitting if not q.resumed}
            prompt = self.work.prompt_tokens
            lengths = [prompt] * len(fresh) + [prompt + q.done for q in s.admitting if q.resumed]
            tokens = len(lengths) * max(lengths) if self.gen.padded else sum(lengths)
            self.begin(s, "prefill", self.slowdown() * (self.gen.prefill_fixed_s + self.gen.prefill_per_token_s * tokens))
        elif s.running:
            n, e = len(s.running), self.gen.step_per_context_token_s * self.slowdown()
            steps = s.finishing[0][0] - s.steps
            if self.gen.padded:  # every answer reads the longest context, padding included
                context = n * (max(self.work.prompt_tokens + q.done - q.start for q in s.running) + s.steps)
            else:
                context = s.context + n * s.steps
            first = self.slowdown() * (self.gen.step_fixed_s + self.gen.step_per_seq_s * n) + e * context
            self.begin(s, "decode", _decode_seconds(steps, first, e * n), steps, first, e * n)

    def slowdown(self) -> float:
        """What a generation op costs now, relative to the generator running alone."""
        return 1 + self.gen.shared_slowdown if self.trainer == "training" else 1.0

    def woken(self, s: SimServer, token: int) -> None:
        if token != s.wake:
            return  # the op was cut; a later wake-up ends it
        op, s.op = s.op, None
        if op in ("decode", "prefill"):
            s.busy += s.op_end - s.op_start
        done: list[SimGroup] = []
        finished = 0
        if op == "decode":
            s.steps += s.op_steps
            s.decoded += s.op_steps * len(s.running)
            while s.finishing and s.finishing[0][0] <= s.steps:
                finished += 1
                _, _, q = heapq.heappop(s.finishing)
                s.running.discard(q)
                s.context -= self.work.prompt_tokens + q.done - q.start
                q.versions[s.version] = q.versions.get(s.version, 0) + q.length - q.done
                q.done = q.length
                s.load -= 1
                q.group.left -= 1
                if not q.group.left:
                    done.append(q.group)
        elif op == "prefill":
            for q in s.admitting:
                q.start = s.steps
                s.running.add(q)
                s.context += self.work.prompt_tokens + q.done - q.start
                heapq.heappush(s.finishing, (s.steps + q.length - q.done, next(self.order), q))
            s.admitting = []
        elif op == "load":  # not interrupting: this server has drained and loaded
            s.version, s.draining = self.step + 1, False
            self.waiting_for -= 1
            if not self.waiting_for:  # the controller's update returns once every server has loaded
                self.published()
        elif op == "answer":  # handed back: the groups it finished travel on to the controller
            done, s.answering = s.answering, []
        if finished and self.gen.answer_s > 0:
            # The server hands the step's finished answers back before its next step.
            s.answering = done
            self.begin(s, "answer", finished * self.gen.answer_s)
            return
        if s.pause_wanted:
            self.pause(s)
        for group in done:
            self.after(self.costs.latency.deliver_s, self.group_finished, group)
        self.next_op(s)

    def pause(self, s: SimServer) -> None:
        """Abort the running answers; they come back, after the update, as prompt + tokens so far."""
        for q in s.running:
            n = s.steps - q.start
            q.versions[s.version] = q.versions.get(s.version, 0) + n
            q.done += n
            q.resumed = True
        s.queue.extend(sorted(s.running, key=lambda q: (q.group.gid, q.index)))
        s.running.clear()
        s.finishing.clear()
        s.context = 0
        s.pause_wanted, s.paused = False, True
        self.waiting_for -= 1
        if not self.waiting_for:  # every server paused: they load at once (colocated: the trainer's turn)
            self.on_stopped()

    def loaded_all(self) -> None:
        """Interrupting or colocated: every paused server has loaded the new version and continues."""
        for s in self.servers:
            s.version, s.paused = self.step + 1, False
        self.published()
        for s in self.servers:
            self.next_op(s)

    def prediction(self) -> Prediction:
        return self.measured.prediction(self.cand, self.warmup, self.total,
                                        len(self.servers) * self.gen.devices_per_server, self.B * self.G)


def _decode_seconds(steps: int, first: float, growth: float) -> float:
    """Seconds of `steps` decode steps, the first costing `first` and each next `growth` more."""
    return steps * first + growth * steps * (steps - 1) / 2


def simulate(costs: Costs, cand: Candidate, *, steps: int = 20, warmup: int | None = None, seed: int = 0,
             trace: list | None = None, seeds: int = 1) -> Prediction:
    """Simulate `warmup` + `steps` train steps of `cand` and predict over the last `steps`.

    `warmup` defaults to η + 2 (the pipeline fills in about η steps). With `seeds` > 1, the mean
    of that many simulations, seeds `seed`, `seed` + 1, ... (over a few dozen steps one draw of the
    lengths and of the filter moves a prediction by ~5%). `trace`, if a list, gets one (time,
    version, accepted, running groups, groups not finished) tuple per admission of the first."""
    if steps < 1:
        raise AdviseError(f"--steps must be at least 1, got {steps}")
    if seeds < 1:
        raise AdviseError(f"--seeds must be at least 1, got {seeds}")
    preds = []
    for i in range(seeds):
        sim = _Simulation(costs, cand, steps, cand.eta + 2 if warmup is None else warmup, seed + i,
                          trace if i == 0 else None)
        sim.run()
        preds.append(sim.prediction())
    return mean_prediction(preds)
