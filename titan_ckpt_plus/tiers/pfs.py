"""The persistent tier: torchtitan's own DCP layout on the parallel file system.

    <dump_folder>/<folder>/step-N/.metadata, __R_I.distcp   written by dcp.save
                               titan_ckpt_plus.json          the job's id, size and
                                                             CRC-32C per file
    <dump_folder>/<folder>/full_state/step-N/               the last step's full state,
                                                             where torchtitan's export
                                                             holds step-N (see below)
    <dump_folder>/<folder>/.spare/<job id>/rank-R.distcp    a purged step's data file,
                                                             which rank R's next drain
                                                             writes over (_spare)

At the last step stock torchtitan writes an export to step-N: the model only (by
default), in `export_dtype`, as DCP or HF safetensors. Tools downstream read it
there, so it is written there, as stock writes it, with a manifest of kind "export";
the job's full state for that step goes to full_state/step-N (a name stock
torchtitan's step search does not match). An export is never a recovery candidate
and never purged: `steps()` lists resumable steps only.

A step's data files are not serialized again: each rank's local part is already in
DCP's per-rank form (staging.py lays every tensor out inside its torch.save frame), so
PartCopyWriter copies the items DCP's own planner gives the rank from the part's bytes,
read once in order and checked, and serializes only the small non-tensor items (each
value once: SmallItems). DCP plans a layout's first step; the later steps of that
layout reuse the plan and its Metadata (KeptPlan). Rank 0 writes the manifest, then
the .metadata that completes the step, the same Metadata DCP's own writer would.

Stock torchtitan loads these steps as they are (it ignores the extra manifest) and
DCP reshards them to another parallel layout. A step without `.metadata` is torn and
never used; one without our manifest (written by stock torchtitan) is used unverified,
as is one whose manifest has no job id (written before job identities); one whose
manifest names another job is never used (`owners()`).
"""

import io
import os
import pickle
import shutil
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from titan_ckpt_plus import staging
from titan_ckpt_plus.telemetry import PhaseClock
from titan_ckpt_plus.tiers import files
from titan_ckpt_plus.tiers.metadata_pickle import MetadataPickle
from titan_ckpt_plus.tiers.pfs_folder import MANIFEST, PfsFolder, read_owner


