"""Never lose a run, round 3 (issue 33), on real files in one process: locks that cover every
folder a run writes, checkpoints verified or refused, damage set aside and named, data that
changed under a resume. The same behaviour through train.py's processes is in
tests/integration/test_run_integrity_processes.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from model_utils.run import run_lock

ROOT = Path(__file__).resolve().parents[2]


# ============================================================================================
# 1. A live run's lock covers every folder below it, and a folder holding it


def _holder_in_another_process(directory: Path) -> subprocess.Popen:
    """A process that holds `directory`'s run lock until its stdin closes."""
    code = (
        "import sys; from model_utils.run import run_lock; "
        "run_lock.RunLock(sys.argv[1]).acquire(); print('held', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_folder_inside_or_around_a_live_run_is_refused_naming_the_holder(tmp_path: Path):
    live = tmp_path / "runs" / "a"
    holder = _holder_in_another_process(live)
    try:
        inside = live / "checkpoints"  # another run's --checkpoint_dir in this run's default one
        with pytest.raises(run_lock.RunLocked) as refused:
            run_lock.check_not_locked(run_lock.lock_dirs(str(tmp_path / "b"), str(inside)).values())
        line = str(refused.value)
        assert (
            f"{inside} is inside {live}, which is in use by another run (pid {holder.pid} " in line
        )
        assert "\n" not in line
        with pytest.raises(run_lock.RunLocked, match=f"{tmp_path / 'runs'} holds {live}, which"):
            run_lock.check_not_locked([tmp_path / "runs"])  # a run folder around the live one
        run_lock.check_not_locked([tmp_path / "b", tmp_path / "runs" / "b"])  # beside it: fine
        assert not inside.exists()  # the check created nothing
    finally:
        holder.stdin.close()
        holder.wait()
    run_lock.check_not_locked([inside, tmp_path / "runs"])  # a dead holder blocks nothing


def test_a_link_or_another_spelling_of_a_live_runs_folder_is_that_folder(tmp_path: Path):
    """Locks compare resolved paths: a symlink to a live run's checkpoints folder (or to its
    run folder), or a spelling through `..`, used to pass, and two runs overwrote each other's
    checkpoints."""
    live = tmp_path / "runs" / "a"
    (live / "checkpoints").mkdir(parents=True)
    (tmp_path / "ckpt-link").symlink_to(live / "checkpoints")
    (tmp_path / "run-link").symlink_to(live)
    holder = _holder_in_another_process(live)
    try:
        for spelled, where in [
            (tmp_path / "ckpt-link", "is inside"),
            (tmp_path / "runs" / "x" / ".." / "a" / "checkpoints", "is inside"),
        ]:
            owned = run_lock.lock_dirs(str(tmp_path / "b"), str(spelled))
            with pytest.raises(run_lock.RunLocked) as refused:
                run_lock.check_not_locked(owned.values())
            line = str(refused.value)
            assert f"{where} {live}, which is in use by another run (pid {holder.pid} " in line
            assert "\n" not in line
        with pytest.raises(run_lock.RunLocked, match=f"which is {live}\\) is in use by"):
            run_lock.check_not_locked([tmp_path / "run-link"])
        with pytest.raises(run_lock.RunLocked, match=f"is inside {live}, which is in use"):
            run_lock.check_not_locked([tmp_path / "run-link" / "checkpoints"])
    finally:
        holder.stdin.close()
        holder.wait()
    assert sorted(p.name for p in (live / "checkpoints").iterdir()) == []  # nothing written


def test_the_lock_taken_after_start_up_also_covers_overlaps(tmp_path: Path) -> None:
    """validate() only looks; a run that took a folder around this one's in between is still
    refused when rank 0 takes its locks, and leaves no folder of its own behind."""
    import torch.distributed as dist

    from model_utils.config.arguments import parse_args
    from model_utils.parallel import distributed

    live = tmp_path / "a"
    holder = _holder_in_another_process(live)
    ours = tmp_path / "b"
    args = parse_args(["--preset", "tiny", f"--output_dir={ours}", f"--checkpoint_dir={live}/c"])
    created = not dist.is_initialized()  # another test of this process may have made one
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(run_lock.RunLocked, match=f"{live}/c is inside {live}, which is in"):
            run_lock.hold_run_dirs(args, distributed.world_from_env({}))
    finally:
        if created:
            dist.destroy_process_group()
        holder.stdin.close()
        holder.wait()
    assert not ours.exists() and not (live / "c").exists()  # no folder holding only .run.lock


def test_a_released_lock_leaves_no_folder_that_holds_only_the_lock(tmp_path: Path) -> None:
    refused = run_lock.RunLock(tmp_path / "new" / "run").acquire()
    refused.release()  # nothing written: the folders acquire made are gone
    assert not (tmp_path / "new").exists()
    kept = run_lock.RunLock(tmp_path / "used").acquire()
    (tmp_path / "used" / "metrics.jsonl").write_text("{}\n")
    kept.release()  # a folder holding the run's work keeps it (and the lock file)
    assert sorted(p.name for p in (tmp_path / "used").iterdir()) == [
        run_lock.LOCK_NAME,
        "metrics.jsonl",
    ]
    existing = tmp_path / "mine"
    existing.mkdir()
    run_lock.RunLock(existing).acquire().release()  # the user's own empty folder stays
    assert existing.is_dir() and not any(existing.iterdir())


def test_train_refuses_a_checkpoint_dir_inside_a_live_runs_folder(
    tmp_path: Path, refused_by_train
) -> None:
    live = tmp_path / "a"
    holder = _holder_in_another_process(live)
    try:
        _, [line], stderr = refused_by_train(
            "--preset", "tiny", f"--output_dir={tmp_path / 'b'}", f"--checkpoint_dir={live}/c"
        )
    finally:
        holder.stdin.close()
        holder.wait()
    assert f"is inside {live}, which is in use by another run (pid {holder.pid} " in line
    assert "Traceback" not in stderr and not (tmp_path / "b").exists()


# ============================================================================================
# 2. A checkpoint is verified or it is not trusted; 3. every damaged one is set aside, named


def _save(root: Path, steps: list[int], keep_last: int = 0):
    """Real DCP checkpoints of a small model (test_failures' helper)."""
    from helpers.checkpoints import save_plain_checkpoints

    return save_plain_checkpoints(root, steps, keep_last)


def _strip_checksums(path: Path, empty: bool = False) -> None:
    """The marker of a checkpoint saved before checksums (no table), or with its table emptied,
    and a megabyte of its weights zeroed: damage no check can see."""
    import json

    from model_utils import checkpoint as ck
    from model_utils.checkpoint.manifest import MARKER

    marker = ck.read_marker(path)
    if empty:
        marker["files"] = {}
    else:
        del marker["files"]
    (path / MARKER).write_text(json.dumps(marker))
    shard = next(path.glob("__0_*.distcp"))
    with open(shard, "r+b") as fh:
        fh.seek(1000)
        fh.write(b"\0" * min(2**20, shard.stat().st_size - 1000))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.mark.parametrize("empty", [False, True], ids=["no table", "empty table"])
def test_auto_resume_passes_an_unverified_checkpoint_by_and_keeps_it(
    tmp_path: Path, empty: bool, caplog
) -> None:
    from model_utils.checkpoint.manifest import checkpoint_name, checkpoint_to_resume

    ckpt = _save(tmp_path, [1, 2, 3])
    newest = tmp_path / checkpoint_name(3)
    _strip_checksums(newest, empty)
    assert checkpoint_to_resume("auto", tmp_path, verify=False) == tmp_path / checkpoint_name(2)
    with caplog.at_level("WARNING"):
        assert checkpoint_to_resume("auto", ckpt.checkpoint_dir) == tmp_path / checkpoint_name(2)
    aside = tmp_path / f"unverified-{checkpoint_name(3)}"
    assert aside.is_dir() and (aside / "__0_0.distcp").is_file()  # kept, out of the way
    [set_aside, resuming] = _warnings(caplog)
    assert f"{newest} set aside as {aside.name}: " in set_aside
    assert "records no checksums" in set_aside
    assert (
        resuming == f"Resuming from {tmp_path / checkpoint_name(2)}, the newest verified checkpoint"
    )


def test_an_unverified_checkpoint_loads_only_when_named_with_a_warning(tmp_path: Path, caplog):
    from model_utils import checkpoint as ck
    from model_utils.checkpoint.manifest import MARKER, checkpoint_name, checkpoint_to_resume

    ckpt = _save(tmp_path, [1])
    only = tmp_path / checkpoint_name(1)
    _strip_checksums(only)
    with pytest.raises(ck.ResumeRefused) as refused:  # auto: nothing verified to fall back to
        checkpoint_to_resume("auto", ckpt.checkpoint_dir)
    line = str(refused.value)
    assert f"no checkpoint in {tmp_path} is verified" in line and "\n" not in line
    assert f"--resume_from_checkpoint {only}" in line and only.is_dir()  # not renamed
    with pytest.raises(ck.ResumeRefused, match="is verified"):  # before any process group too
        checkpoint_to_resume("auto", tmp_path, verify=False)
    with caplog.at_level("WARNING"):
        assert checkpoint_to_resume(str(only), ckpt.checkpoint_dir) == only
    assert _warnings(caplog) == [
        f"Loading {only} unverified, as named: {only / MARKER} records no checksums"
    ]


def test_keep_last_never_prunes_a_verified_checkpoint_for_an_unverified_one(tmp_path: Path):
    from model_utils import checkpoint as ck
    from model_utils.checkpoint.manifest import checkpoint_name

    _save(tmp_path, [1, 2, 3], keep_last=3)
    _strip_checksums(tmp_path / checkpoint_name(3))
    _save(tmp_path, [4], keep_last=2)  # e.g. a run resumed from the unverified one, by name
    names = [p.name for p in ck.complete_checkpoints(tmp_path)]
    assert names == [checkpoint_name(s) for s in (2, 3, 4)]  # 2 kept; 3 takes no slot


def _malform(path: Path, form: str) -> None:
    """Rewrite checkpoint `path`'s table in one malformed `form` and zero a megabyte of its
    weights: a table that proves nothing about damage it cannot see."""
    import json

    from model_utils import checkpoint as ck
    from model_utils.checkpoint.manifest import MARKER

    marker = ck.read_marker(path)
    files = marker["files"]
    if form == "no sha256":  # sizes only: every file listed, no checksum
        marker["files"] = {name: {"bytes": sums["bytes"]} for name, sums in files.items()}
    elif form == "null sha256":
        marker["files"] = {name: {**sums, "sha256": None} for name, sums in files.items()}
    elif form == "sizes as text":
        marker["files"] = {
            name: {**sums, "bytes": str(sums["bytes"])} for name, sums in files.items()
        }
    elif form == "a list":
        marker["files"] = sorted(files)
    (path / MARKER).write_text(json.dumps(marker))
    shard = next(path.glob("__0_*.distcp"))
    with open(shard, "r+b") as fh:
        fh.seek(1000)
        fh.write(b"\0" * min(2**20, shard.stat().st_size - 1000))


MALFORMED = ["no sha256", "null sha256", "sizes as text", "a list"]


@pytest.mark.parametrize("form", MALFORMED)
def test_a_malformed_checksum_table_is_unverified_everywhere(
    tmp_path: Path, form: str, caplog, capsys
) -> None:
    """Verified means every file a load reads has a recorded checksum that matched: a table
    of sizes only used to pass as verified, so a corrupted newest checkpoint was resumed and
    exported without a word and the clean one pruned. Any malformed table is unverified, with
    an unverified checkpoint's consequences: `auto` and the converter pass it by, by path it
    loads with a warning, keep-last gives it no slot."""
    from model_utils import checkpoint as ck
    from model_utils.checkpoint.manifest import UNVERIFIED, checkpoint_name, checkpoint_to_resume
    from scripts import convert_checkpoint

    ckpt = _save(tmp_path, [1, 2], keep_last=2)
    newest = tmp_path / checkpoint_name(2)
    _malform(newest, form)
    assert ck.inspect_checkpoint(newest).kind == UNVERIFIED
    assert checkpoint_to_resume("auto", tmp_path, verify=False) == tmp_path / checkpoint_name(1)
    assert convert_checkpoint.pick_checkpoint(str(tmp_path))[0] == tmp_path / checkpoint_name(1)
    _save(tmp_path, [3], keep_last=2)  # keep-last: 1 and 3 verified, 2 takes no slot
    assert [p.name for p in ck.complete_checkpoints(tmp_path)] == [
        checkpoint_name(s) for s in (1, 2, 3)
    ]
    with caplog.at_level("WARNING"):
        assert checkpoint_to_resume(str(newest), ckpt.checkpoint_dir) == newest
    assert _warnings(caplog) == [
        f"Loading {newest} unverified, as named: {ck.inspect_checkpoint(newest)}"
    ]


@pytest.mark.parametrize("lost", [".metadata", "checkpoint.json"])
def test_a_newest_checkpoint_missing_a_file_is_set_aside_and_named(
    tmp_path: Path, lost: str, caplog
) -> None:
    from model_utils.checkpoint.manifest import checkpoint_name, checkpoint_to_resume, is_complete

    ckpt = _save(tmp_path, [1, 2, 3])
    newest = tmp_path / checkpoint_name(3)
    (newest / lost).unlink()
    with caplog.at_level("WARNING"):
        assert checkpoint_to_resume("auto", ckpt.checkpoint_dir) == tmp_path / checkpoint_name(2)
    aside = tmp_path / f"damaged-{checkpoint_name(3)}"
    assert aside.is_dir() and not newest.exists()
    assert (
        f"{newest} set aside as {aside.name}: checkpoint {newest} has no {lost}"
        in (_warnings(caplog)[0])
    )
    _save(tmp_path, [3])  # the resumed run's next save: the damaged copy is not overwritten
    assert (aside / "__0_0.distcp").is_file() and is_complete(newest)


def test_a_save_onto_a_damaged_step_folder_sets_it_aside(tmp_path: Path, caplog) -> None:
    """A fresh run (no resume) reaching the step of a damaged folder keeps it, named."""
    from model_utils.checkpoint.manifest import DCP_METADATA, checkpoint_name, is_complete

    _save(tmp_path, [1])
    (tmp_path / checkpoint_name(1) / DCP_METADATA).unlink()
    with caplog.at_level("WARNING"):
        _save(tmp_path, [1])
    assert (tmp_path / f"damaged-{checkpoint_name(1)}" / "__0_0.distcp").is_file()
    assert is_complete(tmp_path / checkpoint_name(1))
    assert "set aside as damaged-step_00000001" in _warnings(caplog)[0]


def test_only_damaged_step_folders_are_refused_not_a_silent_fresh_start(tmp_path: Path) -> None:
    from model_utils import checkpoint as ck
    from model_utils.checkpoint.manifest import DCP_METADATA, checkpoint_name, checkpoint_to_resume

    ckpt = _save(tmp_path, [1])
    (tmp_path / checkpoint_name(1) / DCP_METADATA).unlink()
    with pytest.raises(ck.ResumeRefused, match="every checkpoint in .* is damaged"):
        checkpoint_to_resume("auto", tmp_path, verify=False)  # before any process group
    for _ in range(2):  # left as named: the same command (a requeue) is refused again
        with pytest.raises(ck.ResumeRefused, match="every checkpoint in .* is damaged"):
            checkpoint_to_resume("auto", ckpt.checkpoint_dir)
        assert (tmp_path / checkpoint_name(1)).is_dir()


# ============================================================================================
# 7. Writers check space first


def test_convert_checkpoint_onto_a_full_disk_is_refused_before_writing(
    tmp_path: Path, small_disk, capsys
) -> None:
    from helpers.checkpoints import convert_refused, save_llama_checkpoints

    from scripts import convert_checkpoint

    [path] = save_llama_checkpoints(tmp_path / "ckpt", (1,))
    weights = convert_checkpoint.export_bytes(path, "float32")
    assert weights > 2**22  # the small Llama's fp32 weights: more than the disk holds
    disk = small_disk("disk", 2)
    line = convert_refused([str(path), str(disk / "hf")], capsys)  # exit 2, one line
    assert f"{disk / 'hf'} has 0.00 GiB free, less than one Hugging Face export at float32" in (
        line
    )
    assert list(disk.iterdir()) == []  # nothing written, not even the folder
    half = convert_checkpoint.export_bytes(path, "bfloat16")
    assert half == weights // 2


def test_convert_checkpoint_trusts_an_unverified_checkpoint_only_by_name(
    tmp_path: Path, capsys
) -> None:
    """As train.py's resume: a folder converts its newest verified checkpoint, naming the
    unverified one it skipped; given by path, an unverified one converts with a warning."""
    import json

    from helpers.checkpoints import save_llama_checkpoints

    from model_utils import checkpoint as ck
    from model_utils.checkpoint.manifest import MARKER
    from scripts import convert_checkpoint

    folder = tmp_path / "ckpt"
    older, newer = save_llama_checkpoints(folder, (1, 2))
    marker = ck.read_marker(newer)
    del marker["files"]
    (newer / MARKER).write_text(json.dumps(marker))
    assert convert_checkpoint.main([str(folder), str(tmp_path / "hf")]) == 0
    stdout, stderr = capsys.readouterr()
    assert stdout.startswith(f"{older} (step 1, newest intact in {folder})")
    assert stderr == (
        f"convert_checkpoint.py: warning: skipped the unverified checkpoint {newer.name}: "
        f"{newer / MARKER} records no checksums\n"
    )
    assert convert_checkpoint.main([str(newer), str(tmp_path / "hf2")]) == 0
    stdout, stderr = capsys.readouterr()
    assert stdout.startswith(f"{newer} (step 2) -> ")
    assert stderr == (
        f"convert_checkpoint.py: warning: converting {newer} unverified, as named: "
        f"{newer / MARKER} records no checksums\n"
    )


# ============================================================================================
# 8. A disk that fills during an export: one line, nothing left, the weights' checkpoint named


@pytest.fixture
def files_capped():
    """Cap every file this process writes at `nbytes` (RLIMIT_FSIZE, SIGXFSZ ignored: a write
    past it fails with EFBIG, as a full disk fails one with ENOSPC), restored afterwards."""
    import resource
    import signal

    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def cap(nbytes: int) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old[1]))

    yield cap
    resource.setrlimit(resource.RLIMIT_FSIZE, old)
    signal.signal(signal.SIGXFSZ, handler)


