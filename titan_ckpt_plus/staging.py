"""One rank's training state as a skeleton plus one contiguous host buffer.

Staging is the only part of a save the training loop waits for, so it is a plain
sequence of `copy_` calls into a buffer that is allocated once and reused (pinned on
GPUs, so the copies run on the copy engine). Everything after staging (the local
write, the PFS drain) reads the buffer or the files made from it.

A state is a nested structure of dicts/lists/tuples whose leaves are tensors,
DTensors or plain Python values. DTensors are saved by their local shard: the local
tier is only ever loaded by the same layout that wrote it.

The buffer is laid out in DCP's own per-rank file form: each tensor's bytes sit
inside the torch.save frame DCP would write around them (zip headers and pickle
before, the archive's directory after, CRC-32 off so the frames depend only on
dtype and shape). The frames are written into the buffer once per layout, so a
local part is a DCP data file as it stands and the PFS drain copies its bytes
instead of serializing them again (tiers/pfs.py, PartCopyWriter).
"""

import functools
import hashlib
import io
import json
import logging
import math
import mmap
import os
import pickle
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from titan_ckpt_plus.device_copy import Copy
from titan_ckpt_plus.tiers.files import FIRST_CHUNK, PAGE, checksum

log = logging.getLogger("titan_ckpt_plus")

ALIGN = 64
_PLAIN = (int, float, str, bytes, bool, type(None))


class TensorEntry(NamedTuple):
    """One tensor's place in the buffer (a tuple: a save makes one per tensor, on the
    training thread)."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # of the tensor's bytes
    nbytes: int
    pre: int = 0  # bytes of its torch.save frame before them (0: a part without frames)
    post: int = 0  # and after them

    @property
    def frame(self) -> tuple[int, int]:
        """(start, end) of the torch.save archive around the bytes: a DCP item."""
        return self.offset - self.pre, self.offset + self.nbytes + self.post


@dataclass
class StateLayout:
    """Where every tensor of a state lives in the host buffer."""

    skeleton: Any  # the state with each tensor replaced by {"__tensor__": index}
    entries: list[TensorEntry]
    total_bytes: int
    # entry index -> (global shape, global offset) of each DTensor's shard (chunk_table);
    # None: not recorded (a part written before they were), so it reshards only from the PFS
    chunks: dict | None = None
    _fingerprint: str | None = field(default=None, repr=False, compare=False)
    _structure: str | None = field(default=None, repr=False, compare=False)

    def fingerprint(self) -> str:
        """Identifies the tensor table: a local step is loadable only by a job whose
        state has the same paths, dtypes and local shapes. Made once per layout (the
        copy thread and the drain both ask)."""
        if self._fingerprint is None:
            table = [(e.path, e.dtype, list(e.shape)) for e in self.entries]
            self._fingerprint = hashlib.sha256(json.dumps(table).encode()).hexdigest()[:16]
        return self._fingerprint

    def adopt(self, previous: "StateLayout | None") -> bool:
        """Take `previous`'s fingerprint and chunk table where both have the same tensor
        table (every save of a job after its first, until the layout changes): one
        C-level compare of the entries instead of a JSON dump and hash of them all.
        Returns whether it did."""
        if previous is None or previous.entries != self.entries:
            return False
        self._fingerprint, self.chunks = previous.fingerprint(), previous.chunks
        return True

    def structure(self) -> str:
        """Identifies the skeleton apart from its values (keys, containers, the types of
        its leaves): steps of a layout with the same structure get the same DCP plan,
        however their values (lr, step counts) differ. Made once per layout."""
        if self._structure is None:
            def shape(obj: Any) -> Any:
                if isinstance(obj, dict):
                    if len(obj) == 1 and "__tensor__" in obj:  # the fingerprint covers tensors
                        return "T"
                    return {k: shape(v) for k, v in obj.items()}
                if isinstance(obj, (list, tuple)):
                    return [type(obj).__name__, *map(shape, obj)]
                return type(obj).__name__
            self._structure = hashlib.sha256(pickle.dumps(shape(self.skeleton), protocol=4)).hexdigest()[:16]
        return self._structure

    def to_bytes(self) -> bytes:
        entries = [(e.path, e.dtype, e.shape, e.offset, e.nbytes, e.pre, e.post) for e in self.entries]
        return pickle.dumps(
            {"skeleton": self.skeleton, "entries": entries, "total": self.total_bytes, "chunks": self.chunks},
            protocol=4,
        )

    @staticmethod
    def from_bytes(data: bytes) -> "StateLayout":
        """Call only on checksum-verified bytes; the unpickler still refuses any
        class, so a bad file cannot run code."""
        d = _PlainUnpickler(io.BytesIO(data)).load()
        entries = [TensorEntry(p, dt, tuple(s), *rest) for p, dt, s, *rest in d["entries"]]
        return StateLayout(d["skeleton"], entries, d["total"], d.get("chunks"))


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a checkpoint")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, read directly: to_local() goes through an autograd
    Function, which costs more than the rest of planning for small tensors."""
    if isinstance(t, DTensor):
        local = getattr(t, "_local_tensor", None)
        return local if isinstance(local, torch.Tensor) else t.to_local()
    return t


