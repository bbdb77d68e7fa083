"""The chunked lm_head + cross-entropy (model_utils/model/loss.py) against transformers' own
loss."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from model_utils.model import loss
from model_utils.precision import output_gemms

CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def models(dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    plain = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(dtype)
    chunked = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(dtype)
    chunked.load_state_dict(plain.state_dict())
    return plain, loss.use_chunked_loss(chunked)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 512, (3, 40), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = loss.IGNORE_INDEX  # ignored positions count nowhere
    return ids, labels


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"]
)
@pytest.mark.parametrize("chunk", [7, 64, None], ids=["chunk7", "chunk64", "default"])
def test_loss_and_gradients_equal_the_plain_path(dtype, tolerance, chunk, monkeypatch) -> None:
    if chunk is not None:  # 7 tokens: chunk boundaries inside rows and a ragged last chunk
        monkeypatch.setattr(loss, "chunk_tokens", lambda vocab, hidden: chunk)
    plain, chunked = models(dtype)
    ids, labels = batch()
    want = plain(input_ids=ids, labels=labels).loss
    got = chunked(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)
    (2.5 * want).backward()  # a scaled loss (e.g. / grad_accum_steps) scales the gradients
    (2.5 * got).backward()
    for (name, a), b in zip(plain.named_parameters(), chunked.parameters(), strict=True):
        scale = a.grad.abs().max().item()
        torch.testing.assert_close(
            b.grad,
            a.grad,
            rtol=tolerance,
            atol=tolerance * scale,
            msg=lambda m, n=name: f"{n}: {m}",
        )


def test_without_labels_it_returns_logits_and_no_grad_forms_no_gradients(monkeypatch) -> None:
    """Evaluation runs under no_grad: the loss must not pay for the two gradient GEMMs."""
    plain, chunked = models(torch.float32)
    ids, labels = batch()
    torch.testing.assert_close(chunked(input_ids=ids).logits, plain(input_ids=ids).logits)

    def gradient_path(*args):
        raise AssertionError("the gradient-forming path ran under torch.no_grad")

    monkeypatch.setattr(loss._LinearCrossEntropy, "apply", gradient_path)
    with torch.no_grad():
        got = chunked(input_ids=ids, labels=labels).loss
        want = plain(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(got, want)


def test_all_ignored_labels_give_zero_not_nan() -> None:
    _, chunked = models(torch.float32)
    ids, _ = batch()
    value = chunked(input_ids=ids, labels=torch.full_like(ids, loss.IGNORE_INDEX)).loss
    assert value.item() == 0.0
    value.backward()
    assert all(torch.isfinite(p.grad).all() for p in chunked.parameters() if p.grad is not None)


def test_under_autocast_the_loss_runs_its_gemms_in_autocasts_dtype() -> None:
    """Without FSDP2 (--sharding_strategy none) fp32 hidden states and weight arrive under
    torch.autocast: the loss and its gradients are those of bf16 operands, and the weight's
    gradient comes back in the weight's fp32."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 16, 32, requires_grad=True)
    weight = torch.randn(64, 32, requires_grad=True)
    labels = torch.randint(0, 64, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss.linear_cross_entropy(hidden, weight, labels, chunk=8)
    got.backward()
    bf16 = [t.detach().bfloat16().requires_grad_() for t in (hidden, weight)]
    want = loss.linear_cross_entropy(*bf16, labels, chunk=8)
    want.backward()
    assert torch.equal(got, want)
    assert weight.grad.dtype == torch.float32
    assert torch.equal(weight.grad, bf16[1].grad.float())
    assert torch.equal(hidden.grad, bf16[0].grad.float())


def test_train_py_trains_the_same_with_and_without_the_chunked_loss(tmp_path) -> None:
    """The flag through train.py's own model build (FSDP2, world of one): same losses."""
    from helpers.inprocess import SMALL, world_of_one

    import train
    from model_utils import optim
    from model_utils.config import arguments
    from model_utils.parallel import distributed
    from model_utils.precision import backends as precision

    world_of_one()
    device = torch.device("cpu")
    losses = {}
    for flag in ("1", "0"):
        args = arguments.parse_args(
            [*SMALL, "--model_impl=hf", "--bf16=0", f"--chunked_loss={flag}"]
        )
        mesh = distributed.build_mesh(distributed.world_from_env({}), device, "full")
        backend = precision.build_backend(args, device)
        model = train.build_model(args, mesh, device, backend)
        optimizer, _ = optim.from_config(model, args.optim, args.run.max_steps)
        ids, labels = batch()
        ids = ids % args.model.vocab_size
        run = []
        for _ in range(3):
            step_loss = model(input_ids=ids, labels=ids).loss
            step_loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            run.append(step_loss.item())
        losses[flag] = run
    assert losses["1"] == pytest.approx(losses["0"], rel=1e-5)
    assert losses["1"][-1] < losses["1"][0]


def test_chunks_are_large_enough_to_amortise_the_weight_gradient() -> None:
    """Llama 3 (hidden 4096, vocab 128256): 8,192-token chunks, not CHUNK_LOGITS's 523; the tiny
    model at a 64k vocabulary keeps the 1,024-token chunks measured in bench_loss_memory."""
    assert loss.chunk_tokens(128256, 4096) == 8192
    assert loss.chunk_tokens(65536, 256) == 1024
    assert loss.chunk_tokens(2**30, 0) == 1


def test_compiled_chunks_equal_the_eager_ones() -> None:
    """--compile fuses each chunk's softmax gradient (inductor, here on CPU): the same loss and
    gradients as the eager chunks, including a ragged last chunk and ignored labels."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 40, 64, generator=generator).bfloat16()
    weight = (torch.randn(512, 64, generator=generator) * 0.1).bfloat16()
    labels = torch.randint(0, 512, (2, 40), generator=generator)
    labels[1, :6] = loss.IGNORE_INDEX
    results = []
    for compiled in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        value = loss.linear_cross_entropy(h, w, labels, chunk=32, compiled=compiled)
        value.backward()
        results.append((value, h.grad, w.grad))
    (eager_loss, eager_h, eager_w), (fused_loss, fused_h, fused_w) = results
    torch.testing.assert_close(fused_loss, eager_loss, rtol=1e-5, atol=1e-5)
    # bf16 gradients: fp32 ulps apart before the cast, so equal or one bf16 ulp apart
    torch.testing.assert_close(fused_h, eager_h, rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(fused_w, eager_w, rtol=1e-2, atol=1e-4)
    assert fused_h.abs().sum() > 0 and fused_w.abs().sum() > 0


def test_compile_flag_reaches_the_loss() -> None:
    from model_utils.config.arguments import parse_args
    from model_utils.model import modeling

    for flag, want in (("--compile=0", False), ("--compile=1", True)):
        args = parse_args(["--model_impl=hf", flag, "--num_layers=1"])
        assert modeling.build(args, "hf", torch.device("cpu")).lm_head.compiled_loss is want


# ----------------------------------------------------------------------- --fp8_lm_head


def test_fp8_mm_rounds_through_the_format_and_undoes_the_scale() -> None:
    """Emulated (CPU): each operand cast to FP8 with its own scale, the product in fp32. Values
    the format holds exactly come back exactly; others within e4m3's (or e5m2's) rounding."""
    exact = torch.tensor([[1.0, -2.0], [0.5, 4.0]])  # powers of 2 under a power-of-2 scale
    eye = torch.eye(2)
    torch.testing.assert_close(output_gemms.fp8_mm(exact * 112, eye), exact * 112)  # amax 448
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 32, generator=generator), torch.randn(32, 48, generator=generator)
    for grad, step in ((False, 2**-3), (True, 2**-2)):  # e4m3: 3 mantissa bits, e5m2: 2
        got, want = output_gemms.fp8_mm(a, b, grad=grad), a @ b
        relative = (got - want).norm() / want.norm()
        assert 0 < relative < step, (grad, relative)


def test_an_all_zero_or_tiny_operand_stays_finite_in_fp8() -> None:
    """A chunk whose targets are all ignored multiplies its hidden states by zero: the scale of
    an all-zero operand is 1, and a tiny amax's scale stops at fp32's largest (no 0 x inf)."""
    ones = torch.ones(32, 32)
    for a in (torch.zeros(32, 32), torch.full((32, 32), 1e-39)):
        for grad in (False, True):
            assert torch.isfinite(output_gemms.fp8_mm(a, ones, grad=grad)).all(), (a[0, 0], grad)
    assert (output_gemms.fp8_mm(torch.zeros(32, 32), ones, grad=True) == 0).all()


def test_the_weight_is_cast_to_fp8_once_per_loss_call_and_the_gemms_are_unchanged(
    monkeypatch,
) -> None:
    """Fp8Gemms casts lm_head's weight once for every chunk and GEMM of a call (one amax, one
    scale: the same as a cast per GEMM, since the weight does not change within a step), and
    each of its GEMMs equals fp8_mm on the same operands."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(48, 32, generator=generator)
    hidden, d = torch.randn(64, 32, generator=generator), torch.randn(64, 48, generator=generator)
    gemms = output_gemms.Fp8Gemms(weight)
    torch.testing.assert_close(gemms.logits(hidden), output_gemms.fp8_mm(hidden, weight.t()))
    got = gemms.grad_hidden(d, out=torch.empty(64, 32))
    torch.testing.assert_close(got, output_gemms.fp8_mm(d, weight, grad=True))
    torch.testing.assert_close(
        gemms.grad_weight(d, hidden), output_gemms.fp8_mm(d.t(), hidden, grad=True)
    )

    casts = []
    real_cast = output_gemms._to_fp8
    monkeypatch.setattr(
        output_gemms, "_to_fp8", lambda x, dtype: casts.append(x.shape) or real_cast(x, dtype)
    )
    model = loss.use_chunked_loss(LlamaForCausalLM(LlamaConfig(**CONFIG)), fp8=True)
    ids, labels = batch()
    chunk_count = -(-labels.numel() // 16)
    monkeypatch.setattr(loss, "chunk_tokens", lambda vocab, hidden: 16)
    model(input_ids=ids, labels=labels).loss.backward()
    weight_shape = model.lm_head.weight.shape
    assert chunk_count > 1 and casts.count(weight_shape) == 1, casts
    assert len(casts) == 1 + 4 * chunk_count  # per chunk: hidden, d, d.T and hidden.T


@pytest.mark.parametrize("grad", [False, True], ids=["e4m3", "e5m2-gradient"])
def test_the_cuda_call_computes_what_the_emulation_does(grad: bool) -> None:
    """The FP8 GEMM call of the CUDA path (torch._scaled_mm, its layouts and inverse scales),
    run by torch's CPU kernel, equals the CPU emulation (fp32 out: up to summation order)."""
    generator = torch.Generator().manual_seed(1)
    a, b = torch.randn(32, 64, generator=generator), torch.randn(64, 48, generator=generator)
    qa, inv_a = output_gemms._to_fp8(a, torch.float8_e5m2 if grad else torch.float8_e4m3fn)
    qb_t, inv_b = output_gemms._to_fp8(b.t().contiguous(), torch.float8_e4m3fn)
    fused = output_gemms.scaled_mm(qa, qb_t, inv_a, inv_b, torch.float32)
    torch.testing.assert_close(fused, output_gemms.fp8_mm(a, b, grad=grad), rtol=1e-5, atol=1e-5)


def test_the_loss_with_fp8_gemms_stays_close_and_the_tied_weight_is_untouched() -> None:
    """--fp8_lm_head on a tied model: the loss and both gradients move by FP8's rounding only
    (not zero, under 2%), and the embedding still reads the very same high-precision weight."""
    config = LlamaConfig(**CONFIG, tie_word_embeddings=True)
    results = {}
    for fp8 in (False, True):
        torch.manual_seed(0)
        model = loss.use_chunked_loss(LlamaForCausalLM(config), fp8=fp8)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert model.lm_head.weight.dtype == torch.float32
        ids, labels = batch()
        value = model(input_ids=ids, labels=labels).loss
        value.backward()
        results[fp8] = (value.item(), model.lm_head.weight.grad.clone())
    (plain, plain_grad), (fp8_loss, fp8_grad) = results[False], results[True]
    assert plain != fp8_loss and abs(fp8_loss - plain) / plain < 0.02
    cosine = torch.nn.functional.cosine_similarity(plain_grad.flatten(), fp8_grad.flatten(), 0)
    assert cosine > 0.98


def test_the_fp8_lm_head_flag_reaches_the_loss_and_is_refused_where_it_cannot_run() -> None:
    from model_utils.config.arguments import parse_args
    from model_utils.errors import UsageError
    from model_utils.model import modeling

    args = parse_args(["--model_impl=hf", "--fp8=1", "--fp8_lm_head", "--num_layers=1"])
    assert modeling.build(args, "hf", torch.device("cpu")).lm_head.fp8_loss is True
    for flags, needs in (
        (["--fp8=0", "--chunked_loss=0"], "--fp8=1 and --chunked_loss=1"),
        (["--fp8=0"], "--fp8=1"),
        (["--fp8=1", "--chunked_loss=0"], "--chunked_loss=1"),
    ):
        with pytest.raises(UsageError, match=f"--fp8_lm_head .* it needs {needs}$"):
            parse_args(["--model_impl=hf", "--fp8_lm_head", *flags])
