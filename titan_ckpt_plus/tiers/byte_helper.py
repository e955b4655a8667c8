"""A save's bytes, written by a helper process (issue 15, docs/helper_process.md).

A thread of the training process that writes a file hands the kernel a piece at a
time and takes the GIL back after each: on a host where that costs the training
thread more than the thread's own CPU, two such writers slowed a launch-bound loop by
+13% against +0.3% for the same writes from another process (BENCHMARKS.md,
overhead). So with `[checkpoint] helper_process = true` the staging buffer is shared
memory (a memfd, staging.shared_buffer) and each rank's helper moves the bytes: the
local data file, written as the staging copy's progress allows, and the drain's copy
of the part's spans to the PFS, from the buffer while the drain holds it, else from
the local file, checked as it is read. O_DIRECT where it can, fsync'd. One request and
one reply per file; the copy thread sends a few bytes per copy group.

The helper imports no torch (this module, files, faults, priority: about 17 MiB of
RSS against 0.27 GB for one that imports torch). It dies with its rank
(PR_SET_PDEATHSIG), and a kill injected in its write kills the rank too, as a node's
failure would.

Three channels (AF_UNIX SOCK_SEQPACKET pairs), one per thread of the rank that talks
to it, each message a pickled tuple; the helper keys what it gets by step, so the
order between channels does not matter:
  copy   -> ("buffer", gen, size) + memfd   the staging buffer, generation `gen`
         -> ("progress", step, upto)        step's first `upto` bytes staged (None: failed)
         -> ("take_back", step)             the buffer is about to be overwritten
         <- ("taken", step)                 no byte of `step` is read from it after this
  write  -> ("write", step, gen, tmp, reuse, size)
         <- ("done", step, size, crc, bytes read from the buffer) | ("error", step, kind, errno, text)
  drain  -> ("copy", step, gen, path, reuse, spans, tail, file, expect, crc)
         <- the same replies
"""

import ctypes
import errno
import mmap
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading

from titan_ckpt_plus import faults, priority
from titan_ckpt_plus.tiers import files

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PIECE = 32 << 10  # a datagram's payload: well under any socket's send buffer
CHANNELS = ("copy", "write", "drain")


def _send(sock: socket.socket, msg: tuple, fds: tuple = ()) -> None:
    """A message as datagrams of at most _PIECE bytes, each led by 1 if more follow
    (a drain's small items can be larger than one datagram may be); the fds ride on
    the first. The caller holds the channel, so its datagrams are not interleaved."""
    data = pickle.dumps(msg)
    for at in range(0, len(data), _PIECE):
        piece = (b"\1" if at + _PIECE < len(data) else b"\0") + data[at : at + _PIECE]
        if fds and at == 0:
            socket.send_fds(sock, [piece], list(fds))
        else:
            sock.send(piece)


def _recv(sock: socket.socket) -> tuple[tuple | None, list]:
    """The next message and its fds; (None, []) once the other end has closed."""
    parts, fds = [], []
    while True:
        data, got, _, _ = socket.recv_fds(sock, _PIECE + 1, 1)
        if not data:
            return None, []
        fds += got
        parts.append(data[1:])
        if data[:1] == b"\0":
            return pickle.loads(b"".join(parts)), fds


