"""Multi-process behaviour of the trainer: real gloo process groups, launched the ways users do.

- 1-rank and 2-rank FSDP2 training agree bit for bit on the same global batch (bf16, torchao FP8
  emulated, FP8 with float8 all-gather), starting from identical weights;
- the float8 all-gather really moves float8 bytes (about half of bf16's) and the scales are
  recomputed after every optimizer step;
- activation checkpointing and torch.compile run under 2 ranks; HSDP runs on a 2-node mesh made
  by two torchrun agents (c10d rendezvous) and matches full sharding;
- meta-device init: each of 2 ranks grows by about half of a 1.3 GB model, one rank by all of it;
- a killed or hung rank ends the job with a non-zero exit (torchrun, plain env, srun-style env);
- Slurm-only environments give the right world, also without `scontrol`.

The workers are tests/dist_scripts/*.py (built from the product's functions, fed fixed batches)
and train.py itself. Every launch pins one thread per process (torchrun's default), so the
2-core machine runs two ranks without oversubscription.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.procs import PYTHON, free_port, rank_env, torchrun_cmd, warm_env

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "dist_scripts"


LAUNCH_TIMEOUT_S = 240
STEPS = 5  # tests/dist_scripts/parity.py STEPS
# A small train.py run for the failure tests: the tiny preset with short sequences, in fp32
# (bf16 matmuls are tens of times slower than fp32 on a CPU without bf16 units).
TRAIN_ARGV = [
    str(REPO / "train.py"),
    "--preset",
    "tiny",
    "--bf16=0",
    "--train_batch_size",
    "2",
    "--max_context_width",
    "64",
    "--max_steps",
    "100000",
    "--warmup",
    "1",
    "--logging_freq",
    "1",
    "--checkpoint_freq",
    "0",
]
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
)


# ============================================================================================
# Launch helpers


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any launcher/Slurm variables it may itself run under."""
    env = {
        k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")
    }
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def run_torchrun(args: list[str], log: Path, nproc: int, warm: bool = True) -> None:
    """torchrun on one node with a free port; fails the test with the log tail on error.
    ``warm=False``: every process a fresh interpreter (what a memory figure is compared to)."""
    cmd = torchrun_cmd(*args, nproc=nproc, python=PYTHON if warm else sys.executable)
    with log.open("w") as out:
        proc = subprocess.run(
            cmd,
            env=warm_env(clean_env()) if warm else clean_env(),
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=LAUNCH_TIMEOUT_S,
            check=False,
        )
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{tail(log)}"


def wait_for_line(path: Path, text: str, procs: list[subprocess.Popen], timeout: float) -> None:
    """Block until `text` appears in the log; fail early if a process already exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in path.read_text(errors="replace"):
            return
        exited = [p.returncode for p in procs if p.poll() is not None]
        assert not exited, f"exited ({exited}) before {text!r}:\n{tail(path)}"
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not seen within {timeout}s:\n{tail(path)}")


def children_by_rank(pid: int) -> dict[int, int]:
    """torchrun's worker processes, keyed by the RANK in their environment."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            env = dict(
                item.split(b"=", 1)
                for item in (entry / "environ").read_bytes().split(b"\0")
                if b"=" in item
            )
        except OSError:
            continue
        if b"RANK" in env:
            out[int(env[b"RANK"])] = int(entry.name)
    return out


def popen_logged(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start `cmd` with stdout+stderr into `log` (the child keeps its own file descriptor)."""
    with log.open("w") as out:
        return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)


def wait_exit(proc: subprocess.Popen, timeout: float) -> tuple[int | None, float]:
    """(return code or None if still running after `timeout`, seconds waited)."""
    start = time.monotonic()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - start
    return proc.returncode, time.monotonic() - start


def stop_all(procs: list[subprocess.Popen]) -> None:
    """Kill what a test started (also a SIGSTOPped process: SIGKILL works on it)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)


# ============================================================================================
# Launches shared by several tests (module scope: each runs once)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dist")


def load_parity(workdir: Path, world_size: int, strategy: str = "full") -> dict[str, Any]:
    return json.loads((workdir / f"parity_w{world_size}_{strategy}.json").read_text())


