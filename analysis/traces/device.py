"""One rank's GPU trace: a step on the device timeline.

Kernels are put in the step whose host call launched them (the profiler's correlation id joins
a kernel to its ``cudaLaunchKernel``), and take the kinds of the host ranges around that call
(``lm_head``, ``optimizer``, attention's operators...) beside their own name's. A step's window
runs from its first kernel to the next step's first kernel (the last step: to its last kernel's
end); each instant of it goes to exactly one category, so the categories add up to the window.
"""

from __future__ import annotations

from analysis.traces.host import Event, Host, StepTime, category_of, gemm_seen, overlap
from analysis.traces.rules import DEVICE, fp8_named, kinds_of

_RUNTIME_CATS = ("cuda_runtime", "cuda_driver", "runtime")
#: When compute kernels of several categories run at once (several streams), the instant goes to
#: the first of them in this order.
COMPUTE_ORDER = (
    "fp8_matmul",
    "bf16_matmul",
    "attention",
    "fp8_cast",
    "loss",
    "optimizer",
    "data_wait",
    "other",
)

Interval = tuple[float, float, str]


def _launches(events: list[dict]) -> dict[object, tuple[object, float]]:
    """correlation id -> (host thread, time) of the runtime call that launched the work."""
    found = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in _RUNTIME_CATS:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                found[corr] = (e.get("tid"), float(e["ts"]))
    return found


def _classify(
    host: Host, steps, kernels, events
) -> tuple[dict[int, list[Interval]], dict[int, StepTime]]:
    """Each step's device work as (start, end, category); GEMMs counted on the step."""
    launches = _launches(events)
    by_step: dict[int, list[Interval]] = {k: [] for k, _ in steps}
    results: dict[int, StepTime] = {k: StepTime(k, 0.0, {}) for k, _ in steps}
    spans = [(k, ev.ts, ev.end) for k, ev in steps]
    for e in kernels:
        launch = launches.get((e.get("args") or {}).get("correlation"))
        if launch is None:
            continue
        step = next((k for k, lo, hi in spans if lo <= launch[1] < hi), None)
        if step is None:
            continue
        caller = host.innermost(*launch)
        own = kinds_of(e["name"], DEVICE) if e.get("cat") == "kernel" else frozenset()
        if caller is not None and "outside_step" in caller.chain:
            continue  # validation, a checkpoint save: not the step's work
        chain = own | (caller.chain if caller else frozenset())
        category = category_of(chain)
        ts = float(e["ts"])
        end = ts + float(e.get("dur", 0))
        by_step[step].append((ts, end, category))
        results[step].count_forward(chain, category, end - ts)
        if "gemm" in own:  # not the workspace memsets a GEMM operator also launches
            gemm_seen(results[step], category, e["name"], end - ts, fp8_named(e["name"]))
    return by_step, results


def device_steps(
    host: Host, tid: object, steps: list[tuple[int, Event]], kernels, events
) -> list[StepTime]:
    """Each profiled step's window on the device, cut into categories."""
    by_step, results = _classify(host, steps, kernels, events)
    waits = [(ev.ts, ev.end) for ev in host.by_tid.get(tid, []) if ev.name == "data_wait"]
    outside = [(ev.ts, ev.end) for ev in host.by_tid.get(tid, []) if ev.name == "outside_step"]
    numbers = [k for k, _ in steps if by_step[k]]
    out = []
    for i, k in enumerate(numbers):
        lo = min(ts for ts, _, _ in by_step[k])
        hi = (
            min(ts for ts, _, _ in by_step[numbers[i + 1]])
            if i + 1 < len(numbers)
            else max(end for _, end, _ in by_step[k])
        )
        result = results[k]
        result.ms, overlapped = sweep(by_step[k], lo, hi, waits, outside)
        result.total_ms = sum(result.ms.values())
        result.overlapped_comm_ms = overlapped / 1000.0
        out.append(result)
    return out


def sweep(
    items: list[Interval],
    lo: float,
    hi: float,
    waits: list[tuple[float, float]],
    outside: list[tuple[float, float]] = (),
) -> tuple[dict[str, float], float]:
    """Milliseconds per category over [lo, hi) and the microseconds collectives ran beside
    compute. Every instant is counted once, except idle time while the host was ``outside``
    the step (validation, a checkpoint save), which is no part of it."""
    points = []
    for ts, end, category in items:
        ts, end = max(ts, lo), min(end, hi)
        if end > ts:
            points += [(ts, 1, category), (end, -1, category)]
    points.sort(key=lambda p: (p[0], p[1]))
    active: dict[str, int] = {}
    ms: dict[str, float] = {}
    overlapped = 0.0
    t = lo

    def attribute(a: float, b: float) -> None:
        nonlocal overlapped
        compute = [c for c, n in active.items() if n > 0 and c != "comm_exposed"]
        comm = active.get("comm_exposed", 0) > 0
        if compute:
            key = min(compute, key=lambda c: COMPUTE_ORDER.index(c) if c in COMPUTE_ORDER else 99)
            ms[key] = ms.get(key, 0.0) + (b - a) / 1000.0
            overlapped += (b - a) if comm else 0.0
        elif comm:
            ms["comm_exposed"] = ms.get("comm_exposed", 0.0) + (b - a) / 1000.0
        else:
            away = overlap(a, b, outside)
            waited = min(overlap(a, b, waits), b - a - away)
            ms["data_wait"] = ms.get("data_wait", 0.0) + waited / 1000.0
            ms["idle"] = ms.get("idle", 0.0) + (b - a - away - waited) / 1000.0

    for time, delta, category in points:
        if time > t:
            attribute(t, time)
            t = time
        active[category] = active.get(category, 0) + delta
    if hi > t:
        attribute(t, hi)
    return ms, overlapped
