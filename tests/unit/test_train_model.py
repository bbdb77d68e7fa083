"""The model train.py builds, in this process: activation checkpointing (all layers, every other
layer, the MLPs only) saves memory and computes the same, --compile wraps each decoder layer,
and the FSDP2 units are torchtitan's. train.py's runs end to end are
tests/integration/test_train.py."""

from __future__ import annotations

import torch
from helpers.inprocess import build_tiny


def _layer_activation_bytes_and_grads(
    model, part=lambda layer: layer
) -> tuple[int, float, list[torch.Tensor]]:
    """Bytes autograd keeps for backward while inside the decoder layers (or the ``part`` of
    each layer given: metrics.kept_activation_bytes, the AC benchmark's measure too), plus loss and
    grads."""
    from model_utils.report.metrics.device import kept_activation_bytes

    torch.manual_seed(0)
    batch = torch.randint(0, 8192, (4, 128))
    kept, loss = kept_activation_bytes(model, batch, part)
    loss.backward()
    grads = [p.grad.full_tensor().clone() for p in model.parameters()]
    return kept, loss.item(), grads


def test_activation_checkpointing_saves_less_and_computes_the_same():
    plain_bytes, plain_loss, plain_grads = _layer_activation_bytes_and_grads(build_tiny([]))
    ac_bytes, ac_loss, ac_grads = _layer_activation_bytes_and_grads(
        build_tiny(["--activation_checkpointing"])
    )
    assert ac_loss == plain_loss
    assert all(torch.equal(a, b) for a, b in zip(ac_grads, plain_grads, strict=True))
    # Without AC each layer keeps its intermediate activations; with AC it keeps none of them,
    # only its input for the recompute.
    assert plain_bytes > 10_000_000 and ac_bytes < 0.1 * plain_bytes, (ac_bytes, plain_bytes)


def test_activation_checkpointing_every_other_layer_saves_half_and_computes_the_same():
    from model_utils.parallel.distributed import checkpointed_layers

    assert checkpointed_layers(4, 1) == [0, 1, 2, 3]
    assert checkpointed_layers(4, 2) == [1, 3] and checkpointed_layers(3, 2) == [0, 2]
    assert checkpointed_layers(4, 8) == [3]
    plain_bytes, plain_loss, plain_grads = _layer_activation_bytes_and_grads(build_tiny([]))
    half_bytes, half_loss, half_grads = _layer_activation_bytes_and_grads(
        build_tiny(["--activation_checkpointing", "--ac_every=2"])
    )
    assert half_loss == plain_loss
    assert all(torch.equal(a, b) for a, b in zip(half_grads, plain_grads, strict=True))
    # The tiny model has an even number of layers: half of them keep their activations.
    assert 0.4 < half_bytes / plain_bytes < 0.6, (half_bytes, plain_bytes)