@pytest.fixture(scope="module")
def one_rank(workdir: Path) -> dict[str, Any]:
    """Single process, accumulating the two halves of each global batch as two micro-batches."""
    script = [str(SCRIPTS / "parity.py"), str(workdir), "--modes", "bf16,fp8,fp8_ag"]
    run_torchrun([*script, "--grad_accum", "2"], workdir / "parity_w1.log", nproc=1)
    return load_parity(workdir, 1)


@pytest.fixture(scope="module")
def two_ranks(workdir: Path) -> dict[str, Any]:
    modes = (
        "bf16,fp8,fp8_ag,bf16_ac,fp8_ac_mlp,bf16_compile,fp8_ag_keep,bf16_masters,fp8_ag_masters"
    )
    script = [str(SCRIPTS / "parity.py"), str(workdir), "--modes", modes]
    run_torchrun(script, workdir / "parity_w2.log", nproc=2)
    return load_parity(workdir, 2)


@pytest.fixture(scope="module")
def quarters(workdir: Path) -> dict[int, dict[str, Any]]:
    """The global batch in quarters: one rank accumulating 4, two ranks accumulating 2 each
    (equal micro-batch shapes, so bf16 rounding is the same in both)."""
    out = workdir / "quarters"
    out.mkdir()
    script = [str(SCRIPTS / "parity.py"), str(out), "--modes", "bf16"]
    run_torchrun([*script, "--grad_accum", "4"], workdir / "quarters_w1.log", nproc=1)
    run_torchrun([*script, "--grad_accum", "2"], workdir / "quarters_w2.log", nproc=2)
    return {w: load_parity(out, w)["modes"]["bf16"] for w in (1, 2)}


@pytest.fixture(scope="module")
def hybrid(workdir: Path) -> dict[str, Any]:
    """Two torchrun agents ("nodes") of one worker each, joined by c10d rendezvous on localhost."""
    port = free_port()
    script = [str(SCRIPTS / "parity.py"), str(workdir), "--modes", "bf16,fp8_ag", "--hybrid"]
    procs, logs = [], []
    for node in range(2):
        logs.append(workdir / f"hybrid_node{node}.log")
        rendezvous = ("--nnodes=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}")
        cmd = torchrun_cmd(*script, nproc=1, launcher=(*rendezvous, "--rdzv_id=hsdp-test"))
        procs.append(popen_logged(cmd, warm_env(clean_env()), logs[-1]))
    try:
        codes = [wait_exit(p, LAUNCH_TIMEOUT_S)[0] for p in procs]
    finally:
        stop_all(procs)
    assert codes == [0, 0], "\n".join(tail(log) for log in logs)
    return load_parity(workdir, 2, "hybrid")


@pytest.fixture(scope="module")
def memory(workdir: Path) -> dict[int, list[dict[str, Any]]]:
    """RSS of 2 torchrun ranks and, for contrast, of one plain process (a world of one)."""
    out = workdir / "memory"
    out.mkdir()
    run_torchrun(
        [str(SCRIPTS / "memory.py"), str(out)], workdir / "memory_w2.log", nproc=2, warm=False
    )
    with (workdir / "memory_w1.log").open("w") as log:
        proc = subprocess.run(
            [sys.executable, str(SCRIPTS / "memory.py"), str(out)],
            env=clean_env(),
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=LAUNCH_TIMEOUT_S,
            check=False,
        )
    assert proc.returncode == 0, tail(workdir / "memory_w1.log")
    return {
        w: [json.loads(p.read_text()) for p in sorted(out.glob(f"memory_w{w}_rank*.json"))]
        for w in (1, 2)
    }


# ============================================================================================
# 1 rank vs 2 ranks


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16", "fp8", "fp8_ag"])
def test_initial_weights_do_not_depend_on_world_size(
    workdir: Path, one_rank: dict, two_ranks: dict, mode: str
) -> None:
    single = torch.load(workdir / f"init_{mode}_w1_full.pt")
    sharded = torch.load(workdir / f"init_{mode}_w2_full.pt")
    assert single.keys() == sharded.keys()
    different = [k for k in single if not torch.equal(single[k], sharded[k])]
    assert not different, f"initial values differ between 1 and 2 ranks: {different}"
    # Not vacuous: matrices are random N(0, 0.02) and differ from each other.
    q0, q1 = (single[f"model.layers.{i}.self_attn.q_proj.weight"] for i in (0, 1))
    assert 0.015 < q0.std().item() < 0.025 and not torch.equal(q0, q1)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16", "fp8", "fp8_ag"])
