"""scripts/launch_plan.py: train.py's arguments as the sbatch builds them, the folders in
effect, a requeue's rewriting, and --help/--validate_only, without Slurm or torch. Through the
script itself (recording stand-ins): tests/integration/test_sbatch_without_a_cluster.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import launch_plan
import pytest

REPO = Path(__file__).resolve().parents[2]

# The script's defaults, as in 1.train_llama.sbatch (any will do: they go first, untouched).
DEFAULTS = ["--preset", "llama2-7b", "--checkpoint_freq", "500"]


@pytest.mark.parametrize(
    ("user", "checkpoints", "run"),
    [
        ([], "/runs/r/checkpoints", "/runs/r"),
        (["--output_dir", "/mine"], "/mine/checkpoints", "/mine"),
        (["--output_dir=/mine"], "/mine/checkpoints", "/mine"),
        (["--checkpoint_dir", "/fsx/ckpt"], "/fsx/ckpt", "/runs/r"),
        (["--output_dir=/mine", "--checkpoint_dir=/fsx/ckpt"], "/fsx/ckpt", "/mine"),
    ],
)
def test_the_users_output_dir_takes_the_checkpoints_with_it(
    user: list[str], checkpoints: str, run: str
) -> None:
    """train.py's default --checkpoint_dir is <output_dir>/checkpoints: the launcher's run
    folder must not keep the checkpoints when the user moved the run (metrics in one folder,
    checkpoints in another, and a resume looking in the wrong one)."""
    args = launch_plan.train_arguments(DEFAULTS, "/runs/r", user)
    assert launch_plan.run_folders(args) == (checkpoints, run)
    own = args[len(DEFAULTS) : len(args) - len(user)]  # what the launcher added
    assert "--checkpoint_dir" not in own and ("/runs/r" in own) == (run == "/runs/r")


def test_relative_paths_are_the_callers_and_the_path_flags_are_trains(tmp_path: Path) -> None:
    """Outputs are made absolute in the caller's folder; inputs where they exist there (else a
    Hub name, or the checkout's bundled data); an @FILE is read there, its lines too."""
    from model_utils.config.run_config import path_flags

    assert {*launch_plan.argv.OUTPUT_PATH_FLAGS, *launch_plan.argv.INPUT_PATH_FLAGS} == {
        *path_flags()
    }
    (tmp_path / "mine.jsonl").write_text("{}\n")
    (tmp_path / "more.args").write_text("--export_hf hf\n--tokenizer=gpt2\n")
    user = ["--output_dir", "out", "--dataset=mine.jsonl", "--resume_from_checkpoint", "auto"]
    user += ["--checkpoint_dir=/abs/ckpt", "--init_from_hf", "data/tokenizer", "@more.args"]
    assert launch_plan.from_caller([*user, "--lr", "out"], str(tmp_path)) == [
        "--output_dir",
        str(tmp_path / "out"),
        f"--dataset={tmp_path / 'mine.jsonl'}",
        "--resume_from_checkpoint",
        "auto",
        "--checkpoint_dir=/abs/ckpt",
        "--init_from_hf",
        "data/tokenizer",  # not in the caller's folder: left to train.py (the checkout's)
        "--export_hf",
        str(tmp_path / "hf"),
        "--tokenizer=gpt2",
        "--lr",
        "out",
    ]


@pytest.mark.parametrize(
    ("user", "auto"),
    [
        ([], True),
        (["--overwrite_output_dir"], False),
        (["--overwrite_output_dir=1", "--seed", "3"], False),
        (["--overwrite_output_dir", "0"], True),  # argparse: the switch is off
        (["--overwrite_output_dir=false"], True),
        (["--resume_from_checkpoint", "/old/step_00000100"], False),
        (["--resume_from_checkpoint=auto"], False),  # theirs, not a second one
    ],
)
def test_auto_resume_is_added_only_where_the_user_did_not_decide(
    user: list[str], auto: bool
) -> None:
    resume = ["--resume_from_checkpoint", "auto"] if auto else []
    assert launch_plan.train_arguments(DEFAULTS, "/runs/r", user) == [
        *DEFAULTS,
        "--output_dir",
        "/runs/r",
        *resume,
        *user,
    ]


