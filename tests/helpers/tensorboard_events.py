"""A run's TensorBoard events, read back by TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def read_events(log_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def series(events: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in events.Scalars(tag)}


def flags_text(events: EventAccumulator) -> str:
    (event,) = events.Tensors("flags/text_summary")
    return event.tensor_proto.string_val[0].decode()