def test_two_ranks_train_exactly_like_one(one_rank: dict, two_ranks: dict, mode: str) -> None:
    """Same global batch per step: the 2-rank losses equal the 1-rank ones (bit-identical on
    this machine; allowed 1e-6 relative), and the loss really moves, so a no-op would fail."""
    single, sharded = one_rank["modes"][mode], two_ranks["modes"][mode]
    print(f"\n{mode}: 1 rank {single['losses']}\n{mode}: 2 ranks {sharded['losses']}")
    assert sharded["losses"] == pytest.approx(single["losses"], rel=1e-6, abs=0)
    assert sharded["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-5)
    assert single["losses"][0] - single["losses"][-1] > 0.3
    assert sharded["finite"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "fp32_masters"), [("bf16_masters", "bf16"), ("fp8_ag_masters", "fp8_ag")]
)
def test_master_weights_in_the_optimizer_train_like_fp32_parameters(
    two_ranks: dict, mode: str, fp32_masters: str
) -> None:
    """--master_weights optimizer on 2 ranks, alone and with torchao's float8 all-gather: every
    parameter is a bf16 DTensor shard with an fp32 DTensor master in AdamW, and the losses stay
    within 0.5% of the run whose fp32 parameters are the masters (the same AdamW on the same
    values; what differs is bf16 gradients and the rounding of each parameter)."""
    ours, reference = two_ranks["modes"][mode], two_ranks["modes"][fp32_masters]
    print(f"\n{mode}: {ours['losses']}\n{fp32_masters}: {reference['losses']}")
    dtypes = ours["dtypes"]
    assert dtypes["params"] == ["torch.bfloat16"] and dtypes["shards"] == ["DTensor"]
    assert dtypes["masters"] == ["torch.float32"] and dtypes["master_shards"] == ["DTensor"]
    assert dtypes["masters_kept"] == dtypes["num_params"]
    assert reference["dtypes"]["params"] == ["torch.float32"]
    assert reference["dtypes"]["masters_kept"] == 0
    assert ours["losses"] == pytest.approx(reference["losses"], rel=5e-3)
    assert ours["losses"] != reference["losses"]  # bf16 gradients: not the same run
    assert ours["losses"][0] - ours["losses"][-1] > 0.3 and ours["finite"]


