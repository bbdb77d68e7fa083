"""Flags, presets and the one-line exit-2 contract for bad input."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from model_utils.config import arguments, machine, run_config, sections
from model_utils.config.arguments import UsageError, parse_args
from model_utils.config.flag_spec import Resume
from model_utils.config.presets import PRESETS
from model_utils.config.run_config import TOP_FIELDS, Config
from model_utils.config.sections import SECTIONS, flag_fields
from model_utils.model import modeling

ROOT = Path(__file__).resolve().parents[2]


def test_preset_fills_unset_fields_and_explicit_flags_win():
    args = parse_args(["--preset", "llama3-8b", "--num_layers", "2", "--max_steps", "20"])
    assert args.model.num_layers == 2  # explicit
    assert args.model.hidden_width == 4096 and args.model.num_key_value_heads == 8  # from preset
    assert args.model.vocab_size == 128256 and args.model.rope_theta == 500000.0
    assert args.model.max_context_width == 8192
    assert args.data.val_batch_size == args.data.train_batch_size


def test_preset_dataset_config_follows_the_preset_dataset_only():
    """llama3-8b streams allenai/c4 'en'; a user's own --dataset must not inherit 'en' (the
    GPU matrix on the bundled corpus was refused for exactly that)."""
    assert parse_args(["--preset", "llama3-8b"]).data.dataset_config_name == "en"
    own = parse_args(["--preset", "llama3-8b", "--dataset", "data/kjv.jsonl.gz"])
    assert own.data.dataset_config_name is None
    both = ["--preset", "llama3-8b", "--dataset", "x/y", "--dataset_config_name", "de"]
    assert parse_args(both).data.dataset_config_name == "de"
    assert parse_args(["--preset", "tiny"]).data.dataset_config_name is None


@pytest.mark.parametrize(
    "name, shape",
    [
        ("llama2-7b", (4096, 32, 32, 32, 11008, 32000)),
        ("llama2-13b", (5120, 40, 40, 40, 13824, 32000)),
        ("llama2-70b", (8192, 80, 64, 8, 28672, 32000)),
        ("llama3-8b", (4096, 32, 32, 8, 14336, 128256)),
        ("llama3-70b", (8192, 80, 64, 8, 28672, 128256)),
    ],
)
def test_presets_have_published_shapes(name, shape):
    p = PRESETS[name]
    got = (
        p.hidden_width,
        p.num_layers,
        p.num_heads,
        p.num_key_value_heads,
        p.intermediate_size,
        p.vocab_size,
    )
    assert got == shape


def test_llama2_7b_parameter_count_matches_published_6_74b():
    args = parse_args(["--preset", "llama2-7b", "--max_steps", "20"])
    model = modeling.build(args, "hf", modeling.torch.device("cpu"))
    assert abs(modeling.count_parameters(model) - 6.738e9) / 6.738e9 < 1e-3


def test_llama31_preset_carries_rope_scaling_into_the_hf_config():
    args = parse_args(["--preset", "llama3.1-8b", "--max_steps", "20"])
    config = modeling.model_config(args.model)
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_parameters["rope_theta"] == 500000.0


def _product_code(*config_modules: str) -> str:
    """The product's code outside the config package, which only parses and checks the flags,
    and these modules of it."""
    sources = [
        ROOT / "train.py",
        *sorted((ROOT / "model_utils").rglob("*.py")),  # packages too (data/, metrics/)
        ROOT / "te_llama.py",
    ]
    config_dir = ROOT / "model_utils" / "config"
    kept = {config_dir / name for name in config_modules}
    return "\n".join(p.read_text() for p in sources if config_dir not in p.parents or p in kept)


def test_every_flag_is_read_somewhere():
    """No dead flags: each option is read as a config field (`.optim.lr`, `optim.lr` inside
    the optim stage, or a table of fields read by name) outside the config package, or into
    the FP8 plan, whose fields are read outside it (the next test)."""
    # sections.py: SHAPE_FIELDS, the shape read by name (model_config); run_config.py:
    # Config.model_source, the preset in the run's lines; options.py: TE_RECIPE_KEYWORDS,
    # the TE recipe flags read by name (precision/te.build_recipe)
    code = _product_code("sections.py", "run_config.py", "fp8_plan.py", "options.py")
    parser = arguments.build_parser()
    dests = {a.dest for a in parser._actions if a.dest != "help"}

    def read(d: str) -> bool:  # as a field, by name, or in a table of fields
        ways = [rf"\w\.{d}\b", rf'get\("{d}"\)', rf'^    "{d}",$', rf'^    "{d}": "\w+",$']
        return bool(re.search("|".join(ways), code, re.MULTILINE))

    unread = sorted(d for d in dests if not read(d))
    assert unread == []


def test_every_fp8_plan_field_is_read_outside_the_config():
    """The FP8 plan is what the stages read of the FP8 flags: none of its fields is dead."""
    from dataclasses import fields

    from model_utils.config.fp8_plan import Fp8Plan

    code = _product_code()
    unread = [f.name for f in fields(Fp8Plan) if not re.search(rf"plan\.{f.name}\b", code)]
    assert unread == []


def test_each_flag_group_is_a_config_section():
    """The parser's groups are the sections (docs/flags.md's order): a flag added to a group
    is a field of that section, and a section field is a flag unless a preset or the run's
    checks fill it in."""
    groups = arguments.section_flags()
    assert groups.pop(None) == list(TOP_FIELDS)
    assert list(groups) == list(SECTIONS)
    for section, kind in SECTIONS.items():
        assert list(flag_fields(kind)) == groups[section], section


def test_every_config_field_says_what_a_resume_may_do_with_it(monkeypatch):
    """Each field is declared with flag() or derived() and a resume class (the resume rules
    read it there); a field declared without one stops every parse, rather than becoming "a
    resume may change it" by omission."""
    specs = run_config.flag_specs()
    assert set(specs) == set(run_config.SECTION_OF) | set(TOP_FIELDS)
    assert all(isinstance(spec.resume, Resume) for spec in specs.values())

    @dataclass(frozen=True)
    class Undeclared:
        new_flag: int

    monkeypatch.setitem(sections.SECTIONS, "new", Undeclared)
    with pytest.raises(TypeError, match="new_flag is declared without flag"):
        run_config.flag_specs()


