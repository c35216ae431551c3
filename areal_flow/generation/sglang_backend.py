"""Real SGLang as the generation backend (`generation.backend=sglang`): the command line and the
environment of one `python -m sglang.launch_server`, and the checks of `generation.*` it needs.

Everything talks to a generation server through SGLang's native HTTP API (generation/client/generation_client.py),
so the launcher starts SGLang where it would start the embedded server, and the controller waits
for its /health in the same way. Flag spellings follow SGLang's `server_args.py`.
"""

from __future__ import annotations

import importlib.util
import shlex
import sys
from collections.abc import Sequence

from areal_flow.config.schema import GenerationConfig
from areal_flow.generation import tool_parsers

INSTALL = "pip install -e '.[sglang]'"

RUN_FLAGS = {
    "--model-path": "model.path",
    "--host": "generation.host",
    "--port": "the launcher (a free port per server)",
    "--tp-size": "generation.tp_size",
    "--random-seed": "seed (plus the server's rank)",
    "--device": "cluster.device_type",
    # Token ids in, token ids out: areal_flow tokenizes itself and sends no stop strings, so SGLang
    # loads no tokenizer and its answers carry no text.
    "--skip-tokenizer-init": "areal_flow (token ids in and out; kept off for an agent's chat calls: graph.<node>.agent)",
    "--weight-version": "resume (a resumed run's servers start at its checkpoint's version)",
}
"""Flags every SGLang server gets -> what decides them."""

VALUE_FLAGS = {
    "max_batch_size": "--max-running-requests",
    "max_total_tokens": "--max-total-tokens",
    "mem_fraction_static": "--mem-fraction-static",
    "context_length": "--context-length",
    "dtype": "--dtype",
    "attention_backend": "--attention-backend",
    "chunked_prefill_size": "--chunked-prefill-size",
    "page_size": "--page-size",
}
"""generation.* keys passed as `FLAG VALUE` when not null."""

SWITCHES = {"disable_radix_cache": "--disable-radix-cache", "disable_cuda_graph": "--disable-cuda-graph",
            "disable_overlap_schedule": "--disable-overlap-schedule"}
"""generation.* booleans passed as a bare flag when true."""

ALIASES = {"--model": "--model-path", "--tensor-parallel-size": "--tp-size"}
"""SGLang's other spellings of mapped flags."""

EMBEDDED_TOO = ("max_batch_size", "max_total_tokens", "mem_fraction_static", "dtype", "chunked_prefill_size",
                "page_size", "disable_cuda_graph", "disable_radix_cache", "disable_overlap_schedule")
"""generation.* keys both backends read."""

SGLANG_ONLY = tuple(k for k in {**VALUE_FLAGS, **SWITCHES} if k not in EMBEDDED_TOO) + ("extra_args",)
"""generation.* keys that mean nothing to the embedded engine."""

DEVICES = {"cpu": "cpu", "cuda": "cuda"}
"""cluster.device_type -> SGLang's --device (SGLang has a CPU backend too)."""

SECURED_FLAGS = {
    # SGLang then answers 401 to every request without `Authorization: Bearer <key>` but /health*
    # and /metrics; areal_flow's clients send it.
    "--api-key": "the launcher (the run's secret, when launcher.secure is set or the run spans hosts)",
}
"""Flags a secured run's servers get -> what decides them."""

OWNERS = {**RUN_FLAGS, **SECURED_FLAGS, "--tool-call-parser": tool_parsers.KEY,
          **{flag: f"generation.{key}" for key, flag in {**VALUE_FLAGS, **SWITCHES}.items()}}


def sglang_command(gen: GenerationConfig, model_path: str, port: int | str, seed: int, device_type: str, *,
                   host: str | None = None, api_key: str | None = None, version: int = 0,
                   tokenizer: bool = False) -> list[str]:
    """The argv of one SGLang server; the launcher gives it `gen.tp_size` devices. `host`: the
    address to bind when not `generation.host` (a secured run's host address); `api_key`: the
    run's API key. SGLang reads it from its command line only, so local users can see it in the
    process list (docs/security.md). `version`: the weights' version label, when not 0 (a resumed
    run's checkpoint; SGLang's own first label, "default", counts as 0). `tokenizer`: the server
    loads the model's tokenizer (an agent's OpenAI calls need its chat template) and parses chat
    answers' tool calls by generation.tool_call_parser (`sglang_tool_call_parser`); otherwise token
    ids go in and out and SGLang starts without one."""
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", host or gen.host,
            "--port", str(port), "--tp-size", str(gen.tp_size), "--random-seed", str(seed),
            "--device", DEVICES[device_type], *([] if tokenizer else ["--skip-tokenizer-init"])]
    if tokenizer:
        argv += ["--tool-call-parser", sglang_tool_call_parser(gen.tool_call_parser, model_path)]
    if api_key is not None:
        argv += ["--api-key", api_key]
    if version:
        argv += ["--weight-version", str(version)]
    for key, flag in VALUE_FLAGS.items():
        if (value := getattr(gen, key)) is not None:
            argv += [flag, str(value)]
    argv += [flag for key, flag in SWITCHES.items() if getattr(gen, key)]
    return argv + list(gen.extra_args)


