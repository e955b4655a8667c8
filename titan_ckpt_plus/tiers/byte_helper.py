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

The helper imports no torch (this module, files, faults, priority: about 18 MiB of
RSS, 10 MiB of it private, against 0.27 GB for one that imports torch). It dies with
its rank (PR_SET_PDEATHSIG), and a kill injected in its write kills the rank too, as a
node's failure would.

Three channels (AF_UNIX SOCK_SEQPACKET pairs), one per thread of the rank that talks
to it and one thread of the helper each, so a slow PFS never holds up a local write or
a take-back. Each message is a pickled tuple; what the helper is told is keyed by step,
so the order between channels does not matter:
  copy   -> ("buffer", gen, size) + memfd   the staging buffer, generation `gen`
         -> ("progress", step, upto)        step's first `upto` bytes staged (None: failed)
         -> ("take_back", step)             the buffer is about to be overwritten
         <- ("taken", step)                 no byte of `step` is read from it after this
  write  -> ("write", step, gen, tmp, reuse, size)
         <- ("done", step, size, crc, bytes read from the buffer) | ("error", step, kind, errno, text)
  drain  -> ("copy", step, gen, path, reuse, spans, tail, file, expect, crc)
         <- the same replies
"""

import contextlib
import ctypes
import errno
import mmap
import os
import pickle
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
    the drain on "drain"). A message sent in part, or a reply for another step, leaves
    a channel out of step: the helper is then stopped and counts as gone. Made on the
    training thread: PR_SET_PDEATHSIG acts when the thread that started it ends."""

    def __init__(self, nice: int = 0) -> None:
        pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in CHANNELS]
        theirs = [b.fileno() for _, b in pairs]
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(os.getpid()), str(nice), *map(str, theirs)],
                pass_fds=theirs, stdin=subprocess.DEVNULL)
        finally:
            for _, b in pairs:
                b.close()
        self._socks = {name: a for name, (a, _) in zip(CHANNELS, pairs)}
        self._locks = {name: threading.Lock() for name in CHANNELS}
        self._shared: tuple | None = None
        self._open = True
        self.files = 0  # files it wrote
        try:
            self._expect("copy", ("ready",), os.getpid())
        except OSError:
            self.close()
            raise

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
        none of step's bytes from it (a copy goes on from the local file). Waits for
        one piece from memory at most."""
        try:
            self._call("copy", ("take_back", step))
            self._expect("copy", ("taken",), step)
        except OSError:  # gone: it reads nothing any more
            pass

    def write(self, step: int, gen: int, tmp: str, reuse: str | None, size: int) -> None:
        """Write step's first `size` staged bytes to `tmp`, durably, as they are
        staged. Raises OSError as an in-process write would (ENOSPC, EIO), or EPIPE
        if the helper is gone."""
        self._request("write", ("write", step, gen, tmp, reuse, size))

    def copy(self, step: int, gen: int | None, path: str, reuse: str | None, spans: list, tail: bytes,
             file: str | None, expect: dict | None, crc: int | None) -> tuple[dict, int]:
        """Write `spans` of step's part, then `tail`, to `path`, durably: from buffer
        generation `gen` until taken back (None: not at all), then from `file`, checked
        against `expect` as it is read (CorruptCheckpoint if it differs). `crc`: the
        spans' CRC-32C if known (else computed). Returns the file's manifest entry
        (size, CRC-32C) and how many of its bytes came from the buffer."""
        return self._request("drain", ("copy", step, gen, path, reuse, spans, tail, file, expect, crc))

    def close(self) -> None:
        """Stop the helper: EOF on its channels (shutdown reaches it even where a
        forked child, a dataloader worker, still holds our ends), killed if it lingers."""
        if self._open:
            self._open = False
            for sock in self._socks.values():
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _request(self, channel: str, msg: tuple) -> tuple[dict, int]:
        self._call(channel, msg)
        reply = self._expect(channel, ("done", "error"), msg[1])
        if reply[0] == "error":
            _, _, kind, code, text = reply
            raise files.CorruptCheckpoint(text) if kind == "corrupt" else OSError(code, text)
        self.files += 1
        return {"size": reply[2], files.SUM: reply[3]}, reply[4]

    def _call(self, channel: str, msg: tuple, fds: tuple = ()) -> None:
        try:
            with self._locks[channel]:
                _send(self._socks[channel], msg, fds)
        except OSError as e:  # gone, or a message sent in part: the channel is out of step
            self._gone(e)

    def _expect(self, channel: str, kinds, step: int) -> tuple:
        """The channel's next reply, which must be one of `kinds` and for `step`."""
        try:
            reply, _ = _recv(self._socks[channel])
        except OSError as e:
            self._gone(e)
        if reply is None:
            self._gone(None)
        if reply[0] not in kinds or reply[1] != step:
            self._gone(RuntimeError(f"{reply[:2]!r} where {kinds} for {step} was expected"))
        return reply

    def _gone(self, e: Exception | None):
        code = self.proc.poll()
        self.close()  # a helper out of step with us is stopped, not trusted
        raise OSError(errno.EPIPE, f"the byte helper process (pid {self.proc.pid}) has ended "
                                   f"(exit code {code}; {e!r})")


# ---- the helper process ----------------------------------------------------------


