"""One rank's trace, host side: its operators and ranges nested per thread, each with the kinds
(``rules``) it and its ancestors matched, and a CPU trace's step cut into categories.

On a CPU trace the host *is* the device: the main thread's time is cut into each operator's or
range's own (exclusive) time, and each piece takes the category of the event and its ancestors
(``rules.PRECEDENCE``); the gaps between operators (Python) are "other". A backward
operator inherits ``lm_head`` and attention from the forward operator the profiler links it to
(its ``fwdbwd`` flow), so ``lm_head``'s weight-gradient GEMM under ``--chunked_loss=0`` is
counted where it belongs. The GPU side is ``device.py``; ``breakdown.py`` joins them.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from analysis.traces.rules import HOST, PRECEDENCE, fp8_named, kinds_of

_KIND_CATEGORY = {
    "collective": "comm_exposed",
    "data_wait": "data_wait",
    "attention": "attention",
    "fp8_cast": "fp8_cast",
    "optimizer": "optimizer",
    "lm_head": "loss",
}
#: Kinds a backward operator takes over from the forward operator it is linked to.
_INHERITED_BY_BACKWARD = frozenset({"lm_head", "attention"})
_HOST_CATS = ("cpu_op", "user_annotation")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")


def category_of(kinds: frozenset[str]) -> str:
    """The category of an event whose own and inherited rule matches are ``kinds``."""
    for kind in PRECEDENCE:
        if kind in kinds:
            if kind == "gemm":
                return "bf16_matmul" if "lm_head" in kinds else "fp8_matmul"
            return _KIND_CATEGORY[kind]
    return "other"


@dataclass
class Event:
    name: str
    ts: float  # microseconds, as the trace has them
    end: float
    tid: object
    kinds: frozenset[str]
    parent: Event | None = None
    chain: frozenset[str] = frozenset()  # own kinds, inherited ones and the ancestors'
    children_us: float = 0.0


@dataclass
class StepTime:
    """One step of one rank: milliseconds per category (their sum is ``total_ms``)."""

    step: int
    total_ms: float
    ms: dict[str, float]
    overlapped_comm_ms: float = 0.0
    fp8_gemm_ms: float = 0.0  # GEMM time whose kernel name (or torchao's function) says FP8
    #: "category<TAB>GEMM kernel or operator name" -> ms: which GEMMs landed in which share
    gemm_names: dict[str, float] = field(default_factory=dict)
    forward_ms: float = 0.0  # compute inside the forward range; the rest of it is backward's

    def count_forward(self, chain: frozenset[str], category: str, us: float) -> None:
        if "forward" in chain and category not in ("comm_exposed", "data_wait"):
            self.forward_ms += us / 1000.0


def load(path: Path) -> dict:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    if not isinstance(trace, dict):  # Chrome's other form: a bare list of events
        raise ValueError(f"a JSON {type(trace).__name__}, not torch.profiler's object")
    return trace


class Host:
    """The host's operators and ranges per thread, nested, with their inherited kinds."""

    def __init__(self, events: list[dict]) -> None:
        self.by_tid: dict[object, list[Event]] = {}
        for e in events:
            if e.get("ph") == "X" and e.get("cat") in _HOST_CATS:
                ts = float(e["ts"])
                ev = Event(e["name"], ts, ts + float(e.get("dur", 0)), e.get("tid"), frozenset())
                ev.kinds = kinds_of(ev.name, HOST)
                self.by_tid.setdefault(ev.tid, []).append(ev)
        for evs in self.by_tid.values():
            evs.sort(key=lambda ev: (ev.ts, -ev.end))
            self._nest(evs)
        self.starts = {tid: [ev.ts for ev in evs] for tid, evs in self.by_tid.items()}
        self._chains({})
        self._chains(self._backward_links(events))

    @staticmethod
    def _nest(evs: list[Event]) -> None:
        stack: list[Event] = []
        for ev in evs:
            while stack and stack[-1].end < ev.ts + 1e-3:
                stack.pop()
            if stack:
                ev.parent = stack[-1]
                ev.end = min(ev.end, ev.parent.end)
                ev.parent.children_us += ev.end - ev.ts
            stack.append(ev)

    def _chains(self, extra: dict[int, frozenset[str]]) -> None:
        for evs in self.by_tid.values():
            for ev in evs:  # parents come before their children in this order
                above = ev.parent.chain if ev.parent else frozenset()
                ev.chain = ev.kinds | extra.get(id(ev), frozenset()) | above

    def innermost(self, tid: object, ts: float) -> Event | None:
        """The innermost host event of thread ``tid`` running at ``ts``."""
        evs = self.by_tid.get(tid)
        if not evs or self.starts[tid][0] > ts:
            return None
        ev = evs[bisect.bisect_right(self.starts[tid], ts) - 1]
        while ev is not None and ev.end < ts:
            ev = ev.parent
        return ev

    def _backward_links(self, events: list[dict]) -> dict[int, frozenset[str]]:
        """Backward operator -> kinds it inherits from its forward operator (fwdbwd flows)."""
        starts, finishes = {}, {}
        for e in events:
            if e.get("cat") == "fwdbwd" and e.get("ph") in ("s", "f"):
                (starts if e["ph"] == "s" else finishes)[e["id"]] = e
        extra: dict[int, frozenset[str]] = {}
        for flow_id, f in finishes.items():
            s = starts.get(flow_id)
            if s is None:
                continue
            forward = self.innermost(s.get("tid"), float(s["ts"]))
            backward = self.innermost(f.get("tid"), float(f["ts"]))
            if forward is not None and backward is not None:
                inherited = forward.chain & _INHERITED_BY_BACKWARD
                if inherited:
                    extra[id(backward)] = extra.get(id(backward), frozenset()) | inherited
        return extra

    def steps(self) -> tuple[object, list[tuple[int, Event]]]:
        """The main thread and its profiled steps: ProfilerStep ranges that hold a forward."""
        for tid, evs in self.by_tid.items():
            found = [(int(m[1]), ev) for ev in evs if (m := _STEP.match(ev.name))]
            if found:
                forwards = [ev for ev in evs if ev.name == "forward"]
                kept = [(k, s) for k, s in found if any(s.ts <= f.ts < s.end for f in forwards)]
                return tid, kept
        return None, []


