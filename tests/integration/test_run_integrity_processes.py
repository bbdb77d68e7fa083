"""Never lose a run, round 3 (issue 33), through real train.py processes and real ranks: a bad
read records nothing false, and a resume refuses data that changed since the save.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers.endpoints import silent_hub
from helpers.procs import PYTHON, spawn_ranks
from helpers.runs import FAST

from model_utils import checkpoint as ck
from model_utils import data
from model_utils.checkpoint.manifest import checkpoint_name, latest_checkpoint, step_of
from model_utils.report import metrics

ROOT = Path(__file__).resolve().parents[2]


# train.py with the third micro-batch read failing as a disk does (EIO): a fault past the
# start-up scan, at a step of this launch's choosing.
_FAILING_READ = """
import sys
import train
from model_utils.data import stream

reads, fail_at = [0], int(sys.argv[1])
original = stream.TrainStream.__next__

def failing(self):
    reads[0] += 1
    if reads[0] == fail_at:
        raise OSError(5, "Input/output error")
    return original(self)

stream.TrainStream.__next__ = failing
train.main(sys.argv[2:])
"""


def _train_failing_at(read: int, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [PYTHON, "-c", _FAILING_READ, str(read), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )


def _train_records(out: Path) -> dict[int, dict]:
    records = metrics.read_jsonl(out / "metrics.jsonl")
    return {r["step"]: r for r in records if r.get("kind") == "train"}


# ============================================================================================
# 4. A bad read records nothing false


def test_a_read_failing_mid_run_drops_its_step_and_saves_the_last_full_one(tmp_path: Path):
    """Two micro-batches a step: the sixth read, step 3's second, fails after step 3's first
    was read. The saved step 2 holds the stream where step 3 began, so the resumed steps 3
    and 4 train on the data, and to the losses, of a run that never failed."""
    out = tmp_path / "run"
    common = [*FAST, "--warmup", "1", "--validation_batches", "1", "--logging_freq", "1"]
    common += ["--grad_accum_steps", "2"]
    result = _train_failing_at(6, *common, "--max_steps", "10", f"--output_dir={out}")
    assert result.returncode == 2, result.stderr[-3000:]
    [line] = [ln for ln in result.stderr.splitlines() if ln.startswith("train.py: error:")]
    saved = out / "checkpoints" / checkpoint_name(2)
    assert "could not read its data mid-run (OSError: [Errno 5] Input/output error)" in line
    assert f"step 3 met it and was not taken: checkpoint of step 2 at {saved}" in line
    assert sorted(_train_records(out)) == [1, 2]  # no step 3, no loss 0.0
    assert all(r["loss"] > 1.0 for r in _train_records(out).values())
    assert "Batch 3 Loss" not in result.stdout
    assert ck.complete_checkpoints(out / "checkpoints") == [saved]
    assert ck.read_marker(saved)["step"] == 2
    resumed = subprocess.run(  # the saved state is a whole step 2: the run goes on from there
        [PYTHON, str(ROOT / "train.py"), *common, "--max_steps", "4"]
        + [f"--output_dir={out}", "--resume_from_checkpoint=auto"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(_train_records(out)) == [1, 2, 3, 4]
    whole = tmp_path / "whole"
    _train_failing_at(0, *common, "--max_steps", "10", f"--output_dir={whole}").check_returncode()
    losses = {step: r["loss"] for step, r in _train_records(whole).items() if step <= 4}
    assert {step: r["loss"] for step, r in _train_records(out).items()} == losses


class _Stream:
    """A stream of one-token batches whose `fail_at`-th read fails (0: never)."""

    micro_batch, seq_len, dataset, rank = 1, 4, "memory", 0

    def __init__(self, fail_at: int) -> None:
        self.reads, self.fail_at = 0, fail_at

    def state_dict(self) -> dict:
        return {"reads": self.reads}

    def __next__(self) -> dict:
        self.reads += 1
        if self.reads == self.fail_at:
            raise data.DataError("a bad record")
        ids = torch.full((1, 4), self.reads)
        return {"input_ids": ids, "labels": ids}


def _all_read_worker(rank: int, world_size: int, port: int, results: dict) -> None:
    """Rank 1's second read fails; every rank must learn it at the same step."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        reads = data.ReadGuard(_Stream(2 if rank == 1 else 0), "text", world_size)
        seen = []
        for _ in range(3):
            batch, weight = reads.next()
            seen.append((weight, reads.all_read()))
        results[rank] = seen
    finally:
        dist.destroy_process_group()


def test_every_rank_learns_of_a_bad_read_before_the_optimizer_step() -> None:
    results = mp.Manager().dict()
    spawn_ranks(_all_read_worker, 2, results)
    assert results[0] == [(1.0, True), (1.0, False), (1.0, False)]
    assert results[1] == [(1.0, True), (0.0, False), (0.0, False)]


def _reshard_worker(rank: int, world_size: int, port: int, results: dict) -> None:
    """Two ranks resume four shards' positions; rank 1's shards cannot be read (a disk error
    on its node): both ranks must stop at the load, with rank 1's line."""
    from helpers.runs import data_section

    from model_utils.config.presets import BUNDLED_DATASET, BUNDLED_TOKENIZER
    from model_utils.data.stream import TrainStream

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        source, tokenizer = data_section(BUNDLED_DATASET), data.load_tokenizer(BUNDLED_TOKENIZER)
        stream = data.RankStream(source, tokenizer, 32, rank=rank, world_size=world_size)
        saved = [TrainStream(source, tokenizer, 32, rank=s, world_size=4) for s in range(4)]
        if rank == 1:

            def unreadable(**shard: int) -> TrainStream:
                raise OSError(5, "Input/output error")

            stream._shard = unreadable
        try:
            results[rank] = stream.restart_after_reshard([s.state_dict() for s in saved])
        except data.DataError as exc:
            results[rank] = f"DataError: {exc}"
    finally:
        dist.destroy_process_group()


