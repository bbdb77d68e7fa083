"""``--bf16_layers``: chosen decoder layers stay in BF16 while FP8 is on. The refusals, torchao's
conversion through train.py's own build; TE's (both implementations, on the double):
tests/unit/test_te_model.py."""

from __future__ import annotations

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
        (
            ("--fp8=1", "--model_impl", "te", "--fp8_weights", "--bf16_layers", "0"),
            "a layer kept in BF16 needs high-precision weights",
        ),
    ],
    ids=["no-fp8", "past-the-end", "before-the-start", "a-word", "empty-item", "fp8-weights"],
)
def test_what_cannot_be_kept_is_refused_in_one_line(flags, message, te_double) -> None:
    with pytest.raises(UsageError, match=message):
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
