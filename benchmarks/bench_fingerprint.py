"""What the data fingerprint costs a run's start-up and resume, on one large file.

    .venv/bin/python -m benchmarks.bench_fingerprint                # a 1 GiB file in /tmp
    .venv/bin/python -m benchmarks.bench_fingerprint --gib 4 --dir /fsx/tmp

Times, on one file of random bytes (page cache dropped where the system lets this user, else
warm: the line says which), the fingerprint as recorded before the sampled blocks (the first
and last 64 KiB), as recorded now (plus FINGERPRINT_SAMPLES blocks spread evenly between them),
and a sha256 of the whole file, the cost of catching every edit. Median of --repeats.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks._common import COUNT, FOLDER, SIZE
from model_utils.data import checks
from model_utils.errors import OneLineParser


def whole_file(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def drop_cache(path: Path) -> bool:
    """Ask the kernel to forget the file's pages (posix_fadvise DONTNEED); whether it could."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return True
    except (OSError, AttributeError):
        return False


def timed(fn, path: Path, repeats: int) -> tuple[float, bool]:
    times, cold = [], True
    for _ in range(repeats):
        cold = drop_cache(path) and cold
        start = time.perf_counter()
        fn(path)
        times.append(time.perf_counter() - start)
    return statistics.median(times), cold


def main() -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=SIZE, default=1.0, help="size of the test file")
    parser.add_argument("--dir", type=FOLDER, default=tempfile.gettempdir(), help="written there")
    parser.add_argument("--repeats", type=COUNT, default=3)
    args = parser.parse_args()
    path = Path(args.dir) / f"bench-fingerprint-{os.getpid()}.bin"
    try:
        with open(path, "wb") as fh:
            for _ in range(int(args.gib * 1024)):
                fh.write(os.urandom(2**20))
        rows = [
            ("ends only (before)", lambda p: checks.file_fingerprint(p, samples=0)),
            (f"ends + {checks.FINGERPRINT_SAMPLES} samples (now)", checks.file_fingerprint),
            ("whole-file sha256", whole_file),
        ]
        print(f"one {args.gib:g} GiB file in {args.dir}, median of {args.repeats}")
        print("| fingerprint | bytes read | seconds | page cache |")
        print("|---|---:|---:|---|")
        for name, fn in rows:
            seconds, cold = timed(fn, path, args.repeats)
            blocks = {0: 2, 1: 2 + checks.FINGERPRINT_SAMPLES, 2: None}[rows.index((name, fn))]
            read = "all" if blocks is None else f"{blocks * checks.FINGERPRINT_BYTES // 1024} KiB"
            print(f"| {name} | {read} | {seconds:.4f} | {'dropped' if cold else 'warm'} |")
    finally:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
