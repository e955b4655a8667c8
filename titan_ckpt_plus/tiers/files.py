"""Durable file primitives shared by the tiers and the CLI (no torch).

A checkpoint file is trusted only through a manifest written after it: size and
CRC-32C per file, written to a temporary name, fsync'd, then renamed into place.
CRC-32C because it runs on the CPU's own instruction (about 10 GB/s here, against
2 GB/s for zlib's CRC-32): the checksum must not be what makes a save slow.
"""

import contextlib
import ctypes
import fcntl
import json
import mmap
import os

import crc32c

CHUNK = 16 << 20
FIRST_CHUNK = 4 << 20  # see _chunks
PAGE = 4096  # O_DIRECT needs page-aligned memory, offsets and sizes
SPARE = ".spare"  # where retention retires data files for the next write (retire())


class CorruptCheckpoint(Exception):
    """A file is missing, short, or fails its checksum."""


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, data: bytes) -> None:
    write_batch(os.path.dirname(path) or ".", [(path, data)])


def json_bytes(obj) -> bytes:
    """One line: json's C encoder (an indent makes it use the Python one, whose time
    a background thread holds the GIL for)."""
    return json.dumps(obj, sort_keys=True).encode()


def atomic_write_json(path: str, obj) -> None:
    atomic_write_bytes(path, json_bytes(obj))


def read_json(path: str):
    return json.loads(read_bytes(path))


def read_bytes(path: str) -> bytes:
    """A small file's bytes by plain os calls (open, read to the end, close): a Python
    file object adds two stats, a tty check and two seeks, and a background thread
    takes the GIL back from training after every call (issue 15)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        parts = []
        while chunk := os.read(fd, 1 << 20):
            parts.append(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


_pid = os.getpid()  # os.getpid() is a system call on this glibc; temporary names need it


def _after_fork() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork)


def temporary(path: str) -> str:
    """The name a file is written under before it is renamed into place."""
    return f"{path}.tmp{_pid}"


SUM = "crc32c"  # the manifest key of a file's checksum


def checksum(data, value: int = 0) -> int:
    """CRC-32C of a buffer, continuing from `value` (releases the GIL)."""
    return crc32c.crc32c(data, value)


def entry(data) -> dict:
    """A manifest entry for an in-memory buffer."""
    return {"size": memoryview(data).nbytes, SUM: checksum(data)}


def checksum_file(path: str) -> tuple[int, int]:
    """(size, CRC-32C) of a file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = checksum(chunk, crc)
            size += len(chunk)
    return size, crc


def _open_for_read(path: str) -> int:
    """O_DIRECT where the file system takes it: the drain's reads then cost no page-cache
    copy and leave no pages behind."""
    if hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            pass
    return os.open(path, os.O_RDONLY)