@pytest.mark.slow
def test_accumulating_on_two_ranks_trains_like_one(quarters: dict) -> None:
    """Gradients reduce-scattered after every micro-batch (not held unsharded until the last)
    sum to the same step: losses equal the one-rank run's up to fp32 summation order."""
    assert quarters[2]["finite"] and quarters[2]["losses"][-1] < quarters[2]["losses"][0]
    assert quarters[2]["losses"] == pytest.approx(quarters[1]["losses"], rel=1e-5)
    assert quarters[2]["grad_norms"] == pytest.approx(quarters[1]["grad_norms"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16", "fp8_ag"])
def test_binding_clip_reaches_the_limit_on_two_ranks(two_ranks: dict, mode: str) -> None:
    """train.py's clip (step.clip_grad_norm) with a limit that binds: the global gradient norm
    afterwards equals the limit across both ranks' shards."""
    clip = two_ranks["modes"][mode]["binding_clip"]
    assert clip["before"] > 0
    assert clip["after"] == pytest.approx(clip["limit"], rel=1e-4)


@pytest.mark.slow
def test_fp8_runs_really_differ_from_bf16(two_ranks: dict) -> None:
    """Control for the FP8 parity: the FP8 modes quantise (their losses leave bf16's), so their
    1-vs-2-rank agreement is not a bf16 comparison in disguise; and they stay within 2% of it."""
    bf16 = two_ranks["modes"]["bf16"]["losses"]
    assert two_ranks["modes"]["fp8"]["float8_linears"] == 14  # every linear but lm_head
    for mode in ("fp8", "fp8_ag"):
        losses = two_ranks["modes"][mode]["losses"]
        gap = max(abs(a - b) for a, b in zip(losses, bf16, strict=True))
        assert gap > 1e-3, f"{mode} losses equal bf16's: FP8 was not applied"
        assert all(abs(a - b) / b < 0.02 for a, b in zip(losses, bf16, strict=True)), (mode, losses)


# ============================================================================================
# FP8 all-gather


def layer_all_gather_bytes(result: dict[str, Any], world_size: int) -> tuple[int, int]:
    """Expected bytes one rank contributes to a decoder layer's all-gather: (float8, bf16)."""
    linear, norm = result["layer_numels"]["linear"], result["layer_numels"]["norm"]
    return (linear + 2 * norm) // world_size, 2 * (linear + norm) // world_size


@pytest.mark.slow
def test_fp8_all_gather_moves_float8_bytes(two_ranks: dict) -> None:
    fp8, bf16 = two_ranks["modes"]["fp8_ag"], two_ranks["modes"]["bf16"]
    # What torchao hands FSDP2 for every float8 weight: e4m3 data, never the bf16/fp32 weight.
    dtypes = {c["dtype"] for c in fp8["pre_all_gather"]}
    assert dtypes == {"torch.float8_e4m3fn"}, dtypes
    assert len(fp8["pre_all_gather"]) >= fp8["float8_linears"]
    # What goes on the wire: each decoder layer's unit as bytes (float8 linears + bf16 norms,
    # ~half of bf16), forward and backward re-gathers alike; the embedding unit and the
    # [norm, lm_head] unit in bf16, the same calls in both runs (never float8). The root holds
    # no parameters and gathers nothing.
    expect_fp8, expect_bf16 = layer_all_gather_bytes(fp8, two_ranks["world_size"])
    layers_fp8 = [c for c in fp8["all_gathers"] if c["dtype"] == "torch.uint8"]
    others_fp8 = [c for c in fp8["all_gathers"] if c["dtype"] != "torch.uint8"]
    layers_bf16 = [c for c in bf16["all_gathers"] if c["bytes"] == expect_bf16]
    others_bf16 = [c for c in bf16["all_gathers"] if c["bytes"] != expect_bf16]
    print(f"\none rank's decoder-layer all-gather: fp8 {layers_fp8[0]}, bf16 {layers_bf16[0]}")
    assert others_fp8 == others_bf16 and len(others_bf16) >= 2
    assert all(c["dtype"] == "torch.bfloat16" for c in others_bf16)
    assert layers_fp8 and all(
        c == {"op": c["op"], "dtype": "torch.uint8", "bytes": expect_fp8} for c in layers_fp8
    ), layers_fp8
    assert all(c["dtype"] == "torch.bfloat16" for c in layers_bf16)
    assert len(layers_fp8) == len(layers_bf16) >= fp8["float8_linears"] // 7
    assert expect_fp8 / expect_bf16 < 0.52


@pytest.mark.slow
def test_fp8_scales_are_precomputed_after_every_optimizer_step(two_ranks: dict) -> None:
    fp8 = two_ranks["modes"]["fp8_ag"]
    assert fp8["precompute_calls"] == STEPS
    # After each step every float8 weight's scale equals fp8_max / amax(current full weight).
    assert fp8["scale_mismatches"] == [[]] * STEPS
    # Without float8 all-gather there is nothing to precompute.
    assert two_ranks["modes"]["fp8"]["precompute_calls"] == 0


# ============================================================================================
# Activation checkpointing, compile, HSDP


@pytest.mark.slow
def test_activation_checkpointing_under_two_ranks_changes_nothing(two_ranks: dict) -> None:
    modes = two_ranks["modes"]
    assert modes["bf16_ac"]["losses"] == modes["bf16"]["losses"]
    assert modes["bf16_ac"]["grad_norms"] == modes["bf16"]["grad_norms"]
    # Only the MLPs recomputed, through torchao's FP8 linears (dynamic scales: the recompute
    # derives the same scales from the same activations).
    assert modes["fp8_ac_mlp"]["losses"] == modes["fp8"]["losses"]
    assert modes["fp8_ac_mlp"]["grad_norms"] == modes["fp8"]["grad_norms"]


@pytest.mark.slow
def test_keeping_gathered_weights_for_backward_changes_nothing_but_the_gathers(
    two_ranks: dict,
) -> None:
    """--reshard_after_forward never with float8 all-gather on 2 ranks: the same losses and
    gradient norms, bit for bit, and step 0's backward gathers nothing again (the default
    re-gathers every decoder layer and the embedding, in float8 for the layers)."""
    modes = two_ranks["modes"]
    keep, default = modes["fp8_ag_keep"], modes["fp8_ag"]
    assert keep["losses"] == default["losses"]
    assert keep["grad_norms"] == default["grad_norms"]
    assert keep["scale_mismatches"] == default["scale_mismatches"]
    print(f"\nstep 0 all-gathers: default {default['all_gathers']}\nkept {keep['all_gathers']}")
    units = 1 + 2 + 1  # the embedding, tiny's 2 decoder layers, [norm, lm_head]
    assert keep["all_gathers"] == default["all_gathers"][:units]  # the forward's, and no more
    again = [c["dtype"] for c in default["all_gathers"][units:]]  # the embedding and layer 0
    assert sorted(again) == ["torch.bfloat16", "torch.uint8"]


@pytest.mark.slow
def test_compile_under_two_ranks_trains_like_eager(two_ranks: dict) -> None:
    """Inductor fuses bf16 ops differently, so close rather than equal (measured <= 4e-3)."""
    modes = two_ranks["modes"]
    print(f"\neager {modes['bf16']['losses']}\ncompiled {modes['bf16_compile']['losses']}")
    assert modes["bf16_compile"]["finite"]
    assert modes["bf16_compile"]["losses"] == pytest.approx(modes["bf16"]["losses"], abs=1e-2)


@pytest.mark.slow
def test_hybrid_sharding_on_two_nodes_matches_full_sharding(hybrid: dict, two_ranks: dict) -> None:
    assert (hybrid["world_size"], hybrid["num_nodes"]) == (2, 2)
    for mode in ("bf16", "fp8_ag"):
        result = hybrid["modes"][mode]
        # Replicate across the 2 nodes, shard within each (1 rank): no parameter all-gather.
        assert result["mesh"] == {"shape": [2, 1], "dim_names": ["replicate", "shard"]}
        assert result["all_gathers"] == []
        assert result["finite"]
        assert result["losses"] == pytest.approx(two_ranks["modes"][mode]["losses"], rel=1e-6)


# ============================================================================================
# Meta-device init memory


@pytest.mark.slow
def test_meta_device_init_keeps_each_rank_at_its_shard(memory: dict) -> None:
    mib = 2**20
    for r in memory[1] + memory[2]:
        print(
            f"\nworld {r['world_size']} rank {r['rank']}: model {r['full_bytes'] / mib:.0f} MiB, "
            f"shard {r['local_bytes'] / mib:.0f} MiB, RSS +{r['growth'] / mib:.0f} MiB "
            f"(peak +{r['peak_growth'] / mib:.0f} MiB), {r['seconds']:.1f} s"
        )
        assert not r["on_meta"]
    assert len(memory[2]) == 2 and len(memory[1]) == 1
    for r in memory[2]:
        assert r["full_bytes"] > 1.2e9
        assert r["local_bytes"] == r["full_bytes"] // 2
        assert r["growth"] < 0.75 * r["full_bytes"]
        assert r["peak_growth"] < 0.75 * r["full_bytes"]
    # Contrast: the same measurement sees a whole model when one process holds it all.
    assert memory[1][0]["growth"] > 0.95 * memory[1][0]["full_bytes"]


# ============================================================================================
# A dead or hung rank ends the job


@pytest.mark.slow
def test_torchrun_job_exits_nonzero_when_a_worker_is_killed(tmp_path: Path) -> None:
    log = tmp_path / "torchrun.log"
    cmd = torchrun_cmd(  # cold: the workers are found as the agent's children
        *TRAIN_ARGV,
        "--dist_timeout",
        "30",
        "--output_dir",
        str(tmp_path / "run"),
        nproc=2,
        python=sys.executable,
    )
    agent = popen_logged(cmd, clean_env(), log)
    try:
        wait_for_line(log, "Batch 2 ", [agent], LAUNCH_TIMEOUT_S)
        workers = children_by_rank(agent.pid)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[1], signal.SIGKILL)
        code, seconds = wait_exit(agent, 120)
    finally:
        stop_all([agent])
    print(f"\ntorchrun exited {code} {seconds:.1f} s after rank 1 was killed")
    assert code is not None, f"torchrun still running 120 s after a worker died:\n{tail(log)}"
    assert code != 0
    assert "SIGKILL" in tail(log)


def start_ranks(
    env_per_rank: list[dict[str, str]], argv: list[str], logs: list[Path]
) -> list[subprocess.Popen]:
    """One plain `python` process per rank, as srun (or a hand launch) would start them."""
    pairs = zip(env_per_rank, logs, strict=True)
    return [popen_logged([sys.executable, *argv], env, log) for env, log in pairs]


@pytest.mark.slow
def test_plain_env_survivor_exits_nonzero_when_its_peer_is_killed(tmp_path: Path) -> None:
    """Two `python train.py` processes with torchrun-style variables but no agent to clean up:
    the survivor itself must notice (gloo sees the connection drop) and exit."""
    port = free_port()
    envs = [clean_env(**rank_env(r, 2, port)) for r in range(2)]
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    argv = [*TRAIN_ARGV, "--dist_timeout", "30", "--output_dir", str(tmp_path / "run")]
    procs = start_ranks(envs, argv, logs)
    try:
        wait_for_line(logs[0], "Batch 2 ", procs, LAUNCH_TIMEOUT_S)
        procs[1].kill()
        code, seconds = wait_exit(procs[0], 30 + 60)
    finally:
        stop_all(procs)
    print(f"\nrank 0 exited {code} {seconds:.1f} s after rank 1 was killed")
    assert code is not None, f"rank 0 hangs after its peer died:\n{tail(logs[0])}"
    assert code != 0


@pytest.mark.slow
def test_srun_style_world_trains_and_a_hung_rank_times_out(tmp_path: Path) -> None:
    """Only Slurm's variables (as `srun python train.py` gives them), no MASTER_ADDR/PORT and
    no scontrol on PATH: the world and the rendezvous come from SLURM_*. Then one rank hangs
    (SIGSTOP, its sockets stay open so nothing is noticed by connection loss): the other must
    fail after --dist_timeout instead of waiting forever."""
    timeout_s = 10
    port = free_port(29500, 30500)  # distributed.init derives 29500 + SLURM_JOB_ID % 1000
    no_scontrol = tmp_path / "bin"
    no_scontrol.mkdir()
    envs = [
        clean_env(
            SLURM_PROCID=str(r),
            SLURM_NTASKS="2",
            SLURM_LOCALID=str(r),
            SLURM_TASKS_PER_NODE="2",
            SLURM_JOB_ID=str(7000 + port - 29500),
            SLURM_JOB_NODELIST="localhost",
            PATH=str(no_scontrol),
        )
        for r in range(2)
    ]
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    argv = [*TRAIN_ARGV, "--dist_timeout", str(timeout_s), "--output_dir", str(tmp_path / "run")]
    procs = start_ranks(envs, argv, logs)
    try:
        wait_for_line(logs[0], "Batch 3 ", procs, LAUNCH_TIMEOUT_S)
        os.kill(procs[1].pid, signal.SIGSTOP)
        code, seconds = wait_exit(procs[0], timeout_s + 60)
    finally:
        stop_all(procs)
    log0 = logs[0].read_text(errors="replace")
    print(f"\nrank 0 exited {code} {seconds:.1f} s after rank 1 hung (--dist_timeout {timeout_s})")
    assert "world: 2 ranks (1 nodes)" in log0
    assert code is not None, (
        f"rank 0 still waiting {timeout_s + 60} s after a hang:\n{log0[-3000:]}"
    )
    assert code != 0
    assert "Timed out" in log0 or "timeout" in log0.lower()
