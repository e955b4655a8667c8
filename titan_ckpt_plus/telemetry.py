"""Checkpoint events as JSON lines beside the checkpoints (one writer: global rank 0).

The same records feed torchtitan's metric loggers (wandb, tensorboard) and the
`titan-ckpt` tools, so a run without wandb can still be inspected afterwards.
"""

import json
import logging
import math
import os
import queue
import threading
import time

log = logging.getLogger("titan_ckpt_plus")

PREFIX = "ckpt"
_FAILURES = f"{PREFIX}/failures/"


def peak_rss_since_last() -> int | None:
    """This process's peak resident set (bytes) since the previous call, then the
    peak is reset to the current RSS (/proc/self/clear_refs "5", Linux 4.0+). Sampled
    once a step by the benchmarks: the peak during a save's or a drain's steps, apart
    from start-up's and the last step's. None where the kernel has no such counter."""
    try:
        with open("/proc/self/status") as f:
            hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except (OSError, StopIteration, ValueError):
        return None
    return hwm * 1024


class PhaseClock:
    """Wall and thread-CPU seconds of a background task's phases, for its event: what
    in a save or a drain costs the cores training runs on."""

    def __init__(self) -> None:
        self.phases: dict[str, list[float]] = {}
        self._wall, self._cpu = time.monotonic(), time.thread_time()

    def mark(self, name: str) -> None:
        """The time since the previous mark is `name`'s (added up if named again)."""
        wall, cpu = time.monotonic(), time.thread_time()
        w, c = self.phases.setdefault(name, [0.0, 0.0])
        self.phases[name] = [round(w + wall - self._wall, 5), round(c + cpu - self._cpu, 5)]
        self._wall, self._cpu = wall, cpu


# An "interval" record's per-tier fields and their metrics: the interval in use (s),
# the policy's (Young's) tau, and the expected waste of each.
_INTERVAL_METRICS = {"s": "interval/{tier}_s", "tau_s": "interval/{tier}_tau_s",
                     "optimal_steps": "interval/{tier}_optimal_steps",
                     "waste": "interval/expected_waste_{tier}",
                     "optimal_waste": "interval/expected_waste_{tier}_optimal"}


def metrics_of(event: str, f: dict) -> dict:
    """The dashboard scalars of one event, named `ckpt/<group>/<name>`, so wandb's
    workspace groups them in a "ckpt" section with a panel per tier."""
    def mbps(nbytes, seconds):
        return nbytes / seconds / 1e6 if seconds else 0.0

    if event == "stage":
        return {"local/delta_s": f["delta_s"], "local/wait_prev_s": f["wait_prev_s"]}
    if event == "local_commit":
        return {"local/staging_s": f["staging_s"], "local/background_write_s": f["background_write_s"],
                "local/time_to_commit_s": f["time_to_commit_s"], "local/bytes": f["bytes"],
                "local/write_MBps": mbps(f["bytes"], f["background_write_s"]),
                "local/committed_step": f["step"]}
    if event == "pfs_commit":
        return {"pfs/delta_s": 0.0, "pfs/background_write_s": f["background_write_s"],
                "pfs/bytes": f["bytes"], "pfs/write_MBps": mbps(f["bytes"], f["background_write_s"]),
                "pfs/drain_lag_steps": f["drain_lag_steps"], "pfs/committed_step": f["step"]}
    if event == "replication":
        return {"replication/seconds": f["seconds"], "replication/bytes_sent": f["bytes_sent"],
                "replication/MBps": mbps(f["bytes_sent"] + f["bytes_received"], f["seconds"]),
                "replication/lag_s": f["seconds"]}
    if event == "interval":
        out = {"interval/local_steps": f["local_steps"], "interval/pfs_steps": f["pfs_steps"],
               "interval/mtbf_any_h": f["mtbf_any_s"] / 3600,
               "interval/mtbf_unrecoverable_h": f["mtbf_unrecoverable_s"] / 3600,
               "interval/failures_any": (f.get("evidence") or {}).get("any", (0, 0))[0]}
        for tier in ("local", "pfs"):
            for field, name in _INTERVAL_METRICS.items():
                v = f.get(f"{tier}_{field}")
                if isinstance(v, (int, float)) and math.isfinite(v):  # None: not measured yet
                    out[name.format(tier=tier)] = v
        return out
    if event == "recovery":
        return {"recovery/seconds": f["seconds"], "recovery/step": f["step"],
                "recovery/bytes_local": f["bytes_local"], "recovery/bytes_peer": f["bytes_peer"],
                "recovery/bytes_pfs": f["bytes_pfs"]}
    if event == "save_failed":
        return {f"failures/{f['tier']}_save_failed": 1}
    return {}


class EventLog:
    """Appends events to the JSONL file and keeps their metrics until the training
    thread hands them to torchtitan's loggers at the current step (wandb drops a
    value logged at a step older than the last one).

    The file lives on the PFS (beside the checkpoints), so every write to it, and
    any other I/O handed to `submit` (the failure ledger), runs on one background
    thread, in order: the training loop never waits on the PFS."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._pending: list[dict] = []  # each event's metrics, oldest first
        self._io: queue.Queue = queue.Queue()
        if path:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            threading.Thread(target=self._io_loop, name="ckpt-events", daemon=True).start()

    def _io_loop(self) -> None:
        while True:
            fn, args, kwargs = self._io.get()
            try:
                fn(*args, **kwargs)
            except Exception as e:  # a record lost is not worth a crash
                log.warning(f"[titan_ckpt_plus] event/ledger write failed: {e!r}")
            finally:
                self._io.task_done()

    def submit(self, fn, *args, **kwargs) -> None:
        """Run `fn` on the background I/O thread (rank 0 only; a no-op elsewhere)."""
        if self.path:
            self._io.put((fn, args, kwargs))

    def flush(self) -> None:
        if self.path:
            self._io.join()

    def _append(self, line: str) -> None:
        with open(self.path, "a") as f:
            f.write(line + "\n")

    def record(self, event: str, **fields) -> None:
        if not self.path:
            return
        line = json.dumps(dict(event=event, time=time.time(), **fields), sort_keys=True)
        metrics = {f"{PREFIX}/{k}": v for k, v in metrics_of(event, fields).items()}
        self.submit(self._append, line)
        if metrics:
            with self._lock:
                self._pending.append(metrics)

    def take_metrics(self) -> dict:
        """The metrics to log at this step: the pending events', oldest first. A logger
        keeps one value per key and step, so an event whose key is already taken waits
        for the next step (two commits landing between two steps would otherwise show
        only the second); failure counts add up instead."""
        out: dict = {}
        with self._lock:
            pending, self._pending = self._pending, []
            for metrics in pending:
                if all(k.startswith(_FAILURES) for k in metrics):
                    for k, v in metrics.items():
                        out[k] = out.get(k, 0) + v
                elif metrics.keys() & out.keys():
                    self._pending.append(metrics)
                else:
                    out.update(metrics)
        return out


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
