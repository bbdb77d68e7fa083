"""`make demo`'s choices on this CPU: fp32 where the CPU has no bf16 units (FP8 still
emulated), its labels and title saying what ran. (The demo itself runs end to end in
tests/integration/test_demo_processes.py.)"""

from __future__ import annotations

from scripts import demo


def test_without_bf16_units_both_runs_compute_in_fp32_and_say_so() -> None:
    plan = demo.Demo("fp32")
    assert plan.flags == ["--bf16=0"]
    assert plan.labels == "fp32,fp8 (emulated in fp32)"
    assert "fp32 compute" in plan.title
    line = plan.line()
    assert line.startswith("make demo: this CPU has no bf16 units") and "\n" not in line
    assert "both runs compute in fp32, FP8 still emulated" in line


def test_with_bf16_units_the_demo_is_unchanged() -> None:
    plan = demo.Demo("bf16")
    assert plan.flags == []
    assert plan.labels == "bf16,fp8 (emulated in bf16)"
    assert plan.line() == "make demo: this CPU has bf16 units: both runs compute in bf16"


def test_auto_follows_the_cpu(monkeypatch) -> None:
    monkeypatch.setattr(demo, "cpu_computes_bf16", lambda: False)
    assert demo.computes_bf16() is False
    monkeypatch.setattr(demo, "cpu_computes_bf16", lambda: None)  # no /proc/cpuinfo: probe
    monkeypatch.setattr(demo, "probe_native_bf16", lambda: True)
    assert demo.computes_bf16() is True
