"""--fp8_weights with --master_weights optimizer: FP8 parameters that train from fp32 masters.

The masters start from the run's fp32 init (or the HF weights it loads), not from the rounded
parameter; a step writes each FP8 parameter from its master; a checkpoint holds the parameters
as plain values (loadable with --fp8_weights on or off) and a resume writes the FP8 bytes from
the restored masters, so it continues exactly; an HF export writes the masters. FP8 parameters
are the TE double's QuantizedTensor (TE's API: quantize_, dequantize, copy_ quantises), because
real TE cannot run here; the GPU tier runs the same on TE (tests/integration/test_gpu.py).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from helpers.optimizers import BETAS
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from model_utils import checkpoint as ck
from model_utils.checkpoint.checkpointer import ModelItem
from model_utils.config.arguments import UsageError, parse_args
from model_utils.model import modeling
from model_utils.precision.master_weights import (
    STATE_NAMES,
    MasterWeightAdamW,
    is_quantized,
    masters_by_name,
    remember_full_precision,
    requantize_from_masters,
    seed_masters,
)
from model_utils.run import guards


def quantized_tensor_type() -> type:
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

    return QuantizedTensor


class TwoLayers(nn.Module):
    """Two FP8 linears and a bf16 norm weight, as a TE layer under quantized_model_init holds:
    GEMM weights in FP8, the rest in the parameters' dtype."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        quantized = quantized_tensor_type()
        self.inits = {
            name: torch.randn(32, 32, generator=torch.Generator().manual_seed(seed + i)) * 0.1
            for i, name in enumerate(("up", "down"))
        }
        for name, init in self.inits.items():
            param = nn.Parameter(quantized.quantize(init, dtype=torch.bfloat16))
            self.register_parameter(name, param)
            remember_full_precision(param, init)
        self.norm = nn.Parameter(torch.ones(32, dtype=torch.bfloat16))
        remember_full_precision(self.norm, torch.ones(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.relu(F.linear(x * self.norm, self.up)), self.down)


def fp8_bytes(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p._data.view(torch.uint8).clone() for n, p in model.named_parameters() if n != "norm"
    }


def train(model: TwoLayers, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(8, 32, generator=gen).to(torch.bfloat16)
        loss = F.mse_loss(model(x).float(), torch.zeros(8, 32))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def fresh_run(seed: int = 0) -> tuple[TwoLayers, MasterWeightAdamW]:
    model = TwoLayers(seed)
    optimizer = MasterWeightAdamW(model.parameters(), lr=1e-2, betas=BETAS)
    assert seed_masters(optimizer) == 3
    return model, optimizer


def test_masters_start_from_the_fp32_init_and_the_step_writes_fp8(te_double) -> None:
    model, optimizer = fresh_run()
    # The whole state exists before the first step, as DCP needs it to load a resume into.
    assert [group["step"] for group in optimizer.param_groups] == [0]
    assert all(set(optimizer.state[p]) == set(STATE_NAMES) for p in model.parameters())
    for name in ("up", "down"):
        param, master = getattr(model, name), optimizer.state[getattr(model, name)]["master_param"]
        assert is_quantized(param) and master.dtype == torch.float32
        assert torch.equal(master, model.inits[name])  # not the FP8 value it is stored as
        assert not torch.equal(param.dequantize(dtype=torch.float32), master)
        assert not hasattr(param, "_master_seed")  # the host copy is freed once seeded
    before = fp8_bytes(model)
    losses = train(model, optimizer, range(20))
    assert losses[-1] < 0.5 * losses[0], losses
    for name, param in model.named_parameters():
        master = optimizer.state[param]["master_param"]
        if name == "norm":
            assert torch.equal(param, master.to(torch.bfloat16))
            continue
        assert is_quantized(param)  # still FP8 after the steps, written from the master
        assert torch.equal(param._data, type(param).quantize(master)._data), name
        assert not torch.equal(param._data.view(torch.uint8), before[name])


def test_a_checkpoint_holds_plain_values_and_a_resume_continues_exactly(te_double) -> None:
    model, optimizer = fresh_run()
    train(model, optimizer, range(4))
    saved_model = copy.deepcopy(ModelItem(model).state_dict())  # as written to disk
    saved_optim = copy.deepcopy(get_optimizer_state_dict(model, optimizer))
    for name in ("up", "down"):
        value = saved_model[name]
        assert type(value) is torch.Tensor and value.dtype == torch.bfloat16  # no FP8 subclass
        assert torch.equal(value, getattr(model, name).dequantize())
    expected = train(model, optimizer, range(4, 8))
    expected_bytes = fp8_bytes(model)

    fresh, fresh_optim = fresh_run(seed=100)  # other values: the load must replace them
    ModelItem(fresh).load_state_dict(saved_model)
    set_optimizer_state_dict(fresh, fresh_optim, saved_optim)
    assert requantize_from_masters(fresh_optim) == 2
    assert train(fresh, fresh_optim, range(4, 8)) == expected
    assert all(torch.equal(fp8_bytes(fresh)[n], b) for n, b in expected_bytes.items())

    bf16 = nn.Module()  # the same checkpoint loads into bf16 parameters (--fp8_weights off)
    for name, value in saved_model.items():
        bf16.register_parameter(name, nn.Parameter(torch.zeros_like(value)))
    ModelItem(bf16).load_state_dict(saved_model)
    assert torch.equal(bf16.up, saved_model["up"])


def test_the_guard_and_the_export_see_values_and_masters(te_double, tmp_path) -> None:
    model, optimizer = fresh_run()
    train(model, optimizer, range(2))
    checkable = guards._checkable(model.up)
    assert type(checkable) is torch.Tensor and torch.equal(checkable, model.up.dequantize())
    masters = masters_by_name(model, optimizer)
    assert set(masters) == {"up", "down", "norm"}
    assert masters["up"] is optimizer.state[model.up]["master_param"]


def test_seeds_are_kept_only_when_asked_and_hf_weights_replace_them(tmp_path) -> None:
    """materialize keeps each bf16 parameter's fp32 init for the masters when asked; a model
    loaded from HF weights afterwards seeds its masters from those weights instead."""
    from model_utils import data
    from model_utils.config.presets import BUNDLED_TOKENIZER

    args = parse_args(["--preset", "tiny", "--master_weights", "optimizer"])
    model = modeling.build(args, "hf", torch.device("cpu"))
    modeling.materialize(model, torch.device("cpu"), seed=3, keep_master_seeds=True)
    name, param = "model.layers.0.mlp.up_proj.weight", model.model.layers[0].mlp.up_proj.weight
    init = modeling.initial_value(name, param.shape, 3, torch.device("cpu"))
    assert param.dtype == torch.bfloat16 and torch.equal(param._master_seed, init)
    optimizer = MasterWeightAdamW(model.parameters(), lr=1e-3)
    assert seed_masters(optimizer) == len(list(model.parameters()))
    assert torch.equal(optimizer.state[param]["master_param"], init)
    assert not torch.equal(param.float(), init)  # bf16 alone would have started rounded

    plain = modeling.build(args, "hf", torch.device("cpu"))
    modeling.materialize(plain, torch.device("cpu"), seed=3)  # --master_weights params
    assert not any(hasattr(p, "_master_seed") for p in plain.parameters())

    source = modeling.build(parse_args(["--preset", "tiny"]), "hf", torch.device("cpu"))
    modeling.materialize(source, torch.device("cpu"), seed=9)  # fp32 weights, another seed
    ck.export_hf(source, source.config, tmp_path / "hf", data.load_tokenizer(BUNDLED_TOKENIZER))
    loaded = modeling.build(args, "hf", torch.device("cpu"))
    modeling.materialize(loaded, torch.device("cpu"), seed=3, keep_master_seeds=True)
    ck.load_hf_weights(loaded, tmp_path / "hf")
    target = loaded.model.layers[0].mlp.up_proj.weight
    assert torch.equal(target._master_seed, source.model.layers[0].mlp.up_proj.weight)


def test_fp8_weights_train_only_with_masters_in_the_optimizer(te_double) -> None:
    from model_utils.precision import te as te_precision

    shape = ["--max_context_width", "64", "--train_batch_size", "2", "--val_batch_size", "2"]
    base = ["--preset", "tiny", "--model_impl", "te", "--fp8=1", "--fp8_weights", *shape]
    with pytest.raises(UsageError, match=re.escape("add --master_weights optimizer")):
        te_precision.check_requirements(parse_args(base))
    te_precision.check_requirements(parse_args([*base, "--master_weights", "optimizer"]))
    te_precision.check_requirements(parse_args(base), training=False)  # forward-only rows
