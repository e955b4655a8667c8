"""Background threads run below training's CPU and I/O priority (issue 15)."""

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from titan_ckpt_plus import config, device_copy, priority
from titan_ckpt_plus.checkpointer import TieredCheckpointer, TierSettings
from titan_ckpt_plus.telemetry import EventLog

LINUX = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not os.path.isdir("/proc/self/task"),
                           reason="SCHED_IDLE and /proc are Linux's")


def _own_priorities(out: dict) -> None:
    tid = threading.get_native_id()
    out.update(nice=os.getpriority(os.PRIO_PROCESS, tid), io=priority.io_priority(tid))


def test_a_background_thread_is_lowered_and_the_training_thread_is_not():
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    io_before = priority.io_priority(threading.get_native_id())
    seen: dict = {}
    device_copy.Device().start_thread(_own_priorities, "bg", seen, nice=7).join()
    assert seen["nice"] == min(19, base + 7)
    if seen["io"] is not None:  # a Linux kernel that reports I/O priorities
        assert seen["io"] == (priority.IOPRIO_CLASS_BE << 13) | priority.BE_LOWEST
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
    assert priority.io_priority(threading.get_native_id()) == io_before


def test_nice_zero_leaves_the_thread_as_training_runs():
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: dict = {}
    device_copy.Device().start_thread(_own_priorities, "bg", seen, nice=0).join()
    assert seen["nice"] == base


def test_threads_a_background_thread_starts_inherit_its_priority():
    """DCP's own writer threads, started by the drain, stay in the background too."""
    seen: dict = {}

    def outer():
        t = threading.Thread(target=_own_priorities, args=(seen,))
        t.start()
        t.join()

    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    device_copy.Device().start_thread(outer, "bg", nice=5).join()
    assert seen["nice"] == min(19, base + 5)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux only")
def test_a_background_thread_carries_its_name_in_the_kernel():
    """top -H and /proc show where a training process's CPU goes, thread by thread."""
    seen = []
    device_copy.Device().start_thread(
        lambda: seen.append(open(f"/proc/self/task/{threading.get_native_id()}/comm").read().strip()),
        "ckpt-pfs-drainer").join()
    assert seen == ["ckpt-pfs-draine"]  # the kernel keeps 15 characters


def _policy(out: dict) -> None:
    out["policy"] = os.sched_getscheduler(threading.get_native_id())
    child: dict = {}
    t = threading.Thread(target=lambda: child.update(policy=os.sched_getscheduler(threading.get_native_id())))
    t.start()
    t.join()
    out["child"] = child["policy"]


@LINUX
def test_an_idle_thread_is_in_sched_idle_and_so_are_the_threads_it_starts():
    """SCHED_IDLE, not a nice value: a waking training thread takes the core back at
    once. DCP's writer threads, started from the drain, inherit it."""
    before = os.sched_getscheduler(threading.get_native_id())
    seen: dict = {}
    device_copy.Device().start_thread(_policy, "bg", seen, idle=priority.IdleWhileOnTime(True)).join()
    assert seen == {"policy": os.SCHED_IDLE, "child": os.SCHED_IDLE}
    assert os.sched_getscheduler(threading.get_native_id()) == before
    plain: dict = {}
    device_copy.Device().start_thread(_policy, "bg", plain, nice=5).join()
    assert plain["policy"] == before


def _thread_policies(leftover: frozenset = frozenset()) -> dict:
    """Each of this process's checkpointer threads' scheduling policy, by kernel name;
    "gloo": the policies of its gloo threads, sorted. A thread names itself (and sets
    its class) as it starts: wait until the engine's three have. `leftover`: threads
    to leave out, there before the engine (another test's, still ending: in a full run
    one of the same name could be read in place of the engine's)."""
    deadline = time.monotonic() + 5
    while True:
        out = _policies_now(leftover)
        if all(k in out for k in THREADS) or time.monotonic() > deadline:
            return out
        time.sleep(0.01)


def _policies_now(leftover: frozenset = frozenset()) -> dict:
    out: dict = {"gloo": []}
    for tid in os.listdir("/proc/self/task"):
        if int(tid) in leftover:
            continue
        try:
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
            policy = os.sched_getscheduler(int(tid))
        except OSError:  # it ended since the listing
            continue
        if name.startswith("ckpt-"):
            out[name] = policy
        elif "gloo" in name:
            out["gloo"].append(policy)
    out["gloo"].sort()
    return out


