"""The run stage: the step, its guards, the run's log, lock, outputs and metrics."""