def test_a_requeue_never_deletes_or_rewinds_the_runs_own_checkpoints() -> None:
    """A requeued job re-runs its first arguments: --overwrite_output_dir would delete the
    progress, an explicit old PATH would redo (and overwrite) the steps since."""
    user = ["--overwrite_output_dir", "--seed", "3", "--overwrite_output_dir=1"]
    args, note = launch_plan.for_requeue(user, 1, "/runs/r/checkpoints", saved=True)
    assert args == ["--seed", "3"]
    assert note.startswith("restart 1: without --overwrite_output_dir")
    assert "/runs/r/checkpoints" in note
    assert launch_plan.train_arguments([], "/runs/r", args)[-4:-2] == [
        "--resume_from_checkpoint",
        "auto",
    ]

    user = ["--resume_from_checkpoint", "/old/step_00000100", "--lr", "1e-4"]
    args, note = launch_plan.for_requeue(user, 2, "/runs/r/checkpoints", saved=True)
    assert args == ["--lr", "1e-4"] and "--resume_from_checkpoint /old/step_00000100" in note
    # Nothing saved yet: PATH is still where the run starts from (auto would start afresh).
    assert launch_plan.for_requeue(user, 2, "/runs/r/checkpoints", saved=False) == (user, "")
    # Nothing to change: no note.
    assert launch_plan.for_requeue(["--overwrite_output_dir", "0"], 1, "/c", saved=True) == (
        ["--overwrite_output_dir", "0"],
        "",
    )


def run_plan(env: dict[str, str], run_dir: str, *user: str, named: bool = True) -> dict:
    """The plan of a launch in `run_dir`; `named`: its folder is a RUN_NAME (taken as given),
    else a job's name (or `local` without Slurm: the precision appended)."""
    runs, name = str(Path(run_dir).parent), Path(run_dir).name
    if named:
        env = {**env, "RUN_NAME": name}
    elif name != "local":
        env = {**env, "SLURM_JOB_ID": env.get("SLURM_JOB_ID", "1"), "SLURM_JOB_NAME": name}
    got = launch_plan.plan({**env, "RUNS_DIR": runs}, DEFAULTS, list(user))
    return {
        "mode": got.mode,
        "note": got.note,
        "checkpoint_dir": got.checkpoint_dir,
        "output_dir": got.output_dir,
        "args": got.train_args,
    }


def test_the_sbatch_reads_the_plan_as_records_whatever_the_values_hold(tmp_path: Path) -> None:
    """`launcher.py plan` writes NUL-separated key=value records (the sbatch reads them with
    `read -d ''`, no shell generated and evaluated): quotes and newlines come through as typed."""
    odd = "it's a file\nwith a newline.jsonl"
    user = ["--dataset", odd, "--output_dir", str(tmp_path / "r")]
    env = {"PATH": os.environ.get("PATH", ""), "VENV": sys.prefix, "HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "scripts/launcher.py", "plan", "2", "--preset", "tiny", *user],
        cwd=REPO,
        env=env,
        capture_output=True,
        check=True,
    ).stdout.decode()
    records = [field.split("=", 1) for field in out.split("\0")[:-1]]
    args = [value for key, value in records if key == "arg"]
    assert args == ["--preset", "tiny", "--resume_from_checkpoint", "auto", *user]
    assert ["output_dir", str(tmp_path / "r")] in records and ["mode", "train"] in records
    assert not (tmp_path / "r").exists()  # without Slurm the folders wait for the check


@pytest.mark.parametrize(
    ("user", "folder"),
    [
        ([], "local-bf16"),
        (["--fp8=1"], "local-fp8"),
        (["--fp8"], "local-fp8"),
        (["--fp8=1", "--fp8", "0"], "local-bf16"),
        (["--bf16=0"], "local-fp32"),
        (["--recipe", "tiny-fp8"], "local-fp8"),
        (["--recipe=llama3-8b-bf16"], "local-bf16"),
        (["--recipe=tiny-fp8", "--fp8=0"], "local-bf16"),
    ],
)
def test_without_run_name_the_precision_names_the_run_folder(user: list[str], folder: str) -> None:
    """The README's `--fp8=1` run then the same command with `--fp8=0` are two runs: the second
    used to resume the first's checkpoints and record them as bf16."""
    plan = run_plan({}, "/runs/local", *user, named=False)
    assert plan["args"][len(DEFAULTS) : len(DEFAULTS) + 2] == ["--output_dir", f"/runs/{folder}"]


def test_a_run_name_is_taken_as_given_and_a_job_name_keeps_its_own_suffix() -> None:
    assert run_plan({}, "/runs/mine", "--fp8=1")["args"][len(DEFAULTS) + 1] == "/runs/mine"
    plan = run_plan({}, "/runs/llama3-fp8", "--fp8=1", named=False)
    assert plan["args"][len(DEFAULTS) + 1] == "/runs/llama3-fp8"