THREADS = ("ckpt-staging-co", "ckpt-local-writ", "ckpt-pfs-draine")


def _engine(tmp_path, idle: bool, log: EventLog, local_interval: int = 1, pfs_interval: int = 1):
    """The engine on one rank (the caller holds a gloo group of one)."""
    state = {"model": {"w": torch.arange(4096, dtype=torch.float32)}, "train_state": {"step": 0}}
    s = TierSettings(local_root=str(tmp_path / "local"), pfs_folder=str(tmp_path / "pfs"),
                     local_interval=local_interval, pfs_interval=pfs_interval, local_keep=2, pfs_keep=2,
                     rank=0, world_size=1, first_on_node=True, job_id="J", background_idle=idle)
    return TieredCheckpointer(s, lambda: state, log)


@LINUX
@pytest.mark.parametrize("idle", [True, False])
def test_the_engine_puts_its_copy_writer_and_drain_where_the_policy_says(tmp_path, idle):
    leftover = frozenset(map(int, os.listdir("/proc/self/task")))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ckpt = _engine(tmp_path, idle, EventLog(None))
        ckpt.save(1)
        ckpt.flush()  # the threads still do the work: the step reaches both tiers
        assert ckpt.stats.last_drained == 1
        ckpt.save(2)  # flush() brought them back; this step's boundary finds nothing late
        policies = _thread_policies(leftover)  # after the work: each thread has set its own
        ckpt.close()
    finally:
        dist.destroy_process_group()
    want = os.SCHED_IDLE if idle else os.SCHED_OTHER
    # the writer and the drain stay normal: they mostly wait for the disk and their
    # few ms of CPU decide when a step is durable (the drain yields while it checksums)
    assert [policies.get(k) for k in THREADS] == [want, os.SCHED_OTHER, os.SCHED_OTHER]
    # the commit group's gloo threads (3) with the copy; the drain's, the world's and
    # the training thread's group's stay in the normal class
    gloo = policies["gloo"]
    assert gloo.count(os.SCHED_IDLE) == (3 if idle else 0) and gloo.count(os.SCHED_OTHER) >= 9, gloo


@LINUX
def test_a_save_still_writing_a_step_later_brings_the_engines_threads_back(tmp_path):
    """The engine marks a save's write late at the next step's boundary: its threads
    leave SCHED_IDLE (the event log says which work was late), and return once
    nothing is late."""
    if not priority.can_leave_idle():
        pytest.skip("this process may not leave SCHED_IDLE (no CAP_SYS_NICE)")
    from titan_ckpt_plus.telemetry import read_events

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        log = EventLog(str(tmp_path / "events.jsonl"))
        leftover = frozenset(map(int, os.listdir("/proc/self/task")))
        ckpt = _engine(tmp_path, True, log, local_interval=2, pfs_interval=100)
        disk, release = ckpt.local.write_part, threading.Event()

        def slow_disk(*a, **k):
            release.wait()
            return disk(*a, **k)

        ckpt.local.write_part = slow_disk
        ckpt.save(2)
        ckpt.wait_for_staging()
        on_time = _thread_policies(leftover)
        ckpt.save(3)  # not a save step: a boundary, with step 2's write still in flight
        late = _thread_policies(leftover)
        release.set()
        ckpt._write_q.join()
        assert ckpt.stats.last_committed == 2
        ckpt.save(4)
        back = _thread_policies(leftover)
        ckpt.close()
        log.flush()
    finally:
        dist.destroy_process_group()
    idle_then_normal = [os.SCHED_IDLE, os.SCHED_OTHER, os.SCHED_OTHER]  # the writer and drain are not idle
    recorded = [e for e in read_events(str(tmp_path / "events.jsonl")) if e["event"] == "background_late"]
    # it failed twice in full runs and never alone: a failure says what each read saw
    seen = f"on time {on_time}, late {late}, back {back}; late events {recorded}"
    assert [on_time.get(n) for n in THREADS] == idle_then_normal, seen
    assert [late.get(n) for n in THREADS] == [os.SCHED_OTHER] * 3, seen
    assert [back.get(n) for n in THREADS] == idle_then_normal, seen
    assert [(e["step"], e["late"]) for e in recorded] == [(3, ["write 2"])], seen


