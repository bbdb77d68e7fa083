"""--optimizer adamw8bit | adamw_fp8 through ``train.py`` on 2 CPU ranks (gloo, FSDP2): save ->
resume repeats the uninterrupted run bit for bit for both optimizers, all their processes sharing
inductor's cache (adamw_fp8 after adamw8bit crashed there before the cache guard); the
2-rank checkpoint loads on 1 rank with the same (dequantised) moments, and ``train.py`` resumes
from it on 1 rank; an optimizer change on resume is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.optimizers import LOW_BIT, STATE_CLASS, dequantized, local_tensor
from helpers.runs import FAST, losses, records, run_train

from model_utils import checkpoint as ck
from model_utils import optim
from model_utils.checkpoint import layout
from model_utils.checkpoint.layout import read_full_tensors
from model_utils.config.arguments import parse_args

# ============================================================================================
# train.py on 2 CPU ranks

# The tiny preset with one linear shape: torchao compiles its step (torch.compile, inductor's
# C++ on CPU) once per distinct (shape, state class, group) in every process, and each process
# traces them again even when the FX graph cache serves the kernels. Width 128 with 4 KV heads
# and a 128-wide MLP makes q/k/v/o/gate/up/down one shape (a 64 x 128 shard, 8192 values: still
# quantized, like the embeddings' 4096 x 128 shards); the norms stay fp32 as before. Measured
# (2026-11-26, one 2-rank adamw8bit run, CPU s): 110 -> 70 on a fresh cache, 78 -> 60 on a warm one.
ONE_LINEAR_SHAPE = [
    "--hidden_width=128",
    "--num_heads=4",
    "--num_key_value_heads=4",
    "--intermediate_size=128",
]
COMMON = [*FAST, *ONE_LINEAR_SHAPE, "--max_steps=6", "--warmup=2", "--validation_batches=1"]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per optimizer: an uninterrupted 2-rank run saving at steps 3 and 6, and a 2-rank run
    resumed from step 3. All eight processes share inductor's cache (its default folder, as a
    user's processes do), and adamw_fp8 runs after adamw8bit, whose compiled step for the same
    DTensor shapes is in that cache by then: without the cache guard in optim.low_bit_adamw
    adamw_fp8's first step loaded it and died ("'OptimStateFp8' object has no attribute
    'qmap'"). The cache outlives the suite, so a machine's later suites find these kernels
    (inductor keys each on its graph, torch's version and config) and only trace."""
    root = tmp_path_factory.mktemp("low_bit")
    for name in LOW_BIT:
        full, resumed = root / f"{name}-full", root / f"{name}-resumed"
        flags = [*COMMON, f"--optimizer={name}"]
        run_train(*flags, "--checkpoint_freq=3", f"--output_dir={full}", nproc=2)
        result = run_train(
            *flags,
            f"--output_dir={resumed}",
            f"--resume_from_checkpoint={full / 'checkpoints' / 'step_00000003'}",
            nproc=2,
        )
        assert "Resumed from" in result.stdout and "at step 3" in result.stdout
    return {"root": root}


@pytest.mark.parametrize("name", LOW_BIT)
def test_two_rank_resume_repeats_the_uninterrupted_run_bit_for_bit(
    two_rank_runs: dict[str, Path], name: str
) -> None:
    full, resumed = (two_rank_runs["root"] / f"{name}-{kind}" for kind in ("full", "resumed"))
    want, got = losses(full), losses(resumed)
    assert sorted(got) == [4, 5, 6]
    assert [got[s] for s in got] == [want[s] for s in got]  # exact, not approximate
    assert [r["lr"] for r in records(resumed)] == [r["lr"] for r in records(full)][3:]
    assert records(resumed, "val")[-1]["val_loss"] == records(full, "val")[-1]["val_loss"]
    run = json.loads((full / "metrics.jsonl").read_text().splitlines()[0])
    assert run["flags"]["optimizer"] == name


@pytest.mark.parametrize("name", LOW_BIT)
def test_two_rank_checkpoint_loads_on_one_rank_with_the_same_moments(
    two_rank_runs: dict[str, Path], name: str, tmp_path: Path
) -> None:
    """DCP reshards torchao's states 2 -> 1 (torchao's aten.slice + copy_ between its states):
    every moment loaded on one rank equals, dequantised, what the two ranks saved, and is still
    torchao's quantised state where the tensor is big enough."""
    import train
    from model_utils.parallel import distributed
    from model_utils.precision import backends as precision

    path = two_rank_runs["root"] / f"{name}-full" / "checkpoints" / "step_00000003"
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    args = parse_args([*COMMON, f"--optimizer={name}"])
    device = torch.device("cpu")
    mesh = distributed.build_mesh(distributed.world_from_env({}), device, "full")
    backend = precision.build_backend(args, device)
    model = train.build_model(args, mesh, device, backend)
    optimizer, scheduler = optim.from_config(model, args.optim, args.run.max_steps)
    state = ck.TrainState(model, optimizer, scheduler, config=args.as_dict())
    result = ck.Checkpointer(tmp_path, keep_last=0).load(path, state)
    assert result.resharded and result.saved_world_size == 2 and state.step == 3

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    metadata = FileSystemReader(str(path)).read_metadata()
    fields = layout.optimizer_fields(metadata)
    states = get_optimizer_state_dict(model, optimizer)["state"]
    quantized = 0
    for field in ("exp_avg", "exp_avg_sq"):
        saved = read_full_tensors(path, fields[field])  # dequantised by torchao's copy_
        assert set(saved) == set(states)
        for fqn, tensor in saved.items():
            assert torch.equal(dequantized(states[fqn][field]), tensor), (fqn, field)
            quantized += type(local_tensor(states[fqn][field])).__name__ == STATE_CLASS[name]
    assert quantized >= 2 * 7 * 4  # the decoder layers' linear weights at least

    if name == "adamw_fp8":  # and train.py resumes from it on one rank
        out = tmp_path / "one-rank"
        result = run_train(
            *COMMON,
            f"--optimizer={name}",
            f"--output_dir={out}",
            f"--resume_from_checkpoint={path}",
        )
        assert "Checkpoint written by 2 ranks, loaded on 1" in result.stdout
        assert sorted(losses(out)) == [4, 5, 6]


def test_train_refuses_an_optimizer_change_on_resume(
    two_rank_runs: dict[str, Path], refused_by_train
) -> None:
    path = two_rank_runs["root"] / "adamw8bit-full" / "checkpoints" / "step_00000003"
    _, _, stderr = refused_by_train(
        *COMMON,
        "--optimizer=adamw_fp8",
        f"--output_dir={two_rank_runs['root'] / 'changed'}",
        f"--resume_from_checkpoint={path}",
        "--validate_only",
    )
    assert stderr.strip().splitlines() == [
        f"train.py: error: checkpoint {path} belongs to another run: --optimizer adamw8bit -> "
        "adamw_fp8 (saved -> this run); resume with the saved values, or to train on from its "
        "weights with these, write them out (.venv/bin/python -m scripts.convert_checkpoint "
        f"{path} DIR) and start with --init_from_hf DIR"
    ]
