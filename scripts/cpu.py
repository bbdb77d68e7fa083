"""Whether this host's CPU computes bf16 natively, read from /proc/cpuinfo's flags. Standard
library only: the launcher (scripts/launch_plan.py loads it from its file) and `make demo` ask
it before torch is imported.

Why it matters: where the CPU has no bf16 units (AVX2-only x86, many laptops and cloud VMs),
PyTorch's bf16 matmuls are 20-60x slower than fp32 ones (a whole run 20-30x), so a CPU run in
bf16 (the recipe's default) takes an hour where fp32 takes minutes; FP8 emulation works around
either dtype.
"""

from __future__ import annotations

from pathlib import Path

#: /proc/cpuinfo flags of bf16 units: x86's AVX512-BF16 and AMX-BF16 ("flags"), Arm's BF16
#: extension ("Features").
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
CPUINFO = Path("/proc/cpuinfo")


def native_bf16(cpuinfo: str) -> bool:
    """Whether a /proc/cpuinfo text names a bf16 unit on any of its flag lines."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features") and BF16_CPU_FLAGS & set(value.split()):
            return True
    return False


def cpu_computes_bf16(cpuinfo: Path = CPUINFO) -> bool | None:
    """This host's answer (None: no /proc/cpuinfo to read, e.g. macOS)."""
    try:
        return native_bf16(cpuinfo.read_text())
    except OSError:
        return None


def slow_bf16_line() -> str:
    """What a CPU run without bf16 units is told (the demo and the local launcher)."""
    return (
        "this CPU has no bf16 units (no avx512_bf16/amx_bf16 in /proc/cpuinfo): bf16 runs "
        "20-30x slower than fp32 here"
    )
