"""Parameter groups and AdamW under FSDP2 on 2 real ranks (model_utils/optim.py)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.inprocess import tiny_llama
from helpers.optimizers import group_names
from helpers.procs import spawn_ranks

from model_utils.optim import build_optimizer, param_groups
from model_utils.run.step import clip_grad_norm

# ------------------------------------------------------------------- FSDP2 (2 gloo ranks)


def _fsdp_worker(rank: int, world_size: int, port: int, result_dir: str) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        model = tiny_llama()
        reference_groups = group_names(param_groups(model, 0.1))
        convert_to_float8_training(
            model,
            config=Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True),
            module_filter_fn=lambda _module, fqn: fqn != "lm_head",
        )
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        sharded = group_names(param_groups(model, 0.1))
        optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95)
        batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
        losses = []
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()

        # train.py's clip on DTensor shards: the global norm (a plain tensor, the same on both
        # ranks), and gradients scaled so their global norm is the limit
        def global_norm() -> torch.Tensor:
            norms = [torch.linalg.vector_norm(p.grad.full_tensor()) for p in model.parameters()]
            return torch.linalg.vector_norm(torch.stack(norms))

        full_norm = global_norm()
        norm = clip_grad_norm(model, 0.05)
        after = global_norm()
        clip_ok = not isinstance(norm, DTensor) and bool(torch.allclose(norm, full_norm, rtol=1e-5))
        clip_ok &= norm.item() > 0.05 and bool(torch.allclose(after, torch.tensor(0.05), rtol=1e-4))
        optimizer.zero_grad()
        for _ in range(3):
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            clip_grad_norm(model, 1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        ok = sharded == reference_groups and losses[-1] < losses[0] and clip_ok
        with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
            f.write(f"{ok} {optimizer.defaults['fused']} {losses}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_param_groups_and_optimizer_under_fsdp2(tmp_path) -> None:
    """DTensor params (with torchao float8 all-gather) get the same groups and train."""
    spawn_ranks(_fsdp_worker, 2, str(tmp_path))
    for rank in range(2):
        ok, fused, losses = (tmp_path / f"rank{rank}").read_text().split(" ", 2)
        assert ok == "True", losses
        assert fused == "True"  # the fused kernel accepts DTensor + float8 weight subclasses