def test_activation_checkpointing_of_the_mlps_only_saves_most_and_computes_the_same():
    """--ac_scope mlp: each layer keeps its attention activations and recomputes its MLP."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from model_utils.parallel.distributed import decoder_layers

    plain_bytes, plain_loss, plain_grads = _layer_activation_bytes_and_grads(build_tiny([]))
    in_mlps = _layer_activation_bytes_and_grads(build_tiny([]), lambda layer: layer.mlp)[0]
    model = build_tiny(["--activation_checkpointing", "--ac_scope=mlp"])
    layers = decoder_layers(model)
    assert all(isinstance(layer.mlp, CheckpointWrapper) for layer in layers)
    assert not any(isinstance(layer, CheckpointWrapper) for layer in layers)
    mlp_bytes, mlp_loss, mlp_grads = _layer_activation_bytes_and_grads(model)
    assert mlp_loss == plain_loss
    assert all(torch.equal(a, b) for a, b in zip(mlp_grads, plain_grads, strict=True))
    # Each layer keeps what it kept before, less what its MLP kept, plus the MLP's input for the
    # recompute: a [batch, seq, hidden] tensor per layer, as full recompute keeps per layer.
    full_bytes = _layer_activation_bytes_and_grads(build_tiny(["--activation_checkpointing"]))[0]
    assert in_mlps > 0.3 * plain_bytes, (in_mlps, plain_bytes)
    assert mlp_bytes == plain_bytes - in_mlps + full_bytes, (plain_bytes, in_mlps, mlp_bytes)


def test_compile_flag_compiles_each_decoder_layer_of_the_model_train_builds(monkeypatch):
    """--compile reaches the model: torch.compile wraps each decoder layer, and nothing without
    the flag. (Compiled training, cold compile included, against eager: test_distributed's
    test_compile_under_two_ranks_trains_like_eager, on the same train.build_model.)"""
    from model_utils.parallel.distributed import decoder_layers

    compiled = []
    real_compile = torch.compile

    def spy(fn, *args, **kwargs):
        compiled.append(getattr(fn, "__self__", fn))
        return real_compile(fn, *args, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    assert build_tiny([]) is not None and compiled == []
    model = build_tiny(["--compile"])
    layers = decoder_layers(model)
    assert layers and [id(m) for m in compiled] == [id(m) for m in layers]


def test_fsdp_units_are_torchtitans():
    """Embedding, each layer, [final norm, lm_head], and a root that holds no parameters."""
    from torch.distributed.fsdp import fully_shard

    model = build_tiny([])
    inner = model.model
    state = fully_shard.state
    assert state(inner.norm) is state(model.lm_head)
    units = [inner.embed_tokens, *inner.layers, model.lm_head]
    assert len({id(state(m)) for m in units}) == len(units)  # one unit each
    root_groups = state(model)._fsdp_param_groups
    assert sum(len(g.fsdp_params) for g in root_groups) == 0  # rotary buffers only
    # Chunked loss runs inside lm_head's forward, so its unit's hooks fire: the loss is right.
    ids = torch.randint(0, 8192, (2, 64), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert model.lm_head.weight.grad is not None and torch.isfinite(loss)


def _unshards_per_pass(model, monkeypatch) -> tuple[int, int, float]:
    """Parameter groups FSDP2 really gathers (and casts fp32 -> bf16) in forward and in
    backward of one step, and the loss."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    group = _fsdp_param_group.FSDPParamGroup
    real_unshard, count = group.unshard, [0]

    def counting(self, *args, **kwargs):
        if not self.is_unsharded and self._all_gather_result is None:
            count[0] += 1
        return real_unshard(self, *args, **kwargs)

    monkeypatch.setattr(group, "unshard", counting)
    ids = torch.randint(0, 8192, (2, 64), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    forward = count[0]
    loss.backward()
    return forward, count[0] - forward, loss.item()


def test_reshard_after_forward_policies(monkeypatch):
    """default (torchtitan): backward gathers again every unit but the last layer and [norm,
    lm_head]; never: backward gathers nothing again; always: every unit. Same loss."""
    from model_utils.parallel import distributed

    tiny_layers = 4
    results = {}
    for policy in ("default", "never", "always"):
        model = build_tiny([f"--reshard_after_forward={policy}"])
        flags = [reshard for _, reshard in distributed.fsdp_units(model, policy)]
        results[policy] = (flags, *_unshards_per_pass(model, monkeypatch))
        monkeypatch.undo()
    units = tiny_layers + 2  # embedding, layers, [norm, lm_head]
    assert results["default"][0] == [True] * tiny_layers + [False, False]
    assert results["never"][0] == [False] * units and results["always"][0] == [True] * units
    assert [r[1] for r in results.values()] == [units] * 3  # forward gathers every unit once
    assert results["default"][2] == tiny_layers  # embedding + the first 3 layers, again
    assert results["never"][2] == 0
    assert results["always"][2] == units
    assert results["never"][3] == results["default"][3] == results["always"][3]