@pytest.mark.parametrize("name", ["a/b", ".", "..", " ", "", "a\nb"])
def test_a_run_name_that_is_no_plain_folder_is_refused(name: str) -> None:
    """' ' made a run folder named by a space; '' (set but empty) is the default name."""
    if not name:
        assert launch_plan.run_name({"RUN_NAME": name}) == "local"
        return
    with pytest.raises(launch_plan.UsageError, match="must be a plain folder name"):
        launch_plan.run_name({"RUN_NAME": name})


def test_an_unknown_recipe_is_refused_before_anything_is_made() -> None:
    with pytest.raises(launch_plan.UsageError, match="--recipe nope: no such recipe"):
        launch_plan.plan({}, [], ["--recipe", "nope"])


def test_the_launchers_preset_gives_way_to_a_hf_checkpoints_config(tmp_path: Path) -> None:
    """The sbatch's `--preset llama2-7b` default is an explicit flag to train.py, which refuses a
    preset that contradicts --init_from_hf's config.json: the launcher leaves it out there, and
    where a run.args names it (the documented rerun of a run started from HF weights)."""
    args = launch_plan.train_arguments(DEFAULTS, "/runs/r", ["--init_from_hf", "/hf/llama3"])
    assert "--preset" not in args and args[:2] == ["--checkpoint_freq", "500"]
    mine = ["--init_from_hf", "/hf/llama3", "--preset", "llama3-8b"]
    assert launch_plan.train_arguments(DEFAULTS, "/runs/r", mine)[-2:] == ["--preset", "llama3-8b"]
    saved = tmp_path / "run.args"
    saved.write_text("--init_from_hf=/hf/llama3\n--lr=0.0003\n")
    assert "--preset" not in launch_plan.train_arguments(DEFAULTS, "/runs/r", [f"@{saved}"])


