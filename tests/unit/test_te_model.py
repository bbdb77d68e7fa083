"""The TE model and TE precision backend, run on CPU through the TE test double.

The double (tests/te_double) computes with the layout-tested reference and emulates FP8
numerics per recipe, so these tests exercise the product's real wiring: meta-device build,
deterministic shard-aware init, autocast with the amax reduction group, is_first_microbatch,
TE activation checkpointing, FP8 state in ``_extra_state``, and the capability messages.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from helpers.te_models import backend_args, batch, built, tiny_config
from te_double import uninstall
from transformers import LlamaForCausalLM

import te_llama
from model_utils.config import te_loader
from model_utils.config.options import FP8_RECIPE
from model_utils.config.sections import ModelShape
from model_utils.model import te_support
from model_utils.model.modeling import materialize
from model_utils.precision import te as te_precision
from model_utils.precision import te_requirements, te_state
from model_utils.precision.te import TEBackend
from model_utils.precision.te_requirements import TECapabilityError

RECIPES = ["delayed", "current", "block", "mxfp8"]


# ------------------------------------------------------------------------------------------
# Without TE.
# ------------------------------------------------------------------------------------------


def test_without_te_import_works_and_build_fails_clearly() -> None:
    uninstall()
    assert not te_loader.te_available()
    with pytest.raises(te_loader.TEUnavailableError, match="--model_impl hf"):
        te_llama.build_te_llama(tiny_config(), impl="te")
    with pytest.raises(TECapabilityError, match="Transformer Engine"):
        TEBackend(backend_args(fp8=True)).capability_check()


# ------------------------------------------------------------------------------------------
# Pure functions: capability, shapes, recipes, auto.
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "sm", "cuda", "te_version", "expected"),
    [
        ("delayed", (9, 0), "12.4", "2.20.2", None),
        ("delayed", (8, 0), "12.4", "2.20.2", "SM 8.9+ (Ada, Hopper or newer); this GPU is SM 8.0"),
        ("current", (9, 0), "12.4", "2.1.0", "needs Transformer Engine >= 2.2, found 2.1.0"),
        ("block", (9, 0), "12.4", "2.20.2", "CUDA >= 12.9; this PyTorch was built with CUDA 12.4"),
        ("block", (9, 0), "12.9", "2.20.2", None),
        ("block", (8, 9), "12.9", "2.20.2", "SM 9.0+ (Hopper)"),
        ("mxfp8", (9, 0), "12.9", "2.20.2", "SM 10.0+ (Blackwell); this GPU is SM 9.0"),
        ("mxfp8", (10, 0), "12.8", "2.20.2", None),
        ("delayed", None, None, "2.20.2", "no CUDA GPU is visible"),
        ("delayed", (9, 0), "12.4", None, "Transformer Engine >= 2.1, which is not installed"),
        ("bf16", (7, 0), "12.4", "2.20.2", "BF16 on Transformer Engine needs"),
    ],
)
def test_capability_problem_messages(recipe, sm, cuda, te_version, expected) -> None:
    problem = te_requirements.capability_problem(
        recipe, sm=sm, cuda_version=cuda, te_version=te_version
    )
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and expected in problem


def test_fp8_weights_needs_te_2_16() -> None:
    problem = te_requirements.capability_problem(
        "delayed", sm=(9, 0), cuda_version="12.4", te_version="2.15.0", fp8_weights=True
    )
    assert problem == "--fp8_weights needs Transformer Engine >= 2.16, found 2.15.0"


def test_fp8_backward_needs_te_2_15() -> None:
    """TE 2.15 added the recipes' backward_override; an older TE would refuse the keyword."""
    old = te_requirements.capability_problem(
        "current", sm=(9, 0), cuda_version="12.4", te_version="2.14.0", fp8_backward=True
    )
    assert old == (
        "--fp8_backward needs Transformer Engine >= 2.15 (the recipes' backward_override), "
        "found 2.14.0: drop it"
    )
    new = dict(sm=(9, 0), cuda_version="12.4", te_version="2.15.0", fp8_backward=True)
    assert te_requirements.capability_problem("current", **new) is None


