"""FLOPs formula, device peaks, step meter, log lines, JSONL, summaries (model_utils/metrics)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from model_utils.config.sections import ModelShape
from model_utils.report.metrics import (
    JsonlWriter,
    StepMeter,
    detail_line,
    flops_per_token,
    format_duration,
    format_table,
    peak_bf16_tflops,
    peak_bf16_tflops_for_name,
    read_jsonl,
    run_line,
    run_record,
    seed_line,
    summarize,
    validation_record,
)
from model_utils.report.metrics.device import GIB, peak_memory_bytes, peak_memory_label
from model_utils.report.metrics.flops import matmul_params
from model_utils.report.metrics.meter import remaining_seconds, step_metrics
from model_utils.report.metrics.records import upstream_validation_line
from model_utils.report.metrics.summary import format_summary

# The `tiny` preset's shape (model_utils/config/arguments.py), GQA included.
TINY = ModelShape(
    hidden_width=256,
    num_layers=4,
    num_heads=4,
    num_key_value_heads=2,
    intermediate_size=688,
    vocab_size=8192,
    max_context_width=256,
    rope_theta=10000.0,
)


# ------------------------------------------------------------------------------ FLOPs


def counted_train_flops(
    shape: ModelShape, seq_len: int, batch: int, tie: bool, device: str = "cpu"
) -> float:
    """FLOPs torch's FlopCounterMode sees in a real HF Llama forward + backward, per token.

    Eager attention: on CPU the fused SDPA kernel (``_scaled_dot_product_flash_attention_for_cpu``)
    is not registered with FlopCounterMode in torch 2.13, so it would count zero attention FLOPs;
    eager attention runs the two ``seq x seq`` batched matmuls, which the counter sees in full
    (the causal mask is applied after the product, so nothing is discounted there either).
    ``device="meta"`` runs the same module code and aten ops on shapes only (FlopCounterMode
    counts from shapes), which is much faster; the CPU run proves the two agree.
    """
    config = LlamaConfig(
        hidden_size=shape.hidden_width,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_key_value_heads,
        intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size,
        max_position_embeddings=seq_len,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
        input_ids = torch.randint(0, shape.vocab_size, (batch, seq_len))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    return counter.get_total_flops() / (batch * seq_len)


@pytest.mark.parametrize(("tie", "device"), [(False, "cpu"), (True, "meta")])
def test_flops_formula_matches_flop_counter_on_tiny_llama(tie: bool, device: str) -> None:
    seq_len = 256
    formula = flops_per_token(TINY, seq_len)  # tying shares storage, not compute
    counted = counted_train_flops(TINY, seq_len=seq_len, batch=1, tie=tie, device=device)
    # Everything the counter sees is a matmul the formula also counts, so they agree to well
    # under 1%. Dropping any term is far outside that: attention is ~10% of the total here,
    # lm_head ~40%, and counting K/V with n_heads instead of n_kv_heads adds ~5%.
    assert counted == pytest.approx(formula, rel=0.005)
    attention = 12 * TINY.num_layers * TINY.hidden_width * seq_len
    assert attention / formula > 0.05  # the tolerance really can see the attention term


def test_flops_formula_matches_flop_counter_on_llama3_8b_shape() -> None:
    """The real Llama-3-8B shape (GQA 32/8, vocab 128256) counted on the meta device."""
    shape = dataclasses.replace(
        TINY,
        hidden_width=4096,
        num_layers=32,
        num_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
    )
    seq_len = 2048
    counted = counted_train_flops(shape, seq_len=seq_len, batch=1, tie=False, device="meta")
    assert counted == pytest.approx(flops_per_token(shape, seq_len), rel=0.005)


def test_flops_terms() -> None:
    base = flops_per_token(TINY, 256)
    # attention grows linearly in seq_len: 12 * L * n_heads * head_dim per extra token of context
    longer = flops_per_token(TINY, 512)
    assert longer - base == 12 * 4 * 256 * 256
    with pytest.raises(
        ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"
    ):
        flops_per_token(dataclasses.replace(TINY, num_key_value_heads=3), 256)


def test_matmul_params_reproduce_llama2_7b_parameter_count() -> None:
    """Matmul weights + input embedding + norm gains = Llama-2-7B's published 6,738,415,616."""
    hidden, layers, vocab = 4096, 32, 32000
    llama2_7b = dataclasses.replace(
        TINY,
        hidden_width=hidden,
        num_layers=layers,
        num_heads=32,
        num_key_value_heads=32,
        intermediate_size=11008,
        vocab_size=vocab,
    )
    n = matmul_params(llama2_7b)
    norms = (2 * layers + 1) * hidden
    assert n + vocab * hidden + norms == 6_738_415_616


