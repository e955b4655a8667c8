"""Where the staging copy runs and which device the background threads use.

On a GPU the staging copy must not run on the training kernels' stream (it would add
its whole PCIe time to the step instead of overlapping forward/backward), must start
only after the saved step's optimizer update, must be complete before the next update,
and must never be awaited with a device-wide synchronize: that waits for every queued
kernel, and on a thread that did not select the rank's device it waits on device 0,
so ranks 1-7 would report the copy complete while it is still in flight.

    training thread   copy = device.save_point()   after the saved step's update
    copy thread       copy.run(groups, progress)    on the copy stream, after the save
                                                    point; one event per group
    training thread   copy.wait()                   just before optimizer.step()

`Device` and `Copy` are the CPU stand-ins (copies run synchronously, threads are
plain); `CudaDevice` and `CudaCopy` are the GPU path. Both take the same calls, so
the ordering is tested without a GPU (tests/test_device_copy.py, with a fake device
module in place of torch.cuda).
"""

import threading

import torch

from titan_ckpt_plus import priority


class Copy:
    """One save's staging copy on CPU: synchronous, so once issued it is done."""

    # A group's bytes: on CPU, as many as a core's L2 cache holds, so the group's CRC-32C
    # (staging.StagingProgress.advance) reads them from there right after the copy wrote
    # them. With 8 MiB groups it read them back from L3 or memory: the copy and its CRC
    # took 1.4-1.6x the floor's CPU against 1.1-1.2x (BENCHMARKS.md, "a save's whole CPU").
    group_bytes = 1 << 20

    def __init__(self) -> None:
        self.issued = threading.Event()  # no more copies will be issued

    def run(self, groups: list, progress=None, clear=None) -> None:
        """`groups`: (buffer views, source tensors, bytes staged once they are copied),
        in buffer order, one foreach copy each, `clear(bytes staged once copied)`
        called before each (a drain may still write those bytes of the buffer);
        progress is reported per group (and
        the group checksummed while it is in the cache: staging.StagingProgress). On
        CPU that checksum comes before `issued`, so a step whose forward and backward
        are shorter than the copy and its CRC waits for both (measured: the delta
        stayed 2-5 ms on debugmodel and 100M); on a GPU it comes after."""
        try:
            for dst, src, upto in groups:
                if clear is not None:
                    clear(upto)
                if dst:
                    torch._foreach_copy_(dst, src)
                if progress is not None:
                    progress.advance(upto)
        finally:
            self.issued.set()

    def wait(self) -> None:
        """Before optimizer.step(): the parameters may change once this returns."""
        self.issued.wait()


class CudaCopy(Copy):
    """One save's staging copy on the rank's copy stream."""

    # The device writes host memory by DMA, past the CPU's caches: groups only as small
    # as progress needs, each an event and a host wait.
    group_bytes = 8 << 20

    def __init__(self, cuda, device: int, stream, point) -> None:
        super().__init__()
        self.cuda, self.device, self.stream, self.point = cuda, device, stream, point
        self.done = None  # the copy stream's event after the last copy issued

    def run(self, groups: list, progress=None, clear=None) -> None:
        """Issue every group on the copy stream after the save point (each once
        `clear(upto)` returns, as on CPU), an event after
        each, then follow the events in order: a group is reported staged (and the
        writer reads it) only once its event has completed. `groups` keeps the source
        tensors referenced until then, so their memory cannot be handed to the
        training kernels while a copy still reads it."""
        marks = []
        try:
            self.stream.wait_event(self.point)
            with self.cuda.stream(self.stream):
                for dst, src, upto in groups:
                    if clear is not None:
                        clear(upto)
                    if dst:
                        torch._foreach_copy_(dst, src, non_blocking=True)
                    mark = self.cuda.Event(blocking=True)  # a host wait sleeps, not spins
                    mark.record(self.stream)
                    marks.append((mark, upto))
        finally:
            self.done = marks[-1][0] if marks else None
            self.issued.set()
            for mark, upto in marks:  # after a failed issue too: what was issued completes
                mark.synchronize()  # this event only, never the device
                if progress is not None:
                    progress.advance(upto)

    def wait(self) -> None:
        """The training stream waits for the copy's last event on the GPU; the host
        waits only until the copies are issued."""
        self.issued.wait()
        if self.done is not None:
            self.cuda.current_stream(self.device).wait_event(self.done)


class Device:
    """The CPU stand-in: synchronous copies, plain threads."""

    def save_point(self) -> Copy:
        """On the training thread, once the saved step's update is queued."""
        return Copy()

    def start_thread(self, target, name: str, *args, nice: int = 0,
                     idle: priority.IdleWhileOnTime | None = None) -> threading.Thread:
        """Every background thread of the checkpointer starts here; `nice` > 0 puts it
        below training's CPU and I/O priority; `idle` runs it in SCHED_IDLE while its
        work is on time (priority.py)."""
        t = threading.Thread(target=self._run, args=(target, nice, idle, *args), name=name, daemon=True)
        t.start()
        return t

    def _run(self, target, nice: int, idle: priority.IdleWhileOnTime | None, *args) -> None:
        priority.lower_this_thread(nice)
        if idle is not None:
            idle.enter()
        priority.name_this_thread(threading.current_thread().name)  # last: the kernel's name says it is set up
        try:
            self._on_device(target, *args)
        finally:
            if idle is not None:
                idle.leave()

    def _on_device(self, target, *args) -> None:
        target(*args)


class CudaDevice(Device):
    """The rank's GPU: one copy stream, reused by every save. Made on the training
    thread, whose current device is the rank's."""

    def __init__(self, cuda=torch.cuda) -> None:
        self.cuda = cuda
        self.index = cuda.current_device()
        self.stream = cuda.Stream(device=self.index)

    def save_point(self) -> CudaCopy:
        point = self.cuda.Event()
        point.record(self.cuda.current_stream(self.index))
        return CudaCopy(self.cuda, self.index, self.stream, point)

    def _on_device(self, target, *args) -> None:
        # A new thread starts on device 0: its streams, events and NCCL calls would
        # go to another rank's GPU.
        self.cuda.set_device(self.index)
        target(*args)
