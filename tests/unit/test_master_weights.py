"""--master_weights optimizer: bf16 parameters with fp32 master copies in AdamW.

The optimizer must be torch's AdamW on the masters (same bits), keep updates that bf16 alone
would round away, keep TE FusedAdam's state layout, and save and resume exactly. The flags
around it refuse what cannot work, in one line.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from helpers.inprocess import tiny_llama
from helpers.optimizers import BETAS
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from model_utils.checkpoint.resume import config_changes
from model_utils.config.arguments import UsageError, parse_args
from model_utils.model import modeling
from model_utils.optim import ADAM_EPS, build_optimizer, param_groups
from model_utils.precision.master_weights import STATE_NAMES, MasterWeightAdamW, store_parameters_in
from model_utils.run import outputs


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
    return model(input_ids=ids, labels=ids).loss


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = loss_of(model, step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_on_fp32_parameters_it_is_torchs_adamw() -> None:
    """The arithmetic is torch's foreach AdamW, op for op: on fp32 parameters (master = param)
    ten real training steps give the same bits, decayed and undecayed groups alike."""
    ours, reference = tiny_llama(), tiny_llama()
    mine = MasterWeightAdamW(param_groups(ours, 0.1), lr=1e-3, betas=BETAS, eps=ADAM_EPS)
    torch_adamw = torch.optim.AdamW(
        param_groups(reference, 0.1), lr=1e-3, betas=BETAS, eps=ADAM_EPS, foreach=True
    )
    assert train(ours, mine, range(10)) == train(reference, torch_adamw, range(10))
    for (name, a), b in zip(ours.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), name
    start = tiny_llama()
    assert not torch.equal(ours.lm_head.weight, start.lm_head.weight)  # the steps moved it


def test_bf16_parameters_follow_the_fp32_trajectory_of_their_masters() -> None:
    """Given the same gradients, the masters of bf16 parameters move exactly as fp32 parameters
    under torch's AdamW, and each bf16 parameter is its master rounded."""
    reference = tiny_llama()
    ours = copy.deepcopy(reference)
    store_parameters_in(ours, torch.bfloat16)
    torch_adamw = torch.optim.AdamW(
        param_groups(reference, 0.1), lr=1e-3, betas=BETAS, eps=ADAM_EPS, foreach=True
    )
    mine = MasterWeightAdamW(param_groups(ours, 0.1), lr=1e-3, betas=BETAS, eps=ADAM_EPS)
    # Masters start from the bf16 parameters (as TE's FusedAdam does): start the reference there.
    with torch.no_grad():
        for a, b in zip(reference.parameters(), ours.parameters(), strict=True):
            a.copy_(b.float())
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        for a, b in zip(reference.parameters(), ours.parameters(), strict=True):
            grad = torch.randn(a.shape, generator=gen).to(torch.bfloat16)
            a.grad, b.grad = grad.float(), grad
        torch_adamw.step()
        mine.step()
    for (name, a), b in zip(reference.named_parameters(), ours.parameters(), strict=True):
        master = mine.state[b]["master_param"]
        assert b.dtype == torch.bfloat16 and master.dtype == torch.float32
        assert torch.equal(master, a), name
        assert torch.equal(b, a.to(torch.bfloat16)), name


def test_updates_smaller_than_a_bf16_step_are_kept_by_the_masters() -> None:
    """Why the masters exist: at lr 1e-5 each AdamW update (~lr) is far below half a bf16 step
    at 1.0 (2^-9). AdamW on the bf16 parameter itself rounds every update away; with masters
    the updates add up and, after 500 steps, move the bf16 parameter too."""
    plain = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    kept = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    optimizers = [
        torch.optim.AdamW([plain], lr=1e-5, weight_decay=0.0, foreach=True),
        MasterWeightAdamW([kept], lr=1e-5, weight_decay=0.0),
    ]
    for _ in range(500):
        plain.grad = torch.ones_like(plain)
        kept.grad = torch.ones_like(kept)
        for optimizer in optimizers:
            optimizer.step()
    assert torch.equal(plain, torch.ones_like(plain))  # every update lost
    master = optimizers[1].state[kept]["master_param"]
    assert master == pytest.approx(torch.full((4,), 1 - 500e-5), abs=5e-5)  # fp32 sums
    assert torch.all(kept < 1)  # the bf16 parameter moved one step down: 0.99609375
    assert torch.equal(kept, master.to(torch.bfloat16))


