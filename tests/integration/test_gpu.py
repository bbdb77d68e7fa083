"""The GPU tier: ``pytest -m gpu tests/integration/test_gpu.py`` on one CUDA GPU with
Transformer Engine.

Every test runs the real ``train.py`` in a subprocess (one GPU, a world of one) on a small Llama
whose shapes every FP8 recipe accepts, and checks what only a GPU shows: each implementation in
BF16 and every FP8 recipe the device supports (the others refused in one line), resume bit for
bit per recipe, one starting model across implementations (from --seed and from HF weights),
logged throughput equal to wall-clock throughput and MFU <= 100% at --logging_freq 1 and 10,
activation checkpointing, accumulation and compile; --fp8_attention trains and resumes (refused
in one line where TE has no backend); --fp8_weights trains from fp32 masters and resumes; each
gap-closer (--fp8_backward, a short amax history, --bf16_layers, --fp8_lm_head,
--bf16_cooldown) trains near its recipe and resumes bit for bit.
Skipped cleanly without a GPU; the CPU tier (``make test``) hides GPUs (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
from helpers.procs import launch_report

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs a CUDA GPU"),
]

# Dimensions divisible by 128 (FP8 block scaling's tiles); 1024 tokens per micro-batch.
SMALL = [
    "--preset",
    "tiny",
    "--hidden_width",
    "256",
    "--num_layers",
    "2",
    "--num_heads",
    "4",
    "--num_key_value_heads",
    "2",
    "--intermediate_size",
    "1024",
    "--max_context_width",
    "256",
    "--train_batch_size",
    "4",
    "--max_steps",
    "10",
    "--warmup",
    "2",
    "--validation_batches",
    "1",
    "--logging_freq",
    "1",
    "--seed",
    "5",
]
RECIPES = ("delayed", "current", "block", "mxfp8")


def sm() -> tuple[int, int]:
    return torch.cuda.get_device_capability()


@cache
def te_available() -> bool:
    """TE imported as train.py imports it (te_loader: torch's cuDNN first), so a TE that only a
    bare import fails on does not skip the whole TE tier while train.py would run."""
    load = "from model_utils.config.te_loader import import_te; import_te()"
    probe = subprocess.run([sys.executable, "-c", load], capture_output=True, cwd=ROOT)
    return probe.returncode == 0


def needs_te() -> None:
    if not te_available():
        pytest.skip("Transformer Engine is not importable here")


def recipe_runs_here(recipe: str) -> bool:
    return {"mxfp8": sm() >= (10, 0), "block": sm() >= (9, 0)}.get(recipe, sm() >= (8, 9))


def train(
    out: Path, *flags: str, deterministic: bool = True, cudnn_home: str | None = None
) -> subprocess.CompletedProcess:
    """train.py on SMALL; TE's deterministic algorithms unless ``deterministic`` is False; TE's
    cuDNN chosen by the user's ``CUDNN_HOME`` where ``cudnn_home`` is given."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0" if deterministic else "1",
        **({"CUDNN_HOME": cudnn_home} if cudnn_home else {}),
    }
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *SMALL, f"--output_dir={out}", *flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,  # a hung run ends inside a lent GPU's 10-minute call, with the rest to run
    )


#: The first line of a record Python's ``warnings`` prints (the source line follows, indented).
WARNING_RECORD = re.compile(r"^\S.*:\d+: \w*Warning: ")


def message_lines(stderr: str) -> list[str]:
    """train.py's own stderr lines: without the warnings dependencies print as they import
    (on the lent H100, torchao installed without bytecode printed a SyntaxWarning at every
    start, TE a RuntimeWarning about JAX). The one-line rule is about our message."""
    lines, skip_source = [], False
    for line in stderr.splitlines():
        if WARNING_RECORD.match(line):
            skip_source = True
        elif skip_source and line[:1].isspace():
            skip_source = False
        elif line.strip():
            skip_source = False
            lines.append(line)
    return lines


def records(out: Path, kind: str = "train") -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out)}


def ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, launch_report(result)


def trains(out: Path) -> dict[int, float]:
    got = losses(out)
    assert all(v == v and abs(v) < 1e4 for v in got.values()), got  # finite
    assert got[max(got)] < got[min(got)], got
    return got


def impl_flags(impl: str, precision: str) -> list[str]:
    if precision == "bf16":
        return [f"--model_impl={impl}", "--fp8=0"]
    if impl == "hf":
        return ["--model_impl=hf", "--fp8=1"]  # torchao tensorwise
    return [f"--model_impl={impl}", "--fp8=1", f"--fp8_recipe={precision}"]


