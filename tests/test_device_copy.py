"""The staging copy's stream and event handling, without a GPU.

FakeCuda stands in for torch.cuda: a GPU that runs nothing on its own. Work queued
on a stream (the staging copies too: torch._foreach_copy_ is deferred to the stream
current for the tensors' device) runs only when a host wait reaches it after the test
let the GPU run, or when the test runs a stream itself. Every call is logged with its
thread and that thread's current device, so the tests see who called what, where, and
whether a group was reported staged before its copy ran.
"""

import os
import queue
import threading
import time
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from titan_ckpt_plus import device_copy, staging
from titan_ckpt_plus.checkpointer import TieredCheckpointer, TierSettings
from titan_ckpt_plus.device_copy import CudaCopy, CudaDevice
from titan_ckpt_plus.telemetry import EventLog

RANK_DEVICE = 3  # a rank other than the node's first: a new thread starts on device 0


class FakeStream:
    def __init__(self, gpu, device: int, name: str) -> None:
        self.gpu, self.device, self.name = gpu, device, name
        self.queue: list = []  # ("work", fn) | ("wait", event) | ("mark", event), not yet run
        self.history: list = []  # everything ever queued, in order

    def put(self, item) -> None:
        self.queue.append(item)
        self.history.append(item)

    def wait_event(self, event) -> None:
        self.gpu.call("wait_event", self, event)
        self.put(("wait", event))

    def __repr__(self) -> str:
        return f"<{self.name} stream on {self.device}>"


class FakeEvent:
    def __init__(self, gpu) -> None:
        self.gpu, self.stream, self.complete = gpu, None, True  # never recorded: nothing to wait for

    def record(self, stream=None) -> None:
        stream = stream or self.gpu.current_stream()
        self.gpu.call("record", self, stream)
        self.stream, self.complete = stream, False
        stream.put(("mark", self))

    def synchronize(self) -> None:
        self.gpu.call("event_synchronize", self)
        self.gpu.running.wait()
        self.gpu.run_until(self)


class FakeCuda:
    def __init__(self, running: bool = True, tensor_device: int = RANK_DEVICE) -> None:
        self.log: list = []  # (thread name, its current device, call, args)
        self.running = threading.Event()  # host waits return only once the GPU may run
        if running:
            self.running.set()
        self.tensor_device = tensor_device  # where the state's tensors live
        self._tls = threading.local()
        self._lock = threading.RLock()
        self._defaults: dict = {}

    def call(self, what: str, *args) -> None:
        with self._lock:
            self.log.append((threading.current_thread().name, self.current_device(), what, args))

    def calls(self, thread: str) -> list:
        return [c for c in self.log if c[0] == thread]

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return getattr(self._tls, "device", 0)

    def set_device(self, device: int) -> None:
        self.call("set_device", device)
        self._tls.device = device

    def _streams(self) -> dict:
        if not hasattr(self._tls, "streams"):
            self._tls.streams = {}
        return self._tls.streams

    def current_stream(self, device: int | None = None) -> FakeStream:
        device = self.current_device() if device is None else device
        self.call("current_stream", device)
        default = self._defaults.setdefault(device, FakeStream(self, device, "default"))
        return self._streams().get(device) or default

    def Stream(self, device: int | None = None) -> FakeStream:  # noqa: N802 (torch.cuda's name)
        self.call("Stream", device)
        return FakeStream(self, self.current_device() if device is None else device, "side")

    def Event(self, enable_timing: bool = False, blocking: bool = False) -> FakeEvent:  # noqa: N802
        self.call("Event")
        return FakeEvent(self)

    @contextmanager
    def stream(self, s: FakeStream):
        self.call("stream", s)
        streams = self._streams()
        before = streams.get(s.device)
        streams[s.device] = s
        try:
            yield
        finally:
            streams[s.device] = before

    def synchronize(self, device: int | None = None) -> None:
        self.call("synchronize", device)
        self.running.wait()
        device = self.current_device() if device is None else device
        for s in [*self._defaults.values()]:
            if s.device == device:
                self.run(s)

    # ---- the GPU ----

    def launch(self, stream: FakeStream, fn) -> None:
        stream.put(("work", fn))

    def deferred_copy(self, real):
        """torch._foreach_copy_ as on a GPU: queued on the current stream of the
        sources' device (the device guard), run when the GPU reaches it."""
        def copy(dst, src, non_blocking=False):
            stream = self.current_stream(self.tensor_device)
            self.call("copy", stream)
            dst, src = list(dst), list(src)
            self.launch(stream, lambda: real(dst, src))
        return copy

    def run(self, stream: FakeStream, upto: FakeEvent | None = None) -> None:
        with self._lock:
            while stream.queue:
                kind, x = stream.queue.pop(0)
                if kind == "work":
                    x()
                elif kind == "wait":
                    self.run_until(x)
                else:
                    x.complete = True
                    if x is upto:
                        return

    def run_until(self, event: FakeEvent) -> None:
        if not event.complete:
            self.run(event.stream, event)


