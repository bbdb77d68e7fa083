"""What a run is, said plainly: named A/B recipes whose twins differ only in precision, the
--validate_only "ready" line, no abbreviated flags, and log lines that carry their level."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.checkpoints import save_plain_checkpoints

from model_utils.config import recipes
from model_utils.config.arguments import NOT_SAVED, UsageError, parse_args, saved_args

ROOT = Path(__file__).resolve().parents[2]
PRECISION_FLAGS = {"fp8", "fp8_recipe"}
RUN_FOLDERS = {"output_dir", "checkpoint_dir"}  # runs/<preset>-fp8 and -bf16: two runs
#: What 1.train_llama.sbatch puts before the user's arguments.
SBATCH_DEFAULTS = re.search(
    r"^DEFAULT_TRAIN_ARGS=\((.*)\)$", (ROOT / "1.train_llama.sbatch").read_text(), re.M
)[1].split()


@pytest.mark.parametrize("model", sorted({name.rsplit("-", 1)[0] for name in recipes.names()}))
def test_a_recipes_twins_differ_in_precision_alone(model: str) -> None:
    fp8 = parse_args(["--recipe", f"{model}-fp8"]).as_dict()
    bf16 = parse_args(["--recipe", f"{model}-bf16"]).as_dict()
    differ = {name for name in fp8 if fp8[name] != bf16[name]}
    assert differ == {"recipe", *RUN_FOLDERS, *(PRECISION_FLAGS & differ)} and "fp8" in differ
    assert fp8["output_dir"].endswith("-fp8") and bf16["output_dir"].endswith("-bf16")
    assert fp8["fp8"] is True and bf16["fp8"] is False


@pytest.mark.parametrize(
    "argv",
    [
        ["--recipe", "tiny-fp8"],
        ["--preset", "tiny"],
        ["--preset", "tiny", "--fp8=1", "--lr", "3e-4", "--tracker", "tensorboard"],
        ["--preset", "llama3.2-1b", "--bf16=0", "--dataset_config_name", "x", "--max_steps", "7"],
    ],
)
def test_a_saved_run_args_file_runs_the_same_run_and_later_flags_win(argv, tmp_path) -> None:
    """run.args (what a run writes in its folder): `train.py @FILE` resolves to the same run
    but where it writes; a flag after the file overrides it; `#` lines are comments."""
    run = parse_args(argv)
    saved = tmp_path / "run.args"
    saved.write_text("# a comment line\n" + "\n".join(saved_args(run)) + "\n")
    again = parse_args([f"@{saved}"])
    first, second = run.as_dict(), again.as_dict()
    assert {k for k in first if first[k] != second[k]} <= set(NOT_SAVED)
    assert parse_args([f"@{saved}", "--lr", "0.5"]).optim.lr == 0.5
    # What comes before it (the sbatch's defaults) gives way to every value of the run.
    after_defaults = parse_args([*SBATCH_DEFAULTS, "--lr", "0.5", f"@{saved}"]).as_dict()
    assert {k for k in first if first[k] != after_defaults[k]} <= set(NOT_SAVED)


def test_a_run_with_a_global_batch_runs_again_from_its_args_on_other_ranks(
    tmp_path, monkeypatch
) -> None:
    """The accumulation --global_batch_size set for one launch's ranks is not the run's: its
    run.args leaves it out, so `train.py @FILE` sets it again for the ranks it runs on."""
    from model_utils.parallel.distributed import resolve_global_batch

    monkeypatch.setenv("WORLD_SIZE", "2")
    run = resolve_global_batch(parse_args(["--preset", "tiny", "--global_batch_size", "32"]))
    saved = tmp_path / "run.args"
    saved.write_text("\n".join(saved_args(run)) + "\n")
    assert run.optim.grad_accum_steps == 2 and "--global_batch_size=32" in saved.read_text()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert resolve_global_batch(parse_args([f"@{saved}"])).optim.grad_accum_steps == 4


def test_an_args_file_that_cannot_be_read_is_one_line(tmp_path) -> None:
    for path, words in ((tmp_path / "none", "No such file"), (tmp_path, "Is a directory")):
        with pytest.raises(UsageError) as refused:
            parse_args([f"@{path}"])
        assert str(refused.value) == f"@{path}: cannot read the arguments file ({words}" + (
            " or directory)" if words == "No such file" else ")"
        )


def test_an_args_file_takes_flag_and_value_on_one_line_and_never_reads_itself(tmp_path) -> None:
    """A line is split as a shell splits it: `--max_steps 3` is a flag and its value, quotes
    keep spaces and `#`, a `#` starting a word starts a comment; a file that names itself,
    directly or through another, is one line, not a RecursionError."""
    args = tmp_path / "a.args"
    args.write_text(
        "--max_steps 2 # two steps\n  # indented comment\n--dataset_config_name 'two  words'\n"
        '--output_dir "/tmp/q r" --text_column=a#b\n'
    )
    run = parse_args([f"@{args}"])
    assert (run.run.max_steps, run.data.dataset_config_name) == (2, "two  words")
    assert (run.run.output_dir, run.data.text_column) == ("/tmp/q r", "a#b")
    args.write_text("--max_steps 3\n--dataset_config_name=two words\n")  # unquoted: two words
    with pytest.raises(UsageError, match="^unrecognized arguments: words$"):
        parse_args([f"@{args}"])
    other = tmp_path / "b.args"
    other.write_text(f"@{args}\n")
    args.write_text(f"--max_steps 3\n@{other}\n")
    with pytest.raises(UsageError) as refused:
        parse_args([f"@{args}"])
    assert str(refused.value) == (
        f"@{args}: an arguments file names itself (@{args} -> @{other} -> @{args}); remove the line"
    )


@pytest.mark.parametrize("line", ['--output_dir "/tmp/q r', "--max_steps=2 'two # steps"])
def test_an_args_file_line_that_does_not_split_is_one_line(tmp_path, line: str) -> None:
    args = tmp_path / "a.args"
    args.write_text(f"--max_steps 3\n{line}\n")
    with pytest.raises(UsageError) as refused:
        parse_args([f"@{args}"])
    assert str(refused.value) == f"@{args} line 2: no closing quotation: {line}"


def test_run_args_keep_values_with_spaces_comments_and_quotes_exactly(tmp_path) -> None:
    """run.args is read as a shell splits it: a value with spaces, `#` or quotes is written
    quoted and reads back the same."""
    odd = 'it\'s "two"  words # and a\\b'
    run = parse_args(["--preset", "tiny", "--dataset_config_name", odd, "--text_column=#p"])
    saved = tmp_path / "run.args"
    saved.write_text("\n".join(saved_args(run)) + "\n")
    again = parse_args([f"@{saved}"])
    assert (again.data.dataset_config_name, again.data.text_column) == (odd, "#p")
    assert "--preset=tiny" in saved.read_text().splitlines()  # plain values as they were


def test_run_args_leave_out_what_names_one_launch(tmp_path) -> None:
    """A rerun of an exported run must not write into the first run's export, nor allow a data
    change it was never asked for; where its weights came from stays."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, '
        '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, '
        '"vocab_size": 8192, "max_position_embeddings": 256}'
    )
    run = parse_args(
        [f"--init_from_hf={hf}", f"--export_hf={tmp_path / 'x'}", "--allow_data_change"]
    )
    saved = [line.split("=", 1)[0] for line in saved_args(run)]
    assert "--init_from_hf" in saved
    assert not {"--export_hf", "--allow_data_change", "--output_dir"} & set(saved)