class _Recorder:
    """A file object for torch.save that keeps every write but the tensor's bytes:
    the one write of exactly their length (the archive's other records are small)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.before, self.after, self.seen = nbytes, [], [], False

    def write(self, b) -> int:
        n = memoryview(b).nbytes
        if not self.seen and n == self.nbytes:
            self.seen = True
        else:
            (self.after if self.seen else self.before).append(bytes(b))
        return n

    def flush(self) -> None:
        pass


_SMALL = 1 << 16  # below this a tensor's bytes could be mistaken for another record's


@functools.lru_cache(maxsize=4096)
def frame(dtype: str, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    """The bytes torch.save writes before and after a contiguous tensor's data, with
    CRC-32 off (else the archive's directory holds a checksum of the data). Made
    from a stand-in tensor of the same dtype and shape; a large one goes to a
    recorder that drops its bytes, so its pages are never touched."""
    from torch.utils.serialization import config

    t = torch.empty(shape, dtype=getattr(torch, dtype))
    nbytes = t.numel() * t.element_size()
    out = _Recorder(nbytes) if nbytes >= _SMALL else io.BytesIO()
    was, config.save.compute_crc32 = config.save.compute_crc32, False
    try:
        torch.save(t, out)
    finally:
        config.save.compute_crc32 = was
    if isinstance(out, io.BytesIO):
        return _split(out.getvalue(), nbytes)
    if not out.seen:
        raise RuntimeError(f"torch.save of {dtype}{list(shape)} did not write its bytes in one piece")
    return b"".join(out.before), b"".join(out.after)


def _split(raw: bytes, nbytes: int) -> tuple[bytes, bytes]:
    """A whole small archive around its data record (stored, uncompressed)."""
    import struct
    import zipfile

    info = next(i for i in zipfile.ZipFile(io.BytesIO(raw)).infolist() if i.filename.endswith("/data/0"))
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26: info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    return raw[:start], raw[start + nbytes:]


@functools.lru_cache(maxsize=4096)
def _placement(dtype: torch.dtype, shape: torch.Size) -> tuple:
    """(dtype name, shape, bytes, frame before, frame after, room taken) of a tensor:
    the same for every tensor of a dtype and shape, so made once. torch.save aligns
    the bytes to 64 within its archive: each archive starts aligned, so they are too."""
    name, dims = str(dtype).removeprefix("torch."), tuple(shape)
    nbytes = math.prod(dims) * dtype.itemsize
    pre, post = frame(name, dims)
    return name, dims, nbytes, len(pre), len(post), -(-(len(pre) + nbytes + len(post)) // ALIGN) * ALIGN


def plan_layout(state: Any) -> tuple[StateLayout, list[torch.Tensor], dict]:
    """Walk `state`; return its layout, its tensors' local shards in entry order, and
    the DTensor specs by entry index (kept in memory to rebuild DTensors for DCP)."""
    entries: list[TensorEntry] = []
    tensors: list[torch.Tensor] = []
    specs: dict = {}
    offset = 0

    # On the training thread, once per save and node: a dict's test comes first (cheaper
    # than torch.Tensor's), a tensor is detached only where autograd tracks it (each
    # detach() makes a tensor object).
    def walk(obj: Any, path: str) -> Any:
        nonlocal offset
        if isinstance(obj, dict):
            return {k: walk(v, f"{path}/{k}") for k, v in obj.items()}
        if isinstance(obj, torch.Tensor):
            index, local = len(entries), obj
            if isinstance(obj, DTensor):
                specs[index], local = obj._spec, _local(obj)
            if local.requires_grad:
                local = local.detach()
            dtype, shape, nbytes, pre, post, size = _placement(local.dtype, local.shape)
            entries.append(TensorEntry(path, dtype, shape, offset + pre, nbytes, pre, post))
            tensors.append(local)
            offset += size
            return {"__tensor__": index}
        if isinstance(obj, (list, tuple)):
            items = [walk(v, f"{path}/{i}") for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else tuple(items)
        if isinstance(obj, io.BytesIO):
            return obj.getvalue()
        if isinstance(obj, _PLAIN):
            return obj
        raise TypeError(f"cannot stage {type(obj).__name__} at {path or '/'}")

    skeleton = walk(state, "")
    return StateLayout(skeleton, entries, offset), tensors, specs


def chunk_table(layout: StateLayout, specs: dict) -> dict | None:
    """Entry index -> (global shape, global offset) of each DTensor's shard, as DCP
    records its chunk: with them a local part can be loaded under another parallel
    layout (tiers/reshard.py). Once per layout, off the training thread (the copy's);
    None where a shard's placement is one DCP's own rule does not describe."""
    out = {}
    for i, spec in specs.items():
        try:
            shape, offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
        except Exception as e:  # only the reshard from local is lost
            log.debug(f"[titan_ckpt_plus] no chunk for {layout.entries[i].path}: {e!r}")
            return None
        if tuple(shape) != layout.entries[i].shape:
            return None
        out[i] = (tuple(spec.shape), tuple(offset))
    return out


def tensor_view(buffer: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    dtype = getattr(torch, e.dtype)
    if e.nbytes == 0:
        return torch.empty(e.shape, dtype=dtype)
    return buffer[e.offset : e.offset + e.nbytes].view(dtype).view(e.shape)


class StagingProgress:
    """How far the staging copy has got, so the local write can follow right behind
    it instead of waiting for the whole copy; and, once `checksum(data)` named the
    buffer, the CRC-32C of what is staged so far. The copy thread takes it group by
    group right after the copy, while the bytes are still in the cache: a fifth less
    CPU than a second pass over memory, and the write no longer waits for it."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self.done = 0
        self._wanted = float("inf")  # the fewest staged bytes a waiter waits for
        self.failed = False
        self.crc = 0
        self.sums = True  # False: the byte helper checksums the bytes as it writes them
        self._data: memoryview | None = None
        self.listener = None  # told each advance (bytes staged) and a failure (None)

    def checksum(self, data) -> None:
        if self.sums:
            self._data = memoryview(data).cast("B")

    def advance(self, upto: int) -> None:
        if self._data is not None:
            self.crc = checksum(self._data[self.done:upto], self.crc)
        with self._cv:
            self.done = upto
            if upto >= self._wanted:  # a waiter's bytes are here: wake it, not once a group
                self._wanted = float("inf")
                self._cv.notify_all()
        if self.listener is not None:
            self.listener(upto)

    def fail(self) -> None:
        with self._cv:
            self.failed = True
            self._cv.notify_all()
        if self.listener is not None:
            self.listener(None)

    def wait(self, upto: int) -> int:
        """Block until the first `upto` bytes are staged; returns how many are; raises
        if staging failed."""
        with self._cv:
            while self.done < upto and not self.failed:
                self._wanted = min(self._wanted, upto)
                self._cv.wait()
            if self.done < upto:
                raise RuntimeError("staging failed before these bytes were copied")
            return self.done


HUGE_PAGE = 2 << 20


def _advise(mm: mmap.mmap, inherit: bool) -> None:
    """Huge pages for the mapping, and not `inherit`: none for a forked child."""
    for advice in (("MADV_HUGEPAGE",) if inherit else ("MADV_HUGEPAGE", "MADV_DONTFORK")):
        try:
            mm.madvise(getattr(mmap, advice))
        except (AttributeError, OSError):  # not Linux, or a kernel without THP
            pass


def huge_page_buffer(nbytes: int, inherit: bool = True) -> torch.Tensor:
    """`nbytes` of fresh anonymous memory on a 2 MiB boundary, advised to Linux for
    transparent huge pages (where it has them). An O_DIRECT write pins every
    page of its buffer in the kernel: 2 MiB pages cost a third of the CPU time 4 KiB
    pages do (36 MiB: 0.6 ms against 2.0 here), time the training ranks' cores pay.
    Its own private mapping: memory the allocator reuses has its small pages already
    (the advice only shapes pages not yet touched), and shared anonymous memory is
    shmem, whose huge pages are off by default. Not `inherit`: a forked child (a
    dataloader worker) does not get the mapping, where Linux would copy every pinned
    page of it into the child at the fork."""
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    skip = -torch.frombuffer(mm, dtype=torch.uint8).data_ptr() % HUGE_PAGE
    _advise(mm, inherit)
    return _own_storage(mm, skip, nbytes)


def _own_storage(mm: mmap.mmap, offset: int, nbytes: int) -> torch.Tensor:
    """`nbytes` of `mm` from `offset`, as a tensor whose storage begins where it does
    (and holds `mm` alive): torch's is_pinned() asks CUDA about the storage's first
    byte, so a slice of a larger tensor would read as unpinned though its own bytes,
    the ones registered, are pinned."""
    return torch.frombuffer(mm, dtype=torch.uint8, offset=offset, count=nbytes)


def shared_buffer(nbytes: int, inherit: bool = True) -> tuple[torch.Tensor, int]:
    """`nbytes` of shared memory (a memfd, mapped MAP_SHARED) and its fd, for a helper
    process to write from (tiers/byte_helper.py). Advised for huge pages, which Linux
    gives shared memory only where /sys/kernel/mm/transparent_hugepage/shmem_enabled
    allows: else an O_DIRECT write pins 4 KiB pages, about three times the kernel time,
    spent in the helper. Not `inherit`: as huge_page_buffer."""
    fd = os.memfd_create("titan-ckpt-staging", os.MFD_CLOEXEC)
    size = max(nbytes, PAGE)
    os.ftruncate(fd, size)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    _advise(mm, inherit)
    return _own_storage(mm, 0, nbytes), fd


_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not only the current one


def register_with_cuda(buf: torch.Tensor):
    """Pin `buf` for the GPU's copy engine at its own size (cudaHostRegister), so a
    device-to-host copy into it is one DMA; returns what unpins it. torch's pinned
    allocator rounds every allocation up to a power of two: 12 GiB of state per rank
    would pin 16 GiB, and 8.1 GiB would pin 16."""
    cudart = torch.cuda.cudart()
    ptr, nbytes = buf.data_ptr(), buf.numel()
    err = _cuda_call(cudart.cudaHostRegister, ptr, nbytes, _PORTABLE)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes returned CUDA error {int(err)}")
    return lambda: _cuda_call(cudart.cudaHostUnregister, ptr)


def _cuda_call(fn, *args):
    """fn(*args) on a thread of its own, on this thread's device: a failed CUDA call
    leaves its error as its thread's last error, which torch's next kernel launch
    check on this (the training) thread would report as that kernel's."""
    device, out = torch.cuda.current_device(), []

    def run() -> None:
        try:
            torch.cuda.set_device(device)  # a new thread starts on device 0
            out.append(fn(*args))
        except Exception as e:
            out.append(e)

    t = threading.Thread(target=run, name="ckpt-cuda-pin")
    t.start()
    t.join()
    if isinstance(out[0], Exception):
        raise out[0]
    return out[0]


def allocator_pinned(nbytes: int) -> torch.Tensor:
    """`nbytes` from torch's pinned allocator (rounded up to a power of two by it),
    page-aligned for O_DIRECT: the fallback where registering our own memory fails."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=True)
    skip = -raw.data_ptr() % PAGE
    return raw[skip : skip + nbytes]


class HostBuffer:
    """A reusable host buffer, the state's size (in 2 MiB pages, page-aligned for
    O_DIRECT); grows when the state grows; pinned in place when a GPU is used."""

    def __init__(self, pin: bool, register=register_with_cuda, shared: bool = False) -> None:
        self.pin = pin
        self.register = register
        self.shared = shared  # shared memory, for a helper process (shared_buffer)
        self.fd = -1  # the shared memory's memfd
        self.generation = 0  # which buffer this is: a new one each time it grows
        self.data = torch.empty(0, dtype=torch.uint8)
        self._unpin = None  # undoes the current buffer's registration
        self._views_key: tuple | None = None
        self._views_cache: list[torch.Tensor] = []

    def ensure(self, nbytes: int) -> torch.Tensor:
        """The buffer, at least `nbytes`. Called by save() once the previous save's
        copy has landed, so no DMA still writes to a buffer this replaces; readers
        of the old one (a drain) keep its memory alive, unpinned."""
        if self.data.numel() < nbytes:
            fd, unpin = -1, None
            if self.shared:
                data, fd = shared_buffer(nbytes, inherit=not self.pin)
            else:
                data = huge_page_buffer(nbytes, inherit=not self.pin)
            if self.pin:
                try:
                    unpin = self.register(data)
                except Exception as e:
                    log.warning(f"[titan_ckpt_plus] could not pin the staging buffer in place ({e!r}); "
                                f"using torch's pinned allocator, which rounds {nbytes} bytes up to a "
                                "power of two")
                    data = allocator_pinned(nbytes)
                pinned = nbytes if unpin else 1 << (nbytes + PAGE - 1).bit_length()  # torch's rounding
                log.info(f"[titan_ckpt_plus] staging buffer: {nbytes} bytes of state, {pinned} bytes pinned "
                         f"({'in place' if unpin else 'by torch'}; is_pinned={data.is_pinned()})")
            self.release()
            self.data, self._unpin, self.fd = data, unpin, fd
            self.generation += 1
        return self.data

    def release(self) -> None:
        """Unpin the buffer and close its memfd (its memory goes when its last view
        does; the helper holds its own mapping)."""
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def copy_in(self, layout: StateLayout, tensors: list[torch.Tensor],
                progress: StagingProgress | None = None, copy: Copy | None = None,
                clear=None) -> None:
        """The blocking copy, in groups of about `copy.group_bytes` (Copy: a core's L2
        cache on CPU), one foreach call each: the copy thread then takes the GIL back
        once per group, not once per tensor, so a training thread busy in Python does
        not slow it down tensor by tensor. `copy` runs them (device_copy.py:
        synchronously on CPU, on the rank's copy stream on GPUs) and reports progress
        per group once its bytes are here;
        `clear(upto)` runs before a group that ends at `upto` is copied (a drain's
        piece from the buffer written first: StagedBytes.take_back)."""
        views = self._views(self.ensure(layout.total_bytes), layout, clear)
        if progress is not None:
            progress.checksum(self.data[: layout.total_bytes].numpy())
        copy, groups, start = copy or Copy(), [], 0
        for end, upto in _groups(layout, copy.group_bytes):
            groups.append((views[start:end], tensors[start:end], upto))
            start = end
        copy.run(groups, progress, clear)

    def _views(self, buf: torch.Tensor, layout: StateLayout, clear=None) -> list[torch.Tensor]:
        """The buffer's view for every entry, made (and the frames written) once per
        buffer and layout: every save of a job has the same layout. The frames span
        the buffer, so a drain's piece in flight is written first (`clear`)."""
        key = (buf.data_ptr(), tuple(layout.entries))
        if self._views_key != key:
            if clear is not None:
                clear(layout.total_bytes)
            write_frames(buf, layout)
            self._views_cache = [tensor_view(buf, e) for e in layout.entries]
            self._views_key = key
        return self._views_cache


def _groups(layout: StateLayout, size: int) -> list[tuple[int, int]]:
    """(end entry index, bytes staged once entries before it are copied) per group;
    the first group is no larger than the local write's first piece, so the disk
    gets its first bytes sooner."""
    out, first_offset, limit = [], 0, min(FIRST_CHUNK, size)
    for i, e in enumerate(layout.entries):
        if e.offset + e.nbytes - first_offset >= limit:
            upto = layout.entries[i + 1].offset if i + 1 < len(layout.entries) else layout.total_bytes
            out.append((i + 1, upto))
            first_offset, limit = upto, size
    if not out or out[-1][0] < len(layout.entries):
        out.append((len(layout.entries), layout.total_bytes))
    return out


def write_frames(buf: torch.Tensor, layout: StateLayout) -> None:
    """Every entry's torch.save frame around its bytes, and zeros in the gaps, so the
    buffer is the part's whole file image once the tensors are copied in."""
    raw, end = buf.numpy(), 0
    for e in layout.entries:
        start, stop = e.frame
        pre, post = frame(e.dtype, e.shape)
        raw[end:start] = 0
        raw[start:e.offset] = memoryview(pre)
        raw[e.offset + e.nbytes:stop] = memoryview(post)
        end = stop
    raw[end:layout.total_bytes] = 0


def rebuild(layout: StateLayout, buffer: torch.Tensor | None, specs: dict | None = None) -> Any:
    """The state with its tensors as views of `buffer` (no copy), or with no buffer as
    tensors of the same dtypes and shapes on the meta device: what DCP plans a PFS
    step from, whose bytes are then copied from the part (no data to read by mistake).
    With `specs`, the entries that were DTensors become DTensors again, as DCP needs."""
    specs = specs or {}

    def tensor(e: TensorEntry) -> torch.Tensor:
        if buffer is None:
            return torch.empty(e.shape, dtype=getattr(torch, e.dtype), device="meta")
        return tensor_view(buffer, e)

    def walk(obj: Any) -> Any:
        if isinstance(obj, dict):
            if set(obj) == {"__tensor__"}:
                i = obj["__tensor__"]
                t = tensor(layout.entries[i])
                return DTensor(t, specs[i], requires_grad=False) if i in specs else t
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(walk(v) for v in obj)
        return obj

    return walk(layout.skeleton)


def entry_path(obj_path: tuple) -> str:
    """A TensorEntry's path for a DCP object path (its planner's `mappings`): the
    walk in plan_layout names each key and list index after a "/"."""
    return "".join(f"/{p}" for p in obj_path)


def value_at(skeleton: Any, path: tuple) -> Any:
    """The skeleton's value at a DCP object path (its planner's `mappings`)."""
    for key in path:
        skeleton = skeleton[key]
    return skeleton


def copy_into(live: Any, saved: Any, path: str = "") -> Any:
    """Copy a saved state into a live one in place; returns what to hand to
    `load_state_dict`. Tensors are copied byte for byte into the live (local) shards,
    so a resumed run continues bit-exactly. A structural mismatch raises."""
    if isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            raise ValueError(f"{path}: checkpoint has {type(saved).__name__}, job has a tensor")
        dst = _local(live)
        if dst.shape != saved.shape or dst.dtype != saved.dtype:
            raise ValueError(
                f"{path}: checkpoint {saved.dtype}{list(saved.shape)} vs job {dst.dtype}{list(dst.shape)}"
            )
        dst.copy_(saved)
        return live
    if isinstance(live, dict) and isinstance(saved, dict):
        missing = set(live) - set(saved)
        if missing:
            raise ValueError(f"{path}: checkpoint lacks {sorted(map(str, missing))[:5]}")
        return {k: copy_into(live[k], saved[k], f"{path}/{k}") if k in live else saved[k]
                for k in saved}
    if isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)) and len(live) == len(saved):
        items = [copy_into(a, b, f"{path}/{i}") for i, (a, b) in enumerate(zip(live, saved))]
        return items if isinstance(live, list) else tuple(items)
    if isinstance(live, io.BytesIO) and isinstance(saved, bytes):
        return io.BytesIO(saved)
    return saved
