"""Convert a training checkpoint (torch.distributed.checkpoint) to a Hugging Face directory.

    python -m scripts.convert_checkpoint runs/tiny-fp8/checkpoints/step_00000050 runs/tiny-hf
    python -m scripts.convert_checkpoint runs/tiny-fp8/checkpoints runs/tiny-hf   # newest intact
    python -m scripts.convert_checkpoint CKPT OUT --tokenizer PATH   # the run's tokenizer, moved

The output is the folder `--export_hf` writes: safetensors, config.json (the tokenizer's bos/eos/pad
ids, `architectures`, `use_cache`), generation_config.json and the run's tokenizer, so that
`AutoModelForCausalLM.from_pretrained` + `AutoTokenizer.from_pretrained` + `generate` (or
lm-eval-harness) need nothing else. The tokenizer is the one the checkpoint's run recorded
(`--tokenizer PATH` where that one is gone or offline); it must do what the run's did (the
fingerprint the run recorded), else the conversion is refused. One process,
no GPU and no process group: the checkpoint is read one decoder layer at a time, so memory stays
near one layer plus one output shard whatever the model size. Checkpoints written with FP8 on
(torchao Float8Linear) or off convert alike; `--model_impl te` checkpoints are mapped back to HF
names by te_llama.StateDictAdapter.

A checkpoint is verified as train.py verifies one before resuming: every file's size and sha256
against its checkpoint.json. A damaged checkpoint given by path is refused; given the checkpoints
folder, the newest intact one is converted (the damaged ones are named, and left where they are).
Refusals are one line and exit status 2, with nothing written; an export that fails part-way
(a full disk) removes what it wrote and exits 1.
"""

from __future__ import annotations

import argparse
import errno
import math
import runpy
import shutil
import sys
from pathlib import Path

if __name__ == "__main__":  # a Python without the environment: one line, exit 2
    runpy.run_path(str(Path(__file__).with_name("environment_check.py")))
# UsageError: input it will not convert
from model_utils.errors import OneLineParser, UsageError, refuse, said

DTYPES = ("float32", "bfloat16", "float16")
EXPORT_EXTRA_BYTES = 16 * 2**20  # config.json, generation_config.json, the tokenizer's files
PROG = "convert_checkpoint.py"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a step_N checkpoint dir, or a checkpoint_dir (newest one)")
    p.add_argument("out_dir", help="Hugging Face output directory")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of the weights")
    p.add_argument("--max_shard_size_mb", type=int, default=5120, help="safetensors shard size")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="the run's tokenizer (folder or hub name), where the one its checkpoint records is "
        "gone or offline; it must match the fingerprint the run recorded",
    )
    args = p.parse_args(argv)
    if args.max_shard_size_mb <= 0:
        p.error(f"--max_shard_size_mb must be > 0, got {args.max_shard_size_mb}")
    return args


def pick_checkpoint(path: str) -> tuple[Path, list[str]]:
    """(the checkpoint to convert, warning lines). A checkpoint given by path must be intact
    (one without checksums is converted with a warning: it was named); given a folder of
    checkpoints, the newest intact and verified one is taken, as train.py's
    `--resume_from_checkpoint auto` takes it, naming those it skipped. Refused (one line) if
    there is none. The verdict is train.py's (every file's checksum, in a world of one), so a
    checkpoint train.py refuses is never exported as a model either."""
    from model_utils.checkpoint import inspect_checkpoint
    from model_utils.checkpoint.manifest import INCOMPLETE, UNVERIFIED, step_dirs

    problem = inspect_checkpoint(path, checksums=True)
    if problem is None or problem.kind != INCOMPLETE:  # one checkpoint, named
        if problem is None:
            return Path(path), []
        if problem.kind == UNVERIFIED:
            return Path(path), [f"converting {path} unverified, as named: {problem}"]
        raise UsageError(
            f"checkpoint {path} is damaged: {problem}; restore it from a copy, or convert "
            "another checkpoint"
        )
    # incomplete ones too: a damaged newest step is named, not hidden; a run folder's own
    found = step_dirs(path) or step_dirs(Path(path) / "checkpoints")
    if not found:
        held = " (and it holds no complete step_N checkpoint)" if Path(path).is_dir() else ""
        raise UsageError(f"{problem}{held}")
    passed = []
    for candidate in reversed(found):
        why = inspect_checkpoint(candidate, checksums=True)
        if why is None:
            return candidate, [f"skipped the {line}" for line in passed]
        kind = "unverified" if why.kind == UNVERIFIED else "damaged"
        passed.append(f"{kind} checkpoint {candidate.name}: {why}")
    if all(line.startswith("damaged") for line in passed):
        newest = passed[0].removeprefix("damaged checkpoint ")
        raise UsageError(
            f"every checkpoint in {path} is damaged (newest {newest}): restore one from a copy"
        )
    raise UsageError(
        f"no checkpoint in {path} is intact and verified (newest: the {passed[0]}): restore one "
        "from a copy, or give an unverified one by path to convert it as it is"
    )


