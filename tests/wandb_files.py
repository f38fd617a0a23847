"""Read back what W&B wrote in offline mode: each run's `run-<id>.wandb` file (a LevelDB-style log of
protobuf records, the format `wandb sync` uploads), parsed with wandb's own protobuf classes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BLOCK = 32768  # the log's block size: a record's chunks never straddle a block's header
HEADER = 7  # crc32 (4), length (2), type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _chunks(data: bytes) -> list[bytes]:
    assert data[:4] == b":W&B", "not a W&B run file"
    out, pending, pos = [], b"", 7  # the file header: ":W&B", magic (2), version (1)
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's zero-filled tail
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            out.append(pending + chunk)
    return out


def offline_runs(folder: Path) -> list[Path]:
    """The offline runs' files under a job's W&B folder (one `start-<n>` per supervisor), oldest first."""
    return sorted(folder.glob("start-*/wandb/offline-run-*/run-*.wandb"), key=lambda p: int(p.parts[-4][6:]))


def history(path: Path) -> list[dict[str, Any]]:
    """Every `run.log` of the run file, as {key: value}."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for chunk in _chunks(path.read_bytes()):
        record = pb.Record()
        record.ParseFromString(chunk)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