def test_the_parser_is_derived_from_the_fields():
    """A field's annotation is its flag's type (a bool a 0|1 switch), its declaration the
    default, choices and help; the path flags are the fields declared as paths."""
    actions = {a.dest: a for a in arguments.build_parser()._actions}
    assert actions["lr"].type is float and actions["lr"].default == 1e-3
    assert actions["num_layers"].type is int and actions["num_layers"].default is None
    assert actions["fp8"].metavar == "0|1" and actions["fp8"].const is True
    assert actions["optimizer"].choices == ("adamw", "adamw8bit", "adamw_fp8")
    assert actions["preset"].choices == sorted(PRESETS)
    assert actions["profile_steps"].metavar == "START:END"
    assert set(run_config.path_flags()) == {
        "tokenizer",
        "dataset",
        "checkpoint_dir",
        "resume_from_checkpoint",
        "init_from_hf",
        "export_hf",
        "output_dir",
    }
    home = parse_args(["--output_dir=~/run-x", "--validate_only"]).run.output_dir
    assert home == str(Path.home() / "run-x")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num_heads", "3"], "not divisible by --num_heads"),
        (["--num_key_value_heads", "3"], "--num_key_value_heads"),
        (["--min_lr", "1", "--lr", "0.1"], "--min_lr"),
        (["--warmup", "200", "--max_steps", "100"], "--warmup"),
        (["--fp8_all_gather"], "--fp8_all_gather needs --fp8=1"),
        (["--fp8", "maybe"], "expected 0/1"),
        (["--preset", "llama5"], "invalid choice"),
        (["--train_batch_size", "0"], "--train_batch_size must be > 0"),
        (["--activation_checkpointing", "--ac_every=0"], "--ac_every must be >= 1"),
        (["--ac_every=2"], "--ac_every needs --activation_checkpointing"),
        (["--ac_scope=mlp"], "--ac_scope mlp needs --activation_checkpointing"),
        (["--seed=-1"], "--seed must be in [0, 2**63), got -1"),
        (["--validation_batches=0"], "--validation_batches must be > 0, got 0"),
        (["--dist_timeout=99999999999999999"], "--dist_timeout must be <= 2592000 s (30 days)"),
        (
            ["--model_impl=hf", "--fp8=1", "--amax_history_len=16"],
            "--amax_history_len is a Transformer Engine recipe option and does nothing with "
            "--model_impl hf (torchao): drop it, or use --model_impl te",
        ),
        (["--model_impl=hf", "--fp8_format=e4m3"], "--fp8_format is a Transformer Engine"),
        (
            ["--model_impl=te", "--fp8=1", "--fp8_recipe=current", "--amax_compute_algo=max"],
            "--amax_compute_algo does nothing with --fp8_recipe current: only delayed scaling "
            "read it; drop it or change --fp8_recipe",
        ),
        (
            ["--model_impl=te_linear", "--fp8=1", "--fp8_recipe=block", "--fp8_margin=1"],
            "only delayed and mxfp8 scaling read it",
        ),
        (
            ["--model_impl=te", "--fp8=1", "--fp8_recipe=delayed", "--fp8_backward=dequantized"],
            "--fp8_backward does nothing with --fp8_recipe delayed: only current, block and mxfp8 "
            "scaling read it; drop it or change --fp8_recipe",
        ),
        (["--model_impl=hf", "--fp8=1", "--fp8_backward=high_precision"], "Transformer Engine"),
        (
            ["--model_impl=te", "--fp8=1", "--fp8_recipe=current", "--fp8_backward=dequantized"],
            "--fp8_backward dequantized has no path through --model_impl te's fused MLP (TE's "
            "LayerNormMLP refuses it): use --model_impl te_linear",
        ),
        ([f"--seed={2**63}"], "--seed must be in [0, 2**63)"),
        (["--activation_checkpointing", "--ac_scope=attention"], "invalid choice: 'attention'"),
        (["--output_dir="], "--output_dir is empty (an unset shell variable?)"),
        (["--checkpoint_dir", ""], "--checkpoint_dir is empty"),
        (["--dataset", " "], "--dataset is empty"),
        (["--text_column="], "--text_column is empty"),
        (["--resume_from_checkpoint="], "--resume_from_checkpoint is empty"),
        ([f"--tokenizer=/tmp/{'t' * 256}/x"], "is 256 bytes long; file systems take at most 255"),
        (["--output_dir=runs/a\nb"], "--output_dir holds a line break: give a value on one line"),
        (["--max_context_width=1"], "--max_context_width must be >= 2 (one token has no next"),
        (["--max_context_width=0"], "--max_context_width must be > 0, got 0"),
        (["--beta2=1"], "--beta1/--beta2 must be in [0, 1), got 0.9/1.0"),
        (["--hang_timeout=-1"], "--hang_timeout must be >= 1 seconds (0: off), got -1"),
        (["--checkpoint_freq=-2"], "--checkpoint_freq must be >= -1, got -2"),
        (["--keep_last=-1"], "--keep_last must be >= 0, got -1"),
        (
            ["--hidden_width=260", "--num_heads=4"],
            "gives heads of 65 dimensions; RoPE needs an even number",
        ),
        (
            ["--cuda_graphs", "--compile"],
            "--cuda_graphs captures TE's decoder layers as CUDA graphs: it needs --model_impl te, "
            "--sharding_strategy none, a CUDA GPU and no --compile",
        ),
        (
            ["--sharding_strategy=none", "--reshard_after_forward=never"],
            "--reshard_after_forward never is an FSDP2 choice; --sharding_strategy none keeps",
        ),
        (
            ["--overwrite_output_dir", "--resume_from_checkpoint=auto"],
            "--overwrite_output_dir deletes the checkpoints --resume_from_checkpoint would resume "
            "from: drop one of them",
        ),
        (
            ["--fp8=1", "--bf16_layers=0", "--model_impl=te", "--fp8_weights"],
            "--bf16_layers with --fp8_weights: a layer kept in BF16 needs high-precision weights",
        ),
        (
            ["--sharding_strategy=none", "--reduce_dtype=fp8"],
            "--reduce_dtype fp8 sets FSDP2's reduce; --sharding_strategy none has none: drop one "
            "of them",
        ),
        (["--reduce_dtype=fp16"], "invalid choice: 'fp16'"),
        (
            ["--fp8=1", "--fp8_all_gather", "--fp8_numerics"],
            "--fp8_numerics with --fp8_all_gather: the weights arrive in float8, with no bf16 to",
        ),
        (
            ["--sharding_strategy=none", "--fp8=1", "--fp8_all_gather"],
            "--fp8_all_gather gathers FSDP2's weight shards in float8; --sharding_strategy none",
        ),
    ],
)
def test_bad_flags_raise_usage_error(argv, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        parse_args(argv)


def test_no_fsdp2_needs_a_world_of_one(monkeypatch):
    """--sharding_strategy none in a launch of several ranks: refused before any process group."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert parse_args(["--sharding_strategy=none"]).parallel.sharding_strategy == "none"
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match="this launch has 2 ranks: use --sharding_strategy full"):
        parse_args(["--sharding_strategy=none"])


def test_a_global_batch_sets_the_accumulation_for_each_launchs_ranks(monkeypatch):
    """torchtitan's rule: the same flags on 4, 2 or 1 ranks train 16 sequences a step."""
    from model_utils.parallel.distributed import resolve_global_batch

    flags = ["--global_batch_size=16", "--train_batch_size=2"]
    for world_size, accumulation in ((4, 2), (2, 4), (1, 8)):
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        assert resolve_global_batch(parse_args(flags)).optim.grad_accum_steps == accumulation
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UsageError, match=r"^--global_batch_size 16 is not a multiple of "):
        resolve_global_batch(parse_args(flags))  # 2 x 3 ranks
    with pytest.raises(UsageError, match="sets --grad_accum_steps itself: drop one of them"):
        parse_args([*flags, "--grad_accum_steps=2"])


