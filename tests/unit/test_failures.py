"""Never lose a run (issue 11), the checks that run in this process: refused numbers and
warm-ups, float8 weights checked for NaN, the run lock taken after the check, resume rules and
damaged checkpoints, explicit flags, paths, free space and bad data, each with its one line.

Refusals of train.py itself are checked by calling ``train.main`` here (``refused_by_train``:
exit 2 and the line); tests/integration/test_failures_processes.py runs train.py as users do.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.checkpoints import save_plain_checkpoints
from helpers.runs import FAST

from model_utils import checkpoint as ck
from model_utils.checkpoint.manifest import (
    DAMAGED_PREFIX,
    DCP_METADATA,
    MARKER,
    checkpoint_name,
    checkpoint_to_resume,
    content_damage,
)
from model_utils.checkpoint.resume import config_changes, describe_changes
from model_utils.config.arguments import UsageError, parse_args
from model_utils.config.presets import BUNDLED_DATASET, BUNDLED_TOKENIZER
from model_utils.run import guards, outputs, run_lock

ROOT = Path(__file__).resolve().parents[2]


def test_float8_weights_are_checked_too() -> None:
    """torchao's float8 all-gather left float8 tensors among the weights on an H100; torch has no
    isfinite for them, and the final save's weight check crashed a finished run."""
    guard = guards.StepGuard(torch.device("cpu"))
    guard.observe_weights(4, [torch.ones(2, dtype=torch.float8_e4m3fn)])
    assert guard.agree(False) == (False, None)
    nan = torch.tensor([1.0, float("nan")]).to(torch.float8_e4m3fn)
    guard.observe_weights(5, [torch.ones(2), nan])
    assert guard.agree(False) == (False, 5)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
        (["--rope_theta", "0"], "--rope_theta must be > 0, got 0.0"),
        (["--rope_theta", "nan"], "--rope_theta must be a finite number > 0"),
        (["--dist_timeout", "0"], "--dist_timeout must be > 0, got 0"),
        (["--min_lr", "nan"], "--min_lr must be a finite number >= 0"),
        (["--grad_clip", "inf"], "--grad_clip must be a finite number >= 0"),
        (["--weight_decay=-inf"], "--weight_decay must be a finite number >= 0"),
        (["--amax_history_len", "0"], "--amax_history_len must be > 0"),
    ],
)
def test_non_finite_or_non_positive_numbers_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError) as exc:
        parse_args(argv)
    assert str(exc.value).startswith(message)


@pytest.mark.parametrize(
    ("max_steps", "warmup"), [(1, 0), (10, 1), (50, 5), (100, 10), (10**6, 10)]
)
def test_default_warmup_follows_max_steps(max_steps: int, warmup: int) -> None:
    """`--preset tiny --max_steps 10`, a newcomer's first try, must not be refused by a default."""
    assert parse_args(["--preset", "tiny", "--max_steps", str(max_steps)]).optim.warmup == warmup


def test_an_explicit_warmup_is_still_checked() -> None:
    with pytest.raises(UsageError, match="--warmup 10 leaves no decay phase"):
        parse_args(["--preset", "tiny", "--max_steps", "10", "--warmup", "10"])
    assert parse_args(["--max_steps", "10", "--warmup", "3"]).optim.warmup == 3


def test_a_run_that_took_the_directory_after_the_check_still_stops_this_one(
    tmp_path: Path,
) -> None:
    """validate() only looks; rank 0 takes the lock after the process group starts, so a run
    that started in between is still refused there (world of one, in this process)."""
    from model_utils.parallel import distributed

    args = parse_args([*FAST, "--output_dir", str(tmp_path / "run")])
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        world = distributed.world_from_env({})
        locks = run_lock.hold_run_dirs(args, world)
        assert run_lock.lock_holder(tmp_path / "run").startswith(f"pid {os.getpid()} ")
        with pytest.raises(run_lock.RunLocked, match="in use by another run"):
            run_lock.hold_run_dirs(args, world)
        for lock in locks:
            lock.release()
        assert run_lock.lock_holder(tmp_path / "run") is None
    finally:
        if created:
            dist.destroy_process_group()


# ============================================================================================
# 2. A checkpoint is loaded only into the run it belongs to, and only if it is intact


def test_model_data_and_precision_changes_are_refused_the_rest_allowed() -> None:
    saved = parse_args([*FAST, "--max_steps", "20"]).as_dict()
    now = dict(
        saved,
        num_layers=2,
        tokenizer="other/tok",
        train_batch_size=2,
        fp8=True,
        output_dir="elsewhere",
        resume_from_checkpoint="auto",
    )
    refused, allowed = config_changes(json_round_trip(saved), now)
    assert refused == [
        ("--fp8", False, True),
        ("--num_layers", 4, 2),
        ("--tokenizer", saved["tokenizer"], "other/tok"),
    ]
    assert allowed == [("--train_batch_size", 4, 2)]
    # --data_seed unset is --seed: given as the same value it orders the data alike (it was
    # refused as "None -> 42"); another is another data order, named by the values in effect
    assert config_changes(saved, dict(saved, data_seed=saved["seed"])) == ([], [])
    assert config_changes(saved, dict(saved, data_seed=7))[0] == [("--data_seed", 42, 7)]
    # A path that points at the same place is the same dataset; an older marker's missing
    # fields are not compared.
    relative = os.path.relpath(saved["dataset"])
    older = {k: v for k, v in json_round_trip(saved).items() if k != "rope_theta"}
    assert config_changes(older, dict(saved, dataset=relative, rope_theta=1.0)) == ([], [])