class ByteHelper:
    """The training process's side: starts the helper and talks to it, each thread on
    its own channel (the training and copy threads on "copy", the writer on "write",
    the drain on "drain"); a SOCK_SEQPACKET message is sent whole or not at all."""

    def __init__(self, nice: int = 0) -> None:
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in CHANNELS]
        theirs = [b.fileno() for _, b in pairs]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(os.getpid()), str(nice), *map(str, theirs)],
            pass_fds=theirs, stdin=subprocess.DEVNULL)
        for _, b in pairs:
            b.close()
        self._socks = {name: a for name, (a, _) in zip(CHANNELS, pairs)}
        self._locks = {name: threading.Lock() for name in CHANNELS}
        self._shared: tuple | None = None
        self._open = True
        self.files = 0  # files it wrote
        self._expect("copy", ("ready",))

    @property
    def alive(self) -> bool:
        """Neither closed nor ended (killed, out of memory)."""
        return self._open and self.proc.poll() is None

    def share(self, gen: int, fd: int, size: int) -> None:
        """The staging buffer, if it is not the one the helper already has. A helper
        that is gone is found by the request that follows."""
        if self._shared != (gen, size):
            try:
                self._call("copy", ("buffer", gen, size), (fd,))
            except OSError:
                return
            self._shared = (gen, size)

    def progress(self, step: int, upto: int | None) -> None:
        """StagingProgress's listener: `upto` bytes of `step` staged, None if failed."""
        try:
            self._call("copy", ("progress", step, upto))
        except OSError:  # the writer's request reports a dead helper
            pass

    def take_back(self, step: int) -> None:
        """Before the buffer is written again: once this returns, the helper reads
        none of step's bytes from it (a copy goes on from the local file)."""
        try:
            self._call("copy", ("take_back", step))
            self._expect("copy", ("taken",))
        except OSError:  # gone: it reads nothing any more
            pass

    def write(self, step: int, gen: int, tmp: str, reuse: str | None, size: int) -> dict:
        """Write step's first `size` staged bytes to `tmp`, durably, as they are
        staged; returns its size and CRC-32C. Raises OSError as an in-process write
        would (ENOSPC, EIO), or EPIPE if the helper is gone."""
        return self._request("write", ("write", step, gen, tmp, reuse, size))

    def copy(self, step: int, gen: int | None, path: str, reuse: str | None, spans: list, tail: bytes,
             file: str | None, expect: dict | None, crc: int | None) -> dict:
        """Write `spans` of step's part, then `tail`, to `path`, durably: from buffer
        generation `gen` until taken back (None: not at all), then from `file`, checked
        against `expect` as it is read (CorruptCheckpoint if it differs). `crc`: the
        spans' CRC-32C if known (else computed). Returns the file's size and CRC-32C."""
        return self._request("drain", ("copy", step, gen, path, reuse, spans, tail, file, expect, crc))

    def close(self) -> None:
        if self._open:
            self._open = False
            for sock in self._socks.values():
                sock.close()  # the helper exits when it reads EOF
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def _request(self, channel: str, msg: tuple) -> dict:
        self._call(channel, msg)
        reply = self._expect(channel, ("done", "error"))
        if reply[0] == "error":
            _, _, kind, code, text = reply
            raise files.CorruptCheckpoint(text) if kind == "corrupt" else OSError(code, text)
        self.files += 1
        return {"size": reply[2], files.SUM: reply[3], "from_memory": reply[4]}

    def _call(self, channel: str, msg: tuple, fds: tuple = ()) -> None:
        try:
            with self._locks[channel]:
                _send(self._socks[channel], msg, fds)
        except (ConnectionError, OSError) as e:
            if isinstance(e, ConnectionError) or not self._open:  # EPIPE, or closed here
                self._gone(e)
            raise

    def _expect(self, channel: str, kinds: tuple) -> tuple:
        try:
            reply, _ = _recv(self._socks[channel])
        except ConnectionError as e:
            self._gone(e)
        if reply is None:
            self._gone(None)
        if reply[0] not in kinds:
            raise RuntimeError(f"byte helper: {reply!r} where {kinds} was expected")
        return reply

    def _gone(self, e: OSError | None):
        self._open = False
        raise OSError(errno.EPIPE, f"the byte helper process (pid {self.proc.pid}) has ended "
                                   f"(exit code {self.proc.poll()}; {e!r})")


# ---- the helper process ----------------------------------------------------------


class _LocalWrite:
    """A local data file, written piece by piece as the staging copy stages them."""

    def __init__(self, helper: "_Helper", sock, step: int, gen: int, tmp: str, reuse: str | None,
                 size: int) -> None:
        self.helper, self.sock, self.step, self.gen = helper, sock, step, gen
        self.pieces = files._chunks(size)
        self.out = files.Appender(tmp, reuse)
        self.tmp, self.size = tmp, size

    def ready(self) -> bool:
        staged = self.helper.staged.get(self.step, 0)
        return staged is None or not self.pieces or self.pieces[0][1] <= staged

    def piece(self) -> dict | None:
        """Write the next piece; the file's entry once it is all written and durable."""
        if self.helper.staged.get(self.step, 0) is None:
            raise RuntimeError("staging failed before these bytes were copied")
        if self.pieces:
            start, end = self.pieces.pop(0)
            self.out.write(self.helper.view(self.gen)[start:end], crc=False)
            faults.maybe_kill("kill_during_local_write", self.step, pid=os.getppid())
            faults.maybe_fail("enospc_local_write", self.step)
            return None
        self.out.__exit__(None, None, None)
        return {"size": self.size, files.SUM: None, "from_memory": self.size}  # CRC: the copy thread's

    def abandon(self) -> None:
        self.out.__exit__(RuntimeError, None, None)
        try:
            os.remove(self.tmp)
        except OSError:
            pass