# ------------------------------------------------------------------------- device peaks


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA GB200", 2500.0),
        ("NVIDIA GeForce RTX 3090", None),
    ],
)
def test_peak_table(name: str, peak: float | None) -> None:
    value, label = peak_bf16_tflops_for_name(name)
    assert value == peak
    assert (f"vs {name.split()[1].split('-')[0]}" in label) if peak else label.startswith("n/a")


def test_cpu_has_no_peak_and_reports_rss() -> None:
    assert peak_bf16_tflops("cpu") == (None, "n/a on cpu")
    assert peak_memory_label("cpu") == "process max RSS"
    with open("/proc/self/status") as f:
        hwm_kib = int(next(line for line in f if line.startswith("VmHWM")).split()[1])
    # VmHWM is the kernel's own high-water mark of this process: an independent reading.
    assert peak_memory_bytes("cpu") == pytest.approx(hwm_kib * 1024, rel=0.05)


# -------------------------------------------------------------------------- step meter


def test_step_metrics_arithmetic() -> None:
    metrics = step_metrics(
        step=20,
        loss=8.421841,
        lr=1e-4,
        step_seconds=2.0,
        data_wait_seconds=0.1,
        samples=16,  # global: 2 ranks x 8
        tokens=16 * 4096,
        world_size=2,
        peak_memory_bytes=3 * (1 << 30),
        flops_per_token=1e9,
        peak_tflops=989.0,
    )
    assert metrics["samples_per_sec"] == 8.0
    assert metrics["tokens_per_sec_per_device"] == 16 * 4096 / 2 / 2
    assert metrics["tflops_per_device"] == pytest.approx(16384 * 1e9 / 1e12)
    assert metrics["mfu"] == pytest.approx(100 * 16.384 / 989)
    assert metrics["peak_mem_gib"] == 3.0
    assert metrics["data_wait_pct"] == pytest.approx(5.0)
    no_peak = step_metrics(**{**_args(), "peak_tflops": None})
    assert no_peak["mfu"] is None


def _args() -> dict:
    return {
        "step": 1,
        "loss": 1.0,
        "lr": 1e-3,
        "step_seconds": 1.0,
        "data_wait_seconds": 0.0,
        "samples": 1,
        "tokens": 1,
        "world_size": 1,
        "peak_memory_bytes": 0,
        "flops_per_token": 1.0,
        "peak_tflops": 1.0,
    }