def test_mlp_recompute_on_the_fused_layer_needs_te_2_11() -> None:
    """--ac_scope mlp sets LayerNormMLP.checkpoint, which TE 2.10 does not have; te_linear
    wraps HF's MLP and needs nothing from TE."""
    problem = te_requirements.capability_problem(
        "delayed", sm=(9, 0), cuda_version="12.4", te_version="2.10.0", mlp_recompute=True
    )
    assert problem == (
        "--ac_scope mlp with --model_impl te needs Transformer Engine >= 2.11 (LayerNormMLP's "
        "recompute), found 2.10.0: use --ac_scope layer"
    )
    assert (
        te_requirements.capability_problem(
            "delayed", sm=(9, 0), cuda_version="12.4", te_version="2.11.0", mlp_recompute=True
        )
        is None
    )
    ac_mlp = dict(activation_checkpointing=True, ac_scope="mlp")
    assert TEBackend(backend_args(True, **ac_mlp)).mlp_recompute
    assert not TEBackend(backend_args(True, impl="te_linear", **ac_mlp)).mlp_recompute
    assert not TEBackend(backend_args(True, activation_checkpointing=True)).mlp_recompute


def test_fp8_shape_problem() -> None:
    llama2 = ModelShape(
        hidden_width=4096,
        num_layers=32,
        num_heads=32,
        num_key_value_heads=32,
        intermediate_size=11008,
        vocab_size=32000,
        max_context_width=4096,
        rope_theta=10000.0,
    )
    assert te_requirements.fp8_shape_problem(llama2, 1) is None
    problem = te_requirements.fp8_shape_problem(replace(llama2, max_context_width=1000), 1)
    assert problem and "tokens per micro-batch" in problem and "1000" in problem
    assert "hidden_width" not in problem
    odd_ffn = te_requirements.fp8_shape_problem(
        replace(llama2, max_context_width=512, num_key_value_heads=8, intermediate_size=11000), 2
    )
    assert odd_ffn and "intermediate_size = 11000" in odd_ffn
    short = replace(llama2, max_context_width=48)
    mx = te_requirements.fp8_shape_problem(short, 1, recipe="mxfp8")
    assert mx and "multiples of 32" in mx


def test_build_recipe_maps_flags(te_double) -> None:
    from transformer_engine.common import recipe as te_recipe

    delayed = te_precision.build_recipe(
        "delayed",
        fp8_format="e4m3",
        amax_history_len=32,
        amax_compute_algo="most_recent",
        fp8_margin=1,
    )
    assert isinstance(delayed, te_recipe.DelayedScaling)
    assert (delayed.fp8_format, delayed.amax_history_len) == (te_recipe.Format.E4M3, 32)
    assert (delayed.amax_compute_algo, delayed.margin) == ("most_recent", 1)
    assert te_precision.build_recipe("current").fp8_format == te_recipe.Format.HYBRID
    assert isinstance(te_precision.build_recipe("block"), te_recipe.Float8BlockScaling)
    assert isinstance(te_precision.build_recipe("mxfp8"), te_recipe.MXFP8BlockScaling)
    with pytest.raises(ValueError, match="tensorwise"):
        te_precision.build_recipe("tensorwise")
    for recipe in ("current", "block", "mxfp8"):
        built_recipe = te_precision.build_recipe(recipe, fp8_backward="high_precision")
        assert built_recipe.backward_override == "high_precision"
        assert te_precision.build_recipe(recipe, fp8_backward="fp8").backward_override is None


def test_nvte_backward_override_in_the_environment_changes_no_recipe(monkeypatch, te_double):
    """TE's recipes default backward_override to NVTE_BACKWARD_OVERRIDE (read at import), which
    delayed scaling asserts is None: --fp8_backward fp8 gives None to every recipe explicitly."""
    from te_double import install

    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "high_precision")
    install()  # TE imported afresh, under the variable
    from transformer_engine.common import recipe as te_recipe

    assert te_recipe.Float8CurrentScaling().backward_override == "high_precision"
    for recipe in ("delayed", "current", "block", "mxfp8"):
        assert te_precision.build_recipe(recipe).backward_override is None
    built = te_precision.build_recipe("current", fp8_backward="dequantized")
    assert built.backward_override == "dequantized"


