"""A save's bytes, written by a helper process (issue 15, docs/helper_process.md).

A thread of the training process that writes a file hands the kernel a piece at a
time and takes the GIL back after each: on a host where that costs the training
thread more than the thread's own CPU, two such writers slowed a launch-bound loop by
+13% against +0.3% for the same writes from another process (BENCHMARKS.md,
overhead). So with `[checkpoint] helper_process = true` the staging buffer is shared
memory (a memfd, staging.shared_buffer) and each rank's helper moves the bytes: the
local data file, written as the staging copy's progress allows, and the drain's copy
of the part's spans to the PFS, from the buffer while the drain holds it, else from
the local file, checked as it is read. O_DIRECT where it can, fsync'd. It runs the
rank's LocalTier too: the part's layout and manifest files, the commit marker and local
retention, so the writer thread sends a few requests a save and waits for their replies
instead of making some seventy system calls itself. The copy thread sends a few bytes
per copy group.

The helper imports no torch (this module, files, faults, priority: about 18 MiB of
RSS, 10 MiB of it private, against 0.27 GB for one that imports torch). It dies with
its rank (PR_SET_PDEATHSIG), and a kill injected in its write kills the rank too, as a
node's failure would.

Three channels (AF_UNIX SOCK_SEQPACKET pairs), one per thread of the rank that talks
to it and one thread of the helper each, so a slow PFS never holds up a local write or
a take-back. Each message is a pickled tuple; what the helper is told is keyed by step,
so the order between channels does not matter:
  copy   <- ("ready", rank, [tid])            at start: its checksum thread, for the rank's SCHED_IDLE set
         -> ("tiers", 0, LocalTier's arguments, PfsFolder's)  the rank's tiers, once
         <- ("attached", 0)
         -> ("hub", 0, HubInfo, rank)       the job's hub (tiers/hub.py): join it
         <- ("joined", 0) | ("error", 0, ...)
         -> ("buffer", gen, size) + memfd   the staging buffer, generation `gen`
         -> ("progress", step, upto)        step's first `upto` bytes staged (None: the copy failed)
         -> ("take_back", step)             the buffer is about to be overwritten
         <- ("taken", step)                 no byte of `step` is read from it after this
  write  -> ("part", step, gen, size)       LocalTier.write_part from the buffer ...
         -> ("describe", step, layout, meta)  ... its layout bytes and manifest fields, sent
                                            once the copy is done (None: it failed)
         <- ("done", step, manifest bytes) | ("error", step, kind, errno, text)
         -> ("tier", step, method, args)    LocalTier.commit or .retain
         <- ("done", step, its result) | the error
         -> ("vote", key, flags, marker, keep)  the writer's vote through the hub; if every
                                            rank's first flag holds, the commit marker
                                            (`marker`: its fields, None: not this rank's)
         <- ("done", key, ([flags], the marker's error or None)) | the error
                                            ... then local retention (`keep`: its protected
                                            steps and held sources), after the reply
  drain  -> ("exchange", key, object)       every rank's object for `key`, through the hub
         <- ("done", key, [objects]) | the error   (a layout's first drain: its start, its gather)
         -> ("planned", (start, gather), flags, why, copy, lengths, seal)  a kept plan's
                                            drain (pfs_folder.copy_once_agreed): the start
                                            exchange, the copy (its request's fields, below),
                                            the gather; on rank 0 (`seal`) the step's manifest
                                            and .metadata, then PFS retention
         <- ("done", (start, gather), (agreed flags, [outcomes] or None, retention or None))
            | the error
         -> ("copy", step, gen, path, reuse, spans, tail, file, expect, crc)
         <- ("done", step, (entry, bytes read from the buffer)) | the error
         -> ("files", folder, [(path, bytes)])  a PFS step's manifest and .metadata
         <- ("done", folder, their entries) | the error
         -> ("purge", step)                 PFS retention after step's drain (rank 0)
         <- ("done", step, the steps removed) | the error ("torch": NeedsTorch)
"""

import bisect
import collections
import contextlib
import ctypes
import errno
import mmap
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
from concurrent import futures

