"""launcher.type=slurm: the job script against the placement, the job-side completion of the run
spec, the watch loop of the script (with stand-ins for srun and scontrol), torchrun ranks in the
trainer, and the missing-sbatch error."""

import json
import os
import re
import shlex
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from areal_flow.launch import CONF_DIR
from areal_flow.graph import graph_from_config, place
from areal_flow.graph.allocation import apply_allocation, parse_allocation
from areal_flow.launchers import slurm_job
from areal_flow.launchers.slurm import fixed_ports, sbatch_script
from areal_flow.runtime.security import Security
from areal_flow.runtime.spec import RunSpec, read_run, typed, write_run

REPO = Path(__file__).resolve().parents[2]


def config(n_nodes: int, n_devices: int, allocation: str, device_type: str = "cuda", **launcher):
    """The composed recipe (as `python -m areal_flow.launch` composes it), the allocation applied."""
    overrides = ["recipe=tiny_arith_megatron", f"cluster.n_nodes={n_nodes}", f"cluster.n_devices={n_devices}",
                 f"cluster.device_type={device_type}", "launcher.type=slurm", "output_dir=/tmp/unused"]
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        raw = compose("config", overrides=overrides)
    for key, value in launcher.items():
        raw.launcher[key] = value
    raw.allocation = allocation
    apply_allocation(raw, parse_allocation(allocation))
    cfg = typed(raw)
    return raw, cfg, place(graph_from_config(cfg), cfg.rollout.workers, cfg.generation.tp_size, n_devices)


def step_lines(script: str) -> dict[str, str]:
    """Each `start NAME ...` command of the script (continuation lines joined)."""
    joined = script.replace("\\\n", " ")
    return {m.group(1): m.group(0) for m in re.finditer(r"^start (\S+) .*$", joined, re.M)}


ALLOCATIONS = [  # (nodes, devices per node, allocation)
    (1, 8, "sglang:d2t2 + megatron:d2p1t2"),
    (2, 8, "sglang:d4t2 + megatron:d2p2t2"),
    (16, 8, "sglang:d32t2 + megatron:d8p2t4"),
    (2, 8, "sglang:d3t2 + megatron:d2p2t2"),  # trainer ranks straddle nodes: 2 on node 0, 6 on node 1
]


@pytest.mark.parametrize("n_nodes,n_devices,allocation", ALLOCATIONS)
def test_the_script_starts_every_process_on_its_node_with_its_devices(n_nodes, n_devices, allocation, tmp_path):
    raw, cfg, placement = config(n_nodes, n_devices, allocation, slurm_partition="gpu", slurm_account="proj",
                                 slurm_time="4:00:00", slurm_extra=["--qos=high"], slurm_base_port=31000)
    script = sbatch_script(cfg, placement, "/shared/run", python="/opt/py/bin/python")
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    for line in (f"#SBATCH --nodes={n_nodes}", f"#SBATCH --gpus-per-node={n_devices}", "#SBATCH --partition=gpu",
                 "#SBATCH --account=proj", "#SBATCH --time=4:00:00", "#SBATCH --qos=high",
                 "#SBATCH --output=/shared/run/logs/job-%j.log"):
        assert line + "\n" in script
    lines = step_lines(script)
    trainer_nodes = sorted({p.node for p in placement.of_role("trainer")})
    expected = {p.name for p in placement.procs if p.role != "trainer"} | {f"trainers-node{n}" for n in trainer_nodes}
    assert set(lines) == expected
    for proc in placement.procs:
        if proc.role == "trainer":
            continue
        line = lines[proc.name]
        assert line.startswith(f"start {proc.name} {proc.node} ")  # start() runs it on HOSTS[node]
        devices = re.search(r"--devices (\S+)", line)
        # the process's own GPUs, as numbered on its node; light processes none, and on node 0
        assert (devices.group(1) if devices else "") == ",".join(map(str, proc.local_devices)) or \
            (devices and proc.local_devices == tuple(range(proc.local_devices[0], proc.local_devices[-1] + 1)))
        assert proc.devices or proc.node == 0
    rank = 0
    for node_rank, node in enumerate(trainer_nodes):
        ranks = [p for p in placement.of_role("trainer") if p.node == node]
        line = lines[f"trainers-node{node}"]
        assert line.startswith(f"start trainers-node{node} {node} ")
        assert f"--nnodes={len(trainer_nodes)} --node_rank={node_rank} --nproc_per_node={len(ranks)} " in line
        assert f'--master_addr="${{ADDRS[{trainer_nodes[0]}]}}" --master_port={fixed_ports(placement, 31000)["dist"]}' in line
        assert [p.rank for p in ranks] == list(range(rank, rank + len(ranks)))  # torchrun's numbering
        rank += len(ranks)
        first, last = ranks[0].local_devices[0], ranks[-1].local_devices[0]
        assert f"--devices {first}-{last} " in line or f"--devices {first},{last} " in line or len(ranks) == 1
    assert rank == len(placement.of_role("trainer"))