def sglang_tool_call_parser(name: str, model_path: str) -> str:
    """SGLang's `--tool-call-parser` for generation.tool_call_parser `name`: the same format under
    SGLang's name; `auto` resolved from the chat template in `model_path` as the embedded server
    resolves it from its tokenizer's (SGLang has no `auto`, and without the flag parses no calls)."""
    template = tool_parsers.template_of(model_path) if name == "auto" else None
    return tool_parsers.SGLANG_NAMES[tool_parsers.resolve(name, template)]


def sglang_env(devices: Sequence[int], tp_size: int, device_type: str, pin_cpus: bool) -> dict[str, str]:
    """Environment of one SGLang server beyond the launcher's own (which sets CUDA_VISIBLE_DEVICES
    to the server's GPUs, or pins it to its cores).

    SGLang's CPU engine binds each TP rank's OpenMP threads itself, by default to a whole NUMA
    node per rank, which would leave the cores the launcher pinned it to: give rank r the r-th
    share of the server's cores instead."""
    if device_type != "cpu":
        return {}
    env = {"SGLANG_USE_CPU_ENGINE": "1"}
    if pin_cpus and devices:
        share = len(devices) // tp_size
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
            ",".join(map(str, devices[r * share:(r + 1) * share])) for r in range(tp_size))
    return env


def _flag_name(arg: str) -> str | None:
    """`--tp-size=2` -> `--tp-size`; `--tp_size` -> `--tp-size`; not a flag -> None."""
    if not arg.startswith("--") or len(arg) == 2:
        return None
    name = arg.split("=", 1)[0].replace("_", "-")
    return ALIASES.get(name, name)


def generation_problems(gen: GenerationConfig, n_gen_devices: int) -> list[str]:
    """What is wrong with `generation.*` for a generate mesh of `n_gen_devices` devices."""
    problems = []
    if n_gen_devices % gen.tp_size:
        problems.append(f"generation.tp_size={gen.tp_size} does not divide the {n_gen_devices} device(s) of the "
                        f"generate mesh (one server per tp_size devices)")
    if gen.backend != "sglang":
        defaults = GenerationConfig()
        for key in SGLANG_ONLY:
            if getattr(gen, key) != getattr(defaults, key):
                problems.append(f"generation.{key}={getattr(gen, key)!r} is an SGLang setting; it needs "
                                f"generation.backend=sglang (the backend is {gen.backend!r})")
        return problems
    for arg in gen.extra_args:
        name = _flag_name(arg)
        # argparse also takes an unambiguous prefix of a flag (`--tp` for `--tp-size`).
        owned = [flag for flag in OWNERS if name is not None and (flag == name or flag.startswith(name))]
        if owned:
            problems.append(f"generation.extra_args has {arg!r}, which would set {owned[0]}: that is decided by "
                            f"{OWNERS[owned[0]]}" + ("" if owned[0] in RUN_FLAGS or owned[0] in SECURED_FLAGS
                                                         else "; set that key instead"))
    return problems


def sglang_missing() -> str | None:
    """Why this Python cannot start SGLang, or None. Checked before any process starts: without
    it the run would wait launcher.start_timeout for a server that never comes up."""
    if importlib.util.find_spec("sglang") is not None:
        return None
    return (f"generation.backend=sglang, but the sglang package is not installed for {sys.executable}; install it "
            f"with {INSTALL} (on a GPU machine: SGLang pins a CUDA build of torch)")


def shell_line(argv: Sequence[str], env: dict[str, str]) -> str:
    """A command with its environment, as one line a user can paste into a shell."""
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, argv)])