def _add(ms: dict[str, float], category: str, us: float) -> None:
    ms[category] = ms.get(category, 0.0) + us / 1000.0


def host_step(host: Host, tid: object, step: Event, number: int) -> StepTime:
    """A CPU trace's step: each main-thread event's own time in its category."""
    ms: dict[str, float] = {}
    result = StepTime(number, (step.end - step.ts) / 1000.0, ms)
    comm: list[tuple[float, float]] = []
    for ev in host.by_tid[tid]:
        if ev.ts < step.ts or ev.ts >= step.end:
            continue
        if "outside_step" in ev.chain:  # validation, a checkpoint save: not the step's time
            if ev.parent is not None and "outside_step" not in ev.parent.chain:
                result.total_ms -= (ev.end - ev.ts) / 1000.0
            continue
        category = category_of(ev.chain) if ev is not step else "other"
        own = max(0.0, ev.end - ev.ts - ev.children_us)
        _add(ms, category, own)
        result.count_forward(ev.chain, category, own)
        if "gemm" in ev.kinds and "gemm" not in (ev.parent.chain if ev.parent else ()):
            fp8 = fp8_named(ev.name) or "fp8_cast" in ev.chain  # torchao's FP8 matmul function
            gemm_seen(result, category, ev.name, ev.end - ev.ts, fp8)
        if category == "comm_exposed" and "collective" in ev.kinds:
            comm.append((ev.ts, ev.end))
    others = [
        (ev.ts, ev.end)
        for other, evs in host.by_tid.items()
        if other != tid
        for ev in evs
        if "collective" in ev.kinds and ev.parent is None and step.ts <= ev.ts < step.end
    ]
    busy = _union(comm)
    hidden = sum(b - a - overlap(a, b, busy) for a, b in _union(others))
    result.overlapped_comm_ms = hidden / 1000.0
    return result


def gemm_seen(result: StepTime, category: str, name: str, us: float, fp8: bool) -> None:
    """Count one GEMM (an outermost GEMM operator, or a GEMM kernel) by category and name."""
    key = f"{category}\t{name}"
    result.gemm_names[key] = result.gemm_names.get(key, 0.0) + us / 1000.0
    if fp8:
        result.fp8_gemm_ms += us / 1000.0


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def overlap(a: float, b: float, spans: list[tuple[float, float]]) -> float:
    """How long [a, b) overlaps ``spans`` (counted once per span: merge them first)."""
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in spans)