def test_sixteen_nodes_put_generation_on_eight_and_training_on_eight():
    _, cfg, placement = config(16, 8, "sglang:d32t2 + megatron:d8p2t4")
    lines = step_lines(sbatch_script(cfg, placement, "/shared/run"))
    assert lines["gen_server31"].startswith("start gen_server31 7 ") and "--devices 6,7" in lines["gen_server31"]
    assert "--nnodes=8 --node_rank=7 --nproc_per_node=8 " in lines["trainers-node15"]
    assert '--master_addr="${ADDRS[8]}"' in lines["trainers-node15"] and "--devices 0-7 " in lines["trainers-node15"]


def test_a_cpu_job_holds_cores_instead_of_gpus():
    _, cfg, placement = config(1, 4, "embedded:d2 + torch:d2", device_type="cpu")
    script = sbatch_script(cfg, placement, "/shared/run")
    assert "#SBATCH --cpus-per-task=4\n" in script and "--gpus" not in script
    assert "--nnodes=1 --node_rank=0 --nproc_per_node=2 " in step_lines(script)["trainers-node0"]


def test_the_nodelist_expands_as_scontrol_shows_it():
    assert slurm_job.expand_nodelist("node[01-03],gpu7") == ["node01", "node02", "node03", "gpu7"]
    assert slurm_job.expand_nodelist("a[8-10,12]b,c") == ["a8b", "a9b", "a10b", "a12b", "c"]
    assert slurm_job.expand_nodelist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    with pytest.raises(slurm_job.SlurmJobError, match="'x-3' is not a number or range"):
        slurm_job.expand_nodelist("n[x-3]")


def partial_run(tmp_path: Path, n_nodes=2, allocation="sglang:d4t2 + megatron:d2p2t2", device_type="cuda"):
    """What the launcher leaves in the run directory before the job: config, a spec without hosts."""
    raw, cfg, placement = config(n_nodes, 8, allocation, device_type=device_type)
    ports = fixed_ports(placement, 29600)
    n = {r: len(placement.of_role(r)) for r in ("gen_server", "rollout", "trainer")}
    spec = RunSpec(run_dir=str(tmp_path), model_path="/m", train_path="/t", eval_path="/e",
                   gen_ports=[ports[f"gen_server{i}"] for i in range(n["gen_server"])],
                   rollout_ports=[ports[f"rollout{i}"] for i in range(n["rollout"])],
                   trainer_ports=[ports[f"trainer{i}"] for i in range(n["trainer"])], controller_port=ports["controller"],
                   dist_port=ports["dist"], n_trainers=n["trainer"], n_rollout=n["rollout"], security=Security.new())
    write_run(str(tmp_path), raw, spec)
    (tmp_path / "logs").mkdir(exist_ok=True)
    return cfg, placement, spec


def test_the_job_completes_the_spec_with_each_nodes_address(tmp_path, monkeypatch):
    _, placement, before = partial_run(tmp_path)
    table = {"node01": "10.0.0.1", "node02": "10.0.0.2", "node03": "10.0.0.3"}
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: [(0, 0, 0, "", (table[host], 0))])
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[01-03]")
    assert slurm_job.main(["prepare", str(tmp_path)]) == 0
    _, spec = read_run(str(tmp_path))
    assert stat.S_IMODE(os.stat(tmp_path / "spec.json").st_mode) == 0o600  # it holds the secret
    assert spec.security == before.security and spec.trainer_ports == before.trainer_ports
    assert spec.hosts["controller"] == spec.hosts["gen_server3"] == spec.host == "10.0.0.1"
    assert spec.hosts["trainer0"] == spec.hosts["trainer7"] == "10.0.0.2"
    assert spec.endpoint("trainer7", spec.trainer_ports[7]) == f"tcp://10.0.0.2:{spec.trainer_ports[7]}"
    assert spec.gen_urls[0] == f"http://10.0.0.1:{spec.gen_ports[0]}"
    where = json.loads((tmp_path / "slurm_hosts.json").read_text())
    assert where["trainer3"] == {"node": 1, "hostname": "node02", "address": "10.0.0.2", "devices": [3]}


