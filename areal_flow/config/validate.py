"""Checks of a composed run config that need nothing but the schema, and the error they raise.

OmegaConf already rejects wrong types. `check_ranges` checks every field against the bounds
declared on it in `schema.py`, `check_known_keys` the keys Hydra's `+key=value` adds past it, and
`check_model_config` the model directory's config.json. The rules that span several fields or
depend on the graph, the machine or other packages are the launcher's (`run/checks.py: check_run`):
this module imports no other package of areal_flow, so every package may use `ConfigError` and
`check_ranges`. Every problem names the key to change; all of them are reported at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # an annotation only: schema.py raises this module's ConfigError
    from areal_flow.config.schema import RunConfig


class ConfigError(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


def _out_of_range(value: Any, meta: dict) -> str | None:
    """Why `value` breaks the bounds in a field's metadata, or None."""
    if value is None:
        return None
    if "choices" in meta and isinstance(value, (list, tuple)):  # a list field: each item is one of them
        bad = [item for item in value if item not in meta["choices"]]
        return f"has {', '.join(map(repr, bad))}: each item must be one of {', '.join(map(str, meta['choices']))}" if bad else None
    if "choices" in meta and value not in meta["choices"]:
        return f"must be one of {', '.join(map(str, meta['choices']))}"
    if "ge" in meta and value < meta["ge"]:
        return f"must be ≥ {meta['ge']}"
    if "gt" in meta and value <= meta["gt"]:
        return f"must be > {meta['gt']}"
    if "le" in meta and value > meta["le"]:
        return f"must be ≤ {meta['le']}"
    return None


def _not_finite(value: Any, key: str) -> list[str]:
    """`key=nan: must be a finite number` for each NaN or ±inf in a value, in lists and dicts too
    (algorithm.betas[0], graph.<node>.weights.<key>). Every comparison with NaN is false, so the
    bounds alone let it through. No float field gives inf a meaning ("no limit" is null or 0
    throughout the schema), so inf is refused everywhere too."""
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{key}={value}: must be a finite number"]
    if isinstance(value, (list, tuple)):
        return [p for i, item in enumerate(value) for p in _not_finite(item, f"{key}[{i}]")]
    if isinstance(value, dict):
        return [p for name, item in value.items() for p in _not_finite(item, f"{key}.{name}")]
    return []


def check_ranges(obj: Any, prefix: str = "") -> list[str]:
    """Every field of a config dataclass (and of the dataclasses and dicts of dataclasses inside it)
    whose value breaks the bounds declared on the field: `key=value must be ...`, or is not a finite
    number: `key=nan: must be a finite number`."""
    problems = []
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            problems += check_ranges(value, key + ".")
        elif isinstance(value, dict) and value and all(dataclasses.is_dataclass(v) for v in value.values()):
            for name, item in value.items():
                problems += check_ranges(item, f"{key}.{name}.")
        elif not_finite := _not_finite(value, key):
            problems += not_finite
        elif (why := _out_of_range(value, f.metadata)) is not None:
            problems.append(f"{key}={value!r} {why}" if isinstance(value, str) else f"{key}={value} {why}")
    return problems


def did_you_mean(name: str, options: Any, prefix: str = "") -> str:
    """'; did you mean PREFIXoption?' naming the option closest to a mistyped `name`, or '' when
    none is close: the hint of every unknown key, node and recipe name."""
    close = difflib.get_close_matches(str(name), [str(o) for o in options], n=1)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def unknown_keys(obj: Any, prefix: str = "") -> list[str]:
    """Keys of a typed config that its dataclasses do not declare, with their full path. Hydra's
    `+key=value` adds a key past the schema, and the launcher's `typed` keeps it (OmegaConf merges a
    node that already has the schema's type without checking its keys) as an extra attribute; every
    process, which reads the run's config.yaml back untyped, then refuses it."""
    declared = [f.name for f in dataclasses.fields(obj)]
    where = f"'{prefix[:-1]}' ({type(obj).__name__})" if prefix else f"the config ({type(obj).__name__})"
    problems = []
    for name in vars(obj):
        if name not in declared:
            # A graph node names the kind that has the key (config/nodes.py), else the likely spelling.
            hint = getattr(obj, "elsewhere", lambda _: "")(name) or did_you_mean(name, declared, prefix)
            problems.append(f"{prefix}{name}: unknown key, {where} has no field {name!r}{hint}")
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            problems += unknown_keys(value, f"{prefix}{f.name}.")
        elif isinstance(value, dict) and value and all(dataclasses.is_dataclass(v) for v in value.values()):
            for name, item in value.items():
                problems += unknown_keys(item, f"{prefix}{f.name}.{name}.")
    return problems


def check_known_keys(cfg: RunConfig) -> None:
    """Raise ConfigError naming every key of the composed config the schema does not declare (added
    with '+'), found here rather than as a traceback in every process."""
    if problems := unknown_keys(cfg):
        raise ConfigError(problems)


def _config_json(model_path: str, key: str) -> dict:
    path = os.path.join(model_path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError([f"{key}: {path} cannot be read ({type(e).__name__}: {e})"]) from None
    except json.JSONDecodeError as e:
        raise ConfigError([f"{key}: {path} is not valid JSON ({e})"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{key}: {path} is not a JSON object"])
    return data


def model_context(model_path: str, key: str = "model.path") -> int | None:
    """The model's context length: config.json's max_position_embeddings (or its text_config's),
    read as JSON. Where neither says, transformers' default for the model type (load_model_config).
    The launcher, the controller and the rollout workers ask only this: AutoConfig's import costs
    each of them seconds of start-up (cProfile of a launch: 2.8 of its 4.1 s of checks)."""
    data = _config_json(model_path, key)
    for where in (data, data.get("text_config")):
        value = where.get("max_position_embeddings") if isinstance(where, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return getattr(load_model_config(model_path, key), "max_position_embeddings", None)


def load_model_config(model_path: str, key: str = "model.path"):
    """The transformers config of a model directory; ConfigError naming its config.json and what is
    wrong with it (not JSON, or not a config transformers can load)."""
    path = os.path.join(model_path, "config.json")
    _config_json(model_path, key)
    from transformers import AutoConfig  # here: importing it takes seconds, and most runs need none

    try:
        return AutoConfig.from_pretrained(model_path)
    except Exception as e:  # noqa: BLE001 - transformers refuses a config in many ways (ValueError, KeyError, ...)
        raise ConfigError([f"{key}: {path} is not a config transformers.AutoConfig can load "
                           f"({type(e).__name__}: {e})"]) from None


def check_model_config(model_path: str | None) -> None:
    """Raise ConfigError when `model.path`'s config.json does not parse or load (checked before any
    process starts, not in each one's log). Nothing to check without a model.path, or without a
    config.json (check_run reports that where the model must be here)."""
    if model_path and os.path.isfile(os.path.join(model_path, "config.json")):
        load_model_config(model_path)
