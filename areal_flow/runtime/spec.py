"""The run spec: what the launcher resolved before starting processes (paths, endpoints and, when
the run is secured, its secret).

It sits beside the composed config in the run directory; every child reads both at start and
gets the config typed, as a `RunConfig`. `spec.json` is readable by its owner only: it may hold the
run's `Security` (runtime/security.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
from omegaconf import DictConfig, OmegaConf

from areal_flow.config.schema import RunConfig
from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.security import LOOPBACK, Security


class RunSpec(msgspec.Struct, kw_only=True):
    run_dir: str
    model_path: str  # the actor's starting checkpoint (HF dir with its tokenizer)
    train_path: str
    eval_path: str
    gen_ports: list[int]
    controller_port: int  # controller ROUTER: every other process's control messages
    rollout_ports: list[int]  # each rollout worker's PUSH to the reward pool
    trainer_ports: list[int]  # each trainer rank's PULL inbox for scored groups
    # Each inference node on a mesh of its own -> its replicas' PULL inboxes for InferRequests.
    infer_ports: dict[str, list[int]] = {}
    infer_dist_ports: dict[str, int] = {}  # a critic's node on several devices -> its processes' torch.distributed rendezvous
    judge_ports: dict[str, list[int]] = {}  # each judge -> its generation servers' HTTP ports
    judge_models: dict[str, str] = {}  # each judge -> its model dir (absolute), never updated
    dist_port: int  # torch.distributed rendezvous of the trainer ranks
    n_trainers: int
    n_rollout: int
    gen_host: str = "127.0.0.1"  # where clients reach the generation servers (see reachable)
    weights_dir: str = ""  # where trainer rank 0 publishes each version; "" = run_dir/weights
    host: str = LOOPBACK  # where ZeroMQ servers bind and clients connect: this host's address when secured
    hosts: dict[str, str] = {}  # process name -> its node's address, where the launcher placed it on another node
    security: Security | None = None  # the run's secret (security_needed); None: plain, on loopback
    resume: str = ""  # the resumable checkpoint this run continues from (checkpoint/store.py); "" = a new run

    @property
    def api_key(self) -> str | None:
        """The generation servers' API key, or None when the run is not secured."""
        return self.security.api_key if self.security is not None else None

    def host_of(self, name: str, default: str | None = None) -> str:
        """The address process `name` listens on (and is reached at): its node's, or the run's."""
        return self.hosts.get(name, self.host if default is None else default)

    def endpoint(self, name: str, port: int) -> str:
        """The ZeroMQ endpoint of process `name` listening on `port`."""
        host = self.host_of(name)
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"

    @property
    def gen_names(self) -> list[str]:
        """The process names of the policy's generation servers."""
        return [f"gen_server{i}" for i in range(len(self.gen_ports))]

    @property
    def gen_urls(self) -> list[str]:
        return [self._url(name, port) for name, port in zip(self.gen_names, self.gen_ports)]

    def judge_names(self, node: str) -> list[str]:
        """The process names of judge `node`'s generation servers."""
        from areal_flow.graph.placement import judge_server_name

        return [judge_server_name(node, i) for i in range(len(self.judge_ports.get(node, [])))]

    def judge_urls(self, node: str) -> list[str]:
        """The URLs of judge `node`'s generation servers."""
        return [self._url(name, port) for name, port in zip(self.judge_names(node), self.judge_ports.get(node, []))]

    def _url(self, name: str, port: int) -> str:
        host = self.host_of(name, self.gen_host)
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"  # IPv6 in brackets

    def path(self, *parts: str) -> str:
        return os.path.join(self.run_dir, *parts)

    def weights(self, *parts: str) -> str:
        """A path under the published weights' directory."""
        return os.path.join(self.weights_dir or self.path(rd.WEIGHTS), *parts)


def reachable(host: str) -> str:
    """The address a client on this machine connects to for a server bound to `host`: loopback for
    a wildcard address, the address itself otherwise."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def write_run(run_dir: str, cfg: DictConfig, spec: RunSpec) -> None:
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, os.path.join(run_dir, rd.CONFIG), resolve=True)
    write_spec(run_dir, spec)


def write_spec(run_dir: str, spec: RunSpec) -> None:
    # Owner only, from the first byte: the spec may hold the run's secret.
    fd = os.open(os.path.join(run_dir, rd.SPEC), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, 0o600)  # a spec.json left by an earlier run keeps its mode through O_CREAT
        f.write(msgspec.json.encode(spec))


def typed(cfg: DictConfig) -> RunConfig:
    """The config as `RunConfig` dataclasses (interpolations resolved, schema checked again)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), cfg))


def read_spec(run_dir: str) -> RunSpec:
    """The run's spec.json (rewritten by a trainer resize: its ranks' inboxes)."""
    return msgspec.json.decode(Path(run_dir, rd.SPEC).read_bytes(), type=RunSpec)


def read_run(run_dir: str) -> tuple[RunConfig, RunSpec]:
    return typed(OmegaConf.load(os.path.join(run_dir, rd.CONFIG))), read_spec(run_dir)
