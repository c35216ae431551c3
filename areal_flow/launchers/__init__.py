"""Starting and watching the processes of a run, and changing them while it goes on.

- `local.py` (`launcher.type=local`): one OS process per role on this machine, restarted or
  stopped when one dies; `ray_cluster.py` (`ray`): the same processes as Ray actors on a cluster's
  nodes; `slurm.py` (`slurm`): one sbatch job, whose steps `slurm_job.py` prepares and starts.
- `commands.py`: each process's command line, whichever launcher starts it.
- `elastic.py`: generation servers added and removed, the trainer resized (`python -m
  areal_flow.scale`); `autoscale.py` asks for those itself from the run's step rows (`elastic.auto`).
- `progress.py`: the progress bar and the summary table the launcher prints.
"""
