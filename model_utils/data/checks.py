"""Start-up checks of the user's data, before the model is built: a hub name that answers, and
local files that are non-empty, decode and parse. A bad file is named with its line, in one
line, instead of surfacing as a library traceback minutes into the run.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

from model_utils.data.sources import DataError, local_files, not_text_message
from model_utils.errors import UsageError, first_line, first_words

# What the start-up check reads of local data: enough to find a bad file at once, not a whole
# corpus (a bad byte further in is met mid-run and named then).
SCAN_BYTES_PER_FILE = 8 * 2**20
SCAN_BYTES_TOTAL = 64 * 2**20
HUB_TIMEOUT_S = 10.0  # one look-up of a hub name (dataset, tokenizer) before anything starts


def check_hub_dataset(dataset: str, timeout: float = HUB_TIMEOUT_S) -> None:
    """One quick look-up of a name that is not a local path, before anything starts: a typo'd
    local name (`corpus` for `corpus.jsonl`) or a machine without network otherwise spends half
    a minute in the datasets library's retries, after the model is built. Streaming a hub
    dataset needs the network anyway, so an offline setting is refused too."""
    if Path(dataset).expanduser().exists():
        return
    check_hub_repo(
        dataset,
        "dataset",
        f"--dataset {dataset}: no local file or folder of that name",
        "give a local file with its extension (.jsonl, .txt, .parquet) or folder",
        error=DataError,
        timeout=timeout,
    )


#: Per kind of hub repository: the HfApi call that asks about it; the switches that turn hub
#: look-ups off for the library that would load it (huggingface_hub's own, then that
#: library's: transformers', datasets'); and what to do when one is on (a tokenizer, once
#: downloaded, is read from the cache; a hub dataset is streamed from the hub all run long).
_HUB_KINDS = {
    "model": (
        "model_info",
        ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"),
        "download it where there is network",
    ),
    "dataset": (
        "dataset_info",
        ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"),
        "run where there is network, without {switch} (a hub dataset is streamed from the hub)",
    ),
}


def check_hub_repo(
    name: str,
    kind: Literal["model", "dataset"],
    subject: str,
    hint: str,
    *,
    error: type[Exception] = UsageError,
    timeout: float = HUB_TIMEOUT_S,
) -> None:
    """One look-up of hub repository `name` of `kind`, within `timeout` seconds, where the
    loading library (transformers, datasets) would retry each file for half a minute to a
    minute and print dozens of lines before its own error. If the hub cannot give it, `error`
    in one line: `subject` (the flag, the name, and where it was not found locally), why (hub
    look-ups switched off, and by which variable; no such repository; the hub, named by its
    address, did not answer), then `hint` (the local way) and the fix for that reason."""
    method, switches, offline_fix = _HUB_KINDS[kind]
    switch = next((s for s in switches if env_true(s)), None)
    if switch is not None:
        reason, fix = f"hub look-ups are off ({switch}=1)", offline_fix.format(switch=switch)
    else:
        from huggingface_hub import HfApi, constants
        from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError

        try:
            getattr(HfApi(), method)(name, timeout=timeout)
            return
        except HFValidationError as exc:  # asked of no server: the name itself
            reason, fix = f"it is no hub name ({first_words(exc)})", "correct the name"
        except RepositoryNotFoundError:
            reason = (
                f"no such {kind} on the Hugging Face hub (or it is private or gated: set HF_TOKEN)"
            )
            fix = "correct the hub name"
        except Exception as exc:  # no network, DNS, proxy, timeout, server error
            reason = (
                f"the Hugging Face hub ({constants.ENDPOINT}) did not answer within "
                f"{timeout:g} s ({first_line(exc)})"
            )
            fix = "check the network"
    raise error(f"{subject}, and {reason}: {hint}, or {fix}")


def env_true(name: str) -> bool:
    """Whether switch `name` is on, as huggingface_hub reads one, but read now rather than at
    import: a switch set after start-up (a test, a wrapper) is heard too."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def check_local_data(dataset: str, text_column: str) -> None:
    """Before the model is built: every local data file is non-empty and readable, and the first
    SCAN_BYTES_PER_FILE of each (SCAN_BYTES_TOTAL in all) decode as UTF-8, parse (JSON lines),
    and hold `text_column`. DataError names the file, and the line or what is missing."""
    path = Path(dataset).expanduser()
    if not path.exists():
        return
    builder, train, validation = local_files(path)
    budget = SCAN_BYTES_TOTAL
    for name in train + validation:
        file = Path(name)
        if file.stat().st_size == 0:
            raise DataError(f"--dataset: {file} is empty: remove it or fill it")
        budget -= _scan_file(file, builder, text_column, min(SCAN_BYTES_PER_FILE, budget))
        if budget <= 0:
            break


def find_bad_file(dataset: str, text_column: str) -> str | None:
    """The one-line problem of the first local data file that fails the start-up checks read
    in full (what a rank met mid-run, beyond the start-up scan), or None (hub data, or no file
    shows it)."""
    path = Path(dataset).expanduser()
    if not path.exists():
        return None
    builder, train, validation = local_files(path)
    for name in train + validation:
        try:
            _scan_file(Path(name), builder, text_column, limit=None)
        except DataError as exc:
            return str(exc)
    return None


