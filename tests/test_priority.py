"""Background threads run below training's CPU and I/O priority (issue 15)."""

import os
import threading

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
    device_copy.Device().start_thread(_policy, "bg", seen, idle=True).join()
    assert seen == {"policy": os.SCHED_IDLE, "child": os.SCHED_IDLE}
    assert os.sched_getscheduler(threading.get_native_id()) == before
    plain: dict = {}
    device_copy.Device().start_thread(_policy, "bg", plain, nice=5).join()
    assert plain["policy"] == before


def _thread_policies() -> dict:
    """Each of this process's checkpointer threads' scheduling policy, by kernel name."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        name = open(f"/proc/self/task/{tid}/comm").read().strip()
        if name.startswith("ckpt-"):
            out[name] = os.sched_getscheduler(int(tid))
    return out


@LINUX
@pytest.mark.parametrize("idle", [True, False])
def test_the_engine_puts_its_copy_writer_and_drain_where_the_policy_says(tmp_path, idle):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        state = {"model": {"w": torch.arange(4096, dtype=torch.float32)}, "train_state": {"step": 0}}
        s = TierSettings(local_root=str(tmp_path / "local"), pfs_folder=str(tmp_path / "pfs"),
                         local_interval=1, pfs_interval=1, local_keep=2, pfs_keep=2, rank=0,
                         world_size=1, first_on_node=True, job_id="J", background_idle=idle)
        ckpt = TieredCheckpointer(s, lambda: state, EventLog(None))
        ckpt.save(1)
        ckpt.flush()  # the threads still do the work: the step reaches both tiers
        assert ckpt.stats.last_drained == 1
        policies = _thread_policies()  # after the work: each thread has set its own
        ckpt.close()
    finally:
        dist.destroy_process_group()
    want = os.SCHED_IDLE if idle else os.SCHED_OTHER
    assert {k: policies.get(k) for k in ("ckpt-staging-co", "ckpt-local-writ", "ckpt-pfs-draine")} == dict.fromkeys(
        ("ckpt-staging-co", "ckpt-local-writ", "ckpt-pfs-draine"), want)


def test_sched_idle_only_when_asked_for():
    """SCHED_IDLE is opt-in: where training leaves no core idle it delays commits."""
    ckpt = config.Checkpoint()
    assert config.background_idle(ckpt) is False
    ckpt.background_policy = "idle"
    assert config.background_idle(ckpt) is True
    ckpt.background_policy = "normal"
    assert config.background_idle(ckpt) is False


def test_background_policy_unknown_is_refused_naming_the_key(tmp_path):
    ckpt = config.Checkpoint(tier_local=True, local_folder=str(tmp_path / "l"), background_policy="low")
    ckpt.enable, ckpt.interval, ckpt.keep_latest_k, ckpt.folder = True, 10, 3, "checkpoint"
    with pytest.raises(config.ConfigError, match=r"background_policy = 'low' is unknown. Fix: \"normal\""):
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
    with pytest.raises(config.ConfigError, match=r"staging_copy = 'inline' is unknown. Fix: \"thread\""):
        config.validate(ckpt, str(tmp_path / "dump"))

