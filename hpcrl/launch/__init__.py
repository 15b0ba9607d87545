"""Starting jobs: `hpcrl run` on this machine (local.py) and `hpcrl submit` / `hpcrl status` on Slurm.

- local.py      mpiexec on this machine; prepare_run_dir / runtime_command, shared with the Slurm path
- sbatch.py     templates/job.sbatch.j2 -> the batch script (quoting rules, the per-node rank layout)
- sweep.py      a job's `sweep:` block -> the combinations of one job array
- slurm.py      submit(): validate, plan, render, write the run directory, sbatch; SubmittedJob handles
- scheduler.py  what Slurm knows about a job (scontrol, sacct) or, failing that, the run's own files
- status.py     `hpcrl status`

Nothing here imports torch: planning and submitting run on a login node.
"""
