"""Checkpoint events as JSON lines beside the checkpoints (one writer: global rank 0).

The same records feed torchtitan's metric loggers (wandb, tensorboard) and the
`titan-ckpt` tools, so a run without wandb can still be inspected afterwards.
"""

import json
import os
import threading
import time


class EventLog:
    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        if path:
            os.makedirs(os.path.dirname(path), exist_ok=True)

    def record(self, event: str, **fields) -> None:
        if not self.path:
            return
        line = json.dumps(dict(event=event, time=time.time(), **fields), sort_keys=True)
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")


def read_events(path: str) -> list[dict]:
    """All parseable records; a torn last line (a killed writer) is skipped."""
    out = []
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out