class Clock:
    """A settable clock, so window arithmetic is exact."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_step_meter_reports_windows() -> None:
    clock = Clock()
    meter = StepMeter(
        flops_per_token=1e6, world_size=1, peak_tflops=None, peak_label="n/a on cpu", clock=clock
    )
    with pytest.raises(RuntimeError, match="start"):
        meter.add_step(data_wait_seconds=0.0, samples=8, tokens=2048)
    meter.start()
    clock.now += 1.0
    meter.add_step(data_wait_seconds=0.5, samples=8, tokens=2048)
    clock.now += 3.0
    meter.add_step(data_wait_seconds=0.5, samples=8, tokens=2048)
    first = meter.report(step=2, loss=2.5, lr=1e-4, peak_memory_bytes=int(GIB))
    assert first["window_steps"] == 2
    assert first["samples_per_sec"] == 4.0  # 16 samples / 4 s: the window, not the last step
    assert first["data_wait_pct"] == 25.0
    assert (first["step"], first["loss"], first["mfu"]) == (2, 2.5, None)
    with meter.paused():  # validation or a checkpoint save: not training time
        clock.now += 50.0
    clock.now += 0.5
    meter.add_step(data_wait_seconds=0.0, samples=8, tokens=2048)
    second = meter.report(step=3, loss=2.0, lr=1e-4, peak_memory_bytes=int(GIB))
    assert (second["window_steps"], second["samples_per_sec"]) == (1, 16.0)
    assert (first["tokens"], second["tokens"], first["samples"]) == (4096, 2048, 16)
    assert first["time"] <= second["time"]
    with pytest.raises(RuntimeError, match="before any add_step"):
        meter.report(step=4, loss=2.0, lr=1e-4, peak_memory_bytes=0)


class SimulatedGPU:
    """A host and an asynchronous device on one simulated clock (nothing sleeps).

    Launching kernels costs the host only ``launch_seconds``; the device runs queued work in
    order and is paid for only when the host waits: ``sync()`` moves the host clock to the
    moment the device is idle. That is how a CUDA stream behaves, and what hid the GPU time of
    non-logging steps from the old per-step timer.
    """

    def __init__(self) -> None:
        self.host = 0.0
        self.device_idle_at = 0.0

    def clock(self) -> float:
        return self.host

    def host_work(self, seconds: float) -> None:
        self.host += seconds

    def launch(self, device_seconds: float, launch_seconds: float = 1e-3) -> None:
        start = max(self.device_idle_at, self.host)
        self.device_idle_at = start + device_seconds
        self.host += launch_seconds

    def sync(self) -> None:
        self.host = max(self.host, self.device_idle_at)


@pytest.mark.parametrize("logging_freq", [1, 5, 10])
def test_logged_speed_is_wall_clock_speed_on_an_asynchronous_device(logging_freq: int) -> None:
    """The H100 bug class: at --logging_freq 5 the old meter logged 2.3x the real speed."""
    gpu = SimulatedGPU()
    flops, tokens, peak, efficiency = 1e9, 16384, 989.0, 0.6
    device_seconds = tokens * flops / (peak * 1e12 * efficiency)  # one step at 60% of peak
    meter = StepMeter(flops, 1, peak, sync=gpu.sync, clock=gpu.clock)
    meter.start()
    begin, records, host_intervals = gpu.clock(), [], 0.0
    for step in range(1, 31):
        step_start = gpu.clock()
        gpu.host_work(2e-4)  # data wait
        gpu.launch(device_seconds)  # forward, backward, optimizer: queued, not waited for
        meter.add_step(data_wait_seconds=2e-4, samples=8, tokens=tokens)
        host_intervals += gpu.clock() - step_start  # what summing per-step intervals sees
        if step % logging_freq == 0:
            gpu.sync()  # the loss all-reduce + .item() of a logging step
            records.append(meter.report(step=step, loss=1.0, lr=1e-4, peak_memory_bytes=0))
    wall_rate = 30 * tokens / (gpu.clock() - begin)
    for record in records:
        assert record["tokens_per_sec_per_device"] == pytest.approx(wall_rate, rel=0.02)
        assert record["mfu"] <= 100.0
        assert record["mfu"] == pytest.approx(100 * efficiency, rel=0.02)
    assert sum(r["tokens"] for r in records) == 30 * tokens
    if logging_freq > 1:  # the simulation reproduces the bug: host time alone is far less
        assert 30 * tokens / host_intervals > 2 * wall_rate


def test_paused_work_is_left_out_even_when_the_device_still_owes_a_step() -> None:
    gpu = SimulatedGPU()
    meter = StepMeter(1e9, 1, 989.0, sync=gpu.sync, clock=gpu.clock)
    meter.start()
    gpu.launch(2.0)  # a step of 2 s of device work, queued
    meter.add_step(data_wait_seconds=0.0, samples=1, tokens=1000)
    with meter.paused():  # validation right after: its entry sync pays the step first
        gpu.launch(5.0)
    gpu.launch(2.0)
    meter.add_step(data_wait_seconds=0.0, samples=1, tokens=1000)
    record = meter.report(step=2, loss=1.0, lr=1e-4, peak_memory_bytes=0)
    assert record["step_seconds"] == pytest.approx(4.0, rel=1e-3)


# ---------------------------------------------------------------------------- log lines

SEED_RE = re.compile(r"^Batch \d+ Loss: \d+\.\d{5}, Speed: \d+\.\d{2} samples/sec, lr: \d+\.\d{6}$")


def test_seed_line_is_byte_exact() -> None:
    line = seed_line(20, 8.421841, 47.0649, 1e-4)
    assert line == "Batch 20 Loss: 8.42184, Speed: 47.06 samples/sec, lr: 0.000100"
    assert SEED_RE.match(line)
    assert SEED_RE.match(seed_line(1, 10.0, 0.5, 3e-4))


def test_upstream_validation_line_is_byte_exact() -> None:
    assert upstream_validation_line(20, 8.421846) == "Batch 20 Validation loss: 8.42185"


def test_detail_line_labels() -> None:
    clock = Clock()
    meter = StepMeter(
        flops_per_token=flops_per_token(TINY, 256),
        world_size=1,
        peak_tflops=None,
        peak_label="n/a on cpu",
        memory_label="process max RSS",
        clock=clock,
    )
    meter.start()
    clock.now += 0.5
    meter.add_step(data_wait_seconds=0.01, samples=8, tokens=2048)
    line = detail_line(meter.report(step=1, loss=9.0, lr=1e-4, peak_memory_bytes=int(1.5 * GIB)))
    assert "tokens/s/device: 4,096" in line
    assert "MFU: n/a on cpu" in line
    assert "peak mem: 1.50 GiB (process max RSS)" in line
    assert "data wait: 2.0%" in line
    assert re.search(r"TFLOP/s/device: \d+\.\d{3}", line)

    gpu = StepMeter(
        flops_per_token=1e9, world_size=8, peak_tflops=989.0, peak_label="vs H100", clock=clock
    )
    gpu.start()
    clock.now += 1.0
    gpu.add_step(data_wait_seconds=0.0, samples=8, tokens=8 * 400_000)
    assert "MFU: 40.4% (vs H100)" in detail_line(
        gpu.report(step=1, loss=1.0, lr=1e-4, peak_memory_bytes=0)
    )


# -------------------------------------------------------------------------------- JSONL


def test_jsonl_writer_whole_lines_rank0_only(tmp_path) -> None:
    path = tmp_path / "run" / "metrics.jsonl"
    JsonlWriter(tmp_path / "other" / "metrics.jsonl", enabled=False).write({"a": 1})
    assert not (tmp_path / "other").exists()  # non-zero ranks touch nothing

    with JsonlWriter(path) as writer:
        writer.write({"kind": "train", "step": 1, "loss": float("nan"), "mfu": None})
        writer.write({"kind": "train", "step": 2, "loss": 9.0, "grad_norm": float("inf")})
        writer.write({"kind": "numerics", "step": 2, "layers": {"l0": {"amax": float("nan")}}})
        with pytest.raises(TypeError, match="not JSON serializable"):
            writer.write({"kind": "train", "step": 2, "bad": object()})
        # flushed per write: visible to a reader before close
        assert len(path.read_text().splitlines()) == 3
    with JsonlWriter(path) as writer:  # a resumed run appends
        writer.write(validation_record(step=2, val_loss=7.5, batches=4, seconds=0.2))
    text = path.read_text()
    assert text.endswith("\n")
    for line in text.splitlines():
        json.loads(line, parse_constant=pytest.fail)  # strict JSON: no NaN tokens
    records = read_jsonl(path)
    assert records[0]["loss"] is None and records[0]["not_finite"] == ["loss"]
    # a null grad norm is also a run without --grad_clip: the record says which it was
    assert records[1]["grad_norm"] is None and records[1]["not_finite"] == ["grad_norm"]
    assert records[2] == {"kind": "numerics", "step": 2, "layers": {"l0": {"amax": None}}}
    records = records[:1] + records[3:]  # a record's own fields only: a layer's stay as they are
    assert records[1] == {
        "kind": "val",
        "step": 2,
        "val_loss": 7.5,
        "val_batches": 4,
        "val_seconds": 0.2,
    }


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (
            '{"kind": "train", "step": "2", "loss": 1.0}',
            "line 2 has step '2', not a whole number >= 0",
        ),
        ('{"kind": "val", "step": 2}', "line 2 has no 'val_loss'"),
        ('{"kind": "train", "step": 2, "loss": "low"}', "line 2 has loss 'low', not a number"),
        ('{"kind": "run", "flags": 5}', "line 2 has flags 5, not an object"),
    ],
)
def test_a_record_the_summary_cannot_use_is_named_by_its_line(tmp_path, line, problem) -> None:
    """A hand-edited metrics.jsonl: the end summary died in its sort with a TypeError (a string
    step) after the last checkpoint; now the run warns "No summary" with this line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1, "loss": 2.5}\n' + line + "\n")
    with pytest.raises(ValueError) as exc:
        read_jsonl(path)
    assert str(exc.value) == problem


