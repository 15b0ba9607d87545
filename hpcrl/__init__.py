"""hpcrl: reinforcement learning for LLMs as plain Slurm + MPI batch jobs."""
__version__ = "0.1.0"