def test_fp8_weights_in_blocks_are_refused_on_several_ranks(monkeypatch):
    """TE's FSDP2 all-gather misplaces a shard's 128-row block scales (TE 2.20's own FSDP2
    tests xfail --fp8_weights with Float8BlockScaling): one rank trains, several are refused."""
    flags = ["--model_impl=te", "--fp8=1", "--fp8_recipe=block", "--fp8_weights"]
    flags += ["--master_weights=optimizer"]
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert parse_args(flags).precision.fp8_weights
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(UsageError, match="block cannot be sharded over ranks: FSDP2's all-gather"):
        parse_args(flags)
    assert parse_args([*flags, "--fp8_recipe=current"]).precision.fp8_weights


def test_the_largest_seed_starts_a_run_the_same_way_twice():
    """--seed 2**63 - 1: torch's generator and the data order accept it."""
    import torch

    from model_utils.checkpoint.checkpointer import reseed_rng

    seed = parse_args([f"--seed={2**63 - 1}"]).run.seed
    torch.manual_seed(seed)
    first = torch.rand(3)
    reseed_rng(seed)
    assert torch.equal(torch.rand(3), first)
    from model_utils.data.sources import epoch_shard_order

    assert epoch_shard_order(seed, 1) == epoch_shard_order(seed, 1) > 0


