"""Process helpers shared by the tests that interrupt a real run."""

from __future__ import annotations

import signal
import subprocess


def signal_after(
    cmd: list[str], sig: signal.Signals, marker: str = "Batch 2 Loss", timeout: float = 120, **popen
) -> tuple[int, str]:
    """Run ``cmd``, send ``sig`` once ``marker`` appears in its output, and wait for the exit.

    Returns (exit status, everything it printed). The process is killed if it outlives
    ``timeout`` or the test fails.
    """
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if marker in line:
                proc.send_signal(sig)
        status = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return status, "".join(seen)
