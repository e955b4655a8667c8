"""The node-local tier: one folder per node, shared by every job on the node; in it
one subfolder per job, one part per rank per step.

    <local_folder>/job-<id>/JOB.json    the job's identity and where its dump folder is
                           .lock        held by the node's first rank while it runs
                           .spare/rank-00003.data    a retired data file, written over by the
                                                     rank's next save (files.retire)
                           step-N/rank-00003.data    the rank's staged buffer: its tensors in
                                                     DCP's per-rank file form (staging.py)
                                  rank-00003.layout  where each tensor lives in it (plain pickle)
                                  rank-00003.json    manifest: sizes and CRC-32C of both, job id,
                                                     step, world size, layout (written last)
                                  COMMIT.json        written by the node's first rank once every
                                                     rank of the job reported its part durable

A job writes, commits, purges and recovers only in its own subfolder: jobs sharing a
node never touch each other's files. A step is a recovery candidate on this node only
with COMMIT.json, and a part only if its manifest names the job and matches what its
source rank expects (world size, that rank's shard shapes); checksums are checked when
the step is chosen. Each rank deletes only its own files, so no rank can delete a part
another rank of the node is still reading. Steps directly under `<local_folder>` were
written before job identities existed: no job loads them.
"""

import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass

from titan_ckpt_plus import faults
from titan_ckpt_plus.tiers import files

log = logging.getLogger("titan_ckpt_plus")

COMMIT = "COMMIT.json"
FETCHED = "FETCHED.json"  # in a step folder parts of another layout were fetched into (adopt_step)
OLD_LAYOUT = "OLD_LAYOUT.json"  # in a step folder saved with another layout at this world size (mark_old_layout)
JOB_PREFIX = "job-"
JOB_RECORD = "JOB.json"
LOCK = ".lock"


def part_of(m: dict | None, rank: int, step: int, job_id: str, world_size: int) -> bool:
    """Whether a part's manifest is `rank`'s part of `step` of this job at `world_size`."""
    return (isinstance(m, dict) and m.get("job_id") == job_id and m.get("rank") == rank
            and m.get("step") == step and m.get("world_size") == world_size)


def part_matches(m: dict | None, rank: int, step: int, job_id: str, world_size: int,
                 layout_tag: dict | None) -> bool:
    """Whether a part's manifest is `rank`'s part of `step` of this job, in the
    layout that rank has now (None: in any layout, as a run at another world size
    saved it)."""
    return part_of(m, rank, step, job_id, world_size) and layout_tag in (None, m.get("layout_tag"))


def part_file(rank: int, suffix: str) -> str:
    """A part's file (json, layout, data) in its step folder."""
    return f"rank-{rank:05d}.{suffix}"


def job_dir(local_folder: str, job_id: str) -> str:
    return os.path.join(local_folder, JOB_PREFIX + job_id)


class JobLock:
    """An exclusive lock on a job's subfolder, held by the node's first rank for the
    life of the process (the kernel drops it when the process dies). Tools tell a job
    that is still writing from leftovers by it, and a second process of one job on a
    node (two incarnations at once, or two nodes given one folder) is refused."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.path = os.path.join(folder, LOCK)
        self._fd: int | None = None
        self._fork_hook = False

    def acquire(self, wait_s: float = 0.0) -> str:
        """"" once held; else who holds it. Waits up to `wait_s` for a holder to let
        go: a killed incarnation's process can take a moment to exit, and a tool's
        probe holds the lock for microseconds. A folder removed meanwhile (by
        `titan-ckpt clean`, which holds the lock while it moves the folder away) is
        made again rather than locked in its old place."""
        deadline = time.monotonic() + wait_s
        while True:
            os.makedirs(self.folder, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                who = _holder(fd)
                os.close(fd)
                if time.monotonic() >= deadline:
                    return who
                time.sleep(0.05)
                continue
            if _same_file(self.path, fd):
                break
            os.close(fd)
        try:  # who holds it, for tools: not worth refusing a restart on a full disk
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)
        except OSError:
            pass
        self._fd = fd
        if not self._fork_hook:  # a forked child (a dataloader worker) must not keep it
            os.register_at_fork(after_in_child=self._forget)
            self._fork_hook = True
        return ""

    def _forget(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the child's copy only: the parent keeps the lock
            self._fd = None

    def release(self) -> None:
        self._forget()


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote into the lock file."""
    return os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"


