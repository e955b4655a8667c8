"""The PFS drain: committed local steps -> torchtitan's DCP layout on the PFS.

One background thread, its own gloo group (its collectives never interleave with the
writer's or training's), at background priority. The committed local part is already
a DCP data file (staging.py), so the drain is a copy: `PfsTier.save` reads the part
once in order, checking its CRC-32C, and writes the items DCP's planner gives this
rank; DCP plans from the step's state rebuilt on the meta device (no bytes held).
When the local disk failed that step, the bytes come from the staging buffer, still
held for this. A failed drain is logged
and counted; the older PFS steps stay. The training loop never waits for it, except
when it flushes (the last step, a preemption, close()).
"""

import queue
import time
from typing import Callable

import torch.distributed as dist

from titan_ckpt_plus import faults, staging
from titan_ckpt_plus.tiers import files
from titan_ckpt_plus.tiers.local import LocalTier
from titan_ckpt_plus.tiers.pfs import PfsTier, all_ranks, describe

log = __import__("logging").getLogger("titan_ckpt_plus")


class PfsDrain:
    """Queue of steps to copy to the PFS, and the thread that copies them.

    `failed(tier, step, why)` and `done(job)` are the engine's: counting a failure,
    and what to do with a step once its drain is over (drop an uncommitted one, free
    the staging buffer it held)."""

    def __init__(self, local: LocalTier, pfs: PfsTier, stats, events, start_thread: Callable,
                 failed: Callable, done: Callable, info: Callable) -> None:
        self.local, self.pfs, self.stats, self.events = local, pfs, stats, events
        self._failed, self._done, self._info = failed, done, info
        self.pg = dist.new_group(backend="gloo")
        self.steps: set[int] = set()  # queued or in flight: retention keeps them
        self.last_seconds = 0.0
        self._q: queue.Queue = queue.Queue()
        self._thread = start_thread(self._loop, "ckpt-pfs-drainer")

    def submit(self, job) -> None:
        self.steps.add(job.step)
        self._q.put(job)

    def join(self) -> None:
        self._q.join()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (job := self._q.get()) is not None:
            try:
                self._drain(job)
            except BaseException as e:  # the drainer must outlive any one drain
                self._failed("pfs", job.step, f"unexpected: {e!r}")
            finally:
                self.steps.discard(job.step)
                self._done(job)
                self._q.task_done()
        self._q.task_done()

    def _pieces(self, job):
        """The step's part, in order: the staged buffer if the local write failed, else
        the committed local file (checked as it is read)."""
        if job.memory is not None:
            return files.buffer_chunks(job.memory.numpy())
        return self.local.data_pieces(job.step)

    def _drain(self, job) -> None:
        t0 = time.monotonic()
        pieces, why = None, ""
        try:
            pieces = self._pieces(job)
            faults.maybe_fail("eio_pfs_write", job.step)
        except Exception as e:
            pieces, why = None, repr(e)
        if not all_ranks([pieces is not None], self.pg)[0]:
            self._failed("pfs", job.step, why or "another rank could not read its part")
            return
        state = staging.rebuild(job.layout, None, job.specs)
        try:
            nbytes = self.pfs.save(job.step, state, job.layout, pieces, self.pg,
                                   before_write=lambda: faults.maybe_kill("kill_during_pfs_write", job.step),
                                   beside_export=job.beside_export)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            self._failed("pfs", job.step, describe(e))
            return
        self.stats.drains += 1
        self.stats.last_drained = job.step
        self.last_seconds = time.monotonic() - t0
        self._info(f"[titan_ckpt_plus] PFS step {job.step} written: {nbytes / 2**20:.1f} MiB "
                   f"in {self.last_seconds:.3f}s (background)")
        self.events.record("pfs_commit", step=job.step, tier="pfs", bytes=nbytes,
                           background_write_s=self.last_seconds,
                           drain_lag_steps=self.stats.last_committed - job.step)
        try:
            self.pfs.purge()
        except OSError as e:
            log.warning(f"[titan_ckpt_plus] PFS retention failed: {e!r}")