@pytest.mark.parametrize("override", ["high_precision", "dequantized"])
def test_fp8_backward_runs_the_backward_gemms_unquantized(override: str, te_double) -> None:
    """TE's backward_override: the incoming gradient is not cast to FP8, and the GEMMs read the
    forward's high-precision operands (high_precision) or its FP8 ones dequantized. The
    default backward (FP8 gradient) gives other gradients."""
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    layer = te.Linear(32, 32, bias=False, params_dtype=torch.float32)
    x = torch.randn(16, 32, requires_grad=True)
    grad_out = torch.randn(16, 32) * 1e-3

    def grads(fp8_backward: str) -> tuple[torch.Tensor, torch.Tensor]:
        layer.weight.grad = x.grad = None
        recipe = te_precision.build_recipe("current", fp8_backward=fp8_backward)
        with te.autocast(recipe=recipe):
            out = layer(x)
        out.backward(grad_out)
        return x.grad.clone(), layer.weight.grad.clone()

    grad_x, grad_w = grads(override)
    weight = layer.weight.detach()
    if override == "high_precision":
        assert torch.allclose(grad_x, grad_out @ weight)
        assert torch.allclose(grad_w, grad_out.t() @ x.detach())
    else:
        assert not torch.allclose(grad_x, grad_out @ weight, rtol=0, atol=1e-7)
    fp8_grad_x, fp8_grad_w = grads("fp8")
    assert not torch.equal(grad_x, fp8_grad_x) and not torch.equal(grad_w, fp8_grad_w)


# ------------------------------------------------------------------------------------------
# Building and initialising.
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["te", "te_linear"])
def test_meta_build_and_deterministic_init(impl: str, te_double) -> None:
    config = tiny_config()
    with torch.device("meta"):
        model = te_llama.build_te_llama(config, impl=impl)
    assert all(p.is_meta for p in model.parameters())
    materialize(model, torch.device("cpu"), 5)
    state = {k: v for k, v in model.state_dict().items() if not te_support.is_te_extra_state_key(k)}
    same = built(config, impl, seed=5).state_dict()
    other = built(config, impl, seed=6).state_dict()
    for name, tensor in state.items():
        assert torch.isfinite(tensor).all(), name
        assert torch.equal(tensor, same[name]), name
        if tensor.ndim == 1:  # norm weights
            assert torch.equal(tensor, torch.ones_like(tensor)), name
        else:
            assert not torch.equal(tensor, other[name]), name
            assert abs(tensor.std().item() - config.initializer_range) < 0.005, name
    expected_rope = te_support.llama_rope_inv_freq(config)
    assert torch.equal(model.model.rotary_emb.inv_freq, expected_rope)


def test_te_model_carries_its_adapter_for_hf_export_and_import(tmp_path, te_double) -> None:
    """--export_hf and --init_from_hf map the fused layout through ``model.state_dict_adapter``:
    the export is HF's layout exactly, and importing it into another te model restores every
    weight bit for bit. te_linear keeps HF's names and carries no adapter."""
    from model_utils import checkpoint, data
    from model_utils.config.presets import BUNDLED_TOKENIZER

    config = tiny_config()
    model = built(config, "te", seed=3)
    assert isinstance(model.state_dict_adapter, te_llama.StateDictAdapter)
    assert not hasattr(built(config, "te_linear"), "state_dict_adapter")
    checkpoint.export_hf(model, config, tmp_path / "hf", data.load_tokenizer(BUNDLED_TOKENIZER))
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert set(hf) == set(LlamaForCausalLM(config).state_dict())
    expected = te_llama.StateDictAdapter(config).to_hf(model.state_dict())
    assert all(torch.equal(hf[k], expected[k]) for k in hf)
    other = built(config, "te", seed=4)
    checkpoint.load_hf_weights(other, tmp_path / "hf")
    weights = {
        k: v for k, v in model.state_dict().items() if not te_support.is_te_extra_state_key(k)
    }
    loaded = other.state_dict()
    assert all(torch.equal(v, loaded[k]) for k, v in weights.items())