def test_the_plan_rewrites_a_restarted_jobs_arguments_only(tmp_path: Path) -> None:
    run = tmp_path / "r"
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "checkpoints" / "step_00000004" / "checkpoint.json").write_text("{}")
    (run / "checkpoints" / "step_00000004" / ".metadata").write_text("")  # DCP's, complete
    user = ["--overwrite_output_dir", "--dataset", "it's a file\nwith a newline.jsonl"]
    first = run_plan({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0"}, str(run), *user)
    assert first["args"] == [*DEFAULTS, "--output_dir", str(run), *user] and not first["note"]
    again = run_plan({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}, str(run), *user)
    assert again["args"] == [
        *DEFAULTS,
        "--output_dir",
        str(run),
        "--resume_from_checkpoint",
        "auto",
        *user[1:],
    ]
    assert str(again["note"]).startswith("restart 1: without --overwrite_output_dir")
    # Outside a job a stray SLURM_RESTART_COUNT means nothing.
    assert run_plan({"SLURM_RESTART_COUNT": "3"}, str(run), *user)["args"] == first["args"]
    assert again["checkpoint_dir"] == str(run / "checkpoints")


@pytest.mark.parametrize(
    ("user", "mode"),
    [
        (["--preset", "tiny"], "train"),
        (["--preset", "tiny", "--validate_only"], "validate"),
        (["--validate_only=1"], "validate"),
        (["--validate_only", "0"], "train"),
        (["--help"], "help"),
        (["--preset", "tiny", "-h"], "help"),
    ],
)
def test_help_and_validate_only_are_answered_by_the_check_alone(user: list[str], mode: str) -> None:
    assert launch_plan.launch_mode(user) == mode


@pytest.mark.parametrize("flag", ["--output", "--checkpoint_d=/x", "--overwrite", "--val", "--he"])
def test_abbreviations_of_the_flags_the_launcher_reads_are_refused(flag: str) -> None:
    """argparse takes `--output x` for `--output_dir x`; the launcher would miss it."""
    with pytest.raises(launch_plan.UsageError, match=f"^{flag.split('=')[0]}: write --"):
        launch_plan.check_spelled_out(["--preset", "tiny", flag])
    launch_plan.check_spelled_out(["--output_dir=x", "--checkpoint_freq", "5", "--validate_only"])


@pytest.mark.parametrize(
    "user",
    [
        [],
        ["--fp8=1"],
        ["--fp8", "0"],
        ["--fp8", "--bf16=1"],
        ["--bf16", "off", "--validate_only"],
        ["--recipe", "tiny-fp8"],
        ["--recipe=tiny-fp8", "--fp8=no", "--validate_only", "false"],
        ["--preset", "tiny", "--fp8=yes", "--fp8=0", "--bf16=1"],
    ],
)
def test_the_launcher_reads_arguments_as_train_py_parses_them(user: list[str]) -> None:
    """One grammar (model_utils/config/argv.py): the run folder's precision and the launch mode
    the launcher reads are the ones train.py's own parser resolves from the same arguments."""
    from model_utils.config import arguments

    config = arguments.parse_args(["--preset", "tiny", *user])
    assert launch_plan.precision(["--preset", "tiny", *user]) == config.precision.name
    mode = "validate" if config.run.validate_only else "train"
    assert launch_plan.launch_mode(user) == mode


def args_file(tmp_path: Path, *lines: str) -> str:
    """`@FILE` of `lines` (an arguments file), as the user passes it."""
    path = tmp_path / "my.args"
    path.write_text("\n".join(lines) + "\n")
    return f"@{path}"


@pytest.mark.parametrize(
    ("lines", "checkpoints", "run", "auto"),
    [
        (["--output_dir /x/mine"], "/x/mine/checkpoints", "/x/mine", True),
        (["--output_dir=/x/mine", "--checkpoint_dir /x/ckpt"], "/x/ckpt", "/x/mine", True),
        (["--overwrite_output_dir 1"], "/runs/local-bf16/checkpoints", "/runs/local-bf16", False),
        (["--resume_from_checkpoint=/old/step_00000100"], "", "/runs/local-bf16", False),
        (["--fp8 1  # a comment", "--output_dir '/x/q r'"], "/x/q r/checkpoints", "/x/q r", True),
    ],
)
def test_the_launcher_reads_the_flags_of_an_args_file_as_train_py_does(
    tmp_path: Path, lines: list[str], checkpoints: str, run: str, auto: bool
) -> None:
    """An `@FILE`'s --output_dir moves the run (no launcher folder made beside it), and its
    --overwrite_output_dir or --resume_from_checkpoint is the user's decision: no `auto` added
    (train.py refuses it beside --overwrite_output_dir). The file itself goes on to train.py."""
    file = args_file(tmp_path, *lines)
    plan = run_plan({}, "/runs/local", file, named=False)
    assert plan["checkpoint_dir"] == (checkpoints or f"{run}/checkpoints")
    assert plan["output_dir"] == run
    assert ("--output_dir" in plan["args"]) == (run == "/runs/local-bf16")
    assert ("auto" in plan["args"]) == auto and plan["args"][-1] == file


@pytest.mark.parametrize(
    "line", ["--resume_from_checkpoint /old/step_00000100", "--overwrite_output_dir"]
)
def test_a_requeue_drops_an_args_files_resume_and_overwrite_too(tmp_path: Path, line: str) -> None:
    """A requeue's rewriting reaches into an `@FILE`: its arguments stand in its place,
    without the flag that would rewind or delete the run's own checkpoints."""
    run = tmp_path / "r"
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "checkpoints" / "step_00000004" / "checkpoint.json").write_text("{}")
    (run / "checkpoints" / "step_00000004" / ".metadata").write_text("")
    file = args_file(tmp_path, "--seed 3", line, "--lr='1e-4'  # a comment")
    first = run_plan({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0"}, str(run), file)
    assert first["args"][-1] == file and not first["note"]
    again = run_plan({"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}, str(run), file)
    assert again["args"] == [
        *DEFAULTS,
        "--output_dir",
        str(run),
        "--resume_from_checkpoint",
        "auto",
        "--seed",
        "3",
        "--lr=1e-4",
    ]
    assert again["note"].startswith(f"restart 1: without {line} (for the first start only)")


def test_help_validate_only_abbreviations_and_bf16_are_read_from_an_args_file_too(
    tmp_path: Path,
) -> None:
    assert launch_plan.launch_mode([args_file(tmp_path, "--validate_only")]) == "validate"
    assert launch_plan.launch_mode(["--preset", "tiny", args_file(tmp_path, "-h")]) == "help"
    with pytest.raises(launch_plan.UsageError, match="^--output: write --output_dir in full"):
        launch_plan.check_spelled_out([args_file(tmp_path, "--output /x")])
    hint = launch_plan.slow_bf16_hint
    assert hint([args_file(tmp_path, "--bf16=0")], gpus=0, native_bf16=False) == ""