def test_a_job_with_too_few_nodes_or_an_unresolvable_one_is_named(tmp_path, monkeypatch, capsys):
    partial_run(tmp_path)
    assert slurm_job.main(["prepare", str(tmp_path), "only1"]) == 1
    assert "the placement uses 2 nodes, the job has 1" in capsys.readouterr().err

    def fail(host, *a, **k):
        raise socket.gaierror(-2, "Name or service not known")
    monkeypatch.setattr(socket, "getaddrinfo", fail)
    assert slurm_job.main(["prepare", str(tmp_path), "ghost1", "ghost2"]) == 1
    assert "the job's node 'ghost1' does not resolve" in capsys.readouterr().err


def test_a_step_gets_its_command_and_devices_in_the_job(tmp_path, monkeypatch):
    partial_run(tmp_path)
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: [(0, 0, 0, "", ("10.0.0." + host[-1], 0))])
    slurm_job.prepare(str(tmp_path), ["n1", "n2"])
    argv, env, cores = slurm_job.step_command(str(tmp_path), "gen_server1", (2, 3), [],
                                              {"CUDA_VISIBLE_DEVICES": "8,9,10,11,12,13,14,15"})
    assert env["CUDA_VISIBLE_DEVICES"] == "10,11"  # the node's 3rd and 4th GPU, as Slurm names them
    assert "--tp-size" in argv and argv[argv.index("--host") + 1] == "10.0.0.1"
    assert argv[argv.index("--port") + 1] == "29601" and env["AREAL_FLOW_PROC"] == "gen_server1"
    assert "--api-key" in argv  # secured, as every Slurm run is
    argv, env, _ = slurm_job.step_command(str(tmp_path), "controller", (), [], {})
    assert argv[-4:] == ["controller", "controller", "0", str(tmp_path)] and "CUDA_VISIBLE_DEVICES" not in env
    argv, env, _ = slurm_job.step_command(str(tmp_path), "trainers-node1", tuple(range(8)), ["torchrun", "x"], {})
    assert argv == ["torchrun", "x"] and env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    with pytest.raises(slurm_job.SlurmJobError, match="no process 'gen_server9'"):
        slurm_job.step_command(str(tmp_path), "gen_server9", (), [], {})


FAKE_SRUN = """#!/bin/bash
# A stand-in for srun: reads the options it is given, runs the step here, logs where --output says.
out=/dev/null
while [[ $1 == --* ]]; do
  case $1 in --output=*) out=${1#--output=};; esac
  shift
done
name=$(basename "$out" .log)
trap 'kill "$child" 2>/dev/null; echo stopped >> "$out"; exit 143' TERM
case "$FAIL:$name" in
  "$name:$name") sleep 0.5; echo "step $name fails" >> "$out"; exit 3;;
esac
if [[ $name == controller && $FAIL == none ]]; then sleep 0.5; exit 0; fi
sleep 30 >/dev/null 2>&1 &
child=$!
wait
"""


@pytest.mark.slow  # seconds of waiting on a timeout or a process: the full suite runs it
@pytest.mark.parametrize("fail,code", [("gen_server1", 3), ("none", 0)])
def test_the_job_stops_every_step_when_one_fails_and_exits_with_its_code(tmp_path, fail, code):
    _, cfg, placement = config(2, 8, "sglang:d4t2 + megatron:d2p2t2")
    cfg.launcher.stop_timeout = 5
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", "#!/bin/bash\nprintf 'n1\\nn2\\n'\n"),
                       ("python", "#!/bin/bash\nexit 0\n")):  # prepare: done elsewhere in these tests
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    (tmp_path / "job.sbatch").write_text(sbatch_script(cfg, placement, str(run_dir), python=str(bin_dir / "python")))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n[1-2]", "FAIL": fail}
    env.pop("SLURM_JOB_ID", None)  # not in a job: the script signals the steps' sruns itself
    start = time.monotonic()
    r = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == code, r.stderr
    assert time.monotonic() - start < 20  # the others were stopped, not waited for
    stopped = [p.stem for p in (run_dir / "logs").glob("*.log") if "stopped" in p.read_text()]
    assert "trainers-node1" in stopped and "rollout0" in stopped
    if fail != "none":
        node = next(p.node for p in placement.procs if p.name == fail)
        assert f"process '{fail}' on node {node} (n{node + 1}, ) exited with code 3; its log is " \
               f"{run_dir}/logs/{fail}.log" in r.stderr
        assert fail not in stopped
    else:
        assert "controller" not in stopped and "exited with code" not in r.stderr


