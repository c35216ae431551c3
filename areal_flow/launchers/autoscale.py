"""The generation servers' autoscaler (`elastic.auto=true`, off by default): the launcher reads the
run's own step rows (metrics.jsonl) and asks for a scale as `python -m areal_flow.scale` would
(launchers/elastic.py carries it out, one at a time).

- **Add** a server when the trainer waited on samples (`trainer_idle`) more than
  `elastic.add_above_trainer_idle` of each of the last `elastic.window_steps` steps and a device is
  free: generation is what the run waits for.
- **Remove** one when the servers idled (`generator_idle`) more than
  `elastic.remove_above_generator_idle` of each of those steps while the trainer did not wait:
  generation outruns the staleness bound, which holds it back, so a server is spare.

After a change it waits `window_steps` new steps, so that the next decision reads figures of the
new size. Every decision is a line of `scale/decisions.jsonl` with the figures behind it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

from areal_flow.config.schema import ElasticConfig
from areal_flow.runtime import run_dir as rd

DECISIONS = rd.SCALE_DECISIONS


@dataclass
class Decision:
    change: str  # "+1" or "-1": generation servers
    why: str
    figures: dict  # what it was decided from


def decide(rows: list[dict], cfg: ElasticConfig, servers: int, free: int, per_server: int) -> Decision | None:
    """What the last `cfg.window_steps` step rows call for, with `servers` serving and `free` devices
    free (`per_server` a server); None: nothing, or nothing possible."""
    window = rows[-cfg.window_steps:]
    if len(window) < cfg.window_steps:
        return None
    waits = [r.get("trainer_idle") for r in window]
    idles = [r.get("generator_idle") for r in window]
    if None in waits:
        return None
    figures = {"steps": [r["step"] for r in window], "trainer_idle": [round(w, 3) for w in waits],
               "generator_idle": [None if g is None else round(g, 3) for g in idles], "servers": servers,
               "free_devices": free}
    n, wait, idle = cfg.window_steps, cfg.add_above_trainer_idle, cfg.remove_above_generator_idle
    if min(waits) > wait:
        if free < per_server or (cfg.max_servers and servers >= cfg.max_servers):
            return None
        return Decision("+1", f"the trainer waited on samples more than {wait:.0%} of each of the last {n} steps "
                              f"(trainer_idle) and {free} device(s) are free", figures)
    if servers > 1 and None not in idles and min(idles) > idle:
        return Decision("-1", f"the generation servers idled more than {idle:.0%} of each of the last {n} steps "
                              "(generator_idle: the staleness bound held generation back) while the trainer did not "
                              f"wait more than {wait:.0%}", figures)
    return None


class AutoScaler:
    """Reads the step rows as they come and decides; the launcher's Scaler asks for what it decides."""

    def __init__(self, run_dir: str, cfg: ElasticConfig, per_server: int) -> None:
        self.run_dir, self.cfg, self.per_server = run_dir, cfg, per_server
        self.offset = 0  # metrics.jsonl read so far
        self.since = time.time()  # rows before (an earlier launch's, a change's old size) are not counted
        self.rows: list[dict] = []

    def poll(self, servers: int, free: int) -> Decision | None:
        self._read()
        if (decision := decide(self.rows, self.cfg, servers, free, self.per_server)) is None:
            return None
        self.rows, self.since = [], time.time()
        os.makedirs(os.path.join(self.run_dir, "scale"), exist_ok=True)
        with open(os.path.join(self.run_dir, DECISIONS), "a") as f:
            f.write(json.dumps({"time": self.since, "role": "generate", **asdict(decision)}) + "\n")
        return decision

    def _read(self) -> None:
        try:
            with open(os.path.join(self.run_dir, rd.METRICS), "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        whole = data[:data.rfind(b"\n") + 1]  # a line still being written is read next time
        self.offset += len(whole)
        for line in whole.splitlines():
            row = json.loads(line)
            if row.get("event") == "step" and row.get("time", 0) > self.since:
                self.rows.append(row)
        del self.rows[:-self.cfg.window_steps]
