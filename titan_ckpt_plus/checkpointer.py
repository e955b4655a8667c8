"""Two-tier checkpointing, independent of torchtitan's classes.

    save(step)   stage the state into a reused host buffer (the only blocking part;
                 the tensor copy may overlap the next forward/backward and is awaited
                 in wait_for_staging(), just before optimizer.step())
      writer     thread: buffer -> local part, fsync; replicas; all ranks agree on a
                 gloo group; commit marker; local retention; hand PFS steps to the drain
      drain      drain.py: committed local part -> the PFS in DCP layout, a copy (from
                 the staging buffer while it holds the step) on its own thread. The
                 training loop never waits for it, except in flush() at the last step
                 and close().
    recover()    restore.py: at a restart, the newest step every rank can load.

The writer and the drain run at background priority (`background_nice`); the copy,
the vote's and replication's gloo threads, and the drain while it checksums bytes, in
SCHED_IDLE while the work keeps up with training (priority.IdleWhileOnTime: the
training thread checks once a step, in save()).

A failed save (disk full, permission, I/O error) is logged and counted; training
goes on and the older checkpoints stay.
"""

import errno
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from titan_ckpt_plus import device_copy, faults, priority, staging
from titan_ckpt_plus.config import Checkpoint
from titan_ckpt_plus.drain import PfsDrain, StagedBytes
from titan_ckpt_plus.placement import ReplicaPlacement
from titan_ckpt_plus.policy.schedule import IntervalPolicy, Measurements, SaveSchedule, assess
from titan_ckpt_plus.replication import Part, Wire, check_part
from titan_ckpt_plus.restore import Recovery, Restorer
from titan_ckpt_plus.telemetry import EventLog, PhaseClock
from titan_ckpt_plus.tiers import files
from titan_ckpt_plus.tiers.byte_helper import ByteHelper, by_helper
from titan_ckpt_plus.tiers.files import CorruptCheckpoint
from titan_ckpt_plus.tiers.local import LocalTier
from titan_ckpt_plus.tiers.hub import HubInfo, HubMember, HubProcess
from titan_ckpt_plus.tiers.pfs import PfsTier, agree, forget_groups
from titan_ckpt_plus.votes import GlooVotes, HubVotes

log = __import__("logging").getLogger("titan_ckpt_plus")

HUB_TIMEOUT_S = 1800.0  # an exchange through the hub times out as a gloo group does by default
# staging_copy = "auto" on a CPU: a copy (with its CRC, where no helper process takes it)
# of less CPU time than this runs in save(); debugmodel's 36 MiB a rank take 6-8 ms,
# 100M's 586 MiB about 140 ms (BENCHMARKS.md)
INLINE_COPY_CPU_S = 0.02


@dataclass
class TierSettings:
    local_root: str
    pfs_folder: str
    local_interval: int
    pfs_interval: int
    local_keep: int
    pfs_keep: int
    rank: int
    world_size: int
    first_on_node: bool
    job_id: str = ""  # every part, marker and PFS manifest records it (identity.py)
    layout_tags: list = field(default_factory=list)  # per rank: world size, shard shapes
    pin: bool = False
    replication_backend: str = "gloo"
    node_ranks: list = field(default_factory=list)  # ranks sharing this node folder
    # False when the parameters change during backward (optimizer.early_step_in_backward):
    # the copy then completes inside save(), so the staged state is the step boundary's.
    overlap_copy: bool = True
    # where the copy runs ([checkpoint] staging_copy, "auto" resolved by config.staging_copy):
    # "thread", "save", or "auto" (save() while a copy is short: _copy_in_save); never
    # save() while a drain still reads the buffer (taking it back may wait on the PFS).
    # overlap_copy = False is a must, this a preference.
    staging_copy: str = "thread"
    last_step_export: bool = False  # torchtitan's export takes step-N on the PFS (tiers/pfs.py)
    pfs_reuse_files: bool = True  # purged PFS data files are written over by the next drain
    background_nice: int = 0  # the writer's and the drain's CPU nice increment, lowest BE I/O
    background_idle: bool = False  # the copy, the drain's checksums, background gloo threads: SCHED_IDLE while on time
    helper_process: bool = False  # the local data file written by a helper process (tiers/byte_helper.py)
    # the vote's and the drain's, the job's default: "hub" (tiers/hub.py, votes.HubVotes),
    # "gloo", or "auto" (the hub with helper_process, else gloo)
    agreements: str = Checkpoint.agreements
    local_reshard: bool = True  # another layout's local step resharded from the node folder (tiers/reshard.py)
    drain_start: str = Checkpoint.drain_start  # "auto", "commit" or "next_step" (_hold_drain)
    # load_only (a look at a step): recovery writes nothing into the tiers, no timeline is left
    read_only: bool = False

    @property
    def layout_tag(self) -> dict:
        return self.layout_tags[self.rank] if self.layout_tags else {}


@dataclass
class SaveStats:
    saves: int = 0
    failed_saves: int = 0
    drains: int = 0
    failed_drains: int = 0
    failed_replicas: int = 0
    last_committed: int = -1
    last_drained: int = -1


