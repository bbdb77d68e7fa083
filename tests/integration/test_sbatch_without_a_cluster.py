"""1.train_llama.sbatch without a Slurm cluster: on this machine without Slurm (`bash
1.train_llama.sbatch` runs torchrun here, local runs ~1 min), and, for what needs hardware this
machine lacks (GPUs, nodes, Pyxis), with recording stand-ins for srun/scontrol/torchrun that
show exactly what the script would run (~10 s). The real clusters: test_slurm_e2e.py. A module
of its own so that pytest-xdist runs it beside the cluster tests."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.procs import processes_mentioning, signal_after, warm_venv
from helpers.slurm import PREEMPTED, SBATCH, clean_env, seed_losses

REPO = Path(__file__).resolve().parents[2]


def warm_launch(tmp_path: Path) -> dict[str, str]:
    """A launch of two CPU workers whose Python processes (the launcher's check, torchrun, the
    workers) start warm: for the tests of what the launcher decides, and for the plain training
    run. A user's own start stays cold in the USR1 test (its forwarder finds the workers as
    torchrun's children): it trains, saves and resumes through fresh interpreters, as the demo
    and the Slurm jobs do."""
    return {**warm_venv(tmp_path / "venv"), "NPROC_PER_NODE": "2"}


# --------------------------------------------------------------------------------------
# No Slurm: `bash 1.train_llama.sbatch` runs torchrun here


@pytest.mark.slow
def test_bash_without_slurm_trains_here(tmp_path: Path) -> None:
    env = clean_env(**warm_launch(tmp_path / "warm"), RUNS_DIR=str(tmp_path), RUN_NAME="laptop")
    # No --warmup: the default follows --max_steps (a fixed 10 would refuse a 2-step run).
    # fp32 (--bf16=0): bf16 matmuls are 20-60x slower on a CPU without bf16 units.
    args = ["--preset", "tiny", "--max_steps", "2", "--fp8=0", "--bf16=0"]
    args += ["--train_batch_size", "2"]
    result = run_script(env, *args, cwd=tmp_path, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert "no Slurm job: running torchrun" in log
    assert "network:" not in log  # gloo on CPU: no NCCL network to describe
    assert sorted(seed_losses(log)) == [1, 2] and "final train loss" in log, log
    assert (tmp_path / "laptop" / "checkpoints").is_dir()


def test_bad_arguments_through_the_launcher_give_one_line(tmp_path: Path) -> None:
    """train.py's own check, once, before torchrun: no traceback, no empty run folder."""
    env = clean_env(**warm_launch(tmp_path), RUNS_DIR=str(tmp_path / "runs"), RUN_NAME="bad")
    result = run_script(env, "--preset", "tiny", "--lr", "inf", cwd=tmp_path, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        "train.py: error: --lr must be a finite number > 0, got inf"
    ]
    assert "torchrun" not in result.stdout and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"RUNS_DIR": "/proc/llama-runs"}, "--output_dir /proc/llama-runs/r cannot be written"),
        ({"RUN_NAME": "r" * 300}, "is 300 bytes long; file systems take at most 255"),
    ],
)
def test_a_run_folder_that_cannot_be_made_here_is_one_line(
    tmp_path: Path, settings: dict[str, str], message: str
) -> None:
    """Without Slurm the folders are train.py's: its check before torchrun writes where the
    run will, so a folder it cannot make is its one line, and the launch makes none."""
    env = clean_env(
        **warm_launch(tmp_path), **{"RUNS_DIR": str(tmp_path / "runs"), "RUN_NAME": "r", **settings}
    )
    result = run_script(env, "--preset", "tiny", cwd=tmp_path, timeout=120)
    [line] = result.stderr.strip().splitlines()
    assert result.returncode == 2 and message in line, result.stdout + result.stderr
    assert "torchrun" not in result.stdout and not (tmp_path / "runs").exists()


