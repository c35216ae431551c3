"""Recipes as files, before and while Hydra composes them.

`recipe=PATH` (a YAML file anywhere, absolute or relative to the working directory) is turned into
what Hydra knows, a `recipe` group option on its search path: a temporary folder whose
`recipe/NAME.yaml` links to the file (NAME its file name, or that and a hash where a recipe of that
name is already on the search path), and a second one whose `recipe/` links to the file's folder,
so that the file's `defaults:` find the built-in recipes first, then the files beside it; both are
removed when the launcher exits. A recipe name that no folder holds, and an override's key that the
schema does not declare, are refused in one line with the likely one.

While Hydra composes, `watch_hydra_files` sees every YAML file it reads, and only those (a Helm
template or any other YAML beside a recipe is never parsed): a malformed one is refused in one
line naming its file and line, and a recipe file (group `recipe`) is global whatever its header
says, or omits, since a recipe's keys are the run's keys; one that sets no `recipe:` is named after
its file.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import os
import re
import shutil
import tempfile
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from areal_flow.config.validate import did_you_mean

RECIPE_GROUP = "recipe"
SUFFIXES = (".yaml", ".yml")


class RecipeError(ValueError):
    """A recipe the command line names that is not there, or a YAML file Hydra reads that is wrong:
    one line, naming the file or the name."""


def is_path(value: str) -> bool:
    """`recipe=VALUE` names a file (not a recipe by name): it ends in .yaml/.yml or starts as a path does."""
    return value.endswith(SUFFIXES) or value.startswith(("/", "./", "../", "~"))


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def _searchpath(argv: list[str]) -> tuple[int | None, list[str]]:
    """The index of the `hydra.searchpath=[...]` argument (Hydra reads the first) and its entries."""
    for i, arg in enumerate(argv):
        if arg.startswith("hydra.searchpath="):
            from hydra.core.override_parser.overrides_parser import OverridesParser

            try:
                value = OverridesParser.create().parse_override(arg).value()
            except Exception:  # noqa: BLE001 - Hydra reports a malformed override itself
                return i, []
            return i, [str(v) for v in value] if isinstance(value, list) else []
    return None, []


def _folder(entry: str) -> Path | None:
    """The folder of a search path entry, or None for one that is not a file system folder (pkg://)."""
    if entry.startswith("file://"):
        return Path(entry[len("file://"):])
    return None if "://" in entry else Path(entry)


def recipe_names(folders: list[Path]) -> list[str]:
    """The recipes in the folders' recipe/ subfolders, by name."""
    return sorted({p.stem for f in folders if (f / RECIPE_GROUP).is_dir() for p in (f / RECIPE_GROUP).glob("*.yaml")})


def _option(path: Path, folders: list[Path]) -> str:
    """The recipe option name under which the file at `path` is linked: its name, where no folder of
    the search path holds a recipe of that name (Hydra would read that one), else with a hash."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", path.stem) or "recipe"
    if any((f / RECIPE_GROUP / f"{name}.yaml").exists() for f in folders):
        name = f"{name}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    return name


def _linked(path: Path, folders: list[Path]) -> tuple[str, list[str]]:
    """Link the recipe file at `path` into a temporary search path, removed at exit: (its option
    name, the search path's entries)."""
    option = _option(path, folders)
    root = Path(tempfile.mkdtemp(prefix="areal_flow-recipe-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    (root / "file" / RECIPE_GROUP).mkdir(parents=True)
    (root / "file" / RECIPE_GROUP / f"{option}.yaml").symlink_to(path)
    (root / "beside").mkdir()
    (root / "beside" / RECIPE_GROUP).symlink_to(path.parent, target_is_directory=True)
    return option, [f"file://{root / 'file'}", f"file://{root / 'beside'}"]


def _path_problem(value: str, path: Path, builtin: list[str]) -> str | None:
    if path.is_file():
        return None
    what = "a folder, not a YAML file" if path.is_dir() else "no such file"
    hint = ""
    if not path.is_dir() and path.stem in builtin and "/" not in value:
        hint = f" (the built-in recipe is named without .yaml: recipe={path.stem})"
    return f"recipe={value}: {what} ({path}){hint}"


def _name_problem(value: str, folders: list[Path]) -> str | None:
    if not re.fullmatch(r"[\w\-./]+", value) or any((f / RECIPE_GROUP / f"{value}.yaml").is_file() for f in folders):
        return None
    names = recipe_names(folders)
    hint = did_you_mean(value, names, "recipe=")
    return f"recipe={value}: no recipe of that name (recipes: {', '.join(names)}){hint} (a recipe of your own: " \
           "recipe=PATH to its YAML file)"


def recipe_args(argv: list[str], conf_dir: Path) -> list[str]:
    """`argv` (Hydra's arguments) with every `recipe=PATH` made a recipe option Hydra finds (a
    sweep `recipe=a.yaml,b` too), the temporary search path added to hydra.searchpath (after the
    user's entries, so that a name there is found as before). RecipeError for a path that is no
    file, a name no folder holds, or an override's key the schema does not declare."""
    index, entries = _searchpath(argv)
    user = [_folder(e) for e in entries]
    folders = [conf_dir, *(f for f in user if f is not None)]
    # A pkg:// entry or a config dir given as a flag (-cd): names there cannot be listed, so not checked.
    names_known = None not in user and not any(a in ("-cd", "--config-dir") or a.startswith("--config-dir=")
                                               for a in argv)
    builtin = recipe_names([conf_dir])
    out, added = list(argv), []
    for i, arg in enumerate(argv):
        if not arg.startswith(f"{RECIPE_GROUP}="):
            continue
        values = [_unquote(v) for v in arg[len(RECIPE_GROUP) + 1:].split(",")]
        options = []
        for value in values:
            if not is_path(value):
                if names_known and (problem := _name_problem(value, folders)):
                    raise RecipeError(problem)
                options.append(value)
                continue
            path = Path(os.path.abspath(os.path.expanduser(value)))
            if problem := _path_problem(value, path, builtin):
                raise RecipeError(problem)
            option, entries_ = _linked(path, folders)
            options.append(option)
            added += entries_
        if options != values:
            out[i] = f"{RECIPE_GROUP}={','.join(options)}"
    if problems := override_key_problems(argv, conf_dir):
        raise RecipeError("; ".join(problems))
    if not added:
        return out
    quoted = ",".join("'" + e.replace("\\", "\\\\").replace("'", "\\'") + "'" for e in [*entries, *added])
    if index is None:  # beside the first recipe=: after a flag's value (--cfg job) argparse would refuse it
        first = next(i for i, arg in enumerate(out) if arg.startswith(f"{RECIPE_GROUP}="))
        out.insert(first + 1, f"hydra.searchpath=[{quoted}]")
    else:
        out[index] = f"hydra.searchpath=[{quoted}]"
    return out


# ---- while Hydra composes -----------------------------------------------------------------------


def _yaml_problem(path: str, e: Exception) -> str:
    mark = getattr(e, "problem_mark", None)
    where = f"{path}, line {mark.line + 1}" if mark is not None else path
    return f"malformed YAML in {where}: {getattr(e, 'problem', None) or e}"


def unknown_recipe_keys(section: Any, cls: type | None = None, prefix: str = "") -> list[str]:
    """The keys of a recipe file's mapping that the schema does not declare, each with the declared
    key closest to it. The graph's nodes are left to the launcher's check of node keys, and a dict
    field's keys (model.arch, ...) are the user's."""
    from areal_flow.config.schema import RunConfig

    cls = cls or RunConfig
    if not isinstance(section, dict):
        return []
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    problems = []
    for name, value in section.items():
        if not prefix and name in ("defaults", "hydra"):
            continue
        if name not in fields:
            where = f"'{prefix[:-1]}' ({cls.__name__})" if prefix else f"the config ({cls.__name__})"
            problems.append(f"{prefix}{name}: unknown key, {where} has no field {name!r}"
                            f"{did_you_mean(name, fields, prefix)}")
        elif dataclasses.is_dataclass(hints[name]):
            problems += unknown_recipe_keys(value, hints[name], f"{prefix}{name}.")
    return problems


def override_key_problems(argv: list[str], conf_dir: Path) -> list[str]:
    """The keys of `key=value` overrides that the schema does not declare, each with the declared key
    closest to it (Hydra says 'Could not override' in several lines, and suggests a '+' that the
    launcher then refuses). Config groups (algorithm=..., hydra/...), '+' and '~' overrides and flags
    are left to Hydra; past the graph or a dict field, keys are the user's."""
    groups = {p.name for p in conf_dir.iterdir() if p.is_dir()} | {RECIPE_GROUP}
    problems = []
    for arg in argv:
        key, sep, _ = arg.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][\w.]*", key) or key.split(".")[0] == "hydra" or key in groups:
            continue
        nested: dict = {}
        section = nested
        for part in key.split(".")[:-1]:
            section = section.setdefault(part, {})
        section[key.split(".")[-1]] = None
        problems += unknown_recipe_keys(nested)
    return problems


def checked_result(result, config_path: str, full_path: str):
    """A config file Hydra has read (its ConfigResult), as the launcher takes it: a recipe is global
    and named. RecipeError for a recipe file that is not a mapping, or puts its keys under a package."""
    from omegaconf import OmegaConf

    if config_path.split("/", 1)[0] != RECIPE_GROUP:
        return result
    package = result.header.get("package")
    if package not in (None, "_global_"):
        raise RecipeError(f"recipe file {full_path}: '# @package {package}' puts its keys under {package!r}, but a "
                          "recipe's keys are the run's: write '# @package _global_' or no such line")
    if not OmegaConf.is_dict(result.config):
        raise RecipeError(f"recipe file {full_path}: its top level must be a mapping of keys (recipe: ..., graph: "
                          f"...), not a {type(OmegaConf.to_container(result.config)).__name__}")
    result.header["package"] = "_global_"  # Hydra's default for the group, 'recipe', is a string key
    # Hydra would name the group option (a linked file's option is not its name) in several lines.
    if problems := unknown_recipe_keys(OmegaConf.to_container(result.config)):
        raise RecipeError(f"recipe file {full_path}: {'; '.join(problems)}")
    if RECIPE_GROUP not in result.config:
        result.config[RECIPE_GROUP] = Path(full_path).stem
    return result


def watch_hydra_files(report: Callable[[str], None]) -> None:
    """Have every YAML file Hydra reads from a folder checked as it is read (checked_result; YAML
    that does not parse named by file and line): on a problem, `report` it and exit with code 2,
    before anything starts. Only the files Hydra reads: no folder of the search path is scanned."""
    import yaml
    from hydra._internal.sources_registry import SourcesRegistry
    from hydra.core.plugins import Plugins

    # The class Hydra reads file:// folders with: its plugin scan loads the module afresh, so the
    # class registered is not the one an import of file_config_source gives.
    Plugins.instance()
    FileConfigSource = SourcesRegistry.instance().resolve("file")
    load = FileConfigSource.load_config
    if getattr(load, "areal_flow_checked", False):
        return

    def load_config(self, config_path: str):
        full = os.path.realpath(os.path.join(self.path, self._normalize_file_name(config_path)))
        try:
            return checked_result(load(self, config_path), config_path, full)
        except yaml.YAMLError as e:
            problem = _yaml_problem(full, e)
        except UnicodeDecodeError as e:
            problem = f"{full} is not UTF-8 text ({e.reason} at byte {e.start})"
        except RecipeError as e:
            problem = str(e)
        report(problem)
        raise SystemExit(2)  # past Hydra's handler of exceptions, which would print a traceback's worth

    load_config.areal_flow_checked = True
    FileConfigSource.load_config = load_config
