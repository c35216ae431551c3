"""A run directory's files as the status view reads them, each on its own: the tail of a JSON-lines
file and its last event, JSON files, the config's total steps, the trainer's version, the spec and
the generation servers' addresses. None (or empty) where a file is missing or not yet written:
the view reads runs while they start, run and end."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import msgspec

from areal_flow.generation.client.membership import read_membership
from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.spec import RunSpec


def tail_lines(path: str, max_bytes: int) -> list[bytes]:
    """The complete lines in the last `max_bytes` of a file (none when it is missing)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            chunk = f.read()
    except OSError:
        return []
    lines = chunk.split(b"\n")
    if size > max_bytes:
        lines = lines[1:]  # the first one is cut
    return [line for line in lines[:-1] if line.strip()]  # the last one is "" or still being written


def last_event(path: str, event: str, max_bytes: int = 1 << 22) -> dict | None:
    """The last row of a JSON-lines file with this event, looked for in its last `max_bytes`."""
    needle = f'"{event}"'.encode()
    for line in reversed(tail_lines(path, max_bytes)):
        if needle in line:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("event") == event:
                return row
    return None


def read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def config_total_steps(run_dir: str) -> int | None:
    """total_steps of the run's config.yaml, or of Hydra's composed config before it is written."""
    import yaml

    for name in (rd.CONFIG, rd.HYDRA_CONFIG):
        try:
            with open(os.path.join(run_dir, name)) as f:
                steps = (yaml.safe_load(f) or {}).get("total_steps")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(steps, int):
            return steps
    return None


def trained_version(run_dir: str) -> int | None:
    """The version the trainer holds: its last trained step (rank files count steps from 0) + 1."""
    versions = []
    for path in glob.glob(os.path.join(run_dir, rd.TRAINED.format(rank="*"))):
        if "discarded" in os.path.basename(path):  # what a resume cut away (checkpoint/store.py)
            continue
        for line in reversed(tail_lines(path, 1 << 16)):
            try:
                versions.append(int(json.loads(line)["step"]) + 1)
                break
            except (ValueError, KeyError, TypeError):
                continue
    return max(versions) if versions else None


def read_spec(path: str) -> RunSpec | None:
    """The run's spec.json, or None while it is not written (or cannot be read)."""
    try:
        with open(path, "rb") as f:
            return msgspec.json.decode(f.read(), type=RunSpec)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def server_urls(spec: RunSpec | None) -> dict[str, str]:
    """gen_server<i> and each judge's <judge>_server<i> -> its URL (RunSpec.gen_urls, judge_urls, and
    the servers a scale added: servers.json, servers-<judge>.json)."""
    if spec is None:
        return {}
    urls = dict(zip(spec.gen_names, spec.gen_urls))
    for node in spec.judge_ports:
        urls |= dict(zip(spec.judge_names(node), spec.judge_urls(node)))
    for judge in ["", *spec.judge_ports]:
        if (membership := read_membership(spec.run_dir, judge)) is not None:
            urls |= {name: m.url for name, m in membership.servers.items()}
    return urls