class _SpanCopy:
    """A drain's copy of a part's spans: from the shared buffer until it is taken
    back, then from the local file (read whole, checked at its end)."""

    def __init__(self, helper: "_Helper", sock, step: int, gen: int | None, path: str, reuse: str | None,
                 spans: list, tail: bytes, file: str | None, expect: dict | None, crc: int | None) -> None:
        self.helper, self.sock, self.step, self.gen = helper, sock, step, gen
        self.tail, self.crc, self.total = tail, crc, sum(b - a for a, b in spans)
        self.out = files.Appender(path, reuse)
        self.pieces = self._pieces(spans, file, expect)
        self.from_memory = 0

    def ready(self) -> bool:
        return True

    def _pieces(self, spans: list, file: str | None, expect: dict | None):
        resume = 0
        if self.gen is not None:
            resume = yield from self._from_memory(spans)
            if resume is None:
                return
        if file is None:
            raise RuntimeError(f"step {self.step}'s staged bytes were taken back and it has no local file")
        yield from files.read_spans(file, expect, spans, resume=resume)

    def _from_memory(self, spans: list):
        for a, b in spans:
            for p in range(a, b, files.CHUNK):
                view = self.helper.view(self.gen)
                if self.step in self.helper.taken or view is None:
                    return p
                self.from_memory += min(p + files.CHUNK, b) - p
                yield p, view[p : min(p + files.CHUNK, b)]
        return None

    def piece(self) -> dict | None:
        piece = next(self.pieces, None)
        if piece is not None:
            self.out.write(piece[1], crc=self.crc is None)
            return None
        if self.out.size != self.total:
            raise files.CorruptCheckpoint(f"the part ends before its frames do ({self.out.size} bytes copied)")
        if self.crc is not None:
            self.out.crc = self.crc
        if self.tail:
            self.out.write(self.tail)
        self.out.__exit__(None, None, None)
        return {"size": self.out.size, files.SUM: self.out.crc, "from_memory": self.from_memory}

    def abandon(self) -> None:
        self.pieces.close()
        self.out.__exit__(RuntimeError, None, None)


class _Helper:
    """The helper's loop: messages first, then one piece of each file in flight, so a
    local write and a drain's copy go on side by side."""

    def __init__(self, socks: list[socket.socket]) -> None:
        self.socks = dict(zip(CHANNELS, socks))
        self.buffers: dict[int, mmap.mmap] = {}  # generation -> mapping (the newest two)
        self.staged: dict[int, int | None] = {}  # step -> bytes staged (None: failed)
        self.taken: set[int] = set()  # steps whose bytes the buffer no longer holds
        self.jobs: list = []

    def view(self, gen: int) -> memoryview | None:
        buf = self.buffers.get(gen)
        return None if buf is None else memoryview(buf)

    def run(self) -> None:
        _send(self.socks["copy"], ("ready",))
        while True:
            wait = 0 if any(j.ready() for j in self.jobs) else None
            readable, _, _ = select.select(list(self.socks.values()), [], [], wait)
            for sock in readable:
                msg, fds = _recv(sock)
                if msg is None:
                    return  # the rank closed its end, or died
                self.handle(sock, msg, fds)
            for job in [j for j in self.jobs if j.ready()]:
                self.advance(job)

    def handle(self, sock, msg: tuple, fds: list) -> None:
        kind, step = msg[0], msg[1]
        if kind == "buffer":
            # writable, though only read: files.address (O_DIRECT's alignment check)
            # cannot see a read-only buffer's address, and the writes went buffered
            self.buffers[step] = mmap.mmap(fds[0], msg[2], mmap.MAP_SHARED)
            os.close(fds[0])
            for old in sorted(self.buffers)[:-2]:  # a view in use keeps its mapping alive
                del self.buffers[old]
        elif kind == "progress":
            self.staged[step] = msg[2]
        elif kind == "take_back":
            self.taken.add(step)
            _send(sock, ("taken", step))
        else:  # each thread's requests come in step order: older steps' notes are done with
            if kind == "write":
                self.staged = {s: n for s, n in self.staged.items() if s >= step}
            else:
                self.taken = {s for s in self.taken if s >= step}
            try:
                self.jobs.append((_LocalWrite if kind == "write" else _SpanCopy)(self, sock, *msg[1:]))
            except Exception as e:
                self.reply_error(sock, step, e)

    def advance(self, job) -> None:
        try:
            entry = job.piece()
        except Exception as e:
            self.jobs.remove(job)
            job.abandon()
            self.reply_error(job.sock, job.step, e)
            return
        if entry is not None:
            self.jobs.remove(job)
            _send(job.sock, ("done", job.step, entry["size"], entry[files.SUM], entry["from_memory"]))

    @staticmethod
    def reply_error(sock, step: int, e: Exception) -> None:
        kind = "corrupt" if isinstance(e, files.CorruptCheckpoint) else "os"
        code = e.errno if isinstance(e, OSError) and e.errno else errno.EIO
        _send(sock, ("error", step, kind, code, str(e)))


def main(parent: int, nice: int, fds: list[int]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    libc.prctl(_PR_SET_NAME, b"ckpt-byte-helper")  # as top and the sched logs show it
    if os.getppid() != parent:  # the rank died before the line above
        return
    priority.lower_this_thread(nice)
    _Helper([socket.socket(fileno=fd) for fd in fds]).run()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), [int(a) for a in sys.argv[3:]])