class CountingReader(FileSystemReader):
    """A FileSystemReader that counts the bytes DCP asks it for."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.bytes_read = 0

    def read_data(self, plan, planner):
        for req in plan.items:
            self.bytes_read += self.storage_data[req.storage_index].length
        return super().read_data(plan, planner)


SPAN_GAP = 64 << 10  # a gap this short (a replicated scalar's frame) is copied, keeping a span whole


class SmallItems:
    """The small non-tensor items torch.save'd as DCP does, memoized by value: a
    torchtitan optimizer's flattened param groups give hundreds per rank (lr, betas,
    eps ... per parameter), nearly all the same at every step, and one torch.save
    each cost a drain tens of ms of CPU."""

    LIMIT = 4096

    def __init__(self) -> None:
        self._memo: dict = {}

    def serialize(self, obj) -> bytes:
        try:
            key = (type(obj), pickle.dumps(obj, protocol=4))
        except Exception:  # not picklable as is: torch.save decides
            key = None
        out = self._memo.get(key) if key is not None else None
        if out is None:
            buf = io.BytesIO()
            torch.save(obj, buf)
            out = buf.getvalue()
            if key is not None:
                if len(self._memo) >= self.LIMIT:
                    self._memo.clear()
                self._memo[key] = out
        return out


class PartCopyWriter(FileSystemWriter):
    """torchtitan's default DCP writer (one file per rank, fsync'd), whose tensor items
    are copied from a part already in DCP's per-rank form instead of torch.save'd.

    `source` copies the part's bytes (drain.PartSource.copy: from the staged buffer, or
    the local file checked as it is read; by the byte helper process where there is
    one); `layout` says where each tensor's torch.save frame is
    in them. The frames of this rank's items are copied as page-aligned spans, so the
    bulk goes to the file with O_DIRECT where it is taken, and a part whose items are
    all this rank's (FSDP, TP, PP) is copied verbatim, its CRC-32C then the local
    manifest's. An item DCP gave to another rank (a replicated tensor is written once)
    is skipped when it leaves a gap of SPAN_GAP or more. The small items follow in one
    write. `written`: each file's size and CRC-32C, for the manifest; `small_lengths`:
    the small items' sizes in plan order; `before_write` runs before the copy (faults; a
    byte helper making the copy fires that fault itself).

    finish() makes the step's Metadata as DCP's own writer does but does not write it:
    PfsTier writes it after the manifest, so a step complete by DCP's rule (it has a
    .metadata) always has its checksums."""

    def __init__(self, path: str, layout, source, before_write=None, clock=None,
                 small: SmallItems | None = None, reuse: str | None = None) -> None:
        super().__init__(path)
        self.layout, self.source, self.before_write = layout, source, before_write
        self.reuse = reuse  # a spare data file to write over (PfsTier._spare)
        self.clock = clock or PhaseClock()
        self.small = small or SmallItems()
        self.written: dict[str, dict] = {}
        self.small_lengths: list[int] = []
        self._tail = b""  # the small items, serialized
        self.plan = self.metadata = self.items = None  # what DCP planned, kept for the next drains
        self.mappings: dict = {}

    def write_data(self, plan, planner):
        """DCP's call: prepare() and copy()."""
        results = self.prepare(plan, planner)
        self.copy()
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def prepare(self, plan, planner) -> list:
        """Where the plan's items go, and the small items serialized; returns the
        WriteResults. `planner`: DCP's, or a KeptPlan (a later step of a planned layout:
        where each tensor item goes is the same as for the first, only the small items'
        values are new)."""
        self.plan = plan
        placed = planner.items if isinstance(planner, KeptPlan) else None
        self.mappings = (planner.mappings if placed
                         else {item.index.fqn: planner.mappings[item.index.fqn] for item in plan.items})
        self.items = placed = placed or self._place(plan, self.mappings)
        blobs = [(item, self.small.serialize(staging.value_at(self.layout.skeleton, path)))
                 for item, path in placed.small]
        self.clock.mark("items")
        results, at = list(placed.results), sum(b - a for a, b in placed.spans)
        for item, data in blobs:  # train_state, the dataloader's, lr ...: as DCP serializes them
            results.append(WriteResult(item.index, len(data), _StorageInfo(placed.name, at, len(data))))
            at += len(data)
        self._tail = b"".join(data for _, data in blobs)
        self.small_lengths = [len(data) for _, data in blobs]
        return results

    def copy(self) -> dict:
        """The prepared file, written: the spans, the small items after them, its fsync.
        Returns `written`."""
        if self.before_write:
            self.before_write()
        name = self.items.name
        self.written[name] = self.source.copy(os.path.join(self.path, name), self.reuse, self.items.spans,
                                              self._tail)
        self.clock.mark("copy")
        return self.written

    def copy_request(self) -> tuple:
        """What the byte helper needs to make copy() (PartSource.request)."""
        return self.source.request(os.path.join(self.path, self.items.name), self.reuse, self.items.spans,
                                   self._tail)

    def _place(self, plan, mappings: dict) -> "PlacedItems":
        """Where the plan's items are in the part and go in the file."""
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        frames = {e.path: e for e in self.layout.entries}
        tensors, small = [], []
        for item in plan.items:
            path = mappings[item.index.fqn]
            if item.type == WriteItemType.BYTE_IO:
                small.append((item, path))
                continue
            e = frames.get(staging.entry_path(path))
            if e is None or not e.pre:
                raise files.CorruptCheckpoint(f"{item.index.fqn}: not in the part's layout, or not framed")
            tensors.append((e.frame, item))
        spans = spans_of([f for f, _ in tensors], self.layout.total_bytes, SPAN_GAP)
        results = [WriteResult(item.index, end - start, _StorageInfo(name, _moved(start, spans), end - start))
                   for (start, end), item in tensors]
        return PlacedItems(name, spans, results, small)

    def finish(self, metadata, results) -> None:
        """FileSystemWriter.finish without the write (see the class)."""
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for wr_list in results for wr in wr_list}
        metadata.storage_meta = self.storage_meta()
        self.metadata = metadata