class CheckedProgress(staging.StagingProgress):
    """Records, at each report, whether the reported bytes are really in the buffer."""

    def __init__(self, buf: staging.HostBuffer, want: torch.Tensor) -> None:
        super().__init__()
        self.buf, self.want, self.early = buf, want, []

    def advance(self, upto: int) -> None:
        if not torch.equal(self.buf.data[:upto], self.want[:upto]):
            self.early.append(upto)
        super().advance(upto)


def _state():
    g = torch.Generator().manual_seed(3)
    return {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate((900_000, 1_500_000, 2_200_000, 300))}


def _stage_on_fake_gpu(monkeypatch, device_cls=CudaDevice) -> None:
    """A save on local rank 3: step N's update is still queued when save() runs;
    step N+1's update is queued once the wait before it returned. The staged bytes
    must be those after update N, and every check below must hold."""
    gpu = FakeCuda(running=False)
    monkeypatch.setattr(torch, "_foreach_copy_", gpu.deferred_copy(torch._foreach_copy_))
    gpu.set_device(RANK_DEVICE)  # the training thread, as torchtitan sets it
    layout, tensors, _ = staging.plan_layout(_state())
    device = device_cls(gpu)
    compute = gpu.current_stream()
    gpu.launch(compute, lambda: [t.add_(1) for t in tensors])  # step N's update, in flight
    buf = staging.HostBuffer(pin=False)
    buf.ensure(layout.total_bytes).fill_(255)  # an earlier save's bytes
    want = buf.data.clone()
    staging.write_frames(want, layout)
    for e, t in zip(layout.entries, tensors):
        staging.tensor_view(want, e).copy_(t + 1)
    progress = CheckedProgress(buf, want)

    copy = device.save_point()
    thread = device.start_thread(buf.copy_in, "ckpt-staging-copy", layout, tensors, progress, copy)
    let_gpu_run = threading.Timer(2.0, gpu.running.set)  # else a wrong wait would hang the test
    let_gpu_run.start()
    try:
        before = len(gpu.calls("MainThread"))
        copy.wait()
        waited = [c[2:] for c in gpu.calls("MainThread")[before:]]
        assert not gpu.running.is_set(), "the wait before the update blocked the host until the GPU ran"
        assert progress.done == 0, "a group was reported staged before its copy ran"
        gpu.launch(compute, lambda: [t.add_(1) for t in tensors])  # step N+1's update
        gpu.run(compute)  # the training stream runs first: only its wait orders the copy before
    finally:
        let_gpu_run.cancel()
        gpu.running.set()  # lets a blocked copy thread finish, whatever failed
    thread.join(10)

    mine = gpu.calls("ckpt-staging-copy")
    assert mine[0][2:] == ("set_device", (RANK_DEVICE,)), f"copy thread began with {mine[0]}"
    assert all(c[1] == RANK_DEVICE for c in mine[1:]), "copy thread called on another device"
    streams = {c[3][0] for c in gpu.log if c[2] == "copy"}
    assert streams == {device.stream} and device.stream is not compute, f"copies ran on {streams}"
    assert device.stream.history[0] == ("wait", copy.point) and copy.point.stream is compute
    assert not [c for c in gpu.log if c[2] == "synchronize"], "a device-wide synchronize"
    assert waited == [("current_stream", (RANK_DEVICE,)), ("wait_event", (compute, copy.done))]
    assert copy.done.stream is device.stream and device.stream.history[-1] == ("mark", copy.done)
    assert not progress.early, f"reported staged before the bytes were copied: {progress.early}"
    assert progress.done == layout.total_bytes
    assert torch.equal(buf.data[: layout.total_bytes], want), "not the bytes after update N"