def test_a_refusal_only_a_worker_sees_leaves_no_run_folder(tmp_path: Path) -> None:
    """The check before torchrun reads the first rank's share of the validation text; rank 1's
    share (one short document) is refused only once training starts. The launch then leaves
    no empty run folder or lock behind (it used to make both before torchrun)."""
    data = tmp_path / "data"
    data.mkdir()
    words = "in the beginning god created the heaven and the earth".split()
    train = [{"text": " ".join(words[(i + j) % 10] for j in range(60))} for i in range(200)]
    held_out = [{"text": " ".join(words * 400)}, {"text": "amen"}]  # a document per rank
    for name, docs in (("train", train), ("validation", held_out)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    env = clean_env(**warm_launch(tmp_path), RUNS_DIR=str(tmp_path / "runs"), RUN_NAME="x")
    args = ["--preset", "tiny", "--bf16=0", "--dataset", str(data), "--validation_batches", "1"]
    result = run_script(env, *args, cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "in shard 1 of 2 (a rank's part)" in result.stderr and "torchrun" in result.stdout
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("flag", ["--help", "--validate_only"])
def test_help_and_validate_only_through_the_launcher_start_no_training(
    tmp_path: Path, flag: str
) -> None:
    """They used to start torchrun anyway (--help printed three times) and leave an empty
    run folder."""
    env = clean_env(**warm_launch(tmp_path), RUNS_DIR=str(tmp_path / "runs"))
    result = run_script(env, "--preset", "tiny", flag, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("usage: train.py") == (flag == "--help")
    run = tmp_path / "runs" / "local-fp8"
    if flag == "--help":  # what the launcher adds to the user's arguments, before train.py's help
        assert (
            "--preset llama2-7b --fp8=1 --checkpoint_freq 500 "
            f"--output_dir {run} --resume_from_checkpoint auto --preset tiny --help"
        ) in result.stdout
    else:  # one line with the run as resolved, told the world the launch would start
        assert "train.py: ready: --preset tiny, fp8 tensorwise on --model_impl hf, world 2, " in (
            result.stdout
        )
        assert f"run folder {run}, resume auto" in result.stdout
    assert "running torchrun" not in result.stdout
    assert not (tmp_path / "runs").exists()


def test_relative_paths_are_read_from_where_the_script_is_run(tmp_path: Path) -> None:
    """`bash repo/1.train_llama.sbatch` from a project folder: RUNS_DIR, an @FILE and the path
    flags in it are that folder's, though the launch runs in the checkout (they were the
    checkout's: the run went into it, the file and the data were not found)."""
    (tmp_path / "d").mkdir()
    shutil.copy(REPO / "data" / "kjv.jsonl.gz", tmp_path / "d" / "kjv.jsonl.gz")
    (tmp_path / "my.args").write_text(
        "--preset tiny\n--output_dir rel_out\n--dataset d/kjv.jsonl.gz\n"
    )
    env = clean_env(**warm_launch(tmp_path), RUNS_DIR="myruns")
    for args, folder in (([], "myruns/local-fp8"), (["@my.args"], "rel_out")):
        result = run_script(env, "--preset", "tiny", *args, "--validate_only", cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"run folder {tmp_path / folder}, resume auto" in result.stdout, result.stdout
    assert not (REPO / "rel_out").exists() and not (REPO / "myruns").exists()


@pytest.mark.slow
def test_usr1_to_the_local_launcher_checkpoints_and_leaves_no_worker(tmp_path: Path) -> None:
    """`kill -USR1` of `bash 1.train_llama.sbatch` used to kill torchrun and orphan the
    workers; now the launcher forwards it, the workers save and exit, and it exits 0. The
    same command then resumes (no RUN_NAME: the run folder is runs/local-fp32, named by the
    precision, not a new one). fp32: bf16 matmuls are 20-60x slower on a CPU without bf16
    units."""
    env = clean_env(RUNS_DIR=str(tmp_path / "runs"), NPROC_PER_NODE="2")
    args = [
        "--preset",
        "tiny",
        "--max_steps",
        "1000",
        "--fp8=0",
        "--bf16=0",
        "--train_batch_size",
        "2",
        "--max_context_width",
        "64",
    ]
    status, log = signal_after(["bash", str(SBATCH), *args], signal.SIGUSR1, cwd=tmp_path, env=env)
    assert status == 0, log
    assert "USR1 received" in log
    saved = PREEMPTED.search(log)
    assert saved and 2 <= int(saved.group(1)) < 1000, log
    run = tmp_path / "runs" / "local-fp32"
    ckpt = run / "checkpoints" / f"step_{int(saved.group(1)):08d}"
    assert (ckpt / "checkpoint.json").is_file()
    assert processes_mentioning(str(run)) == []  # no orphan

    cmd = ["bash", str(SBATCH), *args]
    status, log = signal_after(cmd, signal.SIGUSR1, "Resumed from", cwd=tmp_path, env=env)
    assert status == 0, log
    assert f"Resumed from {ckpt} at step {int(saved.group(1))}" in log, log


# --------------------------------------------------------------------------------------
# Recording stand-ins for what this machine lacks (GPUs, nodes, Pyxis)

FAKE_TORCHRUN = """#!{python}
# Records how it was started: arguments, folder, thread setting, ignored signals.
import json, os, sys
mask = int(next(l for l in open("/proc/self/status") if l.startswith("SigIgn:")).split()[1], 16)
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps({{
        "argv": sys.argv[1:], "cwd": os.getcwd(), "omp": os.environ.get("OMP_NUM_THREADS"),
        "pet_signals": os.environ.get("PET_SIGNALS_TO_HANDLE"),
        "ignores_usr1": bool(mask >> 9 & 1), "ignores_term": bool(mask >> 14 & 1),
        "ignores_int": bool(mask >> 1 & 1),
    }}) + "\\n")
if os.environ.get("FAKE_REFUSED_IN"):  # a run refused after start-up: its lock, released
    open(os.path.join(os.environ["FAKE_REFUSED_IN"], ".run.lock"), "w").close()
    sys.exit(2)
"""

FAKE_PYTHON = """#!/usr/bin/env bash
# The job's Python: records train.py's --validate_only check and answers it with status
# $FAKE_VALIDATE (default 0); anything else runs on the real interpreter.
if [[ " $* " == *" --validate_only "* ]]; then
    printf '%s\\n' "$*" >>"$VALIDATE_RECORD"
    if [[ ${{FAKE_VALIDATE:-0}} != 0 ]]; then
        echo "train.py: error: (stand-in) bad flag" >&2
    fi
    exit "${{FAKE_VALIDATE:-0}}"
fi
exec {python} "$@"
"""

FAKE_SRUN = """#!/usr/bin/env bash
# srun: advertise Pyxis if asked to, record the options (one line per call, tab-separated),
# run the command as node 0 (in "the container" when given an image: the image's Python
# comes first on PATH).
if [[ ${1:-} == --help ]]; then
    echo "Usage: srun [OPTIONS(0)... [executable(0) [args(0)...]]]"
    if [[ -n ${FAKE_PYXIS:-} ]]; then
        echo "      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH"
    fi
    exit 0
fi
options=()
while [[ ${1:-} == --* ]]; do
    options+=("$1")
    [[ $1 == --container-image=* ]] && export PATH="$CONTAINER_BIN:$PATH"
    shift
done
(IFS=$'\t'; echo "${options[*]}") >>"$SRUN_RECORD"
SLURM_NODEID=0 exec "$@"
"""

FAKE_SCONTROL = """#!/usr/bin/env bash
case "$1 $2" in
"show hostnames") printf 'gpu-node-1\\ngpu-node-2\\n' ;;
"show job") printf '   Command=%s\\n   WorkDir=/tmp\\n' "$FAKE_COMMAND" ;;
"show node")
    echo "NodeName=gpu-node-1 CoresPerSocket=48 NodeAddr=10.1.0.11 NodeHostName=ip-10-1-0-11"
    echo "NodeName=gpu-node-2 CoresPerSocket=48 NodeAddr=10.1.0.12 NodeHostName=ip-10-1-0-12"
    ;;
*) echo "scontrol $*" >>"$SRUN_RECORD" ;;
esac
"""


@dataclass
class Fakes:
    bin_dir: Path
    venv: Path
    record: Path
    srun_record: Path
    validations: Path

    def env(self, **extra: str) -> dict[str, str]:
        base = {
            "PATH": f"{self.bin_dir}:/usr/bin:/bin",
            "HOME": str(self.bin_dir.parent),
            "VENV": str(self.venv),
            "RECORD": str(self.record),
            "SRUN_RECORD": str(self.srun_record),
            "FAKE_COMMAND": str(SBATCH),
            "CONTAINER_BIN": str(self.venv / "bin"),
            "VALIDATE_RECORD": str(self.validations),
        }
        base.update(extra)
        return base

    def srun_calls(self) -> list[list[str]]:
        """The options of every srun call, in order."""
        if not self.srun_record.exists():
            return []
        return [line.split("\t") for line in self.srun_record.read_text().splitlines()]

    def torchrun_calls(self) -> list[dict]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines()]


def write_executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def fakes(tmp_path: Path) -> Fakes:
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    write_executable(venv / "bin" / "python", FAKE_PYTHON.format(python=sys.executable))
    write_executable(venv / "bin" / "torchrun", FAKE_TORCHRUN.format(python=sys.executable))
    write_executable(bin_dir / "srun", FAKE_SRUN)
    write_executable(bin_dir / "scontrol", FAKE_SCONTROL)
    write_executable(bin_dir / "scancel", "#!/bin/sh\nexit 0\n")
    # nvidia-smi installed but no driver (what a CPU node with CUDA packages reports).
    write_executable(
        bin_dir / "nvidia-smi", "#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n"
    )
    return Fakes(
        bin_dir,
        venv,
        tmp_path / "torchrun.jsonl",
        tmp_path / "srun.txt",
        tmp_path / "validate.txt",
    )


def run_script(env: dict[str, str], *args: str, cwd: Path | None = None, timeout: int = 60):
    """`bash 1.train_llama.sbatch ARGS` in `cwd` (default the repository), output captured."""
    return subprocess.run(
        ["bash", str(SBATCH), *args],
        env=env,
        cwd=cwd or REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_finished(checkpoint_dir: Path) -> int:
    """Exit status of the check the script makes before a requeue (0: at max_steps)."""
    return subprocess.run(
        ["python3", str(REPO / "scripts" / "launcher.py"), "finished", str(checkpoint_dir)],
        timeout=120,
    ).returncode


def test_only_an_unfinished_run_counts_as_requeueable(tmp_path: Path) -> None:
    assert run_finished(tmp_path / "none-yet") == 1
    for step, max_steps in ((4, 16), (16, 16)):
        folder = tmp_path / "checkpoints" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        meta = {"step": step, "run_config": {"max_steps": max_steps}}
        (folder / "checkpoint.json").write_text(json.dumps(meta))
        assert run_finished(tmp_path / "checkpoints") == 1  # no DCP .metadata: not complete
        (folder / ".metadata").write_text("")
        assert run_finished(tmp_path / "checkpoints") == (0 if step == max_steps else 1)


def test_local_run_passes_arguments_through_after_the_defaults(
    fakes: Fakes, tmp_path: Path
) -> None:
    env = fakes.env(RUNS_DIR=str(tmp_path / "runs"), RUN_NAME="trial")
    user_args = ["--preset", "llama3-8b", "--fp8=0", "--dataset", "a file with spaces.jsonl"]
    result = run_script(env, *user_args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    [call] = fakes.torchrun_calls()
    argv, run_dir = call["argv"], tmp_path / "runs" / "trial"
    assert argv[:4] == ["--nnodes=1", "--nproc_per_node=2", "--standalone", str(REPO / "train.py")]
    assert argv[4:] == [
        # upstream defaults first, so the user's win
        "--preset",
        "llama2-7b",
        "--fp8=1",
        "--checkpoint_freq",
        "500",
        "--output_dir",
        str(run_dir),  # checkpoints: train.py's default, <output_dir>/checkpoints
        "--resume_from_checkpoint",
        "auto",
        *user_args,
    ]
    assert call["cwd"] == str(REPO)  # relative paths mean the same as in the container
    assert int(call["omp"]) == max(1, (os.cpu_count() or 1) // 2)
    # The launcher forwards USR1/TERM/INT to the workers; torchrun must not act on them.
    assert call["ignores_usr1"] and call["ignores_term"] and call["ignores_int"]
    assert call["pet_signals"] == "SIGHUP,SIGQUIT"
    assert not run_dir.exists()  # train.py makes its folders (a refusal there leaves none)
    # The arguments were checked once, before torchrun, with exactly what torchrun got.
    [checked] = fakes.validations.read_text().splitlines()
    assert checked == " ".join([str(REPO / "train.py"), "--validate_only", *argv[4:]])


def test_cpu_workers_come_from_nproc_per_node(fakes: Fakes, tmp_path: Path) -> None:
    result = run_script(fakes.env(RUNS_DIR=str(tmp_path), NPROC_PER_NODE="3"), "--preset", "tiny")
    assert result.returncode == 0, result.stderr
    assert "--nproc_per_node=3" in fakes.torchrun_calls()[0]["argv"]


def test_a_local_run_without_run_name_has_one_stable_folder(fakes: Fakes, tmp_path: Path) -> None:
    """Same command, same folder (runs/local-fp8): a rerun after Ctrl-C resumes, as a job with
    the same name does (a `local-<time>` folder started every rerun at step 1); the same
    command with --fp8=0 is another run (runs/local-bf16), not a resume of the FP8 one."""
    for _ in range(2):
        assert (
            run_script(fakes.env(RUNS_DIR=str(tmp_path / "runs")), "--preset", "tiny").returncode
            == 0
        )
    for call in fakes.torchrun_calls():
        assert call["argv"][-6:-2] == [
            "--output_dir",
            str(tmp_path / "runs" / "local-fp8"),
            "--resume_from_checkpoint",
            "auto",
        ]
    env = fakes.env(RUNS_DIR=str(tmp_path / "runs"))
    assert run_script(env, "--preset", "tiny", "--fp8=0").returncode == 0
    argv = fakes.torchrun_calls()[-1]["argv"]
    assert argv[argv.index("--output_dir") + 1] == str(tmp_path / "runs" / "local-bf16")


@pytest.mark.parametrize("spelling", ["separate", "equals"])
def test_the_users_output_dir_holds_the_whole_run(
    fakes: Fakes, tmp_path: Path, spelling: str
) -> None:
    """Metrics and checkpoints in the user's --output_dir, none in the launcher's run folder."""
    mine = tmp_path / "mine"
    user = ["--output_dir", str(mine)] if spelling == "separate" else [f"--output_dir={mine}"]
    env = fakes.env(RUNS_DIR=str(tmp_path / "runs"), RUN_NAME="r")
    result = run_script(env, "--preset", "tiny", *user, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"run folder {mine}\n" in result.stdout
    [call] = fakes.torchrun_calls()
    assert "--checkpoint_dir" not in call["argv"] and str(tmp_path / "runs") not in str(call)
    assert str(mine) in str(call["argv"]) and not (tmp_path / "runs").exists()


def test_a_slurm_job_mounts_and_requeues_from_the_users_folders(
    fakes: Fakes, tmp_path: Path
) -> None:
    image = tmp_path / "transformer-engine.sqsh"
    image.touch()
    env = slurm_job_env(fakes, tmp_path, FAKE_PYXIS="1", IMAGE=str(image))
    mine = tmp_path / "mine"
    result = run_script(env, "--preset", "tiny", f"--output_dir={mine}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"run folder {mine}\n" in result.stdout
    [mounts] = [o.split("=", 1)[1] for o in fakes.srun_calls()[-1] if "container-mounts" in o]
    assert f"{mine}/checkpoints:{mine}/checkpoints" in mounts.split(",")
    assert f"{mine}:{mine}" in mounts.split(",")
    assert str(tmp_path / "runs") not in mounts  # does not exist: Pyxis would refuse it
    assert not (tmp_path / "runs").exists()


def test_overwrite_output_dir_starts_afresh_once_and_a_requeue_resumes(
    fakes: Fakes, tmp_path: Path
) -> None:
    """--overwrite_output_dir with the launcher's `--resume_from_checkpoint auto` was refused
    by train.py; a requeue (same arguments) must then resume, not delete again."""
    user = ["--preset", "tiny", "--overwrite_output_dir"]
    local = run_script(fakes.env(RUNS_DIR=str(tmp_path / "runs"), RUN_NAME="r"), *user)
    assert local.returncode == 0, local.stderr
    assert "--resume_from_checkpoint" not in fakes.torchrun_calls()[0]["argv"]

    saved = tmp_path / "runs" / "llama3-fp8" / "checkpoints" / "step_00000500"
    saved.mkdir(parents=True)
    (saved / "checkpoint.json").write_text("{}")
    requeued = run_script(slurm_job_env(fakes, tmp_path, SLURM_RESTART_COUNT="1"), *user)
    assert requeued.returncode == 0, requeued.stdout + requeued.stderr
    argv = fakes.torchrun_calls()[1]["argv"]
    assert "--overwrite_output_dir" not in argv
    assert argv[argv.index("--resume_from_checkpoint") + 1] == "auto"
    assert "restart 1: without --overwrite_output_dir" in requeued.stdout
    assert "--overwrite_output_dir" not in fakes.validations.read_text().splitlines()[-1]


@pytest.mark.parametrize("pyxis", [False, True], ids=["host", "pyxis"])
def test_validate_only_in_a_job_is_the_check_alone(
    fakes: Fakes, tmp_path: Path, pyxis: bool
) -> None:
    image = tmp_path / "transformer-engine.sqsh"
    image.touch()
    extra = {"FAKE_PYXIS": "1", "IMAGE": str(image)} if pyxis else {"IMAGE": str(image)}
    result = run_script(slurm_job_env(fakes, tmp_path, **extra), "--validate_only")
    assert result.returncode == 0, result.stdout + result.stderr
    assert fakes.torchrun_calls() == [] and len(fakes.srun_calls()) == int(pyxis)
    assert fakes.validations.read_text().count("--validate_only") == 2  # launcher's + user's
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RUN_NAME": "a/b"}, "must be a plain folder name"),
        ({"VENV": "/nonexistent-venv"}, "has no bin/python"),
        ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE=0 is not a number of workers per node"),
        ({"NPROC_PER_NODE": "two"}, "NPROC_PER_NODE=two is not a number of workers per node"),
        ({"SLURM_NNODES": "2"}, "SLURM_NNODES=2 asks for 2 nodes outside a Slurm job"),
        ({"SLURM_JOB_ID": "7"}, "SLURM_JOB_ID=7 is set but SLURM_JOB_NODELIST is not"),
        ({"FAKE_VALIDATE": "2"}, "train.py: error: (stand-in) bad flag"),
    ],
)
def test_bad_settings_fail_with_one_line_and_exit_2(
    fakes: Fakes, tmp_path: Path, env: dict[str, str], message: str
) -> None:
    runs = tmp_path / "runs"
    result = run_script(
        fakes.env(**{"RUNS_DIR": str(runs), "RUN_NAME": "r", **env}), "--preset", "tiny"
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert fakes.torchrun_calls() == []
    assert not runs.exists()  # no empty run folder left behind


@pytest.mark.parametrize("pyxis", [False, True], ids=["host", "pyxis"])
def test_a_refused_slurm_job_exits_2_without_requeue_or_empty_folders(
    fakes: Fakes, tmp_path: Path, pyxis: bool
) -> None:
    """In a job the check runs once on the first node, before the nodes' step (in one srun
    task in the container when there is one): a refusal there cannot become a killed step."""
    image = tmp_path / "transformer-engine.sqsh"
    image.touch()
    extra = {"FAKE_PYXIS": "1", "IMAGE": str(image)} if pyxis else {}
    result = run_script(slurm_job_env(fakes, tmp_path, FAKE_VALIDATE="2", **extra), "--lr", "inf")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "(stand-in) bad flag" in result.stderr and fakes.torchrun_calls() == []
    assert fakes.validations.read_text().count("--validate_only") == 1
    assert not (tmp_path / "runs").exists()
    if pyxis:
        [srun] = fakes.srun_calls()
        assert srun[:2] == ["--nodes=1", "--ntasks=1"] and f"--container-image={image}" in srun
    else:
        assert fakes.srun_calls() == []


def test_a_job_refused_after_its_nodes_started_leaves_no_empty_run_folder(
    fakes: Fakes, tmp_path: Path
) -> None:
    """A job's launch makes its folders before the nodes start (Pyxis mounts them); a run
    that a rank then refuses leaves only its released lock there, and the job removes them."""
    run = tmp_path / "runs" / "llama3-fp8"
    result = run_script(slurm_job_env(fakes, tmp_path, FAKE_REFUSED_IN=str(run)))
    assert result.returncode == 2 and len(fakes.torchrun_calls()) == 1, result.stderr
    assert not (tmp_path / "runs").exists()  # the launch made runs/ too


def test_a_job_whose_run_folder_cannot_be_made_is_one_line(fakes: Fakes, tmp_path: Path) -> None:
    result = run_script(slurm_job_env(fakes, tmp_path, RUNS_DIR="/proc/llama-runs"))
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = result.stderr.strip().splitlines()
    assert "cannot create /proc/llama-runs (" in line and "point RUNS_DIR" in line
    assert fakes.srun_calls() == [] and fakes.torchrun_calls() == []
    assert not fakes.validations.exists() or "--validate_only" not in fakes.validations.read_text()


def slurm_job_env(fakes: Fakes, tmp_path: Path, **extra: str) -> dict[str, str]:
    """What sbatch gives the batch shell of a 2-node job with 8 GPUs per node."""
    return fakes.env(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="llama3-fp8",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST="gpu-node-[1-2]",
        SLURMD_NODENAME="gpu-node-1",
        SLURM_GPUS_ON_NODE="8",
        **{"RUNS_DIR": str(tmp_path / "runs"), **extra},
    )


def test_slurm_job_runs_torchrun_per_node_in_the_pyxis_container(
    fakes: Fakes, tmp_path: Path
) -> None:
    image = tmp_path / "transformer-engine.sqsh"
    image.touch()
    env = slurm_job_env(
        fakes,
        tmp_path,
        FAKE_PYXIS="1",
        IMAGE=str(image),
        DATA_PATH="/fsx/data",
        EXTRA_MOUNTS="/fsx/hf:/root/.cache/huggingface",
    )
    result = run_script(env, "--preset", "llama3-8b", "--checkpoint_dir", "/fsx/ckpt/llama3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"container: {image} (Pyxis)" in result.stdout

    # First the argument check in one task, then the nodes' step in the same named container,
    # where each node's launcher says which Python, torch and Transformer Engine it runs.
    check, srun = fakes.srun_calls()
    assert re.search(r"^container: \S+: Python \d+\.\d+\.\d+ \(\S+\), torch ", result.stdout, re.M)
    assert check[:2] == ["--nodes=1", "--ntasks=1"] and check[2:] == srun[5:], (check, srun)
    assert srun[:5] == [
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "--label",
    ]
    assert f"--container-image={image}" in srun and f"--container-workdir={REPO}" in srun
    assert "--container-name=llama-4242" in srun
    [mounts] = [o.split("=", 1)[1] for o in srun if o.startswith("--container-mounts=")]
    run_dir = tmp_path / "runs" / "llama3-fp8"
    for path in (REPO, tmp_path / "runs", Path("/fsx/ckpt/llama3"), run_dir, Path("/fsx/data")):
        assert f"{path}:{path}" in mounts.split(","), mounts
    assert mounts.endswith(",/fsx/hf:/root/.cache/huggingface")

    [call] = fakes.torchrun_calls()
    argv = call["argv"]
    # The store on the first node, reached by its NodeAddr (a node name need not resolve);
    # this node (the first) hosts it; the workers' process group meets at an address too.
    assert argv[:7] == [
        "--nnodes=2",
        "--nproc_per_node=8",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=10.1.0.11:{20000 + 4242 % 20000}",
        "--rdzv_id=4242",
        "--rdzv_conf=is_host=1",
        "--local_addr=10.1.0.11",
    ]
    assert argv[-4:] == ["--preset", "llama3-8b", "--checkpoint_dir", "/fsx/ckpt/llama3"]
    # The launcher passes USR1/TERM/INT on to the workers; torchrun must not act on them.
    assert call["ignores_usr1"] and call["ignores_term"] and call["ignores_int"]
    assert call["pet_signals"] == "SIGHUP,SIGQUIT"


def test_slurm_job_without_pyxis_says_it_uses_host_python(fakes: Fakes, tmp_path: Path) -> None:
    image = tmp_path / "transformer-engine.sqsh"
    image.touch()
    result = run_script(slurm_job_env(fakes, tmp_path, IMAGE=str(image)), "--preset", "tiny")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"host Python {fakes.venv}/bin/python: srun has no --container-image" in result.stdout
    [srun] = fakes.srun_calls()  # no srun for the argument check: this node's Python
    assert not any("--container" in o for o in srun)


def test_a_missing_image_is_an_error_not_a_silent_fallback(fakes: Fakes, tmp_path: Path) -> None:
    env = slurm_job_env(fakes, tmp_path, FAKE_PYXIS="1", IMAGE=str(tmp_path / "typo.sqsh"))
    result = run_script(env, "--preset", "tiny")
    assert result.returncode == 2 and "typo.sqsh does not exist" in result.stderr
    assert fakes.torchrun_calls() == []