def test_te_recipe_options_pass_where_a_te_recipe_reads_them():
    """Every option its recipes read, and any of them with --fp8=0 on TE (one command line
    toggles FP8); a default is never refused (only what the user gave). --fp8_backward runs on
    TE's separate linears (te_linear): TE's fused LayerNormMLP has no such backward."""
    from model_utils.config.options import TE_RECIPE_OPTIONS

    values = {
        "fp8_format": "e4m3",
        "amax_history_len": "16",
        "amax_compute_algo": "most_recent",
        "fp8_margin": "1",
        "fp8_backward": "high_precision",
    }
    for name, recipes in TE_RECIPE_OPTIONS.items():
        impl = "te_linear" if name == "fp8_backward" else "te"
        for recipe in recipes:
            argv = [f"--model_impl={impl}", "--fp8=1", f"--fp8_recipe={recipe}", f"--{name}"]
            args = parse_args([*argv, values[name]])
            assert str(args.get(name)) == values[name], (name, recipe)
        toggled = parse_args(["--model_impl=te", "--fp8=0", f"--{name}", values[name]])
        assert str(toggled.get(name)) == values[name]
    assert parse_args(["--model_impl=hf", "--fp8=1"]).precision.amax_history_len == 1024  # default


def test_fp8_recipe_is_checked_against_the_backend():
    with pytest.raises(UsageError, match="not a torchao recipe"):
        parse_args(["--fp8=1", "--fp8_recipe", "delayed", "--model_impl", "hf"])
    args = parse_args(["--fp8=1", "--model_impl", "hf"])
    assert args.precision.fp8_recipe == "tensorwise"
    assert parse_args(["--fp8=1", "--model_impl", "te"]).precision.fp8_recipe == "delayed"