def check_out_dir(out_dir: Path) -> None:
    """Refuse an out_dir that holds a model or cannot be written before the checksums are read
    (minutes for a large checkpoint): a file in the way or a read-only folder by looking, and
    what looking cannot tell (a root-owned pseudo file system, quotas) by creating the folder
    and a probe file in it, then removing both as train.py's --export_hf check does."""
    from model_utils.checkpoint.hf import export_dir_problem
    from model_utils.run import outputs

    problem = (
        export_dir_problem("out_dir", out_dir)
        or outputs.location_problem("out_dir", out_dir)
        or outputs.probe_write("out_dir", out_dir)
    )
    if problem:
        raise UsageError(problem)


def export_bytes(path: Path, dtype: str) -> int:
    """What the export's weights take at `dtype`, from the checkpoint's DCP metadata (reads no
    tensor): every model tensor but TE's FP8 extra state. A tied embedding counts twice: a
    little over, never under."""
    import torch

    from model_utils.checkpoint.layout import MODEL_PREFIX, saved_tensors
    from model_utils.checkpoint.manifest import read_metadata

    metadata = read_metadata(path)
    saved = saved_tensors(metadata, MODEL_PREFIX).values()
    numel = sum(math.prod(entry.size) for _, entry in saved)
    return numel * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def check_space(path: Path, out_dir: Path, dtype: str) -> None:
    """Refuse (one line, nothing written) an out_dir whose file system has less free space than
    the weights (plus EXPORT_EXTRA_BYTES for config and tokenizer files): found before the
    export, not as the writer's traceback part-way through it."""
    from model_utils.run import outputs

    where = next(p for p in (out_dir, *out_dir.parents) if p.exists())
    need = export_bytes(path, dtype) + EXPORT_EXTRA_BYTES
    verdict, line = outputs.space_verdict(
        shutil.disk_usage(where).free, need, 1, f"Hugging Face export at {dtype}", out_dir
    )
    if verdict == "refuse":
        raise UsageError(line)


def os_problem(exc: OSError) -> str:
    """One line for a path the system refused to look at: the path (shortened) and the reason,
    with the limit for a name over 255 bytes (ENAMETOOLONG), which Path.exists() raises."""
    from model_utils.config.flag_rules import MAX_NAME_BYTES
    from model_utils.errors import os_error_words

    shown = str(exc.filename or "")
    if len(shown) > 100:
        shown = f"{shown[:50]}...{shown[-30:]}"
    line = f"{shown}: {os_error_words(exc)}"
    if exc.errno == errno.ENAMETOOLONG:
        line += f" (a file or folder name is at most {MAX_NAME_BYTES} bytes): give a shorter path"
    return line


def marker_config(path: Path, marker: dict) -> tuple[object, object | None]:
    """(the model config the run built, as its checkpoint's marker records it: the model's
    `config.to_dict()`, TrainState.model_config, the same object --export_hf writes; the TE ->
    HF mapping for --model_impl te checkpoints, None for HF-layout ones). Refused (one line)
    without a recorded config, or when te_llama cannot map it."""
    from transformers import AutoConfig

    model_config = dict(marker.get("model_config") or {})
    if not model_config:
        raise UsageError(f"checkpoint {path} records no model config: cannot write config.json")
    config = AutoConfig.for_model(model_config.pop("model_type", "llama"), **model_config)
    if (marker.get("run_config") or {}).get("model_impl", "hf") != "te":
        return config, None
    try:
        import te_llama

        return config, te_llama.StateDictAdapter(config).to_hf
    except (ImportError, AttributeError) as exc:
        problem = f"checkpoint uses --model_impl te but te_llama cannot map it: {exc}"
        raise UsageError(problem) from exc


