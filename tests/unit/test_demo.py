"""`make demo`'s choices on this CPU: fp32 where the CPU has no bf16 units (FP8 still
emulated), its labels and title saying what ran; what it refuses before it removes anything.
(The demo itself runs end to end in tests/integration/test_demo_processes.py.)"""

from __future__ import annotations

import sys

import pytest

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


def test_a_folder_the_demo_did_not_make_is_refused_and_kept(tmp_path, capsys) -> None:
    """A user's folder at --out/NAME was deleted before the runs' flags were even checked."""
    notes = tmp_path / "fp32" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("mine")
    with pytest.raises(SystemExit) as exited:
        demo.main([f"--out={tmp_path}", "--compute=fp32"])
    assert exited.value.code == 2 and notes.read_text() == "mine"
    assert capsys.readouterr().err.splitlines() == [
        f"demo.py: error: --out: {notes.parent} holds what the demo did not write: move it or "
        "pick another --out"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp32"]


def test_a_relative_out_is_the_callers_folder_though_the_runs_start_in_the_checkout(
    tmp_path, capsys, monkeypatch
) -> None:
    """--out mydemo made mydemo/fp8 here while train.py (cwd: the checkout) wrote the checkout's
    mydemo/fp8, and the comparison found no metrics: the runs' folder is absolute now."""
    (tmp_path / "mydemo" / "fp32").mkdir(parents=True)
    (tmp_path / "mydemo" / "fp32" / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        demo.main(["--out=mydemo", "--compute=fp32"])
    assert f"--out: {tmp_path / 'mydemo' / 'fp32'} holds" in capsys.readouterr().err
    commands = []
    monkeypatch.setattr(demo, "problem", lambda run_dir, cmd: commands.append(cmd))
    monkeypatch.setattr(demo, "run", lambda run_dir, cmd: sys.exit(0))
    with pytest.raises(SystemExit):
        demo.main(["--out=mydemo", "--compute=fp32"])
    assert f"--output_dir={tmp_path / 'mydemo' / 'fp32'}" in commands[0]


def test_bad_train_flags_are_one_line_before_any_folder_is_touched(tmp_path, capsys) -> None:
    earlier = tmp_path / "fp8"
    earlier.mkdir()
    (earlier / demo.MARK).touch()  # an earlier demo's run: kept until the flags are good
    with pytest.raises(SystemExit) as exited:
        demo.main([f"--out={tmp_path}", "--compute=fp32", "--steps=0"])
    assert exited.value.code == 2 and (earlier / demo.MARK).exists()
    assert capsys.readouterr().err.splitlines() == [
        "demo.py: error: --max_steps must be > 0, got 0"
    ]


def test_a_run_replaces_the_demos_own_folder_and_a_failed_one_exits_with_its_code(
    tmp_path, capsys
) -> None:
    run_dir = tmp_path / "fp8"
    run_dir.mkdir()
    (run_dir / demo.MARK).touch()
    (run_dir / "metrics.jsonl").write_text("an earlier demo's\n")
    assert demo.problem(run_dir, [sys.executable, "train.py"]) is None
    assert demo.run(run_dir, [sys.executable, "-c", "pass"]) == run_dir
    assert sorted(p.name for p in run_dir.iterdir()) == [demo.MARK]
    with pytest.raises(SystemExit) as exited:  # train.py said why: no traceback beneath it
        demo.run(run_dir, [sys.executable, "-c", "raise SystemExit(2)"])
    assert exited.value.code == 2 and "Traceback" not in capsys.readouterr().err