def piece_size(total: int) -> int:
    """The reused buffer for `total` bytes moved piece by piece through host memory (a
    drain reading a local file, a replica landing): a sixteenth of them in whole pages,
    at least 1 MiB and at most CHUNK. A fixed CHUNK was as large as a small model's
    whole part (debugmodel: 36 MiB a rank), so the host memory held beside the
    staging buffer stays a small share of the state at any size (issue 15)."""
    return min(CHUNK, max(1 << 20, -(-total // 16 // PAGE) * PAGE))


def read_spans(path: str, expect: dict, spans: list, resume: int = 0):
    """Yields (offset, piece) for the bytes of `spans` ((start, end) pairs, sorted,
    page-aligned starts) at or after `resume`, each piece valid until the next is asked
    for. The whole file is read in order and checked against its manifest entry: raises
    CorruptCheckpoint after the last piece if the size or CRC-32C differ, so a consumer
    that wrote the pieces elsewhere must fail what it wrote."""
    fd = _open_for_read(path)
    buf = mmap.mmap(-1, piece_size(os.fstat(fd).st_size))  # page-aligned, as O_DIRECT needs
    view, crc, size, k = memoryview(buf), 0, 0, 0
    try:
        while n := os.preadv(fd, [buf], size):
            lo, hi = size, size + n
            chunk = view[:n]
            crc, size = checksum(chunk, crc), hi
            while k < len(spans):
                a, b = max(spans[k][0], resume, lo), spans[k][1]
                if a >= b:
                    k += 1
                    continue
                if a >= hi:
                    break
                yield a, chunk[a - lo : min(b, hi) - lo]
                if b > hi:
                    break
                k += 1
            if n < len(buf):
                break
    finally:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    check_entry(path, size, crc, expect)


def _mismatch(name: str, size: int, crc: int, expect: dict) -> str:
    return (f"{name}: size {size} {SUM} {crc:08x}, manifest says "
            f"size {expect.get('size')} {SUM} {expect.get(SUM, 0):08x}")


def check_file(path: str, expect: dict) -> None:
    """Raise CorruptCheckpoint unless `path` matches its manifest entry."""
    if not os.path.isfile(path):
        raise CorruptCheckpoint(f"{path}: missing")
    check_entry(path, *checksum_file(path), expect)


def check_bytes(name: str, data, expect: dict) -> None:
    check_entry(name, memoryview(data).nbytes, checksum(data), expect)


def check_entry(name: str, size: int, crc: int, expect: dict) -> None:
    """Raise CorruptCheckpoint unless (size, CRC-32C) is what the manifest entry says."""
    if size != expect.get("size") or crc != expect.get(SUM):
        raise CorruptCheckpoint(_mismatch(name, size, crc, expect))


def address(view: memoryview) -> int | None:
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):  # read-only or empty buffer
        return None


def retire(path: str, spare: str) -> None:
    """A data file retention no longer keeps becomes `spare`, written over by the
    next save instead of deleted and made anew: its blocks stay allocated, so that
    write neither allocates nor converts extents, and no delete (with the file
    system's discard, a TRIM of every freed block) loads the disk (BENCHMARKS.md,
    save and overhead). One spare per writer: deleted when one waits already.
    Raises FileNotFoundError if `path` is not there."""
    if os.path.exists(spare):
        os.remove(path)
        return
    try:
        os.rename(path, spare)
    except FileNotFoundError:  # the first retired file: no spare folder yet
        os.makedirs(os.path.dirname(spare), exist_ok=True)
        os.rename(path, spare)


def _write_flags(path: str, reuse: str | None) -> int:
    """Open flags for a new file at `path`, or for `reuse` (a spare: retire())
    moved there and written over, if it is there (then without O_TRUNC: _cut_to)."""
    if reuse is not None:
        try:
            os.rename(reuse, path)
            return os.O_WRONLY | os.O_CREAT
        except OSError:  # none to reuse (the first saves, another file system)
            pass
    return os.O_WRONLY | os.O_CREAT | os.O_TRUNC


def _cut_to(fd: int, size: int, flags: int) -> None:
    """A written-over spare that was longer ends where the new bytes do (a file
    opened with O_TRUNC holds only what was written: no stat needed)."""
    if not flags & os.O_TRUNC and os.fstat(fd).st_size > size:
        os.ftruncate(fd, size)


def _open_for_write(path: str, view: memoryview, reuse: str | None = None) -> tuple[int, bool, int]:
    """(fd, direct, flags): O_DIRECT when the buffer is page-aligned and the file system
    takes it (tmpfs does not). Direct writes skip the page-cache copy, so a save
    costs the training ranks' cores almost nothing; the bytes go from the staging
    buffer to the disk. `reuse`: a spare to write over (_write_flags)."""
    flags = _write_flags(path, reuse)
    addr = address(view) if len(view) >= 1 << 20 else None
    if addr is not None and addr % PAGE == 0 and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True, flags
        except OSError:
            pass
    return os.open(path, flags, 0o644), False, flags


def _buffered(fd: int) -> bool:
    """Turn O_DIRECT off for the rest of a file (its last partial page, small records
    after the bulk); returns False, the file's `direct` from then on."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
    return False


def write_all(fd: int, chunk: memoryview) -> None:
    """os.write until every byte is written (it may write fewer)."""
    while len(chunk):
        chunk = chunk[os.write(fd, chunk):]


def _write_pages(fd: int, view: memoryview, direct: bool) -> bool:
    """Write `view` on at the file's end: its whole pages with O_DIRECT while `direct`,
    a last partial page through the page cache (O_DIRECT off from then on: it takes
    whole pages only), so a piece that ends mid-page sends only that page through the
    cache. Returns the file's `direct` after it."""
    head = len(view) // PAGE * PAGE if direct else len(view)
    if head:
        write_all(fd, view[:head])
    if head < len(view):  # only while direct: else head is the whole piece
        direct = _buffered(fd)
        write_all(fd, view[head:])
    return direct


def _chunks(n: int, ready=None):
    """(start, end) pieces of a write: a small first one, so the disk starts while
    the staging copy fills the next; then CHUNK, few enough that the writer thread
    seldom has to take the GIL back from the training thread. Every piece is whole
    pages but the last partial page, alone: O_DIRECT takes whole pages only, and only
    that page then goes through the page cache. `ready(end)`, if given, blocks until
    the first `end` bytes are there (the write follows the staging copy) and returns
    how many are: a piece then runs on over every whole page already there, so a
    copy that is ahead is written in fewer calls, each one a time the writer takes
    the GIL back (issue 15)."""
    def pages(size: int) -> int:
        return max(PAGE, min(size, n // 2) // PAGE * PAGE)

    whole = n // PAGE * PAGE
    start, size = 0, pages(FIRST_CHUNK)
    while start < whole:
        end = min(whole, start + size)
        if ready is not None:
            end = min(whole, ready(end) // PAGE * PAGE)  # >= end: ready(end) waits for it
        yield start, end
        start, size = end, pages(CHUNK)
    if whole < n:
        if ready is not None:
            ready(n)
        yield whole, n


class DurableBatch:
    """Files written under temporary names, then made durable together on a clean
    exit from the `with` block: every file fsync'd, then renamed into place in the
    order written (so the file that vouches for the others comes last). The renames
    become durable with one directory fsync by the caller. A write, fsync, rename and
    directory fsync per file cost a journal commit each, 1-10 ms apiece here; synced
    at the end, the small files ride on the data file's commit. On an exception the
    files are closed and removed, not renamed: a write cut short by a full disk must
    not keep its bytes there."""

    def __init__(self) -> None:
        self._open: list[tuple[int, str, str]] = []  # (fd, temporary name, final name)
        self._streams: list[Appender] = []

    def __enter__(self) -> "DurableBatch":
        return self

    def stream(self, path: str, reuse: str | None = None) -> "Appender":
        """An Appender for `path` under a temporary name, made durable and named with
        the batch's other files (a replica written as it arrives); not closed by itself."""
        tmp = temporary(path)
        out = Appender(tmp, reuse)
        self._open.append((out.fd, tmp, path))
        self._streams.append(out)
        return out

    def write(self, path: str, data, on_chunk=None, before_chunk=None, known_crc=None,
              reuse: str | None = None) -> dict:
        """Write `data` (a buffer) for `path`; returns its manifest entry.
        `before_chunk(end)` may block until data[:end] is ready (the write follows the
        staging copy) and returns how much is (_chunks); `on_chunk(bytes_written)` runs
        between chunks (fault injection);
        `known_crc()`, if given, is the CRC-32C of all of `data` once it is ready (the
        staging copy took it), so none is computed here; `reuse`: a retired file to
        write over (_open_for_write)."""
        view = memoryview(data).cast("B")
        crc = 0
        tmp = temporary(path)
        fd, direct, flags = _open_for_write(tmp, view, reuse)
        self._open.append((fd, tmp, path))
        # a small file in one write: pieces matter only to O_DIRECT and to a write
        # that follows the staging copy
        pieces = _chunks(len(view), before_chunk) if direct or before_chunk or on_chunk else [(0, len(view))]
        for start, end in pieces:
            chunk = view[start:end]
            if known_crc is None:
                crc = checksum(chunk, crc)
            direct = _write_pages(fd, chunk, direct)
            if on_chunk:
                on_chunk(end)
        _cut_to(fd, len(view), flags)
        return {"size": len(view), SUM: crc if known_crc is None else known_crc()}

    def __exit__(self, exc_type, *_) -> None:
        try:
            if exc_type is None:
                for out in self._streams:
                    _cut_to(out.fd, out.size, out.flags)
                for fd, _, _ in self._open:
                    os.fsync(fd)
        finally:
            for fd, tmp, _ in self._open:
                os.close(fd)
                if exc_type is not None:
                    with contextlib.suppress(OSError):
                        os.remove(tmp)
        if exc_type is None:
            for _, tmp, path in self._open:
                os.replace(tmp, path)


class Appender:
    """A file written in order, from pieces that arrive one by one: with O_DIRECT while
    every piece starts on a page at a page-aligned address (a copy's bulk), buffered
    from the first partial page on (the last one, small records); its size and CRC-32C kept on
    the way (`crc=False` for pieces whose checksum the caller already knows);
    fsync'd, its pages dropped from the cache and closed at the end of the `with`
    block. `reuse`: a spare to write over (_write_flags)."""

    def __init__(self, path: str, reuse: str | None = None) -> None:
        self.flags = flags = _write_flags(path, reuse)
        self.direct = hasattr(os, "O_DIRECT")
        try:
            self.fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError:
            self.fd, self.direct = os.open(path, flags, 0o644), False
        self.size, self.crc = 0, 0

    def write(self, data, crc: bool = True) -> None:
        """A piece's whole pages with O_DIRECT while the file is (_write_pages), all of
        it buffered once a piece starts off a page or at an unaligned address."""
        view = memoryview(data).cast("B")
        if self.direct and (self.size % PAGE or (address(view) or 1) % PAGE):
            self.direct = _buffered(self.fd)
        self.direct = _write_pages(self.fd, view, self.direct)
        self.size += len(view)
        if crc:
            self.crc = checksum(view, self.crc)

    def __enter__(self) -> "Appender":
        return self

    def __exit__(self, exc_type, *_) -> None:
        try:
            if exc_type is None:
                _cut_to(self.fd, self.size, self.flags)
                os.fsync(self.fd)
                if hasattr(os, "posix_fadvise"):  # written and durable: no need to cache it
                    os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(self.fd)


def memory_pieces(data, spans: list, lock, taken_back, size: int = CHUNK):
    """(offset, piece) of `spans` from `data` (a buffer the next save will take back),
    pieces of `size`, `lock` held while the consumer writes each; returns the offset
    where a reader must go on from elsewhere once `taken_back(offset)` (asked before
    each piece, with its offset), None if it never was. The take-back sets its flag,
    then takes `lock` before it overwrites the piece's bytes: one piece at most."""
    for a, b in spans:
        for p in range(a, b, size):
            with lock:
                if taken_back(p):
                    return p
                yield p, data[p : min(p + size, b)]
    return None


def copy_spans(path: str, reuse: str | None, spans: list, pieces, tail: bytes, known_crc: int | None,
               on_piece=None) -> dict:
    """Write `pieces` ((offset, piece) covering `spans` in order), then `tail`, to
    `path` durably (an Appender: O_DIRECT for the bulk, fsync'd); returns its size and
    CRC-32C. `known_crc`: the spans' CRC-32C if known (none computed then);
    `on_piece()` runs after each piece (fault injection). Makes the file's folder."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with Appender(path, reuse) as out:
        with contextlib.closing(pieces):
            for _, piece in pieces:
                out.write(piece, crc=known_crc is None)
                if on_piece:
                    on_piece()
        if out.size != sum(b - a for a, b in spans):
            raise CorruptCheckpoint(f"the part ends before its frames do ({out.size} bytes copied)")
        if known_crc is not None:
            out.crc = known_crc
        if tail:
            out.write(tail)
    return {"size": out.size, SUM: out.crc}


def write_batch(folder: str, items: list) -> list[dict]:
    """Small files ((path, bytes) in `folder`) through one DurableBatch, named in the
    order given and made durable by the folder's fsync; their manifest entries."""
    with DurableBatch() as batch:
        entries = [batch.write(path, data) for path, data in items]
    fsync_dir(folder)
    return entries


def write_durable(path: str, data, on_chunk=None, before_chunk=None) -> dict:
    """One file through a DurableBatch; returns its manifest entry."""
    with DurableBatch() as batch:
        return batch.write(path, data, on_chunk, before_chunk)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def step_of(name: str) -> int | None:
    """`step-N` -> N; anything else -> None."""
    if name.startswith("step-") and name[5:].isdigit():
        return int(name[5:])
    return None
