"""The slow rank, named: at report steps every rank's busy time and data wait for the window are
gathered (one all-gather of two numbers per rank), and a rank more than ``--slow_rank_threshold``
times the median is named in a W line, with its node.

Why *busy* time and not the window's wall time: FSDP's collectives hold every rank in lock-step,
so all ranks see the same wall time per step, the slow one's. What differs is what each rank
did with it: the slow one worked (or waited for a core) while the others slept in collectives.
So a rank's busy time is its main thread's CPU time plus its time queued for a core (Linux
``/proc/thread-self/schedstat``; ``time.thread_time`` elsewhere). That names a rank whose host
is slow: a CPU shared with another job, a throttled core, slow data loading (which shows in its
data wait too). A slow GPU under a fast host is not seen by it: the host thread spins in the
device sync on every rank alike (docs/hangs.md).
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_SCHEDSTAT = Path("/proc/thread-self/schedstat")


def busy_seconds() -> float:
    """The calling thread's CPU time plus its time runnable but waiting for a core."""
    try:
        run_ns, wait_ns = _SCHEDSTAT.read_text().split()[:2]
    except (OSError, ValueError):  # no schedstat (not Linux, or a kernel without it)
        return time.thread_time()
    return (int(run_ns) + int(wait_ns)) / 1e9


@dataclass(frozen=True)
class SlowRank:
    """The slowest rank of one report window, and how it compares with the median rank."""

    rank: int
    host: str
    step_seconds: float  # its busy seconds per step
    median_seconds: float  # the ranks' median busy seconds per step
    data_wait_seconds: float  # its data wait per step
    named: bool  # over the threshold: the W line is logged

    @property
    def ratio(self) -> float:
        return self.step_seconds / self.median_seconds if self.median_seconds > 0 else 1.0


def slowest(
    busy: Sequence[float], waits: Sequence[float], hosts: Sequence[str], threshold: float
) -> SlowRank:
    """The rank with the most busy time, named when it exceeds ``threshold`` x the median
    (``busy``, ``waits``: seconds per step, one per rank)."""
    rank = max(range(len(busy)), key=lambda r: busy[r])
    median = statistics.median(busy)
    over = threshold > 0 and busy[rank] > threshold * median
    return SlowRank(rank, hosts[rank], busy[rank], median, waits[rank], over)


def slow_rank_line(step: int, window_steps: int, slow: SlowRank) -> str:
    """The W line: rank, node, by how much, and its data wait (a slow reader shows there)."""
    first = step - window_steps + 1
    return (
        f"slow rank: rank {slow.rank} on {slow.host} was busy {slow.step_seconds:.3f} s a step "
        f"over steps {first}-{step}, {slow.ratio:.2f}x the median rank's "
        f"{slow.median_seconds:.3f} s (its data wait {slow.data_wait_seconds:.3f} s a step)"
    )


def record_fields(slow: SlowRank) -> dict[str, Any]:
    """What a train record of metrics.jsonl carries about the window's slowest rank (every
    report: a tracker can chart the ratio; ``slow_rank_named`` marks the W lines)."""
    return {
        "slowest_rank": slow.rank,
        "slowest_rank_host": slow.host,
        "slowest_rank_ratio": slow.ratio,
        "slowest_rank_data_wait_seconds": slow.data_wait_seconds,
        "slow_rank_named": slow.named,
    }


def most_often_slow(records: Iterable[Mapping[str, Any]]) -> list[tuple[int, str, int]]:
    """(rank, host, reports it was named in), most often first, from train records (a resumed
    run's re-logged steps count once, as last logged)."""
    latest = {r["step"]: r for r in records if r.get("kind") == "train"}
    named = Counter(
        (r["slowest_rank"], r.get("slowest_rank_host", "?"))
        for r in latest.values()
        if r.get("slow_rank_named")
    )
    return [(rank, host, count) for (rank, host), count in named.most_common()]


def summary_line(records: Iterable[Mapping[str, Any]], limit: int = 4) -> str | None:
    """The summary's line of the ranks named slow most often; None if none ever was."""
    ranked = most_often_slow(records)
    if not ranked:
        return None
    shown = ", ".join(f"rank {r} on {h} ({n}x)" for r, h, n in ranked[:limit])
    more = f" and {len(ranked) - limit} more" if len(ranked) > limit else ""
    return f"  slow ranks (reports naming them)  {shown}{more}"


class RankTimes:
    """Each rank's busy time and data wait since the previous report, gathered at the next.

    Work outside the training window (validation, checkpoint saves) is left out with
    :meth:`paused`, as the step meter leaves it out of the window's time."""

    def __init__(self, world_size: int, device: torch.device, threshold: float) -> None:
        self.world_size, self.device, self.threshold = world_size, device, threshold
        self.enabled = world_size > 1 and dist.is_initialized()
        self.hosts = [socket.gethostname()]
        if self.enabled:  # once, at start-up: the names never travel again
            self.hosts = [""] * world_size
            dist.all_gather_object(self.hosts, socket.gethostname())
        self._start = busy_seconds()
        self._excluded = self._data_wait = 0.0
        self._steps = 0

    def add_step(self, data_wait_seconds: float) -> None:
        self._data_wait += data_wait_seconds
        self._steps += 1

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        begin = busy_seconds()
        try:
            yield
        finally:
            self._excluded += busy_seconds() - begin

    def gather(self) -> SlowRank | None:
        """Every rank calls it at the same steps: the window's slowest rank (None if one rank,
        or no step since the last report)."""
        if not self.enabled or self._steps == 0:
            return None
        busy = busy_seconds()
        mine = (busy - self._start - self._excluded) / self._steps, self._data_wait / self._steps
        local = torch.tensor(mine, dtype=torch.float64, device=self.device)
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        values = torch.stack(gathered).tolist()
        self._start, self._excluded, self._data_wait, self._steps = busy, 0.0, 0.0, 0
        return slowest([v[0] for v in values], [v[1] for v in values], self.hosts, self.threshold)
