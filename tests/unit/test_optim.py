"""Parameter groups, AdamW construction, clipping and the LR schedule (model_utils/optim.py), in
this process; under FSDP2 on 2 ranks: tests/integration/test_optim_processes.py."""

from __future__ import annotations

import io
import math
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers.inprocess import tiny_llama
from helpers.optimizers import group_names
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from model_utils.optim import (
    build_optimizer,
    build_scheduler,
    is_no_decay,
    lr_at,
    param_groups,
)

SCHEDULE = {"lr": 1e-3, "min_lr": 1e-4, "warmup": 10, "max_steps": 110}


# ------------------------------------------------------------------------------ LR schedule


@pytest.mark.parametrize(
    ("step", "cosine", "linear"),
    [
        (0, 0.0, 0.0),  # before training
        (1, 1e-4, 1e-4),  # first step: lr / warmup, not zero
        (5, 5e-4, 5e-4),  # half-way through warm-up
        (10, 1e-3, 1e-3),  # warm-up end: the peak lr
        # a quarter into the decay: cosine 1e-4 + 9e-4 * (1 + cos(pi/4)) / 2, linear 1e-3 - 9e-4/4
        (35, 1e-4 + 9e-4 * (1 + math.sqrt(0.5)) / 2, 7.75e-4),
        (60, 5.5e-4, 5.5e-4),  # mid-decay: both half-way between lr and min_lr
        (110, 1e-4, 1e-4),  # last step trains at min_lr
        (500, 1e-4, 1e-4),  # beyond max_steps: stays at min_lr
    ],
)
def test_lr_at_key_steps(step: int, cosine: float, linear: float) -> None:
    assert lr_at(step, style="cosine", **SCHEDULE) == pytest.approx(cosine, rel=1e-12, abs=1e-15)
    assert lr_at(step, style="linear", **SCHEDULE) == pytest.approx(linear, rel=1e-12, abs=1e-15)


def test_lr_constant_and_no_warmup() -> None:
    assert lr_at(5, style="constant", **SCHEDULE) == pytest.approx(5e-4)
    assert [lr_at(s, style="constant", **SCHEDULE) for s in (10, 60, 110, 999)] == [1e-3] * 4
    no_warmup = {**SCHEDULE, "warmup": 0, "max_steps": 100}
    assert lr_at(0, style="linear", **no_warmup) == 1e-3
    assert lr_at(50, style="linear", **no_warmup) == pytest.approx(5.5e-4)
    assert lr_at(100, style="cosine", **no_warmup) == pytest.approx(1e-4)


def test_lr_decay_is_monotonic() -> None:
    for style in ("cosine", "linear"):
        values = [lr_at(s, style=style, **SCHEDULE) for s in range(10, 111)]
        assert all(a >= b for a, b in zip(values, values[1:], strict=False))


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"style": "exponential"}, "lr decay style must be one of"),
        ({"min_lr": 2e-3}, r"min_lr must be in \[0, lr=0.001\], got 0.002"),
        ({"lr": 0.0}, "lr must be > 0, got 0.0"),
        ({"warmup": -1}, "warmup must be >= 0, got -1"),
        ({"max_steps": 0}, "max_steps must be >= 1, got 0"),
    ],
)
def test_lr_at_rejects_bad_settings(bad: dict, message: str) -> None:
    settings = {**SCHEDULE, "style": "cosine", **bad}
    with pytest.raises(ValueError, match=message):
        lr_at(3, **settings)


def test_scheduler_lr_of_batch_n_is_lr_at_n() -> None:
    """The lr in the optimizer while step N runs (what Batch N prints) is lr_at(N)."""
    model = tiny_llama()
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95)
    settings = {**SCHEDULE, "warmup": 3, "max_steps": 12, "style": "cosine"}
    scheduler = build_scheduler(optimizer, **settings)
    for step in range(1, 15):
        expected = lr_at(step, **settings)
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([expected] * 2)
        optimizer.step()  # no gradients yet: only the schedule matters here
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)