def test_tied_and_untied_embeddings_are_different_models() -> None:
    """Either way, and from a checkpoint older than the field (it was untied then), in this run
    or another's: one matrix where the checkpoint has two (or two where it has one) is refused."""
    untied = json_round_trip(parse_args(FAST).as_dict())
    tied = dict(untied, tie_word_embeddings=True)
    older = {k: v for k, v in untied.items() if k != "tie_word_embeddings"}
    for saved, now in ((untied, tied), (tied, untied), (older, tied)):
        for same_run in (True, False):
            refused, _ = config_changes(saved, now, same_run)
            want = (
                "--tie_word_embeddings",
                not now["tie_word_embeddings"],
                now["tie_word_embeddings"],
            )
            assert refused == [want]
    assert config_changes(older, untied) == ([], [])


def test_what_the_fp8_bf16_comparison_compares_is_part_of_the_run() -> None:
    """--fp8, the implementation, the recipe and the FP8 knobs that change numerics are refused
    on resume (the resumed run would be recorded under the other precision); the FP8 knobs count
    only while FP8 is on (a BF16 run's resolved --fp8_recipe trains nothing); --fp8_all_gather
    and --fp8_weights (what is moved or kept, not the GEMMs' numerics) may change."""
    fp8 = json_round_trip(parse_args([*FAST, "--bf16=1", "--fp8=1"]).as_dict())
    assert config_changes(fp8, dict(fp8, fp8=False, fp8_recipe=None))[0] == [("--fp8", True, False)]
    for change in (
        {"fp8_recipe": "rowwise"},
        {"model_impl": "te"},
        {"bf16": False},
        {"amax_history_len": 16},
        {"fp8_format": "e4m3"},
    ):
        refused, _ = config_changes(fp8, dict(fp8, **change))
        assert {flag for flag, _, _ in refused} == {f"--{name}" for name in change}, change
    assert config_changes(fp8, dict(fp8, fp8_all_gather=True)) == (
        [],
        [("--fp8_all_gather", False, True)],
    )
    refused, _ = config_changes(fp8, dict(fp8, bf16_layers="0"))
    assert describe_changes(refused) == "--bf16_layers (none) -> 0"  # was "--bf16_layers  -> 0"
    bf16 = json_round_trip(parse_args([*FAST, "--bf16=1"]).as_dict())
    assert config_changes(bf16, dict(bf16, amax_history_len=16))[0] == []
    assert config_changes(bf16, dict(bf16, fp8_recipe="rowwise"))[0] == []
    # Another run's checkpoint loaded into a new folder starts a new run from its weights: the
    # implementation or precision may change there (hf -> te conversion, BF16 -> FP8).
    refused, allowed = config_changes(fp8, dict(fp8, model_impl="te"), same_run=False)
    assert refused == [] and allowed == [("--model_impl", "hf", "te")]


def test_a_recipe_is_another_experiment_the_schedule_s_shape_is_the_saved_one() -> None:
    """The README's tiny run resumed as docs/recipes.md's tiny-fp8 twin (the recipe, its
    warm-up and validation) is refused within the run; another warm-up or decay style, and
    AdamW's betas and decay, are refused in any folder: the loaded schedule and optimizer put
    the saved ones back, so a new value would be recorded but never used. Extending --max_steps
    is not refused, even where the default warm-up follows it (10 -> 20 steps: warm-up 1 -> 2,
    the saved schedule's kept), except under a BF16 cool-down, whose first BF16 step it sets."""
    readme = json_round_trip(parse_args(["--preset", "tiny"]).as_dict())
    recipe = parse_args(["--recipe", "tiny-fp8"]).as_dict()
    refused, _ = config_changes(readme, recipe)
    assert {"--recipe", "--fp8"} <= {flag for flag, _, _ in refused}, refused
    assert config_changes(readme, recipe, same_run=False)[0] == []
    for change in (
        {"warmup": readme["warmup"] + 1},
        {"lr_decay_style": "linear"},
        {"beta1": 0.0, "beta2": 0.5, "weight_decay": 0.9},
    ):
        for same_run in (True, False):
            refused, _ = config_changes(readme, dict(readme, **change), same_run)
            assert {flag for flag, _, _ in refused} == {f"--{name}" for name in change}, change
    short = json_round_trip(parse_args([*FAST, "--max_steps", "10"]).as_dict())
    longer = parse_args([*FAST, "--max_steps", "20"]).as_dict()
    assert (short["warmup"], longer["warmup"]) == (1, 2)
    # the default warm-up that follows the longer --max_steps is no change of its own (the
    # resumed schedule keeps its saved warm-up): "--warmup 1 -> 2" was logged for it
    assert config_changes(short, longer) == ([], [("--max_steps", 10, 20)])
    typed = parse_args([*FAST, "--max_steps", "20", "--warmup", "5"]).as_dict()
    assert config_changes(short, typed)[0] == [("--warmup", 1, 5)]
    cool = ["--fp8=1", "--bf16_cooldown", "0.5", "--warmup", "1"]
    cooled = json_round_trip(parse_args([*FAST, *cool, "--max_steps", "10"]).as_dict())
    refused, _ = config_changes(cooled, parse_args([*FAST, *cool, "--max_steps", "20"]).as_dict())
    assert refused == [("--max_steps (it places --bf16_cooldown's first BF16 step)", 10, 20)]
    # a cool-down turned on is the refusal; the longer schedule was listed beside it as if it
    # moved a cool-down the saved run never had
    plain = json_round_trip(parse_args([*FAST, "--fp8=1", "--max_steps", "10"]).as_dict())
    refused, allowed = config_changes(
        plain, parse_args([*FAST, *cool, "--max_steps", "20"]).as_dict()
    )
    assert [flag for flag, _, _ in refused] == ["--bf16_cooldown"]
    assert ("--max_steps", 10, 20) in allowed