from titan_ckpt_plus import faults, priority
from titan_ckpt_plus.tiers import files
from titan_ckpt_plus.tiers.hub import STREAMS, HubInfo, HubMember, every
from titan_ckpt_plus.tiers.local import LocalTier
from titan_ckpt_plus.tiers.pfs_folder import NeedsTorch, PfsFolder, copy_once_agreed

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_PIECE = 64 << 10  # a datagram's payload: under a socket's default send buffer (208 KiB on Linux)
CHANNELS = ("copy", "write", "drain")
TIER_CALLS = ("commit", "retain")  # what the writer asks of the helper's LocalTier


def by_helper(helper: "ByteHelper | None", there, here):
    """`there(helper)` while the byte helper runs, else `here()`; `here()` too when the
    helper ended during the request (what it did not finish is done again, whole: each
    such request is one durable batch or a retention pass) or answered NeedsTorch.
    Whether it still runs is asked of the process only once a request failed: a
    waitpid per request is a system call that hands the GIL to training and back."""
    if helper is not None and helper.running:
        try:
            return there(helper)
        except NeedsTorch:
            pass
        except OSError:
            if helper.alive:  # the request failed in the helper: a real error
                raise
    return here()


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
            # a session of its own: the launcher's SIGTERM to the rank's process group (a
            # preemption notice) is the rank's to act on, and the rank's last saves need it
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(os.getpid()), str(nice), *map(str, theirs)],
                pass_fds=theirs, stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            for _, b in pairs:
                b.close()
        self._socks = {name: a for name, (a, _) in zip(CHANNELS, pairs)}
        self._locks = {name: threading.Lock() for name in CHANNELS}
        self._shared: tuple | None = None
        self._open = True
        self.served = collections.Counter()  # requests it did, by kind
        self.hub_joined = False  # its streams are connected to the job's hub (join_hub)
        try:
            # its checksum thread: the rank runs it in SCHED_IDLE while on time, as its copy thread
            self.idle_tids: list[int] = self._expect("copy", ("ready",), os.getpid())[2]
        except OSError:
            self.close()
            raise

    @property
    def alive(self) -> bool:
        """Neither closed nor ended (killed, out of memory)."""
        return self._open and self.proc.poll() is None

    @property
    def running(self) -> bool:
        """Not closed, nor seen to have ended, asking nothing of the kernel: a helper
        that ended since is found by the request that follows (EPIPE)."""
        return self._open and self.proc.returncode is None

    def share(self, gen: int, fd: int, size: int) -> None:
        """The staging buffer, if it is not the one the helper already has. A helper
        that is gone is found by the request that follows."""
        if self._shared != (gen, size):
            try:
                self._call("copy", ("buffer", gen, size), (fd,))
            except OSError:
                return
            self._shared = (gen, size)

    def attach(self, tier: LocalTier, pfs: PfsFolder | None = None) -> None:
        """The rank's local tier (write_part, tier) and PFS folder (purge_pfs), run by
        the helper from now on: copies made from their settings, as neither keeps
        state. Waits until the helper has them: other channels' requests use them."""
        self._call("copy", ("tiers", 0, (tier.root, tier.rank, tier.world_size, tier.first_on_node,
                                         tier.keep_latest_k, tier.job_id),
                            pfs and (pfs.folder, pfs.rank, pfs.world_size, pfs.keep_latest_k, pfs.job_id,
                                     pfs.reuse_files)))
        self._expect("copy", ("attached",), 0)

    def join_hub(self, info: HubInfo, rank: int) -> None:
        """Connect the helper's streams to the job's hub (at start-up), so the writer's
        and the drain's exchanges go through it. Raises OSError if it could not."""
        self._request("copy", ("hub", 0, info, rank))
        self.hub_joined = True

    def exchange(self, channel: str, key: tuple, obj) -> list:
        """Every rank's object for exchange `key`, through the hub, by the helper (on
        the calling thread's channel): this thread only waits for the reply."""
        return self._request(channel, ("exchange", key, obj))

    def vote(self, key: tuple, flags: list[bool], marker: dict | None, keep: tuple) -> tuple[list, str | None]:
        """The writer's vote (every rank's `flags`, through the hub), then, if every
        rank's first flag holds, LocalTier.commit(step, marker) (unless `marker` is None)
        and after the reply LocalTier.retain(step, *keep): one request where there were
        three, so the writer wakes once. Returns every rank's flags and the marker's
        error (None: written or not this rank's)."""
        return self._request("write", ("vote", key, flags, marker, keep))

    def progress(self, step: int, size: int):
        """A StagingProgress listener for step's `size` bytes: tells the helper how many
        are staged (None: the copy failed), but only when they reach the end of the
        helper's next piece (files._chunks), which is all it waits for: fewer
        messages, each a system call of the copy thread."""
        ends = [end for _, end in files._chunks(size)]

        def listener(upto: int | None) -> None:
            if upto is not None:
                passed = bisect.bisect_right(ends, upto)  # the pieces this progress completes
                if not passed:
                    return
                del ends[:passed]
            try:
                self._call("copy", ("progress", step, upto))
            except OSError:  # the writer's request reports a dead helper
                pass
        return listener

    def take_back(self, step: int) -> None:
        """Before the buffer is written again: once this returns, the helper reads
        none of step's bytes from it (a copy goes on from the local file). Waits for
        one piece from memory at most."""
        try:
            self._call("copy", ("take_back", step))
            self._expect("copy", ("taken",), step)
        except OSError:  # gone: it reads nothing any more
            pass

    def write_part(self, step: int, gen: int, size: int, describe) -> bytes:
        """LocalTier.write_part of step's first `size` staged bytes, by the helper, as
        they are staged; `describe()` (layout bytes, manifest fields) is called here
        meanwhile and its result sent on. Returns the manifest's bytes. Raises
        OSError as an in-process write would (ENOSPC, EIO), or EPIPE if the helper is
        gone; what describe() raises, once the helper has let the part go."""
        self._call("write", ("part", step, gen, size))
        try:
            layout, meta = describe()
        except BaseException:
            self._call("write", ("describe", step, None, None))  # the helper waits for it
            with contextlib.suppress(OSError, files.CorruptCheckpoint):
                self._request("write", None, step)
            raise
        self._call("write", ("describe", step, layout, meta))
        raw = self._request("write", None, step)
        self.served["part"] += 1
        return raw

    def tier(self, step: int, method: str, *args):
        """The helper's LocalTier.`method`(step, *args) (one of TIER_CALLS): its result,
        or what it raised, as an OSError."""
        return self._request("write", ("tier", step, method, args))

    def copy(self, step: int, gen: int | None, path: str, reuse: str | None, spans: list, tail: bytes,
             file: str | None, expect: dict | None, crc: int | None) -> tuple[dict, int]:
        """Write `spans` of step's part, then `tail`, to `path`, durably: from buffer
        generation `gen` until taken back (None: not at all), then from `file`, checked
        against `expect` as it is read (CorruptCheckpoint if it differs). `crc`: the
        spans' CRC-32C if known (else computed). Returns the file's manifest entry
        (size, CRC-32C) and how many of its bytes came from the buffer."""
        return self._request("drain", ("copy", step, gen, path, reuse, spans, tail, file, expect, crc))

    def copy_planned(self, keys: tuple, flags: list[bool], why: str, request: tuple | None,
                     lengths: list[int], seal: tuple | None = None) -> tuple[list[bool], list | None, tuple | None]:
        """A kept plan's drain (pfs_folder.copy_once_agreed) by the helper, in one request:
        the start exchange `keys[0]` of `flags`, then, if all hold on every rank, the
        copy (`request`: copy()'s arguments; not tried if `why`) and the gather
        `keys[1]` of (why, {file: entry}, `lengths`); then, given `seal` (rank 0:
        PfsFolder.seal_kept's step, path, .metadata, lengths), the step's manifest and
        .metadata if every part is as planned, and PFS retention. Returns the agreed
        flags, the gathered outcomes (None: not all held) and retention's outcome
        (PfsFolder.purge_outcome; None: not sealed)."""
        return self._request("drain", ("planned", keys, flags, why, request, lengths, seal))

    def purge_pfs(self, step: int) -> list[int]:
        """PfsFolder.purge by the helper, after step's drain (on the drain's channel);
        NeedsTorch where a step without our manifest needs its .metadata read."""
        return self._request("drain", ("purge", step))

    def write_batch(self, folder: str, items: list) -> list[dict]:
        """files.write_batch(folder, items), by the helper (on the drain's channel; the
        folder is the request's key)."""
        return self._request("drain", ("files", folder, items))

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

    def _request(self, channel: str, msg: tuple | None, step: int | None = None):
        """Send `msg` (None: it was sent) and return its reply's result."""
        if msg is not None:
            self._call(channel, msg)
            step = msg[1]
        reply = self._expect(channel, ("done", "error"), step)
        if reply[0] == "error":
            _, _, kind, code, text = reply
            if kind == "corrupt":
                raise files.CorruptCheckpoint(text)
            if kind == "torch":
                raise NeedsTorch(text)
            raise OSError(code, text)
        if msg is not None:
            self.served[msg[0] if msg[0] != "tier" else msg[2]] += 1
        return reply[2]

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
    blocked by a write), the writer's (the local tier: a part, its commit and
    retention) and the drain's (one file at a time)."""

    def __init__(self, socks: list[socket.socket], parent: int) -> None:
        self.sums = _StagedSums(self)
        self.socks = dict(zip(CHANNELS, socks))
        self.parent = parent  # the rank: what a kill fault kills
        self.local: LocalTier | None = None  # the rank's, once attached
        self.pfs: PfsFolder | None = None  # the job's, once attached
        self.cv = threading.Condition()  # over buffers, staged, taken
        self.buffers: dict[int, mmap.mmap] = {}  # generation -> mapping (the newest two)
        self.staged: dict[int, int | None] = {}  # step -> bytes staged (None: failed)
        self.taken: set[int] = set()  # steps whose bytes the buffer no longer holds
        self.memory = threading.Lock()  # held while a piece goes from the buffer to a file
        self.members: dict[str, HubMember] = {}  # stream -> its connection to the hub, once joined

    def run(self) -> None:
        served = [threading.Thread(target=self.serve, args=(self.socks[name], work, f"ckpt-helper-{name}"),
                                   daemon=True)
                  for name, work in (("write", self.local_work), ("drain", self.drain_work))]
        for thread in served:
            thread.start()
        sock = self.socks["copy"]
        _send(sock, ("ready", self.parent, [self.sums.thread.native_id]))
        while (msg := _recv(sock))[0] is not None:  # EOF: the rank closed it, or died
            self.note(sock, *msg)
        for thread in served:  # closed: the work after a last reply (retention) ends first
            thread.join(timeout=10)

    def note(self, sock, msg: tuple, fds: list) -> None:
        kind, key = msg[0], msg[1]
        if kind == "tiers":
            self.local = LocalTier(*msg[2])
            self.pfs = msg[3] and PfsFolder(*msg[3])
            _send(sock, ("attached", key))
        elif kind == "hub":
            try:
                for stream in STREAMS:
                    self.members[stream] = member = HubMember(msg[2], msg[3], stream)
                    member.connect()
            except OSError as e:  # the rank exchanges from its own process: none of these stays open
                for member in self.members.values():
                    member.close()
                self.members.clear()
                _send(sock, ("error", key, "os", errno.EIO, str(e)))
            else:
                _send(sock, ("done", key, None))
        elif kind == "buffer":
            # writable, though only read: files.address (O_DIRECT's alignment check)
            # cannot see a read-only buffer's address, and the writes went buffered
            mapping = mmap.mmap(fds[0], msg[2], mmap.MAP_SHARED)
            os.close(fds[0])
            with self.cv:
                self.buffers[key] = mapping
                for old in sorted(self.buffers)[:-2]:  # a view in use keeps its mapping alive
                    del self.buffers[old]
                self.cv.notify_all()
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

    def serve(self, sock, work, name: str) -> None:
        _name_thread(name)
        while (msg := _recv(sock)[0]) is not None:
            step = msg[1]
            try:
                result = work(sock, *msg)
            except Exception as e:
                kind = ("corrupt" if isinstance(e, files.CorruptCheckpoint)
                        else "torch" if isinstance(e, NeedsTorch) else "os")
                code = e.errno if isinstance(e, OSError) and e.errno else errno.EIO
                _send(sock, ("error", step, kind, code, str(e)))
            else:
                then = None
                if isinstance(result, _Then):
                    result, then = result.result, result.then
                _send(sock, ("done", step, result))
                if then is not None:
                    then()

    def view(self, gen: int) -> memoryview:
        """Buffer generation `gen`, once its message (sent before any request that
        names it, but on the copy channel, served by another thread) is in."""
        with self.cv:
            if not self.cv.wait_for(lambda: gen in self.buffers, timeout=60):
                raise RuntimeError(f"staging buffer {gen} was never shared with the helper")
            return memoryview(self.buffers[gen])

    def wait_staged(self, step: int, upto: int) -> int:
        """As StagingProgress.wait, for the copy the rank reports."""
        with self.cv:
            self.staged = {s: n for s, n in self.staged.items() if s >= step}  # writes come in step order
            while (self.staged.get(step) or 0) < upto and self.staged.get(step, 0) is not None:
                self.cv.wait()
            if self.staged.get(step, 0) is None:
                raise RuntimeError("staging failed before these bytes were copied")
            return self.staged[step]

    def local_work(self, sock, kind: str, step: int, *args):
        if kind == "vote":  # keyed by the exchange
            return self.vote(step, *args)
        if kind == "part":
            return self.part_write(sock, step, *args)
        if kind == "tier" and args[0] in TIER_CALLS:
            method, call_args = args
            return getattr(self.local, method)(step, *call_args)
        raise ValueError(f"not a request of the byte helper: {kind} {args[:1]}")

    def vote(self, key: tuple, flags: list, marker: dict | None, keep: tuple) -> "_Then":
        """The writer's vote, the commit marker if every rank's part is in, and local
        retention once the reply is out (its failure only warned about, as the rank
        does: the next save's retention catches up)."""
        got = self.members[key[0]].exchange(key, flags)
        step, committed = key[1], all(g[0] for g in got)
        why = None
        if committed and marker is not None:
            try:
                self.local.commit(step, marker)
            except Exception as e:  # the save fails on this rank, as the vote stands
                why = repr(e)

        def retain() -> None:
            try:
                self.local.retain(step, *keep)
            except Exception as e:  # the next save's retention catches up
                print(f"[titan_ckpt_plus] local retention failed (byte helper): {e!r}", file=sys.stderr, flush=True)
        return _Then((got, why), retain if committed else None)

    def part_write(self, sock, step: int, gen: int, size: int) -> bytes:
        """LocalTier.write_part from the buffer, piece by piece as the copy stages it,
        checksummed here by the sum thread (so the training process's copy thread only
        copies); its layout and manifest fields come as the writer's next message,
        which is read even if the data's write failed."""
        described, job = [], None

        def describe():
            msg, _ = _recv(sock)
            described.append(msg)
            if msg is None or msg[:2] != ("describe", step):
                raise RuntimeError(f"{msg!r} where the description of step {step} was expected")
            if msg[2] is None:
                raise RuntimeError("staging failed")
            return msg[2], msg[3]

        def on_chunk(_n):
            faults.maybe_kill("kill_during_local_write", step, pid=self.parent)
            faults.maybe_fail("enospc_local_write", step)

        try:
            self.wait_staged(step, min(1, size))  # a copy that failed first never shared its buffer
            data = self.view(gen)[:size]
            job = self.sums.submit(step, data)
            raw, _ = self.local.write_part(step, data, describe, on_chunk=on_chunk,
                                           before_chunk=lambda end: self.wait_staged(step, end),
                                           known_crc=job.result)
        finally:
            if job is not None:  # the next write forgets this step's progress, which the sum waits on
                futures.wait([job])
            if not described:  # the writer sends it all the same; an error is the one above
                with contextlib.suppress(RuntimeError):
                    describe()
        return raw

    def drain_work(self, sock, kind: str, step, *args):
        if kind == "files":  # keyed by its folder
            return files.write_batch(step, *args)
        if kind == "purge":
            return self.pfs.purge()
        if kind == "exchange":
            return self.members[step[0]].exchange(step, *args)
        if kind == "planned":  # keyed by its exchanges
            return self.copy_planned(step, *args)
        if kind != "copy":
            raise ValueError(f"not a request of the byte helper: {kind}")
        return self.span_copy(step, *args)

    def copy_planned(self, keys: tuple, flags: list, why: str, request: tuple | None,
                     lengths: list, seal: tuple | None) -> tuple[list, list | None, tuple | None]:
        """ByteHelper.copy_planned: the exchanges through this rank's drain stream, the
        copy as span_copy makes it (the kill fault the rank's writer would fire first),
        then the seal and retention where asked."""
        member = self.members[keys[0][0]]

        def copy() -> dict:
            faults.maybe_kill("kill_during_pfs_write", request[0], pid=self.parent)
            entry, _ = self.span_copy(*request)
            return {os.path.basename(request[2]): entry}
        agreed, got = copy_once_agreed(lambda f: every(member.exchange(keys[0], f)), flags, copy,
                                       lambda obj: member.exchange(keys[1], obj), why, lengths)
        if seal is None or got is None or not self.pfs.seal_kept(got, *seal):
            return agreed, got, None
        return agreed, got, self.pfs.purge_outcome()

    def span_copy(self, step: int, gen: int | None, path: str, reuse: str | None, spans: list,
                  tail: bytes, file: str | None, expect: dict | None, crc: int | None) -> tuple[dict, int]:
        """A drain's copy: from the buffer until it is taken back, then from the local
        file (read whole, checked at its end)."""
        with self.cv:
            self.taken = {s for s in self.taken if s >= step}  # drains come in step order
        switch = [None if gen is not None else 0]  # where the file takes over; None: never

        def pieces():
            if gen is not None:
                switch[0] = yield from files.memory_pieces(self.view(gen), spans, self.memory,
                                                           lambda _: step in self.taken)
                if switch[0] is None:
                    return
            if file is None:
                raise RuntimeError(f"step {step}'s staged bytes were taken back and it has no local file")
            yield from files.read_spans(file, expect, spans, resume=switch[0])

        entry = files.copy_spans(path, reuse, spans, pieces(), tail, crc,
                                 on_piece=lambda: faults.maybe_delay("slow_pfs_copy", step, 0.1))
        upto = switch[0]
        return entry, sum(b - a if upto is None else max(0, min(b, upto) - a) for a, b in spans)


