"""Profiler traces read back (no training process imports it): host and device timelines, the
one table of what a range or kernel is, and the per-category breakdown the scripts print."""
