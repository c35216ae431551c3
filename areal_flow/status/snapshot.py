"""A run directory read into a `Snapshot`: what `python -m areal_flow.status` shows.

Where each figure comes from:
- step, rates, busy fractions, staleness, reward: the controller's `step` rows in metrics.jsonl (the
  last step, and a window of the last steps weighted by their seconds); the last evaluation: its
  `eval` rows; the end of the run: its `summary` row (or summary.json).
- total steps: the `start` row, else config.yaml.
- versions: trained = the last step trained (trained-rank*.jsonl, whose steps count from 0, or the
  last step row); loaded on the servers = the last `loaded` event of ledger.jsonl (else
  weights_loaded.json); while live, each server's own /get_weight_version.
- processes: processes.json (the local launcher's), else ray_placement.json, and logs/<name>.log
  (the age of its last write); generation servers' addresses from spec.json.

metrics.jsonl is read from where the last read stopped (a `RunReader` keeps its place), and a line
not yet ended by a newline (the run writes it) waits for the next read. What a snapshot holds is
status/model.py; how each other file is read, status/run_files.py.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import time
from collections import deque

from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.spec import RunSpec
from areal_flow.status.model import Evaluation, Figure, NotARunDirectory, ProcessStatus, Snapshot, Staleness
from areal_flow.status.probe import pid_alive, servers_health
from areal_flow.status.processes import PROCESSES, read_processes
from areal_flow.status.run_files import (config_total_steps, last_event, read_json, read_spec, server_urls,
                                         trained_version)

WINDOW = 10
"""Steps in the window the view averages over."""

LIVE_WITHOUT_TABLE = 120.0
"""A run without processes.json (another launcher, or an older run) is taken to be live while one
of its files was written within this many seconds."""

OPTIONAL_KEYS = ("train/ess_fraction", "train/capped_fraction")
OPTIONAL_PREFIXES = ("by_length/", "train/stale/", "train/mismatch/")
"""Keys of a step row shown when the run writes them."""

ROLES = ("controller", "gen_server", "rollout", "reward", "trainer", "inference", "judge_server")
RUN_FILES = (rd.SPEC, rd.CONFIG, rd.METRICS, PROCESSES, rd.HYDRA_CONFIG)
"""A run directory holds at least one of these (the launcher writes .hydra/ first, the rest after
it prepared the data and the model)."""


# ---- metrics.jsonl, read as it grows ---------------------------------------------------------------


class MetricsTail:
    """What the view needs of metrics.jsonl, updated with the lines written since the last read."""

    def __init__(self, path: str, window: int = WINDOW):
        self.path, self.window_size = path, window
        self.reset()

    def reset(self) -> None:
        self.offset, self.start, self.resume, self.summary = 0, None, None, None
        self.failure: dict | None = None  # the `failure` row of a controller that failed
        self.seen = b""  # the bytes just before `offset`: still there unless the file was rewritten
        self.steps: deque[dict] = deque(maxlen=self.window_size)
        self.first_eval = self.last_eval = None
        self.run_hist: list[int] = []
        self.run_max: int | None = None
        self.bad_lines = 0

    def read(self) -> None:
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return
        with open(self.path, "rb") as f:
            if size < self.offset or self._moved(f):  # a resume cut it back to its checkpoint: read it again
                self.reset()
            f.seek(self.offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next read
        self.offset += len(complete)
        self.seen = (self.seen + complete)[-64:]
        for line in complete.splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                self.bad_lines += 1
                continue
            if isinstance(row, dict):
                self.take(row)

    def _moved(self, f) -> bool:
        f.seek(self.offset - len(self.seen))
        return f.read(len(self.seen)) != self.seen

    def take(self, row: dict) -> None:
        event = row.get("event")
        if event == "step":
            self.steps.append(row)
            hist = row.get("staleness_hist") or []
            if len(hist) > len(self.run_hist):
                self.run_hist += [0] * (len(hist) - len(self.run_hist))
            for i, n in enumerate(hist):
                self.run_hist[i] += n
            if isinstance(row.get("staleness_max"), (int, float)):
                self.run_max = max(self.run_max or 0, int(row["staleness_max"]))
        elif event == "eval" and isinstance(row.get("accuracy"), (int, float)):
            e = Evaluation(accuracy=row["accuracy"], when=row.get("when"), step=row.get("step"),
                           version=row.get("version"), time=row.get("time"), seconds=row.get("seconds"),
                           n=row.get("n"))
            self.first_eval = self.first_eval or e
            self.last_eval = e
        elif event == "start":
            self.start, self.failure = row, None  # a run started again (recover.retries) is not failed yet
        elif event == "failure":
            self.failure = row
        elif event == "resume":
            self.resume = row
        elif event == "summary":
            self.summary = row


def weighted(rows, key: str, weight: str = "step_seconds", of=lambda x: x) -> float | None:
    """The mean of `of(row[key])` over the rows that have it, weighted by `row[weight]` (plain
    mean when a row lacks the weight): a rate over a window is its total over the window's time."""
    pairs = [(of(r[key]), r.get(weight)) for r in rows if isinstance(r.get(key), (int, float))]
    if not pairs:
        return None
    if all(isinstance(w, (int, float)) and w > 0 for _, w in pairs):
        return sum(v * w for v, w in pairs) / sum(w for _, w in pairs)
    return sum(v for v, _ in pairs) / len(pairs)