@dataclass
class PlacedItems:
    """A plan's items placed (PartCopyWriter._place): the same for every step of a
    layout, so a KeptPlan keeps them (a drain's Python holds the GIL training wants)."""

    name: str  # the rank's data file
    spans: list  # the part's spans that hold the tensor items, in order
    results: list  # the tensor items' WriteResults
    small: list  # (item, object path) of each small item, in plan order


@dataclass
class KeptPlan:
    """What DCP planned for a layout's first PFS step, kept for the layout's later steps
    (DCP would plan them the same way): this rank's plan and DCP's item names; on rank
    0 the step's Metadata, and where each file's small items start and how long they
    are, which is all that changes from step to step."""

    key: tuple
    plan: Any
    mappings: dict  # item name -> object path in the state
    small: SmallItems
    metadata: Any = None  # rank 0
    items: PlacedItems | None = None
    small_items: dict = field(init=False)  # rank 0: file -> (start, [index], [length])
    pickler: MetadataPickle = field(init=False, default_factory=MetadataPickle)  # rank 0

    def __post_init__(self) -> None:
        self.small_items = self.small_items_of(self.metadata) if self.metadata is not None else {}

    @staticmethod
    def small_items_of(metadata) -> dict:
        """file -> (where its small items start, their indexes and lengths in write order)."""
        by_file: dict = {}
        for index, info in metadata.storage_data.items():
            if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata):
                by_file.setdefault(info.relative_path, []).append((info.offset, index, info.length))
        out = {}
        for name, items in by_file.items():
            items.sort(key=lambda t: t[0])
            out[name] = (items[0][0], [i for _, i, _ in items], [n for _, _, n in items])
        return out

    def update(self, name: str, lengths: list[int]) -> None:
        """Rank 0: a file's small items as this step wrote them."""
        start, indexes, known = self.small_items.get(name, (0, [], []))
        if lengths == known:
            return
        if len(lengths) != len(indexes):
            raise files.CorruptCheckpoint(f"{name}: {len(lengths)} small items written, {len(indexes)} planned")
        at = start
        for index, n in zip(indexes, lengths):
            self.metadata.storage_data[index] = _StorageInfo(name, at, n)
            at += n
        self.pickler.changed("storage_data")
        self.small_items[name] = (start, indexes, lengths)


def spans_of(frames: list[tuple[int, int]], total: int, gap: int) -> list[tuple[int, int]]:
    """Page-aligned (start, end) spans of a part that cover `frames`, in order; a gap
    shorter than `gap` between two is copied too."""
    out: list[list[int]] = []
    for start, end in sorted(frames):
        a, b = start // files.PAGE * files.PAGE, min(-(-end // files.PAGE) * files.PAGE, total)
        if out and a - out[-1][1] < gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _moved(offset: int, spans: list[tuple[int, int]]) -> int:
    """Where a byte of the part lands in the copy: spans are written back to back."""
    at = 0
    for a, b in spans:
        if a <= offset < b:
            return at + offset - a
        at += b - a
    raise ValueError(f"offset {offset} is in no span")


