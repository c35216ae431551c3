"""Allocation strings: which devices generation and training get, and how each is parallel.

    sglang:d32t2 + megatron:d4p2t4

reads "32 SGLang servers of 2 devices each (64 devices), then Megatron on the next 32 devices with
data parallel 4, pipeline 2, tensor 2·2 = 4". `+` separates parts on devices of their own (in
order: the first part gets devices 0.., the next part the devices after it); `|` puts the two parts
on the same devices (colocated: `embedded:d1 | torch:d1` runs a whole recipe on one GPU, generation
and training taking turns; docs/colocation.md), and their sizes must then match. A part is an optional backend and
its sizes: `d` data parallel (servers, for generation), `t` tensor, `p` pipeline; a missing size
is 1. Backends: generation `sglang` or `embedded` (areal_flow's engine), training `megatron` or
`torch` (alias `fsdp`). Without names the first part generates and the second trains.

The grammar is parsed with lark; every error names the character it is about, with a caret line.
`apply_allocation` writes the result into a run config (the generate node's mesh,
generation.backend and tp_size; the batch nodes' mesh, parallel layout and engine), so every
process reads one effective config. Imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lark import Lark, Token, Transformer, UnexpectedInput, UnexpectedToken

from areal_flow.graph.layout import Layout

GRAMMAR = r"""
    allocation: component ("+" component)*
    component: part ("|" part)*
    part: (BACKEND ":")? DIM+
    BACKEND: /[A-Za-z_][A-Za-z0-9_-]*(?=\s*:)/
    DIM: /[A-Za-z][0-9]+/
    %import common.WS
    %ignore WS
"""
_PARSER = Lark(GRAMMAR, start="allocation", parser="lalr")

GENERATION_BACKENDS = ("sglang", "embedded")
TRAINING_BACKENDS = {"megatron": "megatron", "torch": "torch", "fsdp": "torch"}  # name -> node engine
_DIMS = {"d": "dp", "t": "tp", "p": "pp"}
_NOT_HERE = {"c": "context parallel (c) is not supported in this version",
             "e": "expert parallel (e) is not supported in this version"}


class AllocationError(ValueError):
    """An allocation string that does not parse or does not fit; the message points at the character."""


@dataclass(frozen=True)
class Part:
    """One `backend:dims` part: its backend (None when not named) and layout, and where it starts."""

    backend: str | None
    layout: Layout
    column: int  # 1-based character of the part in the string
    columns: dict[str, int]  # "dp" | "tp" | "pp" -> the character of its size, where given

    @property
    def n_devices(self) -> int:
        return self.layout.size


@dataclass(frozen=True)
class Allocation:
    """A parsed allocation: generation on devices [0, generation.n_devices), training after it."""

    text: str
    generation: Part
    training: Part
    colocated: bool = False  # `|`: training on generation's devices

    @property
    def n_devices(self) -> int:
        return self.generation.n_devices + (0 if self.colocated else self.training.n_devices)

    @property
    def generation_mesh(self) -> tuple[int, ...]:
        return tuple(range(self.generation.n_devices))

    @property
    def training_first(self) -> int:
        """The training part's first device."""
        return 0 if self.colocated else self.generation.n_devices

    @property
    def training_mesh(self) -> tuple[int, ...]:
        return tuple(range(self.training_first, self.training_first + self.training.n_devices))

    @property
    def generation_backend(self) -> str | None:
        return self.generation.backend

    @property
    def training_engine(self) -> str | None:
        return None if self.training.backend is None else TRAINING_BACKENDS[self.training.backend]

    def __str__(self) -> str:
        gen, train = self.generation, self.training
        return (f"{gen.backend or 'generation'}:d{gen.layout.dp}t{gen.layout.tp} {'|' if self.colocated else '+'} "
                f"{train.backend or 'training'}:{train.layout}")


def pointing(text: str, column: int, message: str, where: str = "allocation") -> AllocationError:
    """`message` about character `column` (1-based) of `text`, with the string and a caret under it."""
    return AllocationError(f"{where}={text!r}: {message} (character {column})\n    {text}\n    {' ' * (column - 1)}^")


