"""Exit code of a run that checkpointed on a signal and must be requeued."""
EXIT_REQUEUE = 99