class _Helper:
    """A thread per channel: the copy channel's (buffers, progress, take-backs: never
    blocked by a write), the writer's and the drain's (one file each at a time)."""

    def __init__(self, socks: list[socket.socket], parent: int) -> None:
        self.socks = dict(zip(CHANNELS, socks))
        self.parent = parent  # the rank: what a kill fault kills
        self.cv = threading.Condition()  # over buffers, staged, taken
        self.buffers: dict[int, mmap.mmap] = {}  # generation -> mapping (the newest two)
        self.staged: dict[int, int | None] = {}  # step -> bytes staged (None: failed)
        self.taken: set[int] = set()  # steps whose bytes the buffer no longer holds
        self.memory = threading.Lock()  # held while a piece goes from the buffer to a file

    def run(self) -> None:
        for name, work in (("write", self.local_write), ("drain", self.span_copy)):
            threading.Thread(target=self.serve, args=(self.socks[name], work), daemon=True).start()
        sock = self.socks["copy"]
        _send(sock, ("ready", self.parent))
        while (msg := _recv(sock))[0] is not None:  # EOF: the rank closed it, or died
            self.note(sock, *msg)

    def note(self, sock, msg: tuple, fds: list) -> None:
        kind, key = msg[0], msg[1]
        if kind == "buffer":
            # writable, though only read: files.address (O_DIRECT's alignment check)
            # cannot see a read-only buffer's address, and the writes went buffered
            mapping = mmap.mmap(fds[0], msg[2], mmap.MAP_SHARED)
            os.close(fds[0])
            with self.cv:
                self.buffers[key] = mapping
                for old in sorted(self.buffers)[:-2]:  # a view in use keeps its mapping alive
                    del self.buffers[old]
        elif kind == "progress":
            with self.cv:
                self.staged[key] = msg[2]
                self.cv.notify_all()
        elif kind == "take_back":
            with self.cv:
                self.taken.add(key)
            with self.memory:  # the piece being written from the buffer, if any, is written
                pass
            _send(sock, ("taken", key))

    def serve(self, sock, work) -> None:
        while (msg := _recv(sock)[0]) is not None:
            step = msg[1]
            try:
                entry, from_memory = work(*msg[1:])
            except Exception as e:
                kind = "corrupt" if isinstance(e, files.CorruptCheckpoint) else "os"
                code = e.errno if isinstance(e, OSError) and e.errno else errno.EIO
                _send(sock, ("error", step, kind, code, str(e)))
            else:
                _send(sock, ("done", step, entry["size"], entry[files.SUM], from_memory))

    def view(self, gen: int) -> memoryview:
        with self.cv:
            return memoryview(self.buffers[gen])

    def wait_staged(self, step: int, upto: int) -> None:
        with self.cv:
            self.staged = {s: n for s, n in self.staged.items() if s >= step}  # writes come in step order
            while (self.staged.get(step) or 0) < upto and self.staged.get(step, 0) is not None:
                self.cv.wait()
            if self.staged.get(step, 0) is None:
                raise RuntimeError("staging failed before these bytes were copied")

    def local_write(self, step: int, gen: int, tmp: str, reuse: str | None, size: int) -> tuple[dict, int]:
        """The local data file, piece by piece as the copy stages it (its CRC-32C is
        the copy thread's)."""
        try:
            with files.Appender(tmp, reuse) as out:
                for start, end in files._chunks(size):
                    self.wait_staged(step, end)
                    out.write(self.view(gen)[start:end], crc=False)
                    faults.maybe_kill("kill_during_local_write", step, pid=self.parent)
                    faults.maybe_fail("enospc_local_write", step)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        return {"size": size, files.SUM: None}, size

    def span_copy(self, step: int, gen: int | None, path: str, reuse: str | None, spans: list, tail: bytes,
                  file: str | None, expect: dict | None, crc: int | None) -> tuple[dict, int]:
        """A drain's copy: from the buffer until it is taken back, then from the local
        file (read whole, checked at its end)."""
        with self.cv:
            self.taken = {s for s in self.taken if s >= step}  # drains come in step order
        switch = [None if gen is not None else 0]  # where the file takes over; None: never

        def pieces():
            if gen is not None:
                switch[0] = yield from files.memory_pieces(self.view(gen), spans, self.memory,
                                                           lambda: step in self.taken)
                if switch[0] is None:
                    return
            if file is None:
                raise RuntimeError(f"step {step}'s staged bytes were taken back and it has no local file")
            yield from files.read_spans(file, expect, spans, resume=switch[0])

        entry = files.copy_spans(path, reuse, spans, pieces(), tail, crc,
                                 on_piece=lambda: faults.maybe_delay("slow_pfs_copy", step, 0.1))
        upto = switch[0]
        return entry, sum(b - a if upto is None else max(0, min(b, upto) - a) for a, b in spans)


def main(parent: int, nice: int, fds: list[int]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    libc.prctl(_PR_SET_NAME, b"ckpt-byte-helper")  # as top and the sched logs show it
    if os.getppid() != parent:  # the rank died before the line above
        return
    priority.lower_this_thread(nice)
    _Helper([socket.socket(fileno=fd) for fd in fds], parent).run()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), [int(a) for a in sys.argv[3:]])
