"""Profiler traces read back: host and device timelines, what each event is, ms per category."""