def test_a_recipe_stands_where_it_is_written() -> None:
    """Like argparse's @file: the sbatch's defaults before it give way, the user's flags after
    it win."""
    args = parse_args(["--preset", "llama2-7b", "--fp8=0", "--recipe=llama3-8b-fp8", "--lr=1e-4"])
    assert (args.preset, args.precision.fp8, args.precision.fp8_recipe, args.optim.lr) == (
        "llama3-8b",
        True,
        "delayed",
        1e-4,
    )
    assert (
        args.data.train_batch_size == 4
        and args.parallel.ac_scope == "mlp"
        and args.parallel.compile
    )
    assert args.recipe == "llama3-8b-fp8"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--recipe", "llama3-8b"], "--recipe llama3-8b: no such recipe; choose one of"),
        (["--recipe"], "--recipe needs a name: one of llama3-8b-fp8"),
        (["--output", "/x"], "unrecognized arguments: --output /x"),
        (["--fp8_rec", "delayed"], "unrecognized arguments: --fp8_rec delayed"),
    ],
)
def test_unknown_recipes_and_abbreviated_flags_are_refused(argv: list[str], message: str) -> None:
    """argparse used to take `--output /x` as --output_dir."""
    with pytest.raises(UsageError, match=message):
        parse_args(argv)