def test_a_save_on_local_rank_3_copies_on_its_stream_between_the_two_updates(monkeypatch):
    _stage_on_fake_gpu(monkeypatch)


# ---- the checks above catch today's copy and each way of getting it wrong ----

class TodaysCopy(CudaCopy):
    """HostBuffer.copy_in before this module: copies on the thread's current stream,
    then torch.cuda.synchronize(), then everything reported staged."""

    def run(self, groups, progress=None, clear=None):
        try:
            for dst, src, _ in groups:
                torch._foreach_copy_(dst, src, non_blocking=True)
            self.cuda.synchronize()
            progress.advance(groups[-1][2])
        finally:
            self.issued.set()

    def wait(self):
        self.issued.wait()  # the copy thread's join


class TodaysDevice(CudaDevice):
    def save_point(self):
        return TodaysCopy(self.cuda, self.index, self.stream, None)

    def _on_device(self, target, *args):  # no set_device
        target(*args)


class ReportsEarly(CudaCopy):
    def run(self, groups, progress=None, clear=None):
        for _, _, upto in groups:
            progress.advance(upto)
        super().run(groups, progress, clear)


class ReportsEarlyDevice(CudaDevice):
    def save_point(self):
        plain = super().save_point()
        return ReportsEarly(self.cuda, self.index, self.stream, plain.point)


class NoDeviceSelect(CudaDevice):
    def _on_device(self, target, *args):
        target(*args)


@pytest.mark.parametrize("device_cls", [TodaysDevice, ReportsEarlyDevice, NoDeviceSelect])
def test_the_checks_reject_todays_copy_and_each_broken_variant(monkeypatch, device_cls):
    with pytest.raises(AssertionError):
        _stage_on_fake_gpu(monkeypatch, device_cls)


# ---- the real engine, one rank, no torchrun ----

@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _engine(tmp_path, state, device, **settings):
    s = TierSettings(local_root=str(tmp_path / "local"), pfs_folder=str(tmp_path / "pfs"),
                     local_interval=2, pfs_interval=1000, local_keep=2, pfs_keep=2, rank=0,
                     world_size=1, first_on_node=True, job_id="J", **settings)
    return TieredCheckpointer(s, lambda: state, EventLog(None), device=device)


def _committed(ckpt, step):
    layout_bytes, data, _ = ckpt.local.read_part(step)
    return staging.rebuild(staging.StateLayout.from_bytes(layout_bytes), torch.frombuffer(data, dtype=torch.uint8))


def test_every_background_thread_selects_the_ranks_device_first(one_rank, tmp_path):
    gpu = FakeCuda()
    gpu.set_device(RANK_DEVICE)
    state = _state()
    ckpt = _engine(tmp_path, state, CudaDevice(gpu))
    ckpt.save(2)
    ckpt.wait_for_staging()
    ckpt.close()
    for name in ("ckpt-local-writer", "ckpt-pfs-drainer", "ckpt-staging-copy"):
        assert gpu.calls(name)[:1] == [(name, 0, "set_device", (RANK_DEVICE,))], name
    assert not [c for c in gpu.log if c[2] == "synchronize"]
    assert all(torch.equal(v, state[k]) for k, v in _committed(ckpt, 2).items())