def test_a_trainer_started_by_torchrun_takes_its_rank_from_the_environment(monkeypatch):
    from areal_flow.runtime.child import torchrun_rank
    from areal_flow.training.build import process_group_init

    spec = RunSpec(run_dir="/r", model_path="/m", train_path="/t", eval_path="/e", gen_ports=[1], controller_port=2,
                   rollout_ports=[3], trainer_ports=[4, 5, 6], dist_port=7, n_trainers=3, n_rollout=1,
                   hosts={"trainer0": "10.0.0.2"})
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    assert torchrun_rank() is None  # the local and Ray launchers: the command line's rank
    assert process_group_init(spec, 1) == {"init_method": "tcp://10.0.0.2:7", "rank": 1, "world_size": 3}
    for key, value in (("RANK", "2"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "3"), ("MASTER_ADDR", "n2"),
                       ("MASTER_PORT", "29614")):
        monkeypatch.setenv(key, value)
    assert torchrun_rank() == 2
    assert process_group_init(spec, 2) == {"init_method": "env://", "rank": 2, "world_size": 3}
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match="torchrun started rank 2 of 4, but the run spec has 3 trainer ranks"):
        process_group_init(spec, 2)


@pytest.mark.slow  # processes of its own: the full suite runs it, the fast tier does not
def test_torchrun_ranks_join_one_gloo_group_and_log_under_their_names(tmp_path):
    """Two real processes under torchrun: each takes its rank from the environment and the child
    entrypoint's rule, and they meet in one gloo group through env://."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, sys, torch, torch.distributed as dist\n"
        "from areal_flow.runtime.child import torchrun_rank\n"
        "from areal_flow.runtime.spec import RunSpec\n"
        "from areal_flow.training.build import process_group_init\n"
        "rank = torchrun_rank()\n"
        "spec = RunSpec(run_dir='/r', model_path='/m', train_path='/t', eval_path='/e', gen_ports=[], controller_port=1,\n"
        "               rollout_ports=[], trainer_ports=[2, 3], dist_port=4, n_trainers=2, n_rollout=0)\n"
        "dist.init_process_group('gloo', **process_group_init(spec, rank))\n"
        "t = torch.tensor([rank + 1.0]); dist.all_reduce(t)\n"
        f"open(os.path.join({str(tmp_path)!r}, f'rank{{rank}}'), 'w').write(str(t.item()))\n"
        "dist.destroy_process_group()\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
                        "--master_addr=127.0.0.1", f"--master_port={port}", str(probe)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "rank0").read_text() == (tmp_path / "rank1").read_text() == "3.0"


def launch(*args: str, cwd: Path, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"PATH": path} if path is not None else {})}
    return subprocess.run([sys.executable, "-m", "areal_flow.launch", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_without_sbatch_a_slurm_run_fails_at_start_and_makes_nothing(tmp_path):
    r = launch("launcher.type=slurm", f"output_dir={tmp_path}/run", f"cache_dir={tmp_path}/cache", cwd=tmp_path,
               path=os.path.dirname(sys.executable))  # no sbatch there
    assert r.returncode == 2
    assert "launcher.type=slurm submits the run with sbatch, which is not on PATH" in r.stdout
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_a_slurm_dry_run_prints_the_script_and_submits_nothing(tmp_path):
    r = launch("recipe=tiny_arith_megatron", "cluster.device_type=cuda", "cluster.n_nodes=2", "cluster.n_devices=8",
               "allocation=sglang:d4t2 + megatron:d2p2t2", "launcher.type=slurm", "dry_run=true",
               f"output_dir={tmp_path}/run", cwd=tmp_path, path=os.path.dirname(sys.executable))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "placement on 2 nodes:" in r.stdout and "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1" in r.stdout
    assert "--nnodes=1 --node_rank=0 --nproc_per_node=8" in r.stdout and f"RUN_DIR={tmp_path}/run" in r.stdout
    assert not (tmp_path / "run").exists()


def fake_slurm(tmp_path: Path, monkeypatch, scontrol: str) -> Path:
    """Stand-ins for scontrol (printing `scontrol`) and scancel (noting its arguments) on PATH."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "scontrol").write_text(f"#!/bin/bash\nprintf '%s\\n' {shlex.quote(scontrol)}\n")
    (bin_dir / "scancel").write_text(f"#!/bin/bash\necho \"$@\" >> {bin_dir}/scancelled\n")
    for name in ("scontrol", "scancel"):
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return bin_dir


