"""BF16 in depth and in time: ``--bf16_layers`` keeps chosen decoder layers in BF16 while FP8 is
on, ``--bf16_cooldown`` turns FP8 off for the last steps. The refusals, torchao's conversion
through train.py's own build, each backend's cool-down; TE's layers (both implementations, on
the double): tests/unit/test_te_model.py; the cool-down's resume:
tests/integration/test_train.py."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.inprocess import SMALL, world_of_one

from model_utils.config.arguments import parse_args
from model_utils.errors import UsageError


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--fp8=0", "--bf16_layers", "0"), "--bf16_layers keeps layers out of FP8: it needs"),
        (("--fp8=1", "--bf16_layers", "0,2"), "'2' is not a layer of this 2-layer model"),
        (("--fp8=1", "--bf16_layers=-3"), "give indices from -2 to 1"),
        (("--fp8=1", "--bf16_layers", "first"), "'first' is not a layer"),
        (("--fp8=1", "--bf16_layers", "0,"), "'' is not a layer"),
        (  # every layer (-1 is 1) and a bf16 lm_head: a BF16 run recorded as FP8
            ("--fp8=1", "--bf16_layers", "0,-1,1"),
            "--bf16_layers 0,-1,1 keeps all 2 decoder layers (and the lm_head) in bf16: nothing "
            "would train in FP8; train with --fp8=0",
        ),
        (
            ("--fp8=1", "--model_impl", "te", "--fp8_weights", "--bf16_layers", "0"),
            "a layer kept in BF16 needs high-precision weights",
        ),
        (("--fp8=0", "--bf16_cooldown=0.1"), "--bf16_cooldown turns FP8 off for the last steps"),
        (("--fp8=1", "--bf16_cooldown=1"), "--bf16_cooldown must be in [0, 1), got 1.0"),
        (("--fp8=1", "--bf16_cooldown=-0.1"), "--bf16_cooldown must be in [0, 1)"),
        (
            ("--fp8=1", "--model_impl", "te", "--fp8_weights", "--bf16_cooldown=0.1"),
            "--bf16_cooldown with --fp8_weights: BF16 steps need high-precision weights: drop one",
        ),
        (
            ("--fp8=1", "--fp8_all_gather", "--bf16_cooldown=0.1"),
            "--bf16_cooldown with --fp8_all_gather: BF16 steps gather no float8",
        ),
        (  # its BF16 steps would begin after the run's one step: nothing cooled, nothing said
            ("--fp8=1", "--bf16_cooldown=0.5", "--max_steps=1", "--warmup=0"),
            "--bf16_cooldown needs --max_steps >= 2: FP8 steps, then BF16 ones",
        ),
    ],
    ids=[
        "no-fp8",
        "past-the-end",
        "before-the-start",
        "a-word",
        "empty-item",
        "every-layer",
        "fp8-weights",
        "cooldown-no-fp8",
        "cooldown-whole-run",
        "cooldown-negative",
        "cooldown-fp8-weights",
        "cooldown-all-gather",
        "cooldown-one-step",
    ],
)
def test_what_cannot_be_kept_is_refused_in_one_line(flags, message, te_double) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        parse_args([*SMALL, "--num_layers", "2", *flags])


def test_indices_count_from_either_end_once_each() -> None:
    from model_utils.config.fp8_plan import plan_of

    args = parse_args([*SMALL, "--num_layers", "4", "--fp8=1", "--bf16_layers=-1,0,3"])
    assert plan_of(args).kept_layers == (0, 3)
    assert plan_of(parse_args([*SMALL, "--num_layers", "4", "--fp8=0"])).kept_layers == ()


def test_torchao_keeps_the_chosen_layers_linears_in_high_precision() -> None:
    """train.py's build (FSDP2, world of one): layers 0 and -1 keep nn.Linear, the others are
    Float8Linear, and the start-up line says which layers and how many linears."""
    import train
    from model_utils.parallel import distributed
    from model_utils.precision import backends as precision

    world_of_one()
    device = torch.device("cpu")
    args = parse_args([*SMALL, "--num_layers", "3", "--fp8=1", "--bf16_layers", "0,-1"])
    mesh = distributed.build_mesh(distributed.world_from_env({}), device, "full")
    backend = precision.build_backend(args, device)
    model = train.build_model(args, mesh, device, backend)
    kinds = {
        i: {type(m).__name__ for m in layer.modules() if isinstance(m, torch.nn.Linear)}
        for i, layer in enumerate(model.model.layers)
    }
    assert kinds == {0: {"Linear"}, 1: {"Float8Linear"}, 2: {"Linear"}}
    assert "decoder layers 0, 2 (14 linears)" in backend.describe()
    assert len(backend.converted) == 7 and "lm_head" in backend.describe()


def test_the_cool_down_starts_at_a_step_of_the_schedule() -> None:
    """The last ``fraction`` of the steps, rounded, at least one and never the first."""
    from model_utils.config.fp8_plan import cooldown_from, plan_of

    assert [cooldown_from(100, f) for f in (0.0, 0.1, 0.25, 0.999)] == [None, 90, 75, 1]
    assert cooldown_from(10, 0.01) == 9 and cooldown_from(1, 0.5) == 1
    args = parse_args([*SMALL, "--fp8=1", "--max_steps=8", "--bf16_cooldown=0.25"])
    assert plan_of(args).cooldown_from == 6
    assert "BF16 from step 7" in built_backend(args)[0].describe()


def built_backend(args):
    """train.py's backend and model for ``args`` (FSDP2, a world of one), initialised from
    ``--seed`` as train.py does."""
    import train
    from model_utils.parallel import distributed
    from model_utils.precision import backends as precision

    world_of_one()
    device = torch.device("cpu")
    mesh = distributed.build_mesh(distributed.world_from_env({}), device, "full")
    backend = precision.build_backend(args, device)
    torch.manual_seed(args.run.seed)
    return backend, train.build_model(args, mesh, device, backend)


def loss_and_grad(model, ids) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    weight = model.model.layers[0].mlp.down_proj.weight.grad
    return loss.detach(), weight.full_tensor().clone()


@pytest.mark.parametrize("lm_head", [False, True], ids=["linears", "and-lm_head"])
def test_torchao_cooled_down_computes_what_the_model_without_fp8_computes(lm_head) -> None:
    """After cool_down the Float8Linear layers (and --fp8_lm_head's loss GEMMs) run in the
    compute dtype: loss and gradients are the no-FP8 model's, which they were not before."""
    ids = torch.randint(0, 8192, (2, 32), generator=torch.Generator().manual_seed(1))
    common = [*SMALL, "--bf16=0", "--chunked_loss=1"]
    fp8_flags = ["--fp8=1", "--bf16_cooldown=0.5", *(["--fp8_lm_head"] if lm_head else [])]
    backend, model = built_backend(parse_args([*common, *fp8_flags]))
    _, plain = built_backend(parse_args([*common, "--fp8=0"]))
    want_loss, want_grad = loss_and_grad(plain, ids)
    fp8_loss, fp8_grad = loss_and_grad(model, ids)
    assert not torch.allclose(fp8_grad, want_grad, rtol=1e-5, atol=0)
    backend.cool_down(model)
    loss, grad = loss_and_grad(model, ids)
    assert torch.allclose(loss, want_loss, rtol=1e-6, atol=0), (loss, want_loss, fp8_loss)
    assert torch.allclose(grad, want_grad, rtol=1e-5, atol=1e-9)
    assert model.lm_head.fp8_loss is False


def test_torchao_cooled_down_trains_under_autocast_without_fsdp2() -> None:
    """--sharding_strategy none keeps fp32 weights and computes in bf16 under torch.autocast:
    a cooled Float8Linear multiplies there as nn.Linear does (torchao's own backward with every
    cast disabled multiplied the bf16 gradient by the fp32 weight, and raised)."""
    from torch import nn

    from model_utils.precision import backends as precision

    args = parse_args([*SMALL, "--fp8=1", "--bf16_cooldown=0.5", "--sharding_strategy=none"])
    backend = precision.build_backend(args, torch.device("cpu"))
    model = backend.prepare(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)))
    assert backend.converted == ["0", "1"]
    backend.cool_down(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(16, 64))
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and model[0].weight.grad.dtype == torch.float32


def test_te_cooled_down_leaves_the_fp8_autocast(te_double) -> None:
    """TE's layers outside its autocast compute in the compute dtype: after cool_down the FP8
    model's loss is the same TE model's with FP8 off, and its recipe stays for the checkpoint."""
    from helpers.te_models import backend_args, batch, built, tiny_config

    from model_utils.precision.te import TEBackend

    config = tiny_config()
    ids = batch(config)
    losses = {}
    for fp8 in (True, False):
        backend = TEBackend(backend_args(fp8=fp8, recipe="current", bf16_cooldown=0.5))
        model = backend.prepare(built(config))
        with torch.no_grad(), backend.autocast():
            losses[fp8] = model(ids, labels=ids).loss
        if fp8:
            backend.cool_down(model)
            with torch.no_grad(), backend.autocast():
                losses["cooled"] = model(ids, labels=ids).loss
            assert backend.te_recipe is not None
    assert not torch.equal(losses[True], losses[False])
    assert torch.equal(losses["cooled"], losses[False])