def test_scheduler_state_dict_round_trip() -> None:
    """A resumed scheduler continues the saved schedule; the state survives torch.load/pickle."""
    settings = {**SCHEDULE, "warmup": 4, "max_steps": 20, "style": "linear"}
    model = tiny_llama()
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95)
    scheduler = build_scheduler(optimizer, **settings)
    for _ in range(7):
        optimizer.step()
        scheduler.step()
    state = scheduler.state_dict()
    assert state["lr_lambdas"][0] == {
        "lr": 1e-3,
        "min_lr": 1e-4,
        "warmup": 4,
        "max_steps": 20,
        "style": "linear",
    }
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    restored_state = torch.load(buffer, weights_only=True)  # the safe loader must accept it
    assert pickle.loads(pickle.dumps(state)) == state

    # A fresh scheduler built with *different* settings adopts the checkpointed schedule.
    other = build_optimizer(tiny_llama(), lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95)
    resumed = build_scheduler(other, **{**settings, "max_steps": 50, "style": "cosine"})
    resumed.load_state_dict(restored_state)
    assert resumed.last_epoch == 7
    for _ in range(5):
        optimizer.step()
        scheduler.step()
        other.step()
        resumed.step()
        assert resumed.get_last_lr() == pytest.approx(scheduler.get_last_lr())
    assert resumed.get_last_lr()[0] == pytest.approx(lr_at(13, **settings))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_optimizer_and_scheduler_survive_dcp(tmp_path) -> None:
    """Groups (with their names and decay) and the schedule round-trip through DCP."""
    settings = {**SCHEDULE, "warmup": 2, "max_steps": 10, "style": "cosine"}
    model = tiny_llama()
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95)
    scheduler = build_scheduler(optimizer, **settings)
    batch = torch.randint(0, 256, (2, 16))
    for _ in range(3):
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    dcp.save(
        {"optim": get_optimizer_state_dict(model, optimizer), "sched": scheduler.state_dict()},
        checkpoint_id=tmp_path,
    )

    model2 = tiny_llama()
    optimizer2 = build_optimizer(model2, lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95)
    scheduler2 = build_scheduler(optimizer2, **settings)
    model2(input_ids=batch, labels=batch).loss.backward()  # materialise optimizer state
    optimizer2.step()
    state = {
        "optim": get_optimizer_state_dict(model2, optimizer2),
        "sched": scheduler2.state_dict(),
    }
    dcp.load(state, checkpoint_id=tmp_path)
    set_optimizer_state_dict(model2, optimizer2, state["optim"])
    scheduler2.load_state_dict(state["sched"])

    assert scheduler2.last_epoch == 3
    for g1, g2 in zip(optimizer.param_groups, optimizer2.param_groups, strict=True):
        assert g2["lr"] == pytest.approx(lr_at(4, **settings))
        assert g2["lr"] == pytest.approx(g1["lr"])
        assert (g2["weight_decay"], g2["param_names"]) == (g1["weight_decay"], g1["param_names"])
    p1 = dict(model.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    p2 = dict(model2.named_parameters())["model.layers.0.mlp.up_proj.weight"]
    torch.testing.assert_close(optimizer2.state[p2]["exp_avg"], optimizer.state[p1]["exp_avg"])


def test_build_scheduler_rejects_mismatched_lr() -> None:
    optimizer = build_optimizer(tiny_llama(), lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95)
    with pytest.raises(ValueError, match="differs from schedule lr"):
        build_scheduler(optimizer, **{**SCHEDULE, "lr": 2e-3, "min_lr": 0.0, "style": "cosine"})


# ---------------------------------------------------------------------------- weight decay


def test_param_groups_on_real_llama() -> None:
    model = tiny_llama()
    groups = param_groups(model, weight_decay=0.1)
    decay, no_decay = group_names(groups)
    all_names = [name for name, _ in model.named_parameters()]

    # every parameter exactly once
    listed = [n for g in groups for n in g["param_names"]]
    assert sorted(listed) == sorted(all_names) and len(listed) == len(set(listed))
    assert sum(len(g["params"]) for g in groups) == len(all_names)
    for g in groups:  # names and tensors line up
        params = dict(model.named_parameters())
        assert all(params[n] is p for n, p in zip(g["param_names"], g["params"], strict=True))

    norms = {n for n in all_names if "norm" in n}
    assert norms == {
        "model.norm.weight",
        *(
            f"model.layers.{i}.{k}.weight"
            for i in range(2)
            for k in ("input_layernorm", "post_attention_layernorm")
        ),
    }
    assert no_decay == norms
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert decay == {f"{n}.weight" for n in linears} | {"model.embed_tokens.weight"}
    assert "lm_head.weight" in decay


def test_param_groups_biases_and_tied_embeddings() -> None:
    model = tiny_llama(attention_bias=True, mlp_bias=True, tie_word_embeddings=True)
    groups = param_groups(model, weight_decay=0.05)
    decay, no_decay = group_names(groups)
    biases = {n for n, _ in model.named_parameters() if n.endswith(".bias")}
    assert len(biases) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert biases <= no_decay and not biases & decay
    # tied lm_head/embed_tokens: one tensor, listed once, decayed
    assert model.lm_head.weight is model.model.embed_tokens.weight
    all_params = [p for g in groups for p in g["params"]]
    assert sum(p is model.lm_head.weight for p in all_params) == 1
    assert "model.embed_tokens.weight" in decay


def test_param_groups_float8_linear_and_te_names() -> None:
    """torchao's Float8Linear keeps nn.Linear names; TE fused-norm names are recognised."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = tiny_llama()
    before = group_names(param_groups(model, 0.1))
    convert_to_float8_training(
        model,
        config=Float8LinearConfig(emulate=True),
        module_filter_fn=lambda _module, fqn: fqn != "lm_head",
    )
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "Float8Linear"
    assert group_names(param_groups(model, 0.1)) == before

    # Transformer Engine cannot be installed here; its parameter *names* are what matter.
    assert is_no_decay("self_attention.layernorm_qkv.layer_norm_weight", torch.empty(64))
    assert is_no_decay("layernorm_mlp.layer_norm_weight", torch.empty(1, 64))
    assert is_no_decay("layernorm_mlp.fc1_bias", torch.empty(1, 256))
    assert not is_no_decay("self_attention.layernorm_qkv.query_weight", torch.empty(64, 64))
    assert not is_no_decay("layernorm_mlp.fc2_weight", torch.empty(64, 128))


def test_build_optimizer_settings() -> None:
    model = tiny_llama()
    optimizer = build_optimizer(model, lr=3e-4, weight_decay=0.1, beta1=0.9, beta2=0.95)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.defaults["fused"] is True  # torch has a CPU fused AdamW
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert all(g["betas"] == (0.9, 0.95) and g["lr"] == 3e-4 for g in optimizer.param_groups)
    norm_before = model.model.norm.weight.detach().clone()
    # with zero gradients only weight decay moves parameters: norms must not move
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    embed_before = model.model.embed_tokens.weight.detach().clone()
    optimizer.step()
    torch.testing.assert_close(model.model.norm.weight.detach(), norm_before, rtol=0, atol=0)
    shrunk = model.model.embed_tokens.weight.detach()
    torch.testing.assert_close(shrunk, embed_before * (1 - 3e-4 * 0.1))
    with pytest.raises(ValueError, match=r"beta1 must be in \[0, 1\), got 1.0"):
        build_optimizer(model, lr=3e-4, weight_decay=0.1, beta1=1.0, beta2=0.95)