def figure(rows: list[dict], key: str, weight: str = "step_seconds", of=lambda x: x) -> Figure:
    value = rows[-1].get(key) if rows else None
    return Figure(of(value) if isinstance(value, (int, float)) else None, weighted(rows, key, weight, of))


def role_of(name: str) -> str:
    if "_infer" in name:
        return "inference"
    if "_server" in name and not name.startswith("gen_server"):
        return "judge_server"
    return next((r for r in ROLES if name.startswith(r)), "")


def order(p: ProcessStatus) -> tuple:
    digits = "".join(c for c in p.name if c.isdigit())
    return (ROLES.index(p.role) if p.role in ROLES else len(ROLES), p.name.rstrip("0123456789"),
            int(digits) if digits else 0, p.name)


def check_run_dir(run_dir: str) -> None:
    """Raise NotARunDirectory naming the path when it is not a run directory."""
    if not os.path.exists(run_dir):
        raise NotARunDirectory(f"{run_dir}: no such directory")
    if not os.path.isdir(run_dir):
        raise NotARunDirectory(f"{run_dir}: not a directory")
    if any(os.path.exists(os.path.join(run_dir, f)) for f in RUN_FILES):
        return
    inside = sorted(d for d in os.listdir(run_dir) if os.path.isdir(os.path.join(run_dir, d))
                    and any(os.path.exists(os.path.join(run_dir, d, f)) for f in RUN_FILES))
    hint = f"; it holds run directories: {', '.join(inside[:8])}{', ...' if len(inside) > 8 else ''}" if inside else ""
    raise NotARunDirectory(f"{run_dir} is not a run directory: it holds none of "
                           f"{', '.join(RUN_FILES)}{hint}")


# ---- the snapshot ----------------------------------------------------------------------------------