def test_a_tokenizer_changed_in_place_is_refused_by_its_contents(tmp_path) -> None:
    """Same path, other contents (retrained in place, or a hub tokenizer updated upstream):
    the fingerprint differs and the resume is refused; a checkpoint or a config that never
    measured it is not compared on it."""
    from tokenizers import AddedToken

    from model_utils import data

    tokenizer = data.load_tokenizer(str(ROOT / "data" / "tokenizer"))
    before = data.tokenizer_fingerprint(tokenizer)
    assert (
        data.tokenizer_fingerprint(data.load_tokenizer(str(ROOT / "data" / "tokenizer"))) == before
    )
    tokenizer.backend_tokenizer.add_tokens([AddedToken("<extra>")])
    after = data.tokenizer_fingerprint(tokenizer)
    assert after != before
    saved = dict(parse_args(FAST).as_dict(), tokenizer_sha256=before)
    refused, _ = config_changes(json_round_trip(saved), dict(saved, tokenizer_sha256=after))
    assert refused == [("the tokenizer's contents (sha256)", before, after)]
    assert config_changes(json_round_trip(saved), dict(saved, tokenizer_sha256=None)) == ([], [])


def test_the_same_data_and_tokenizer_moved_elsewhere_still_resume(tmp_path) -> None:
    """A checkout moved (or data mounted elsewhere) was refused as 'another run': the saved
    paths no longer exist, though the tokenizer's contents and the data's name are the same.
    Now that is a logged change; another tokenizer or data name is still refused."""
    old_home = tmp_path / "old"  # where the run was: gone now
    moved = tmp_path / "new" / "corpus.jsonl"
    moved.parent.mkdir()
    moved.write_text('{"text": "x"}\n')
    saved = dict(
        parse_args(FAST).as_dict(),
        dataset=str(old_home / "corpus.jsonl"),
        tokenizer=str(old_home / "tokenizer"),
        tokenizer_sha256="ab" * 8,
    )
    now = dict(saved, dataset=str(moved), tokenizer=str(tmp_path / "new" / "tokenizer"))
    refused, allowed = config_changes(json_round_trip(saved), now)
    assert refused == []
    assert allowed == [
        ("--dataset", saved["dataset"], now["dataset"]),
        ("--tokenizer", saved["tokenizer"], now["tokenizer"]),
    ]
    other = dict(now, dataset=str(tmp_path / "new"), tokenizer_sha256="cd" * 8)
    refused, _ = config_changes(json_round_trip(saved), other)
    assert [flag for flag, _, _ in refused] == [
        "--dataset",
        "--tokenizer",
        "the tokenizer's contents (sha256)",
    ]


def json_round_trip(config: dict) -> dict:
    import json

    return json.loads(json.dumps(config, default=str))


def test_explicit_lr_on_resume_replaces_the_saved_one_a_default_does_not() -> None:
    from model_utils import optim

    def schedule(lr: float, min_lr: float):
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        return optim.build_scheduler(
            opt, lr=lr, min_lr=min_lr, warmup=2, max_steps=10, style="cosine"
        )

    saved = schedule(1e-3, 1e-4)
    for _ in range(4):
        saved.optimizer.step()
        saved.step()
    state = saved.state_dict()
    expected = {"lr": 1e-3, "min_lr": 1e-4, "warmup": 2, "max_steps": 10, "style": "cosine"}
    for given, peak, final in [
        ({}, 1e-3, 1e-4),
        ({"lr": 5e-4}, 5e-4, 1e-4),
        ({"lr": 5e-4, "min_lr": 0.0}, 5e-4, 0.0),
    ]:
        resumed = schedule(2e-3, 2e-4)  # this run's flags, e.g. defaults
        resumed.load_state_dict(state)
        assert optim.resume_schedule(resumed, given) == {"lr": peak, "min_lr": final}
        want = optim.lr_at(5, **dict(expected, lr=peak, min_lr=final))
        assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12)
        assert resumed.get_last_lr() == [resumed.optimizer.param_groups[0]["lr"]]
        resumed.optimizer.step()
        resumed.step()  # the schedule goes on with the new peak
        want = optim.lr_at(6, **dict(expected, lr=peak, min_lr=final))
        assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="min_lr"):
        resumed = schedule(1e-3, 1e-4)
        resumed.load_state_dict(state)
        optim.resume_schedule(resumed, {"min_lr": 5e-3})  # above the saved peak
    assert optim.spent_lr(resumed, {"lr": 5e-4}) == ""  # step 4 of 10: it applies
    for _ in range(6):
        saved.optimizer.step()
        saved.step()
    assert optim.spent_lr(saved, {"min_lr": 0.0}) == ""
    assert optim.spent_lr(saved, {"lr": 5e-4}) == (  # step 10 of 10: the lr is --min_lr's
        "--lr 0.0005 changes nothing: the saved schedule reached --min_lr 0.0001 at step 10 (its "
        "first --max_steps) and stays there; give --min_lr to train on at another lr"
    )