MATRIX = [("hf", "bf16"), ("hf", "tensorwise")] + [
    (impl, p) for impl in ("te", "te_linear") for p in ("bf16", *RECIPES)
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpu_runs")


@pytest.mark.parametrize(("impl", "precision"), MATRIX)
def test_every_impl_and_precision_trains_or_is_refused(impl, precision, runs) -> None:
    if impl != "hf":
        needs_te()
    out = runs / f"{impl}-{precision}"
    result = train(out, *impl_flags(impl, precision), "--checkpoint_freq=5", "--keep_last=0")
    if precision in RECIPES and not recipe_runs_here(precision):
        assert result.returncode == 2, result.stderr[-2000:]
        message = message_lines(result.stderr)
        assert len(message) == 1 and f"--fp8_recipe {precision} needs" in message[0]
        return
    ok(result)
    trains(out)


@pytest.mark.parametrize("recipe", ["bf16", *RECIPES[:3]])
def test_resume_repeats_the_uninterrupted_run_bit_for_bit(recipe, runs) -> None:
    needs_te()
    if recipe != "bf16" and not recipe_runs_here(recipe):
        pytest.skip(f"{recipe} does not run on SM {sm()}")
    full = runs / f"te-{recipe}"
    if not (full / "metrics.jsonl").exists():
        pytest.skip("needs the matrix run of the same recipe")
    out = runs / f"te-{recipe}-resumed"
    checkpoint = full / "checkpoints" / "step_00000005"
    result = train(out, *impl_flags("te", recipe), f"--resume_from_checkpoint={checkpoint}")
    ok(result)
    assert "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE" not in result.stdout + result.stderr
    if recipe == "delayed":
        assert "FP8 scaling state of" in result.stdout
    want = {s: v for s, v in losses(full).items() if s > 5}
    assert losses(out) == want


def test_validation_changes_no_training_loss_under_delayed_scaling(runs) -> None:
    """TE keeps a no-grad forward's amaxes for the next training step (``autocast_exit``
    reduces only with grad enabled); the backend puts the state back after validation
    (te_state.fp8_scaling_kept), so validating every 2 steps leaves every training loss as
    it was, bit for bit."""
    needs_te()
    flags = (*impl_flags("te", "delayed"), "--checkpoint_freq=5", "--keep_last=0")
    plain = runs / "te-delayed"
    if not (plain / "metrics.jsonl").exists():
        ok(train(plain, *flags))
    out = runs / "te-delayed-validating"
    ok(train(out, *flags, "--validation_freq=2"))
    assert losses(out) == losses(plain)


def test_one_seed_and_one_hf_checkpoint_give_one_step_one_loss(runs) -> None:
    needs_te()
    first = {}
    for impl in ("hf", "te", "te_linear"):
        out = runs / f"{impl}-bf16"
        if not (out / "metrics.jsonl").exists():  # run on its own (-k one_seed): train here
            ok(train(out, *impl_flags(impl, "bf16"), "--max_steps=3"))
        first[impl] = losses(out)[1]
    assert first["te"] == pytest.approx(first["hf"], rel=2e-3)
    assert first["te_linear"] == pytest.approx(first["hf"], rel=2e-3)
    hf_dir = runs / "hf-export"
    ok(
        train(
            runs / "hf-src", "--model_impl=hf", "--fp8=0", "--max_steps=3", f"--export_hf={hf_dir}"
        )
    )
    step_one = {}
    for impl in ("hf", "te", "te_linear"):
        out = runs / f"from-hf-{impl}"
        ok(
            train(
                out, f"--model_impl={impl}", "--fp8=0", "--max_steps=3", f"--init_from_hf={hf_dir}"
            )
        )
        step_one[impl] = losses(out)[1]
    assert step_one["te"] == pytest.approx(step_one["hf"], rel=2e-3)
    assert step_one["te_linear"] == pytest.approx(step_one["hf"], rel=2e-3)


BIG = [
    "--hidden_width",
    "2048",
    "--num_layers",
    "4",
    "--num_heads",
    "16",
    "--num_key_value_heads",
    "4",
    "--intermediate_size",
    "5632",
    "--max_context_width",
    "2048",
    "--train_batch_size",
    "4",
    "--max_steps",
    "30",
    "--warmup",
    "3",
]


@pytest.mark.parametrize("logging_freq", [1, 10])
def test_logged_speed_is_wall_clock_speed(logging_freq, runs) -> None:
    """Consecutive records' timestamps give the real rate; the logged rate must agree (5%)."""
    needs_te()
    out = runs / f"speed-{logging_freq}"
    ok(
        train(
            out,
            *BIG,
            "--model_impl=te",
            "--fp8=1",
            f"--logging_freq={logging_freq}",
            "--checkpoint_freq=-1",
            "--max_steps=40",  # at --logging_freq 10, four records: one pair past the ends
        )
    )
    logged = records(out)
    assert all(r["mfu"] is None or r["mfu"] <= 100.0 for r in logged), [r["mfu"] for r in logged]
    pairs = list(zip(logged, logged[1:], strict=False))[1:-1]  # skip warm-up and the last step
    assert pairs, [r["step"] for r in logged]
    for before, after in pairs:
        wall = after["tokens"] / (after["time"] - before["time"])
        assert after["tokens_per_sec_per_device"] == pytest.approx(wall, rel=0.05)


FEATURES = {
    "activation_checkpointing": ["--activation_checkpointing"],
    "grad_accumulation": ["--grad_accum_steps=2"],
    "compile": ["--compile"],
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_te_fp8_with_each_feature_trains(feature, runs) -> None:
    needs_te()
    out = runs / f"feature-{feature}"
    ok(train(out, "--model_impl=te", "--fp8=1", "--fp8_recipe=delayed", *FEATURES[feature]))
    trains(out)


def test_mlp_recompute_on_te_trains_like_no_recompute(runs) -> None:
    """--ac_scope mlp on the fused layer (TE's LayerNormMLP(checkpoint=True), under FSDP2):
    the recompute replays the forward's delayed scales, so the losses are those of the run
    without recompute (deterministic algorithms: equal up to the order of fp32 reductions)."""
    needs_te()
    flags = ("--model_impl=te", "--fp8=1", "--fp8_recipe=delayed")
    plain = runs / "te-delayed-no-ac"
    ok(train(plain, *flags))
    out = runs / "te-delayed-ac-mlp"
    ok(train(out, *flags, "--activation_checkpointing", "--ac_scope=mlp"))
    assert trains(out) == pytest.approx(trains(plain), rel=1e-3)


def test_master_weights_in_fused_adam_train_like_fp32_parameters_and_resume(runs) -> None:
    """--master_weights optimizer on TE: bf16 parameters under FSDP2 and TE's FusedAdam keeping
    the fp32 masters (the start-up line names it). Trains within 1% of fp32 parameters per
    step (bf16 gradients are the difference), and resumes from step 5 bit for bit: the masters
    come back from the checkpoint through FusedAdam's own load."""
    needs_te()
    base = runs / "te-delayed-fp32-params"
    ok(train(base, *TE_DELAYED))
    out = runs / "te-delayed-master-weights"
    result = train(out, *TE_DELAYED, "--master_weights=optimizer", "--checkpoint_freq=5")
    ok(result)
    assert "FusedAdam, fp32 master weights in the optimizer" in result.stdout
    got, want = trains(out), trains(base)
    assert got != want and all(abs(got[s] - want[s]) / want[s] < 0.01 for s in want), (got, want)
    resumed = runs / "te-delayed-master-weights-resumed"
    checkpoint = out / "checkpoints" / "step_00000005"
    flags = ("--master_weights=optimizer", f"--resume_from_checkpoint={checkpoint}")
    ok(train(resumed, *TE_DELAYED, *flags))
    assert losses(resumed) == {s: v for s, v in got.items() if s > 5}


def test_no_fsdp2_and_cuda_graphs_train_like_fsdp2_and_resume(runs) -> None:
    """--sharding_strategy none (torch.autocast instead of FSDP2's bf16 parameters) trains within
    1% of FSDP2 per step; --cuda_graphs on it replays the same kernels from graphs (TE's
    make_graphed_callables) and gives its losses, and a graphed run resumed at step 5 (captured
    after the load) repeats the uninterrupted one."""
    needs_te()
    if not recipe_runs_here("delayed"):
        pytest.skip(f"FP8 does not run on SM {sm()}")
    fsdp2 = runs / "te-delayed-fsdp2"
    ok(train(fsdp2, *TE_DELAYED))
    plain = runs / "te-delayed-no-fsdp2"
    ok(train(plain, *TE_DELAYED, "--sharding_strategy=none"))
    graphed = runs / "te-delayed-cuda-graphs"
    flags = (*TE_DELAYED, "--sharding_strategy=none", "--cuda_graphs", "--checkpoint_freq=5")
    result = train(graphed, *flags)
    ok(result)
    assert "cuda graphs: 2 decoder layers captured at 4 x 256 tokens" in result.stdout
    want, got = trains(fsdp2), trains(plain)
    assert all(abs(got[s] - want[s]) / want[s] < 0.01 for s in want), (got, want)
    assert trains(graphed) == pytest.approx(got, rel=1e-3)
    resumed = runs / "te-delayed-cuda-graphs-resumed"
    checkpoint = graphed / "checkpoints" / "step_00000005"
    ok(train(resumed, *flags, f"--resume_from_checkpoint={checkpoint}"))
    assert losses(resumed) == {s: v for s, v in losses(graphed).items() if s > 5}


#: head_dim 128 (256 / 2 heads): what cuDNN's FP8 attention takes on Hopper.
HEAD_128 = ("--num_heads=2", "--num_key_value_heads=2")
TE_DELAYED = ("--model_impl=te", "--fp8=1", "--fp8_recipe=delayed")


def test_fp8_attention_trains_close_to_fp8_gemms_and_resumes(runs) -> None:
    """--fp8_attention (TE's fp8_dpa, cuDNN's FP8 fused attention): trains, stays within 3% of
    FP8 GEMMs alone per step, and resumes from step 5. Bit for bit where cuDNN >= 9.19 runs it
    deterministically; otherwise determinism is off (TE's rule) and the resume is within 0.5%."""
    needs_te()
    if sm() < (9, 0):
        pytest.skip("FP8 attention needs SM 9.0+")
    from model_utils.precision.te_requirements import FP8_ATTENTION_DETERMINISTIC_MIN_CUDNN

    # TE's cuDNN from a fresh process: importing TE here would set CUDNN_HOME for every run after
    cudnn = version_tuple(cudnn_probe()["te"][0])
    deterministic = cudnn >= FP8_ATTENTION_DETERMINISTIC_MIN_CUDNN
    gemms_only = runs / "te-delayed-head128"
    ok(train(gemms_only, *TE_DELAYED, *HEAD_128, deterministic=deterministic))
    out = runs / "te-delayed-fp8-attention"
    result = train(
        out,
        *TE_DELAYED,
        *HEAD_128,
        "--fp8_attention",
        "--checkpoint_freq=5",
        "--keep_last=0",
        deterministic=deterministic,
    )
    ok(result)
    assert "fp8_attention=True" in result.stdout + result.stderr
    got, base = trains(out), trains(gemms_only)
    assert got != base
    assert all(abs(got[s] - base[s]) / base[s] < 0.03 for s in base), (got, base)
    resumed = runs / "te-delayed-fp8-attention-resumed"
    checkpoint = out / "checkpoints" / "step_00000005"
    flags = (*TE_DELAYED, *HEAD_128, "--fp8_attention", f"--resume_from_checkpoint={checkpoint}")
    ok(train(resumed, *flags, deterministic=deterministic))
    want = {s: v for s, v in got.items() if s > 5}
    if deterministic:
        assert losses(resumed) == want
    else:
        assert losses(resumed) == pytest.approx(want, rel=5e-3)


def test_fp8_attention_where_te_has_no_backend_is_refused_in_one_line(runs) -> None:
    """SMALL's head_dim is 64: TE would fail at the first forward; train.py refuses first."""
    needs_te()
    if not (9, 0) <= sm() < (10, 0):
        pytest.skip("the head_dim rule is Hopper's")
    # Non-deterministic, so that head_dim is the only rule in the way (on the H100 of
    # 2026-11-24 TE had loaded cuDNN 9.14, and deterministic FP8 attention needs 9.19).
    result = train(
        runs / "fp8-attention-head64", *TE_DELAYED, "--fp8_attention", deterministic=False
    )
    assert result.returncode == 2
    message = message_lines(result.stderr)
    assert len(message) == 1 and "needs head_dim 128" in message[0], message


#: Prints the cuDNN TE runs on and the one torch runs on (None where torch's raises: the
#: version mismatch two cuDNNs in one process give), after the project's TE import, and every
#: cuDNN library file the process has open.
_CUDNN_PROBE = """
import torch
from model_utils.config.te_loader import import_te
te = import_te()
print("te", tuple(te.get_cudnn_version()))
try:
    v = torch.backends.cudnn.version()
    print("torch", (v // 10000, v % 10000 // 100, v % 100))
except RuntimeError:
    print("torch None")
for path in sorted({line.split()[-1] for line in open("/proc/self/maps") if "libcudnn" in line}):
    print("mapped", path)
"""


def cudnn_probe(cudnn_home: str | None = None) -> dict[str, list[str]]:
    """The probe's lines by key, in a fresh process, without or with a user's CUDNN_HOME."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDNN_HOME", "CUDNN_PATH")}
    env |= {"CUDNN_HOME": cudnn_home} if cudnn_home else {}
    probe = subprocess.run(
        [sys.executable, "-c", _CUDNN_PROBE], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert probe.returncode == 0, probe.stderr
    found: dict[str, list[str]] = {}
    for key, value in re.findall(r"^(te|torch|mapped) (.*)$", probe.stdout, flags=re.MULTILINE):
        found.setdefault(key, []).append(value)
    return found


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text))


def other_cudnn_folder() -> str | None:
    """A cuDNN installed beside torch's: the CUDA toolkit's, or the system's (``ldconfig``; on
    the lent H100s, Debian's 9.14 in /lib/x86_64-linux-gnu)."""
    from model_utils.config.te_loader import mapped_cudnn

    torch.backends.cudnn.version()  # torch opens its cuDNN
    torch_cudnn = mapped_cudnn(Path("/proc/self/maps").read_text())
    torch_folder = Path(torch_cudnn).parent.resolve() if torch_cudnn else None
    toolkit = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    candidates = [p.parent for p in sorted(toolkit.glob("**/libcudnn.so*"))]
    ldconfig = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    candidates += [Path(p).parent for p in re.findall(r"libcudnn\.so\S* .*=> (\S+)", ldconfig)]
    for folder in candidates:
        if folder.resolve() != torch_folder:
            return str(folder)
    return None


def test_te_runs_on_the_cudnn_torch_runs_on() -> None:
    """te_loader makes TE load torch's libcudnn and its sub-libraries: TE and torch report the
    same cuDNN, torch's own ``cudnn.version()`` answers, and every cuDNN file open is in
    torch's folder (on the H100 of 2026-11-24, TE alone loaded Debian's 9.14 beside torch's
    9.19, and that call raised)."""
    needs_te()
    found = cudnn_probe()
    assert found["torch"] != ["None"], found
    assert version_tuple(found["te"][0]) == version_tuple(found["torch"][0]), found
    assert len({str(Path(p).parent) for p in found["mapped"]}) == 1, found["mapped"]


def test_deterministic_fp8_attention_on_an_old_cudnn_is_refused_in_one_line(runs) -> None:
    """The cuDNN rule reads the cuDNN TE loaded; here the user points TE (CUDNN_HOME) at
    another cuDNN on the machine (the toolkit's or the system's), where that one is older
    than 9.19."""
    needs_te()
    from model_utils.precision.te_requirements import FP8_ATTENTION_DETERMINISTIC_MIN_CUDNN

    other = other_cudnn_folder()
    if sm() < (9, 0) or other is None:
        pytest.skip("needs Hopper and a second cuDNN beside torch's")
    found = version_tuple(cudnn_probe(other)["te"][0])
    if found >= FP8_ATTENTION_DETERMINISTIC_MIN_CUDNN:
        pytest.skip(f"the cuDNN in {other} is {found}, not older than 9.19")
    result = train(
        runs / "fp8-attention-old-cudnn",
        *TE_DELAYED,
        *HEAD_128,
        "--fp8_attention",
        cudnn_home=other,
    )
    assert result.returncode == 2
    message = message_lines(result.stderr)
    version = ".".join(map(str, found))
    assert len(message) == 1 and f"needs cuDNN >= 9.19.0, found {version}" in message[0], message


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_weights_train_from_fp32_masters_and_resume_exactly(runs, recipe: str) -> None:
    """--fp8_weights --master_weights optimizer: TE's FP8 parameters (quantized_model_init)
    under FSDP2, FusedAdam's fp32 masters seeded from the run's fp32 init. Trains within 2% of
    bf16 parameters with masters per step, resumes from step 5 bit for bit (the FP8 bytes are
    written again from the restored masters), and exports the masters to HF. Without the masters
    flag the run is refused in one line."""
    needs_te()
    te = ("--model_impl=te", "--fp8=1", f"--fp8_recipe={recipe}", "--master_weights=optimizer")
    refused = train(runs / f"fp8-weights-{recipe}-no-masters", *te[:3], "--fp8_weights")
    assert refused.returncode == 2
    message = message_lines(refused.stderr)
    assert len(message) == 1 and "add --master_weights optimizer" in message[0], message
    base = runs / f"te-{recipe}-masters"
    ok(train(base, *te))
    out = runs / f"te-{recipe}-fp8-weights"
    result = train(out, *te, "--fp8_weights", "--checkpoint_freq=5", f"--export_hf={out}/hf")
    ok(result)
    assert "weights FP8 (fp8_model_init)" in result.stdout + result.stderr
    got, want = trains(out), trains(base)
    assert got != want and all(abs(got[s] - want[s]) / want[s] < 0.02 for s in want), (got, want)
    assert got[max(got)] < got[min(got)]
    checkpoint = out / "checkpoints" / "step_00000005"
    resumed = runs / f"te-{recipe}-fp8-weights-resumed"
    ok(train(resumed, *te, "--fp8_weights", f"--resume_from_checkpoint={checkpoint}"))
    assert losses(resumed) == {s: v for s, v in got.items() if s > 5}
    from safetensors import safe_open

    with safe_open(str(out / "hf" / "model.safetensors"), "pt") as fh:  # fp32 masters, not FP8
        assert fh.get_tensor("model.layers.0.mlp.up_proj.weight").dtype == torch.float32


#: TE's separate linears: its fused LayerNormMLP (--model_impl te) has no backward_override.
TE_CURRENT = ("--model_impl=te_linear", "--fp8=1", "--fp8_recipe=current")
#: The gap-closers and levers that landed after the tier last ran on a GPU, each on the recipe
#: it applies to: (base recipe's flags, the lever's flags, largest per-step gap to the base).
LEVERS = {
    "fp8-backward-high-precision": (TE_CURRENT, ("--fp8_backward=high_precision",), 0.03),
    "fp8-backward-dequantized": (TE_CURRENT, ("--fp8_backward=dequantized",), 0.03),
    "short-amax-history": (
        TE_DELAYED,
        ("--amax_history_len=16", "--amax_compute_algo=most_recent"),
        0.03,
    ),
    # SMALL has 2 layers, where 0,-1 would be all of them: layer 0 in BF16 beside FP8's layer 1
    "bf16-first-layer": (TE_DELAYED, ("--bf16_layers=0",), 0.03),
    "fp8-lm-head": (TE_DELAYED, ("--fp8_lm_head",), 0.03),
}


@pytest.mark.parametrize("lever", sorted(LEVERS))
def test_each_gap_closer_trains_near_its_recipe_and_resumes_bit_for_bit(lever: str, runs) -> None:
    """On real TE and CUDA kernels (the CPU tier runs these paths on torchao and the TE double):
    TE's backward_override, delayed scaling's short most_recent history, the first and last
    layers in BF16 and the output layer's GEMMs in FP8 (torch._scaled_mm) each train within
    a few percent of the recipe they change, per step, and a resume from step 5 repeats the
    uninterrupted run bit for bit. (--reduce_dtype fp8 needs 2 GPUs: a world of one reduces
    nothing.)"""
    needs_te()
    base_flags, flags, gap = LEVERS[lever]
    recipe = base_flags[-1].split("=")[1]
    if not recipe_runs_here(recipe):
        pytest.skip(f"{recipe} scaling does not run on SM {sm()}")
    base = runs / f"lever-base-{base_flags[-1].split('=')[1]}"
    if not (base / "metrics.jsonl").exists():
        ok(train(base, *base_flags))
    out = runs / f"lever-{lever}"
    result = train(out, *base_flags, *flags, "--checkpoint_freq=5", "--keep_last=0")
    if lever.startswith("fp8-backward") and result.returncode == 2:  # TE < 2.15 has none
        message = message_lines(result.stderr)
        assert len(message) == 1 and "needs Transformer Engine >= 2.15" in message[0], message
        pytest.skip("TE < 2.15: --fp8_backward is refused in one line, as it must be")
    ok(result)
    got, want = trains(out), trains(base)
    assert got != want and all(abs(got[s] - want[s]) / want[s] < gap for s in want), (got, want)
    resumed = runs / f"lever-{lever}-resumed"
    checkpoint = out / "checkpoints" / "step_00000005"
    ok(train(resumed, *base_flags, *flags, f"--resume_from_checkpoint={checkpoint}"))
    after = {s: v for s, v in got.items() if s > 5}
    if "--model_impl=te_linear" in base_flags:  # HF's SDPA: torch's attention backward is not
        assert losses(resumed) == pytest.approx(after, rel=1e-3)  # deterministic (TE's is)
    else:
        assert losses(resumed) == after


def test_a_bf16_cool_down_on_te_switches_once_and_resumes_across_the_switch(runs) -> None:
    """--bf16_cooldown 0.3 of 10 steps: TE's FP8 autocast for steps 1-7, off for 8-10, said once;
    a resume from step 5 crosses the switch where the uninterrupted run did, bit for bit, and
    the BF16 steps' losses leave FP8's (FP8 is really off)."""
    needs_te()
    if not recipe_runs_here("delayed"):
        pytest.skip(f"FP8 does not run on SM {sm()}")
    flags = (*TE_DELAYED, "--bf16_cooldown=0.3")
    out = runs / "te-delayed-cool-down"
    result = train(out, *flags, "--checkpoint_freq=5", "--keep_last=0")
    ok(result)
    switch = "BF16 cool-down: steps 8-10 train with FP8 off (--bf16_cooldown)"
    assert result.stdout.count("BF16 cool-down") == 1 and switch in result.stdout
    fp8 = runs / "lever-base-delayed"
    if not (fp8 / "metrics.jsonl").exists():
        ok(train(fp8, *TE_DELAYED))
    got, want = trains(out), trains(fp8)
    assert all(got[s] == want[s] for s in range(1, 8)), (got, want)  # the same run until 7
    assert all(got[s] != want[s] for s in range(8, 11)), (got, want)
    resumed = runs / "te-delayed-cool-down-resumed"
    checkpoint = out / "checkpoints" / "step_00000005"
    result = train(resumed, *flags, f"--resume_from_checkpoint={checkpoint}")
    ok(result)
    assert switch in result.stdout
    assert losses(resumed) == {s: v for s, v in got.items() if s > 5}


def profiled(out: Path, *flags: str) -> tuple[object, subprocess.CompletedProcess]:
    """A SMALL run with steps 6-8 traced: rank 0's breakdown and the run's output."""
    from analysis.traces.breakdown import read_rank

    result = train(out, *flags, "--profile_steps=6:8")
    ok(result)
    assert "Profiler trace of step(s) 6-8: " in result.stdout
    got = read_rank(out / "profile" / "step_6" / "rank_0.pt.trace.json.gz", 0)
    assert [s.step for s in got.steps] == [6, 7, 8] and got.gpu
    for step in got.steps:
        assert sum(step.ms.values()) == pytest.approx(step.total_ms, rel=1e-9)
    return got, result


def kernel(key: str) -> str:
    """The kernel's name in a breakdown's ``category\tkernel`` key (a category's own name,
    fp8_matmul, must not count as an FP8 kernel)."""
    return key.split("\t", 1)[1]


def test_a_te_trace_finds_fp8_gemms_under_fp8_only_and_lm_head_in_the_bf16_share(
    runs, capsys
) -> None:
    """On real TE kernels: cuBLAS's FP8 GEMMs (e4m3 in xmma names, qq in nvjet's) appear with
    --fp8=1, in the share FP8 can run, and not at all with --fp8=0; lm_head's GEMMs (launched
    inside the lm_head range, its backward linked to it) are bf16 kernels in the other share."""
    needs_te()
    from analysis import step_breakdown
    from analysis.traces.rules import fp8_named

    got = {}
    for precision, flags in (("bf16", impl_flags("te", "bf16")), ("fp8", TE_DELAYED)):
        got[precision], _ = profiled(runs / f"profiled-te-{precision}", *flags)
        head = [k for k in got[precision].gemm_names if k.startswith("bf16_matmul\t")]
        assert head and not any(fp8_named(kernel(k)) for k in head), got[precision].gemm_names
    fp8_gemms = [k for k in got["fp8"].gemm_names if fp8_named(kernel(k))]
    assert got["fp8"].fp8_gemm_ms > 0 and all(k.startswith("fp8_matmul\t") for k in fp8_gemms)
    assert got["bf16"].fp8_gemm_ms == 0
    bf16_kernels = [kernel(k) for k in got["bf16"].gemm_names]
    assert not any(fp8_named(k) for k in bf16_kernels), bf16_kernels
    assert got["fp8"].ms["fp8_cast"] > 0 and got["bf16"].ms["fp8_cast"] == 0
    runs_given = [str(runs / "profiled-te-bf16"), str(runs / "profiled-te-fp8")]
    assert step_breakdown.main(runs_given) == 0
    out = capsys.readouterr().out
    assert "The matmuls FP8 can run were " in out and "; ceiling " in out


@pytest.mark.parametrize("feature", ["compile", "activation_checkpointing"])
def test_profiling_works_with_compile_and_recompute(runs, feature: str) -> None:
    needs_te()
    got, _ = profiled(runs / f"profiled-te-fp8-{feature}", *TE_DELAYED, f"--{feature}")
    assert got.fp8_gemm_ms > 0 and got.ms["bf16_matmul"] > 0


#: Llama3-8B's layer width on 2 layers, one 8k window per sequence: micro-batch 1 fits an H100
#: easily, 24 (~110 GB of activations by arithmetic) does not. The bundled corpus holds 7
#: validation windows of 8192 tokens, so validation reads one window whatever the micro-batch.
OOM_SHAPE = (
    "--model_impl=hf",
    "--fp8=0",
    "--hidden_width=4096",
    "--num_heads=32",
    "--num_key_value_heads=8",
    "--intermediate_size=14336",
    "--num_layers=2",
    "--max_context_width=8192",
    "--warmup=0",
    "--validation_batches=1",
    "--val_batch_size=1",  # validation is not the point: one window, whatever the micro-batch
)


def test_an_oversized_micro_batch_is_one_line_with_a_readable_snapshot(runs) -> None:
    """--memory_snapshot_step: a snapshot after step 1; then a resume at 24x the micro-batch
    runs out of memory in step 2: one line (exit 1) naming the snapshot and the levers, the
    snapshot loads (segments and the allocator's history), and the checkpoint of step 1 is
    intact."""
    import pickle

    from model_utils.checkpoint import complete_checkpoints

    out = runs / "oom"
    first = train(
        out, *OOM_SHAPE, "--train_batch_size=1", "--max_steps=1", "--memory_snapshot_step=1"
    )
    ok(first)
    with open(out / "memory" / "step_1_rank_0.pickle", "rb") as f:
        assert "segments" in pickle.load(f)
    result = train(
        out,
        *OOM_SHAPE,
        "--train_batch_size=24",
        "--max_steps=2",
        "--memory_snapshot_step=0",
        "--resume_from_checkpoint=auto",
    )
    assert result.returncode == 1, launch_report(result)
    message = message_lines(result.stderr)
    assert len(message) == 1 and "step 2 ran out of GPU memory" in message[0], message
    snapshot = out / "memory" / "oom_step_2_rank_0.pickle"
    for words in (str(snapshot), "--train_batch_size", "--activation_checkpointing", "memory_viz"):
        assert words in message[0], message
    with open(snapshot, "rb") as f:
        loaded = pickle.load(f)
    assert loaded["segments"] and "device_traces" in loaded
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step_00000001"]


FLIGHT_RECORDER_WORKER = """
import sys, time, torch, torch.distributed as dist
from model_utils.parallel import distributed
from model_utils.run import watchdog
out = sys.argv[1]
world = distributed.world_from_env()
device = distributed.device_for(world)
watchdog.enable_flight_recorder(out, world.rank)  # what train.main does on CUDA
distributed.init(world, device, 60)
for _ in range(3):
    dist.all_reduce(torch.ones(1024, device=device))
torch.cuda.synchronize()
dog = watchdog.Watchdog(1.0, out, world.rank, flight_recorder=True)
dog.start()
time.sleep(60)  # no step: the watchdog writes the stacks and the recorder, and exits 4
"""


def test_flight_recorder_dumps_into_the_run_folder(tmp_path: Path) -> None:
    """NCCL with the variables train.py sets: the hang watchdog's dump holds this rank's
    collectives, lands in <run>/flight_recorder/rank_0, and PyTorch's analyser reads it."""
    import pickle

    from helpers.procs import free_port, rank_env

    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **rank_env(0, 1, free_port()), "PYTHONPATH": path}
    for name in list(env):
        if name.startswith(("TORCH_FR_", "TORCH_NCCL_TRACE", "TORCH_NCCL_DEBUG_INFO")):
            del env[name]  # the run folder's settings, not the machine's
    result = subprocess.run(
        [sys.executable, "-c", FLIGHT_RECORDER_WORKER, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 4, launch_report(result)
    assert (tmp_path / "hang" / "stacks.rank0.txt").read_text().count('File "') > 0
    dump = tmp_path / "flight_recorder" / "rank_0"
    assert f"NCCL Flight Recorder in {dump}" in result.stdout + result.stderr
    entries = pickle.loads(dump.read_bytes())["entries"]
    assert sum("all_reduce" in e["profiling_name"] for e in entries) >= 3, entries[:3]
    analysed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace"]
        + [str(dump.parent), "--prefix", "rank_", "-j"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert analysed.returncode == 0, analysed.stdout[-2000:] + analysed.stderr[-2000:]
    assert "all_reduce" in analysed.stdout + analysed.stderr
