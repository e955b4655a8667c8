"""The PFS drain: committed local steps -> torchtitan's DCP layout on the PFS.

One background thread, at background priority: in the normal class, as the writer,
but in SCHED_IDLE (where the policy says) while it checksums bytes. The ranks agree
over its own gloo group (its collectives never interleave with the writer's or
training's) or its own stream through the hub (votes.py); with the byte helper, a
kept plan's drain (its start, copy and gather) is one request to it. The committed
local part is already a DCP data file (staging.py), so the drain is a copy
(`PfsTier.save`, PartCopyWriter) of the items DCP's planner gives this rank; DCP plans
from the step's state rebuilt on the meta device (no bytes held). The bytes come from
the staging buffer while it still holds them (StagedBytes: nothing is read back from
the local disk), else from the committed local file, checked as it is read. A failed
drain is logged and counted; the older PFS steps stay. The training loop never waits for it, except
when it flushes (the last step, a preemption, close()).
"""

import collections
import contextlib
import queue
import threading
import time
from typing import Callable

from titan_ckpt_plus import faults
from titan_ckpt_plus.telemetry import PhaseClock
from titan_ckpt_plus.tiers import files
from titan_ckpt_plus.tiers.local import LocalTier
from titan_ckpt_plus.tiers.pfs import PfsTier, describe
from titan_ckpt_plus.tiers.byte_helper import by_helper

log = __import__("logging").getLogger("titan_ckpt_plus")


# A drain's pieces from the staging buffer: each is a write call after which the drain
# takes the GIL back from training (586 MiB: 10 calls against 37 at files.CHUNK). The
# next save's copy waits for the piece in flight only where it reaches that piece's bytes.
MEMORY_PIECE = 64 << 20


class StagedBytes:
    """A step's bytes in the staging buffer, lent to its drain. The next save's copy
    thread takes them back before it copies into the buffer and the drain goes on from
    the committed local file, from the piece after the one it is writing. A step whose local
    write failed has no file: its loan is not `reclaimable`, and the next save waits
    for the drain instead (the checkpointer keeps the buffer held)."""

    def __init__(self, data, reclaimable: bool, step: int = -1, generation: int = 0, helper=None) -> None:
        self.data = memoryview(data).cast("B")
        self.reclaimable = reclaimable
        self.step, self.generation = step, generation  # the buffer's (HostBuffer.generation)
        self.helper = helper  # a byte helper that may be copying them (helper_process)
        self.lock = threading.Lock()  # held while a piece is written from the buffer
        self._flag = threading.Lock()  # taken_back and writing change together
        self.taken_back = False
        self.writing: int | None = None  # the offset of the last piece begun from the buffer
        self.returned = False  # the drain is done with them (set by the checkpointer)

    def claim(self, offset: int) -> bool:
        """The drain, before each piece from the buffer: True if taken back (the
        piece is read from the file instead), else the piece at `offset` is begun."""
        with self._flag:
            if not self.taken_back:
                self.writing = offset
            return self.taken_back

    def take_back(self) -> Callable[[int], None]:
        """From the next piece on, the drain reads the file. Returns `clear(upto)`,
        which the copy calls before it overwrites the buffer's first `upto` bytes: it
        waits for the piece being written from memory only if the copy reaches that
        piece's bytes before the piece is written. The byte helper (if any) lets go of
        its own piece before this returns."""
        with self._flag:
            self.taken_back = True
            writing = self.writing
        if self.helper is not None:
            self.helper.take_back(self.step)

        def clear(upto: int) -> None:
            if writing is not None and upto > writing:
                with self.lock:  # the piece is written; the drain begins no other
                    pass
        return clear