@dataclass
class _Job:
    step: int
    pfs_due: bool
    started: float
    layout: staging.StateLayout | None = None
    specs: dict = field(default_factory=dict)
    staged: threading.Event = field(default_factory=threading.Event)
    ok: bool = False  # the writer's: its part written (and replicated), then as voted
    copied: bool = False  # the staging copy's outcome, set before `staged`
    staging_s: float = 0.0
    staging_cpu_s: float = 0.0  # the copy thread's CPU time (inline copies: the training thread's too)
    capture_s: float = 0.0  # the training thread's: torchtitan's state_dict() calls
    copy_thread: str = ""  # the thread that ran the staging copy
    progress: staging.StagingProgress = field(default_factory=staging.StagingProgress)
    committed: bool = False
    undecided: bool = False  # the vote itself failed: the step's files are left as they are
    loan: StagedBytes | None = None  # the staged bytes, lent to the drain (drain.py)
    manifest: bytes | None = None  # this rank's part's, once written: the drain reads its entry
    layout_bytes: bytes | None = None  # made by the writer once staged (_describe)
    beside_export: bool = False  # the PFS copy goes to full_state/step-N
    helper: ByteHelper | None = None  # moves the bytes, if the job has one (helper_process)
    generation: int = 0  # the staging buffer's (HostBuffer.generation) the job staged into
    hold_drain: bool = False  # its drain waits for the next step boundary (_hold_drain)
    voted: bool = False  # its commit vote was cast (_vote_failed)
    holds_buffer: bool = False  # it took the staging buffer in save() (_release_buffer)
    counted_failed: bool = False  # in stats.failed_saves already (_save_failed)


