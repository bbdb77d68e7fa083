"""Runs read back beside the training (comparison, parity, step breakdown, profiler traces)."""
