"""The benchmarks' own behaviour, on CPU: bench_gpu_matrix refuses without a GPU, its rows are
train.py commands that run what their names say, its table shows the ratios and its failure
notes the cause; every row gpu_levers.sh names exists; bench_activation_checkpointing times each
setting with only its own model alive; every benchmark refuses a bad value before any work."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
from helpers.procs import warm_venv
from helpers.runs import FAST


def test_gpu_matrix_refuses_without_gpu(capsys, monkeypatch) -> None:
    from benchmarks import bench_gpu_matrix

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_gpu_matrix.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_gpu_matrix_never_measures_a_row_again_over_a_kept_one(tmp_path, capsys) -> None:
    """A phase run again into its folder deleted each row's metrics.jsonl before measuring it
    (gpu_common.sh: the GPU scripts never replace a run); refused before any row, GPU or not."""
    from benchmarks import bench_gpu_matrix

    kept = tmp_path / "te-bf16" / "metrics.jsonl"
    kept.parent.mkdir()
    kept.write_text('{"kind": "train"}\n')
    assert bench_gpu_matrix.main(["--out", str(tmp_path), "--modes", "train"]) == 2
    assert capsys.readouterr().err == (
        f"bench_gpu_matrix.py: error: {kept.parent} holds a run already: give a new --out\n"
    )
    assert kept.read_text() == '{"kind": "train"}\n'
    assert bench_gpu_matrix.main(["--out", str(tmp_path), "--only", "hf-bf16"]) == 2  # no GPU
    assert "needs a CUDA GPU" in capsys.readouterr().err


WHOLE = "is not a whole number >= 1"


@pytest.mark.parametrize(
    ("bench", "args", "says"),
    [
        ("bench_activation_checkpointing", ["--repeats", "0"], f"--repeats: '0' {WHOLE}"),
        ("bench_checkpoint", ["--sizes", "256x4,0x8"], "'256x4,0x8' is not HIDDENxLAYERS,..."),
        ("bench_checkpoint", ["--dir", "/proc/x"], "--dir: '/proc/x' is not a writable folder"),
        ("bench_data", ["--step_ms", "nan"], "--step_ms: 'nan' is not a number > 0"),
        ("bench_data", ["--tokens", "1.5"], f"--tokens: '1.5' {WHOLE}"),
        ("bench_fingerprint", ["--gib", "-1"], "--gib: '-1' is not a number > 0"),
        ("bench_hf_writer", ["--shape", "1024x8,512x4"], "is not HIDDENxLAYERS (e.g. 1024x8)"),
        ("bench_loss_kernel", ["--repeat", "0"], f"--repeat: '0' {WHOLE}"),
        ("bench_loss_memory", ["--micro_batch", "0"], f"--micro_batch: '0' {WHOLE}"),
        ("bench_optimizer_states", ["--ranks", "0"], f"--ranks: '0' {WHOLE}"),
        ("bench_rank_gather", ["--calls", "-3"], f"--calls: '-3' {WHOLE}"),
        ("bench_scaling", ["--threads", "0"], f"--threads: '0' {WHOLE}"),
        ("bench_numerics", ["--speed_warmup", "30"], "--speed_warmup must be below --steps"),
        ("bench_profiler_cost", ["--speed_warmup", "28"], "must be below --steps - 2"),
        ("bench_train_loop", ["--steps", "12", "--speed_warmup", "10"], "below --steps - 2"),
        ("bench_shaped_links", ["--steps", "5"], "--steps: '5' is not > 5 (warm-up)"),
        ("bench_shaped_links", ["--runs", "/proc/x"], "/proc/x/fp32-off/metrics.jsonl: no such"),
    ],
)
def test_every_benchmark_refuses_a_bad_value_in_one_line_before_any_work(
    bench: str, args: list[str], says: str, capsys, monkeypatch
) -> None:
    """Not a traceback after minutes of measuring: one line, exit 2."""
    module = importlib.import_module(f"benchmarks.{bench}")
    monkeypatch.setattr(sys, "argv", [f"{bench}.py", *args])
    with pytest.raises(SystemExit) as exited:
        module.main()
    [error] = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and error.startswith(f"{bench}.py: error: "), error
    assert says in error


def test_gpu_scripts_launch_only_recipes_that_exist() -> None:
    """The phases that launch shipped recipes (gpu_levers.sh's `recipe NAME RECIPE`, and
    gpu_parity.sh's pair) name recipes the launcher knows: a misspelt one costs a GPU call."""
    import re

    from benchmarks import bench_gpu_matrix as bench
    from model_utils.config import recipes

    levers = (bench.ROOT / "benchmarks" / "gpu_levers.sh").read_text()
    launch = r'^\s+(?:[A-Z_]+=\S+ )*(?:recipe|compiled) (?!"\$@")\S+ (\S+)'
    launched = re.findall(launch, levers, flags=re.M)
    # attention-3b 3, scaling-1b 2, host-1b 3, graphs-1b 2, and the 8B's one per phase
    assert len(launched) == 11 and launched[-1] == '"llama3-8b-${phase#8b-}"'
    launched[-1:] = ["llama3-8b-bf16", "llama3-8b-fp8"]
    parity = (bench.ROOT / "benchmarks" / "gpu_parity.sh").read_text()
    models = re.findall(r"^\s+recipe=(\S+)$", parity, flags=re.M)
    assert models == ["tiny", "llama3.2-1b"]
    for name in [*launched, *(f"{m}-{p}" for m in models for p in ("fp8", "bf16"))]:
        assert recipes.flags(name), name


def test_the_8b_phases_are_one_fair_pair_that_fits_one_h200_by_the_phases_own_arithmetic() -> None:
    """gpu_levers.sh's 8b-bf16 and 8b-fp8 launch the llama3-8b twins with the same overrides,
    which parse into the whole Llama 3.1 8B with torchao's 8-bit moments beside fp32
    parameters: 10 bytes per parameter, the 75 GiB its header counts on. A smaller GPU is
    refused before anything is made (test_gpu_levers_refuses_without_the_gpu_...)."""
    import dataclasses
    import re

    from benchmarks import bench_gpu_matrix as bench
    from model_utils.config.arguments import parse_args
    from model_utils.model import modeling

    levers = (bench.ROOT / "benchmarks" / "gpu_levers.sh").read_text()
    (overrides,) = re.findall(r'"llama3-8b-\$\{phase#8b-\}" \\\n((?:.*\\\n)*.*)$', levers, re.M)
    overrides = overrides.replace("\\\n", " ").replace('"$ck"', "/dev/shm/8b-fp8-checkpoints")
    overrides = overrides.removesuffix(" ;;")
    flags = [*overrides.split(), "--output_dir", "runs/8b"]  # the launcher names each folder
    twins = [parse_args(["--recipe", f"llama3-8b-{p}", *flags]) for p in ("bf16", "fp8")]
    assert [c.precision.fp8 for c in twins] == [False, True]
    fair = dataclasses.replace(twins[0], recipe=twins[1].recipe, precision=twins[1].precision)
    assert fair == twins[1]  # nothing but the precision differs
    shape, optim = twins[1].model, twins[1].optim
    assert (shape.num_layers, shape.vocab_size, optim.optimizer) == (32, 128256, "adamw8bit")
    assert twins[1].run.hang_timeout == 900  # step 1 compiles TE's layers and torchao's steps
    meta = modeling.build(twins[1], "hf", torch.device("cpu"))  # every parameter on meta
    params = sum(p.numel() for p in meta.parameters())
    assert 8.0e9 < params < 8.1e9 and 74 < params * (4 + 4 + 2) / 2**30 < 76


def test_every_shipped_recipe_gpu_levers_launches_finds_its_validation_in_the_bundled_corpus():
    """recipe() of gpu_levers.sh launches shipped recipes on data/kjv.jsonl.gz: the held-out
    documents hold 7 windows of 8192 tokens, so 4 batches of the micro-batch (the defaults)
    would end each run at start-up on the GPU. Its flags build every recipe's batches here."""
    import re

    from benchmarks import bench_gpu_matrix as bench
    from model_utils.config.arguments import parse_args
    from model_utils.data.tokens import load_tokenizer
    from model_utils.data.validation import validation_batches

    levers = (bench.ROOT / "benchmarks" / "gpu_levers.sh").read_text()
    (body,) = re.findall(r"^recipe\(\) \{\n(.*?)^\}", levers, flags=re.M | re.S)
    flags = body.replace("\\\n", " ").split('"$2"')[1].split('"${@:3}"')[0].split()
    recipes = set(re.findall(r"recipe \S+ (llama[\w.-]+)", levers))
    recipes |= {f"llama3-8b-{p}" for p in ("bf16", "fp8")}  # the 8B phases name it by pattern
    assert {"llama3.2-1b-fp8", "llama3.2-3b-bf16", "llama3-8b-fp8"} <= recipes
    tokenizer = load_tokenizer("data/tokenizer")
    for recipe in sorted(recipes):
        config = parse_args(["--recipe", recipe, *flags])
        width = config.model.max_context_width
        batches = validation_batches(config.data, tokenizer, width, config.run.validation_batches)
        assert len(batches) == 1 and batches[0]["input_ids"].shape == (1, width), recipe


def test_gpu_levers_script_names_only_rows_the_matrix_has(capsys) -> None:
    """A misspelt row in gpu_levers.sh would run nothing and spend a lent GPU's call: every
    row it names exists, and the matrix refuses an unknown row or mode in one line, exit 2."""
    import re

    from benchmarks import bench_gpu_matrix as bench

    script = (bench.ROOT / "benchmarks" / "gpu_levers.sh").read_text()
    selections = re.findall(r'matrix "([^"]+)"(?: \d+)?(?: "([^"]+)")?\)?$', script, flags=re.M)
    # levers, masters, compile, best, reshard, ac, attention, torchao, depth (4 and 8 layers)
    assert len(selections) == 10
    for only, vs in selections:
        assert bench.selection_problems("levers", only, vs) == [], only
        bench.parse_args(["--modes", "levers", "--only", only, "--vs", vs])
    # The ac phase's train.py flags parse under every AC setting the benchmark measures.
    from benchmarks import bench_activation_checkpointing as ac_bench
    from model_utils.config.arguments import parse_args

    joined = script.replace("\\\n", " ")
    (ac_flags,) = re.findall(
        r"benchmarks.bench_activation_checkpointing --repeats \d+ -- ([^\n]+)", joined
    )
    for flags in ac_bench.SETTINGS.values():
        parsed = parse_args([*ac_bench.LLAMA3_SHAPED, *flags, *ac_flags.split()])
        assert (parsed.precision.model_impl, parsed.precision.fp8, parsed.model.hidden_width) == (
            "te",
            True,
            4096,
        )
    for argv, wanted in (
        (
            ["--modes", "levers", "--only", "te-fp8 mb4 +expandible"],
            "no row 'te-fp8 mb4 +expandible'",
        ),
        (["--only", "te-fp8 mb2"], "no row 'te-fp8 mb2' in --modes train,infer"),
        (["--modes", "lever"], "unknown mode 'lever'"),
        (
            ["--modes", "levers", "--only", "te-fp8 mb2", "--vs", "te-bf16 mb2"],
            "--vs: 'te-bf16 mb2' is not among the rows that run",
        ),
    ):
        with pytest.raises(SystemExit) as exit_:
            bench.parse_args(argv)
        assert exit_.value.code == 2
        assert wanted in capsys.readouterr().err, argv


def test_gpu_matrix_rows_are_train_py_commands(tmp_path) -> None:
    """Each row runs what its name says as train.py reads the flags, the user's flags after
    the defaults and a lever row's own micro-batch and AC after the user's."""
    from benchmarks import bench_gpu_matrix as bench
    from model_utils.config.arguments import parse_args

    args, extra = bench.parse_args(["--preset", "tiny", "--nproc", "8", "--", "--seed", "3"])
    args.out = tmp_path
    for name, flags in bench.TRAIN_ROWS + bench.INFER_ROWS:
        cmd = bench.train_command(args, name, flags, extra)
        assert "--nproc_per_node=8" in cmd and cmd[-2:] == ["--seed", "3"]  # user flags win
        row = parse_args(cmd[cmd.index(str(bench.ROOT / "train.py")) + 1 :])  # parses, resolved
        # Each row runs what its name says, as train.py reads the flags (not their spelling).
        impl, kind, *recipe = name.split("+")[0].split("-")
        assert row.precision.model_impl == {"torchao": "hf"}.get(impl, impl), name
        assert row.precision.fp8 == (kind == "fp8") and recipe in (
            [],
            [row.precision.fp8_recipe],
        ), name
        assert (row.parallel.compile, row.precision.fp8_all_gather) == (
            "+compile" in name,
            "+ag" in name,
        ), name
        assert row.precision.fp8_weights == ("+fp8_weights" in name), name
    names = [name for name, _ in bench.TRAIN_ROWS]
    assert {"hf-bf16", "te-bf16", "te-fp8-delayed", "te-fp8-mxfp8"} <= set(names)
    user = ["--train_batch_size", "2", "--activation_checkpointing=0"]
    for name, fixed, env in bench.LEVER_ROWS:  # the row's own micro-batch and AC win
        cmd = bench.train_command(args, name, (), user, fixed)
        parsed = parse_args(cmd[cmd.index(str(bench.ROOT / "train.py")) + 1 :])
        assert f"--train_batch_size={parsed.data.train_batch_size}" in fixed, name
        assert parsed.parallel.activation_checkpointing == (
            "--activation_checkpointing" in fixed
        ), name
        assert parsed.parallel.ac_scope == ("mlp" if "+AC-mlp" in name else "layer"), name
        assert env in ({}, bench.EXPANDABLE) and ("expandable" in name) == bool(env), name
        assert parsed.parallel.compile == ("+compile" in name), name
        assert (parsed.optim.master_weights == "optimizer") == ("+masters" in name), name
        assert (parsed.parallel.reshard_after_forward == "never") == ("+no-reshard" in name), name
        assert parsed.precision.fp8_attention == ("+fp8-attention" in name), name
        impl, kind = name.split()[0].split("-")
        assert (parsed.precision.model_impl, parsed.precision.fp8) == (
            {"torchao": "hf"}.get(impl, impl),
            kind == "fp8",
        )
        assert parsed.precision.fp8_all_gather == ("+ag" in name), name
        assert " " not in cmd[-len(fixed) - len(user) - 1]  # run directory without spaces
    # The table's shape line parses from a row's own flags: the user's alone may not (the
    # --fp8_attention of a run on H100 is refused without the --fp8=1 a row supplies).
    from model_utils.config.arguments import UsageError

    fixed = next(fixed for name, fixed, _ in bench.LEVER_ROWS if "+fp8-attention" in name)
    with pytest.raises(UsageError, match="--fp8_attention needs --fp8=1"):
        parse_args(["--preset=tiny", "--fp8_attention"])
    shape = bench.shape_line(args, ["--fp8_attention", *fixed], per_row_batch=True)
    assert "micro-batch per row" in shape and "preset tiny" in shape
    assert set(bench.BASELINES["levers"]) <= {name for name, *_ in bench.LEVER_ROWS}
    assert {"hf-bf16+compile", "torchao-fp8-rowwise+compile"} <= set(names)
    assert all("+compile" in name for name in names if name.startswith("torchao"))


def test_gpu_matrix_table_shows_ratios_against_each_modes_baseline() -> None:
    from benchmarks import bench_gpu_matrix as bench

    rows = [
        bench.Row("hf-bf16", "train", 1000.0, 100.0, 10.0),
        bench.Row("te-bf16", "train", 1250.0, 125.0, 9.0),
        bench.Row("te-fp8-delayed", "train", 1500.0, 150.0, 8.0),
        bench.Row("te-fp8-mxfp8", "train", note="skipped: needs SM 10.0+"),
    ]
    table = bench.render(rows, "preset tiny, seq 256, micro-batch 8 x 1 accumulation")
    fp8_line = next(line for line in table.splitlines() if "te-fp8-delayed" in line)
    assert "1.50x" in fp8_line and "1.20x" in fp8_line
    assert "[train] A = hf-bf16, B = te-bf16" in table and "[levers]" not in table
    levers = bench.render(
        [
            bench.Row("te-fp8 mb2 hf-loss", "levers", 1000.0, 100.0, 50.0),
            bench.Row("te-bf16 mb2 hf-loss", "levers", 800.0, 80.0, 52.0),
            bench.Row("te-fp8 mb4 +AC +expandable", "levers", 1100.0, 110.0, 40.0),
        ]
    )
    ac_line = next(line for line in levers.splitlines() if "mb4" in line)
    assert "1.10x" in ac_line and "1.38x" in ac_line
    # --vs: one slice's rows against one of them (here te-fp8 against te-bf16, measured in the
    # same run), in column A of that row's mode; the other modes keep their baselines.
    args, _ = bench.parse_args(
        ["--modes", "levers", "--only", "te-bf16 mb2,te-fp8 mb2", "--vs", "te-bf16 mb2"]
    )
    depth = bench.render(
        [
            bench.Row("te-bf16 mb2", "levers", 800.0, 80.0, 50.0),
            bench.Row("te-fp8 mb2", "levers", 1000.0, 100.0, 48.0),
        ],
        baselines=bench.baselines_with(args.vs),
    )
    assert "[levers] A = te-bf16 mb2, B = te-bf16 mb2 hf-loss" in depth
    assert "1.25x" in next(line for line in depth.splitlines() if "te-fp8 mb2" in line)
    assert bench.baselines_with(args.vs)["train"] == bench.BASELINES["train"]
    assert "skipped: needs SM 10.0+" in table and table.startswith("preset tiny, seq 256")


def test_gpu_matrix_failure_notes_and_wall_clock_rate() -> None:
    from benchmarks import bench_gpu_matrix as bench

    log = "Traceback ...\nImportError: libcudnn_cnn.so.9: undefined symbol: cudnnFoo, version 9\n"
    note = bench.failure_note(log)
    assert "undefined symbol" in note and "LD_LIBRARY_PATH" in note
    torchrun = (
        "train.py: error: --num_layers must be > 0, got 0\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    )
    assert "--num_layers must be > 0" in bench.failure_note(torchrun)
    records = [
        {
            "kind": "train",
            "step": s,
            "tokens": 1000,
            "time": 10.0 + s,
            "step_seconds": 1.0,
            "tokens_per_sec_per_device": 500.0,
        }
        for s in range(1, 11)
    ]
    assert bench.wall_clock_rate(records, warmup_steps=5) == pytest.approx(500.0)  # 2 devices


def test_the_ac_benchmark_times_each_setting_with_only_its_own_model_alive(monkeypatch):
    """bench_activation_checkpointing measures settings one after another in one process; the
    models before stay alive in reference cycles unless collected, and on the H100 each
    setting's peak memory then included theirs."""
    import weakref

    import torch.distributed as dist

    from benchmarks import bench_activation_checkpointing as bench

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    built: list[weakref.ref] = []
    alive_while_timing: list[int] = []
    real_build = bench.build

    def build(flags, device):
        run = real_build(flags, device)
        built.append(weakref.ref(run.model))
        return run

    def median_seconds(step, repeats, device):
        alive_while_timing.append(sum(ref() is not None for ref in built))
        return 1.0

    monkeypatch.setattr(bench, "build", build)
    monkeypatch.setattr(bench, "median_seconds", median_seconds)
    flags = [*FAST, "--num_layers=2"]
    for _ in range(3):
        bench.measure(flags, 1, torch.device("cpu"))
    assert alive_while_timing == [1, 1, 1]


@pytest.mark.parametrize(
    "script", ["gpu_parity.sh", "gpu_long_ab.sh", "gpu_levers.sh", "profile_pair.sh"]
)
def test_the_gpu_scripts_refuse_before_running_and_delete_no_run(script, tmp_path) -> None:
    """A forgotten OUT_DIR (a flag in its place), one that cannot be made, and one that already
    holds a run the call would launch are one line and exit 2 before anything runs; the run is
    kept as it was. --help is the script's header and usage, exit 0. Without $PYTHON the
    scripts' Python is the checkout's .venv (the dry runs' verdict ran the system python3,
    which has no torch on a CPU box)."""
    import os
    import subprocess

    from benchmarks import bench_gpu_matrix as bench

    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    lead = ["tier"] if script == "gpu_levers.sh" else []
    forgot = subprocess.run(
        ["bash", f"benchmarks/{script}", *lead, "--dry_run"],
        cwd=bench.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert forgot.returncode == 2, forgot.stderr
    assert "no OUT_DIR where the usage has it (got '--dry_run')" in forgot.stderr
    helped = subprocess.run(
        ["bash", f"benchmarks/{script}", *lead, str(tmp_path / "out"), "--help"],
        cwd=bench.ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    header = (bench.ROOT / "benchmarks" / script).read_text().splitlines()[1][2:]
    assert helped.returncode == 0 and helped.stdout.startswith(header + "\n"), helped.stderr
    assert helped.stdout.splitlines()[-1].startswith(f"usage: bash benchmarks/{script}")
    (tmp_path / "file").write_text("a file, not a folder\n")
    file, under_a_file = tmp_path / "file", tmp_path / "file" / "sub"
    for wrong_args, said in (
        ([str(tmp_path / "out"), "--bogus"], ""),
        ([str(file)], f"OUT_DIR {file} is a file, not a folder"),
        ([str(under_a_file)], f"OUT_DIR {under_a_file} cannot be made: {file} is not a folder"),
    ):
        wrong = subprocess.run(
            ["bash", f"benchmarks/{script}", *lead, *wrong_args],
            cwd=bench.ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1, wrong.stderr
        assert said in wrong.stderr
        assert not (tmp_path / "out").exists()  # nothing made before every check passed
    if script == "gpu_levers.sh":  # no phase, or one it lacks: refused before OUT_DIR is made
        for phase in ([], ["8b"], ["loss|levers"]):
            wrong = subprocess.run(
                ["bash", "benchmarks/gpu_levers.sh", *phase, str(tmp_path / "out")],
                cwd=bench.ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            said = f"gpu_levers.sh: error: no phase '{phase[0] if phase else tmp_path / 'out'}'"
            assert wrong.returncode == 2 and wrong.stderr.startswith(said), wrong.stderr
            assert wrong.stderr.count("\n") == 1 and not (tmp_path / "out").exists()
    if script != "gpu_levers.sh":  # its runs are named by the phase, checked as each starts
        kept = {"gpu_parity.sh": "fp8", "gpu_long_ab.sh": "bf16-a", "profile_pair.sh": "te-fp8"}
        finished, dry = (
            tmp_path / kept[script],
            [] if script == "profile_pair.sh" else ["--dry_run"],
        )
        finished.mkdir()
        (finished / "metrics.jsonl").write_text("{}\n")
        again = subprocess.run(
            ["bash", f"benchmarks/{script}", str(tmp_path), *dry],
            cwd=bench.ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert again.returncode == 2, again.stdout + again.stderr
        assert f"{finished} holds a run already: give a new OUT_DIR" in again.stderr
        assert again.stderr.count("\n") == 1, again.stderr  # no rm racing a started check
        assert (finished / "metrics.jsonl").read_text() == "{}\n"
    venv = bench.ROOT / ".venv" / "bin" / "python"
    said = subprocess.run(
        ["bash", "-c", "source benchmarks/gpu_common.sh; echo $python"],
        cwd=bench.ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert said == (str(venv) if venv.exists() else "python3")


def _gpu_script(script: str, *args: str, tmp: Path, cwd=None, **env: str):
    """benchmarks/SCRIPT ARGS run as a user runs it (from CWD, default the checkout), the
    launcher's Python processes warm (a venv of stand-ins in TMP)."""
    import os
    import subprocess

    from benchmarks import bench_gpu_matrix as bench

    return subprocess.run(
        ["bash", str(bench.ROOT / "benchmarks" / script), *args],
        cwd=cwd or bench.ROOT,
        env={**os.environ, **warm_venv(tmp / "venv"), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


NOPE = "--fp8_recipe nope is not a torchao recipe for --model_impl hf; choose one of tensorwise"


@pytest.mark.parametrize(
    ("script", "args", "env", "run"),
    [
        ("gpu_parity.sh", ["--dry_run", "--", "--fp8_recipe", "nope"], {}, "fp8"),
        (
            "gpu_long_ab.sh",
            ["--dry_run", "--arms", "bf16-a,fp8-closer"],
            {"CLOSER": "--fp8_recipe nope"},
            "fp8-closer",
        ),
    ],
)
def test_every_runs_flags_are_checked_before_the_first_run_starts(
    script, args, env, run, tmp_path
) -> None:
    """A flag only a later run gets (the FP8 run's, an arm's) is refused before the BF16 run
    spends its minutes on the GPU, not after it (which also left OUT_DIR/bf16 in the way of the
    corrected call): train.py --validate_only's line, as the script's one line, exit 2."""
    out = tmp_path / "out"
    refused = _gpu_script(script, str(out), *args, tmp=tmp_path, STEPS="3", WARMUP="1", **env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr == (
        f"{script}: error: the {run} run would be refused (nothing ran): train.py: error: {NOPE}"
        ", rowwise, rowwise_with_gw_hp (--model_impl auto chose hf: no FP8-capable GPU (Hopper "
        "or Ada) is visible)\n"
    )
    assert not out.exists()  # no bf16/ run folder, no log


def test_gpu_levers_checks_every_run_of_a_phase_before_the_first_starts(tmp_path) -> None:
    """host-1b's third run already in OUT_DIR is refused before its first run starts."""
    import os

    gpu = tmp_path / "bin"
    gpu.mkdir()
    (gpu / "nvidia-smi").write_text("#!/bin/sh\necho 81559\n")  # an H100's memory
    (gpu / "nvidia-smi").chmod(0o755)
    (tmp_path / "out" / "1b-bf16-none").mkdir(parents=True)
    path = f"{gpu}:{os.environ['PATH']}"
    refused = _gpu_script(
        "gpu_levers.sh", "host-1b", str(tmp_path / "out"), tmp=tmp_path, PATH=path
    )
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr == (
        f"gpu_levers.sh: error: {tmp_path}/out/1b-bf16-none holds a run already: give a new "
        "OUT_DIR or move it away\n"
    )
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["1b-bf16-none"]


NO_ARMS = (
    "--arms needs its NAME,... or none (e.g. --arms bf16-a,bf16-b,fp8): usage: bash "
    "benchmarks/gpu_long_ab.sh OUT_DIR [--dry_run] [--arms NAME,...|none]"
)


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--arms"], NO_ARMS),
        (["--arms", "--dry_run"], NO_ARMS),
        (["--dry_run", "--arms"], NO_ARMS),
        # two launches into one run folder, the second's log over the first's
        (["--dry_run", "--arms", "fp8,bf16-a,fp8"], "--arms: fp8 given twice (each arm is one run"),
    ],
)
def test_a_flag_without_its_value_or_an_arm_twice_is_one_line_and_exit_2(args, said, tmp_path):
    refused = _gpu_script("gpu_long_ab.sh", str(tmp_path / "out"), *args, tmp=tmp_path)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.startswith(f"gpu_long_ab.sh: error: {said}"), refused.stderr
    assert refused.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("mib", "said"),
    [
        ("", "no GPU is visible (nvidia-smi lists none): 8b-bf16 runs on an H200 (141 GB)"),
        ("81559", "8b-bf16 runs on an H200 (141 GB), not on this 81559 MiB GPU"),
    ],
)
def test_gpu_levers_refuses_without_the_gpu_before_making_anything(mib, said, tmp_path) -> None:
    """No GPU (nvidia-smi failing, or none at all) or too small a one for the phase: one line,
    before OUT_DIR or its log exists; from any folder, OUT_DIR relative to it."""
    import os

    gpu = tmp_path / "bin"
    gpu.mkdir()
    (gpu / "nvidia-smi").write_text(f"#!/bin/sh\necho {mib or 'NVIDIA-SMI has failed'}\n")
    (gpu / "nvidia-smi").chmod(0o755)
    path = f"{gpu}:{os.environ['PATH']}"
    refused = _gpu_script("gpu_levers.sh", "8b-bf16", "out", tmp=tmp_path, cwd=tmp_path, PATH=path)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr == f"gpu_levers.sh: error: {said}\n"
    assert not (tmp_path / "out").exists()


def test_profile_pair_runs_from_any_folder(tmp_path) -> None:
    """Started from outside the checkout, profile_pair.sh finds train.py and data/ (here its
    check of the pair refuses TE's absence, before OUT_DIR, relative to that folder, is made)."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed: the pair would train")
    refused = _gpu_script("profile_pair.sh", "out", tmp=tmp_path, cwd=tmp_path)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr == (
        "profile_pair.sh: error: the te-bf16 run would be refused (nothing ran): train.py: error: "
        "--model_impl te needs Transformer Engine (import failed: No module named "
        "'transformer_engine'); use the NGC container (0.transformer-engine.dockerfile) or "
        "--model_impl hf\n"
    )
    assert not (tmp_path / "out").exists()


def _shaped_run(folder, flags: list[str], tokens_per_sec: float, network_gbs: float) -> None:
    from model_utils.config.arguments import parse_args
    from model_utils.report import metrics

    folder.mkdir(parents=True)
    config = parse_args(["--preset", "tiny", "--bf16=0", *flags]).as_dict()
    with metrics.JsonlWriter(folder / "metrics.jsonl") as writer:
        writer.write(metrics.run_record(config, world_size=2, samples_per_step=8))
        for step in range(1, 13):
            record = {"kind": "train", "step": step, "loss": 9.0, "lr": 1e-3}
            writer.write(record | {"tokens_per_sec_per_device": tokens_per_sec})
    rows = [
        {"op": op, "payload": "bf16", "scope": "across nodes", "bus_gbs": network_gbs * share}
        for op, share in (("all_gather", 1.0), ("reduce_scatter", 0.5))
    ]
    record = {"nodes": 2, "backend": "gloo", "collectives": rows}
    (folder / "preflight.json").write_text(json.dumps(record))


def test_shaped_links_report_projects_each_rate_from_its_own_preflight(tmp_path, capsys):
    """The accounting of benchmarks/bench_shaped_links.py: each arm's unshaped run is the base,
    each rate's link is the bandwidth its own preflight measured, and the ratio is projected
    over measured step time (the unshaped row: 1 by construction)."""
    from analysis import project_scale as ps
    from benchmarks import bench_shaped_links as bench

    for arm, flags in bench.PAIR.items():
        _shaped_run(tmp_path / f"{arm}-off", flags, 4000.0, 0.5)
        _shaped_run(tmp_path / f"{arm}-100mbit", flags, 1000.0, 0.01)
    assert bench.main(["--rates", "off,100mbit", "--runs", str(tmp_path)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [row[:2] for row in rows] == [[a, r] for a in bench.PAIR for r in ("off", "100mbit")]
    for arm, rate, gbs, step, guess, ratio in rows:
        job, base = bench.measured(tmp_path / f"{arm}-off")
        links = ps.links_of(json.loads((tmp_path / f"{arm}-{rate}/preflight.json").read_text()))
        want = job.tokens_per_gpu / ps.projected(job, (2, 1), 2, 1, links=links, base_links=base)
        assert float(gbs) == links.network and float(guess) == pytest.approx(want, abs=1e-3)
        assert float(ratio) == pytest.approx(float(guess) / float(step), abs=2e-3)
    assert rows[0][5] == "1.000" and float(rows[1][4]) > 2 * float(rows[0][4])  # slower link