class TieredCheckpointer:
    def __init__(self, s: TierSettings, capture: Callable[[], Any], events: EventLog,
                 placement: ReplicaPlacement | None = None,
                 policy: IntervalPolicy | None = None,
                 device: device_copy.Device | None = None, adaptive: bool = False) -> None:
        self.s = s
        self.capture = capture
        self.events = events
        self.local = LocalTier(s.local_root, s.rank, s.world_size, s.first_on_node, s.local_keep,
                               s.job_id)
        self.pfs = PfsTier(s.pfs_folder, s.rank, s.world_size, s.pfs_keep, s.job_id,
                           reuse_files=s.pfs_reuse_files, write_batch=self._pfs_batch)
        self.stats = SaveStats()
        # Per-save figures once per job, not once per rank; warnings stay on every rank.
        self._info = log.info if s.rank == 0 else (lambda *_: None)
        self.helper = self._start_helper(s.background_nice) if s.helper_process else None
        self.buffer = staging.HostBuffer(pin=s.pin, shared=self.helper is not None)
        # Made here, on the training thread: its current device is the rank's.
        self.device = device or (device_copy.CudaDevice() if s.pin else device_copy.Device())
        self._buffer_free = threading.Event()
        self._buffer_free.set()
        self._loans: list[StagedBytes] = []  # staged bytes lent to drains, taken back by the next save
        self._last_layout: staging.StateLayout | None = None  # the last described (the writer's)
        self._pending_copy: device_copy.Copy | None = None
        self._pending = False
        self._pending_delta = 0.0
        self._pending_wait = 0.0
        self._pending_job: _Job | None = None
        self._last_copy_cpu_s = float("inf")  # the first copy runs on the thread (staging_copy "auto")
        self._ended = False  # the last step saved and flushed (save(last_step=True))
        # Dedicated groups: their collectives run on background threads and must never
        # interleave with each other or with the training group's.
        self.background = priority.IdleWhileOnTime(s.background_idle)
        self._groups: list = []  # every group made here: close() ends them
        self._fail_lock = threading.Lock()  # _save_failed's
        self._group_tids: list[int] = []  # their gloo threads
        if self.helper is not None:  # its checksum thread yields as the copy thread does
            self.background.adopt(self.helper.idle_tids)
        self.commit_pg = self._background_group()
        self.hub: HubProcess | None = None  # rank 0's, with agreements = "hub" or helper_process
        hub = self._join_hub() if s.agreements == "hub" or s.helper_process else None
        # The drain and its group's gloo threads stay in the normal class but while the
        # drain checksums bytes: the rest of its time it waits (the device's flush, two
        # small collectives), and in SCHED_IDLE each wake-up waited for a free core, which
        # made debugmodel's drain 1.7x its disk bound against 1.3x, the steps the same
        # (BENCHMARKS.md, overhead).
        drain_pg = self._background_group(idle=False)
        # The writer's vote and the drain's agreements (votes.py): through the hub (by the
        # byte helpers where they run), or gloo collectives on the two threads' own groups.
        self.votes, drain_votes = (
            (HubVotes("write", hub, s.rank, self._hub_helper, self.commit_pg),
             HubVotes("drain", hub, s.rank, self._hub_helper, drain_pg)) if hub
            else (GlooVotes(self.commit_pg), GlooVotes(drain_pg)))
        self.drain = PfsDrain(self.local, self.pfs, self.stats, events,
                              lambda target, name: self._background(target, name, idle=False),
                              drain_votes, self.record_failure, self._drained,
                              self._info, yielding=self.background.yielding,
                              started=lambda job: self.background.begin(("drain", job.step)),
                              overdue_s=lambda: max(1.0, 3 * self._step_time))
        self.schedule = SaveSchedule(s.local_interval, s.pfs_interval, adaptive=adaptive)
        self.policy = policy  # adaptive: sets the intervals; else only compared with them
        # The training thread's own group (interval decisions, preemption agreement):
        # only that thread issues on it, so the order is the same on every rank.
        self.main_pg = self._new_group("gloo")[0]
        self._preempt_flag: torch.Tensor | None = None
        self._preempt_work = None
        self._last_committed_job: _Job | None = None
        self._started = time.monotonic()
        self._last_step_call: tuple[int, float] | None = None
        self._step_time = 0.0
        self._last_local_write = 0.0
        self.placement = placement if placement and placement.factor > 0 else None
        self.wire: Wire | None = None
        if self.placement is not None:
            nccl = s.replication_backend == "nccl"
            self.wire = Wire(self._background_group(s.replication_backend),
                             device=torch.device("cuda", torch.cuda.current_device()) if nccl else None)
        self._write_q: queue.Queue = queue.Queue()
        # In the normal class (at background_nice) throughout: its few ms of CPU a save
        # (O_DIRECT submissions, fsyncs, the vote) decide when the step is durable; in
        # SCHED_IDLE a commit came 10 ms later on debugmodel, for no step time saved
        # (BENCHMARKS.md, overhead).
        self._writer = self._background(self._writer_loop, "ckpt-local-writer", idle=False)
        # One copy thread for the job, at training's nice value (training waits for its
        # copy before optimizer.step()), in SCHED_IDLE where the others are: training
        # blocked on it leaves it a core. A thread started per save made save() wait
        # for it to start, and to hand the GIL back.
        self._copy_q: queue.Queue = queue.Queue()
        self._copier = self.device.start_thread(self._copy_loop, "ckpt-staging-copy",
                                                idle=self.background)

    def _start_helper(self, nice: int) -> ByteHelper | None:
        """The byte helper, at the writer's and the drain's priority (background_nice),
        running this rank's local tier."""
        try:
            helper = ByteHelper(nice)
            helper.attach(self.local, self.pfs)
            return helper
        except OSError as e:
            log.warning(f"[titan_ckpt_plus] [checkpoint] helper_process = true: the helper process did not "
                        f"start ({e!r}); the local writes stay in the training process")
            return None

    def _join_hub(self) -> HubInfo | None:
        """Collective, at start-up (agreements = "hub", or helper_process): rank 0 starts the job's hub and
        every rank learns where it is (None on every rank if it did not start: the
        agreements stay gloo collectives); this rank's helper joins it."""
        box: list = [None]
        if self.s.rank == 0:
            try:
                self.hub = HubProcess(self.s.world_size, HUB_TIMEOUT_S)
                box[0] = self.hub.info
            except OSError as e:
                log.warning(f"[titan_ckpt_plus] {e}; the ranks agree on saves by gloo collectives instead")
        dist.broadcast_object_list(box, src=0, group=self.commit_pg)
        info, why = box[0], ""
        if info is None:
            return None
        try:
            if self.helper is not None:
                try:
                    self.helper.join_hub(info, self.s.rank)
                except OSError as e:  # this rank's exchanges go from this process instead
                    log.warning(f"[titan_ckpt_plus] the byte helper could not join the hub ({e}); this rank "
                                f"exchanges from the training process")
            if not self._hub_helper():
                probe = HubMember(info, self.s.rank, "write")
                probe.connect()
                probe.close()
        except OSError as e:
            why = str(e)
        # A rank that cannot reach the hub would fail every vote while the others wait
        # for it: every rank agrees by gloo then.
        why = agree(why, self.commit_pg)
        if why:
            log.warning(f"[titan_ckpt_plus] not every rank reaches the checkpoint hub ({why}); the ranks "
                        f"agree on saves by gloo collectives instead")
            if self.hub is not None:
                self.hub.close()
                self.hub = None
            return None
        return info

    def _hub_alive(self) -> None:
        """Rank 0: a hub that ended (killed, out of memory) is started again where the
        members reconnect; the exchanges in flight then failed (failed saves or drains,
        counted). If it cannot start, every later save fails, logged, until the job
        restarts."""
        if self.hub is None or self.hub.alive:
            return
        code = self.hub.proc.returncode
        try:
            self.hub = self.hub.restarted()
            log.warning(f"[titan_ckpt_plus] the checkpoint hub process ended (exit code {code}); "
                        f"restarted on port {self.hub.info.port}")
        except OSError as e:
            log.error(f"[titan_ckpt_plus] the checkpoint hub process ended (exit code {code}) and could not "
                      f"be restarted ({e}): no save can be agreed until the job restarts")
            self.hub = None

    def _hub_helper(self) -> ByteHelper | None:
        """The byte helper that makes this rank's exchanges, if it runs and joined the hub."""
        helper = self.helper
        return helper if helper is not None and helper.hub_joined else None

    def _helper_alive(self) -> bool:
        """Whether the byte helper takes the next write; one that ended (killed, out
        of memory) leaves the writes to this process, with a warning, once."""
        if self.helper is not None and not self.helper.alive:
            log.warning(f"[titan_ckpt_plus] the byte helper process ended (exit code "
                        f"{self.helper.proc.poll()}); the local writes go on in the training process")
            self.helper.close()
            self.background.forget(self.helper.idle_tids)
            self.helper = None
        return self.helper is not None

    def _background_group(self, backend: str = "gloo", idle: bool = True):
        """A process group for background work only (the vote, the drain, replication):
        with `idle`, its gloo threads, which move a collective's bytes and wake for its
        messages, yield to training as the copy thread does. NCCL's run on the GPU."""
        pg, tids = self._new_group(backend)
        if backend == "gloo" and idle:
            self.background.adopt(tids)
        return pg

    def _new_group(self, backend: str) -> tuple:
        """(a new process group, its threads): close() ends both."""
        pg, tids = priority.threads_started_by(lambda: dist.new_group(backend=backend))
        self._groups.append(pg)
        self._group_tids += tids
        return pg, tids

    def _background(self, target, name: str, idle: bool = True):
        """A thread on the rank's device, below training's CPU and I/O priority; with
        `idle`, in SCHED_IDLE while the work is on time."""
        return self.device.start_thread(target, name, nice=self.s.background_nice,
                                        idle=self.background if idle else None)

    # ---- training-thread side -------------------------------------------------

    def resumed_at(self, step: int) -> None:
        """Collective, before the first step: the steps newer than `step`, the timeline
        the job left (steps that failed their checks, another layout's, all of them after
        `load_step`), go: the local ones removed (LocalTier.drop_after), the PFS ones set
        aside (PfsFolder.set_aside_after): none is loaded by a later restart in place of
        the new run's steps, nor keeps retention's slots from them. A look (read_only)
        saves nothing: it starts no new timeline, and nothing goes."""
        if self.s.read_only:
            return
        self.schedule.start_at(step)
        dropped = self.local.drop_after(step)
        if dropped:
            log.info(f"[titan_ckpt_plus] removed local steps {dropped}: newer than step {step}, which the job "
                     "resumed from (a timeline it left: it saves those numbers again)")
        why = ""
        try:
            moved, dest, before = self.pfs.set_aside_after(step)
            if moved:
                log.warning(f"[titan_ckpt_plus] moved PFS steps {moved} to {dest}: newer than step {step}, which "
                            "the job resumed from, so never loaded in place of its new steps; delete that "
                            "folder once they are of no more use")
            if before:  # set aside after this step before
                log.warning(f"[titan_ckpt_plus] the job has gone back to step {step} {before + 1} times: if "
                            f"[checkpoint] load_step = {step} is still in its config, every restart goes back "
                            "there and sets aside what it trained since. Fix: load_step = -1 (the default) "
                            "to resume from the newest step.")
        except OSError as e:
            why = f"could not set aside the PFS steps newer than step {step}: {e!r}"
        why = agree(why, self.commit_pg)
        if why:  # a later restart would load them: refused, as a check that fails
            raise RuntimeError(f"[titan_ckpt_plus] {why}. Fix: make {self.pfs.folder} writable, or move "
                               f"its steps after step {step} out of it, and restart.")

    def save(self, step: int, last_step: bool = False) -> None:
        now = time.monotonic()
        if self._last_step_call and self._last_step_call[0] == step - 1:
            self._step_time = now - self._last_step_call[1]
        self._last_step_call = (step, now)
        self._step_boundary(step)
        save_now, pfs_due = self.schedule.due(step, last_step)
        if not save_now:
            return
        self.schedule.saved(step, pfs_due)
        t0 = time.monotonic()
        self._buffer_free.wait()  # the writer still holds the buffer: part of delta
        waited = time.monotonic() - t0
        job, tensors = _Job(step, pfs_due, t0, beside_export=last_step and self.s.last_step_export), None
        job.hold_drain = pfs_due and self._hold_drain(step)
        self._hub_alive()
        if self._helper_alive():  # the helper writes what the copy has staged, as it is staged
            job.helper = self.helper
            job.progress.sums = False  # the helper checksums the bytes as it writes them
        self.background.begin(("write", step))
        inline = last_step or not self.s.overlap_copy or self._copy_in_save()
        try:
            c0 = time.monotonic()  # after the wait for the buffer: capture alone
            captured = self.capture()
            job.capture_s = time.monotonic() - c0
            job.layout, tensors, job.specs = staging.plan_layout(captured)
            self.buffer.ensure(job.layout.total_bytes)
            job.generation = self.buffer.generation
            if job.helper is not None:  # a new buffer (the state grew) goes to the helper once
                job.helper.share(job.generation, self.buffer.fd, self.buffer.data.numel())
                job.progress.listener = job.helper.progress(step, job.layout.total_bytes)
            # After capture: the copy waits for every kernel queued so far, the update too.
            # Before the job is queued: a device error here fails this save, and the
            # writer never waits for a copy that will not come.
            copy = self.device.save_point()
        except Exception as e:  # a state we cannot stage is a failed save, not a crash
            tensors = None
            self._save_failed(job, f"staging: {e!r}")
            job.progress.fail()
        if tensors is not None:
            self._buffer_free.clear()
            job.holds_buffer = True
        self._write_q.put(job)  # before the copy starts: the writer wakes meanwhile
        if tensors is None:
            job.staged.set()  # the failed job still goes to the writer: it must vote
        else:
            self._pending_copy = copy
            if inline:  # the last step (flushed below), no overlap, or _copy_in_save()
                self._copy(job, tensors, copy)
            else:
                self._copy_q.put((job, tensors, copy))
        self._pending = True
        self._pending_delta = time.monotonic() - t0
        self._pending_wait = waited
        self._pending_job = job
        if inline:
            self.wait_for_staging()
        if last_step:
            self.flush()
            self._ended = True  # close() then lets the PFS spares go

    def _step_boundary(self, step: int) -> None:
        """Once a step: the background threads leave SCHED_IDLE while a save or a drain
        is late (priority.IdleWhileOnTime), so a failure loses at most about a step
        more work than at normal priority."""
        promotions = self.background.promotions
        late = self.background.boundary()
        self.drain.start_held()
        if self.background.promotions > promotions:
            self.events.record("background_late", step=step, late=[f"{k} {s}" for k, s in late],
                               promoted=self.background.enabled)

    def _copy_in_save(self) -> bool:
        """staging_copy = "save"; or "auto" (a CPU machine whose cores training fills,
        config.staging_copy) while the last copy took under INLINE_COPY_CPU_S: training
        then waits less for it in save() than a copy thread, taking its CPU time from
        training anyway, costs it in hand-overs (BENCHMARKS.md, "The staging copy's
        place chosen by its cost"). Never while a drain still reads the buffer: taking
        it back may wait on the PFS."""
        if self.s.staging_copy == "thread" or self._buffer_lent():
            return False
        return self.s.staging_copy == "save" or self._last_copy_cpu_s < INLINE_COPY_CPU_S

    def _buffer_lent(self) -> bool:
        """Whether a drain still reads the staging buffer (a loan it has not returned)."""
        return not all(loan.returned for loan in self._loans)

    def _take_back_loans(self) -> Callable[[int], None]:
        """Before the buffer is written again: a drain still copying from it goes on
        from the local file. Returns `clear(upto)` for the copy (StagedBytes.take_back):
        a drain lets go only once the piece it is writing to the PFS is written, so
        the copy may wait there for it. Called by the copy thread, or in save() only
        where no drain still reads the buffer (its loans all returned: nothing to wait
        for): the training thread must not wait on the PFS (it waits for the copy only
        before optimizer.step()). An inline copy may wait for that one piece only on
        the last step (which flushes anyway) and with early_step_in_backward: with
        staging_copy "save" or "auto" the copy goes back to the copy thread while a
        drain still reads the buffer."""
        clears = []
        while self._loans:
            clears.append(self._loans.pop().take_back())

        def clear(upto: int) -> None:
            for c in clears:
                c(upto)
        return clear

    def _copy_loop(self) -> None:
        while (work := self._copy_q.get()) is not None:
            self._copy(*work)

    def _copy(self, job: _Job, tensors, copy: device_copy.Copy) -> None:
        cpu0 = time.thread_time()
        job.copy_thread = threading.current_thread().name
        faults.maybe_kill("kill_during_staging", job.step)
        faults.maybe_delay("slow_staging", job.step)
        try:
            clear = self._take_back_loans()
            self.buffer.copy_in(job.layout, tensors, job.progress, copy, clear)
            job.copied = True
        except Exception as e:
            self._save_failed(job, f"staging copy: {e!r}")  # the cause, before the writer's
            job.progress.fail()
        finally:
            copy.issued.set()  # a copy that failed before it began must not hang the wait
            job.staging_s = time.monotonic() - job.started
            job.staging_cpu_s = time.thread_time() - cpu0
            # a copy that failed early measured nothing of a copy's cost: the next one runs on the thread
            self._last_copy_cpu_s = job.staging_cpu_s if job.copied else float("inf")
            job.staged.set()

    def wait_for_staging(self) -> None:
        """Called before optimizer.step(): the staged copy must be complete before the
        parameters change (on a GPU: the update's kernels wait for the copy's event)."""
        if not self._pending:
            return
        self._pending = False
        t0 = time.monotonic()
        if self._pending_copy is not None:
            self._pending_copy.wait()
            self._pending_copy = None
        waited = time.monotonic() - t0
        delta = self._pending_delta + waited
        self._pending_delta = 0.0
        job = self._pending_job
        self.events.record("stage", step=job.step, tier="local", delta_s=delta,
                           wait_prev_s=self._pending_wait, capture_s=job.capture_s, wait_copy_s=waited,
                           copy_thread=job.copy_thread)
        if self.policy is not None:
            self._review_intervals(job.step, delta)

    def _review_intervals(self, step: int, delta: float) -> None:
        """After every save, both tiers' intervals against the policy's choice for this
        save's numbers. Adaptive intervals take that choice, from the maxima over ranks
        so every rank schedules the same steps. Fixed ones stay: rank 0 only records
        Young's tau and the expected waste of the configured interval against it, on
        the event log's background thread, so the training step does no more work."""
        mine = [delta, self._step_time, self._last_local_write, self.drain.last_seconds,
                time.monotonic() - self._started]
        if not self.schedule.adaptive:
            if self.s.rank == 0:
                self.events.submit(self._judge_intervals, step, Measurements(*mine))
            return
        t = torch.tensor(mine, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.main_pg)
        self._judge_intervals(step, Measurements(*t.tolist()))

    def _judge_intervals(self, step: int, m: Measurements) -> None:
        local, pfs, mtbf = self.policy.update(m)
        if self.schedule.adaptive:
            self.schedule.local_interval, self.schedule.pfs_interval = local.steps, pfs.steps
            self._info(f"[titan_ckpt_plus] intervals after step {step}: local {local.steps} steps "
                       f"({local.reason}), PFS {pfs.steps} steps ({pfs.reason}); MTBF any "
                       f"{mtbf['any'] / 3600:.3g} h, unrecoverable {mtbf['unrecoverable_local'] / 3600:.3g} h")
        record = {}
        for tier, steps, d, cost, mtbf_s in (
                ("local", self.schedule.local_interval, local, m.delta_local_s, mtbf["any"]),
                ("pfs", self.schedule.pfs_interval, pfs, m.write_pfs_s, mtbf["unrecoverable_local"])):
            a = assess(steps, d, cost, mtbf_s, m.step_time_s)
            record.update({f"{tier}_steps": a.steps, f"{tier}_s": a.seconds, f"{tier}_tau_s": a.tau_s,
                           f"{tier}_optimal_steps": a.optimal_steps, f"{tier}_reason": d.reason,
                           f"{tier}_waste": a.waste, f"{tier}_optimal_waste": a.optimal_waste})
        self.events.record("interval", step=step, adaptive=self.schedule.adaptive, **record,
                           mtbf_any_s=mtbf["any"], mtbf_unrecoverable_s=mtbf["unrecoverable_local"],
                           delta_s=m.delta_local_s, step_time_s=m.step_time_s,
                           write_local_s=m.write_local_s, write_pfs_s=m.write_pfs_s,
                           uptime_s=m.uptime_s, evidence=self.policy.evidence)

    def preemption_agreed(self, noticed: bool) -> bool:
        """Collective, called once per step: whether any rank had noticed a preemption
        by its previous call. The all-reduce started here completes during the next
        step, so the training loop never waits for it, and every rank gets the same
        answer at the same step."""
        agreed = False
        if self._preempt_work is not None:
            self._preempt_work.wait()
            agreed = bool(self._preempt_flag.item())
        self._preempt_flag = torch.tensor([int(noticed)], dtype=torch.int32)
        self._preempt_work = dist.all_reduce(self._preempt_flag, op=dist.ReduceOp.MAX,
                                             group=self.main_pg, async_op=True)
        return agreed

    def promote_newest(self, deadline: float) -> tuple[int, str]:
        """Collective, at a preemption: finish the saves in flight, then copy the newest
        committed local step to the PFS unless it is there already or the drain would
        not fit before `deadline` (the next allocation may not have these nodes' disks).
        Returns (the step now newest on the PFS, or -1; what was done)."""
        self.flush()
        job = self._last_committed_job
        estimate = self.drain.last_seconds or 2 * self._last_local_write
        try:
            on_pfs = self.pfs.steps()
        except OSError:  # the all-reduce below must come; another rank's view counts
            on_pfs = []
        # the newest PFS step any rank sees: a rank whose file system client has not seen
        # the last seal yet must not enter a drain its peers skip
        t = torch.tensor([estimate, time.monotonic() - deadline, on_pfs[-1] if on_pfs else -1],
                         dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.main_pg)  # worst rank
        estimate, remaining, newest_pfs = float(t[0]), -float(t[1]), int(t[2])
        if job is None or job.step <= newest_pfs:
            return newest_pfs, "the newest local step is already on the PFS"
        if estimate > remaining:
            return newest_pfs, (f"not promoting local step {job.step}: the drain takes about "
                                f"{estimate:.1f}s, {remaining:.1f}s of grace left")
        failed = self.stats.failed_drains  # last_drained may be this step's from before
        self._drain(job)
        self.drain.join()
        if self.stats.last_drained == job.step and self.stats.failed_drains == failed:
            return job.step, f"promoted local step {job.step} to the PFS"
        return newest_pfs, f"promoting local step {job.step} failed (see above)"

    def flush(self, promote: bool = True) -> None:
        """Wait until every queued local write and PFS drain is done. `promote`: the
        training loop waits for them, so they stop yielding the CPU (a benchmark that
        times work beside them passes False)."""
        if promote:
            self.background.promote()
        self.wait_for_staging()
        self._write_q.join()
        self.drain.join()

    def close(self) -> None:
        self.flush()
        if self._preempt_work is not None:
            self._preempt_work.wait()
            self._preempt_work = None
        self._copy_q.put(None)
        self._copier.join()
        self._write_q.put(None)
        self._writer.join()
        self.drain.close()
        if self.helper is not None:
            self.helper.close()
        self.votes.close()
        self.drain.votes.close()
        if self.hub is not None:
            self.hub.close()
        self.buffer.release()
        if self._ended:
            self.pfs.release_spares()
        self._end_groups()

    def _end_groups(self) -> None:
        """Join the groups' gloo threads now, while the interpreter lives. A gloo thread
        frees a finished collective's tensors after the caller has moved on; one left
        in SCHED_IDLE could do it as the process exited, take the GIL from a finalizing
        interpreter and abort the rank after a clean run (SIGABRT, "terminate called
        without an active exception"). A group's threads end with its last reference,
        so each holder drops its own."""
        groups, self._groups = self._groups, []
        if not groups:
            return  # closed before
        # deleted, not None: a collective after close() raises, not runs on the default group
        del self.commit_pg, self.main_pg
        self._preempt_work = None
        for holder in (self.votes, self.drain.votes, self.wire):
            if holder is not None:
                del holder.pg
        forget_groups(groups)
        for pg in groups:
            try:
                dist.destroy_process_group(pg)
            except ValueError:
                pass  # gone with the default group already: dropping it is enough
            except Exception as e:
                log.warning(f"[titan_ckpt_plus] ending a process group at close(): {e!r}")
        self.background.forget(self._group_tids)

    def recover(self, load_resharded: Callable[[Any], int] | None = None, only_step: int = -1) -> Recovery:
        """Collective: the newest checkpoint every rank can load, found, fetched and
        checked (restore.Restorer.recover)."""
        return Restorer(self.s, self.local, self.pfs, self.commit_pg).recover(load_resharded, only_step)

    # ---- background side ------------------------------------------------------

    def record_failure(self, tier: str, step: int, why: str) -> None:
        if tier == "pfs":
            self.stats.failed_drains += 1
        elif tier == "replica":
            self.stats.failed_replicas += 1
        else:
            self.stats.failed_saves += 1
        log.error(f"[titan_ckpt_plus] {tier} save of step {step} failed ({why}); "
                  "training continues, older checkpoints are kept")
        self.events.record("save_failed", step=step, tier=tier, error=why)

    def _save_failed(self, job: _Job, why: str) -> None:
        """A save counts once in failed_saves, however many of its stages fail (a copy,
        then the write it left without bytes, then an unexpected error); each is logged."""
        with self._fail_lock:  # the copy thread and the writer
            first, job.counted_failed = not job.counted_failed, True
        if first:
            self.record_failure("local", job.step, why)
        else:
            log.error(f"[titan_ckpt_plus] local save of step {job.step} also failed: {why}")

    def _writer_loop(self) -> None:
        while (job := self._write_q.get()) is not None:
            try:
                self._write(job)
            except Exception as e:  # the thread must go on: the next save waits for it
                self._save_failed(job, f"the writer: {e!r}")
                if not job.voted:  # after its vote the buffer went as voted (_release_buffer, _drained)
                    self._vote_failed(job)
            finally:
                self.background.end(("write", job.step))
                self._write_q.task_done()
        self._write_q.task_done()

    def _vote_failed(self, job: _Job) -> None:
        """A save whose write raised before its vote: every rank votes on every save (or
        its next vote would pair with its peers' vote on this one), so it votes this one
        not written: no rank commits or drains it. What it held is freed."""
        try:
            self.votes.vote([False, False], job.step, None, (set(self.drain.steps), []))
        except Exception as e:
            log.warning(f"[titan_ckpt_plus] the vote on failed step {job.step}: {e!r}")
        job.staged.wait()  # the copy ends whatever happened (_copy), before the buffer is free
        self._drained(job)
        self._release_buffer(job)

    def _release_buffer(self, job: _Job) -> None:
        """The next save may copy into the staging buffer: only where this job took it in
        save(). A save that failed at staging never did, and by the time the writer gets
        to it a later save may hold the buffer."""
        if job.holds_buffer:
            job.holds_buffer = False
            self._buffer_free.set()

    def _write(self, job: _Job) -> None:
        """The local write follows the staging copy chunk by chunk, so a step is
        durable about one write after the save began, not one copy plus one write."""
        t0, cpu0, clock = time.monotonic(), time.thread_time(), PhaseClock()
        nbytes, own, helper = 0, None, self._job_helper(job)
        if job.layout is not None:  # planned; the copy may still be running
            try:
                data = self.buffer.data[: job.layout.total_bytes].numpy()
                if helper is not None:
                    manifest = helper.write_part(job.step, job.generation, len(data), lambda: self._describe(job))
                    layout_bytes = job.layout_bytes
                else:
                    manifest, layout_bytes = self.local.write_part(
                        job.step, data, lambda: self._describe(job),
                        on_chunk=lambda _n: self._write_faults(job.step),
                        before_chunk=job.progress.wait,
                        known_crc=(lambda: job.progress.crc) if job.progress.sums else None)
                own = Part(manifest, layout_bytes, data)
                job.manifest = manifest
                nbytes = own.nbytes()
            except Exception as e:
                why = repr(e)
                if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                    why += f"; local disk full: {self.local.disk_full_note()}"
                self._save_failed(job, why)
                own = None
        clock.mark("write")
        job.staged.wait()
        clock.mark("wait_copy")
        staged_ok = job.copied  # a failed copy also failed the write
        job.ok = own is not None
        write_s = time.monotonic() - t0
        if self.placement is not None:
            job.ok = self._replicate(job, own) and job.ok
            clock.mark("replicate")
        if job.pfs_due and staged_ok:
            # The drain copies the staged bytes while the buffer still holds them. If the
            # local disk failed this step they are its only copy: the buffer stays held
            # until the drain is done (the next save waits), so a full or broken local
            # disk does not stop the persistent tier. Else the next save takes them back.
            job.loan = StagedBytes(self.buffer.data[: job.layout.total_bytes].numpy(),
                                   reclaimable=own is not None, step=job.step, generation=job.generation,
                                   helper=job.helper)
            if job.loan.reclaimable:
                self._loans.append(job.loan)
        if job.loan is None or job.loan.reclaimable:
            self._release_buffer(job)
        # Every rank reaches this vote, failed or not, so the groups stay in step. The
        # marker is the node's first rank's: no request from the others.
        marker = ({"world_size": self.s.world_size, "layout_tag": self.s.layout_tag,
                   "node_ranks": self.s.node_ranks} if self.s.first_on_node else None)
        held = self.placement.sources(self.s.rank) if self.placement else []
        keep = (set(self.drain.steps) | ({job.step} if job.pfs_due else set()), held)
        try:  # with the hub, the helper also writes the marker and runs retention (done: not None)
            job.voted = True
            (committed, drainable), done = self.votes.vote(
                [job.ok, own is not None or job.loan is not None], job.step, marker, keep)
        except Exception as e:  # the hub could not decide (on every rank), or the group broke: none commits
            self._save_failed(job, f"the commit vote: {e}")
            job.ok = committed = drainable = False
            job.undecided = True  # a peer may have died mid-save: its files stay for recovery to judge
        clock.mark("vote")
        if not committed:
            if own is not None and not job.undecided:  # its write was fine: counted here, not yet
                self._save_failed(job, "another rank's part failed" if job.ok
                                  else "its replicas did not all arrive (above)")
            if job.pfs_due and drainable:
                # at once, on every rank alike: a rank whose write failed holds its staged
                # bytes (the buffer) until this drain is done, and its next save waits for it
                self.drain.submit(job, hold=False)  # from this rank's uncommitted part or memory
            else:
                self._drained(job)
            return
        job.committed = True
        self._last_committed_job = job
        try:
            if done:
                raise OSError(done)
            if done is None and marker is not None:
                self._on_local(helper, job.step, "commit", marker)
        except Exception as e:  # not a recovery candidate on this node; the drain goes on as voted
            self._save_failed(job, f"commit marker: {e!r}")
        else:
            clock.mark("commit")
            self.stats.saves += 1
            self.stats.last_committed = job.step
            commit_s = time.monotonic() - job.started
            self._last_local_write = time.monotonic() - t0
            try:  # a record that fails is a line in the log, not a failed save
                self._info(f"[titan_ckpt_plus] local step {job.step} committed: {nbytes / 2**20:.1f} MiB, "
                           f"staging {job.staging_s:.3f}s, write {write_s:.3f}s, durable after {commit_s:.3f}s")
                self.events.record("local_commit", step=job.step, tier="local", bytes=nbytes,
                                   staging_s=job.staging_s, background_write_s=write_s,
                                   time_to_commit_s=commit_s, cpu_s=time.thread_time() - cpu0,
                                   staging_cpu_s=job.staging_cpu_s, phases=clock.phases,
                                   by_helper=helper is not None, agreed_by=self.votes.kind)
            except Exception as e:
                log.warning(f"[titan_ckpt_plus] could not record local step {job.step}'s commit: {e!r}")
        finally:  # every rank hands a voted PFS step over, whatever befell its marker: drains pair up
            if job.pfs_due:
                self._drain(job)
        if done is None:
            try:
                self._on_local(helper, job.step, "retain", *keep)
            except Exception as e:  # OSError, or the byte helper's reply (CorruptCheckpoint)
                log.warning(f"[titan_ckpt_plus] local retention failed: {e!r}")

    @staticmethod
    def _job_helper(job: _Job) -> ByteHelper | None:
        """The byte helper that writes this job's part, if it has one still running and
        the staging did not fail in save() already (the helper would wait for a buffer
        it was never given); else the write stays here."""
        if job.helper is None or not job.helper.alive or job.progress.failed:
            return None
        return job.helper

    def _pfs_batch(self, folder: str, items: list) -> list[dict]:
        """A PFS step's manifest and .metadata (the drain thread's): by the byte helper
        while it runs, else here."""
        return by_helper(self.helper, lambda h: h.write_batch(folder, items),
                         lambda: files.write_batch(folder, items))

    def _on_local(self, helper: ByteHelper | None, step: int, method: str, *args):
        """LocalTier.`method`, run by the byte helper where it wrote the part (one
        request instead of a dozen file-system calls on this thread), else here."""
        return by_helper(helper, lambda h: h.tier(step, method, *args),
                         lambda: getattr(self.local, method)(step, *args))

    def _describe(self, job: _Job) -> tuple[bytes, dict]:
        """The layout's bytes and the manifest's fields, once the copy is done: made
        here, on the writer's thread (after the data's write; with the byte helper, while
        it writes), not by the copy, which may run in save() on the training thread. The
        fingerprint and chunk table come from the last layout while the tensor table is
        the same (a job's specs change only with its layout). What fails here fails the
        local write alone."""
        job.staged.wait()
        if not job.copied:
            raise RuntimeError("staging failed")
        if not job.layout.adopt(self._last_layout):
            job.layout.chunks = staging.chunk_table(job.layout, job.specs)
            if job.layout.chunks is None:
                log.warning("[titan_ckpt_plus] a shard's placement has no DCP chunk: this layout's local "
                            "steps reshard only from the PFS after a DP change (local_reshard)")
        self._last_layout = job.layout
        job.layout_bytes = job.layout.to_bytes()
        return job.layout_bytes, {"fingerprint": job.layout.fingerprint(), "layout_tag": self.s.layout_tag}

    def _discard(self, step: int) -> None:
        """A step the ranks did not commit: its parts here would only fill the disk."""
        try:
            held = self.placement.sources(self.s.rank) if self.placement else []
            self.local.discard(step, held)
        except OSError as e:
            log.warning(f"[titan_ckpt_plus] could not remove uncommitted local step {step}: {e!r}")

    @staticmethod
    def _write_faults(step: int) -> None:
        faults.maybe_kill("kill_during_local_write", step)
        faults.maybe_fail("enospc_local_write", step)

    def _replicate(self, job: _Job, own: Part | None) -> bool:
        """Send this rank's part to its peers and store its sources' parts, verified
        and fsync'd, before the commit vote: a committed step never relies on a
        half-sent copy. Runs on every rank, failed or not, to keep the group in step.
        An exchange that fails itself (a peer gone, the group's timeout) fails the save
        and ends this save's exchanges (the pairs are out of step), but not the writer:
        the vote still comes, and the next save tries again."""
        faults.maybe_kill("kill_during_replication", job.step)
        t0, ok, received = time.monotonic(), True, 0
        limit = 4 * (own.nbytes() if own else 0) + (64 << 20)
        peers, sources = self.placement.peers(self.s.rank), self.placement.sources(self.s.rank)
        for peer, src in zip(peers, sources):
            why = None
            try:  # the source's data goes to its file as it arrives, never whole in memory
                with self.local.receive_replica(job.step, src) as sink:
                    part, why = self.wire.exchange(peer, own, src, limit, sink=sink.write)
                    if part is None:
                        raise CorruptCheckpoint(why)
                    data = sink.entry()
                    check_part(part, src, job.step, self.s.world_size, self.s.job_id,
                               self.s.layout_tags[src], streamed=data)
                    sink.finish(part.manifest, part.layout)
                received += len(part.manifest) + len(part.layout) + data["size"]
            except Exception as e:
                ok = False
                if why is None:  # the exchange itself failed (its files are gone): not a bad copy
                    self.record_failure("replica", job.step, f"exchange with ranks {peer}/{src} failed: {e!r}")
                    break
                self.record_failure("replica", job.step, f"copy of rank {src}: {e}")
        seconds = time.monotonic() - t0
        sent = (own.nbytes() if own else 0) * len(peers)
        self.events.record("replication", step=job.step, seconds=seconds, bytes_sent=sent,
                           bytes_received=received, ok=ok)
        return ok

    def _drain(self, job: _Job) -> None:
        """Hand a step to the drain, or hold it until the next step boundary, so the
        local write and the drain's copy cost two steps a little each instead of one
        twice as much; late once the step it is handed over in ends."""
        self.drain.submit(job, hold=job.hold_drain)

    def _hold_drain(self, step: int) -> bool:
        """drain_start for a PFS save at `step`, decided in save(), where every rank's
        schedule is the same: "next_step"; "auto" unless the next step saves too, whose
        copy would take the staged bytes back at that very boundary."""
        if self.s.drain_start == "auto":
            return not self.schedule.due(step + 1)[0]
        return self.s.drain_start == "next_step"

    def _drained(self, job: _Job) -> None:
        """A step's drain is over (or none comes): free the staging buffer it held, and
        drop an uncommitted step's local files."""
        self.background.end(("drain", job.step))
        if job.loan is not None:
            job.loan.returned = True  # the next save may copy in save() again
            if not job.loan.reclaimable:
                self._release_buffer(job)
        job.loan = None
        if not job.committed and not job.undecided:
            self._discard(job.step)