class _Build(Transformer):
    """Parse tree -> lists of Parts; sizes are checked here, where the tokens know their columns."""

    def __init__(self, text: str, where: str):
        super().__init__()
        self.text, self.where = text, where

    def part(self, children: list[Token]) -> Part:
        backend, column = None, children[0].column
        if children[0].type == "BACKEND":
            backend = str(children[0]).lower()
            known = GENERATION_BACKENDS + tuple(TRAINING_BACKENDS)
            if backend not in known:
                raise pointing(self.text, children[0].column, f"unknown backend {str(children[0])!r}; expected one "
                               f"of {', '.join(known)}", self.where)
            children = children[1:]
        sizes: dict[str, int] = {}
        columns: dict[str, int] = {}
        for dim in children:
            letter, size = dim[0].lower(), int(dim[1:])
            if letter in _NOT_HERE:
                raise pointing(self.text, dim.column, _NOT_HERE[letter], self.where)
            if letter not in _DIMS:
                raise pointing(self.text, dim.column, f"unknown size {dim[0]!r}; expected d (data), t (tensor) or "
                               "p (pipeline), e.g. d4t2", self.where)
            if _DIMS[letter] in sizes:
                raise pointing(self.text, dim.column, f"{letter!r} is given twice in one part", self.where)
            if size < 1:
                raise pointing(self.text, dim.column + 1, f"{letter}{size}: a size must be at least 1", self.where)
            sizes[_DIMS[letter]] = size
            columns[_DIMS[letter]] = dim.column
        return Part(backend, Layout(**sizes), column, columns)

    def component(self, parts: list[Part]) -> list[Part]:
        return parts

    def allocation(self, components: list[list[Part]]) -> list[list[Part]]:
        return components


def parse_allocation(text: str, where: str = "allocation") -> Allocation:
    """The allocation `text` describes; AllocationError pointing at the character that is wrong."""
    try:
        components = _Build(text, where).transform(_PARSER.parse(text))
    except UnexpectedInput as e:
        pos = getattr(e, "pos_in_stream", None)
        if isinstance(e, UnexpectedToken) and e.token.type == "$END" or pos is None or pos >= len(text):
            pos, what = len(text.rstrip()), "the string ends where a part was expected"
        else:
            what = f"unexpected {text[pos]!r}"
        raise pointing(text, pos + 1, f"{what}; expected parts like 'sglang:d4t2 + megatron:d2p2t2'", where) from None
    except AllocationError:
        raise
    except Exception as e:  # lark wraps errors raised in a transformer callback
        if isinstance(getattr(e, "orig_exc", None), AllocationError):
            raise e.orig_exc from None
        raise
    colocated = len(components) == 1 and len(components[0]) == 2
    if any(len(parts) > 1 for parts in components) and not colocated:
        raise pointing(text, text.index("|") + 1, "'|' colocates the two parts of an allocation, generation | "
                       "training, alone: it cannot be mixed with '+' or join more parts", where)
    parts = components[0] if colocated else [p[0] for p in components]
    if len(parts) != 2:
        column = parts[2].column if len(parts) > 2 else len(text) + 1
        raise pointing(text, column, f"{len(parts)} part(s); an allocation has two, generation then training, "
                       "e.g. 'sglang:d4t2 + megatron:d2t2'", where)
    gen, train = parts
    if gen.backend in TRAINING_BACKENDS:
        raise pointing(text, gen.column, f"the first part generates, and {gen.backend!r} is a training backend "
                       f"(generation: {', '.join(GENERATION_BACKENDS)})", where)
    if train.backend in GENERATION_BACKENDS:
        raise pointing(text, train.column, f"the second part trains, and {train.backend!r} is a generation backend "
                       f"(training: {', '.join(TRAINING_BACKENDS)})", where)
    if gen.layout.pp > 1:
        raise pointing(text, gen.columns["pp"], "generation has no pipeline parallel here: servers are d (how many) "
                       "and t (devices each)", where)
    if colocated and gen.n_devices != train.n_devices:
        raise pointing(text, train.column, f"parts joined by '|' share their devices, so their sizes must match: "
                       f"generation has {gen.n_devices}, training {train.n_devices}", where)
    return Allocation(text, gen, train, colocated)


