"""Adding and removing generation servers (the policy's, a judge's) and resizing the trainer while a
run goes on: the launcher's side of `python -m areal_flow.scale RUN_DIR generate=+2`, `judge=+1`,
`trainers=2` (docs/reliability.md, "Elastic"; the trainer's hand-offs: runtime/resize.py).

The command writes its request to `scale/request.json` (made exclusively: one scale at a time) and
waits for its line in `scale/results.jsonl`. The launcher looks for a request at every tick of its
watch loop (`Scaler.tick`) and carries it out step by step without blocking the loop: each
operation is a generator that yields while it waits, so a process that dies meanwhile is noticed
(and restarted) as at any other time.

- **Up** (`generate=+k`): k servers on free devices (`generation.tp_size` each), started from the
  run's first weights (a newer version's files may be pruned while a server starts), each listed
  in servers.json as `joining` once its /health answers; the controller's pool takes it, loading
  the current version on it, and marks it ready; then it is listed as serving and every rollout
  worker's pool takes it (generation/client/membership.py says why in two steps). A server
  that does not start is reported, stopped and left out; the run goes on.
- **Down** (`generate=-k`): the newest k servers are marked `leaving` (no new request goes to them;
  weight updates still do), once every follower has acknowledged that, their running requests are
  aborted (each comes back to its caller with its tokens so far and goes on elsewhere), then they
  are dropped from the list (no more updates) and, once that is acknowledged, their processes stop.

Every change is recorded: servers.json's epoch, the controller's ledger (`scale` events), the
process table (`areal_flow.status`), and the result line (what changed and how long it took).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
import urllib.request
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import msgspec

from areal_flow.generation.client.generation_client import auth_headers, wait_healthy
from areal_flow.generation.client.membership import (ACKS, READY, Member, Membership, acknowledged, is_ready,
                                              read_membership, servers_file, write_membership)
from areal_flow.graph.placement import Proc
from areal_flow.launchers.autoscale import AutoScaler
from areal_flow.runtime import resize
from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.security import is_loopback
from areal_flow.runtime.spec import read_spec, write_spec

LOCK_FILE, REQUEST, RESULTS = rd.LOCK, rd.SCALE_REQUEST, rd.SCALE_RESULTS
ROLES = {"generate": "generation server(s)", "trainers": "trainer rank(s)", "judge": "judge server(s)"}
"""What a scale command may change: the policy's generation servers, the trainer's data-parallel
ranks, a judge's servers (`judge`, or `judge:<node>` in a run with several judges)."""
FILE_MODES = ("disk", "shm")
"""rollout.weight_update_mode values whose servers can join later: each loads the weights from files."""
ACK_TIMEOUT = 30.0
"""Seconds the launcher waits for every follower to apply a change before it goes on."""
DRAIN_SECONDS = 1.0
"""Seconds a leaving server's aborted requests get to come back to their callers before it stops."""


class ScaleRefused(ValueError):
    """A scale command that cannot be carried out; the run is unchanged."""


@dataclass
class Request:
    id: str
    role: str
    change: str  # "+k", "-k" or "k"
    asked: float  # time.time() of the command

    @property
    def text(self) -> str:
        return f"{self.role}={self.change}"


def parse_change(role: str, change: str) -> tuple[str, int]:
    """("add" | "set", k) of a size change `+k`, `-k` or `k`; ScaleRefused naming the argument."""
    if role.partition(":")[0] not in ROLES:
        raise ScaleRefused(f"{role}={change}: there is no role {role!r} to scale (roles: {', '.join(ROLES)})")
    text = change.strip()
    try:
        k = int(text)
    except ValueError:
        raise ScaleRefused(f"{role}={change}: a size is N, +N or -N (a whole number)") from None
    return ("add", k) if text[:1] in "+-" else ("set", k)


def target_size(role: str, change: str, now: int) -> int:
    """The size `change` asks for, with `now` of `role` running; ScaleRefused below 1 or when nothing changes."""
    how, k = parse_change(role, change)
    target = now + k if how == "add" else k
    if target < 1:
        raise ScaleRefused(f"{role}={change}: it would leave {target} {_noun(role)} of {now}; a run needs at least 1")
    if target == now:
        raise ScaleRefused(f"{role}={change}: the run has {now} {_noun(role)} already")
    return target


