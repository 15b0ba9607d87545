"""hpcrl: reinforcement learning for LLMs as plain Slurm + MPI batch jobs."""
__version__ = "0.1.0"


def submit(job_path, cluster_path, overrides=(), dry_run=False, chain=1, **kwargs):
    """Submit a job to Slurm as `hpcrl submit` does; returns a list of `SubmittedJob` handles
    (`.job_id`, `.run_dir`, `.state()`, `.wait(timeout)`), one per job or array task.

    Imported lazily: `import hpcrl` stays free of the launcher (and of Jinja2 and submitit).
    See hpcrl.launch.slurm.submit for the keyword arguments (run_dir, env, cwd).
    """
    from hpcrl.launch.slurm import submit as _submit

    return _submit(job_path, cluster_path, overrides, dry_run=dry_run, chain=chain, **kwargs)