def test_state_is_te_fused_adams_and_resumes_exactly() -> None:
    """TE FusedAdam's layout (exp_avg, exp_avg_sq, master_param per parameter, fp32; one step
    per group), through torch's state-dict API as DCP uses it: a fresh model and optimizer
    loaded from it continue bit for bit, and the lr-0 step that initialises the empty state
    for loading moves nothing."""
    model = tiny_llama()
    store_parameters_in(model, torch.bfloat16)
    optimizer = MasterWeightAdamW(param_groups(model, 0.1), lr=1e-3, betas=BETAS)
    train(model, optimizer, range(3))
    for param in model.parameters():
        state = optimizer.state[param]
        assert set(state) == set(STATE_NAMES)
        assert {t.dtype for t in state.values()} == {torch.float32}
    assert [group["step"] for group in optimizer.param_groups] == [3, 3]

    saved_model = copy.deepcopy(model.state_dict())
    saved_optim = copy.deepcopy(get_optimizer_state_dict(model, optimizer))
    expected = train(model, optimizer, range(3, 6))

    fresh = tiny_llama(initializer_range=0.5)  # other weights, so the load must change them
    store_parameters_in(fresh, torch.bfloat16)
    fresh.load_state_dict(saved_model)
    fresh_optim = MasterWeightAdamW(param_groups(fresh, 0.1), lr=1e-3, betas=BETAS)
    set_optimizer_state_dict(fresh, fresh_optim, saved_optim)
    assert [group["step"] for group in fresh_optim.param_groups] == [3, 3]
    assert train(fresh, fresh_optim, range(3, 6)) == expected


def test_parameters_are_stored_in_bf16_and_buffers_keep_their_dtype() -> None:
    args = parse_args(["--preset", "tiny", "--master_weights", "optimizer"])
    model = modeling.build(args, "hf", torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in model.buffers()} == {torch.float32}  # RoPE's inverse frequencies
    default = modeling.build(parse_args(["--preset", "tiny"]), "hf", torch.device("cpu"))
    assert {p.dtype for p in default.parameters()} == {torch.float32}


def test_a_parameter_shared_by_two_modules_stays_shared() -> None:
    model = tiny_llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    store_parameters_in(model, torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_the_flag_chooses_the_optimizer() -> None:
    model = tiny_llama()
    assert type(build_optimizer(model, 1e-3, 0.1, *BETAS)) is torch.optim.AdamW
    chosen = build_optimizer(model, 1e-3, 0.1, *BETAS, master_weights="optimizer")
    assert type(chosen) is MasterWeightAdamW
    given = build_optimizer(
        model, 1e-3, 0.1, *BETAS, master_weights="optimizer", master_adam=torch.optim.Adam
    )
    assert type(given) is torch.optim.Adam  # the backend's fused one, when it has one
    with pytest.raises(ValueError, match="master_weights must be one of"):
        build_optimizer(model, 1e-3, 0.1, *BETAS, master_weights="gpu")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--master_weights", "optimizer", "--bf16=0"],
            "--master_weights optimizer stores the parameters in bf16, and --bf16=0 computes in "
            "fp32 (fp32 parameters are their own master weights): drop one of them",
        ),
        (
            ["--master_weights", "optimizer", "--optimizer", "adamw8bit"],
            "--master_weights optimizer keeps bf16 parameters with fp32 copies in AdamW, and "
            "torchao's adamw8bit keeps none (torchao/optim/adam.py rounds each update into them): "
            "it needs --optimizer adamw",
        ),
        (["--master_weights", "fp32"], "argument --master_weights: invalid choice: 'fp32'"),
    ],
)
def test_combinations_that_cannot_work_are_refused_in_one_line(argv, message) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        parse_args(argv)


def test_a_resume_keeps_where_the_master_weights_live() -> None:
    """The saved optimizer state holds masters or not: a resume with the other setting is
    refused like one with another --optimizer; a checkpoint from before the flag counts as
    ``params``."""
    saved = {"optimizer": "adamw", "master_weights": "params"}
    refused, _ = config_changes(saved, {**saved, "master_weights": "optimizer"})
    assert refused == [("--master_weights", "params", "optimizer")]
    refused, _ = config_changes({"optimizer": "adamw"}, {**saved, "master_weights": "optimizer"})
    assert refused == [("--master_weights", "params", "optimizer")]
    assert config_changes({"optimizer": "adamw"}, saved) == ([], [])


def test_the_disk_check_counts_the_masters() -> None:
    assert outputs.checkpoint_bytes(10) == 120  # fp32 weights + two fp32 moments
    assert outputs.checkpoint_bytes(10, "adamw", "optimizer") == 140  # bf16 + fp32 master
