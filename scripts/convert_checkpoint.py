"""Convert a training checkpoint (torch.distributed.checkpoint) to a Hugging Face directory.

    python scripts/convert_checkpoint.py runs/tiny-fp8/checkpoints/step_00000050 runs/tiny-hf
    python scripts/convert_checkpoint.py runs/tiny-fp8/checkpoints runs/tiny-hf   # newest one

The output (safetensors + config.json) loads with `LlamaForCausalLM.from_pretrained`. One process,
no GPU and no process group: the checkpoint is read one decoder layer at a time, so memory stays
near one layer plus one output shard whatever the model size. Checkpoints written with FP8 on
(torchao Float8Linear) or off convert alike; `--model_impl te` checkpoints are mapped back to HF
names by te_llama.StateDictAdapter.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DTYPES = ("float32", "bfloat16", "float16")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a step_N checkpoint dir, or a checkpoint_dir (newest one)")
    p.add_argument("out_dir", help="Hugging Face output directory")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of the weights")
    p.add_argument("--max_shard_size_mb", type=int, default=5120, help="safetensors shard size")
    args = p.parse_args(argv)
    if args.max_shard_size_mb <= 0:
        p.error(f"--max_shard_size_mb must be > 0, got {args.max_shard_size_mb}")
    return args


def pick_checkpoint(path: str) -> tuple[Path | None, str | None]:
    """(checkpoint, None) or (None, why not): a complete checkpoint, or the newest one in a dir."""
    from model_utils.checkpoint import checkpoint_problem, latest_checkpoint

    problem = checkpoint_problem(path)
    if problem is None:
        return Path(path), None
    newest = latest_checkpoint(path)
    if newest is not None:
        return newest, None
    return None, f"{problem} (and it holds no complete step_N checkpoint)"


def key_map_for(marker: dict) -> tuple[object | None, str | None]:
    """TE -> HF mapping for --model_impl te checkpoints; (None, None) for HF-layout ones."""
    impl = (marker.get("run_config") or {}).get("model_impl", "hf")
    if impl != "te":
        return None, None
    try:
        from transformers import AutoConfig

        import te_llama

        cfg = dict(marker["model_config"])
        config = AutoConfig.for_model(cfg.pop("model_type", "llama"), **cfg)
        return te_llama.StateDictAdapter(config).to_hf, None
    except (ImportError, AttributeError) as exc:
        return None, f"checkpoint uses --model_impl te but te_llama cannot map it: {exc}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        return _fail(f"{out_dir} exists and is not a directory")
    from model_utils.checkpoint.hf_export import export_dir_problem

    problem = export_dir_problem("out_dir", out_dir)
    if problem:
        return _fail(problem)
    path, problem = pick_checkpoint(args.checkpoint)
    if path is None:
        return _fail(problem or "no checkpoint")
    import torch

    from model_utils.checkpoint import dcp_to_hf, read_marker

    marker = read_marker(path)
    if not marker.get("model_config"):
        return _fail(f"checkpoint {path} records no model config: cannot write config.json")
    key_map, problem = key_map_for(marker)
    if problem:
        return _fail(problem)
    files = dcp_to_hf(
        path,
        out_dir,
        key_map=key_map,
        dtype=getattr(torch, args.dtype),
        max_shard_bytes=args.max_shard_size_mb * 2**20,
    )
    print(f"{path} (step {marker['step']}) -> {out_dir}: {len(files)} safetensors file(s)")
    return 0


def _fail(message: str) -> int:
    print(f"convert_checkpoint.py: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