class PartSource:
    """A rank's part of a step, as PartCopyWriter reads it. `crc`: the CRC-32C of all
    its bytes if known (the local manifest's), so a verbatim copy need not compute it.
    `yielding()`: a context in which the thread's CPU-heavy work yields to training
    (IdleWhileOnTime.yielding): checksumming, whether the file's bytes as they are read
    or the copied ones as they are written."""

    def __init__(self, total: int, staged: StagedBytes | None, path: str | None = None,
                 expect: dict | None = None, yielding: Callable = contextlib.nullcontext,
                 helper=None, step: int = -1) -> None:
        self.total, self.staged, self.path, self.expect = total, staged, path, expect
        self.crc = expect[files.SUM] if expect and expect.get("size") == total else None
        self.yielding = yielding
        self.helper, self.step = helper, step  # the byte helper copies it, if there is one
        self.by_helper = False  # whether it did

    def copy(self, path: str, reuse: str | None, spans: list, tail: bytes) -> dict:
        """Write `spans` of the part, then `tail` (the small items), to `path`, durably
        (Appender: O_DIRECT for the bulk, fsync'd); returns its size and CRC-32C. By the
        byte helper if there is one still running, else by this thread."""
        def there(helper):
            entry, _ = helper.copy(*self.request(path, reuse, spans, tail))
            self.by_helper = True
            return entry
        return by_helper(self.helper, there, lambda: files.copy_spans(
            path, reuse, spans, self.pieces(spans), tail, self.crc if self.verbatim(spans) else None))

    def request(self, path: str, reuse: str | None, spans: list, tail: bytes) -> tuple:
        """copy()'s arguments as the byte helper takes them (ByteHelper.copy): from the
        staged bytes while they are lent, then from the file."""
        lent = self.staged is not None and not self.staged.taken_back
        return (self.step, self.staged.generation if lent else None, path, reuse, spans, tail, self.path,
                self.expect, self.crc if self.verbatim(spans) else None)

    def verbatim(self, spans: list) -> bool:
        """Whether copying `spans` copies the whole part, whose CRC-32C is known."""
        return spans == [(0, self.total)] and self.crc is not None

    def pieces(self, spans: list):
        """(offset, piece) over `spans` in order: from memory while the loan lasts, then
        from the file. Only a verbatim copy from memory goes without checksumming, in the
        thread's own class."""
        resume = 0
        if self.staged is not None:
            with contextlib.nullcontext() if self.verbatim(spans) else self.yielding():
                resume = yield from files.memory_pieces(self.staged.data, spans, self.staged.lock,
                                                        self.staged.claim, MEMORY_PIECE)
            if resume is None:
                return
        with self.yielding():
            yield from files.read_spans(self.path, self.expect, spans, resume=resume)


# How often the drain thread looks for a held step whose boundary never came.
HELD_POLL_S = 0.5


