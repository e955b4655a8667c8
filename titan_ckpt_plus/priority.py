"""Background work yields to training: lower CPU and I/O priority, per thread.

On Linux both the nice value and the I/O priority belong to a thread (its tid), not to
the process, so the checkpointer's writer and drainer can run below the training
thread in the same process, as Megatron's async workers do in theirs. Elsewhere, or
where the kernel refuses, nothing changes (a note in the log, never an error).
No torch import: unit-testable alone.
"""

import contextlib
import ctypes
import functools
import logging
import os
import platform
import threading

log = logging.getLogger("titan_ckpt_plus")

_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30, "ppc64le": 273, "s390x": 282}
_SYS_IOPRIO_GET = {"x86_64": 252, "aarch64": 31, "ppc64le": 274, "s390x": 283}
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_SHIFT = 13
IOPRIO_CLASS_BE = 2  # best effort: the class every thread starts in
BE_LOWEST = 7


def lower_this_thread(nice: int) -> dict:
    """Raise this thread's nice value by `nice` (capped at 19) and put its I/O in the
    lowest best-effort level. A nice value only shrinks the thread's share: on 2 CPU
    ranks that keep both cores busy, training's gloo threads still waited behind a
    nice-19 writer; SCHED_IDLE (IdleWhileOnTime) more than halved what a local save
    cost debugmodel's steps (BENCHMARKS.md, overhead).
    Returns what took effect, for the log and the tests."""
    done = {"nice": None, "ioprio": None}
    if nice <= 0:
        return done
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + nice))
        done["nice"] = os.getpriority(os.PRIO_PROCESS, tid)
    except (OSError, AttributeError) as e:
        log.debug(f"[titan_ckpt_plus] could not lower thread {tid}'s CPU priority: {e!r}")
    number = _SYS_IOPRIO_SET.get(platform.machine())
    if number is not None:
        libc = ctypes.CDLL(None, use_errno=True)
        value = (IOPRIO_CLASS_BE << _IOPRIO_CLASS_SHIFT) | BE_LOWEST
        if libc.syscall(number, _IOPRIO_WHO_PROCESS, tid, value) == 0:
            done["ioprio"] = value
    return done


def set_class(tid: int, idle: bool) -> bool:
    """Put thread `tid` in SCHED_IDLE or back in the normal class (its nice value kept).
    Leaving SCHED_IDLE needs CAP_SYS_NICE or an RLIMIT_NICE that allows the thread's
    nice value; returns whether it took effect."""
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE if idle else os.SCHED_OTHER, os.sched_param(0))
        return True
    except (OSError, AttributeError):  # not permitted, a thread that ended, not Linux
        return False


@functools.cache
def can_leave_idle() -> bool:
    """Whether this process's threads may leave SCHED_IDLE again (root or CAP_SYS_NICE,
    or RLIMIT_NICE >= 20): tried once on a throwaway thread."""
    out: list[bool] = []

    def probe() -> None:
        tid = threading.get_native_id()
        out.append(set_class(tid, idle=True) and set_class(tid, idle=False))

    t = threading.Thread(target=probe, name="ckpt-idle-probe", daemon=True)
    t.start()
    t.join()
    return out[0]