def _same_file(path: str, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def claim_job_dir(folder: str, record: dict, wait_s: float = 30.0, look: bool = False) -> tuple[JobLock | None, str]:
    """The node's first rank, at start: make the job's subfolder, hold its lock and
    write JOB.json (who the job is, where its dump folder is, for tools and the other
    jobs' logs). Returns (the lock, "") or (None, why this process cannot use it):
    never raises, as the other ranks wait for the answer in a collective. `look`: the
    process is a load_only run, whose fix differs."""
    lock = JobLock(folder)
    try:
        who = lock.acquire(wait_s)
        if not who:
            remove_torn(folder)
            _write_record(folder, record)
            return lock, ""
    except OSError as e:
        lock.release()
        return None, (f"cannot use the local folder {folder} ({e}). Fix: [checkpoint] "
                      "local_folder on a writable node-local disk")
    if look:
        return None, (f"{folder} is in use by {who}, another process of this job. Fix: give this "
                      "load_only run a [checkpoint] local_folder of its own (it then loads the PFS "
                      "steps), or stop the other one")
    return None, (f"{folder} is in use by {who}, another process of this job: two "
                  "incarnations of one job, or two nodes given one local folder, cannot "
                  "share it. Fix: stop the other one, or put {node_rank} in "
                  "[checkpoint] local_folder so every node has its own")


def remove_torn(folder: str) -> list[str]:
    """With the job's lock held, before anything is written: a killed incarnation's
    half-written files (`<name>.tmp<pid>`, never renamed into place, never read).
    They would only fill the disk, and on a full one keep this incarnation from
    starting. Returns what was removed."""
    gone = []
    for d in [folder, *(os.path.join(folder, f"step-{s}") for s in steps_in(folder))]:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in names:
            if ".tmp" in n and n.rpartition(".tmp")[2].isdigit():
                os.remove(os.path.join(d, n))
                gone.append(os.path.join(d, n))
    return gone


def _write_record(folder: str, record: dict) -> None:
    """JOB.json, for tools. A restart of the same job on a disk too full for a new one
    keeps the record there (it names the job already): the lock, not the record, is
    what keeps another process out, and recovery may still use the disk's steps."""
    path = os.path.join(folder, JOB_RECORD)
    try:
        files.atomic_write_json(path, record)
    except OSError as e:
        old, _ = _record(folder)
        if old.get("job_id") != record.get("job_id"):
            raise
        log.warning(f"[titan_ckpt_plus] could not update {path} ({e!r}); the job's earlier record stays")


def lock_holder(folder: str) -> str:
    """Who holds `folder`'s job lock ("" if nobody): probed without blocking and
    without creating anything."""
    try:
        fd = os.open(os.path.join(folder, LOCK), os.O_RDONLY)
    except OSError:
        return ""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return ""
    except BlockingIOError:
        return _holder(fd)
    finally:
        os.close(fd)


@dataclass
class NodeJob:
    """One job's steps in a node's local folder, as found there."""

    job_id: str | None  # None: steps written before job identities (no subfolder)
    path: str
    record: dict  # its JOB.json ({} if missing or unusable)
    problem: str  # why JOB.json could not be used ("" if it could)
    steps: list[int]
    size: int
    newest: float  # mtime of the newest file, 0 if none
    writing: str  # who holds its lock ("" if nobody)

    def describe(self) -> str:
        if self.job_id is None:
            who = "steps without a job identity (written before them)"
        else:
            where = self.problem or f"dump folder {self.record['dump_folder']}"
            who = f"job {self.job_id} ({where})"
        n = len(self.steps)
        return f"{who}: {n} step{'s' if n != 1 else ''}, {files.human_bytes(self.size)}"

    def summary(self) -> dict:
        """What the start-up log and its event say of it."""
        return {"job_id": self.job_id, "dump_folder": self.record.get("dump_folder"),
                "steps": len(self.steps), "bytes": self.size, "text": self.describe()}


def tree_size(path: str) -> tuple[int, float]:
    """(bytes, newest mtime) of every file under `path`."""
    size, newest = 0, 0.0
    for base, _, names in os.walk(path):
        for n in names:
            try:
                st = os.stat(os.path.join(base, n))
            except OSError:
                continue
            size, newest = size + st.st_size, max(newest, st.st_mtime)
    return size, newest


def steps_in(folder: str) -> list[int]:
    """The N of every step-N in `folder`, sorted ([] if it cannot be listed)."""
    try:
        return sorted(s for s in map(files.step_of, os.listdir(folder)) if s is not None)
    except OSError:
        return []


def _record(folder: str) -> tuple[dict, str]:
    path = os.path.join(folder, JOB_RECORD)
    try:
        rec = files.read_json(path)
    except FileNotFoundError:
        return {}, f"{path}: missing"
    except (OSError, ValueError) as e:
        return {}, f"{path}: unreadable ({e})"
    if not isinstance(rec, dict) or not isinstance(rec.get("dump_folder"), str):
        return {}, f"{path}: not a job record"
    return rec, ""


def node_jobs(local_folder: str) -> list[NodeJob]:
    """Every job's steps in a node folder, and the steps written before job
    identities (job_id None), oldest job first."""
    out = []
    try:
        names = sorted(os.listdir(local_folder))
    except OSError:
        return []
    legacy = [n for n in names if files.step_of(n) is not None]
    if legacy:
        sizes = [tree_size(os.path.join(local_folder, n)) for n in legacy]
        out.append(NodeJob(None, local_folder, {}, "", sorted(map(files.step_of, legacy)),
                           sum(s for s, _ in sizes), max(t for _, t in sizes), ""))
    for n in names:
        path = os.path.join(local_folder, n)
        if not n.startswith(JOB_PREFIX) or not os.path.isdir(path):
            continue
        rec, problem = _record(path)
        out.append(NodeJob(n[len(JOB_PREFIX):], path, rec, problem, steps_in(path),
                           *tree_size(path), lock_holder(path)))
    return out


def others_note(local_folder: str, job_id: str) -> str:
    """For a failed write's message: what other jobs keep on this node's disk."""
    others = [j for j in node_jobs(local_folder) if j.job_id != job_id and j.steps]
    try:
        free = f"{files.human_bytes(shutil.disk_usage(local_folder).free)} free"
    except OSError:
        free = "free space unknown"
    if not others:
        return f"{local_folder}: {free}; no other job's steps there"
    total = sum(j.size for j in others)
    return (f"{local_folder}: {free}; other jobs' steps there take {files.human_bytes(total)} "
            f"({'; '.join(j.describe() for j in others)}). This job never deletes them: "
            f"see `titan-ckpt ls {local_folder}`, remove stale ones with "
            f"`titan-ckpt clean {local_folder}` (--dry-run first)")


class ReplicaSink:
    """Where a received replica's data goes, chunk by chunk, under its final name's
    temporary one; its size and CRC-32C kept on the way. write() never raises: the
    sender is still sending, and a receiver that stopped would leave it waiting; the
    first error is kept, and raised by entry()."""

    def __init__(self, tier: "LocalTier", batch: files.DurableBatch, step: int, rank: int) -> None:
        self.tier, self.batch, self.step, self.rank = tier, batch, step, rank
        self.out: files.Appender | None = None
        self.error: Exception | None = None

    def write(self, chunk) -> None:
        if self.error is not None:
            return
        try:
            if self.out is None:
                os.makedirs(self.tier.step_dir(self.step), exist_ok=True)
                self.out = self.batch.stream(self.tier._part(self.step, "data", self.rank),
                                             reuse=self.tier._spare(self.rank))
            self.out.write(chunk)
        except Exception as e:  # a full disk, a bad path: raised by entry(), after the exchange
            self.error = e

    def entry(self) -> dict:
        """The data's manifest entry as written."""
        if self.out is None:  # no data: an empty file
            self.write(b"")
        if self.error is not None:
            raise self.error
        return {"size": self.out.size, files.SUM: self.out.crc}

    def finish(self, manifest: bytes, layout: bytes) -> None:
        """The layout and, last, the manifest, made durable with the data."""
        self.tier._drop_stale(self.step, [self.rank])
        self.batch.write(self.tier._part(self.step, "layout", self.rank), layout)
        self.batch.write(self.tier._part(self.step, "json", self.rank), manifest)


class LocalTier:
    """One job's steps on this node: `root` is the job's subfolder (job_dir)."""

    def __init__(self, root: str, rank: int, world_size: int, first_on_node: bool,
                 keep_latest_k: int, job_id: str = "") -> None:
        self.root = root
        self.job_id = job_id
        self.rank = rank
        self.world_size = world_size
        self.first_on_node = first_on_node
        self.keep_latest_k = keep_latest_k
        os.makedirs(root, exist_ok=True)

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step}")

    def disk_full_note(self) -> str:
        """What other jobs keep on this node's disk (the root is under the node folder)."""
        return others_note(os.path.dirname(self.root), self.job_id)

    def _part(self, step: int, suffix: str, rank: int | None = None) -> str:
        return os.path.join(self.step_dir(step), part_file(self.rank if rank is None else rank, suffix))

    def write_part(self, step: int, data, describe, on_chunk=None, before_chunk=None,
                   known_crc=None) -> tuple[bytes, bytes]:
        """Write this rank's part durably; returns its manifest's bytes (what a
        replica receiver stores as is) and its layout's. `describe()` gives the layout
        bytes and the manifest's fields; it is called once the data is written (the
        engine pickles the layout then, off the training thread). Raises on I/O error. Run by
        the training process's writer thread, or by the byte helper process."""
        os.makedirs(self.step_dir(step), exist_ok=True)
        self._drop_stale(step, [self.rank])
        with files.DurableBatch() as batch:
            path, spare = self._part(step, "data"), self._spare(self.rank)
            data_entry = batch.write(path, data, on_chunk, before_chunk, known_crc, reuse=spare)
            layout_bytes, meta = describe()
            manifest = dict(meta, job_id=self.job_id, step=step, rank=self.rank,
                            world_size=self.world_size, written_at=time.time())
            manifest["files"] = {"data": data_entry,
                                 "layout": batch.write(self._part(step, "layout"), layout_bytes)}
            raw = files.json_bytes(manifest)
            batch.write(self._part(step, "json"), raw)
        return raw, layout_bytes

    @contextlib.contextmanager
    def receive_replica(self, step: int, rank: int):
        """A copy of another rank's part written as it arrives: yields a ReplicaSink
        (the Wire's sink), `finish`ed with the part's manifest and layout once they
        are checked; made durable on a clean exit, removed on an exception."""
        with files.DurableBatch() as batch:
            yield ReplicaSink(self, batch, step, rank)

    def _drop_stale(self, step: int, ranks: list[int]) -> None:
        """A step number saved again (after a restart from an older step) must not
        keep the previous incarnation's commit or manifests."""
        stale = [self._part(step, "json", r) for r in ranks]
        if self.first_on_node and self.rank in ranks:
            stale.append(os.path.join(self.step_dir(step), COMMIT))
        for p in stale:
            if os.path.exists(p):
                os.remove(p)

    def commit(self, step: int, info: dict) -> None:
        """The marker's directory fsync also makes the parts' renames durable (they
        are in the same folder and came first); the root's, the step folder's name."""
        if self.first_on_node:
            faults.maybe_fail("eio_commit_marker", step)
            files.atomic_write_json(os.path.join(self.step_dir(step), COMMIT),
                                    dict(info, job_id=self.job_id, step=step, committed_at=time.time()))
            files.fsync_dir(self.root)

    def wait_for_commit(self, step: int, timeout_s: float = 2.0) -> None:
        """Until this node's first rank has written the step's COMMIT.json. Deleting
        old parts makes the file system commit its journal; the other ranks wait for
        the marker before they purge, so that work does not land inside the marker's
        fsync (it made the commit 10 ms slower, one save in three)."""
        path = os.path.join(self.step_dir(step), COMMIT)
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.001)

    def retain(self, step: int, protected: set[int], held: list[int]) -> list[int]:
        """Retention after `step` was voted committed (purge), once this node's first
        rank has its marker (wait_for_commit)."""
        if not self.first_on_node:
            self.wait_for_commit(step)
        return self.purge(protected, held, committed_now=step)

    def steps(self) -> list[int]:
        return steps_in(self.root)

    def committed_steps(self, steps: list[int] | None = None) -> list[int]:
        """Of `steps` (all of them if None), those with a commit marker."""
        return [s for s in (self.steps() if steps is None else steps)
                if os.path.isfile(os.path.join(self.step_dir(s), COMMIT))]

    def manifest(self, step: int, rank: int | None = None) -> dict | None:
        try:
            return files.read_json(self._part(step, "json", rank))
        except (OSError, ValueError):
            return None

    def held_parts(self, layout_tags: list[dict]) -> dict[int, list[int]]:
        """Committed step -> ranks whose parts (own node's or replicas) this folder
        holds with a manifest of this job that matches what that rank expects: the
        world size and the *source* rank's layout (`layout_tags[r]`; uneven shards
        differ between ranks). Checksums are checked later, when a step is chosen."""
        out = {}
        for s in self.committed_steps():
            commit = self._commit_record(s)
            if commit.get("job_id") != self.job_id:
                continue
            ranks = []
            for name in os.listdir(self.step_dir(s)):
                if name.startswith("rank-") and name.endswith(".json") and name[5:-5].isdigit():
                    r = int(name[5:-5])
                    if r < len(layout_tags) and self._whole(s, r, len(layout_tags), layout_tags[r]):
                        ranks.append(r)
            if ranks:
                out[s] = sorted(ranks)
        return out

    def other_layout_steps(self, held: dict[int, list[int]], layout_tags: list[dict]) -> dict[int, str]:
        """Committed steps of this job saved at another world size, or with a part of
        another sharding, and no part that fits this layout (`held`: held_parts() of
        `layout_tags`) -> why: not loaded as they are (a reshard may load them), but
        worth a line in the log, and a refusal if nothing else can be loaded."""
        out = {}
        for s in self.committed_steps():
            commit = self._commit_record(s)
            if s in held or commit.get("job_id") != self.job_id:
                continue
            was = commit.get("world_size")
            if was != self.world_size:
                out[s] = f"saved at world size {was}, now {self.world_size}"
            elif len(layout_tags) == was and any(
                    part_of(m := self.manifest(s, r), r, s, self.job_id, was)
                    and not part_matches(m, r, s, self.job_id, was, layout_tags[r]) for r in range(was)):
                out[s] = "saved with another parallel layout"
        return out

    def mark_old_layout(self, other: dict[int, str], held: dict[int, list[int]]) -> None:
        """At recovery, by the node's first rank: a step saved with another parallel
        layout at this world size (`other`: other_layout_steps) is marked as the old
        run's (old_run_steps), so it takes none of the slots retention keeps for this
        run's steps and goes whole; a marked step that fits this layout again (`held`:
        the job went back to it before committing a step) is unmarked."""
        if not self.first_on_node:
            return
        for s in other:
            if self._commit_record(s).get("world_size") == self.world_size:
                files.atomic_write_json(os.path.join(self.step_dir(s), OLD_LAYOUT), {"world_size": self.world_size})
        for s in held:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.step_dir(s), OLD_LAYOUT))

    def old_run_steps(self, steps: list[int] | None = None) -> list[int]:
        """Of `steps` (all if None), the committed ones saved at another world size or
        marked as of another layout (fetched into, or found at recovery): steps of this
        job before a DP or layout change. They never count among the steps retention keeps (their
        numbers may be ahead of this job's), and go whole."""
        out = []
        for s in self.committed_steps(steps):
            was = self._commit_record(s).get("world_size")
            if (isinstance(was, int) and was != self.world_size) or any(
                    os.path.exists(os.path.join(self.step_dir(s), m)) for m in (FETCHED, OLD_LAYOUT)):
                out.append(s)
        return out

    def drop_after(self, step: int) -> list[int]:
        """After a restart at `step`: the node's first rank removes every step newer than
        it, the timeline the job left (the job saves those numbers again): one that failed
        its checks, one of another layout, or one after `load_step` = `step`. Kept, a
        newer step would take retention's slots from the new run's and be loaded in
        their place by the next restart. Before any save, so no rank writes in them.
        Returns the steps removed."""
        if not self.first_on_node:
            return []
        gone = [s for s in self.steps() if s > step]
        for s in gone:
            self._remove_whole(s)
        return gone

    def _remove_whole(self, step: int) -> None:
        """A step of the job before a DP or layout change: no rank of this run holds its
        parts and replicas by their old ranks, so the node's first rank removes the folder."""
        shutil.rmtree(self.step_dir(step), ignore_errors=True)

    def other_layout_parts(self, steps) -> dict[int, tuple[int, list[int]]]:
        """Of `steps` (other_layout_steps: this job's, saved under another layout), step
        -> (the world size it was saved at, the ranks of that run whose parts this folder
        holds: its node's and replicas). DCP reshards a step from a folder holding it
        whole (tiers/reshard.py; recovery.reshard_plans fetches what one lacks).
        Checksums are checked when one is chosen."""
        out = {}
        for s in steps:
            was = self._commit_record(s).get("world_size")
            if isinstance(was, int) and was > 0:
                out[s] = (was, [r for r in range(was) if self._whole(s, r, was)])
        return out

    def _whole(self, step: int, rank: int, world_size: int, layout_tag: dict | None = None) -> bool:
        """Whether the folder holds `rank`'s part of `step` (in `layout_tag`'s layout, if
        given) with its data file at its size: a reshard fetches another node's
        manifests and layouts alone, and the data only of the parts it reads."""
        m = self.manifest(step, rank)
        if not part_matches(m, rank, step, self.job_id, world_size, layout_tag):
            return False
        try:
            return os.path.getsize(self._part(step, "data", rank)) == m["files"]["data"]["size"]
        except (OSError, KeyError, TypeError):
            return False

    def adopt_step(self, step: int, world_size: int) -> None:
        """Before parts of the run at `world_size` are fetched into this folder's `step`:
        a marker, so retention removes the step whole as a step of another layout, even
        at this world size or if a fetch fails midway (old_run_steps); and a commit
        record if the folder had none (a new node), with that world size."""
        os.makedirs(self.step_dir(step), exist_ok=True)
        files.atomic_write_json(os.path.join(self.step_dir(step), FETCHED), {"world_size": world_size})
        path = os.path.join(self.step_dir(step), COMMIT)
        if not os.path.exists(path):
            files.atomic_write_json(path, {"world_size": world_size, "job_id": self.job_id, "step": step,
                                           "fetched_at": time.time()})

    def old_run_view(self, world_size: int) -> "LocalTier":
        """This folder as a rank of the run that saved a step at `world_size` sees it,
        to store a part of that run fetched at recovery (receive_replica) without
        touching the step's commit record."""
        return LocalTier(self.root, 0, world_size, False, self.keep_latest_k, self.job_id)

    def checked_part_files(self, step: int, rank: int, data: bool = True) -> tuple[bytes, int]:
        """(layout bytes, data bytes read) of a part, its layout checked against its
        manifest, and its data file too with `data` (read once, in chunks, not kept)."""
        m = self._present_manifest(step, rank)
        path = self._part(step, "layout", rank)
        with open(path, "rb") as f:
            layout = f.read()
        files.check_bytes(path, layout, m["files"]["layout"])
        if not data:
            return layout, 0
        files.check_file(self._part(step, "data", rank), m["files"]["data"])
        return layout, m["files"]["data"]["size"]

    def _commit_record(self, step: int) -> dict:
        try:
            rec = files.read_json(os.path.join(self.step_dir(step), COMMIT))
        except (OSError, ValueError):
            return {}
        return rec if isinstance(rec, dict) else {}

    def _read(self, step: int, suffix: str, rank: int | None) -> bytes:
        with open(self._part(step, suffix, rank), "rb") as f:
            return f.read()

    def read_raw(self, step: int, rank: int | None = None, data: bool = True):
        """The part's three files as stored (manifest, layout, data), unverified; the
        data in a new buffer (recovery loads it), or empty without `data`."""
        path = self._part(step, "data", rank)
        out = bytearray(os.path.getsize(path) if data else 0)
        if data:
            with open(path, "rb") as f:
                f.readinto(out)
        return self._read(step, "json", rank), self._read(step, "layout", rank), out

    def read_part(self, step: int, rank: int | None = None) -> tuple[bytes, bytearray, int]:
        """(layout bytes, data, bytes read), both verified against the manifest."""
        m = self._present_manifest(step, rank)
        _, layout, data = self.read_raw(step, rank)
        files.check_bytes(self._part(step, "layout", rank), layout, m["files"]["layout"])
        files.check_bytes(self._part(step, "data", rank), data, m["files"]["data"])
        return layout, data, len(layout) + len(data)

    def data_file(self, step: int, manifest: bytes | None = None) -> tuple[str, dict]:
        """(path, manifest entry) of this rank's data file of `step`: what the drain
        reads when the staged bytes are gone. `manifest`: the part's, as write_part
        returned it (else read here; raises if the part is not there)."""
        entry = json.loads(manifest) if manifest is not None else self._present_manifest(step)
        return self._part(step, "data"), entry["files"]["data"]

    def _present_manifest(self, step: int, rank: int | None = None) -> dict:
        m = self.manifest(step, rank)
        if m is None:
            raise files.CorruptCheckpoint(f"{self._part(step, 'json', rank)}: missing or unreadable")
        return m

    def _spare(self, rank: int) -> str:
        """Where retention retires the rank's data files (files.retire): the disk
        holds one more part per rank at rest, and no more while a step is written."""
        return os.path.join(self.root, files.SPARE, part_file(rank, "data"))

    def _remove_step(self, s: int, held: list[int]) -> None:
        d = self.step_dir(s)
        gone = contextlib.suppress(FileNotFoundError)  # a file another rank or a torn write left out
        if self.first_on_node:
            with gone:
                os.remove(os.path.join(d, COMMIT))
        for r in [self.rank, *held]:
            for suffix in ("json", "layout"):
                with gone:
                    os.remove(self._part(s, suffix, r))
            with gone:
                files.retire(self._part(s, "data", r), self._spare(r))
        try:
            os.rmdir(d)
        except OSError:
            # leftovers of a torn write: remove once no rank's manifest remains
            if not any(n.startswith("rank-") and n.endswith(".json") for n in os.listdir(d)):
                shutil.rmtree(d, ignore_errors=True)

    def discard(self, step: int, held: list[int]) -> None:
        """Remove this rank's files of an uncommitted step (own part, received copies)."""
        if os.path.isdir(self.step_dir(step)):
            try:
                self._remove_step(step, held)
            except FileNotFoundError:
                pass

    def purge(self, protected: set[int], held: list[int] | None = None,
              committed_now: int | None = None) -> list[int]:
        """Keep the newest `keep_latest_k` committed steps, anything newer than the
        newest commit (being written) and `protected` (being drained); delete the
        files this rank is responsible for (its own part, and the replicas it received
        from `held` ranks) of every other step; the old run's steps (old_run_steps)
        never count as kept, and the node's first rank removes them whole once this
        run has a commit. Returns the steps touched.
        `committed_now`: the step all ranks just voted committed, which counts even
        before this node's first rank has written its COMMIT.json."""
        steps = self.steps()
        other = set(self.old_run_steps(steps))  # before a DP or layout change: gone once this job commits
        committed = sorted(set(self.committed_steps(steps)) - other | ({committed_now} - {None}))
        if not committed:
            return []
        keep = set(committed[-self.keep_latest_k:]) | protected
        newest = committed[-1]
        gone = []
        for s in steps:
            if s in keep or (s > newest and s not in other):
                continue
            gone.append(s)
            if s not in other:
                with contextlib.suppress(FileNotFoundError):  # another rank of this node removed it first
                    self._remove_step(s, held or [])
            elif self.first_on_node:
                self._remove_whole(s)
        return gone