def test_a_resumed_writer_drops_a_record_cut_short_before_appending(tmp_path) -> None:
    """The machine died mid-write: the cut record goes, the whole ones before it stay, and the
    next record starts its own line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "run"}\n{"kind": "train", "step": 1, "loss": 2.5}\n{"kind": "tr')
    with JsonlWriter(path) as writer:
        writer.write({"kind": "train", "step": 2, "loss": 2.0})
    assert [r.get("step") for r in read_jsonl(path)] == [None, 1, 2]
    path.write_text('{"kind": "tr')  # nothing whole at all
    JsonlWriter(path).close()
    assert path.read_text() == ""
    path.write_text('{"kind": "run"}\n')  # whole: left as it is
    JsonlWriter(path).close()
    assert path.read_text() == '{"kind": "run"}\n'


# ------------------------------------------------------------------------------ summary


def _train(step: int, speed: float, loss: float, mem: float = 1.0) -> dict:
    return {
        "kind": "train",
        "step": step,
        "loss": loss,
        "samples_per_sec": speed,
        "tokens_per_sec_per_device": speed * 256,
        "tflops_per_device": speed / 100,
        "mfu": None,
        "data_wait_pct": 1.0,
        "peak_mem_gib": mem,
    }


def test_summarize_skips_warmup() -> None:
    records = [
        _train(5, speed=1.0, loss=9.0, mem=2.5),  # warm-up: slow, must not count
        _train(10, speed=2.0, loss=8.0),  # step == warmup_steps: still warm-up
        _train(15, speed=10.0, loss=7.0),
        validation_record(step=15, val_loss=7.2, batches=2, seconds=0.1),
        _train(20, speed=12.0, loss=6.5),
        _train(25, speed=11.0, loss=6.0),
        validation_record(step=25, val_loss=6.4, batches=2, seconds=0.1),
    ]
    summary = summarize(records, warmup_steps=10)
    assert summary["samples_per_sec"] == 11.0
    assert summary["tokens_per_sec_per_device"] == 11.0 * 256
    assert summary["data_wait_pct"] == 1.0
    assert summary["mfu"] is None
    assert summary["peak_mem_gib"] == 2.5  # a peak is the max over the whole run
    assert (summary["final_train_loss"], summary["final_val_loss"]) == (6.0, 6.4)
    assert summary["measured_records"] == 3
    assert summarize(records, warmup_steps=0)["samples_per_sec"] == 10.0
    empty = summarize(records, warmup_steps=100)
    assert empty["samples_per_sec"] is None and empty["final_train_loss"] == 6.0

    text = format_summary(summary, title="bf16")
    assert "samples/s (median)" in text and "11.00" in text and "6.40000" in text
    assert "MFU % vs bf16 peak (median)" in text and "n/a" in text


def test_summarize_skips_each_launch_s_warm_up_windows() -> None:
    """A resumed run warms up (and compiles) again: its records say so (speed_warmup), and the
    medians leave them out as they leave out the first launch's."""
    records = [_train(s, speed=10.0, loss=5.0) for s in (11, 12, 13)]
    records += [{**_train(s, speed=1.0, loss=5.0), "speed_warmup": True} for s in (14, 15)]
    records += [{**_train(s, speed=11.0, loss=5.0), "speed_warmup": False} for s in (16, 17)]
    summary = summarize(records, warmup_steps=10)
    assert summary["measured_records"] == 5 and summary["samples_per_sec"] == 10.0


