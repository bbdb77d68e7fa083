"""The TE model across processes, through the TE test double: the double reaches a subprocess,
and FSDP2 on 2 ranks builds and initialises the TE model and reduces amax over the group."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
import torch.distributed as dist
from helpers.procs import PYTHON, spawn_ranks
from helpers.te_models import backend_args, batch, built, tiny_config
from te_double import install, subprocess_env

import te_llama
from model_utils.model import te_support
from model_utils.model.modeling import materialize
from model_utils.precision.te import TEBackend


def test_double_injects_into_subprocess(tmp_path) -> None:
    """The route train.py integration tests use: PYTHONPATH from te_double.subprocess_env."""
    code = (
        "import transformer_engine, transformer_engine.pytorch as te; "
        "print(transformer_engine.__version__, te.TransformerLayer.__module__)"
    )
    out = subprocess.run(
        [PYTHON, "-c", code],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["2.20.2+double", "transformer_engine.pytorch"]


# ------------------------------------------------------------------------------------------
# Two ranks, FSDP2 on gloo.
# ------------------------------------------------------------------------------------------


def _two_rank_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    install()
    try:
        config = tiny_config()
        backend = TEBackend(backend_args(fp8=True, recipe="delayed"), dp_group=dist.group.WORLD)
        with torch.device("meta"):
            model = te_llama.build_te_llama(config, impl="te")
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        materialize(model, torch.device("cpu"), 11)
        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        backend.prepare(model)
        ids = batch(config, seed=100 + rank)  # different data per rank -> different local amaxes
        with backend.autocast(first_micro_batch=True):
            loss = model(ids, labels=ids).loss
        loss.backward()
        meta = model.model.layers[0].transformer_layer.layernorm_mlp.fp8_meta
        history = meta["scaling_fwd"].amax_history
        gathered = [torch.zeros_like(history) for _ in range(world)]
        dist.all_gather(gathered, history)
        if rank == 0:
            weights = {k: v for k, v in full.items() if not te_support.is_te_extra_state_key(k)}
            torch.save(
                {"weights": weights, "histories": gathered}, os.path.join(out_dir, "result.pt")
            )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_two_ranks_init_and_amax_reduction(tmp_path, te_double) -> None:
    """2-rank FSDP2: the sharded init equals the single-process init, and delayed-scaling
    amaxes are all-reduced over the data-parallel group passed to the backend."""
    spawn_ranks(_two_rank_worker, 2, str(tmp_path))
    result = torch.load(tmp_path / "result.pt")
    single = built(tiny_config(), seed=11).state_dict()
    for name, tensor in result["weights"].items():
        assert torch.equal(tensor, single[name]), name
    first, second = result["histories"]
    assert first.abs().sum() > 0  # the reduced amaxes entered the history
    assert torch.equal(first, second)