def run_tokenizer(path: Path, marker: dict, given: str | None) -> object:
    """The run's tokenizer: `given` (--tokenizer), else the one the checkpoint's run recorded.
    Refused (one line) if none loads, or if it does not do what the run's did (the fingerprint
    train.py records; a checkpoint from before fingerprints is taken at its word), as another
    tokenizer would turn the model's ids into other text."""
    from model_utils import data

    run_config = marker.get("run_config") or {}
    name = given or run_config.get("tokenizer")
    if not name:
        raise UsageError(f"checkpoint {path} records no tokenizer: give the run's with --tokenizer")
    try:
        tokenizer = data.load_tokenizer(str(name))
    except ValueError as exc:
        if given:
            raise UsageError(str(exc)) from exc
        raise UsageError(
            f"checkpoint {path} records the tokenizer {name}, which cannot be used "
            f"({str(exc).removeprefix('--tokenizer ')}): "
            "give the run's tokenizer with --tokenizer PATH"
        ) from exc
    recorded, found = run_config.get("tokenizer_sha256"), data.tokenizer_fingerprint(tokenizer)
    if recorded and found != recorded:
        raise UsageError(
            f"tokenizer {name} is not the run's: its fingerprint {found} differs from the "
            f"{recorded} checkpoint {path} records (other ids for the same text); give the "
            "run's tokenizer with --tokenizer PATH"
        )
    return tokenizer


def export(
    path: Path,
    out_dir: Path,
    config: object,
    key_map: object,
    tokenizer: object,
    args: argparse.Namespace,
) -> list[Path]:
    """The checkpoint's model, one decoder layer at a time, into the folder --export_hf writes
    (its writer, files and key map are the export's own, model_utils/checkpoint/hf.py), with no
    process group and no model object; on any failure (a full disk, Ctrl-C) what it wrote is
    removed before the exception goes on."""
    import torch

    from model_utils.checkpoint import hf
    from model_utils.checkpoint.layout import iter_dcp_model_layers

    dtype = getattr(torch, args.dtype)
    snapshot = hf.export_snapshot(out_dir)
    try:
        writer = hf.SafetensorsShardWriter(out_dir, args.max_shard_size_mb * 2**20)
        hf.write_model_files(writer.staging, config, tokenizer, dtype)
        for layer in iter_dcp_model_layers(path):
            layer = {n: t.to(dtype) for n, t in layer.items()}
            for name, tensor in (key_map(layer) if key_map else layer).items():
                if not (config.tie_word_embeddings and name == hf.TIED_HEAD):
                    writer.add(name, tensor)
        return writer.finish()
    except BaseException:
        hf.undo_export(out_dir, snapshot)
        raise


def convert(args: argparse.Namespace) -> int:
    """Check everything that reads only, then export; the exit status."""
    out_dir = Path(args.out_dir)
    empty = [name for name in ("checkpoint", "out_dir") if not getattr(args, name).strip()]
    if empty:  # Path("") is the current directory
        return said(PROG, f"{empty[0]} is empty (an unset shell variable?): give a path")
    from model_utils.checkpoint.hf import export_dir_problem
    from model_utils.checkpoint.manifest import read_marker, write_error_reason

    try:
        check_out_dir(out_dir)
        path, skipped = pick_checkpoint(args.checkpoint)
        refuse(export_dir_problem("out_dir", out_dir, path.parent))  # pruning would delete it
        marker = read_marker(path)
        config, key_map = marker_config(path, marker)
        tokenizer = run_tokenizer(path, marker, args.tokenizer)
        check_space(path, out_dir, args.dtype)
    except UsageError as exc:
        return said(PROG, str(exc))
    except OSError as exc:  # a name over 255 bytes, a folder it may not list
        return said(PROG, os_problem(exc))
    for line in skipped:
        print(f"{PROG}: warning: {line}", file=sys.stderr)
    try:
        files = export(path, out_dir, config, key_map, tokenizer, args)
    except OSError as exc:
        reason = write_error_reason(exc, out_dir)
        return said(
            PROG,
            f"writing {out_dir} failed: {reason}; what was written is removed, and the weights "
            f"are still in the checkpoint {path}",
            1,
        )
    which = "" if path == Path(args.checkpoint) else f", newest intact in {path.parent}"
    print(f"{path} (step {marker['step']}{which}) -> {out_dir}: {len(files)} safetensors file(s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return convert(args)
    except KeyboardInterrupt:
        return said(PROG, "interrupted; nothing was exported (what was written is removed)", 130)


if __name__ == "__main__":
    sys.exit(main())