def test_summarize_counts_each_step_once_as_last_logged() -> None:
    """A requeued run re-logs the steps between its checkpoint and the interruption."""
    records = [
        _train(1, speed=1.0, loss=9.0),
        _train(2, speed=10.0, loss=8.0),
        _train(3, speed=10.0, loss=7.5),  # logged, then the job was killed; resumed at step 2
        validation_record(step=3, val_loss=7.9, batches=2, seconds=0.1),
        _train(3, speed=30.0, loss=7.0),
        validation_record(step=3, val_loss=7.3, batches=2, seconds=0.1),
        _train(4, speed=30.0, loss=6.5),
    ]
    summary = summarize(records, warmup_steps=1)
    assert summary["measured_records"] == 3 and summary["samples_per_sec"] == 30.0
    assert (summary["final_train_loss"], summary["final_val_loss"]) == (6.5, 7.3)
    assert summary["last_step"] == 4


def test_set_aside_keeps_an_earlier_runs_file_and_folder_beside_the_new_one(tmp_path) -> None:
    from model_utils.report.metrics.records import set_aside

    path = tmp_path / "metrics.jsonl"
    assert set_aside(path) is None  # nothing there
    path.write_text("")
    assert set_aside(path) is None and path.exists()  # empty: nothing to keep
    for n in (1, 2):
        path.write_text(f'{{"run": {n}}}\n')
        assert set_aside(path) == tmp_path / f"metrics.{n}.jsonl" and not path.exists()
    assert (tmp_path / "metrics.1.jsonl").read_text() == '{"run": 1}\n'
    board = tmp_path / "tensorboard"
    board.mkdir()
    assert set_aside(board) is None and board.is_dir()  # an empty folder stays
    (board / "events").write_text("x")
    assert set_aside(board) == tmp_path / "tensorboard.1"
    assert (tmp_path / "tensorboard.1" / "events").read_text() == "x"


