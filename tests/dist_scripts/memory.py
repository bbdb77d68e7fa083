"""How much host memory one rank gains from building, sharding and initialising a ~1.3 GB model.

    torchrun --nproc_per_node=2 tests/dist_scripts/memory.py OUT_DIR
    python tests/dist_scripts/memory.py OUT_DIR          # a world of one, for contrast

Each rank writes OUT_DIR/memory_w<N>_rank<r>.json with its resident set before `modeling.build`,
after `modeling.materialize` and its peak (VmHWM), next to the model's full fp32 size and the
bytes of this rank's shards. Meta-device init means the growth tracks the shard, not the model.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import common
import torch.distributed as dist

# The modelling code itself, loaded before the baseline (a build imports it on first use): the
# growth measured is the model's memory, not the library's.
import transformers.models.llama.modeling_llama  # noqa: F401

# ~335M parameters, 1.34 GB in fp32: large enough that a full copy per rank cannot hide.
LARGE_SHAPE = [
    "--hidden_width",
    "1024",
    "--num_layers",
    "16",
    "--num_heads",
    "16",
    "--num_key_value_heads",
    "16",
    "--intermediate_size",
    "4096",
    "--vocab_size",
    "32000",
    "--max_context_width",
    "256",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    cli = parser.parse_args()

    args = common.parse_product_args([*LARGE_SHAPE, "--output_dir", str(cli.out_dir)])
    world, device = common.start_world()
    gc.collect()
    dist.barrier()
    before = common.rss_bytes("VmRSS")
    start = time.perf_counter()
    model, _, _ = common.build_sharded(args, world, device)
    seconds = time.perf_counter() - start
    gc.collect()
    after = common.rss_bytes("VmRSS")
    peak = common.rss_bytes("VmHWM")
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    local_bytes = sum(
        p.to_local().numel() * p.to_local().element_size() for p in model.parameters()
    )
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    # Every parameter must be a real (non-meta) shard after materialize.
    on_meta = [n for n, p in model.named_parameters() if p.to_local().is_meta]
    dist.barrier()
    common.distributed.cleanup()
    record = {
        "world_size": world.world_size,
        "rank": world.rank,
        "rss_before": before,
        "rss_after": after,
        "peak": peak,
        "growth": after - before,
        "peak_growth": peak - before,
        "full_bytes": full_bytes,
        "local_bytes": local_bytes,
        "largest_param_bytes": largest,
        "on_meta": on_meta,
        "seconds": seconds,
    }
    path = cli.out_dir / f"memory_w{world.world_size}_rank{world.rank}.json"
    path.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
