"""Checkpoints for tests: real DCP checkpoints of a plain model or of a small Llama, nested
states compared path by path, and scripts/convert_checkpoint.py's refusal line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.procs import script_refusal
from helpers.runs import SMALL_LLAMA
from model_utils import checkpoint as ck
from scripts import convert_checkpoint

# The checkpoint tests' run (in this process and on ranks): SMALL_LLAMA with a 256-token
# vocabulary, which `logits` draws its batch from.
TINY = [
    *SMALL_LLAMA,
    *"--vocab_size 256 --train_batch_size 2 --max_steps 50 --warmup 2 --lr 0.01 --seed 7".split(),
]


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths where two nested states differ (tensors: exact values, dtype and shape)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}{{keys: {sorted(set(a) ^ set(b))}}}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}[len]"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, f"{path}[{i}]")
        ]  # noqa: E501
    return [] if a == b else [path]


def logits(model: torch.nn.Module) -> torch.Tensor:
    """The model's logits on one fixed batch (TINY's vocabulary)."""
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model(input_ids=ids).logits


def save_plain_checkpoints(root: Path, steps: list[int], keep_last: int = 0) -> ck.Checkpointer:
    """Real DCP checkpoints of a small model, one process, no process group."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    ckpt = ck.Checkpointer(root, keep_last=keep_last)
    for step in steps:
        with torch.no_grad():
            model[0].weight.add_(1.0)
        ckpt.save(step, ck.TrainState(model, config={"seed": 1}))
    return ckpt


def save_llama_checkpoints(
    root: Path, steps: tuple[int, ...], tokenizer: str | None = None
) -> list[Path]:
    """Real checkpoints (DCP files and a marker with every file's sha256, the run's tokenizer
    and its fingerprint, as train.py records them) of a small Llama whose weights differ from
    step to step."""
    from transformers import LlamaForCausalLM

    from model_utils import data
    from model_utils.config import arguments
    from model_utils.model import modeling

    args = arguments.parse_args(SMALL_LLAMA)
    tokenizer = tokenizer or args.data.tokenizer
    fingerprint = data.tokenizer_fingerprint(data.load_tokenizer(tokenizer))
    run_config = {"tokenizer": tokenizer, "tokenizer_sha256": fingerprint}
    model = LlamaForCausalLM(modeling.model_config(args.model))
    checkpointer = ck.Checkpointer(root)
    paths = []
    for step in steps:
        with torch.no_grad():
            model.model.embed_tokens.weight.fill_(float(step))
        paths.append(checkpointer.save(step, ck.TrainState(model, config=run_config)))
    return paths


def convert_refused(argv: list[str], capsys: pytest.CaptureFixture[str], status: int = 2) -> str:
    """scripts/convert_checkpoint.py's one refusal line for ``argv`` (exit ``status``)."""
    return script_refusal(convert_checkpoint.main, "convert_checkpoint.py", argv, capsys, status)