def test_a_two_run_table_has_the_ratios() -> None:
    bf16 = summarize([_train(20, 10.0, 6.0), _train(30, 10.0, 5.0)], warmup_steps=10)
    fp8 = summarize([_train(20, 5.0, 6.1), _train(30, 5.0, 5.05)], warmup_steps=10)
    table = format_table([bf16, fp8], ["bf16", "fp8"])
    lines = table.splitlines()
    assert "fp8/bf16" in lines[0]
    speed = next(line for line in lines if "samples/s" in line).split()
    assert speed[-3:] == ["10.00", "5.00", "0.500"]
    loss = next(line for line in lines if "final train loss" in line).split()
    assert float(loss[-1]) == pytest.approx(5.05 / 5.0, abs=1e-3)
    val = next(line for line in lines if "validation" in line)
    assert val.split()[-1] == "n/a"
    assert not math.isnan(bf16["samples_per_sec"])


# ---------------------------------------------------------------------------------- ETA


def test_eta_is_the_median_step_time_after_warmup_times_the_steps_left() -> None:
    """Elapsed is the wall clock since start (validation included); remaining is the median
    seconds per step of windows ending after warm-up, times max_steps - step."""
    clock = Clock()
    meter = StepMeter(1e6, 1, None, clock=clock, max_steps=100, warmup_steps=2)
    meter.start()

    def window(step: int, seconds_per_step: float, steps: int = 2) -> dict:
        for _ in range(steps):
            clock.now += seconds_per_step
            meter.add_step(data_wait_seconds=0.0, samples=1, tokens=1)
        return meter.report(step=step, loss=1.0, lr=1e-4, peak_memory_bytes=0)

    warm = window(2, 30.0)  # compilation: must not count
    assert warm["remaining_seconds"] is None and warm["elapsed_seconds"] == 60.0
    assert detail_line(warm).endswith(", elapsed: 1m00s, remaining: n/a (warm-up)")
    assert window(4, 1.0)["remaining_seconds"] == 1.0 * 96
    with meter.paused():  # a validation pass: in elapsed, not in the step times
        clock.now += 600.0
    assert window(6, 3.0)["remaining_seconds"] == pytest.approx(2.0 * 94)  # median(1, 3)
    late = window(8, 2.0)  # median(1, 3, 2) = 2
    assert late["remaining_seconds"] == 2.0 * 92
    assert [warm["speed_warmup"], late["speed_warmup"]] == [True, False]
    assert late["elapsed_seconds"] == 60 + 2 + 600 + 6 + 4
    assert detail_line(late).endswith(", elapsed: 11m12s, remaining: ~3m04s")
    # A run that resumed at step 90 warms up again (steps counted by this meter, not the step).
    resumed = StepMeter(1e6, 1, None, clock=clock, max_steps=100, warmup_steps=2)
    resumed.start()
    clock.now += 5.0
    resumed.add_step(data_wait_seconds=0.0, samples=1, tokens=1)
    assert resumed.report(step=91, loss=1, lr=1, peak_memory_bytes=0)["remaining_seconds"] is None