def test_fp8_computes_around_fp32_only_where_it_is_emulated(monkeypatch):
    """torchao on a CPU emulates FP8 in the model's compute dtype, fp32 included (the demo on
    CPUs without bf16 units); a GPU or TE runs FP8 layers inside a bf16 model."""
    config = parse_args(["--fp8=1", "--bf16=0"])
    assert config.precision.fp8 and not config.precision.bf16
    with pytest.raises(UsageError, match="--fp8=1 needs --bf16=1 on a GPU or with Transformer"):
        parse_args(["--fp8=1", "--bf16=0", "--model_impl", "te"])
    monkeypatch.setattr(machine, "has_cuda", lambda: True)
    with pytest.raises(UsageError, match="--fp8=1 needs --bf16=1 on a GPU"):
        parse_args(["--fp8=1", "--bf16=0"])


def test_torchao_fp8_on_a_gpu_needs_tokens_per_micro_batch_in_sixteens(monkeypatch):
    """torch._scaled_mm's weight-gradient GEMM sums over the micro-batch's tokens, which CUDA
    wants in multiples of 16; torchao's CPU emulation runs any count."""
    odd = ["--fp8=1", "--model_impl=hf", "--max_context_width=100", "--train_batch_size=1"]
    assert parse_args(odd).data.train_batch_size == 1  # emulated here
    monkeypatch.setattr(machine, "has_cuda", lambda: True)
    with pytest.raises(UsageError, match=r"x --max_context_width = 100\) to be a multiple of 16"):
        parse_args(odd)
    assert parse_args([*odd, "--train_batch_size=4"]).data.train_batch_size == 4  # 400 tokens
    assert parse_args([*odd, "--fp8=0"]).data.train_batch_size == 1


def test_the_config_is_resolved_once_and_frozen():
    args = parse_args(["--fp8=1"])
    assert args.precision.model_impl == "hf"  # auto, resolved (no TE or FP8 GPU here)
    with pytest.raises(AttributeError, match="cannot assign"):
        args.optim.lr = 0.5
    with pytest.raises(AttributeError, match="cannot assign"):
        args.optim = args.optim
    changed = args.replace(lr=0.5)  # by the flag's name
    assert (changed.optim.lr, args.optim.lr) == (0.5, 1e-3)
    assert changed.as_dict() == {**args.as_dict(), "lr": 0.5}
    with pytest.raises(AttributeError, match="no such config field"):
        args.replace(learning_rate=0.5)
    record = args.as_dict()  # what checkpoint.json and metrics.jsonl keep: flat flag names
    record["lr"] = 9.0
    record["rope_scaling"] = {"factor": 2.0}
    assert args.optim.lr == 1e-3 and args.model.rope_scaling is None
    assert Config.from_flat(args.as_dict()) == args  # a record reads back as the same config


