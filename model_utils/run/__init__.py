"""The run stage: what a training step needs around it: the step, its guards, the hang
watchdog, the run lock, the outputs checked before training, the profiler."""