def test_cpu_save_point_then_copy_then_wait_before_the_update(one_rank, tmp_path):
    """The CPU stand-in in the real engine: the copy runs on its own thread after the
    save point, and wait_for_staging() returns only once it is done, so an update
    right after never reaches the staged bytes even when the copy is slow."""
    order = []

    class SlowCopy(device_copy.Copy):
        def run(self, groups, progress=None, clear=None):
            order.append(("copy", threading.current_thread().name))
            threading.Event().wait(0.3)
            super().run(groups, progress, clear)
            order.append(("copied", threading.current_thread().name))

    class Recording(device_copy.Device):
        def save_point(self):
            order.append(("save point", threading.current_thread().name))
            return SlowCopy()

    state = _state()
    before = {k: v.clone() for k, v in state.items()}
    ckpt = _engine(tmp_path, state, Recording())
    ckpt.save(2)
    ckpt.wait_for_staging()
    order.append(("update", threading.current_thread().name))
    for t in state.values():
        t.add_(1)
    ckpt.close()
    assert order == [("save point", "MainThread"), ("copy", "ckpt-staging-copy"),
                     ("copied", "ckpt-staging-copy"), ("update", "MainThread")]
    assert all(torch.equal(v, before[k]) for k, v in _committed(ckpt, 2).items())


# ---- replication's NCCL path, with a loopback in place of NCCL ----

class Loopback:
    """dist.P2POp / batch_isend_irecv between two threads standing for two ranks."""

    def __init__(self) -> None:
        self.boxes = {0: queue.Queue(), 1: queue.Queue()}
        self.rank = threading.local()
        self.sent: list = []  # (rank, tensor's storage pointer, bytes)

    def op(self, fn, tensor, peer, group):
        return fn, tensor, peer

    def batch(self, ops):
        me = self.rank.r
        for fn, t, peer in ops:
            if fn is dist.isend:
                self.sent.append((me, t.untyped_storage().data_ptr(), t.numel()))
                self.boxes[peer].put((me, t.clone()))
        for fn, t, peer in ops:
            if fn is dist.irecv:
                src, data = self.boxes[me].get(timeout=10)
                assert src == peer
                t.copy_(data)
        return []


def test_nccl_replication_moves_parts_in_chunks_through_one_reused_device_buffer(monkeypatch):
    """The NCCL path of Wire (a device given), with the CPU standing in for the device:
    each side's part arrives whole and unchanged, and every chunk sent went through
    the same device buffer of one chunk, so no part is ever whole in GPU memory."""
    from titan_ckpt_plus import replication
    from titan_ckpt_plus.replication import Part, Wire

    from titan_ckpt_plus.tiers import files

    net = Loopback()
    monkeypatch.setattr(files, "piece_size", lambda n: 1000)
    monkeypatch.setattr(replication.dist, "P2POp", net.op)
    monkeypatch.setattr(replication.dist, "batch_isend_irecv", net.batch)
    g = torch.Generator().manual_seed(5)
    parts = [Part(b'{"m": %d}' % r, b"layout" * (r + 1), bytearray(torch.randint(0, 256, (3500 + r,), generator=g,
                                                                                dtype=torch.uint8).numpy()))
             for r in (0, 1)]
    wires, got = [Wire(None, device=torch.device("cpu")) for _ in (0, 1)], {}

    def rank(r):
        net.rank.r = r
        got[r] = wires[r].exchange(1 - r, parts[r], 1 - r, max_bytes=1 << 20)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for r in (0, 1):
        part, why = got[r]
        src = parts[1 - r]
        assert not why and (part.manifest, part.layout, bytes(part.data)) == (src.manifest, src.layout, bytes(src.data))
        chunks = [(p, n) for who, p, n in net.sent if who == r and n > 8]  # the bytes, not the sizes
        assert len(chunks) >= 4 and {p for p, _ in chunks} == {wires[r]._dev_buf.untyped_storage().data_ptr()}
        assert wires[r]._dev_buf.numel() == 1000