def test_remaining_and_durations() -> None:
    assert remaining_seconds([], 10) is None
    assert remaining_seconds([1.0, 100.0, 2.0], 10) == 20.0  # a slow outlier does not swing it
    assert remaining_seconds([1.0], -3) == 0.0  # past max_steps (never negative)
    cases = {0: "0s", 12.4: "12s", 245: "4m05s", 3720: "1h02m", 183600: "2d03h", 59.6: "1m00s"}
    assert {s: format_duration(s) for s in cases} == cases
    # Records without timing (older runs, hand-made records) keep the old detail line.
    plain = step_metrics(
        step=1,
        loss=1,
        lr=1,
        step_seconds=1.0,
        data_wait_seconds=0.0,
        samples=1,
        tokens=1,
        world_size=1,
        peak_memory_bytes=0,
        flops_per_token=1.0,
        peak_tflops=None,
    )
    assert detail_line(plain).endswith("data wait: 0.0%")
    # The tokens seen over all launches: plain below a thousand, then k, M, B.
    seen = {512: "512 tokens", 2048: "2.05k tokens", 1_234_567: "1.23M tokens", 3e9: "3.00B tokens"}
    for tokens, words in seen.items():
        assert f", seen: {words}" in detail_line({**plain, "tokens_seen": tokens}), tokens
    # The gradient norm before clipping, after the data wait; none where --grad_clip 0 skips it.
    normed = detail_line({**plain, "grad_norm": 0.87361, "tokens_seen": 512})
    assert normed.endswith("data wait: 0.0%, grad norm: 0.8736, seen: 512 tokens")
    assert "grad norm" not in detail_line({**plain, "grad_norm": None})


def test_run_record_and_line_round_trip() -> None:
    from pathlib import Path

    flags = {"fp8": True, "output_dir": Path("runs/x"), "lr": 1e-3, "rope_scaling": None}
    run = run_record(flags, world_size=16, samples_per_step=128)
    assert run["kind"] == "run" and (run["world_size"], run["samples_per_step"]) == (16, 128)
    assert run["flags"] == {"fp8": True, "output_dir": "runs/x", "lr": 1e-3, "rope_scaling": None}
    here = Path.cwd() / "runs" / "x"  # a person's line: where the record and the flags are
    line = run_line("runs/x/metrics.jsonl", "runs/x/run.args")
    assert line == f"run: record in {here / 'metrics.jsonl'}, flags in {here / 'run.args'}"


def test_format_table_three_runs_ratios_to_the_first() -> None:
    runs = [
        summarize([_train(20, 10.0, 6.0)], warmup_steps=10),
        summarize([_train(20, 15.0, 6.1)], warmup_steps=10),
        summarize([_train(20, 5.0, 6.2)], warmup_steps=10),
    ]
    table = format_table(runs, ["bf16 hf", "fp8 tensorwise hf", "fp8 te"])
    head, *rows = table.splitlines()
    columns = ["bf16 hf", "fp8 tensorwise hf", "fp8 tensorwise hf/bf16 hf", "fp8 te/bf16 hf"]
    assert [head.index(c) for c in columns] == sorted(head.index(c) for c in columns)
    speed = next(r for r in rows if r.lstrip().startswith("samples/s")).split()
    assert speed[-5:] == ["10.00", "15.00", "1.500", "5.00", "0.500"]
    with pytest.raises(ValueError, match="3 summaries for 1 names"):
        format_table(runs, ["one"])


