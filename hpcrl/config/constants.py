"""Constants more than one package needs: the ranks' exit codes (and `hpcrl run`'s) that are not
plain failures, where ranks report how they ended, and sizes the memory estimate shares with the engines."""
EXIT_REQUEUE = 99   # a checkpoint was saved on a warning (USR2/USR1): requeue, and the run resumes from it
EXIT_STOPPED = 98   # stopped on request (TERM/INT: scancel, `hpcrl cancel`, Ctrl-C) after saving a checkpoint
EXIT_REFUSED = 97   # refused to start (the run directory is held, or would be overwritten): nothing to retry
# "1" in a restarted world's environment (a failure's restart by `hpcrl run` or the batch script, a Slurm
# requeue): where no checkpoint was written yet (it failed before the first) it starts over from step 0, as
# --restart does, instead of refusing; its metrics move to metrics.superseded.jsonl. Damaged checkpoints still refuse
AUTOMATIC_RESTART_ENV = "HPCRL_AUTOMATIC_RESTART"
EXIT_HUNG = 96      # a rank stopped answering (hung or dead) and the world was aborted: a failure to restart

RANK_EXITS_DIR = "ranks"   # RUN_DIR/ranks/rank-N.exit.json: how a rank ended, by its supervisor (runtime/supervisor.py)
# RUN_DIR/ranks/refused-<Slurm job id>: the controller refused the start. srun gives the step the exit code of the
# peers the abort killed (137, 143), not 97, so the batch script reads this to know a refusal from a failure.
REFUSED_MARKER = "refused-"
# RUN_DIR/ranks/world-<Slurm job id>: every rank started and MPI joined them (written by the controller). A step that
# fails without it failed to start (an interpreter without hpcrl's packages, an MPI that cannot start under the
# profile's srun --mpi): a setup error that a restart would repeat, so the batch script does not requeue it.
WORLD_MARKER = "world-"
# Elements of the fp32 log-softmax computed at once (engines/batch.py; the memory estimate counts it): 64 MB.
LOGSOFTMAX_CHUNK_ELEMENTS = 1 << 24
