"""An offline W&B run read back: its ``run-<id>.wandb`` records decoded with wandb's own protobuf
(``wandb.proto.wandb_internal_pb2.Record``), from the record log's framing (LevelDB's log
format: 32 KiB blocks, each record a 7-byte header and a full, first, middle or last piece)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
FILE_HEADER = struct.Struct("<4sHB")  # ":W&B", 0xBEE1, version 0
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> list[bytes]:
    ident, magic, version = FILE_HEADER.unpack_from(data)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    out, pos, parts = [], FILE_HEADER.size, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0 and length == 0:  # the zero-filled end of a block
            pos += BLOCK - pos % BLOCK
            continue
        piece = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        parts = piece if kind in (FULL, FIRST) else parts + piece
        if kind in (FULL, LAST):
            out.append(parts)
    return out


def read_run(path: Path) -> dict[str, Any]:
    """The run id, its tags, config, its history rows ({step: {key: value}}) and the summary
    values set outside history (``run.summary[key] = value``)."""
    from wandb.proto import wandb_internal_pb2

    run: dict[str, Any] = {"history": {}, "config": {}, "summary": {}}
    for payload in _payloads(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        which = record.WhichOneof("record_type")
        if which == "run":
            run["id"], run["tags"] = record.run.run_id, list(record.run.tags)
            run["project"] = record.run.project
            for item in record.run.config.update:
                run["config"][item.key] = json.loads(item.value_json)
        elif which == "history":
            row = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            run["history"][int(row.pop("_step"))] = row
        elif which == "summary":
            for i in record.summary.update:
                if i.key:  # history's own copies are nested keys
                    run["summary"][i.key] = json.loads(i.value_json)
    return run
