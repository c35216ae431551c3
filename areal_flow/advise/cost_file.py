"""The cost file (YAML or JSON) the advisor reads its costs and candidates from: sections
generation, training, weights, workload, latency and candidates, each key checked against the
dataclasses of costs.py. A missing section or key keeps its default; every bad value is an
`AdviseError` naming its key or file."""

from __future__ import annotations

import json
import math
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import yaml

from areal_flow.advise.costs import (
    AdviseError,
    Candidates,
    Costs,
    GenCosts,
    Latency,
    Lengths,
    TrainCosts,
    UpdateCosts,
    Workload,
)

_SECTIONS = {"generation": GenCosts, "training": TrainCosts, "weights": UpdateCosts, "workload": Workload,
             "latency": Latency}
_POSITIVE = {"batch_size", "group_size", "devices_per_server", "max_running", "max_concurrent", "dp_efficiency",
             "join_group"}


def _number(where: str, value: Any, kind: type, *, positive: bool = False, nullable: bool = False) -> Any:
    """`value` as `kind` (int, float or bool), checked ≥ 0, or > 0 when `positive`; None if `nullable`."""
    if value is None and nullable:
        return None
    if kind is bool:
        if not isinstance(value, bool):
            raise AdviseError(f"{where}: expected true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise AdviseError(f"{where}: expected {'an integer' if kind is int else 'a number'}, got {value!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and positive):
        raise AdviseError(f"{where}: must be {'positive' if positive else 'a cost ≥ 0'}, got {value!r}")
    return kind(value)


def _section(cls: type, raw: Any, where: str) -> Any:
    """One section of the cost file as `cls`, every key known and every value checked."""
    if not isinstance(raw, dict):
        raise AdviseError(f"{where}: expected a mapping of keys, got {type(raw).__name__}")
    known = {f.name: str(f.type) for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise AdviseError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
    values = {}
    for key, value in raw.items():
        kind = bool if "bool" in known[key] else int if "int" in known[key] else float
        values[key] = _number(f"{where}.{key}", value, kind, positive=key in _POSITIVE, nullable="None" in known[key])
    return cls(**values)


def read_lengths_file(path: str | Path, where: str) -> tuple[int, ...]:
    """Answer lengths from a file: a JSON list, or one integer per line."""
    path = Path(path)
    if not path.is_file():
        raise AdviseError(f"{where}: lengths file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        values = json.loads(text) if text.lstrip().startswith("[") else [float(x) for x in text.split()]
    except ValueError as exc:
        raise AdviseError(f"{where}: {str(path)!r} is not a JSON list or one length per line ({exc})") from None
    if not values or any(not isinstance(v, (int, float)) or v < 1 for v in values):
        raise AdviseError(f"{where}: {str(path)!r} must hold at least one length, each ≥ 1")
    return tuple(int(v) for v in values)


def _lengths(raw: Any, max_new_tokens: int, base: Path) -> Lengths:
    where = "workload.lengths"
    if isinstance(raw, list):
        if not raw or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 1 for v in raw):
            raise AdviseError(f"{where}: a list must hold at least one length, each ≥ 1")
        return Lengths(max_new_tokens, values=tuple(int(v) for v in raw))
    if not isinstance(raw, dict) or len(raw) != 1:
        raise AdviseError(f"{where}: expected a list of lengths, {{file: PATH}}, {{constant: N}} or "
                          "{lognormal: {mean: M, sigma: S}}")
    (kind, value), = raw.items()
    if kind == "file":
        return Lengths(max_new_tokens, values=read_lengths_file(base / str(value), f"{where}.file"))
    if kind == "constant":
        return Lengths(max_new_tokens, mean=_number(f"{where}.constant", value, float, positive=True))
    if kind == "lognormal" and isinstance(value, dict) and set(value) == {"mean", "sigma"}:
        return Lengths(max_new_tokens, mean=_number(f"{where}.lognormal.mean", value["mean"], float, positive=True),
                       sigma=_number(f"{where}.lognormal.sigma", value["sigma"], float))
    raise AdviseError(f"{where}: unknown form {kind!r}; use a list, file, constant or lognormal {{mean, sigma}}")


def parse_split(text: str, where: str = "--splits") -> tuple[int, int]:
    """'3:1' -> (3, 1)."""
    gen, sep, train = str(text).partition(":")
    try:
        split = int(gen), int(train)
    except ValueError:
        split = None
    if not sep or split is None or split[0] < 1 or split[1] < 1:
        raise AdviseError(f"{where}: {text!r} is not GEN:TRAIN with two positive integers, e.g. 3:1")
    return split


def load_cost_file(path: str | Path) -> tuple[Costs, Candidates]:
    """Read a cost file (YAML or JSON); sections generation, training, weights, workload, latency, candidates."""
    path = Path(path)
    if not path.is_file():
        raise AdviseError(f"--costs: cost file {str(path)!r} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise AdviseError(f"--costs: {str(path)!r} is not YAML or JSON: {exc}") from None
    return parse_costs(raw, path.parent, str(path))


def parse_costs(raw: Any, base: Path = Path("."), name: str = "cost file") -> tuple[Costs, Candidates]:
    """Costs and candidates from the cost file's mapping; a missing section or key keeps its default."""
    if not isinstance(raw, dict):
        raise AdviseError(f"{name}: expected a mapping with sections generation, training, weights, workload, latency, "
                          "candidates")
    unknown = sorted(set(raw) - {*_SECTIONS, "candidates"})
    if unknown:
        raise AdviseError(f"{name}: unknown section(s) {', '.join(map(repr, unknown))}; "
                          f"known: {', '.join([*_SECTIONS, 'candidates'])}")
    workload_raw = dict(raw.get("workload") or {})
    lengths_raw = workload_raw.pop("lengths", None)
    max_new = _number("workload.max_new_tokens", workload_raw.pop("max_new_tokens", 1024), int, positive=True)
    parts = {k: _section(cls, raw.get(k) or {} if k != "workload" else workload_raw, k) for k, cls in _SECTIONS.items()}
    lengths = _lengths(lengths_raw, max_new, base) if lengths_raw is not None else Lengths(max_new, mean=max_new / 2)
    if parts["workload"].filtered_fraction >= 1:
        raise AdviseError(f"{name}: workload.filtered_fraction={parts['workload'].filtered_fraction:g} must be below 1 "
                          "(with every group filtered nothing is ever trained)")
    costs = Costs(parts["generation"], parts["training"], parts["weights"], parts["workload"], lengths, parts["latency"])
    return costs, _candidates(raw.get("candidates") or {})


def _candidates(raw: Any) -> Candidates:
    where = "candidates"
    if not isinstance(raw, dict):
        raise AdviseError(f"{where}: expected a mapping")
    unknown = sorted(set(raw) - {f.name for f in fields(Candidates)})
    if unknown:
        raise AdviseError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; known: splits, etas, devices, colocated")
    out = Candidates()
    if "splits" in raw:
        out = replace(out, splits=tuple(parse_split(s, f"{where}.splits") for s in raw["splits"]))
    if "etas" in raw:
        out = replace(out, etas=tuple(_number(f"{where}.etas", e, int) for e in raw["etas"]))
    if raw.get("devices") is not None:
        out = replace(out, devices=_number(f"{where}.devices", raw["devices"], int, positive=True))
    if "colocated" in raw:
        out = replace(out, colocated=_number(f"{where}.colocated", raw["colocated"], bool))
    return out
