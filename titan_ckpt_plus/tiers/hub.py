"""The job's hub: the small agreements of a save and a drain (the commit vote, the
drain's start and its gather), exchanged by the ranks' byte helpers over TCP instead
of gloo collectives issued by the training process (issue 15, docs/helper_process.md).
A gloo collective from Python hands the GIL to the training thread and takes it back
several times (2-5 of a launch-bound loop's waits a call, a gather about 6); through
the hub, the rank's thread sends one request to its helper and waits for the reply.

One hub per job, a process of its own started by rank 0 (no torch; it dies with rank
0's process), so a byte helper that ends never takes it down. A star: each rank's
stream (its writer's, its drain's) is one connection. Every rank names an exchange
alike (its stream, its number in the stream, its step); once every rank has given
its object, each gets the list of all, in rank order. It fails for all:
- when a rank's connection closes before that rank took part (the rank died: no one
  waits for it, as a gloo collective would not);
- after `timeout_s`, as a gloo group times out.
Outcomes are kept, so a rank that asks again gets the answer the others got: its
helper ended mid-request and it asks from its own process (HubMember there).

A connection's first frame is the job's token and the member's name, checked before
anything is unpickled: the hub listens on every interface, for the other nodes.
"""

import collections
import ctypes
import hmac
import os
import pickle
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

_LEN = struct.Struct("<I")
_HELLO_MAX = 256
KEPT = 4096  # outcomes kept for a rank asking again
STREAMS = ("write", "drain")  # the writer's vote; the drain's start and gather


class HubError(OSError):
    """An exchange the hub could not complete (a rank left, a timeout, the hub gone)."""


@dataclass(frozen=True)
class HubInfo:
    """What a member needs: where the hub listens, the job's token, its timeout."""
    host: str  # rank 0's host name: members on it connect to 127.0.0.1
    address: str  # the IP that host's name resolves to, as gloo's default device uses
    port: int
    token: str
    timeout_s: float

    def connect_to(self) -> tuple[str, int]:
        on_host = socket.gethostname() == self.host
        return ("127.0.0.1" if on_host else self.address), self.port


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv(sock: socket.socket, limit: int = 1 << 30) -> bytes | None:
    """The next frame; None once the other end has closed between frames."""
    head = _exactly(sock, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > limit:
        raise HubError(f"a frame of {n} bytes, over {limit}")
    return _exactly(sock, n) if n else b""


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if buf:
                raise HubError("the connection closed mid-frame")
            return None
        buf += chunk
    return bytes(buf)


class Hub:
    """The exchanges, served on a thread per member connection."""

    def __init__(self, world_size: int, token: str, timeout_s: float) -> None:
        self.world_size, self.token, self.timeout_s = world_size, token, timeout_s
        self.cv = threading.Condition()
        self.pending: dict = {}  # key -> {rank: object}
        self.since: dict = {}  # key -> when its first rank came
        self.outcomes: collections.OrderedDict = collections.OrderedDict()  # key -> reply
        self.busy = 0  # members between a request and its reply
        self.open: collections.Counter = collections.Counter()  # (rank, stream) -> connections

    def serve(self, listener: socket.socket) -> None:
        while True:
            conn, _ = listener.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self.member, args=(conn,), daemon=True).start()

    def member(self, conn: socket.socket) -> None:
        with conn:
            name = self._hello(conn)
            if name is None:
                return
            rank, stream = name
            with self.cv:
                self.open[name] += 1
            try:
                while (data := _recv(conn)) is not None:
                    with self.cv:
                        self.busy += 1
                    try:
                        key, obj = pickle.loads(data)
                        _send(conn, pickle.dumps(self.contribute(key, rank, obj)))
                    finally:
                        with self.cv:
                            self.busy -= 1
                            self.cv.notify_all()
            except Exception:  # a member gone, or out of step: its connection ends
                pass
            finally:
                self.left(rank, stream)

    def _hello(self, conn: socket.socket) -> tuple[int, str] | None:
        """(rank, stream) from a hello with the job's token; None (closed) otherwise."""
        try:
            token, rank, stream = (_recv(conn, _HELLO_MAX) or b"").decode().split(" ")
            rank = int(rank)
        except (OSError, UnicodeDecodeError, ValueError):
            return None
        if not hmac.compare_digest(token, self.token) or not 0 <= rank < self.world_size:
            return None
        return rank, stream

    def contribute(self, key: tuple, rank: int, obj) -> tuple:
        """Rank's object for exchange `key`; returns the exchange's outcome once it has
        one: ("ok", key, objects in rank order) or ("fail", key, why)."""
        with self.cv:
            if key not in self.outcomes:
                got = self.pending.setdefault(key, {})
                got[rank] = obj
                self.since.setdefault(key, time.monotonic())
                if len(got) == self.world_size:
                    self._decide(key, ("ok", key, [got[r] for r in range(self.world_size)]))
            while key not in self.outcomes:
                left = self.since[key] + self.timeout_s - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.world_size)) - set(self.pending[key]))
                    self._decide(key, ("fail", key, f"exchange {key} timed out after {self.timeout_s:.0f}s "
                                                    f"waiting for ranks {missing[:8]}"))
                else:
                    self.cv.wait(left)
            return self.outcomes[key]

    def left(self, rank: int, stream: str) -> None:
        """Rank's `stream` closed (its last connection): the exchanges it has not
        joined fail for all."""
        with self.cv:
            self.open[rank, stream] -= 1
            if self.open[rank, stream] > 0:
                return
            for key in [k for k, got in self.pending.items() if k[0] == stream and rank not in got]:
                self._decide(key, ("fail", key, f"rank {rank}'s {stream} stream left the hub before it "
                                                f"took part in exchange {key} (its rank or helper ended)"))

    def _decide(self, key: tuple, outcome: tuple) -> None:
        self.pending.pop(key, None)
        self.since.pop(key, None)
        self.outcomes[key] = outcome
        while len(self.outcomes) > KEPT:
            self.outcomes.popitem(last=False)
        self.cv.notify_all()

    def quiesce(self, timeout_s: float) -> None:
        """Wait until no reply is owed (the last exchange's go out before the hub ends)."""
        with self.cv:
            self.cv.wait_for(lambda: self.busy == 0, timeout=timeout_s)


