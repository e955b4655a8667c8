"""Background work yields to training: lower CPU and I/O priority, per thread.

On Linux both the nice value and the I/O priority belong to a thread (its tid), not to
the process, so the checkpointer's writer and drainer can run below the training
thread in the same process, as Megatron's async workers do in theirs. Elsewhere, or
where the kernel refuses, nothing changes (a note in the log, never an error).
No torch import: unit-testable alone.
"""

import ctypes
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


def lower_this_thread(nice: int, idle: bool = False) -> dict:
    """Raise this thread's nice value by `nice` (capped at 19) and put its I/O in the
    lowest best-effort level; with `idle`, put it in SCHED_IDLE too: it then runs only
    on a core no normal thread wants, and a waking training or gloo thread takes the
    core back at once. A nice value only shrinks the thread's share: on 2 CPU ranks
    that keep both cores busy, training's gloo threads still waited behind a nice-19
    writer; SCHED_IDLE more than halved what a local save cost debugmodel's steps
    (BENCHMARKS.md, overhead).
    Returns what took effect, for the log and the tests."""
    done = {"nice": None, "ioprio": None, "idle": False}
    if nice <= 0 and not idle:
        return done
    tid = threading.get_native_id()
    if idle:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            done["idle"] = os.sched_getscheduler(tid) == os.SCHED_IDLE
        except (OSError, AttributeError) as e:
            log.debug(f"[titan_ckpt_plus] could not put thread {tid} in SCHED_IDLE: {e!r}")
    if nice > 0:
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
    pid = str(os.getpid())
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
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
