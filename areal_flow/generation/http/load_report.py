"""What a generation server says about its load: SGLang's `/v1/loads` and Prometheus `/metrics`.

Both read `GenerationEngine.stats()` when asked. KV usage comes from the stats keys
`kv_tokens_used` / `kv_tokens_budget` where the engine keeps a KV token budget, else it reads 0.
Metric names are SGLang's (`sglang:num_running_reqs`, ...) where SGLang has the metric, and
`areal_flow:` names for the rest, so that dashboards made for SGLang work on either server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from areal_flow.generation.engine.generation_engine import GenerationEngine

THROUGHPUT_WINDOW_SECONDS = 1.0
"""gen_throughput is measured over the time since the previous reading, once that is this long
(SGLang reports the throughput of its last logging interval); closer readings repeat the last value."""


class LoadReport:
    """The load of one server. Each has its own Prometheus registry, so several servers can run in
    one process (as the tests do) without their metrics colliding."""

    def __init__(self, engine: GenerationEngine) -> None:
        self.engine = engine
        self.model_name = engine.model_path  # fixed at start, as SGLang's served_model_name label
        self._lock = threading.Lock()
        self._last = (time.monotonic(), 0)  # (when, generated tokens) of the previous throughput reading
        self._throughput = 0.0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def _gen_throughput(self, generated_tokens: int) -> float:
        with self._lock:  # /metrics and /v1/loads may be asked at once
            now = time.monotonic()
            then, tokens = self._last
            if now - then >= THROUGHPUT_WINDOW_SECONDS:
                self._throughput = (generated_tokens - tokens) / (now - then)
                self._last = (now, generated_tokens)
            return self._throughput

    def load(self) -> dict:
        """One entry of SGLang's `loads` list (the single data-parallel rank 0)."""
        stats = self.engine.stats()
        used, budget = int(stats.get("kv_tokens_used", 0)), int(stats.get("kv_tokens_budget", 0))
        running, max_running = int(stats["num_running_reqs"]), self.engine.max_batch_size
        return {
            "dp_rank": 0,
            "timestamp": time.time(),
            "num_running_reqs": running,
            "num_waiting_reqs": int(stats["num_waiting_reqs"]),
            "num_used_tokens": used,
            "num_total_tokens": used,  # the engine does not count the waiting prompts' tokens
            "max_total_num_tokens": budget,
            "token_usage": used / budget if budget else 0.0,
            "gen_throughput": self._gen_throughput(int(stats["generated_tokens"])),
            "cache_hit_rate": 0.0,
            "utilization": running / max_running,
            "max_running_requests": max_running,
        }

    def loads(self) -> dict:
        """GET /v1/loads."""
        return {
            "timestamp": datetime.now(timezone.utc).isoformat(),
            "version": "areal_flow-embedded",
            "accelerator": None,
            "num_accelerators": 0,
            "loads": [self.load()],
        }

    def collect(self) -> Iterator[Metric]:
        """The metrics, read at each scrape (prometheus_client's custom-collector protocol)."""
        stats, load = self.engine.stats(), self.load()
        gauges = {
            "sglang:num_running_reqs": ("Requests decoding.", load["num_running_reqs"]),
            "sglang:num_queue_reqs": ("Requests waiting to be admitted.", load["num_waiting_reqs"]),
            "sglang:num_used_tokens": ("KV cache tokens in use.", load["num_used_tokens"]),
            "sglang:token_usage": ("Fraction of the KV token budget in use.", load["token_usage"]),
            "sglang:gen_throughput": ("Generated tokens per second.", load["gen_throughput"]),
            "areal_flow:weight_version": ("Integer version of the served weights.", stats["weight_version"]),
        }
        counters = {
            "sglang:prompt_tokens_total": ("Prompt tokens of finished requests.", stats["finished_prompt_tokens"]),
            "sglang:generation_tokens_total": ("Generated tokens.", stats["generated_tokens"]),
            "sglang:num_requests_total": ("Finished requests.", stats["num_finished_reqs"]),
            "areal_flow:busy_seconds_total": ("Seconds the engine spent computing.", stats["busy_seconds"]),
            "areal_flow:load_seconds_total": ("Seconds the engine spent copying weight updates in.",
                                              stats["load_seconds"]),
        }
        for kind, table in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, (documentation, value) in table.items():
                family = kind(name, documentation, labels=["model_name"])
                family.add_metric([self.model_name], float(value))
                yield family

    def prometheus_text(self) -> bytes:
        return generate_latest(self.registry)