class RunReader:
    """Reads a run directory again and again, from where it stopped in metrics.jsonl. `probe`:
    ask a live run's processes (pids, the servers' /health), within `timeout` seconds each."""

    def __init__(self, run_dir: str, *, window: int = WINDOW, probe: bool = True, timeout: float = 0.5):
        check_run_dir(run_dir)
        self.run_dir, self.probe, self.timeout = run_dir, probe, timeout
        self.metrics = MetricsTail(self.path(rd.METRICS), window)

    def path(self, *parts: str) -> str:
        return os.path.join(self.run_dir, *parts)

    def snapshot(self, now: float | None = None) -> Snapshot:
        check_run_dir(self.run_dir)
        now = time.time() if now is None else now
        m = self.metrics
        m.read()
        rows = list(m.steps)
        last = rows[-1] if rows else {}
        spec = read_spec(self.path(rd.SPEC))
        summary = m.summary or read_json(self.path(rd.SUMMARY))

        snap = Snapshot(run_dir=self.run_dir, at=now, state="", live=False, note="", summary=summary,
                        window=len(rows), bad_lines=m.bad_lines)
        total = (m.start or {}).get("total_steps")
        snap.total_steps = total if isinstance(total, int) else config_total_steps(self.run_dir)
        snap.step = int(last.get("step", 0)) if rows else (int((m.resume or {}).get("step", 0)))
        snap.elapsed = last.get("elapsed")
        snap.reward = figure(rows, "reward")
        snap.samples_per_second = figure(rows, "samples_per_second")
        snap.gen_tokens_per_second = figure(rows, "gen_tokens_per_second")
        snap.train_tokens_per_second = figure(rows, "train_tokens_per_second", weight="train_seconds")
        snap.trainer_busy = figure(rows, "trainer_idle", of=lambda x: 1 - x)
        snap.generator_busy = figure(rows, "generator_idle", of=lambda x: 1 - x)
        snap.reward_busy = {k.split("/", 1)[1]: figure(rows, k) for k in last if k.startswith("reward_busy/")}
        snap.env = {k.split("/", 1)[1]: figure(rows, k) for k in sorted(last) if k.startswith("env/")}
        snap.staleness = Staleness(mean=last.get("staleness_mean"), max=last.get("staleness_max"),
                                   hist=list(last.get("staleness_hist") or []),
                                   window_mean=weighted(rows, "staleness_mean", weight="train/n_valid_tokens"),
                                   run_max=m.run_max, run_hist=list(m.run_hist),
                                   seq_hist=last.get("staleness_seq_hist"))
        snap.first_eval, snap.last_eval = m.first_eval, m.last_eval
        snap.extras = {k: v for k, v in last.items() if k in OPTIONAL_KEYS or k.startswith(OPTIONAL_PREFIXES)}

        known = [v for v in (trained_version(self.run_dir), snap.step if rows else None) if v is not None]
        snap.trained_version = max(known) if known else (snap.step if m.start is not None else None)
        loaded = last_event(self.path(rd.LEDGER), "loaded")
        if loaded is not None:
            snap.loaded_version = loaded.get("version")
        elif isinstance(w := read_json(self.path(rd.WEIGHTS_LOADED)), dict):
            snap.loaded_version = w.get("version")
        elif m.start is not None:  # nothing loaded yet: the weights the servers started with
            snap.loaded_version = int((m.resume or {}).get("step", 0))

        snap.processes = self.processes(spec, now)
        self.judge(snap, spec, now)
        reason = (m.failure or {}).get("stop_reason")
        if snap.state == "ended" and isinstance(reason, dict):
            snap.note = f"failed: {reason.get('message')}; {snap.note}"
        seconds = [r["step_seconds"] for r in rows if isinstance(r.get("step_seconds"), (int, float))]
        if snap.live and snap.total_steps and seconds and snap.step < snap.total_steps:
            snap.eta = sum(seconds) / len(seconds) * (snap.total_steps - snap.step)
        return snap

    def processes(self, spec: RunSpec | None, now: float) -> list[ProcessStatus]:
        table = read_processes(self.run_dir)
        placed = read_json(self.path(rd.RAY_PLACEMENT)) if table is None else None
        found: dict[str, ProcessStatus] = {}
        for name, e in (table or {}).items():
            if isinstance(e, dict):
                found[name] = ProcessStatus(name, e.get("role") or role_of(name), pid=e.get("pid"), host=e.get("host"),
                                            state=e.get("state"), restarts=e.get("restarts") or 0,
                                            exit_code=e.get("exit_code"), ended=e.get("ended"),
                                            started=e.get("started"))
        for name, e in (placed or {}).items() if isinstance(placed, dict) else ():
            if isinstance(e, dict):
                found[name] = ProcessStatus(name, role_of(name), pid=e.get("pid"), host=e.get("address"))
        for log in glob.glob(self.path(rd.log_of("*"))):
            name = os.path.basename(log)[:-4]
            found.setdefault(name, ProcessStatus(name, role_of(name)))
        for name, url in server_urls(spec).items():
            found.setdefault(name, ProcessStatus(name, role_of(name))).url = url
        for p in found.values():
            try:
                p.log_age = max(0.0, now - os.path.getmtime(self.path(rd.log_of(p.name))))
            except OSError:
                pass
        return sorted(found.values(), key=order)

    def judge(self, snap: Snapshot, spec: RunSpec | None, now: float) -> None:
        """The run's state, whether it is live, and (live) each process's probe."""
        procs = snap.processes
        if snap.summary is not None:
            stopped = bool(snap.summary.get("stopped"))
            snap.state = "stopped" if stopped else "finished"
            steps = snap.summary.get("steps", snap.step)
            snap.note = (f"the controller stopped it after step {steps} (resume=auto continues it)" if stopped
                         else f"the controller finished {steps} steps")
            if isinstance(reason := snap.summary.get("stop_reason"), dict):  # older runs' summaries have none
                snap.note += f": {reason.get('message')}"
            return
        started = os.path.exists(self.path(rd.SPEC))
        here = socket.gethostname()
        local = [p for p in procs if p.state is not None and p.pid is not None and p.host == here]
        if local and self.probe:
            for p in local:
                p.alive = False if p.state in ("exited", "removed") else pid_alive(p.pid)
            snap.live = any(p.alive for p in local)
            if not snap.live:
                snap.state = "ended"
                gone = sorted((p for p in local if p.state == "exited"), key=lambda p: p.ended or 0)
                failed = [p for p in gone if p.exit_code not in (0, None)]
                snap.note = "no summary, and none of its processes runs"
                if failed or gone:
                    first = (failed or gone)[0]
                    snap.note += (f"; the first to {'fail' if failed else 'exit'}: {first.name} (exit code "
                                  f"{first.exit_code}; its log: logs/{first.name}.log)")
                else:
                    snap.note += " (their launcher was killed?)"
                return
            snap.note = "its processes run (processes.json)"
        else:
            newest = max((t for t in (self._mtime(rd.METRICS), self._mtime(rd.LEDGER),
                                      self._mtime(rd.HYDRA_LOG), *(now - p.log_age for p in procs
                                                                   if p.log_age is not None)) if t), default=None)
            age = None if newest is None else now - newest
            snap.live = age is not None and age < LIVE_WITHOUT_TABLE
            why = "no processes.json of this host" if not local else "not probed"
            if not snap.live:
                snap.state = "ended"
                snap.note = f"no summary; {why}, and nothing written for {age:.0f} s" if age is not None else \
                    f"no summary; {why}, and no file of the run yet"
                return
            snap.note = f"{why}: live as its files were written {age:.0f} s ago"
        snap.state = "running" if self.metrics.start is not None else ("starting" if started else "preparing")
        if self.probe:
            urls = {p.name: p.url for p in procs if p.url and p.alive is not False}
            api_key = spec.api_key if spec is not None else None
            for name, h in servers_health(urls, self.timeout, api_key).items():
                p = next(p for p in procs if p.name == name)
                p.health, p.weight_version = h.health, h.weight_version

    def _mtime(self, name: str) -> float | None:
        try:
            return os.path.getmtime(self.path(name))
        except OSError:
            return None


def read_snapshot(run_dir: str, **kwargs) -> Snapshot:
    """One snapshot of a run directory (RunReader's arguments)."""
    return RunReader(run_dir, **kwargs).snapshot()