def test_validate_only_prints_one_ready_line(tmp_path, capsys) -> None:
    import train

    train.main(["--recipe", "tiny-fp8", f"--output_dir={tmp_path / 'run'}", "--validate_only"])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == (
        "train.py: ready: --recipe tiny-fp8, --preset tiny, fp8 tensorwise on --model_impl hf, "
        f"world set by torchrun, run folder {tmp_path / 'run'}, resume none (a fresh start)"
    )
    assert not (tmp_path / "run").exists()
    auto = ["--preset", "tiny", f"--output_dir={tmp_path / 'run'}", "--resume_from_checkpoint=auto"]
    train.main([*auto, "--validate_only"])
    assert capsys.readouterr().out.strip().endswith("resume auto (none yet: a fresh start)")
    save_plain_checkpoints(tmp_path / "run" / "checkpoints", [2, 4])  # which one a requeue takes
    (tmp_path / "run" / "checkpoints" / "step_00000004" / ".metadata").unlink()
    assert train.ready_line(parse_args(auto)).endswith(
        "resume auto (newest complete: step_00000002, its checksums read at start)"
    )


def test_log_lines_carry_their_level_letter() -> None:
    """The upstream format puts the level after the time; a warning was printed as `I`. Only
    real warnings carry a W: torchao's import-time "no triton" line (its int8 kernels, which
    the recipe never runs) came twice in every CPU run."""
    code = (
        "import logging, train; train.configure_logging(); import torchao.float8; "
        "logging.getLogger('t').info('told'); logging.getLogger('t').warning('warned')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    told, warned = out.strip().splitlines()
    assert " I [<string>:1] told" in told and " W [<string>:1] warned" in warned


def test_docs_recipes_lists_every_recipe_with_its_flags() -> None:
    """docs/recipes.md is what a user copies from: each FP8 recipe's flags exactly as expanded."""
    page = (ROOT / "docs" / "recipes.md").read_text()
    for name in recipes.names():
        if name.endswith("-fp8"):
            assert f"| `{name}` | `{' '.join(recipes.flags(name))}`" in page, name


@pytest.mark.parametrize(
    ("flags", "name", "fp8_recipe"),
    [
        (["--fp8=0"], "bf16", None),
        (["--fp8=1"], "torchao-fp8", None),
        (["--model_impl=te", "--fp8=0"], "te", None),
        (["--model_impl=te", "--fp8=1", "--fp8_recipe=delayed"], "te", "DelayedScaling"),
    ],
)
def test_every_precision_backend_is_one_interface(
    flags: list[str], name: str, fp8_recipe: str | None, te_double
) -> None:
    """train.py calls the three backends the same way (PrecisionBackend), with no branch on
    their names: the TE recipe that TE layers are built with is None outside TE FP8."""
    import torch

    from model_utils.precision import backends as precision

    backend = precision.build_backend(parse_args(flags), torch.device("cpu"))
    assert isinstance(backend, precision.PrecisionBackend) and backend.name == name
    assert type(backend.te_recipe).__name__ == (fp8_recipe or "NoneType")
    members = {m for m in dir(precision.PrecisionBackend) if not m.startswith("_")}
    assert members <= set(dir(backend))


def test_a_run_from_a_hf_folder_is_described_as_the_model_it_builds(tmp_path) -> None:
    """An --init_from_hf run was "model: tiny" and "ready: --preset tiny" (the default preset's
    name) while it built the checkpoint's model."""
    from transformers import LlamaConfig

    import train

    shape = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4)
    LlamaConfig(**shape, num_key_value_heads=2, intermediate_size=128).save_pretrained(tmp_path)
    config = parse_args([f"--init_from_hf={tmp_path}", "--fp8=0"])
    assert config.model_source == f"--init_from_hf {tmp_path} (3 layers, hidden 64)"
    line = train.ready_line(config)
    assert f"ready: --init_from_hf {tmp_path} (3 layers, hidden 64), bf16 on " in line
    assert "--preset" not in line
    assert parse_args([]).model_source == "--preset tiny"


