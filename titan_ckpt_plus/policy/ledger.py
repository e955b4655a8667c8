"""Append-only failure ledger: the job's own evidence for its MTBF.

Each process incarnation (one launch of the job) writes JSON lines:

    {"event": "start",     "incarnation": ID, "t": T, "world_size": N, ...}
    {"event": "heartbeat", "incarnation": ID, "t": T, "step": S}
    {"event": "recovery",  "incarnation": ID, "t": T, "tier": "local"|"pfs"|null,
                           "step": S, "seconds": X}
    {"event": "clean_end", "incarnation": ID, "t": T}

A crash leaves no record, so a failure is *inferred*: an incarnation without
``clean_end`` (other than the one still running) died at its last sign of
life. Its class comes from the recovery record of the incarnation after it:
if that one had to fall back to the PFS tier (or found nothing at all,
tier null), the local tier plus replicas could not recover the failure.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

FAILURE_CLASSES = ("any", "unrecoverable_local")
# Recovery tiers meaning "local checkpoints and their replicas were lost".
UNRECOVERABLE_LOCAL_TIERS = ("pfs", "none")
_EVENTS = ("start", "heartbeat", "recovery", "clean_end")
_RESERVED = ("event", "incarnation", "t")


@dataclass
class Incarnation:
    """What the ledger knows about one launch of the job."""

    id: Any
    start_t: float
    last_t: float  # last sign of life: heartbeat, recovery or end
    world_size: int | None = None
    last_step: int | None = None
    clean_end: bool = False
    recovery_tier: str | None = None  # "none" = recovered nothing
    recovery_step: int | None = None
    recovery_s: float | None = None
    meta: dict = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return max(0.0, self.last_t - self.start_t)


@dataclass(frozen=True)
class Failure:
    """An incarnation that died; ``recovered_from`` is None until known."""

    incarnation: Any
    t: float
    step: int | None
    recovered_from: str | None

    @property
    def classes(self) -> tuple[str, ...]:
        if self.recovered_from in UNRECOVERABLE_LOCAL_TIERS:
            return ("any", "unrecoverable_local")
        return ("any",)


@dataclass
class LedgerSummary:
    incarnations: list[Incarnation]
    failures: list[Failure]
    exposure_s: float  # summed incarnation durations
    skipped_lines: int = 0

    def count(self, failure_class: str = "any") -> int:
        """Number of failures of one class (see FAILURE_CLASSES)."""
        if failure_class not in FAILURE_CLASSES:
            raise ValueError(f"unknown failure class {failure_class!r}, expected one of {FAILURE_CLASSES}")
        return sum(failure_class in f.classes for f in self.failures)

    def evidence(self, failure_class: str = "any") -> tuple[int, float]:
        """(failures, exposure_s), ready for GammaPoissonMTBF.set_evidence."""
        return self.count(failure_class), self.exposure_s


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_step(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _valid(rec: Any) -> bool:
    """Structural check, so one bad line cannot crash the reader later."""
    if not isinstance(rec, dict) or rec.get("event") not in _EVENTS:
        return False
    if not isinstance(rec.get("incarnation"), (str, int)) or not _is_number(rec.get("t")):
        return False
    event = rec["event"]
    if event == "heartbeat":
        return _is_step(rec.get("step"))
    if event == "recovery":
        tier_ok = rec.get("tier") is None or isinstance(rec.get("tier"), str)
        return tier_ok and _is_step(rec.get("step")) and _is_number(rec.get("seconds"))
    return True


class FailureLedger:
    """JSON-lines ledger; only one rank (e.g. rank 0) may write to it.

    Every append is one ``os.write`` of one full line on an O_APPEND file
    descriptor, followed by fsync: a crash leaves at most one torn last
    line, which ``read`` skips and the next append starts after. Threads of
    the writing process may append concurrently.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        # The torn-line check and the write must be one step: another thread's
        # append landing between them would be taken for a torn line.
        self._lock = threading.Lock()

    # -- writing ---------------------------------------------------------

    def start(self, incarnation_id: str | int, t: float | None = None, world_size: int | None = None, **meta: Any) -> None:
        clash = set(meta) & set(_RESERVED)
        if clash:
            raise ValueError(f"meta may not override reserved keys {sorted(clash)}")
        self._append({"event": "start", "incarnation": incarnation_id, "t": t, "world_size": world_size, **meta})

    def heartbeat(self, incarnation_id: str | int, t: float | None = None, step: int = 0) -> None:
        self._append({"event": "heartbeat", "incarnation": incarnation_id, "t": t, "step": step})

    def clean_end(self, incarnation_id: str | int, t: float | None = None) -> None:
        self._append({"event": "clean_end", "incarnation": incarnation_id, "t": t})

    def recovery(self, incarnation_id: str | int, t: float | None, tier: str | None, step: int, seconds: float) -> None:
        """Record where this incarnation restored from; tier None = nothing."""
        self._append(
            {"event": "recovery", "incarnation": incarnation_id, "t": t, "tier": tier, "step": step, "seconds": seconds}
        )

    def _append(self, rec: dict) -> None:
        if rec["t"] is None:
            rec["t"] = time.time()
        if not _valid(rec):
            raise ValueError(f"invalid ledger record: {rec!r}")
        # json.dumps escapes newlines inside strings: one record, one line.
        line = (json.dumps(rec, separators=(",", ":"), allow_nan=False) + "\n").encode()
        with self._lock:
            self._write_line(line)

    def _write_line(self, line: bytes) -> None:
        # O_RDWR only so the torn-line check below can read the last byte.
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            # Terminate a line torn by an earlier crash, else our record
            # would be glued to it and lost too.
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line
            written = os.write(fd, line)
            if written != len(line):  # not expected on local files; never drop data
                os.write(fd, line[written:])
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- reading ---------------------------------------------------------

    def read(self, current_incarnation: str | int | None = None) -> LedgerSummary:
        """Summarise the ledger; ``current_incarnation`` is still running.

        Corrupt lines are skipped with a warning, never fatal: losing one
        record only blurs the MTBF estimate, crashing the job is worse.
        """
        records, bad = self._parse()
        if bad:
            shown = ", ".join(map(str, bad[:5])) + (" ..." if len(bad) > 5 else "")
            warnings.warn(f"{self.path}: skipped {len(bad)} corrupt ledger line(s): {shown}", RuntimeWarning, stacklevel=2)
        incs = _incarnations(records)
        failures = []
        for i, inc in enumerate(incs):
            if inc.clean_end or inc.id == current_incarnation:
                continue
            nxt = incs[i + 1] if i + 1 < len(incs) else None
            failures.append(Failure(inc.id, inc.last_t, inc.last_step, nxt.recovery_tier if nxt else None))
        exposure = sum(inc.duration_s for inc in incs)
        return LedgerSummary(incs, failures, exposure, len(bad))

    def _parse(self) -> tuple[list[dict], list[int]]:
        """Valid records in file order, and the line numbers skipped."""
        records: list[dict] = []
        bad: list[int] = []
        try:
            f = open(self.path, encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return records, bad
        with f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError:
                    rec = None
                if _valid(rec):
                    records.append(rec)
                else:
                    bad.append(lineno)
        return records, bad


def _incarnations(records: list[dict]) -> list[Incarnation]:
    """Fold records into incarnations, ordered by first appearance."""
    incs: dict[Any, Incarnation] = {}
    for rec in records:
        t = float(rec["t"])
        inc = incs.get(rec["incarnation"])
        if inc is None:  # tolerate a lost start line: begin at first record
            inc = incs[rec["incarnation"]] = Incarnation(rec["incarnation"], t, t)
        inc.last_t = max(inc.last_t, t)
        event = rec["event"]
        if event == "start":
            inc.start_t = min(inc.start_t, t)
            inc.world_size = rec.get("world_size")
            inc.meta = {k: v for k, v in rec.items() if k not in _RESERVED and k != "world_size"}
        elif event == "heartbeat":
            inc.last_step = rec["step"]
        elif event == "recovery":
            inc.recovery_tier = rec["tier"] if rec["tier"] is not None else "none"
            inc.recovery_step, inc.recovery_s = rec["step"], float(rec["seconds"])
        else:
            inc.clean_end = True
    return list(incs.values())