def describe(e: BaseException) -> str:
    """repr(e); DCP's CheckpointException as each rank's error, without the frames."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, dict):
        return repr(e)
    return "; ".join(f"rank {r}: {f[0] if isinstance(f, tuple) else f!r}"
                     for r, f in sorted(failures.items()))


def all_ranks(flags: list[bool], pg) -> list[bool]:
    """Collective: for each flag, whether it holds on every rank."""
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=pg)
    return [bool(v) for v in t.tolist()]


FRAME = 4096  # bytes a rank in gather()'s one collective, to start with
MAX_FRAME = 64 << 10  # beyond this, all_gather_object
TOO_LARGE = 0xFFFFFFFF  # gather(): this rank's object did not fit its frame
_frames: dict = {}  # process group -> its frame, grown where an object did not fit


def gather(obj, pg) -> list:
    """Collective: dist.all_gather_object for a few KiB a rank (a drain's file sizes,
    CRCs and small items' lengths), as one all_gather of fixed-size frames:
    all_gather_object's two collectives and dozen tensor ops each hand the GIL to the
    training thread and take it back (about 12 of a launch-bound loop's waits a call
    against 7 here, BENCHMARKS.md). An object too large for its frame: all_gather_object,
    on every rank (each sees that frame's mark), and the group's frame grows to fit the
    largest (every rank computes the same size from the same objects)."""
    data = pickle.dumps(obj)
    n, frame = dist.get_world_size(pg), _frames.get(pg, FRAME)
    frames, mine = torch.empty(n, frame, dtype=torch.uint8), torch.zeros(frame, dtype=torch.uint8)
    fits = len(data) <= frame - 4
    buf = mine.numpy()
    buf[:4] = np.frombuffer((len(data) if fits else TOO_LARGE).to_bytes(4, "little"), np.uint8)
    if fits:
        buf[4 : 4 + len(data)] = np.frombuffer(data, np.uint8)
    dist.all_gather(list(frames), mine, group=pg)
    got = frames.numpy()
    lengths = [int.from_bytes(f[:4].tobytes(), "little") for f in got]
    if TOO_LARGE in lengths:
        out: list = [None] * n
        dist.all_gather_object(out, obj, group=pg)
        need = max(len(pickle.dumps(o)) for o in out) + 4
        if need <= MAX_FRAME:
            _frames[pg] = 1 << (need - 1).bit_length()
        return out
    return [pickle.loads(f[4 : 4 + k].tobytes()) for f, k in zip(got, lengths)]


def forget_groups(groups) -> None:
    """The groups are ended: gather() holds no reference that would keep them (and
    their gloo threads) alive."""
    for pg in groups:
        _frames.pop(pg, None)


def agree(why: str, pg) -> str:
    """Collective: "" if every rank's check passed, else every failing rank's reason
    (so the log on rank 0 names the file that failed on rank 5)."""
    reasons = gather(why, pg)
    return "; ".join(f"rank {r}: {w}" for r, w in enumerate(reasons) if w)


class PfsTier(PfsFolder):
    """The PFS folder (PfsFolder) and the DCP steps in it: written by the drain
    (save), checked and loaded at recovery, exports recorded."""

    def __init__(self, folder: str, rank: int, world_size: int, keep_latest_k: int,
                 job_id: str = "", reuse_files: bool = True, write_batch=files.write_batch) -> None:
        super().__init__(folder, rank, world_size, keep_latest_k, job_id, reuse_files, write_batch)
        self._kept: KeptPlan | None = None  # the plan of the layout drained last: see save()
        self.retained: dict[int, tuple] = {}  # step -> the byte helper's purge_outcome() after sealing it

    def dcp_keys(self, path: str) -> list[str] | None:
        try:
            return list(FileSystemReader(path).read_metadata().state_dict_metadata)
        except Exception:
            return None

    def save(self, step: int, layout, specs: dict, source, votes, before_write=None,
             beside_export: bool = False, clock=None, why: str = "") -> int:
        """Collective over `votes` (votes.py: its agreements, and `votes.pg`, the gloo
        group DCP plans a layout's first step over): this rank's part of the step, copied from `source` (laid
        out as `layout` says; `specs`: the DTensors' for DCP's planner; None if this
        rank could not read its part, `why`), then rank 0's manifest and .metadata.
        Returns this rank's bytes. `beside_export`: the last step, whose step-N
        torchtitan's export will hold.

        The first step of a layout is planned by dcp.save with PartCopyWriter. DCP would
        make the same plan and .metadata for every later step of that layout, at a cost
        in Python and collectives the copy does not have (most of a drain's CPU on a
        small model), so they are kept (KeptPlan): a later step is one agreement (every
        part readable, the folder clear, the plan kept), the copy, one gather of what
        every rank wrote, and rank 0's manifest and .metadata. With the byte helper all
        of that is one request (votes.copy_planned), PFS retention too on rank 0: what
        it did is kept in `retained` for the drain."""
        clock = clock or PhaseClock()
        path = self._dir(step, beside_export)
        blocked = self._make_room(path) if self.rank == 0 else ""
        clock.mark("clear")
        key = (layout.fingerprint(), layout.structure())
        kept = self._kept if self._kept and self._kept.key == key else None
        small = kept.small if kept else SmallItems()
        writer = PartCopyWriter(path, layout, source, before_write, clock, small, self._spare(self.rank))
        flags = [source is not None, not blocked, kept is not None]
        sealed = None
        if kept is not None and source is not None:  # agreed, copied and gathered in one go
            (readable, room, planned), gathered, sealed = self._copy_planned(step, writer, kept, flags, votes)
        else:
            (readable, room, planned), gathered = votes.all_ranks(flags, step), None
        if not readable:
            raise files.CorruptCheckpoint(why if source is None else "another rank could not read its part")
        if not room:
            raise files.CorruptCheckpoint(blocked or f"rank 0 could not make room at {path} (see its log)")
        if sealed is not None:  # by the byte helper, which ran retention after it
            self.retained[step] = sealed
        elif planned:
            self._seal_planned(step, writer, kept, gathered)
        else:
            dcp.save(staging.rebuild(layout, None, specs), checkpoint_id=path, storage_writer=writer,
                     planner=DefaultSavePlanner(), process_group=votes.pg)
            gathered = votes.gather(writer.written, step)
            self._kept = KeptPlan(key, writer.plan, writer.mappings, small, writer.metadata, writer.items)
            if self.rank == 0:
                self.seal(step, path, {k: v for part in gathered for k, v in part.items()},
                          pickle.dumps(writer.metadata))
            clock.mark("dcp_save")
        return sum(v["size"] for v in writer.written.values())

    def _copy_planned(self, step: int, writer: "PartCopyWriter", kept: KeptPlan, flags: list[bool], votes):
        """Collective: the start agreement over `flags` and, if every rank holds them all,
        the step written to the kept plan and every rank's outcome gathered
        (votes.copy_planned: by the byte helper in one request, where there is one,
        which on rank 0 also seals the step and runs retention if no small item moved:
        the .metadata is pickled for that here, before the copy). Returns the agreed
        flags, the gathered outcomes (None: nothing written) and the helper's retention
        outcome (None: not sealed by it)."""
        why, seal = "", None
        try:
            writer.set_up_storage_writer(self.rank == 0, rank=self.rank)
            writer.prepare(kept.plan, kept)
            if self.rank == 0:
                kept.metadata.storage_meta = writer.storage_meta()
            if self.rank == 0 and votes.kind == "hub":  # the byte helper's to seal
                seal = (step, writer.path, kept.pickler.dumps(kept.metadata),
                        {name: known for name, (_, _, known) in kept.small_items.items()})
        except Exception as e:  # this rank copies nothing; every rank still reaches the gather
            why = describe(e)
        agreed, gathered, sealed = votes.copy_planned(flags, step, writer, why, seal)
        if gathered is not None:
            writer.written = dict(gathered[self.rank][1])
        writer.clock.mark("copy")
        return agreed, gathered, sealed

    def _seal_planned(self, step: int, writer: "PartCopyWriter", kept: KeptPlan, gathered: list) -> None:
        """Rank 0 seals a step written to a kept plan, if every rank wrote its part
        (where the byte helper did not: _copy_planned)."""
        whys = "; ".join(f"rank {r}: {w}" for r, (w, _, _) in enumerate(gathered) if w)
        if whys:
            raise files.CorruptCheckpoint(whys)
        if self.rank == 0:
            for _, written, lengths in gathered:
                for name in written:
                    kept.update(name, lengths)
            self.seal(step, writer.path, {k: v for _, w, _ in gathered for k, v in w.items()},
                      kept.pickler.dumps(kept.metadata))
            writer.clock.mark("metadata")

    def _make_room(self, path: str) -> str:
        """Rank 0: empty `path` of this job's old files ("" when done), never touching
        another job's (its reason then). The same step saved again after a restart must
        not mix two incarnations' files under one .metadata. A failure is a reason too:
        every rank must reach the agreement that follows."""
        try:
            if os.path.isdir(path):
                owner = read_owner(path)
                if owner not in (None, self.job_id):
                    return f"{path} exists and belongs to job {owner}; not overwritten"
                shutil.rmtree(path)
        except OSError as e:
            return f"could not clear {path}: {e!r}"
        return ""

    def _clear(self, path: str, pg) -> None:
        """Collective: _make_room on rank 0, the others waiting (it is also the barrier:
        no rank writes before the old files are gone)."""
        why = agree(self._make_room(path) if self.rank == 0 else "", pg)
        if why:
            raise files.CorruptCheckpoint(why)

    def prepare_export(self, step: int, pg) -> None:
        """Collective: step-N emptied for torchtitan's export (raises if another job's)."""
        self._clear(self._dir(step), pg)

    def record_export(self, step: int, fmt: str, dtype: str) -> int:
        """Rank 0, after torchtitan wrote its export: the manifest that marks step-N as an
        export of this job (never loaded, never purged), with every file's checksum.
        Returns the export's bytes."""
        path = self._dir(step)
        names = [os.path.relpath(os.path.join(root, n), path) for root, _, ns in os.walk(path) for n in ns]
        allfiles = _checksums(path, [n for n in names if n != MANIFEST])
        files.atomic_write_json(os.path.join(path, MANIFEST),
                                {"step": step, "job_id": self.job_id, "kind": "export",
                                 "format": fmt, "dtype": dtype, "files": allfiles})
        return sum(v["size"] for v in allfiles.values())

    def verify(self, step: int, pg) -> tuple[bool, str]:
        """Collective: each rank checks every world_size-th file of the manifest."""
        path = self.step_dir(step)
        reason = ""
        try:
            manifest = files.read_json(os.path.join(path, MANIFEST))
            if manifest.get("job_id") not in (None, self.job_id):
                raise files.CorruptCheckpoint(f"{path} belongs to job {manifest['job_id']}")
            names = sorted(manifest["files"])
            for name in names[self.rank :: self.world_size]:
                files.check_file(os.path.join(path, name), manifest["files"][name])
        except FileNotFoundError:
            manifest = None  # written by stock torchtitan: nothing to verify against
        except (files.CorruptCheckpoint, OSError, ValueError, KeyError, AttributeError, TypeError) as e:
            reason = str(e)
        reason = agree(reason, pg)
        return not reason, reason

    def load(self, step: int, state: dict) -> int:
        """dcp.load into `state` in place (resharding as needed); returns bytes read."""
        reader = CountingReader(self.step_dir(step))
        dcp.load(state, storage_reader=reader)
        return reader.bytes_read


def _checksums(path: str, names: list[str]) -> dict:
    """name -> {size, crc32c} of files under `path`: a manifest's "files"."""
    out = {}
    for name in names:
        size, crc = files.checksum_file(os.path.join(path, name))
        out[name] = {"size": size, files.SUM: crc}
    return out