def test_a_converter_export_cut_short_leaves_nothing_and_names_the_checkpoint(
    tmp_path: Path, files_capped, capsys
) -> None:
    from helpers.checkpoints import convert_refused, save_llama_checkpoints

    [path] = save_llama_checkpoints(tmp_path / "ckpt", (1,))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    files_capped(1536 * 1024)  # config and tokenizer fit; the weights do not
    for out in (tmp_path / "new" / "hf", mine):
        argv = [str(path), str(out), "--max_shard_size_mb", "1"]
        line = convert_refused(argv, capsys, status=1)
        assert line.startswith(f"convert_checkpoint.py: error: writing {out} failed: ")
        assert line.rstrip("\n").endswith(
            f"what was written is removed, and the weights are still in the checkpoint {path}"
        )
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]  # no hidden parts left


def test_train_export_cut_short_leaves_nothing_and_names_the_checkpoint(
    tmp_path: Path, files_capped
) -> None:
    """--export_hf at the end of a run (checkpoint.export_hf, as train.py calls it): the hidden
    parts and staged files it wrote used to stay behind."""
    from helpers.runs import SMALL_LLAMA
    from transformers import LlamaForCausalLM

    from model_utils import checkpoint as ck
    from model_utils import data
    from model_utils.config import arguments
    from model_utils.model import modeling

    args = arguments.parse_args(SMALL_LLAMA)
    model = LlamaForCausalLM(modeling.model_config(args.model))
    tokenizer = data.load_tokenizer(args.data.tokenizer)
    kept = tmp_path / "ckpt" / "step_00000009"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    files_capped(1536 * 1024)
    for out in (tmp_path / "new" / "hf", mine):
        with pytest.raises(ck.CheckpointWriteError) as failed:
            ck.export_hf(model, model.config, out, tokenizer, max_shard_bytes=2**20, kept=kept)
        line = str(failed.value)
        assert line.startswith(f"the Hugging Face export to {out} failed: ") and "\n" not in line
        assert f"(what it wrote is removed); the checkpoint {kept} holds the same" in line
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_the_converter_names_a_damaged_newest_step_it_passes_over(tmp_path: Path, capsys):
    """As train.py's `auto` names it: a newest step_N missing its .metadata was skipped without
    a word (only complete checkpoints were looked at)."""
    from helpers.checkpoints import convert_refused, save_llama_checkpoints

    from scripts import convert_checkpoint

    folder = tmp_path / "ckpt"
    older, newer = save_llama_checkpoints(folder, (1, 2))
    (newer / ".metadata").unlink()
    assert convert_checkpoint.main([str(folder), str(tmp_path / "hf")]) == 0
    stdout, stderr = capsys.readouterr()
    assert stdout.startswith(f"{older} (step 1, newest intact in {folder})")
    assert stderr == (
        f"convert_checkpoint.py: warning: skipped the damaged checkpoint {newer.name}: "
        f"checkpoint {newer} has no .metadata: not a DCP checkpoint or not finished\n"
    )
    (older / "checkpoint.json").unlink()
    line = convert_refused([str(folder), str(tmp_path / "hf2")], capsys)
    assert f"every checkpoint in {folder} is damaged (newest {newer.name}: " in line


def test_a_finished_run_resumed_to_export_does_not_save_its_checkpoint_again(tmp_path: Path):
    """train.py's finish() saves the last step; a run resumed at --max_steps (only to write
    --export_hf) used to write its own final checkpoint again: minutes for a large model, and
    a moment in which the only copy was being replaced."""
    import torch

    from model_utils import checkpoint as ck
    from model_utils.checkpoint.manifest import MARKER, checkpoint_name

    _save(tmp_path, [1, 2])
    final = tmp_path / checkpoint_name(2)
    before = {p.name: p.stat().st_mtime_ns for p in final.iterdir()}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    state = ck.TrainState(model, config={"seed": 1})
    resumed = ck.Checkpointer(tmp_path)
    resumed.load(final, state)
    assert state.step == 2
    assert resumed.save(2, state) == final  # nothing left to train: the same checkpoint
    resumed.close()
    assert {p.name: p.stat().st_mtime_ns for p in final.iterdir()} == before
    assert (final / MARKER).is_file() and not list(tmp_path.glob(".tmp-*"))
