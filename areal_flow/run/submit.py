"""`launcher.type=slurm`: write the run directory and the job script, submit it, and leave: the
job runs on its own (launchers/slurm.py, launchers/slurm_job.py)."""

from __future__ import annotations

import os

from omegaconf import DictConfig
from rich.console import Console

from areal_flow.checkpoint import store
from areal_flow.config.schema import RunConfig
from areal_flow.config.validate import ConfigError
from areal_flow.graph.placement import Placement
from areal_flow.launchers.slurm import fixed_ports, sbatch_script, submit
from areal_flow.run.lock import note_slurm_job
from areal_flow.run.ports import spec_with_ports
from areal_flow.run.prepare import Prepared
from areal_flow.run.start import find_resume
from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.security import Security
from areal_flow.runtime.spec import write_run


def submit_slurm(raw: DictConfig, cfg: RunConfig, placement: Placement, prepared: Prepared, console: Console) -> int:
    """Write the run directory (config, spec with the run's secret and ports; the job adds the
    hosts) and the job script, and submit it, from the checkpoint `resume` names when it does (the
    run directory rewound to it here, as the local launcher does). Exit code 0."""
    resume, prepared = find_resume(raw, cfg, prepared, console)
    run_dir = prepared.run_dir
    if any(c.isspace() for c in run_dir):
        # #SBATCH lines are not read by a shell: a path with spaces cannot be quoted there.
        raise ConfigError([f"output_dir={run_dir!r}: launcher.type=slurm needs a run directory without spaces"])
    spec = spec_with_ports(placement, fixed_ports(placement, cfg.launcher.slurm_base_port), run_dir=run_dir,
                           model_path=prepared.model_path, train_path=prepared.train_path,
                           eval_path=prepared.eval_path, judge_models=prepared.judge_models,
                           security=Security.new(),  # a Slurm run spans hosts: always secured (security_needed)
                           resume=resume or "")
    if resume is not None:
        console.print(f"resuming from {resume} (step {store.read_manifest(resume)['step']})", highlight=False)
        store.rewind(run_dir, resume)
    write_run(run_dir, raw, spec)
    os.makedirs(os.path.join(run_dir, rd.LOGS), exist_ok=True)
    script = os.path.join(run_dir, rd.SBATCH)
    with open(script, "w") as f:
        f.write(sbatch_script(cfg, placement, run_dir))
    job_id = submit(script, cfg)
    note_slurm_job(run_dir, job_id)  # a later launch into run_dir waits for the job (run/lock.py)
    console.print(f"run directory: {run_dir}\nsubmitted Slurm job {job_id} ({script})\n"
                  f"  follow it:  squeue -j {job_id}; tail -f {run_dir}/logs/job-{job_id}.log {run_dir}/logs/controller.log\n"
                  f"  stop it:    scancel {job_id}", highlight=False, markup=False)
    return 0
