"""Make the two real H100 traces tests/unit/test_trace_device.py reads (run on a CUDA GPU):

    python tests/traces/make_h100_traces.py OUT_DIR    # h100_bf16/h100_fp8.pt.trace.json.gz

Small on purpose (about 16 KB each): a 4096-wide linear (a "decoder layer" GEMM), an annotated
``lm_head`` (4096 -> 32000) and its loss, cuDNN's SDPA, fused AdamW, under the step's ranges of
model_utils/model/annotate.py; the fp8 trace adds one ``torch._scaled_mm`` in E4M3, the cuBLAS FP8
GEMM TE's linears also run. Two recorded steps after one warm-up. Made on 2026-11-26 on one
H100 80GB HBM3, torch 2.11.0+cu130: cuBLAS ran nvjet_sm90_tst_* (bf16) and nvjet_sm90_qqtst_*
(FP8) GEMMs, cudnn_generated_fort_native_sdpa_sm90_flash_fprop_* attention.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function, schedule


def main(out: str) -> None:
    device, bf16, e4m3 = "cuda", torch.bfloat16, torch.float8_e4m3fn
    lin = torch.nn.Linear(4096, 4096, bias=False, device=device, dtype=bf16)
    head = torch.nn.Linear(4096, 32000, bias=False, device=device, dtype=bf16)
    opt = torch.optim.AdamW([*lin.parameters(), *head.parameters()], fused=True)
    w8 = torch.randn(4096, 4096, device=device).to(e4m3)
    one = torch.ones((), device=device)
    q = torch.randn(1, 32, 2048, 128, device=device, dtype=bf16)

    def step(fp8: bool) -> None:
        with record_function("data_wait"):
            x = torch.randn(8192, 4096, device=device, dtype=bf16)
        with record_function("forward"):
            if fp8:
                torch._scaled_mm(x.to(e4m3), w8.t(), scale_a=one, scale_b=one, out_dtype=bf16)
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
            y = lin(x)
            with record_function("lm_head"):
                loss = head(torch.relu(y)).float().square().mean()
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()
            opt.zero_grad()

    for fp8, name in ((False, "bf16"), (True, "fp8")):
        for _ in range(3):
            step(fp8)
        torch.cuda.synchronize()
        prof = profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
            schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
            record_shapes=True,
            on_trace_ready=lambda p, n=name: p.export_chrome_trace(
                f"{out}/h100_{n}.pt.trace.json.gz"
            ),
        )
        prof.start()
        for _ in range(4):
            step(fp8)
            prof.step()
        prof.stop()


if __name__ == "__main__":
    main(sys.argv[1])