class IdleWhileOnTime:
    """The checkpointer's CPU-heavy threads (the staging copy, the vote's and
    replication's gloo threads, the drain while it checksums: yielding()) in SCHED_IDLE
    while the work keeps up with training, back in the normal class (at their nice
    value) while some of it is late.

    SCHED_IDLE gives a core back the moment a training or gloo thread wakes: on 2 CPU
    ranks it cut what a local save cost debugmodel's steps by half or more. But where
    training leaves no core idle (pipeline parallel on CPU) idle threads starve: a save
    was not committed two steps later, and a failure then loses more work. So work
    still in flight when the step it began in ends is late (a save's write: at the
    end of the step after the save; a drain: of the step it was handed over in): at that step boundary every checkpointer thread returns to the normal class,
    and goes back to SCHED_IDLE at the first boundary with nothing in flight. A commit
    then comes at most about a step later than at normal priority.

    `enter()` on each thread at its start; `begin`/`end` around each unit of work,
    from any thread; `boundary()` from the training thread once a step."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.promoted = False
        self.promotions = 0
        self._tids: list[int] = []
        self._work: set = set()  # in flight
        self._lock = threading.Lock()

    def enter(self) -> None:
        """On a checkpointer thread, as it starts."""
        self.adopt([threading.get_native_id()])

    def adopt(self, tids) -> None:
        """Threads started elsewhere for the checkpointer's work (a background process
        group's gloo threads, the byte helper's checksum thread): they move with its own
        threads, until forgotten."""
        if not self.enabled:
            return
        with self._lock:
            for tid in tids:
                self._tids.append(tid)
                set_class(tid, idle=not self.promoted)

    def leave(self) -> None:
        """On a checkpointer thread, as it ends: its tid may be reused elsewhere."""
        self.forget([threading.get_native_id()])

    def forget(self, tids) -> None:
        """Threads that ended, or whose process did: their tids may be reused."""
        with self._lock:
            self._tids = [t for t in self._tids if t not in tids]

    @contextlib.contextmanager
    def yielding(self):
        """A stretch of CPU-heavy work on a thread that otherwise stays in the normal
        class (the drain checksumming bytes): in SCHED_IDLE with the other threads for
        its length, and promoted with them while late."""
        if not self.enabled:
            yield
            return
        self.enter()
        try:
            yield
        finally:
            self.leave()
            set_class(threading.get_native_id(), idle=False)

    def begin(self, key) -> None:
        with self._lock:
            self._work.add(key)

    def end(self, key) -> None:
        with self._lock:
            self._work.discard(key)

    def boundary(self) -> list:
        """A training step ended: whatever is still in flight began in it or before, so
        it is late. Promote the threads if anything is, return them to SCHED_IDLE once
        nothing is. Returns the late work."""
        with self._lock:
            late = sorted(self._work)
        if late and not self.promoted:
            self.promotions += 1
            self._set(promoted=True)
        elif not late and self.promoted:
            self._set(promoted=False)
        return late

    def promote(self) -> None:
        """The training loop waits for the work (a flush): nothing to yield to."""
        if not self.promoted:
            self._set(promoted=True)

    def _set(self, promoted: bool) -> None:
        with self._lock:
            self.promoted = promoted
            for tid in self._tids if self.enabled else ():
                set_class(tid, idle=not promoted)


def threads_started_by(fn):
    """(fn(), the native ids of the threads of this process that appeared meanwhile):
    a gloo process group starts its own (a TCP loop and two workers) when made."""
    before = set(_tids())
    out = fn()
    return out, sorted(set(_tids()) - before)


def _tids() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else []


def name_this_thread(name: str) -> None:
    """The thread's name as the kernel shows it (top -H, /proc/<pid>/task): where a
    training process's CPU goes can then be told thread by thread."""
    if platform.system() == "Linux":
        ctypes.CDLL(None).prctl(15, name.encode()[:15] + b"\0", 0, 0, 0)  # PR_SET_NAME


def thread_times() -> dict[str, list[int]]:
    """This process's threads' scheduler counters, summed by kernel name ("main": the
    process's first thread): [ns on a CPU, ns runnable but waiting for one], from
    /proc/self/task/*/schedstat. Sampled once a step by the benchmarks, they tell a
    step's extra time apart: more work, a wait for a core, or asleep (a collective,
    the GIL). Empty where the kernel has no schedstat."""
    out: dict[str, list[int]] = {}
    pid = os.getpid()
    for tid in _tids():
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = "main" if tid == pid else f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                on_cpu, waiting = map(int, f.read().split()[:2])
        except (OSError, ValueError):  # a thread that just ended
            continue
        total = out.setdefault(name, [0, 0])
        total[0] += on_cpu
        total[1] += waiting
    return out


def io_priority(tid: int) -> int | None:
    """A thread's I/O priority as the kernel reports it (class << 13 | level)."""
    number = _SYS_IOPRIO_GET.get(platform.machine())
    if number is None:
        return None
    value = ctypes.CDLL(None, use_errno=True).syscall(number, _IOPRIO_WHO_PROCESS, tid)
    return value if value >= 0 else None
