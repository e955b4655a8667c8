"""Reads the history rows of an offline wandb run (`run-*.wandb`).

The file is wandb's LevelDB-style record log: a 7-byte header (":W&B", magic
0xBEE1, version), then 32 KiB blocks of records, each with a 7-byte header (CRC-32C,
length, type FULL/FIRST/MIDDLE/LAST); each record is a wandb_internal_pb2.Record.
"""

import json
import struct
from pathlib import Path

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(data: bytes):
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - (pos % BLOCK)
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            buf = chunk
        elif kind == MIDDLE:
            buf += chunk
        elif kind == LAST:
            yield buf + chunk
            buf = b""
        elif kind == 0 and length == 0:
            pos += BLOCK - (pos % BLOCK) if pos % BLOCK else 0


def history(path: Path) -> list[dict]:
    """One dict per logged row: {"_step": N, key: value, ...}."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for raw in _records(path.read_bytes()):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in rec.history.item:
            key = item.key or "/".join(item.nested_key)
            row[key] = json.loads(item.value_json)
        if rec.history.HasField("step"):
            row.setdefault("_step", rec.history.step.num)
        rows.append(row)
    return rows