def test_auto_impl_is_hf_without_transformer_engine(monkeypatch):
    monkeypatch.setattr(machine, "te_available", lambda: False)
    monkeypatch.setattr(machine, "fp8_capable_gpu", lambda: True)  # even on an H100
    assert machine.resolve_model_impl("auto") == "hf"
    # a rule of hf the user never chose says why auto took it (they asked for TE's recipe)
    with pytest.raises(UsageError) as refused:
        parse_args(["--fp8=1", "--fp8_recipe", "delayed"])
    assert str(refused.value).endswith(
        "(--model_impl auto chose hf: Transformer Engine does not import (--model_impl te says "
        "why))"
    )
    monkeypatch.setattr(machine, "fp8_capable_gpu", lambda: False)
    with pytest.raises(UsageError) as refused:
        parse_args(["--fp8=1", "--fp8_recipe", "delayed"])
    assert "(--model_impl auto chose hf: no FP8-capable GPU (Hopper or Ada) is visible)" in str(
        refused.value
    )
    with pytest.raises(UsageError) as refused:  # the user's own choice: nothing to explain
        parse_args(["--fp8=1", "--fp8_recipe", "delayed", "--model_impl", "hf"])
    assert "auto chose" not in str(refused.value)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num_heads", "3"], "not divisible"),
        (["--vocab_size", "1000"], "vocab"),
        (["--dataset", "no/such/dir/file.txt"], "no/such/dir"),
        (["--resume_from_checkpoint", "missing_ckpt"], "missing_ckpt"),
    ],
)
def test_bad_input_exits_2_with_one_line_before_touching_files(
    tmp_path, monkeypatch, refused_by_train, argv, message
):
    """train.main in this process (the exit through the interpreter: test_failures'
    test_lr_inf_exits_2_with_one_line_and_touches_nothing)."""
    monkeypatch.chdir(tmp_path)  # relative paths resolve in an empty folder
    out = tmp_path / "run"
    _, lines, stderr = refused_by_train(*argv, f"--output_dir={out}")
    assert len(lines) == 1 and message in lines[0], stderr
    assert "Traceback" not in stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing written


def test_a_refusal_is_one_line_and_its_exit_code(capsys):
    from model_utils.checkpoint import CheckpointWriteError
    from model_utils.errors import exit_refused
    from model_utils.run.profiling import StepOutOfMemory

    with pytest.raises(SystemExit) as exc:
        exit_refused(UsageError("--x is wrong; use --y"))
    assert exc.value.code == 2
    assert capsys.readouterr().err == "train.py: error: --x is wrong; use --y\n"
    with pytest.raises(SystemExit) as exc:  # the run failed, not its input; rank 0 says it
        exit_refused(CheckpointWriteError("no space left"), is_main=False)
    assert exc.value.code == 1 and capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as exc:  # out of memory: every rank that ran out says it
        exit_refused(StepOutOfMemory("step 3 ran out"), is_main=False)
    assert exc.value.code == 1 and capsys.readouterr().err == "train.py: error: step 3 ran out\n"


def test_bool_flags_accept_upstream_style():
    assert parse_args(["--fp8=1"]).precision.fp8 is True
    assert parse_args(["--fp8=0"]).precision.fp8 is False
    assert parse_args(["--activation_checkpointing"]).parallel.activation_checkpointing is True


@pytest.mark.parametrize(
    "bad, message",
    [
        ("--fp8_weights", "--fp8_weights needs --fp8=1"),
        ("--compile=2", "argument --compile: expected 0/1 or true/false, got '2'"),
    ],
)
def test_more_bad_inputs(bad, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        parse_args([bad])


def test_help_states_each_default_once() -> None:
    """--help printed "(default: from --preset) (default: None)" and "(default: False)" for
    switches that take 0|1."""
    text = " ".join(arguments.build_parser().format_help().split())
    assert "(default: None)" not in text
    assert "(default: False)" not in text and "(default: True)" not in text
    assert "--fp8 [0|1] train the linear layers in FP8 (default: 0)" in text
    assert "--chunked_loss [0|1]" in text and "0 = HF's (default: 1)" in text
    assert "model shape (default: from --preset) --num_layers" in text
    assert "steps between log lines (default: 1)" in text