def test_sched_idle_by_default_only_where_late_threads_can_come_back():
    """"auto" and "idle" mean SCHED_IDLE only where a late thread may leave it again;
    "normal" never."""
    ckpt = config.Checkpoint()
    assert ckpt.background_policy == "auto"
    for policy, can, want in [("auto", True, True), ("auto", False, False), ("idle", True, True),
                              ("idle", False, False), ("normal", True, False)]:
        ckpt.background_policy = policy
        assert config.background_idle(ckpt, can) is want, (policy, can)


@LINUX
def test_without_cap_sys_nice_a_thread_cannot_leave_sched_idle_and_the_probe_says_so():
    """Unprivileged (no CAP_SYS_NICE, RLIMIT_NICE 0, as on most clusters) a thread in
    SCHED_IDLE stays there: the probe must see it, so "auto" keeps the normal class."""
    import shutil
    import subprocess
    import sys

    setpriv = shutil.which("setpriv")
    if os.getuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to drop CAP_SYS_NICE")
    import resource

    if resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20:
        pytest.skip("RLIMIT_NICE lets any thread come back")
    code = "from titan_ckpt_plus import priority; print(priority.can_leave_idle())"
    out = subprocess.run([setpriv, "--inh-caps=-sys_nice", "--bounding-set=-sys_nice", sys.executable,
                          "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"]
    assert priority.can_leave_idle() is True  # root here, with CAP_SYS_NICE


@pytest.mark.e2e
@LINUX
def test_unprivileged_idle_is_refused_at_start_with_the_fix_and_the_job_runs_normal(tmp_path, monkeypatch):
    """A job without CAP_SYS_NICE (a container's default) asking for "idle" gets a
    startup warning naming the fix, and its threads stay in the normal class; "auto"
    says why it is not SCHED_IDLE. Both train and save."""
    import shutil

    import harness

    setpriv = shutil.which("setpriv")
    if os.getuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to drop CAP_SYS_NICE")
    monkeypatch.setattr(harness, "LAUNCH", [setpriv, "--inh-caps=-sys_nice", "--bounding-set=-sys_nice",
                                            *harness.LAUNCH])
    for policy, said in (("idle", 'background_policy = "idle" cannot be honoured'),
                         ("auto", "not SCHED_IDLE: a late thread could not leave it, no CAP_SYS_NICE")):
        proc = harness.torchrun(tmp_path / policy, "--training.steps", "4",
                                f"--checkpoint.background_policy={policy}")
        harness.ok(proc)
        assert said in proc.stdout and "its threads at nice +" in proc.stdout
        if policy == "idle":
            assert "Fix: grant CAP_SYS_NICE" in proc.stdout
        assert [e["step"] for e in harness.ckpt_events(tmp_path / policy, "local_commit")] == [2, 4]


def test_work_still_in_flight_when_its_step_ends_is_late_until_none_is():
    """A save's write begins at a step boundary (save() runs the boundary first), a
    drain mid-step: either is late at the next boundary it is still in flight at."""
    w = priority.IdleWhileOnTime(enabled=False)  # the rule alone: no thread is touched
    assert w.boundary() == []
    w.begin(("write", 1))
    w.begin(("drain", 1))
    assert w.boundary() == [("drain", 1), ("write", 1)] and w.promoted and w.promotions == 1
    w.end(("write", 1))
    assert w.boundary() == [("drain", 1)] and w.promoted and w.promotions == 1
    w.end(("drain", 1))
    assert w.boundary() == [] and not w.promoted
    w.begin(("write", 2))
    w.end(("write", 2))  # done within its step: never late
    assert w.boundary() == [] and not w.promoted and w.promotions == 1
    w.begin(("drain", 2))
    w.promote()  # a flush: training waits for it
    assert w.promoted and w.promotions == 1


@LINUX
def test_late_work_brings_every_checkpointer_thread_back_and_on_time_work_returns_them():
    if not priority.can_leave_idle():
        pytest.skip("this process may not leave SCHED_IDLE (no CAP_SYS_NICE)")
    w = priority.IdleWhileOnTime(enabled=True)
    go, tids = threading.Event(), []

    def worker():
        tids.append(threading.get_native_id())
        go.wait()

    threads = [device_copy.Device().start_thread(worker, f"bg{i}", idle=w) for i in range(2)]
    while len(tids) < 2:
        go.wait(0.01)
    classes = lambda: [os.sched_getscheduler(t) for t in tids]  # noqa: E731
    assert classes() == [os.SCHED_IDLE] * 2
    w.boundary()
    w.begin(("write", 4))  # as save() does, right after the boundary
    assert classes() == [os.SCHED_IDLE] * 2
    w.boundary()
    assert classes() == [os.SCHED_OTHER] * 2  # through a whole step: late
    w.end(("write", 4))
    w.boundary()
    assert classes() == [os.SCHED_IDLE] * 2
    go.set()
    for t in threads:
        t.join()
    assert w._tids == []  # ended threads are forgotten: their tids may be reused


@LINUX
def test_a_normal_thread_yields_while_it_checksums_and_comes_back_after():
    """IdleWhileOnTime.yielding: the drain's checksumming stretch in SCHED_IDLE with the
    copy thread, promoted with it while late, and the normal class again after."""
    if not priority.can_leave_idle():
        pytest.skip("this process may not leave SCHED_IDLE (no CAP_SYS_NICE)")
    w = priority.IdleWhileOnTime(enabled=True)
    seen = []

    def drain():
        me = threading.get_native_id()
        seen.append(os.sched_getscheduler(me))
        with w.yielding():
            seen.append(os.sched_getscheduler(me))
            w.begin(("drain", 1))
            w.boundary()
            w.boundary()  # a whole step in flight: late, promoted with the others
            seen.append(os.sched_getscheduler(me))
            w.end(("drain", 1))
            w.boundary()
            seen.append(os.sched_getscheduler(me))
        seen.append(os.sched_getscheduler(me))

    device_copy.Device().start_thread(drain, "drain").join()
    assert seen == [os.SCHED_OTHER, os.SCHED_IDLE, os.SCHED_OTHER, os.SCHED_IDLE, os.SCHED_OTHER]
    assert w._tids == []
    off = priority.IdleWhileOnTime(enabled=False)
    with off.yielding():  # the policy off ("normal"): nothing is touched
        assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER


def test_background_policy_unknown_is_refused_naming_the_key(tmp_path):
    ckpt = config.Checkpoint(tier_local=True, local_folder=str(tmp_path / "l"), background_policy="low")
    ckpt.enable, ckpt.interval, ckpt.keep_latest_k, ckpt.folder = True, 10, 3, "checkpoint"
    with pytest.raises(config.ConfigError, match=r"background_policy = 'low' is unknown. Fix: \"auto\""):
        config.validate(ckpt, str(tmp_path / "dump"))


def test_auto_lowers_only_with_an_accelerator():
    ckpt = config.Checkpoint()
    assert ckpt.background_nice == -1
    assert config.background_nice(ckpt, accelerator=True) == 10
    assert config.background_nice(ckpt, accelerator=False) == 0
    ckpt.background_nice = 3
    assert config.background_nice(ckpt, accelerator=False) == 3


@pytest.mark.parametrize("bad", [-2, 20])
def test_background_nice_out_of_range_is_refused_naming_the_key(bad, tmp_path):
    ckpt = config.Checkpoint(tier_local=True, local_folder=str(tmp_path / "l"), background_nice=bad)
    ckpt.enable, ckpt.interval, ckpt.keep_latest_k, ckpt.folder = True, 10, 3, "checkpoint"
    with pytest.raises(config.ConfigError, match=rf"background_nice = {bad} is invalid"):
        config.validate(ckpt, str(tmp_path / "dump"))


def test_staging_copy_unknown_is_refused_naming_the_key(tmp_path):
    ckpt = config.Checkpoint(tier_local=True, local_folder=str(tmp_path / "l"), staging_copy="inline")
    ckpt.enable, ckpt.interval, ckpt.keep_latest_k, ckpt.folder = True, 10, 3, "checkpoint"
    with pytest.raises(config.ConfigError, match=r"staging_copy = 'inline' is unknown. Fix: \"auto\" \(the default\), \"thread\""):
        config.validate(ckpt, str(tmp_path / "dump"))