def test_another_run_never_appends_to_a_run_folders_metrics(tmp_path) -> None:
    """One run identity per metrics.jsonl: a resume of the same run appends; a launch into the
    same run folder with another --checkpoint_dir or precision (a resume of another run's
    checkpoint) used to append too, and compare_runs labelled its records by the first run's
    flags. Now the earlier file is kept aside and the new run starts its own."""
    from helpers.runs import SMALL_LLAMA

    from model_utils.checkpoint import TrainState
    from model_utils.config.arguments import parse_args
    from model_utils.model import modeling
    from model_utils.parallel import distributed
    from model_utils.precision.backends import BF16
    from model_utils.report.run_log import RunLog

    def launch(*flags: str, start_step: int, out: Path = tmp_path) -> None:
        config = parse_args([*SMALL_LLAMA, f"--output_dir={out}", "--bf16=0", *flags])
        model = LlamaForCausalLM(modeling.model_config(config.model))
        world = distributed.world_from_env({})
        RunLog(
            config,
            model,
            BF16(config),
            world,
            torch.device("cpu"),
            start_step=start_step,
            seen=TrainState(model).seen,
        )

    def runs(name: str = "metrics.jsonl", out: Path = tmp_path) -> list[dict]:
        lines = (out / name).read_text().splitlines()
        return [r["flags"] for r in map(json.loads, lines) if r["kind"] == "run"]

    launch(start_step=0)
    launch(start_step=5)  # the same run resumed: its records go on in its file
    assert len(runs()) == 2 and not (tmp_path / "metrics.1.jsonl").exists()
    launch(f"--checkpoint_dir={tmp_path / 'elsewhere'}", start_step=5)
    assert len(runs("metrics.1.jsonl")) == 2  # the first run's records, whole, beside
    assert [r["checkpoint_dir"] for r in runs()] == [str(tmp_path / "elsewhere")]
    launch(f"--checkpoint_dir={tmp_path / 'elsewhere'}", "--bf16=1", start_step=7)
    assert [r["bf16"] for r in runs("metrics.2.jsonl")] == [False]
    assert [r["bf16"] for r in runs()] == [True]
    # A run folder moved (or renamed) and resumed is the same run: its records go on.
    launch(start_step=0, out=tmp_path / "first")
    (tmp_path / "first").rename(tmp_path / "moved")
    launch(start_step=5, out=tmp_path / "moved")
    assert len(runs(out=tmp_path / "moved")) == 2
    assert not (tmp_path / "moved" / "metrics.1.jsonl").exists()


def test_a_window_holding_warm_up_steps_is_warm_up_whatever_its_last_step() -> None:
    """--logging_freq 12 with a 10-step warm-up: the first window (steps 1-12) holds the whole
    warm-up, so it is no estimate and no median, though it ends past step 10."""
    clock = Clock()
    meter = StepMeter(1e6, 1, None, clock=clock, max_steps=48, warmup_steps=10)
    meter.start()
    reports = []
    for step in (12, 24):
        for _ in range(12):
            clock.now += 5.0 if step == 12 else 1.0
            meter.add_step(data_wait_seconds=0.0, samples=1, tokens=1)
        reports.append(meter.report(step=step, loss=1.0, lr=1e-4, peak_memory_bytes=0))
    assert [r["speed_warmup"] for r in reports] == [True, False]
    assert reports[0]["remaining_seconds"] is None and reports[1]["remaining_seconds"] == 24.0


def test_a_resume_from_an_older_checkpoint_drops_what_the_abandoned_launch_logged() -> None:
    """Launch 1 logs every step to 10 (diverging, say); launch 2 resumes from step 4 and logs
    every 2nd step: steps 5, 7, 9 and 10 of launch 1 were undone and count nowhere (they fed
    train.py's summary and compare_runs' curves before)."""

    def train(step: int, loss: float) -> dict:
        return {"kind": "train", "step": step, "loss": loss, "samples_per_sec": loss}

    flags = {"fp8": True}
    records = [
        run_record(flags, world_size=1, samples_per_step=8, start_step=0),
        *(train(step, 1.0) for step in range(1, 11)),
        {"kind": "val", "step": 8, "val_loss": 9.0},
        run_record(flags, world_size=1, samples_per_step=8, start_step=4),
        *(train(step, 2.0) for step in (6, 8)),
    ]
    summary = summarize(records, warmup_steps=0)
    assert summary["last_step"] == 8 and summary["final_val_loss"] is None
    assert summary["final_train_loss"] == 2.0 and summary["measured_records"] == 6  # 1-4, 6, 8
    unknown = [records[0], *records[1:11], {**records[12], "start_step": None}, *records[13:]]
    assert summarize(unknown, warmup_steps=0)["last_step"] == 10  # an older record: no drop