def test_a_node_is_reached_at_the_address_slurm_reaches_it_at(tmp_path, monkeypatch):
    """slurm.conf's NodeAddr, where it names one: node names that resolve nowhere (n1, n2) are
    reached as Slurm reaches them."""
    fake_slurm(tmp_path, monkeypatch, "NodeName=n2 Arch=x86_64 NodeAddr=10.9.0.2 NodeHostName=localhost")
    assert slurm_job.node_address("n2") == "10.9.0.2"
    fake_slurm(tmp_path / "same", monkeypatch, "NodeName=localhost NodeAddr=localhost State=IDLE")
    assert slurm_job.slurm_node_addr("localhost") is None  # the name itself: resolved as before


@pytest.mark.parametrize("said,named", [
    ("sbatch: error: invalid partition specified: gpu\nsbatch: error: Batch job submission failed: Invalid partition "
     "name specified", "the partition does not exist: launcher.slurm_partition=gpu"),
    ("sbatch: error: Invalid --time specification", "launcher.slurm_time=4:00:00"),
    ("sbatch: error: Batch job submission failed: Requested node configuration is not available",
     "cluster.n_nodes=2 and cluster.n_devices=8 (GPUs a node, cluster.device_type=cuda)"),
    ("sbatch: error: Invalid generic resource (gres) specification", "cluster.n_devices=8 (GPUs a node"),
    ("sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified",
     "launcher.slurm_account=proj"),
    ("sbatch: error: something new", "check launcher.slurm_* and cluster.* (docs/clusters.md)"),
])
def test_what_sbatch_rejects_is_said_in_one_line_naming_the_setting(said, named):
    from areal_flow.launchers.slurm_refusals import rejected

    _, cfg, _ = config(2, 8, "sglang:d4t2 + megatron:d2p2t2", slurm_partition="gpu", slurm_account="proj",
                       slurm_time="4:00:00")
    line = rejected(cfg, said)
    assert named in line and "\n" not in line and line.startswith("Slurm refused the job (")


def test_a_job_that_would_pend_forever_is_cancelled_and_named(tmp_path, monkeypatch):
    from areal_flow.launchers.slurm_refusals import pending_forever

    _, cfg, _ = config(2, 8, "sglang:d4t2 + megatron:d2p2t2", slurm_time="9-00:00:00")
    bin_dir = fake_slurm(tmp_path, monkeypatch, "JobId=42 JobState=PENDING Reason=PartitionTimeLimit Partition=gpu")
    line = pending_forever(cfg, "42", settle=0.1)
    assert line == ("Slurm will not run job 42 (pending: PartitionTimeLimit, cancelled): it asks partition gpu for a "
                    "longer time limit than the partition allows: launcher.slurm_time=9-00:00:00")
    assert (bin_dir / "scancelled").read_text() == "42\n"
    # Waiting its turn (Resources), or running: nothing to say, nothing cancelled.
    for shown in ("JobId=43 JobState=PENDING Reason=Resources Partition=gpu", "JobId=44 JobState=RUNNING Reason=None"):
        bin_dir = fake_slurm(tmp_path / shown.split()[0], monkeypatch, shown)
        assert pending_forever(cfg, "43", settle=0.1) is None and not (bin_dir / "scancelled").exists()


def test_a_requeued_job_goes_on_from_the_newest_checkpoint_or_the_start(tmp_path, monkeypatch, capsys):
    partial_run(tmp_path)
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: [(0, 0, 0, "", ("10.0.0." + host[-1], 0))])
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    slurm_job.prepare(str(tmp_path), ["n1", "n2"])
    assert "requeued" not in capsys.readouterr().err
    (tmp_path / "ledger.jsonl").write_text('{"event": "admit"}\n')
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    slurm_job.prepare(str(tmp_path), ["n1", "n2"])
    assert "the job was requeued (start 2): the run goes on from the start: it holds no complete checkpoint" in \
        capsys.readouterr().err
    assert read_run(str(tmp_path))[1].resume == ""
    assert (tmp_path / "ledger.jsonl").read_text() == ""  # rewound to the start: a new run's ledger