class _Then:
    """A request's result, and work the helper does once the reply is sent."""

    def __init__(self, result, then) -> None:
        self.result, self.then = result, then


class _StagedSums:
    """The CRC-32C of each part's bytes as the copy stages them, on a thread of its
    own: the rank adopts it among its threads in SCHED_IDLE while on time (priority.
    IdleWhileOnTime), where it took that checksum on its copy thread; the write
    thread stays in the normal class, as the rank's writer does."""

    def __init__(self, helper: "_Helper") -> None:
        self.helper = helper
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        named = threading.Event()
        self.thread = threading.Thread(target=self.run, args=(named,), daemon=True)
        self.thread.start()
        named.wait()  # the rank is told its tid next: the kernel then shows its name

    def submit(self, step: int, data: memoryview) -> futures.Future:
        """The CRC-32C of `data`, step's staged bytes, once they are staged."""
        out: futures.Future = futures.Future()
        self.jobs.put((step, data, out))
        return out

    def run(self, named: threading.Event) -> None:
        try:
            _name_thread("ckpt-helper-sum")
        finally:  # the helper's start waits for it
            named.set()
        while True:
            step, data, out = self.jobs.get()
            try:
                crc = 0
                for lo, hi in files._chunks(len(data)):
                    self.helper.wait_staged(step, hi)
                    crc = files.checksum(data[lo:hi], crc)
                out.set_result(crc)
            except Exception as e:  # staging failed: the write fails with it
                out.set_exception(e)
            del data  # a buffer replaced since goes once no view holds it


def _name_thread(name: str) -> None:
    """As top, strace and the sched logs show the thread (15 bytes kept)."""
    ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode())


def main(parent: int, nice: int, fds: list[int]) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    _name_thread("ckpt-byte-helper")
    if os.getppid() != parent:  # the rank died before the line above
        return
    priority.lower_this_thread(nice)
    _Helper([socket.socket(fileno=fd) for fd in fds], parent).run()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), [int(a) for a in sys.argv[3:]])