def test_explicit_flags_are_those_on_the_command_line() -> None:
    from model_utils.config.arguments import explicit_flags

    assert explicit_flags(["--preset", "tiny", "--lr=3e-4", "--fp8"]) == {"preset", "lr", "fp8"}
    assert explicit_flags([]) == frozenset()


def _zero_a_megabyte(path: Path) -> None:
    shard = next(path.glob("__0_*.distcp"))
    with open(shard, "r+b") as fh:
        fh.seek(1000)
        fh.write(b"\0" * min(2**20, shard.stat().st_size - 1000))


DAMAGE = {
    "zeros inside a shard": (_zero_a_megabyte, "__0_0.distcp does not match its sha256"),
    "truncated shard": (
        lambda p: os.truncate(p / "__0_0.distcp", 100),
        "__0_0.distcp has 100 bytes",
    ),
    "deleted shard": (lambda p: (p / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
    "garbage .metadata": (
        lambda p: (p / DCP_METADATA).write_bytes(b"garbage" * 10),
        ".metadata cannot be read",
    ),
    "bad checkpoint.json": (
        lambda p: (p / MARKER).write_text("{not json"),
        "checkpoint.json is not a valid",
    ),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_damaged_checkpoint_is_named_and_auto_resume_falls_back(tmp_path: Path, kind: str):
    damage, message = DAMAGE[kind]
    ckpt = save_plain_checkpoints(tmp_path, [1, 2, 3])
    assert sorted(ck.read_marker(tmp_path / checkpoint_name(3))["files"]) == [
        DCP_METADATA,
        "__0_0.distcp",
    ]
    newest = tmp_path / checkpoint_name(3)
    damage(newest)
    with pytest.raises(ck.ResumeRefused) as refused:  # an explicit path: one line, the file
        checkpoint_to_resume(str(newest), ckpt.checkpoint_dir)
    assert str(newest) in str(refused.value) and message in str(refused.value)
    assert "\n" not in str(refused.value)
    # auto: the newest intact one, the damaged one set aside (out of resume and pruning)
    assert checkpoint_to_resume("auto", ckpt.checkpoint_dir) == tmp_path / checkpoint_name(2)
    assert (tmp_path / f"{DAMAGED_PREFIX}{checkpoint_name(3)}").is_dir()
    state = ck.TrainState(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)))
    assert ckpt.load(checkpoint_to_resume("auto", ckpt.checkpoint_dir), state).step == 2


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_shard_gone_before_its_checksum_is_a_verdict_not_an_exception(tmp_path: Path) -> None:
    """Each rank sums its share of the files and the verdicts are gathered: a rank that raised
    instead would leave the others waiting in the gather (they would die of a lost peer)."""
    save_plain_checkpoints(tmp_path, [1])
    path = tmp_path / checkpoint_name(1)
    files = ck.read_marker(path)["files"]
    assert content_damage(path, files) is None
    (path / "__0_0.distcp").unlink()  # after the cheap checks passed, before the checksum
    problem = content_damage(path, files)
    assert problem.startswith(f"{path / '__0_0.distcp'} cannot be read (") and "\n" not in problem


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_every_checkpoint_damaged_is_refused_not_a_silent_fresh_start(tmp_path: Path) -> None:
    ckpt = save_plain_checkpoints(tmp_path, [1, 2])
    for step in (1, 2):
        _zero_a_megabyte(tmp_path / checkpoint_name(step))
    for _ in range(2):  # none set aside: the same command (a requeue) is refused again
        with pytest.raises(ck.ResumeRefused, match="every checkpoint in .* is damaged"):
            checkpoint_to_resume("auto", ckpt.checkpoint_dir)
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [
            checkpoint_name(1),
            checkpoint_name(2),
        ]
    ckpt = save_plain_checkpoints(tmp_path / "cheap", [1])
    (tmp_path / "cheap" / checkpoint_name(1) / MARKER).write_text("[]")
    with pytest.raises(ck.ResumeRefused, match="every checkpoint"):  # before a process group
        checkpoint_to_resume("auto", tmp_path / "cheap", verify=False)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_an_auto_resume_pointed_at_an_empty_checkpoint_dir_is_no_fresh_start(
    tmp_path: Path, refused_by_train
) -> None:
    """--checkpoint_dir added to the resume of a run that saved in its own folder found nothing
    there, and trained afresh beside the run's checkpoints (its records set aside)."""
    run = tmp_path / "run"
    save_plain_checkpoints(run / "checkpoints", [2])
    elsewhere = tmp_path / "fast-disk"
    argv = ["--output_dir", str(run), "--resume_from_checkpoint", "auto"]
    _, lines, _ = refused_by_train(*argv, "--checkpoint_dir", str(elsewhere))
    assert lines == [
        f"train.py: error: --resume_from_checkpoint auto: --checkpoint_dir {elsewhere} holds no "
        f"checkpoint, but {run / 'checkpoints'} holds this run folder's: give --checkpoint_dir "
        f"{run / 'checkpoints'} to resume from them (or move them), or another --output_dir to "
        "start anew"
    ]
    assert not elsewhere.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_damaged_checkpoint_takes_no_keep_last_slot_from_an_intact_one(tmp_path: Path):
    ckpt = save_plain_checkpoints(tmp_path, [1, 2, 3], keep_last=2)
    _zero_a_megabyte(tmp_path / checkpoint_name(3))
    assert checkpoint_to_resume("auto", ckpt.checkpoint_dir) == tmp_path / checkpoint_name(2)
    save_plain_checkpoints(tmp_path, [4], keep_last=2)  # the resumed run saves on
    names = [p.name for p in ck.complete_checkpoints(tmp_path)]
    assert names == [checkpoint_name(2), checkpoint_name(4)]  # both intact ones kept
    assert all(ck.inspect_checkpoint(tmp_path / name, checksums=True) is None for name in names)


# ============================================================================================
# 4. Write problems found before training, in words


def test_tilde_is_expanded_in_every_path_flag(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    args = parse_args(["--output_dir", "~/run", "--export_hf=~/hf"])
    assert args.run.output_dir == str(tmp_path / "run")
    assert args.checkpoint.checkpoint_dir == str(tmp_path / "run" / "checkpoints")
    assert args.checkpoint.export_hf == str(tmp_path / "hf")


def test_a_file_in_the_way_is_refused_before_anything_is_created(
    tmp_path: Path, refused_by_train
) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    for flag in ("--checkpoint_dir", "--export_hf", "--output_dir"):
        problem = outputs.location_problem(flag, blocker)
        assert problem == f"{flag} {blocker} is a file, not a directory: choose another {flag}"
        below = outputs.location_problem(flag, blocker / "sub")
        assert below and f"{blocker} is a file" in below
    assert outputs.location_problem("--output_dir", tmp_path / "new" / "deep") is None
    assert not (tmp_path / "new").exists()
    assert outputs.probe_write("--output_dir", tmp_path / "new" / "deep") is None
    assert not (tmp_path / "new").exists()  # the probe leaves nothing behind
    _, lines, _ = refused_by_train("--export_hf", str(blocker), f"--output_dir={tmp_path / 'run'}")
    assert lines == [
        f"train.py: error: --export_hf {blocker} is a file, not a directory: choose another "
        "--export_hf"
    ]
    assert not (tmp_path / "run").exists()


def test_a_link_to_nowhere_is_named_not_called_an_existing_file(tmp_path: Path) -> None:
    """A dangling symlink (a scratch mount not up yet) is neither a folder nor creatable: mkdir
    says only "File exists"; the line names the link and where it points."""
    (tmp_path / "scratch").symlink_to(tmp_path / "gone")
    for path in (tmp_path / "scratch", tmp_path / "scratch" / "run"):
        assert outputs.location_problem("--export_hf", path) == (
            f"--export_hf {path} cannot be created: {tmp_path / 'scratch'} is a link to "
            f"{tmp_path / 'gone'}, which does not exist; create it or choose another --export_hf"
        )
    (tmp_path / "gone").mkdir()
    assert outputs.location_problem("--export_hf", tmp_path / "scratch" / "run") is None
    (tmp_path / "loop").symlink_to("loop")
    assert outputs.location_problem("--output_dir", tmp_path / "loop" / "run") == (
        f"--output_dir {tmp_path / 'loop' / 'run'} cannot be created: {tmp_path / 'loop'} is a "
        "link that loops (to loop): choose another --output_dir"
    )


def test_an_export_inside_the_run_s_checkpoints_is_refused(tmp_path: Path, refused_by_train):
    """--keep_last deletes an old checkpoint with whatever it holds: an export into the run's
    checkpoint folder, or into a step of it, would go with it."""
    run = tmp_path / "run"
    for export in (run / "checkpoints", run / "checkpoints" / checkpoint_name(2)):
        _, lines, _ = refused_by_train("--export_hf", str(export), f"--output_dir={run}")
        assert lines == [
            f"train.py: error: --export_hf {export} is inside {run / 'checkpoints'}, where a "
            "run's checkpoints are pruned and replaced: give a folder outside it"
        ]
    assert not run.exists()


def test_free_space_verdicts() -> None:
    gib, where = 2**30, Path("/x")
    assert outputs.space_verdict(10 * gib, 1 * gib, 3, "checkpoint", where)[0] == "ok"
    verdict, line = outputs.space_verdict(2 * gib, 1 * gib, 3, "checkpoint", where)
    assert verdict == "warn" and "less than the 3 checkpoints" in line
    verdict, line = outputs.space_verdict(gib // 2, 1 * gib, 3, "checkpoint", where)
    assert verdict == "refuse" and line.startswith("/x has 0.50 GiB free, less than one checkpoint")
    # 82 MiB measured for the tiny model's 7.1M parameters with AdamW: 12 bytes per parameter
    assert outputs.checkpoint_bytes(7_100_000) == 85_200_000
    assert outputs.checkpoint_bytes(10, "adamw8bit") == 60


# ============================================================================================
# 5. Data errors as one line, before training, naming the file


def _write_parquet(path: Path, columns: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)


BAD_DATA = {
    "empty file": ("a.jsonl", b"", "a.jsonl is empty"),
    "no text column": ("a.jsonl", b'{"body": "x"}\n', "a.jsonl line 1 has no column 'text'"),
    "not UTF-8": ("a.txt", b"fine\n\nfine\n\nbad \xff here\n", "a.txt line 5 is not UTF-8"),
    "binary": ("a.jsonl", bytes(range(128, 256)) * 4, "a.jsonl line 1 is not UTF-8"),
    "bad JSON line": ("a.jsonl", b'{"text": "x"}\n{"text": \n', "a.jsonl line 2 is not JSON"),
    "not an object": ("a.jsonl", b'{"text": "x"}\n[1, 2]\n', "a.jsonl line 2 is not a JSON"),
    "corrupt gzip": ("a.jsonl.gz", b"\x1f\x8b\x08\x00garbage", "a.jsonl.gz cannot be read"),
    "corrupt parquet": ("a.parquet", b"PAR1 not really", "a.parquet is not a readable parquet"),
    "only blank lines": ("a.txt", b"\n\n  \n", "a.txt holds no text"),
    "a number as text": (
        "a.jsonl",
        b'{"text": "x"}\n{"text": 12345}\n',
        "a.jsonl line 2: column 'text' holds a number ('12345'), not text",
    ),
    "a list as text": ("a.jsonl", b'{"text": ["x", "y"]}\n', "line 1: column 'text' holds a list"),
    "text column all null": (
        "a.jsonl",
        b'{"text": null, "body": "x"}\n{"text": ""}\n',
        "a.jsonl has no text in column 'text' (every record's is null or empty): pass the",
    ),
}


@pytest.mark.parametrize("kind", sorted(BAD_DATA))
def test_bad_local_data_is_one_line_naming_the_file(tmp_path: Path, kind: str) -> None:
    from model_utils import data

    name, content, message = BAD_DATA[kind]
    (tmp_path / name).write_bytes(content)
    with pytest.raises(data.DataError) as exc:
        data.check_local_data(str(tmp_path / name), "text")
    assert str(tmp_path / name) in str(exc.value) and message in str(exc.value)
    assert "\n" not in str(exc.value)


def test_parquet_column_and_a_json_document_file(tmp_path: Path) -> None:
    from model_utils import data
    from model_utils.data.sources import document_texts, open_source

    _write_parquet(tmp_path / "p.parquet", {"body": ["a", "b"]})
    with pytest.raises(data.DataError, match=r"p.parquet has no column 'text' \(columns: body\)"):
        data.check_local_data(str(tmp_path / "p.parquet"), "text")
    _write_parquet(tmp_path / "n.parquet", {"text": [1, 2]})
    with pytest.raises(data.DataError, match=r"n.parquet column 'text' is of type int64, not text"):
        data.check_local_data(str(tmp_path / "n.parquet"), "text")
    (tmp_path / "doc.json").write_text('[\n {"text": "one"},\n {"text": "two"}\n]\n')
    data.check_local_data(str(tmp_path / "doc.json"), "text")  # a JSON array: datasets reads it
    (tmp_path / "config.json").write_text('{\n "vocab": {"a": 1},\n "text": "x"\n}\n')
    with pytest.raises(data.DataError, match="config.json is one JSON document, not records: "):
        data.check_local_data(str(tmp_path / "config.json"), "text")  # pyarrow's traceback
    (tmp_path / "words.json").write_text('[\n "one",\n "two"\n]\n')
    with pytest.raises(data.DataError, match="words.json is one JSON document, not records: "):
        data.check_local_data(str(tmp_path / "words.json"), "text")
    (tmp_path / "nums.json").write_text('[{"text": 1.5}, {"text": 2.5}]')
    # Not scanned by lines: found when read.
    source = open_source(str(tmp_path / "nums.json"), None, "text")
    with pytest.raises(data.DataError, match="nums.json: column 'text' holds a number \\('1.5'\\)"):
        list(document_texts(iter(source.train), "text", source))
    data.check_local_data(BUNDLED_DATASET, "text")  # the bundled corpus passes


def _jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_json_columns_that_change_between_files_do_not_stop_the_run(tmp_path: Path) -> None:
    """The datasets library casts every JSON record to the columns and types of the start of
    the first file: a field that appears later, a column null at first, or an int column that
    later holds 2.5 stopped a run hours in, though training reads only the text."""
    from datasets import load_dataset

    from model_utils import data
    from model_utils.data.reads import read_error_message
    from model_utils.data.sources import document_texts, open_source

    folder = tmp_path / "shards"
    folder.mkdir()
    _jsonl(folder / "a.jsonl", [{"text": "one", "id": 1, "title": None}, {"text": "two", "id": 2}])
    later = [
        {"text": "three", "id": 2.5},
        {"text": "four", "title": "Genesis", "meta": {"lang": "en"}},
        {"id": 5},  # no text at all: an empty document
    ]
    _jsonl(folder / "b.jsonl", later)
    _jsonl(folder / "validation.jsonl", [{"text": "five", "meta": [1]}])
    files = {"train": [str(folder / "a.jsonl"), str(folder / "b.jsonl")]}
    library = load_dataset("json", data_files=files, streaming=True)["train"]
    with pytest.raises(ValueError):  # what a run met when it reached b.jsonl
        list(library)
    data.check_local_data(str(folder), "text")
    source = open_source(str(folder), None, "text")
    assert list(document_texts(iter(source.train), "text", source)) == [
        "one",
        "two",
        "three",
        "four",
    ]
    assert list(document_texts(iter(source.validation), "text", source)) == ["five"]
    # Hub data still goes through the library: its CastError line now says which columns.
    files = {"train": [str(folder / "a.jsonl"), str(folder / "validation.jsonl")]}
    with pytest.raises(ValueError) as cast:
        list(load_dataset("json", data_files=files, streaming=True)["train"])
    assert read_error_message(cast.value, "org/hub-data", "text", 0, "mid-run") == (
        "--dataset org/hub-data: rank 0 could not read its data mid-run (CastError: Couldn't "
        "cast: there are 1 new columns ({'meta'}))"
    )


def test_parquet_columns_that_change_between_files_do_not_stop_the_run(tmp_path: Path) -> None:
    from datasets import load_dataset

    from model_utils import data
    from model_utils.data.sources import document_texts, open_source

    _write_parquet(tmp_path / "a.parquet", {"text": ["one", "two"], "id": [1, 2]})
    _write_parquet(tmp_path / "b.parquet", {"text": ["three"], "id": ["x"], "score": [0.5]})
    files = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    with pytest.raises(ValueError):  # the library alone: CastError at b.parquet
        list(load_dataset("parquet", data_files=files, streaming=True)["train"])
    data.check_local_data(str(tmp_path), "text")
    source = open_source(str(tmp_path), None, "text")
    assert list(document_texts(iter(source.train), "text", source)) == ["one", "two", "three"]


def test_the_json_reader_keeps_every_row_and_its_position(tmp_path: Path) -> None:
    """Only columns are dropped, never rows: a saved stream position (a count of records)
    means the same record as with the library's reader, so checkpoints resume unchanged."""
    from datasets import load_dataset
    from datasets.packaged_modules.json.json import Json

    from model_utils.data.sources import open_source

    assert "_cast_table" in vars(Json)  # the private method local_json.py overrides
    records = [{"text": f"doc {i}" if i % 3 else None, "n": i} for i in range(50)]
    _jsonl(tmp_path / "a.jsonl", records)
    ours = open_source(str(tmp_path / "a.jsonl"), None, "text").train
    theirs = load_dataset("json", data_files=str(tmp_path / "a.jsonl"), streaming=True)["train"]
    assert [r["text"] for r in ours] == [r["text"] for r in records] == [r["text"] for r in theirs]
    theirs = load_dataset("json", data_files=str(tmp_path / "a.jsonl"), streaming=True)["train"]
    position = iter(theirs)
    for _ in range(20):
        next(position)
    resumed = open_source(str(tmp_path / "a.jsonl"), None, "text").train
    resumed.load_state_dict(theirs.state_dict())  # a position the library's reader saved
    assert [r["text"] for r in resumed] == [r["text"] for r in records[20:]]


def test_a_name_that_is_no_local_path_fails_fast_offline_or_unknown(monkeypatch) -> None:
    from helpers.endpoints import silent_hub
    from huggingface_hub import constants

    from model_utils import data

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        data.DataError,
        match="corpus: no local file or folder of that name, and hub look-ups are off",
    ):
        data.check_hub_dataset("corpus")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with silent_hub() as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        with pytest.raises(data.DataError, match="4f1c: no local file or folder of that name"):
            data.check_hub_dataset("no-such-user-4f1c/no-such-dataset-4f1c", timeout=5)
        asked = hub.connections
        with pytest.raises(data.DataError, match="and it is no hub name .* or correct the name$"):
            data.check_hub_dataset("my corpus", timeout=5)  # not "check the network"
    assert 1 <= asked <= 2 and hub.connections == asked  # one look-up, not the library's retries


def test_tiny_data_warns_that_each_batch_repeats_it(tmp_path: Path, caplog) -> None:
    from helpers.runs import data_section

    from model_utils import data
    from model_utils.data.stream import TrainStream

    (tmp_path / "train.jsonl").write_text('{"text": "a short text"}\n' * 3)
    tokenizer = data.load_tokenizer(BUNDLED_TOKENIZER)
    source = data_section(str(tmp_path / "train.jsonl"), train_batch_size=2)
    stream = TrainStream(source, tokenizer, 64)
    with caplog.at_level("WARNING"):
        next(stream)
    [warning] = [r.getMessage() for r in caplog.records if "repeats it" in r.getMessage()]
    assert "less than one micro-batch (2 x 64 tokens)" in warning


def test_a_checkpoint_signal_after_the_run_is_ignored_not_fatal() -> None:
    """The launcher resends a pending USR1/TERM/INT until torchrun exits. While the run is
    alive a signal only sets the flag; after main() it must not kill the exiting worker (CPython
    resets a Python handler to the default action at shutdown, but keeps an ignore)."""
    import signal

    import train

    saved = {sig: signal.getsignal(sig) for sig in train.Preemption.SIGNALS}
    try:
        preemption = train.Preemption()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert preemption.requested
        preemption.requested = False
        preemption.stand_down()
        assert all(signal.getsignal(s) is signal.SIG_IGN for s in train.Preemption.SIGNALS)
        os.kill(os.getpid(), signal.SIGUSR1)  # would end this process under SIG_DFL
        assert not preemption.requested
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize(("suffix", "package"), [(".zst", "zstandard"), (".lz4", "lz4.frame")])
def test_a_compression_whose_package_is_missing_is_named(
    tmp_path: Path, monkeypatch, suffix: str, package: str
) -> None:
    """.zst and .lz4 data passed the start-up check and failed at the first read, after the
    process group and the run folder existed."""
    from model_utils import data

    monkeypatch.setitem(sys.modules, package, None)  # import raises ImportError
    file = tmp_path / f"a.jsonl{suffix}"
    file.write_bytes(b"\x28\xb5\x2f\xfd compressed")
    with pytest.raises(data.DataError) as exc:
        data.check_local_data(str(file), "text")
    name = package.split(".")[0]
    assert str(exc.value) == (
        f"--dataset: {file} is {suffix[1:]}-compressed, which needs the {name} package: pip "
        f"install {name} (in the image too), or decompress the file"
    )


def test_an_unwritable_hugging_face_cache_is_named_not_blamed_on_the_data(
    tmp_path: Path, monkeypatch
) -> None:
    """HF_HOME on a read-only or virtual file system failed the first read, reported as
    '--dataset ...: rank 0 could not read its data at start-up (PermissionError ...)'."""
    from model_utils import data
    from model_utils.data.reads import read_error_message
    from model_utils.run import outputs

    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    monkeypatch.setenv("HF_HOME", str(in_the_way))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    with pytest.raises(outputs.WriteProblem, match=f"HF_HOME {in_the_way} is a file"):
        outputs.check_locations(data.cache_location())
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    refused = PermissionError(1, "Operation not permitted", str(tmp_path / "cache" / "x" / "y"))
    line = read_error_message(refused, BUNDLED_DATASET, "text", 0, "at start-up")
    assert line == (
        f"HF_DATASETS_CACHE {tmp_path / 'cache'} cannot be written (Operation not permitted): "
        "choose another HF_DATASETS_CACHE"
    )
    elsewhere = PermissionError(13, "Permission denied", str(tmp_path / "data.jsonl"))
    line = read_error_message(elsewhere, BUNDLED_DATASET, "text", 0, "at start-up")
    assert line.startswith(f"--dataset {BUNDLED_DATASET}: rank 0 could not read its data")


def test_a_run_folder_inside_the_dataset_folder_is_refused_at_start(tmp_path) -> None:
    """It trained, then its resume read the run's own metrics.jsonl as data and was refused
    ("has no column 'text'"): a requeue could never continue it."""
    from model_utils.run import outputs

    data = tmp_path / "corpus"
    data.mkdir()
    run = data / "runs" / ".." / "run"
    with pytest.raises(outputs.WriteProblem) as refused:
        outputs.check_locations(
            {"--output_dir": tmp_path / "run", "--checkpoint_dir": run}, str(data)
        )
    assert str(refused.value) == (
        f"--checkpoint_dir {run} is inside --dataset {data}, read whole as text: choose "
        "another --checkpoint_dir"
    )
    outputs.check_locations({"--output_dir": tmp_path / "run"}, str(data / "one.jsonl"))


def test_a_folder_asking_to_run_its_own_code_is_refused_without_a_question(
    tmp_path, monkeypatch
) -> None:
    """A tokenizer or an --init_from_hf config.json whose auto_map names code of its own is
    refused in one line, and transformers never asks "run the custom code? [y/N]" (at a
    terminal it waited 15 s for an answer); the folder's code never runs."""
    import builtins
    import shutil

    import transformers.dynamic_module_utils as remote

    asked = []
    monkeypatch.setattr(builtins, "input", lambda *a, **k: asked.append(a) or "n")
    monkeypatch.setattr(remote, "TIME_OUT_REMOTE_CODE", 15)
    tok = tmp_path / "tok"
    shutil.copytree(BUNDLED_TOKENIZER, tok)
    settings = json.loads((tok / "tokenizer_config.json").read_text())
    settings |= {"tokenizer_class": "OwnTok", "auto_map": {"AutoTokenizer": ["own.OwnTok", None]}}
    (tok / "tokenizer_config.json").write_text(json.dumps(settings))
    (tok / "own.py").write_text("raise SystemExit('the folder ran its code')\n")
    from model_utils import data

    with pytest.raises(UsageError, match=f"--tokenizer {tok}: cannot be loaded .*custom code"):
        data.load_tokenizer(str(tok))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps({"model_type": "own", "auto_map": {"AutoConfig": "own.OwnConfig"}})
    )
    (hf / "own.py").write_text("raise SystemExit('the folder ran its code')\n")
    from model_utils.config.hf_config import ConfigError, read_config

    with pytest.raises(ConfigError, match="cannot read .*custom code"):
        read_config(str(hf))
    assert asked == []
