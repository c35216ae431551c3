"""The command line of each process of a run, whichever launcher starts it.

A role's process is `python -m areal_flow.runtime.child`; a generation server is the embedded
server or SGLang's, under `generation.backend`. The local and Ray launchers take these from the
entry point; a Slurm job step makes them on its node (`launchers/slurm_job.py`), where the spec is
complete: so they live here, below both.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from areal_flow.checkpoint import store
from areal_flow.config.schema import RunConfig
from areal_flow.generation.sglang_backend import sglang_command, sglang_env
from areal_flow.graph.placement import Proc
from areal_flow.runtime.security import API_KEY_ENV, is_loopback, security_needed
from areal_flow.runtime.spec import RunSpec


def python_role(role: str, proc: Proc, run_dir: str) -> list[str]:
    """The argv of a role's process (controller, rollout, reward, trainer): it reads the run directory."""
    return [sys.executable, "-m", "areal_flow.runtime.child", role, proc.name, str(proc.rank), run_dir]


def first_weights(spec: RunSpec) -> tuple[str, int]:
    """(path, version) of the weights the policy's servers start from: a resumed run's checkpoint's actor."""
    if spec.resume:
        return os.path.join(spec.resume, "actor"), store.read_manifest(spec.resume)["version"]
    return spec.model_path, 0


def server_command(cfg: RunConfig, proc: Proc, model_path: str, port: int | str, *, host: str | None = None,
                   api_key: str | None = None, version: int = 0,
                   tp_size: int | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv of generation server `proc` under generation.backend, and its environment beyond
    the launcher's own. `host`: the address to bind when not generation.host; `api_key`: the
    run's API key, when it is secured; `version`: the version of the weights at `model_path`
    (versions count train steps: a resumed run's servers start at its checkpoint's); `tp_size`:
    its devices when not generation.tp_size (a judge's server: 1)."""
    gen, seed = cfg.generation, cfg.seed + proc.rank
    if tp_size is not None:
        gen = dataclasses.replace(gen, tp_size=tp_size)
    if gen.backend == "sglang":
        # The policy's servers answer an agent's OpenAI calls (chat templates need the tokenizer).
        agents = tp_size is None and any(getattr(node, "agent", None) is not None for node in cfg.graph.values())
        return (sglang_command(gen, model_path, port, seed, cfg.cluster.device_type, host=host, api_key=api_key,
                               version=version, tokenizer=agents),
                sglang_env(proc.devices, gen.tp_size, cfg.cluster.device_type, cfg.launcher.pin_cpus))
    device = cfg.cluster.device_type
    argv = [sys.executable, "-m", "areal_flow.generation.server", "--model-path", model_path, "--host",
            host or gen.host, "--port", str(port), "--seed", str(seed), "--weight-version", str(version),
            "--device", device, "--dtype", gen.dtype or "auto"]
    if device == "cpu":  # a CPU server computes on its mesh's cores; a GPU server's threads only feed the GPU
        argv += ["--num-threads", str(max(1, len(proc.devices)))]
    if cfg.batch_invariant_servers:
        argv += ["--enable-deterministic-inference"]  # synchronous runs reproduce bit for bit
    if gen.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(gen.mem_fraction_static)]
    if gen.max_batch_size is not None:
        argv += ["--max-batch-size", str(gen.max_batch_size)]
    if gen.max_total_tokens is not None:
        argv += ["--max-total-tokens", str(gen.max_total_tokens)]
    if gen.chunked_prefill_size is not None:
        argv += ["--chunked-prefill-size", str(gen.chunked_prefill_size)]
    if gen.page_size is not None:
        argv += ["--page-size", str(gen.page_size)]
    if gen.disable_cuda_graph:
        argv += ["--disable-cuda-graph"]
    if gen.disable_radix_cache:
        argv += ["--disable-radix-cache"]
    if gen.disable_overlap_schedule:
        argv += ["--disable-overlap-schedule"]
    if gen.lora_decode != "lowrank":
        argv += ["--lora-decode", gen.lora_decode]
    argv += ["--max-request-bytes", str(gen.max_request_bytes)]
    if gen.tool_call_parser != "auto":  # auto: the server reads its tokenizer's chat template itself
        argv += ["--tool-call-parser", gen.tool_call_parser]
    # The embedded server takes --api-key as SGLang does, and the key in its environment too: the
    # launcher uses that, since a command line is visible to every user of the host.
    return argv, ({API_KEY_ENV: api_key} if api_key is not None else {})


def judge_command(cfg: RunConfig, proc: Proc, model_path: str, port: int | str, *, host: str | None = None,
                  api_key: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of judge server `proc`: its judge's frozen model at version 0, on its one device."""
    return server_command(cfg, proc, model_path, port, host=host, api_key=api_key, version=0, tp_size=1)


def server_host(cfg: RunConfig, host: str) -> str:
    """The address generation servers bind: generation.host, or this host's address `host` when
    the run is secured and generation.host would keep them on loopback."""
    return host if security_needed(cfg) and is_loopback(cfg.generation.host) else cfg.generation.host
