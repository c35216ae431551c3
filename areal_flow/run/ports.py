"""The spec of a run the launcher watches (local or Ray): a free port on the node of each process
that listens, the hosts of processes placed on other nodes, and the run's secret when it is secured
(docs/security.md). Written into the run directory with the config, which every process reads."""

from __future__ import annotations

from areal_flow.config.schema import RunConfig
from areal_flow.graph.placement import LISTENERS, Placement, infer_name
from areal_flow.launchers.commands import server_host
from areal_flow.run.prepare import Prepared
from areal_flow.runtime.security import LOOPBACK, Security, host_address, is_loopback, security_needed
from areal_flow.runtime.spec import RunSpec, reachable


def spec_with_ports(placement: Placement, ports: dict[str, int], **fields) -> RunSpec:
    """The run spec with the port of each listening process (`ports`: process name -> port, and
    'dist' for the trainers' torch.distributed rendezvous) and `fields`."""
    names = {r: [p.name for p in placement.of_role(r)] for r in ("gen_server", "rollout", "trainer")}
    return RunSpec(gen_ports=[ports[n] for n in names["gen_server"]], rollout_ports=[ports[n] for n in names["rollout"]],
                   trainer_ports=[ports[n] for n in names["trainer"]], infer_ports=_by_node(placement, "inference", ports),
                   judge_ports=_by_node(placement, "judge_server", ports),
                   controller_port=ports["controller"], dist_port=ports["dist"], n_trainers=len(names["trainer"]),
                   infer_dist_ports={n: ports[f"{n}_dist"] for n in placement.rendezvous},
                   n_rollout=len(names["rollout"]), **fields)


def _by_node(placement: Placement, role: str, ports: dict[str, int]) -> dict[str, list[int]]:
    """Graph node -> the ports of its processes of `role`, in rank order."""
    out: dict[str, list[int]] = {}
    for p in placement.of_role(role):
        out.setdefault(p.graph_node, []).append(ports[p.name])
    return out


def watched_spec(cfg: RunConfig, placement: Placement, launcher, prepared: Prepared, *, weights_dir: str,
                 resume: str | None) -> RunSpec:
    """The spec of a run `launcher` starts: ports it reserves, on the nodes where it places the processes."""
    # A secured run listens on this host's address, with a secret made here (docs/security.md).
    security = Security.new() if security_needed(cfg) else None
    host = host_address() if security is not None else LOOPBACK
    # A free port on the node of each process that listens (trainer 0's node twice: its inbox and the
    # trainers' torch.distributed rendezvous), in the order the spec lists them. Secured: free on
    # every address, since servers bind the host's address, loopback (torch.distributed) and maybe a
    # wildcard (generation.host).
    listeners = [p.name for r in LISTENERS for p in placement.of_role(r)]
    # A critic's processes on several devices: their rendezvous on the first one's node.
    names = [*listeners, "controller", "trainer0", *(infer_name(n, 0) for n in placement.rendezvous)]
    reserved = launcher.reserve(names, wildcard=security is not None)
    ports = dict(zip([*listeners, "controller", "dist", *(f"{n}_dist" for n in placement.rendezvous)],
                     (port for _, port in reserved)))
    # Processes a launcher put on other nodes (Ray) listen on, and are reached at, their node's address.
    hosts = {name: addr for name, (addr, _) in zip(names, reserved) if not is_loopback(addr)}
    return spec_with_ports(placement, ports, run_dir=prepared.run_dir, model_path=prepared.model_path,
                           train_path=prepared.train_path, eval_path=prepared.eval_path,
                           judge_models=prepared.judge_models,
                           gen_host=reachable(server_host(cfg, host)), weights_dir=weights_dir, host=host, hosts=hosts,
                           security=security, resume=resume or "")