class PfsDrain:
    """Queue of steps to copy to the PFS, and the thread that copies them. A step may
    be held first (drain_start): started at the training thread's next step boundary
    (start_held), so the step's local write and its drain do not share a step.

    Every step goes through the held queue, and is started under one lock, so each rank
    starts its drains in the order their steps were written: their agreements are
    collectives. A held step whose boundary does not come (a rank's training stopped on
    an exception, its peers wait in a collective) is started by the drain thread once
    `overdue_s()` old, so a rank's close() never waits for a peer's held drain.

    `failed(tier, step, why)` and `done(job)` are the engine's: counting a failure,
    and what to do with a step once its drain is over (drop an uncommitted one, free
    the staging buffer it held); `started(job)` marks it in flight."""

    def __init__(self, local: LocalTier, pfs: PfsTier, stats, events, start_thread: Callable, votes,
                 failed: Callable, done: Callable, info: Callable,
                 yielding: Callable = contextlib.nullcontext, started: Callable = lambda job: None,
                 overdue_s: Callable[[], float] = lambda: 1.0) -> None:
        self.local, self.pfs, self.stats, self.events = local, pfs, stats, events
        self._failed, self._done, self._info, self._started = failed, done, info, started
        self._yielding = yielding  # PartSource's
        self._overdue_s = overdue_s
        # how the ranks agree (votes.py): its own gloo group, its collectives never
        # interleaved with others', or its own stream through the hub
        self.votes = votes
        self.steps: set[int] = set()  # held, queued or in flight: retention keeps them
        self.last_seconds = 0.0
        self._q: queue.Queue = queue.Queue()
        self._held: collections.deque = collections.deque()  # (job, when held), oldest first
        self._hand_over = threading.Lock()
        self._thread = start_thread(self._loop, "ckpt-pfs-drainer")

    def submit(self, job, hold: bool = False) -> None:
        """Drain a step after those held before it; `hold`: not before start_held()."""
        self.steps.add(job.step)
        self._held.append((job, time.monotonic()))
        if not hold:
            self.start_held()

    def start_held(self) -> None:
        """Start every held step, oldest first: at a step boundary, a flush, or late."""
        with self._hand_over:
            while self._held:
                job, _ = self._held.popleft()
                self._started(job)
                self._q.put(job)

    def join(self) -> None:
        """Every step submitted so far drained, the held ones started first."""
        self.start_held()
        self._q.join()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()

    def _next(self):
        """The next step to drain; held ones left past overdue_s() are started meanwhile."""
        while True:
            try:
                return self._q.get(timeout=HELD_POLL_S)
            except queue.Empty:
                with self._hand_over:  # the training thread may empty _held meanwhile
                    overdue = bool(self._held) and time.monotonic() - self._held[0][1] > self._overdue_s()
                if overdue:
                    self.start_held()

    def _loop(self) -> None:
        while (job := self._next()) is not None:
            try:
                self._drain(job)
            except BaseException as e:  # the drainer must outlive any one drain
                self._failed("pfs", job.step, f"unexpected: {e!r}")
            finally:
                self.steps.discard(job.step)
                self._done(job)
                self._q.task_done()
        self._q.task_done()

    def _source(self, job) -> PartSource:
        """The step's part: the staged bytes while lent, else the committed local file."""
        total = job.layout.total_bytes
        no_file = job.loan is not None and not job.loan.reclaimable
        return PartSource(total, job.loan, *(() if no_file else self.local.data_file(job.step, job.manifest)),
                          yielding=self._yielding, helper=job.helper, step=job.step)

    def _purge(self, job) -> None:
        """PFS retention (rank 0): by the byte helper while it runs, so the listing,
        manifest reads and deletes leave this process (in the drain's one request, where
        the helper sealed the step: PfsTier.retained); here where a step without our
        manifest needs its .metadata read (torch's classes) to be told apart."""
        done, why = self.pfs.retained.pop(job.step, ("", None))
        if done == "purged":
            return
        if done == "failed":
            raise OSError(why)
        helper = job.helper if self.pfs.rank == 0 and done != "torch" else None  # the others have nothing to purge
        by_helper(helper, lambda h: h.purge_pfs(job.step), self.pfs.purge)

    def _drain(self, job) -> None:
        t0, cpu0, clock = time.monotonic(), time.thread_time(), PhaseClock()
        source, why = None, ""
        try:
            source = self._source(job)
            faults.maybe_fail("eio_pfs_write", job.step)
        except Exception as e:
            source, why = None, repr(e)
        clock.mark("source")
        try:  # collective: every rank goes in, its part readable or not
            nbytes = self.pfs.save(job.step, job.layout, job.specs, source, self.votes,
                                   before_write=lambda: faults.maybe_kill("kill_during_pfs_write", job.step),
                                   beside_export=job.beside_export, clock=clock, why=why)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            self._failed("pfs", job.step, describe(e))
            return
        self.stats.drains += 1
        self.stats.last_drained = job.step
        self.last_seconds = time.monotonic() - t0
        self._info(f"[titan_ckpt_plus] PFS step {job.step} written: {nbytes / 2**20:.1f} MiB "
                   f"in {self.last_seconds:.3f}s (background)")
        try:
            self._purge(job)
        except OSError as e:
            log.warning(f"[titan_ckpt_plus] PFS retention failed: {e!r}")
        clock.mark("purge")
        self.events.record("pfs_commit", step=job.step, tier="pfs", bytes=nbytes,
                           by_helper=bool(source and source.by_helper), agreed_by=self.votes.kind,
                           background_write_s=self.last_seconds, cpu_s=time.thread_time() - cpu0,
                           drain_lag_steps=self.stats.last_committed - job.step, phases=clock.phases)
