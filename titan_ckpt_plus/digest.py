"""State digests: a test hook that shows exactness where losses cannot.

Pipeline-parallel runs on CPU are not deterministic, so equal losses cannot show that
a resume restored the exact state. Digesting the state at each save point and right
after each load can: equal digests mean every tensor's bytes, dtype and shape, and
every other value, came back. Off by default; armed by TITAN_CKPT_STATE_DIGEST (a
folder: one `rank<R>.jsonl` per rank). Costs a full pass over the state on the
training thread, so it is for tests only.
"""

import hashlib
import json
import os

import torch

DIGEST_ENV = "TITAN_CKPT_STATE_DIGEST"


def digest(state: dict) -> dict[str, str]:
    """Top-level key -> sha256 of its value (nested dicts in key order, DTensors as
    this rank's local shard)."""
    out = {}
    for key in sorted(state, key=str):
        h = hashlib.sha256()
        _feed(h, state[key])
        out[str(key)] = h.hexdigest()[:32]
    return out


def _feed(h, x) -> None:
    if isinstance(x, dict):
        h.update(b"{%d" % len(x))
        for k in sorted(x, key=str):
            h.update(repr(k).encode())
            _feed(h, x[k])
    elif isinstance(x, (list, tuple)):
        h.update(b"[%d" % len(x))
        for y in x:
            _feed(h, y)
    elif isinstance(x, torch.Tensor):
        t = x.to_local() if hasattr(x, "to_local") else x
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        h.update(repr(x).encode())


class DigestLog:
    """Appends {"when", "step", "rank", "digest"} records; a no-op when not armed."""

    def __init__(self, folder: str | None, rank: int) -> None:
        self.path = os.path.join(folder, f"rank{rank}.jsonl") if folder else None
        self.rank = rank
        if self.path:
            os.makedirs(folder, exist_ok=True)

    def record(self, when: str, step: int, state: dict, world_size: int = 1) -> None:
        if not self.path:
            return
        line = json.dumps({"when": when, "step": step, "rank": self.rank, "world_size": world_size,
                           "digest": digest(state)})
        with open(self.path, "a") as f:
            f.write(line + "\n")


def read(folder: str) -> list[dict]:
    """Every rank's records, in file order per rank."""
    out = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("rank") and name.endswith(".jsonl"):
            with open(os.path.join(folder, name)) as f:
                out += [json.loads(line) for line in f if line.strip()]
    return out


def mismatches(records: list[dict], strict: bool = False) -> list[str]:
    """Every load whose digest differs from the digest its step had when saved by the
    same rank of the same world size, for every key it loaded (exclude_from_loading's
    keys are not in a load record); [] when all match. `strict`: a load that no save
    record matches is listed too (else skipped: a load at another world size, resharded
    from the PFS, has no per-rank counterpart)."""
    saved = {(r["rank"], r["world_size"], r["step"]): r["digest"] for r in records if r["when"] == "save"}
    bad = []
    for r in records:
        if r["when"] != "load":
            continue
        want = saved.get((r["rank"], r["world_size"], r["step"]))
        if want is None:
            if strict:
                bad.append(f"rank {r['rank']}: loaded step {r['step']}, whose save was not digested")
            continue
        for key in sorted(r["digest"]):
            if want.get(key) != r["digest"][key]:
                bad.append(f"rank {r['rank']} step {r['step']}: {key} differs after the load")
    return bad