def test_te_linear_swaps_decoder_linears_only(te_double) -> None:
    import transformer_engine.pytorch as te

    config = tiny_config(intermediate_size=200)  # not a multiple of 16: the MLP stays nn.Linear
    hf = LlamaForCausalLM(config).eval()
    model = te_llama.build_te_llama(config, impl="te_linear").eval()
    assert isinstance(model.model.layers[0].self_attn.q_proj, te.Linear)
    assert type(model.model.layers[0].mlp.gate_proj) is torch.nn.Linear
    assert type(model.lm_head) is torch.nn.Linear
    mlps = [layer.mlp for layer in model.model.layers]
    assert all(type(m.down_proj) is type(m.up_proj) is torch.nn.Linear for m in mlps)
    missing, unexpected = model.load_state_dict(hf.state_dict(), strict=False)
    assert not unexpected and all(map(te_support.is_te_extra_state_key, missing))
    ids = batch(config)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_build_refuses_unsupported_configs(te_double) -> None:
    with pytest.raises(ValueError, match="attention_bias"):
        te_llama.build_te_llama(tiny_config(attention_bias=True), impl="te")
    scaled = tiny_config(rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type 'linear'"):
        te_llama.build_te_llama(scaled, impl="te")
    with pytest.raises(ValueError, match="impl"):
        te_llama.build_te_llama(tiny_config(), impl="hf")


# ------------------------------------------------------------------------------------------
# Training through the backend.
# ------------------------------------------------------------------------------------------


def train_losses(model, backend, config, steps: int) -> list[float]:
    """train.py's step (no clip, constant lr) on one batch; every parameter must get a gradient."""
    from model_utils.run.step import StepParts, train_step

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    no_grad: list[str] = []
    optimizer.register_step_pre_hook(
        lambda *_: no_grad.extend(n for n, p in model.named_parameters() if p.grad is None)
    )
    ids = batch(config, size=(2, 32))
    step_args = backend_args(False, grad_accum_steps=1, grad_clip=0.0, sharding_strategy="full")
    losses = []
    for _ in range(steps):
        parts = StepParts(model, optimizer, scheduler, backend, step_args, ids.device)
        done = train_step(parts, lambda: ({"input_ids": ids, "labels": ids}, 1.0))
        assert no_grad == []
        losses.append(done.loss.item())
    return losses


MATRIX = [("te", p) for p in ("bf16", *RECIPES)] + [("te_linear", "bf16"), ("te_linear", "current")]


@pytest.mark.parametrize(("impl", "precision"), MATRIX)
def test_forward_backward_every_precision(
    precision: str, impl: str, te_double, monkeypatch
) -> None:
    if precision == "mxfp8":
        monkeypatch.setenv("TE_DOUBLE_SM", "10.0")
    config = tiny_config()
    args = backend_args(
        fp8=precision != "bf16", recipe=precision if precision != "bf16" else "delayed", impl=impl
    )
    backend = TEBackend(args, torch_autocast_dtype=torch.bfloat16)
    backend.capability_check()
    model = backend.prepare(built(config, impl))
    losses = train_losses(model, backend, config, steps=3)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert impl in backend.describe() and ("FP8" in backend.describe()) == (precision != "bf16")
    if precision != "bf16":  # the line names the knobs the recipe reads, no others
        read = FP8_RECIPE[precision].knobs
        assert ("amax_history_len=" in backend.describe()) == ("amax_history_len" in read)


def test_delayed_scaling_updates_where_te_updates(te_double) -> None:
    """The double's delayed scaling follows TE's points (test_te_contract reads them in TE's
    source): a training forward's autocast exit updates the forward state only, the end of
    backward the backward state, and an autocast exit with grad disabled nothing: its amaxes
    wait in row 0. The backend's no-grad autocast (validation) puts even those back."""
    import transformer_engine.pytorch as te

    config = tiny_config()
    backend = TEBackend(backend_args(fp8=True, amax_history_len=4))
    model = backend.prepare(built(config))
    ids = batch(config)
    mlp = model.model.layers[0].transformer_layer.layernorm_mlp

    def history(direction: str) -> torch.Tensor:
        return mlp.fp8_meta[f"scaling_{direction}"].amax_history.clone()

    def filled_rows(direction: str) -> list[int]:
        return history(direction).abs().sum(1).nonzero().flatten().tolist()

    with backend.autocast():
        loss = model(ids, labels=ids).loss
    assert (filled_rows("fwd"), filled_rows("bwd")) == ([3], [])  # rolled once; bwd untouched
    scales = mlp.fp8_meta["scaling_fwd"].scale.clone()
    loss.backward()
    assert (filled_rows("fwd"), filled_rows("bwd")) == ([3], [3])
    with torch.no_grad(), te.autocast(recipe=backend.te_recipe):
        model(ids, labels=ids)
    assert filled_rows("fwd") == [0, 3] and torch.equal(mlp.fp8_meta["scaling_fwd"].scale, scales)
    kept = history("fwd")
    with torch.no_grad(), backend.autocast():
        model(batch(config, seed=1), labels=ids)
    assert torch.equal(history("fwd"), kept)


def test_fp8_changes_numerics_but_stays_close(te_double) -> None:
    config = tiny_config()
    ids = batch(config)
    losses = {}
    for name in ("bf16", "delayed", "current"):
        backend = TEBackend(
            backend_args(fp8=name != "bf16", recipe="delayed" if name == "bf16" else name)
        )
        model = backend.prepare(built(config))
        with torch.no_grad(), backend.autocast():
            losses[name] = model(ids, labels=ids).loss.item()
    for name in ("delayed", "current"):
        assert losses[name] != losses["bf16"]
        assert abs(losses[name] - losses["bf16"]) / losses["bf16"] < 0.02


def test_capability_check_through_double(te_double, monkeypatch) -> None:
    with pytest.raises(TECapabilityError, match="Blackwell.*10.0 or higher"):
        TEBackend(backend_args(fp8=True, recipe="mxfp8")).capability_check()
    monkeypatch.setenv("TE_DOUBLE_SM", "8.0")
    with pytest.raises(TECapabilityError, match="8.9"):
        TEBackend(backend_args(fp8=True, recipe="delayed")).capability_check()
    TEBackend(backend_args(fp8=False)).capability_check()  # BF16 needs no FP8 support


def test_backend_refuses_hf_model(te_double) -> None:
    from model_utils.config.arguments import UsageError, parse_args

    with pytest.raises(ValueError, match="--model_impl te or te_linear"):
        TEBackend(backend_args(fp8=True)).prepare(LlamaForCausalLM(tiny_config()))
    with pytest.raises(UsageError, match="--fp8_weights needs --fp8=1"):  # the flags' one check
        parse_args(["--model_impl", "te", "--fp8=0", "--fp8_weights"])


def test_pickled_extra_state_is_refused_like_te_2_20(te_double, monkeypatch) -> None:
    """TE >= 2.18 refuses pickled delayed-scaling ``_extra_state`` without the user's opt-in
    (the double applies the same policy); with it, the state restores the same numerics."""
    monkeypatch.delenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", raising=False)
    config = tiny_config()
    backend = TEBackend(backend_args(fp8=True, recipe="delayed"))
    model = backend.prepare(built(config))
    train_losses(model, backend, config, steps=2)
    state = model.state_dict()
    extra = [k for k in state if te_support.is_te_extra_state_key(k) and state[k].numel()]
    # qkv, proj, mlp and core attention (TE allocates its state under any FP8 autocast)
    assert len(extra) == 4 * config.num_hidden_layers
    clone = TEBackend(backend_args(fp8=True, recipe="delayed"))
    restored = clone.prepare(built(config, seed=9))
    with pytest.raises(RuntimeError, match="NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1"):
        restored.load_state_dict(state)
    monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")
    restored.load_state_dict(state)
    ids = batch(config, seed=4)
    with torch.no_grad(), backend.autocast():
        expected = model(ids).logits
    with torch.no_grad(), clone.autocast():
        got = restored(ids).logits
    assert torch.equal(got, expected)


def _flags(model) -> set:
    return {
        getattr(m, "is_first_microbatch", getattr(m, "te_is_first_microbatch", "missing"))
        for m in te_state.te_modules(model)
    }


@pytest.mark.parametrize("impl", ["te", "te_linear"])
def test_is_first_microbatch_reuses_fp8_weights(impl: str, te_double) -> None:
    """autocast(first_micro_batch=False) makes TE reuse the FP8 weights cast on micro-batch 0;
    an autocast entered without it (evaluation) clears the flags and re-casts."""
    config = tiny_config()
    backend = TEBackend(backend_args(fp8=True, recipe="current", impl=impl))
    model = backend.prepare(built(config, impl)).eval()
    ids = batch(config)
    with torch.no_grad():
        with backend.autocast(first_micro_batch=True):
            assert _flags(model) == {True}
            first = model(ids).logits
        assert _flags(model) == {True}  # kept for the activation recompute in backward
        for name, param in model.named_parameters():
            if "layers" in name and "norm" not in name:
                param.mul_(1.5)
        with backend.autocast(first_micro_batch=False):
            assert _flags(model) == {False}
            cached = model(ids).logits
        with backend.autocast():  # evaluation: no flags -> fresh FP8 weights
            assert _flags(model) == {None}
            fresh = model(ids).logits
    torch.testing.assert_close(cached, first)
    assert (fresh - first).abs().max() > 1e-2


@pytest.mark.parametrize("recipe", ["bf16", "delayed"])
def test_te_activation_checkpointing_keeps_gradients(recipe: str, te_double) -> None:
    """train.py's route (checkpoint_wrapper with TE's checkpoint as backend.checkpoint_fn)
    recomputes with TE's checkpoint and gives the gradients of no recompute."""
    from model_utils.parallel import distributed

    config = tiny_config()
    ids = batch(config)
    grads = []
    for route in ("none", "wrapper"):
        backend = TEBackend(backend_args(fp8=recipe != "bf16", recipe="delayed"))
        model = backend.prepare(built(config))
        if route == "wrapper":
            distributed.apply_activation_checkpointing(model, backend.checkpoint_fn)
        for micro in range(2):  # the second runs with updated delayed-scaling factors
            model.zero_grad()
            with backend.autocast(first_micro_batch=micro == 0):
                loss = model(ids, labels=ids).loss
            loss.backward()
        grads.append(
            {
                n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
                for n, p in model.named_parameters()
            }
        )
    for other in grads[1:]:
        for name, grad in grads[0].items():
            torch.testing.assert_close(other[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("recipe", ["bf16", "delayed"])
def test_te_mlp_recompute_keeps_gradients_and_fp8_state(recipe: str, te_double) -> None:
    """--ac_scope mlp on the fused layer turns on LayerNormMLP's own recompute (``checkpoint``)
    in the chosen layers only: the MLP keeps nothing but its input, and gradients, amax
    histories and scales come out as without recompute (the recompute replays the forward's
    scales and records no amax)."""
    from model_utils.parallel import distributed

    config = tiny_config(num_hidden_layers=4)
    ids = batch(config)
    results = []
    for scope in (None, "mlp"):
        backend = TEBackend(backend_args(fp8=recipe != "bf16", recipe="delayed"))
        model = backend.prepare(built(config))
        if scope:
            distributed.apply_activation_checkpointing(model, backend.checkpoint_fn, 2, scope)
        layers = distributed.decoder_layers(model)
        assert [layer.transformer_layer.layernorm_mlp.checkpoint for layer in layers] == (
            [False, True, False, True] if scope else [False] * 4
        )
        saved = [0]

        def pack(t: torch.Tensor, saved=saved) -> torch.Tensor:
            saved[0] += t.numel() * t.element_size()
            return t

        for micro in range(2):  # the second runs with updated delayed-scaling factors
            model.zero_grad()
            saved[0] = 0
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                with backend.autocast(first_micro_batch=micro == 0):
                    loss = model(ids, labels=ids).loss
            loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((saved[0], grads, te_state.fp8_scaling_state(model)))
    (plain_bytes, plain_grads, plain_state), (mlp_bytes, mlp_grads, mlp_state) = results
    assert mlp_bytes < plain_bytes
    for name, grad in plain_grads.items():
        torch.testing.assert_close(mlp_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert plain_state.keys() == mlp_state.keys() and (recipe == "bf16") == (not plain_state)
    for key, value in plain_state.items():
        assert torch.equal(mlp_state[key], value), key


@pytest.mark.parametrize("scope", ["layer", "mlp"])
def test_te_linear_activation_checkpointing_keeps_state_dict_names(scope: str, te_double) -> None:
    from model_utils.parallel import distributed

    config = tiny_config()
    model = built(config, "te_linear")
    keys = set(model.state_dict())
    checkpoint_fn = TEBackend(backend_args(False)).checkpoint_fn
    distributed.apply_activation_checkpointing(model, checkpoint_fn, scope=scope)
    assert set(model.state_dict()) == keys
    ids = batch(config)
    model(ids, labels=ids).loss.backward()
    wrapped = {"layer": "model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight"}
    name = wrapped.get(scope, "model.layers.0.mlp._checkpoint_wrapped_module.up_proj.weight")
    assert dict(model.named_parameters())[name].grad is not None


def test_fp8_weights_build(te_double) -> None:
    backend = TEBackend(backend_args(fp8=True, recipe="delayed", fp8_weights=True))
    config = tiny_config()
    model = built(config, fp8_weights=True, fp8_recipe=backend.te_recipe)
    backend.prepare(model)
    assert "weights FP8" in backend.describe()
    losses = train_losses(model, backend, config, steps=3)
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses


# A shape whose tokens per micro-batch and linear dims all meet TE's FP8 rules.
FP8_SHAPE = dict(
    train_batch_size=2,
    val_batch_size=2,
    max_context_width=256,
    hidden_width=128,
    intermediate_size=256,
    num_heads=4,
    num_key_value_heads=2,
)


def test_check_requirements_refuses_before_training(te_double) -> None:
    """train.py's pre-flight: one UsageError line for hardware/recipe and FP8 shape problems."""
    from model_utils.config.arguments import UsageError

    shape = FP8_SHAPE
    te_precision.check_requirements(backend_args(fp8=True, **shape))
    with pytest.raises(UsageError, match="Blackwell"):
        te_precision.check_requirements(backend_args(fp8=True, recipe="mxfp8", **shape))
    with pytest.raises(UsageError, match=r"tokens per micro-batch .* = 312 .*--val_batch_size 3"):
        te_precision.check_requirements(
            backend_args(fp8=True, **{**shape, "val_batch_size": 3, "max_context_width": 104})
        )
    te_precision.check_requirements(  # BF16 on TE has no FP8 shape rule
        backend_args(fp8=False, **{**shape, "max_context_width": 100})
    )


def test_fsdp2_models_get_no_micro_batch_weight_caching(te_double, tmp_path) -> None:
    """Under FSDP2 the weights are gathered anew each forward; TE ignores the flag there, so the
    backend leaves it None (unsharded models still get True/False)."""
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    backend = TEBackend(backend_args(fp8=True))
    plain = backend.prepare(built(tiny_config()))
    with backend.autocast(first_micro_batch=True):
        assert _flags(plain) == {True}
    with torch.device("meta"):
        sharded = te_llama.build_te_llama(tiny_config(), impl="te")
    for layer in sharded.model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    materialize(sharded, torch.device("cpu"), 0)
    backend.prepare(sharded)
    with backend.autocast(first_micro_batch=True):
        assert _flags(sharded) == {None}


def test_auto_impl_picks_te_only_with_te_and_an_fp8_gpu(te_double, monkeypatch) -> None:
    from model_utils.config import machine

    assert machine.resolve_model_impl("auto") == "hf"  # TE importable, but no GPU here
    monkeypatch.setattr(machine, "fp8_capable_gpu", lambda: True)
    assert machine.resolve_model_impl("auto") == "te"
    assert machine.resolve_model_impl("hf") == "hf"


def test_master_weights_in_the_optimizer_on_the_te_layout(te_double) -> None:
    """--master_weights optimizer on --model_impl te, built as train.py builds it (FSDP2, a
    world of one): TE's own reset_parameters keeps the bf16 dtype (TE materialises with
    ``empty_like``), the optimizer keeps an fp32 master per parameter and the model trains. On
    CPU the optimizer is ours: TE's FusedAdam is GPU-only, so the backend offers it on CUDA only.
    """
    from helpers.inprocess import build_tiny

    from model_utils import optim
    from model_utils.config.arguments import parse_args
    from model_utils.precision.master_weights import MasterWeightAdamW

    flags = ["--model_impl", "te", "--bf16=1", "--fp8=1", "--master_weights", "optimizer"]
    model = build_tiny(flags)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    backend = TEBackend(backend_args(fp8=True, master_weights="optimizer"))
    assert backend.master_weight_adam(torch.device("cpu")) is None
    assert "bf16 parameters, fp32 master weights in the optimizer" in backend.describe()
    args = parse_args(["--preset", "tiny", *flags])
    optimizer, _ = optim.from_config(
        model, args.optim, args.run.max_steps, backend.master_weight_adam(torch.device("cpu"))
    )
    assert type(optimizer) is MasterWeightAdamW
    ids = batch(model.config, size=(2, 32))
    losses = []
    for _ in range(4):
        with backend.autocast(first_micro_batch=True):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    masters = [optimizer.state[p]["master_param"] for p in model.parameters()]
    assert {m.dtype for m in masters} == {torch.float32} and len(masters) == len(
        list(model.parameters())
    )


def test_te_runs_offer_tes_fused_adam_with_fp32_masters_on_cuda(te_double) -> None:
    """On a CUDA device the TE backend hands optim TE's FusedAdam keeping fp32 master weights
    (its one fused kernel updates masters, moments and bf16 parameters); built on a machine
    without CUDA, FusedAdam fails as TE's does, which is why the CPU path never builds it."""
    import transformer_engine.pytorch as te

    backend = TEBackend(backend_args(fp8=True, master_weights="optimizer"))
    fused = backend.master_weight_adam(torch.device("cuda"))
    assert fused.func is te.optimizers.FusedAdam
    assert fused.keywords == {"master_weights": True, "master_weight_dtype": torch.float32}
    with pytest.raises((RuntimeError, AssertionError), match="CUDA|cuda"):
        fused([torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))], lr=1e-3)


# ------------------------------------------------------------------------------------------
# --bf16_layers: chosen decoder layers in high precision while FP8 is on.
# ------------------------------------------------------------------------------------------


def test_a_kept_layer_builds_no_recipe_while_torch_compile_traces(te_double, monkeypatch) -> None:
    """TE's nested autocast given no recipe builds TE's default one, which TE (and the double)
    refuse while torch.compile traces: under --compile the frame of a layer kept in BF16 ran
    uncompiled. It gets the run's recipe, so it compiles like the others."""
    import transformer_engine.pytorch as te

    config = tiny_config()
    args = backend_args(fp8=True, recipe="current", impl="te", bf16_layers="0", num_layers=2)
    recipe = TEBackend(args).te_recipe
    kept = built(config, "te", bf16_layers=(0,), fp8_recipe=recipe).model.layers[0]
    hidden, positions = torch.randn(1, 16, config.hidden_size), torch.arange(16)[None]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # as while dynamo traces
    with pytest.raises(AssertionError, match="inside compiled regions"):
        te_llama.fp8_disabled().__enter__()
    with torch.no_grad(), te.autocast(enabled=True, recipe=recipe):
        assert kept(hidden, position_ids=positions).shape == hidden.shape


@pytest.mark.parametrize("impl", ["te", "te_linear"])
def test_bf16_layers_compute_without_fp8_and_the_others_with_it(impl: str, te_double) -> None:
    """Layer 0 kept in BF16 (te: TE's nested autocast(enabled=False) around the layer;
    te_linear: its linears stay nn.Linear): it records no FP8 state and its output equals
    the same weights without FP8, while layer 1 still runs FP8 and trains."""
    import transformer_engine.pytorch as te

    config = tiny_config()
    args = backend_args(fp8=True, recipe="current", impl=impl, bf16_layers="0", num_layers=2)
    backend = TEBackend(args)
    model = backend.prepare(built(config, impl, bf16_layers=(0,)))
    plain = built(config, impl)  # same seed, same weights, every layer FP8
    ids = batch(config)

    def layer_out(m, fp8: bool) -> torch.Tensor:
        out = []  # a copy: the next layer adds to the residual stream in place
        hook = m.model.layers[0].register_forward_hook(lambda mod, a, o: out.append(o.clone()))
        with torch.no_grad(), te.autocast(enabled=fp8, recipe=backend.te_recipe):
            m(ids)
        hook.remove()
        return out[0]

    torch.testing.assert_close(layer_out(model, True), layer_out(plain, False))
    assert not torch.equal(layer_out(plain, True), layer_out(plain, False))
    with backend.autocast():
        loss = model(ids, labels=ids).loss
    loss.backward()
    kept, fp8 = model.model.layers[0], model.model.layers[1]

    def ran_fp8(layer) -> list[bool]:  # TE initialises a module's FP8 metadata in its FP8 forward
        return [m.fp8_initialized for m in layer.modules() if hasattr(m, "fp8_initialized")]

    assert ran_fp8(fp8) and all(ran_fp8(fp8))
    assert not any(ran_fp8(kept))
    if impl == "te_linear":
        assert type(kept.self_attn.q_proj) is torch.nn.Linear
        assert isinstance(fp8.self_attn.q_proj, te.Linear)
    assert "decoder layer 0 in BF16" in backend.describe()