def _check_parquet(file: Path, text_column: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(file).metadata
    except Exception as exc:
        raise DataError(
            f"--dataset: {file} is not a readable parquet file ({first_line(exc)}): replace or "
            "remove it"
        ) from None
    schema = meta.schema.to_arrow_schema()
    if text_column not in schema.names:
        raise DataError(
            f"--dataset: {file} has no column {text_column!r} (columns: "
            f"{', '.join(schema.names)}): pass --text_column"
        )
    kind = schema.field(text_column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(
            f"--dataset: {file} column {text_column!r} is of type {kind}, not text (string): "
            "pass the --text_column that holds the documents, or convert the column"
        )
    if meta.num_rows == 0:
        raise DataError(f"--dataset: {file} has no rows: remove it or fill it")


#: Compressions outside the standard library: the module (the one the datasets library needs
#: for them too) and how it opens a file. Without it the run failed at its first read.
_PACKAGED_COMPRESSIONS = {".zst": "zstandard", ".lz4": "lz4"}


def _open_binary(file: Path) -> Any:
    """`file` opened for reading its decompressed bytes; DataError when its compression needs a
    package that is not installed."""
    import bz2
    import gzip
    import importlib
    import lzma

    openers = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
    suffix = file.suffix.lower()
    package = _PACKAGED_COMPRESSIONS.get(suffix)
    if package is None:
        return openers.get(suffix, open)(file, "rb")
    try:
        module = importlib.import_module("lz4.frame" if package == "lz4" else package)
    except ImportError:
        raise DataError(
            f"--dataset: {file} is {suffix[1:]}-compressed, which needs the {package} package: "
            f"pip install {package} (in the image too), or decompress the file"
        ) from None
    return module.open(file, "rb")


def _scan_file(file: Path, builder: str, column: str, limit: int | None) -> int:
    """Read `file` line by line (up to about `limit` decompressed bytes; None: all of it): each
    line must be UTF-8 and, in JSON lines, a JSON object; the first record must hold `column`.
    DataError names the file and line. Returns the bytes read (0 for parquet: its metadata is
    checked, `_check_parquet`)."""
    if builder == "parquet":
        _check_parquet(file, column)
        return 0
    handle = _open_binary(file)
    read, has_text, json_lines, seen_column, cut = 0, False, None, False, False
    column_text = False  # some record's column holds a non-empty document
    try:
        with handle:
            for number, raw in enumerate(handle, start=1):
                if limit is not None and read + len(raw) > limit:
                    cut = True  # the scan ends here; a line cut by it is not judged
                    break
                read += len(raw)
                line = _decode_line(file, number, raw)
                if not line.strip():
                    continue
                has_text = True
                if builder != "json":
                    continue
                if json_lines is None:  # a .json file may be one JSON document instead
                    json_lines = ".jsonl" in [x.lower() for x in file.suffixes] or _is_object(line)
                if json_lines:
                    record = _check_record(file, number, line, column, not seen_column)
                    seen_column = True
                    column_text = column_text or bool(record.get(column))
    except (OSError, EOFError, ValueError) as exc:
        if isinstance(exc, DataError):
            raise
        raise DataError(
            f"--dataset: {file} cannot be read or decompressed ({first_line(exc)}): replace or "
            "remove it"
        ) from None
    if not has_text and not cut:
        raise DataError(f"--dataset: {file} holds no text: remove it or fill it")
    if json_lines is False and not cut:  # one document: the data library wants a list of records
        records = _json_document(file)
        if not (isinstance(records, list) and records and isinstance(records[0], dict)):
            raise DataError(
                f"--dataset: {file} is one JSON document, not records: give JSON lines (an "
                "object per line) or a list of objects"
            )
        json_lines, column_text = True, any(isinstance(r, dict) and r.get(column) for r in records)
    if json_lines and not column_text and not cut:
        raise DataError(
            f"--dataset: {file} has no text in column {column!r} (every record's is null or "
            "empty): pass the --text_column that holds the documents, or remove the file"
        )
    return read


def _decode_line(file: Path, number: int, raw: bytes) -> str:
    """Line `number` as text, or DataError naming the first byte that is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"--dataset: {file} line {number} is not UTF-8 text (byte "
            f"0x{raw[exc.start]:02x}): convert the file to UTF-8, or remove it"
        ) from None


def _check_record(file: Path, number: int, line: str, column: str, first: bool) -> dict[str, Any]:
    """JSON line `number` as an object, or DataError: not JSON, not an object, the `column`
    missing from the `first` record (a wrong flag; later records may lack it: empty documents)
    or holding something other than text or null."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(
            f"--dataset: {file} line {number} is not JSON ({exc.msg}): fix or remove the line"
        ) from None
    if not isinstance(record, dict):
        raise DataError(f"--dataset: {file} line {number} is not a JSON object")
    if first and column not in record:
        raise DataError(
            f"--dataset: {file} line {number} has no column {column!r} (columns: "
            f"{', '.join(record)}): pass --text_column"
        )
    value = record.get(column)
    if value is not None and not isinstance(value, str):
        raise DataError(not_text_message(f"--dataset: {file} line {number}", column, value))
    return record


def _json_document(file: Path) -> Any:
    """The whole file as one JSON value (None: not JSON)."""
    with _open_binary(file) as handle, contextlib.suppress(ValueError):
        return json.loads(handle.read())
    return None


def _is_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


# --------------------------------------------------------------------------------------------
# What a checkpoint's data position points into: a resume on other data would read other text
# from the saved position without a sign. Size and a sum of each file's ends, not the whole
# file: cheap on a corpus of a thousand files on network storage, and it names the file; not
# the modification time, which a fresh copy (node-local staging, a new mount) changes.

FINGERPRINT_BYTES = 64 * 2**10  # read from each end of each file, and per sampled block
FINGERPRINT_SAMPLES = 16  # blocks evenly spaced between the ends (docs/data.md: cost, reach)


def data_fingerprint(dataset: str, whole: bool = False) -> dict[str, str] | None:
    """{file, relative to --dataset's folder: "<bytes>:<ends>:<samples>[:<all>]"} for every
    local file the run reads (training and validation); None for a hub dataset. <ends>: sha256
    of the first and last 64 KiB; <samples>: of FINGERPRINT_SAMPLES blocks of 64 KiB spread
    evenly between them, so a same-size edit in the middle shows where it touches one; <all>
    (``whole``, --verify_data full): of every byte, so any edit shows."""
    path = Path(dataset).expanduser()
    if not path.exists():
        return None
    _, train, validation = local_files(path)
    base = path if path.is_dir() else path.parent
    return {
        str(Path(f).relative_to(base)): file_fingerprint(Path(f), whole=whole)
        for f in sorted(train + validation)
    }


def file_fingerprint(file: Path, samples: int = FINGERPRINT_SAMPLES, whole: bool = False) -> str:
    """One file's "<bytes>:<ends>:<samples>[:<all>]" (data_fingerprint)."""
    size = file.stat().st_size
    ends, middle = hashlib.sha256(), hashlib.sha256()
    with open(file, "rb") as fh:
        ends.update(fh.read(FINGERPRINT_BYTES))
        fh.seek(max(0, size - FINGERPRINT_BYTES))
        ends.update(fh.read(FINGERPRINT_BYTES))
        for i in range(1, samples + 1):
            fh.seek(max(0, size - FINGERPRINT_BYTES) * i // (samples + 1))
            middle.update(fh.read(FINGERPRINT_BYTES))
        fh.seek(0)
        every = hashlib.file_digest(fh, "sha256").hexdigest()[:16] if whole else None
    found = f"{size}:{ends.hexdigest()[:16]}:{middle.hexdigest()[:16]}"
    return f"{found}:{every}" if every else found


#: What a comparison of two fingerprints covered, by how many of their parts both have.
CHECK_WORDS = {
    2: "size and ends",
    3: f"size, ends and {FINGERPRINT_SAMPLES} sampled blocks",
    4: "every byte",
}


def data_check(saved: dict[str, str] | None, now: dict[str, str] | None) -> str:
    """Which check a resume's data comparison ran, in words for its log line."""
    if not isinstance(now, dict):
        return "none (a hub dataset is not fingerprinted)"
    if not isinstance(saved, dict) or not saved:
        return "none (the checkpoint recorded no fingerprint)"
    both = [(str(saved[f]), str(now[f])) for f in set(saved) & set(now)]
    parts = min((min(a.count(":"), b.count(":")) + 1 for a, b in both), default=3)
    words = f"{CHECK_WORDS[parts]} of {len(now)} file(s)"
    if parts < 4 and all(len(str(v).split(":")) == 4 for v in now.values()):
        words += " (--verify_data full: this checkpoint recorded no whole-file sums; later ones do)"
    return words


def _same_file(saved: str, now: str) -> bool:
    """Whether two fingerprints of one file agree, on the parts both have: a checkpoint saved
    before the sampled blocks were recorded holds "<bytes>:<ends>" only, and one saved with
    --verify_data full a whole-file sum that a sampled resume does not compute."""
    old, new = str(saved).split(":"), str(now).split(":")
    both = min(len(old), len(new))
    return old[:both] == new[:both]


def data_change(saved: dict[str, str] | None, now: dict[str, str] | None) -> str | None:
    """The first difference between the data a checkpoint was saved with and today's, in
    words naming the file; None if the same (or either side unknown: a hub dataset, or a
    checkpoint from before fingerprints)."""
    if not isinstance(saved, dict) or not isinstance(now, dict):
        return None
    for name in sorted(set(saved) | set(now)):
        if name not in now:
            return f"{name} is gone"
        if name not in saved:
            return f"{name} was added"
        if not _same_file(saved[name], now[name]):
            before, after = saved[name].split(":")[0], now[name].split(":")[0]
            sizes = f"{before} -> {after} bytes" if before != after else "same size"
            return f"{name} changed ({sizes}, other contents)"
    return None