class HubMember:
    """One stream of a rank's exchanges: in its byte helper, or in the training
    process once the helper is gone. Connects at its first exchange (or connect())."""

    def __init__(self, info: HubInfo, rank: int, stream: str) -> None:
        self.info, self.rank, self.stream = info, rank, stream
        self.sock: socket.socket | None = None

    def connect(self) -> None:
        if self.sock is not None:
            return
        try:
            sock = socket.create_connection(self.info.connect_to(), timeout=30)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.info.timeout_s + 60)  # the hub times an exchange out first
            _send(sock, f"{self.info.token} {self.rank} {self.stream}".encode())
        except OSError as e:
            raise HubError(f"could not reach the checkpoint hub at {self.info.connect_to()}: {e!r}") from e
        self.sock = sock

    def exchange(self, key: tuple, obj) -> list:
        """Every rank's object for `key`, in rank order; HubError if it failed."""
        self.connect()
        try:
            _send(self.sock, pickle.dumps((key, obj)))
            data = _recv(self.sock)
            if data is None:
                raise HubError("the checkpoint hub closed the connection (it ended)")
            kind, got, value = pickle.loads(data)
            if got != key:
                raise HubError(f"the hub answered {got!r} for {key!r}")
        except OSError as e:
            self.close()
            raise e if isinstance(e, HubError) else HubError(f"the checkpoint hub: {e!r}") from e
        if kind != "ok":
            raise HubError(value)
        return value

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class HubProcess:
    """Rank 0's side: the hub process, started at the engine's start-up, stopped by
    close() once its last replies are out. Raises OSError if it did not start."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        token = secrets.token_hex(16)
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(os.getpid()), str(world_size),
                                      str(timeout_s)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            self.proc.stdin.write(token + "\n")  # not in argv: ps shows that to every user
            self.proc.stdin.close()
            port = int(self.proc.stdout.readline() or 0)
        except (OSError, ValueError):
            port = 0
        self.proc.stdout.close()
        if not port:
            self.close()
            raise OSError(f"the checkpoint hub process did not start (exit code {self.proc.poll()})")
        host = socket.gethostname()
        try:
            address = socket.gethostbyname(host)
        except OSError:
            address = "127.0.0.1"
        self.info = HubInfo(host, address, port, token, timeout_s)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the hub sends the replies it owes, then ends
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main(parent: int, world_size: int, timeout_s: float) -> None:
    libc = ctypes.CDLL(None)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: it dies with rank 0's process
    libc.prctl(15, b"ckpt-hub")  # PR_SET_NAME
    if os.getppid() != parent:  # rank 0 died before the line above
        return
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    token = sys.stdin.readline().strip()
    hub = Hub(world_size, token, timeout_s)
    listener = socket.create_server(("", 0), backlog=max(128, 2 * world_size))
    threading.Thread(target=hub.serve, args=(listener,), daemon=True).start()
    print(listener.getsockname()[1], flush=True)
    while not stop.wait(0.5):
        pass
    hub.quiesce(10.0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