def test_a_conflict_inside_a_recipe_names_the_recipe(tmp_path) -> None:
    """The user typed `--recipe llama3-8b-fp8`, not `--preset llama3-8b`: the refusal named a
    flag they never wrote."""
    from transformers import LlamaConfig

    shape = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4)
    LlamaConfig(**shape, num_key_value_heads=2, intermediate_size=128).save_pretrained(tmp_path)
    with pytest.raises(UsageError) as refused:
        parse_args(["--recipe", "llama3-8b-fp8", f"--init_from_hf={tmp_path}"])
    message = str(refused.value)
    assert "but --preset llama3-8b (" in message and "\n" not in message
    assert message.endswith("(--preset from --recipe llama3-8b-fp8)")
    with pytest.raises(UsageError) as typed:  # typed by the user: theirs, no recipe to name
        parse_args(["--recipe=llama3-8b-fp8", "--preset=llama3-8b", f"--init_from_hf={tmp_path}"])
    assert "from --recipe" not in str(typed.value)


def test_the_recipes_expected_output_agrees_with_itself_within_its_tolerance() -> None:
    """docs/recipes.md shows a log and a table of the same run: the step-1 loss in both must be
    the same figure, and the page states the tolerance another machine's run is held to."""
    import re

    page = (ROOT / "docs" / "recipes.md").read_text()
    [logged] = re.findall(r"Batch 1 Loss: ([\d.]+)", page)
    [tabled] = re.findall(r"\| step-1 loss \| ([\d.]+) fp8 /", page)
    assert logged == tabled
    assert "Expect the step-1\nloss within ±0.001 of the table" in page


def test_library_import_noise_is_left_out_and_the_libraries_other_lines_kept(caplog) -> None:
    """torchao's line per C++ kernel library it cannot load and torch's pytree deprecation
    (both printed as torchao is imported) say nothing about a run; any other line of those
    loggers still shows."""
    import logging

    import model_utils  # noqa: F401 (its import installs the filters)

    lines = {
        "torchao": [
            "Failed to load /v/site-packages/torchao/_C_mxfp8.cpython-310.so: Could not load",
            "Failed to load /v/site-packages/torchao/_C_cutlass_90a.abi3.so: Could not load",
            "Skipping import of cpp extensions due to incompatible torch version",
        ],
        "torchao.kernel.intmm": [
            "Warning: Detected no triton, on systems without Triton certain kernels will not work",
            "int_mm fell back",
        ],
        "torch.utils._pytree": [
            "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by "
            "torch.compile as an opaque value type.",
            "register_pytree_node is deprecated",
        ],
    }
    with caplog.at_level(logging.WARNING):
        for name, messages in lines.items():
            for message in messages:
                logging.getLogger(name).warning(message)
    assert [r.getMessage() for r in caplog.records] == [
        "Skipping import of cpp extensions due to incompatible torch version",
        "int_mm fell back",
        "register_pytree_node is deprecated",
    ]


def test_validate_only_refuses_data_too_small_to_validate(tmp_path, capsys) -> None:
    """It said "ready", and every rank then stopped at start-up with this line, after the
    launcher had made the run folder and started torchrun."""
    import train

    small = tmp_path / "small.jsonl"
    small.write_text('{"text": "one short document"}\n')
    argv = ["--recipe", "tiny-fp8", f"--dataset={small}", f"--output_dir={tmp_path / 'run'}"]
    with pytest.raises(SystemExit) as exited:
        train.main([*argv, "--validate_only"])
    [line] = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and not (tmp_path / "run").exists()
    assert line.startswith(f"train.py: error: --dataset {small}: the validation part has only 0")


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs /sys (Linux)")
def test_validate_only_writes_where_the_run_will_and_leaves_nothing(tmp_path, capsys) -> None:
    """It said "ready" for an --export_hf in /sys (writable to root by access()); the launcher
    then made the run folder, started torchrun, and the run refused there."""
    import train

    argv = ["--recipe", "tiny-fp8", f"--output_dir={tmp_path / 'run'}", "--validate_only"]
    with pytest.raises(SystemExit) as exited:
        train.main([*argv, "--export_hf=/sys/kernel/x"])
    [line] = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and list(tmp_path.iterdir()) == []
    assert line.startswith("train.py: error: --export_hf /sys/kernel/x cannot be written")
    train.main(argv)  # a good one is written and removed, as before
    assert list(tmp_path.iterdir()) == []