def allocation_problems(alloc: Allocation, *, n_nodes: int, per_node: int) -> list[str]:
    """What does not fit the cluster: more devices than nodes × devices, or groups that would
    straddle nodes. (The model's heads and layers are checked on the nodes it was applied to.)"""
    where = f"allocation={alloc.text!r}"
    problems = []
    total = n_nodes * per_node
    if alloc.n_devices > total:
        needs = str(alloc.n_devices) if alloc.colocated else \
            f"{alloc.generation.n_devices} + {alloc.training.n_devices} = {alloc.n_devices}"
        problems.append(f"{where} needs {needs} devices, the cluster has {n_nodes} node(s) × {per_node} = {total} "
                        "(cluster.n_nodes × cluster.n_devices)")
    # A server's devices and a tensor-parallel group talk on every layer: they must share a node.
    for what, part, first in (("a generation server", alloc.generation, 0),
                              ("a tensor-parallel group", alloc.training, alloc.training_first)):
        tp = part.layout.tp
        if tp > per_node:
            problems.append(f"{where}: {what} of t{tp} needs {tp} devices on one node, a node has {per_node}")
        elif per_node % tp or first % tp:
            problems.append(f"{where}: {what} of t{tp} would straddle two nodes of {per_node} devices "
                            f"(its devices start at {first}); choose t dividing {per_node} and sizes that keep "
                            "each group on one node")
    return problems


def _mesh(devices: tuple[int, ...]) -> str:
    return f"{devices[0]}-{devices[-1]}" if len(devices) > 1 else str(devices[0])


def _own_mesh(node: Any, trainer_mesh: Any) -> bool:
    """An inference node of a frozen role (ref) whose recipe gives it devices other than the actor
    train node's: a mesh of its own (graph/dag.py `own_mesh_nodes`), which an allocation keeps."""
    return (node.get("role") not in (None, "actor", "critic")
            and node.get("mesh") is not None and node.get("mesh") != trainer_mesh)


def apply_allocation(raw: Any, alloc: Allocation) -> list[str]:
    """Write `alloc` into the run config `raw` (an OmegaConf DictConfig or a mapping of its shape):
    the policy's generate node's mesh (a judge keeps its own), generation.backend and tp_size; the
    batch nodes' mesh, parallel and engine. A frozen node on a mesh of its own keeps it (the graph's
    checks then refuse, naming it, an allocation that gives its devices to another node). Returns
    one line per key it set, for the launcher to print."""
    set_lines = []

    def put(section: Any, key: str, value: Any, path: str) -> None:
        section[key] = value
        set_lines.append(f"{path}={value}")

    gen, train = alloc.generation, alloc.training
    trainer_mesh = next((node.get("mesh") for node in raw["graph"].values()
                         if node is not None and node.get("type") == "train" and node.get("role") == "actor"), None)
    if alloc.generation_backend is not None:
        put(raw["generation"], "backend", alloc.generation_backend, "generation.backend")
    put(raw["generation"], "tp_size", gen.layout.tp, "generation.tp_size")
    for name, node in raw["graph"].items():
        kind = node.get("type") if node is not None else None  # a node set to null is removed (schema.py)
        if kind == "generate" and node.get("role") == "judge":
            continue  # a judge keeps its mesh; one the allocation's devices overlap is refused naming it
        if kind == "generate":
            put(node, "mesh", _mesh(alloc.generation_mesh), f"graph.{name}.mesh")
        elif kind == "inference" and _own_mesh(node, trainer_mesh):
            set_lines.append(f"graph.{name}.mesh={node['mesh']} (kept: a frozen node on a mesh of its own)")
        elif kind in ("inference", "train"):
            put(node, "mesh", _mesh(alloc.training_mesh), f"graph.{name}.mesh")
            put(node, "parallel", str(train.layout), f"graph.{name}.parallel")
            if alloc.training_engine is not None:
                put(node, "engine", alloc.training_engine, f"graph.{name}.engine")
    return set_lines