@pytest.mark.parametrize("device", [None, "cpu"], ids=["gloo", "nccl-path"])
def test_a_replica_streams_to_its_file_through_one_reused_chunk_and_a_bad_one_leaves_nothing(
        monkeypatch, tmp_path, device):
    """Replication's receive side with a sink (the LocalTier's ReplicaSink): each
    rank's replica of the other's part reaches its file byte for byte, while the data
    only ever lands in one reused host buffer of one chunk (no part is whole in host
    memory). A part whose data does not match its manifest is refused after the
    exchange, and none of its files is left, not even under a temporary name."""
    import json

    from titan_ckpt_plus import replication
    from titan_ckpt_plus.replication import Part, Wire, check_part
    from titan_ckpt_plus.tiers import files
    from titan_ckpt_plus.tiers.local import LocalTier

    net = Loopback()
    monkeypatch.setattr(files, "piece_size", lambda n: 8192)
    monkeypatch.setattr(replication.dist, "P2POp", net.op)
    monkeypatch.setattr(replication.dist, "batch_isend_irecv", net.batch)
    g = torch.Generator().manual_seed(7)
    datas = [torch.randint(0, 256, (5 * 8192 + 123 * (r + 1),), generator=g, dtype=torch.uint8).numpy()
             for r in (0, 1)]
    parts = []
    for r, data in enumerate(datas):
        entry = files.entry(data)
        if r == 1:
            entry[files.SUM] ^= 1  # rank 1's manifest does not match its bytes
        manifest = json.dumps({"job_id": "J", "step": 4, "rank": r, "world_size": 2, "layout_tag": {},
                               "files": {"data": entry, "layout": files.entry(b"L%d" % r)}}).encode()
        parts.append(Part(manifest, b"L%d" % r, data))
    tiers = [LocalTier(str(tmp_path / f"node{r}"), r, 2, True, 2, job_id="J") for r in (0, 1)]
    wires = [Wire(None, device=torch.device(device) if device else None) for _ in (0, 1)]
    got = {}

    def rank(r):
        net.rank.r = r
        src = 1 - r
        try:
            with tiers[r].receive_replica(4, src) as sink:
                part, why = wires[r].exchange(src, parts[r], src, max_bytes=1 << 20, sink=sink.write)
                check_part(part, src, 4, 2, "J", {}, streamed=sink.entry())
                sink.finish(part.manifest, part.layout)
            got[r] = "kept"
        except files.CorruptCheckpoint as e:
            got[r] = str(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    manifest, layout, data = tiers[1].read_raw(4, 0)
    assert got[1] == "kept" and (manifest, layout, bytes(data)) == (parts[0].manifest, b"L0", bytes(datas[0]))
    assert got[0].startswith("rank 1 step 4 data: size")  # the CRC differs: refused
    assert os.listdir(tiers[0].step_dir(4)) == []  # nothing kept of it, no temporary file either
    for w in wires:
        assert w._chunk.numel() == 8192  # the only buffer the data lands in


def test_save_does_not_wait_for_a_drain_still_copying_from_the_buffer(one_rank, tmp_path):
    """A drain writing a piece of the last step from the staging buffer to a slow PFS
    holds its loan; the next save() must return without waiting for it (the copy
    thread takes the buffer back), and the copy lands once the piece is written."""
    from titan_ckpt_plus.drain import StagedBytes

    state = _state()
    ckpt = _engine(tmp_path, state, device_copy.Device())
    loan = StagedBytes(bytearray(8), reclaimable=True)
    ckpt._loans.append(loan)
    assert not loan.claim(0)  # the drain, mid-piece: its first piece from the buffer
    loan.lock.acquire()
    released = threading.Event()

    def piece_written():
        released.set()
        loan.lock.release()

    timer = threading.Timer(1.0, piece_written)
    timer.start()
    ckpt.save(2)
    assert not released.is_set(), "save() waited for the drain's piece"
    ckpt.wait_for_staging()  # before optimizer.step(): by now the piece is written
    assert released.is_set() and loan.taken_back and ckpt._loans == []
    ckpt.close()
    timer.join()
    saved = _committed(ckpt, 2)
    assert all(torch.equal(saved[k], v) for k, v in state.items())


def test_the_copy_thread_checksums_what_it_staged_and_the_writer_does_not(one_rank, tmp_path, monkeypatch):
    """The local part's CRC-32C is taken group by group right after each group is
    copied (the bytes still in the cache), on the copy thread; the writer only writes.
    The manifest's CRC must still be the file's, save after save (the buffer reused)."""
    from titan_ckpt_plus.tiers import files

    where = []
    real = files.checksum

    def counted(data, value=0):
        where.append((threading.current_thread().name, memoryview(data).nbytes))
        return real(data, value)

    monkeypatch.setattr(files, "checksum", counted)
    monkeypatch.setattr(staging, "checksum", counted)
    state = _state()
    ckpt = _engine(tmp_path, state, device_copy.Device())
    for step in (2, 4):
        for t in state.values():
            t.add_(1)
        where.clear()
        ckpt.save(step)
        ckpt.wait_for_staging()
        ckpt.flush()
        data_file, expect = ckpt.local.data_file(step)
        staged = sum(n for name, n in where if name == "ckpt-staging-copy")
        written = sum(n for name, n in where if name == "ckpt-local-writer")
        assert staged == os.path.getsize(data_file) and written < 4096  # the writer: the small files only
        size, crc = files.checksum_file(data_file)
        assert {"size": size, files.SUM: crc} == {"size": expect["size"], files.SUM: expect[files.SUM]}
        assert all(torch.equal(v, state[k]) for k, v in _committed(ckpt, step).items())
    ckpt.close()


def test_staging_copy_save_copies_in_save_unless_a_drain_still_reads_the_buffer(one_rank, tmp_path):
    """staging_copy = "save": the copy runs inside save() on the
    training thread. While a drain still reads the buffer (its loan not returned),
    taking the buffer back could wait on the PFS, so that save's copy goes to the copy
    thread and save() returns at once; once a real drain has returned its loan, save()
    copies itself again. Each save's bytes are that step's."""
    from titan_ckpt_plus.drain import StagedBytes

    state = _state()
    ckpt = _engine(tmp_path, state, device_copy.Device(), staging_copy="save")
    ckpt.save(2)
    assert ckpt._pending_job.copy_thread == "MainThread" and not ckpt._pending  # done in save()
    for t in state.values():
        t.add_(1)
    loan = StagedBytes(bytearray(8), reclaimable=True)
    ckpt._loans.append(loan)
    assert not loan.claim(0)  # a drain, mid-piece: its first piece from the buffer
    loan.lock.acquire()
    timer = threading.Timer(1.0, loan.lock.release)
    timer.start()
    t0 = time.monotonic()
    ckpt.save(4)
    assert time.monotonic() - t0 < 0.9, "save() waited for the drain's piece"
    ckpt.wait_for_staging()
    assert ckpt._pending_job.copy_thread == "ckpt-staging-copy" and loan.taken_back
    timer.join()
    ckpt._write_q.join()
    assert all(torch.equal(_committed(ckpt, 4)[k], v) for k, v in state.items())
    # step 6 goes to the PFS: its drain copies from the buffer, then returns the loan
    ckpt.schedule.pfs_interval = 6
    for t in state.values():
        t.add_(1)
    ckpt.save(6)
    want6 = {k: v.clone() for k, v in state.items()}
    ckpt._write_q.join()
    ckpt.drain.join()  # starts it: held to the next boundary (drain_start)
    (lent,) = ckpt._loans
    assert lent.returned and ckpt.pfs.steps() == [6]
    for t in state.values():
        t.add_(1)
    ckpt.save(8)
    assert ckpt._pending_job.copy_thread == "MainThread" and lent.taken_back and ckpt._loans == []
    ckpt.close()
    assert all(torch.equal(_committed(ckpt, 6)[k], v) for k, v in want6.items())
    assert all(torch.equal(_committed(ckpt, 8)[k], v) for k, v in state.items())


def test_staging_copy_auto_copies_in_save_once_a_copy_proved_short(one_rank, tmp_path, monkeypatch):
    """staging_copy = "auto" (as config.staging_copy leaves it on a CPU machine whose
    cores training fills): the first copy runs on the copy thread, and measures its CPU
    time; the next ones run in save() while the last took under INLINE_COPY_CPU_S, and
    go back to the thread once one took longer. (The bound is 1 s here: this host's
    load must not decide the test.)"""
    from titan_ckpt_plus import checkpointer

    monkeypatch.setattr(checkpointer, "INLINE_COPY_CPU_S", 1.0)
    state = _state()
    ckpt = _engine(tmp_path, state, device_copy.Device(), staging_copy="auto")
    where, measured = [], []
    for step in (2, 4, 6, 8):
        for t in state.values():
            t.add_(1)
        if step == 6:  # as if step 4's copy had been long: step 6's goes back to the thread
            ckpt._last_copy_cpu_s = 1.0
        ckpt.save(step)
        ckpt.wait_for_staging()
        ckpt._write_q.join()  # the writer waits for the whole copy, its measure too
        where.append(ckpt._pending_job.copy_thread)
        measured.append(ckpt._last_copy_cpu_s)
        assert all(torch.equal(_committed(ckpt, step)[k], v) for k, v in state.items())
    assert where == ["ckpt-staging-copy", "MainThread", "ckpt-staging-copy", "MainThread"]
    assert all(0 < m < 1.0 for m in measured), measured  # each copy measured itself
    ckpt.close()


def test_staging_copy_auto_sends_the_copy_after_a_failed_one_to_the_thread(one_rank, tmp_path, monkeypatch):
    """A copy that failed measured nothing of a copy's cost (it may have stopped at
    once): the next one runs on the copy thread and measures itself again, instead
    of running in save() on the failed copy's tiny CPU time."""
    from titan_ckpt_plus import checkpointer

    monkeypatch.setattr(checkpointer, "INLINE_COPY_CPU_S", 1.0)
    state = _state()
    ckpt = _engine(tmp_path, state, device_copy.Device(), staging_copy="auto")
    real, where, calls = ckpt.buffer.copy_in, [], []

    def fail_at_step_4(*args, **kwargs):  # the second save's copy
        calls.append(1)
        if len(calls) == 2:
            raise OSError("injected: the copy stopped at once")
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt.buffer, "copy_in", fail_at_step_4)
    for step in (2, 4, 6):
        ckpt.save(step)
        ckpt.wait_for_staging()
        ckpt._write_q.join()
        where.append((ckpt._pending_job.copy_thread, ckpt._pending_job.ok, ckpt._last_copy_cpu_s))
    assert [(w, ok) for w, ok, _ in where] == [("ckpt-staging-copy", True), ("MainThread", False),
                                               ("ckpt-staging-copy", True)], where
    assert where[1][2] == float("inf") and 0 < where[2][2] < 1.0, where
    assert all(torch.equal(_committed(ckpt, 6)[k], v) for k, v in state.items())
    ckpt.close()
