"""Background threads run below training's CPU and I/O priority (issue 15)."""

import os
import threading

import pytest

from titan_ckpt_plus import config, device_copy, priority


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

