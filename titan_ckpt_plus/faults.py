"""Fault injection for tests and the demo, armed only by an environment variable.

    TITAN_CKPT_FAULT="kill_after_step@7:1,kill_during_local_write@10"

kinds (SIGKILL unless said): kill_after_step (after step N's save call),
kill_during_staging (before step N's staging copy), kill_during_local_write (after
the first chunk of step N's local data file), kill_during_replication (before step
N's part is sent to its peers), kill_during_pfs_write (in step N's PFS drain, once
every rank agreed to start, before this rank's data file: by its byte helper where
that makes the copy); enospc_local_write (that write fails with "No space left on device"),
eio_pfs_write (step N's PFS drain fails with an I/O error), eio_commit_marker (step N's
commit marker fails so, wherever it is written); slow_staging (step N's
staging copy starts 1.5 s late, so the next step's forward/backward runs meanwhile: a
copy not ordered before the parameters change is caught); slow_step (step N's save call
returns 1.5 s late, before a kill_after_step of the same step: the background work gets
that far ahead, whatever the machine's load); slow_pfs_copy (each
piece of step N's PFS copy by the byte helper 0.1 s late: a take-back lands mid-copy);
sigterm_after_step (SIGTERM
to the launcher, as a scheduler's preemption notice: torchrun forwards it to every
worker). `:R` limits it to global rank R. Only the first incarnation fires
(TORCHELASTIC_RESTART_COUNT 0), so torchrun restarts run clean.
"""

import errno
import os
import signal
import time

ENV = "TITAN_CKPT_FAULT"


def _armed(kind: str, step: int) -> bool:
    spec = os.environ.get(ENV, "")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    rank = os.environ.get("RANK", "0")
    for item in spec.split(","):
        name, _, where = item.strip().partition("@")
        at, _, only_rank = where.partition(":")
        if name == kind and at.isdigit() and int(at) == step and only_rank in ("", rank):
            return True
    return False


def maybe_kill(kind: str, step: int, pid: int | None = None) -> None:
    """SIGKILL this process, or the rank `pid` and then this process (its byte helper,
    as a node's failure ends both at once: a helper left to its PR_SET_PDEATHSIG could
    finish the copy and its gather first, and rank 0's helper then seal the step)."""
    if _armed(kind, step):
        print(f"[titan_ckpt_plus.faults] {kind} at step {step}: SIGKILL rank "
              f"{os.environ.get('RANK', '0')}", flush=True)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_preempt(step: int) -> None:
    if _armed("sigterm_after_step", step):
        print(f"[titan_ckpt_plus.faults] sigterm_after_step at step {step}: SIGTERM to the "
              f"launcher (pid {os.getppid()})", flush=True)
        os.kill(os.getppid(), signal.SIGTERM)


def maybe_fail(kind: str, step: int) -> None:
    """Raise the OSError a full disk (enospc_*) or a broken file system (eio_*) gives."""
    if _armed(kind, step):
        code = errno.ENOSPC if kind.startswith("enospc") else errno.EIO
        raise OSError(code, f"{os.strerror(code)} (injected: {kind}@{step})")


def maybe_delay(kind: str, step: int, seconds: float = 1.5) -> None:
    if _armed(kind, step):
        print(f"[titan_ckpt_plus.faults] {kind} at step {step}: {seconds:g}s late on rank "
              f"{os.environ.get('RANK', '0')}", flush=True)
        time.sleep(seconds)
