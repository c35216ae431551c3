"""Which processes a graph needs and where they run."""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_flow.graph.dag import Graph, format_mesh


@dataclass(frozen=True)
class Proc:
    """One OS process of the run."""

    name: str
    role: str  # controller | gen_server | rollout | reward | trainer
    devices: tuple[int, ...] = ()  # cores (CPU) or GPUs it owns; () = floats
    rank: int = 0


@dataclass
class Placement:
    procs: list[Proc] = field(default_factory=list)

    def of_role(self, role: str) -> list[Proc]:
        return [p for p in self.procs if p.role == role]

    def describe(self, device_type: str) -> str:
        unit = "core" if device_type == "cpu" else "gpu"
        lines = ["placement:"]
        for p in self.procs:
            where = f"{unit} {format_mesh(p.devices)}" if p.devices else "any core (light)"
            lines.append(f"  {p.name:<14} {where}")
        return "\n".join(lines)


def place(graph: Graph, rollout_workers: int, gen_tp_size: int = 1) -> Placement:
    """One generation server per `gen_tp_size` consecutive generate-mesh devices (which must divide
    the mesh: config/validate.py), one trainer rank per trainer-mesh device (data parallel), the
    reward pool, rollout workers and one controller."""
    procs = [Proc("controller", "controller")]
    gen_mesh = graph.generate.mesh or ()
    for i, start in enumerate(range(0, len(gen_mesh), gen_tp_size)):
        procs.append(Proc(f"gen_server{i}", "gen_server", tuple(gen_mesh[start:start + gen_tp_size]), i))
    procs += [Proc(f"rollout{i}", "rollout", (), i) for i in range(rollout_workers)]
    # One reward process runs every reward node in graph order on each group it takes; each node
    # scores in its own pool of `workers` processes (rewards/service.py).
    procs += [Proc("reward0", "reward", (), 0)] if graph.rewards else []
    for rank, dev in enumerate(graph.trainer_mesh):
        procs.append(Proc(f"trainer{rank}", "trainer", (dev,), rank))
    return Placement(procs)