def _noun(role: str) -> str:
    return ROLES[role.partition(":")[0]]


def judge_of(role: str, judges: list[str]) -> str:
    """The judge node a role names (`judge`: the run's one judge; `judge:<node>`), "" for another
    role; ScaleRefused when it names no judge of the run."""
    kind, _, node = role.partition(":")
    if kind != "judge":
        return ""
    if not judges:
        raise ScaleRefused(f"{role}: this run has no judge (a graph node of type judge)")
    if not node and len(judges) > 1:
        raise ScaleRefused(f"{role}: this run has judges {', '.join(judges)}: name one, e.g. judge:{judges[0]}=+1")
    if node and node not in judges:
        raise ScaleRefused(f"{role}: this run has no judge {node!r} (its judges: {', '.join(judges)})")
    return node or judges[0]


@dataclass(frozen=True)
class Servers:
    """The servers a scale adds or removes: the policy's (`judge` "") or a judge's."""

    judge: str = ""
    per_server: int = 1  # devices a server

    @property
    def prefix(self) -> str:
        return f"{self.judge}_server" if self.judge else "gen_server"

    @property
    def role(self) -> str:
        return "judge_server" if self.judge else "gen_server"


def running(run_dir: str) -> bool:
    """Whether a live launcher holds the run directory (its lock, LOCK_FILE: run/lock.py)."""
    try:
        fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def submit(run_dir: str, role: str, change: str) -> Request:
    """Write the request for the launcher; ScaleRefused when another is in progress."""
    request = Request(uuid.uuid4().hex[:12], role, change, time.time())
    os.makedirs(os.path.join(run_dir, "scale"), exist_ok=True)
    try:
        fd = os.open(os.path.join(run_dir, REQUEST), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pending = read_request(run_dir)
        since = time.strftime("%H:%M:%S", time.localtime(pending.asked)) if pending else "?"
        raise ScaleRefused(f"another scale command is in progress ({pending.text if pending else 'unreadable'}, "
                           f"since {since}): wait for it to finish") from None
    with os.fdopen(fd, "w") as f:
        json.dump(request.__dict__, f)
    return request


def read_request(run_dir: str) -> Request | None:
    try:
        with open(os.path.join(run_dir, REQUEST)) as f:
            return Request(**json.load(f))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None


def results(run_dir: str) -> list[dict]:
    try:
        with open(os.path.join(run_dir, RESULTS)) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


Command = Callable[[Proc, int, str], tuple[list[str], dict[str, str]]]
"""How to start process `proc` (a generation server on `port` of `host`, a trainer rank): its argv and environment."""


class Scaler:
    """Carries out scale requests for a launcher (LocalLauncher or RayLauncher) from its watch loop."""

    def __init__(self, launcher: Any, run_dir: str, *, command: Command, n_devices: int, per_server: int,
                 followers: list[str], weight_mode: str, restarts: int, api_key: str | None = None,
                 start_timeout: float = 300.0, trainer_problem: Callable[[int], str | None] = lambda n: None,
                 judges: list[str] | None = None, auto: AutoScaler | None = None,
                 say: Callable[[str], None] = lambda text: None, devices_named: str = "cluster.n_devices") -> None:
        # command: starts a server or a trainer rank; followers: the processes that apply servers.json
        # (the controller, the rollout workers); trainer_problem: what stops the run's trainer from
        # training on n ranks, if anything (run/start.py); judges: the run's judge nodes; auto: the
        # autoscaler (elastic.auto), whose decisions `say` tells the user.
        self.launcher, self.run_dir, self.command = launcher, run_dir, command
        self.trainer_problem, self.judges, self.auto, self.say = trainer_problem, judges or [], auto, say
        self.devices_named = devices_named  # what n_devices counts, for a refusal: the config's keys
        self.n_devices, self.per_server, self.followers = n_devices, per_server, followers
        self.weight_mode, self.restarts, self.api_key, self.start_timeout = weight_mode, restarts, api_key, start_timeout
        self.op: Generator[None, None, dict] | None = None
        self.request: Request | None = None
        self.next_index: dict[str, int] = {}  # a server name's prefix -> the next new server's index

    @staticmethod
    def reset(run_dir: str, servers: dict[str, str], judges: dict[str, dict[str, str]] | None = None) -> None:
        """A launch's start: servers.json lists the placement's servers (and each judge's file its
        judge's); acknowledgements and a request left by an earlier launch are gone."""
        for folder in (ACKS, READY):
            shutil.rmtree(os.path.join(run_dir, folder), ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(run_dir, REQUEST))
        resize.clear(run_dir)
        for judge, listed in {"": servers, **(judges or {})}.items():
            write_membership(run_dir, Membership(0, {name: Member(url) for name, url in listed.items()}), judge)

    def tick(self) -> None:
        """Advance the scale in progress, or start the next request."""
        if self.op is None:
            if (request := read_request(self.run_dir)) is None:
                self._autoscale()
                return
            self.request, self.op = request, self._run(request)
        try:
            next(self.op)
        except StopIteration as done:
            self._finish(done.value)

    def _autoscale(self) -> None:
        """Ask for what the autoscaler decides, as the scale command would."""
        if self.auto is None or (membership := read_membership(self.run_dir)) is None:
            return
        if (decision := self.auto.poll(len(membership.serving()), len(self.free_devices()))) is not None:
            self.say(f"autoscaler: generate={decision.change}: {decision.why}")
            with contextlib.suppress(ScaleRefused):  # a command given meanwhile goes first
                submit(self.run_dir, "generate", decision.change)

    # ---- one request -----------------------------------------------------------------------------

    def _run(self, request: Request) -> Generator[None, None, dict]:
        t0 = time.monotonic()
        try:
            if not self.launcher.scales:
                raise ScaleRefused(f"{request.text}: launcher.type={type(self.launcher).__name__} cannot start and "
                                   "stop processes while the run goes on; the local and Ray launchers can")
            if self.weight_mode not in FILE_MODES:
                raise ScaleRefused(f"{request.text}: rollout.weight_update_mode={self.weight_mode} sends weights over "
                                   "a group fixed at the run's start; servers and trainer ranks can join and leave "
                                   "with disk or shm")
            if request.role == "trainers":
                out = yield from self._resize(request)
                return {"ok": True, "seconds": round(time.monotonic() - t0, 3), **out}
            judge = judge_of(request.role, self.judges)
            kind = Servers(judge, 1 if judge else self.per_server)  # a judge's server: one device
            now = len(self._membership(kind).serving())
            target = target_size(request.role, request.change, now)
            if target > now:
                out = yield from self._up(target - now, kind)
            else:
                out = yield from self._down(now - target, kind)
        except ScaleRefused as e:
            return {"ok": False, "refused": True, "message": str(e)}
        return {"ok": not out.get("failed"), "seconds": round(time.monotonic() - t0, 3), **out}

    def _finish(self, result: dict) -> None:
        request, self.op, self.request = self.request, None, None
        line = {"id": request.id, "command": request.text, "time": time.time(), **result}
        with open(os.path.join(self.run_dir, RESULTS), "a") as f:
            f.write(json.dumps(line) + "\n")
        os.remove(os.path.join(self.run_dir, REQUEST))

    def _membership(self, kind: Servers) -> Membership:
        membership = read_membership(self.run_dir, kind.judge)
        if membership is None:
            raise ScaleRefused(f"this run has no {servers_file(kind.judge)}: it was started by an older areal_flow")
        return membership

    def _publish(self, membership: Membership, kind: Servers) -> Generator[None, None, None]:
        """Write the next epoch and wait (up to ACK_TIMEOUT) until every follower applied it."""
        membership.epoch += 1
        write_membership(self.run_dir, membership, kind.judge)
        deadline = time.monotonic() + ACK_TIMEOUT
        while any(acknowledged(self.run_dir, f, kind.judge) < membership.epoch for f in self.followers):
            if time.monotonic() > deadline:
                return  # a follower restarting reads servers.json when it starts
            yield

    def free_devices(self) -> list[int]:
        used = {d for proc in self.launcher.running_procs() for d in proc.devices}
        return [d for d in range(self.n_devices) if d not in used]

    def _up(self, count: int, kind: Servers) -> Generator[None, None, dict]:
        free, need = self.free_devices(), count * kind.per_server
        if len(free) < need:
            raise ScaleRefused(f"{self.request.role}=+{count} needs {need} free device(s) ({kind.per_server} a server"
                               f"{'' if kind.judge else ': generation.tp_size'}); free: "
                               f"{', '.join(map(str, free)) or 'none'} of {self.n_devices} ({self.devices_named})")
        if kind.prefix not in self.next_index:
            self.next_index[kind.prefix] = 1 + max(
                (int(n.removeprefix(kind.prefix)) for n in self._membership(kind).servers), default=-1)
        t0, started = time.monotonic(), {}
        procs = []
        for i in range(count):
            index = self.next_index[kind.prefix]
            self.next_index[kind.prefix] += 1
            procs.append(Proc(f"{kind.prefix}{index}", kind.role,
                              tuple(free[i * kind.per_server:(i + 1) * kind.per_server]), index, graph_node=kind.judge))
        self._place(procs)
        for proc, (host, port) in zip(procs, self.launcher.reserve([p.name for p in procs])):
            argv, env = self.command(proc, port, host)
            self.launcher.provisional.add(proc.name)  # a death while it starts is this scale's failure, not the run's
            self.launcher.start(proc, argv, env, again=lambda proc=proc, port=port, host=host: self.command(
                proc, port, host), restarts=self.restarts)
            started[proc.name] = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        ready, failed = {}, {}
        deadline = time.monotonic() + self.start_timeout
        while True:
            exited = self.launcher.exited()
            for name in [n for n in started if n not in ready and n not in failed]:
                if name in exited:
                    failed[name] = f"it exited with code {exited[name]} while starting; its log: " \
                                   f"{self.launcher.log_path(name)}"
                elif self._healthy(started[name]):
                    ready[name] = time.monotonic() - t0
                elif time.monotonic() > deadline:
                    failed[name] = f"its /health did not answer within {self.start_timeout:g} s " \
                                   "(launcher.start_timeout); its log: " + self.launcher.log_path(name)
            if len(ready) + len(failed) == len(started):
                break
            yield
        for name in failed:
            self.launcher.retire(name)
        for name in started:
            self.launcher.provisional.discard(name)
        if not ready:
            return {"added": [], "failed": failed}
        membership = self._membership(kind)
        # A judge's model never changes: healthy is current. The policy's new servers join first.
        membership.servers.update({name: Member(started[name], joining=not kind.judge) for name in ready})
        yield from self._publish(membership, kind)  # the controller's pool takes them, at the current weights
        deadline = time.monotonic() + self.start_timeout
        while not kind.judge and not all(is_ready(self.run_dir, name) for name in ready) \
                and time.monotonic() < deadline:
            yield
        current = [name for name in ready if kind.judge or is_ready(self.run_dir, name)]
        for name in ready:
            if name not in current:
                failed[name] = f"it did not get the current weights within {self.start_timeout:g} s " \
                               "(launcher.start_timeout); its log: " + self.launcher.log_path(name)
                self.launcher.retire(name)
                del membership.servers[name]
        if not kind.judge:
            for name in current:
                membership.servers[name].joining = False
            yield from self._publish(membership, kind)  # every rollout worker's pool takes them
        serving = time.monotonic() - t0
        return {"added": current, "failed": failed, "healthy_seconds": _rounded(ready),
                "serving_seconds": {name: round(serving, 3) for name in current}}

    def _down(self, count: int, kind: Servers) -> Generator[None, None, dict]:
        membership = self._membership(kind)
        leaving = membership.serving()[-count:]  # the newest first
        for name in leaving:
            membership.servers[name].leaving = True
        yield from self._publish(membership, kind)  # no follower sends them a new request from here
        for name in leaving:
            # Their running requests come back aborted, with their tokens so far: their callers go on
            # elsewhere (rollout/requests.py; the agents' gateway carries them on).
            self._abort_all(membership.servers[name].url)
        drained = time.monotonic() + DRAIN_SECONDS
        while time.monotonic() < drained:
            yield
        for name in leaving:
            del membership.servers[name]
        yield from self._publish(membership, kind)  # forgotten: no update is sent to them from here
        for name in leaving:
            self.launcher.retire(name)
        return {"removed": leaving}

    def _resize(self, request: Request) -> Generator[None, None, dict]:
        """The trainer's ranks, stopped after a checkpoint at the end of a step and started again at
        the size asked, from it (runtime/resize.py has the hand-offs with the controller)."""
        trainers = sorted((p for p in self.launcher.running_procs() if p.role == "trainer"), key=lambda p: p.rank)
        now = len(trainers)
        n = target_size(request.role, request.change, now)
        if problem := self.trainer_problem(n):
            raise ScaleRefused(f"{request.text}: {problem}")
        held, free = [d for p in trainers for d in p.devices], self.free_devices()
        if len(held) + len(free) < n:
            raise ScaleRefused(f"{request.text} needs {n} device(s) (one a rank); the trainer holds "
                               f"{', '.join(map(str, held))} and free are {', '.join(map(str, free)) or 'none'} of "
                               f"{self.n_devices} ({self.devices_named})")
        # Rank r of the new size: the device old rank r held, then free ones.
        ranks = [Proc(f"trainer{r}", "trainer", (device,), r) for r, device in enumerate([*held, *free][:n])]
        self._place(ranks[now:])  # room for the added ranks before anything stops
        resize.ask(self.run_dir, request.id, n)
        while (saved := resize.answered(self.run_dir, resize.SAVED, request.id)) is None:
            yield  # the controller ends its step and saves the checkpoint
        for proc in trainers:
            self.launcher.retire(proc.name)
        self._place(ranks[:now])  # on the devices the old ranks left
        # Each rank's inbox on its node, and the rendezvous on rank 0's (as at a launch: run/ports.py).
        reserved = self.launcher.reserve([*(p.name for p in ranks), "trainer0"])
        spec = read_spec(self.run_dir)
        hosts = {**{k: v for k, v in spec.hosts.items() if not k.startswith("trainer")},
                 **{p.name: host for p, (host, _) in zip(ranks, reserved) if not is_loopback(host)}}
        write_spec(self.run_dir, msgspec.structs.replace(
            spec, trainer_ports=[port for _, port in reserved[:n]], dist_port=reserved[n][1], n_trainers=n,
            hosts=hosts, resume=saved["checkpoint"]))
        for proc, (host, _) in zip(ranks, reserved):
            self.launcher.start(proc, *self.command(proc, 0, host))
        while (done := resize.answered(self.run_dir, resize.DONE, request.id)) is None:
            yield  # the new ranks load the checkpoint and report to the controller
        resize.clear(self.run_dir)
        return {"trainers": {"from": now, "to": n}, "checkpoint": saved["checkpoint"], "step": saved["step"],
                "resize_seconds": done["seconds"]}

    def _place(self, procs: list[Proc]) -> None:
        """Room for each of `procs` (launcher.place); ScaleRefused, with none of them kept, when one has none."""
        placed = []
        try:
            for proc in procs:
                self.launcher.place(proc)
                placed.append(proc)
        except RuntimeError as e:
            for proc in placed:
                self.launcher.retire(proc.name)
            raise ScaleRefused(f"{self.request.text}: {e}") from None

    # ---- HTTP, blocking but short: the watch loop's tick -------------------------------------------

    def _healthy(self, url: str) -> bool:
        try:
            wait_healthy(url, timeout=0.2, api_key=self.api_key)
        except TimeoutError:
            return False
        return True

    def _abort_all(self, url: str) -> None:
        """Abort every request the server runs (best effort: one that is gone has none)."""
        request = urllib.request.Request(url + "/abort_request", data=json.dumps({"abort_all": True}).encode(),
                                         method="POST",
                                         headers={"Content-Type": "application/json", **auth_headers(self.api_key)})
        with contextlib.suppress(OSError):
            urllib.request.urlopen(request, timeout=5).close()


def _rounded(seconds: dict[str, float]) -> dict[str, float]:
    return {name: round(s, 3) for name, s in seconds.items()}
