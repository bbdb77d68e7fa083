"""The loss alone: transformers' full-logits cross-entropy against the chunked loss, one device.

    python -m benchmarks.bench_loss_kernel                   # CPU: 4,096 tokens, h 512, V 65536
    python -m benchmarks.bench_loss_kernel --device cuda     # Llama 3: seq 8192 x mb 2 tokens
    python -m benchmarks.bench_loss_kernel --device cuda --tokens 32768   # micro-batch 4

Each row times ``lm_head`` + cross-entropy forward and backward (``training``; ``--compile``: the
chunks' softmax gradient fused by torch.compile, the first call compiling in the warm-up) or
forward only under ``torch.no_grad`` (``evaluation``) on random bf16 hidden states and weights,
median of ``--repeat`` runs after one warm-up; on CUDA it also reports the peak memory the step
allocated beyond its inputs. The paths compute the same loss (tests/unit/test_loss.py); each
ratio is what the chunked loss costs or saves, measured in this one run. The last row is the
chunked loss's training step with its GEMMs in FP8 (``--fp8_lm_head``) against bf16: on CUDA the
output layer's FP8 speed-up (gpu_levers.sh ``loss``), on a CPU the emulation's cost.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks._common import COUNT, median_seconds
from model_utils.errors import OneLineParser
from model_utils.model import loss

#: Per device: (tokens, hidden, vocab). CUDA: Llama 3 8B at seq 8192, micro-batch 2.
DEFAULT_SHAPES = {"cpu": (4096, 512, 65536), "cuda": (16384, 4096, 128256)}


def hf_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss``: full bf16 logits, upcast, shifted cross-entropy."""
    logits = (hidden @ weight.t()).float()
    targets = loss.shift_labels(labels).reshape(-1)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, ignore_index=-100)


#: The chunked loss as train.py runs it; under ``--compile`` (each chunk's softmax gradient fused
#: by torch.compile); with ``--fp8_lm_head`` (its three GEMMs in FP8, the weight cast once a call).
chunked_loss = loss.linear_cross_entropy
compiled_chunked_loss = functools.partial(loss.linear_cross_entropy, compiled=True)
fp8_chunked_loss = functools.partial(loss.linear_cross_entropy, fp8=True)


def measure(
    fn: Callable, inputs: tuple[torch.Tensor, ...], training: bool, repeat: int
) -> tuple[float, float | None]:
    """Median seconds per call and (CUDA) peak GiB allocated beyond the inputs."""
    hidden, weight, labels = inputs
    cuda, base = hidden.device.type == "cuda", [0]

    def once() -> None:
        if training:
            h = hidden.detach().requires_grad_()
            w = weight.detach().requires_grad_()
            fn(h, w, labels).backward()
        else:
            with torch.no_grad():
                fn(hidden, weight, labels)

    def reset_peak() -> None:  # before each call: the peak is one call's
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base[0] = torch.cuda.memory_allocated()

    seconds = median_seconds(once, repeat, hidden.device, reset_peak)  # one warm-up call first
    peak = (torch.cuda.max_memory_allocated() - base[0]) / 2**30 if cuda else None
    return seconds, peak


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--tokens", type=COUNT, help="tokens per micro-batch (batch x seq)")
    parser.add_argument("--hidden", type=COUNT)
    parser.add_argument("--vocab", type=COUNT)
    parser.add_argument("--seq", type=COUNT, default=8192, help="sequence length (labels' rows)")
    parser.add_argument("--repeat", type=COUNT, default=5)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    given = (args.tokens, args.hidden, args.vocab)  # each one not given: the device's default
    default = DEFAULT_SHAPES[device.type]
    tokens, hidden_size, vocab = (a or b for a, b in zip(given, default, strict=True))
    seq = min(args.seq, tokens)
    if tokens % seq:
        parser.error(f"--tokens {tokens} must be a multiple of --seq {seq}")
    generator = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(tokens // seq, seq, hidden_size, generator=generator)
    weight = torch.randn(vocab, hidden_size, generator=generator) * hidden_size**-0.5
    labels = torch.randint(0, vocab, (tokens // seq, seq), generator=generator)
    inputs = (
        hidden.to(device, torch.bfloat16),
        weight.to(device, torch.bfloat16),
        labels.to(device),
    )
    print(
        f"{device.type}: {tokens} tokens, hidden {hidden_size}, vocab {vocab}, bf16, "
        f"chunks of {loss.chunk_tokens(vocab, hidden_size)} tokens, median of {args.repeat}"
    )
    rows = [
        ("training (fwd+bwd)", True, chunked_loss),
        ("training, --compile", True, compiled_chunked_loss),
        ("evaluation (no_grad)", False, chunked_loss),
    ]
    for label, training, chunked in rows:
        hf_s, hf_gib = measure(hf_loss, inputs, training, args.repeat)
        ch_s, ch_gib = measure(chunked, inputs, training, args.repeat)
        memory = f"   peak GiB {hf_gib:.2f} -> {ch_gib:.2f}" if hf_gib is not None else ""
        print(
            f"  {label:21s} HF {hf_s * 1e3:8.1f} ms   chunked {ch_s * 1e3:8.1f} ms   "
            f"speed chunked/HF {hf_s / ch_s:.2f}x{memory}"
        )
    bf16_s, _ = measure(chunked_loss, inputs, True, args.repeat)
    fp8_s, _ = measure(fp8_chunked_loss, inputs, True, args.repeat)
    print(  # on a CPU the FP8 GEMMs are emulated: the ratio is the emulation's cost, not FP8's
        f"  {'training, FP8 head':21s} chunked {bf16_s * 1e3:8.1f} ms   FP8 GEMMs "
        f"{fp8_s * 1e3:8.1f} ms   speed FP8/bf16 {bf16_s / fp8_s:.2f}x"
    )


if __name__ == "__main__":
    main()