def test_a_shard_unreadable_at_a_resume_stops_every_rank_with_its_line() -> None:
    results = mp.Manager().dict()
    spawn_ranks(_reshard_worker, 2, results)
    assert results[0] == results[1], dict(results)  # rank 0's shards were fine: it stops too
    assert (
        results[0].startswith("DataError: ")
        and "rank 1 could not read its data at the resume" in results[0]
    )


# ============================================================================================
# 5. The data a run resumes on is the data it saved with


def _train(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [PYTHON, str(ROOT / "train.py"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )


def test_a_resume_refuses_a_data_file_replaced_since_the_save(
    tmp_path: Path, refused_by_train
) -> None:
    import gzip

    corpus = tmp_path / "corpus.jsonl.gz"
    lines = gzip.decompress((ROOT / "data" / "kjv.jsonl.gz").read_bytes()).splitlines(True)
    corpus.write_bytes(gzip.compress(b"".join(lines)))
    out = tmp_path / "run"
    common = [*FAST, "--warmup=1", "--validation_batches=1", f"--dataset={corpus}"]
    common.append(f"--output_dir={out}")
    first = _train(*common, "--max_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    saved = latest_checkpoint(out / "checkpoints")
    recorded = ck.read_marker(saved)["run_config"]["data_fingerprint"]
    assert list(recorded) == ["corpus.jsonl.gz"]

    corpus.write_bytes(gzip.compress(b"".join(lines[1:])))  # same path, one document less
    _, [line], _ = refused_by_train(*common, "--max_steps=3", "--resume_from_checkpoint=auto")
    assert f"checkpoint {saved} was saved with other data: corpus.jsonl.gz changed (" in line
    assert "--allow_data_change" in line

    allowed = _train(
        *common, "--max_steps=3", "--resume_from_checkpoint=auto", "--allow_data_change"
    )
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    [warning] = [ln for ln in allowed.stdout.splitlines() if "Resuming on changed data" in ln]
    assert " W [resume.py:" in warning  # once, as a warning
    assert "(--allow_data_change): corpus.jsonl.gz changed" in warning
    assert step_of(latest_checkpoint(out / "checkpoints")) == 3


# ============================================================================================
# 6. Offline answers fast


def _hub_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """An empty Hugging Face cache, and a hub endpoint that refuses every connection (what a
    node without network sees), unless `extra` says otherwise."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_TOKEN"):
        env.pop(var, None)
    return {**env, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9", **extra}


def test_a_hub_tokenizer_without_network_is_one_line_at_once(tmp_path: Path) -> None:
    """One look-up of a hub that never answers (the loader's retries made dozens and took a
    minute), none offline."""
    for extra in ({}, {"HF_HUB_OFFLINE": "1"}):
        with silent_hub() as hub:
            result = subprocess.run(
                [sys.executable, str(ROOT / "train.py"), "--preset", "tiny"]
                + ["--tokenizer", "someorg/sometok", "--validate_only"],
                capture_output=True,
                text=True,
                timeout=300,
                env=_hub_env(tmp_path, HF_ENDPOINT=hub.url, **extra),
                cwd=ROOT,
            )
        assert result.returncode == 2, result.stderr[-2000:]
        [line] = (result.stdout + result.stderr).splitlines()  # was 45 lines, after a minute
        assert line.startswith("train.py: error: --tokenizer someorg/sometok: no local folder")
        unreachable = f"the Hugging Face hub ({hub.url}) did not answer within 10 s"
        assert ("HF_HUB_OFFLINE=1" if extra else unreachable) in line
        assert hub.connections <= (0 if extra else 2), hub.connections


def test_a_hub_tokenizer_in_the_cache_loads_without_network(tmp_path: Path) -> None:
    import shutil

    snapshot = tmp_path / "hf" / "hub" / "models--someorg--tok" / "snapshots" / "abc"
    shutil.copytree(ROOT / "data" / "tokenizer", snapshot)
    (snapshot / "config.json").write_text('{"model_type": "llama"}')  # as a hub model has
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("abc")
    code = "from model_utils import data; print(len(data.load_tokenizer('someorg/tok')))"
    for extra in ({}, {"HF_HUB_OFFLINE": "1"}):
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=300,
            env=_hub_env(tmp_path, **extra),
            cwd=ROOT,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert int(result.stdout) > 1000


# ============================================================================================
# 8. A refusal found after start-up leaves no run folder holding only .run.lock


def test_a_refusal_after_start_up_leaves_no_run_folder_behind(tmp_path: Path) -> None:
    """Too little data for validation is found by the ranks' readers, after the process group
    and the run lock: the folder the lock made goes with it."""
    (tmp_path / "one.jsonl").write_text('{"text": "just a few words"}\n')
    out = tmp_path / "runs" / "r"
    result = _train(*FAST, "--dataset", str(tmp_path / "one.jsonl"), f"--output_dir={out}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "the validation part has only 0 windows" in result.stderr
    assert not (tmp_path / "runs").exists()
