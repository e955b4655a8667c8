"""The job's hub: the small agreements of a save and a drain (the commit vote, the
drain's start and its gather), exchanged by the ranks' byte helpers over TCP instead
of gloo collectives issued by the training process (issue 15, docs/helper_process.md).
A gloo collective from Python hands the GIL to the training thread and takes it back
several times (2-5 of a launch-bound loop's waits a call, a gather about 6); through
the hub, the rank's thread sends one request to its helper and waits for the reply.

One hub per job, a process of its own started by rank 0 (no torch; it dies with rank
0's process), so a byte helper that ends never takes it down. A star: each rank's
stream (its writer's, its drain's) is one connection. Every rank names an exchange
alike (votes.py: its stream, step, phase and attempt); once every rank has given its
object, each gets the list of all, in rank order. It fails for all:
- when a rank's connection closes before that rank took part (the rank died: no one
  waits for it, as a gloo collective would not);
- when a rank asks for a later step's exchange on that stream without having taken
  part (it failed before it);
- after `timeout_s`, as a gloo group times out.
If the hub process ends while rank 0 lives, rank 0 starts another on the same port at
its next save (HubProcess.restarted); the members reconnect.
Outcomes are kept, so a rank that asks again gets the answer the others got: its
helper ended mid-request and it asks from its own process (HubMember there). A rank
can also ask whether an exchange is decided without taking part (HubMember.decided):
whether its helper had finished a drain's gather before it ended.

A connection's first frame is the job's token and the member's name, checked within
5 s; the frames are JSON (flags, reasons, file sizes and checksums), so nothing a
connection sends is ever run: the hub listens on every interface, for the other nodes.
"""

import collections
import ctypes
import fcntl
import hmac
import json
import os
import secrets
import select
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
KEPT = 64  # outcomes kept for a rank asking again (its helper ended mid-request)
RESTART_S = 5.0  # how long a member that reached the hub waits for it to be restarted
STREAMS = ("write", "drain")  # the writer's vote; the drain's start and gather


class HubError(OSError):
    """An exchange the hub could not complete (a rank left, a timeout, the hub gone)."""


@dataclass(frozen=True)
class HubInfo:
    """What a member needs: where the hub listens, the job's token, its timeout."""
    host: str  # rank 0's host name: members on it connect to 127.0.0.1
    address: str  # where the other nodes reach that host (advertised_address)
    port: int
    token: str
    timeout_s: float

    def connect_to(self) -> tuple[str, int]:
        on_host = socket.gethostname() == self.host
        return ("127.0.0.1" if on_host else self.address), self.port


def advertised_address() -> str:
    """Where the other nodes reach this host, as gloo picks it: the interface
    GLOO_SOCKET_IFNAME names; else the host name's address, unless it is a loopback
    one (127.0.1.1 on Debian-style hosts); then the address this host routes to
    MASTER_ADDR from."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if ifname:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # SIOCGIFADDR
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))
            return socket.inet_ntoa(packed[20:24])
        except OSError:
            pass
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        address = "127.0.0.1"
    master = os.environ.get("MASTER_ADDR")
    if address.startswith("127.") and master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, 9))  # no packet: only the route is looked up
                routed = s.getsockname()[0]
            if not routed.startswith("127."):
                return routed
        except OSError:
            pass
    return address


def every(got: list[list[bool]]) -> list[bool]:
    """For each flag of an exchange of flags, whether every rank's holds."""
    return [all(g[i] for g in got) for i in range(len(got[0]))]


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
        self.world_size, self.token, self.timeout_s = world_size, token.encode(), timeout_s
        self.cv = threading.Condition()
        self.pending: dict = {}  # key -> {rank: object}
        self.since: dict = {}  # key -> when its first rank came
        self.outcomes: collections.OrderedDict = collections.OrderedDict()  # key -> reply, encoded once
        self.open: collections.Counter = collections.Counter()  # (rank, stream) -> connections
        self.idle = threading.Condition()  # over busy: quiesce() waits on it alone
        self.busy = 0  # members between a request and its reply

    def serve(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # out of file descriptors, a connection reset: go on accepting
                time.sleep(0.1)
                continue
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
                    with self.idle:
                        self.busy += 1
                    try:
                        first, second = json.loads(data)
                        _send(conn, self.outcome(tuple(second)) if first == "decided"
                              else self.contribute(tuple(first), rank, second))
                    finally:
                        with self.idle:
                            self.busy -= 1
                            self.idle.notify_all()
            except Exception:  # a member gone, or out of step: its connection ends
                pass
            finally:
                self.left(rank, stream)

    def _hello(self, conn: socket.socket) -> tuple[int, str] | None:
        """(rank, stream) from a hello with the job's token within 5 s; None (closed)
        otherwise."""
        try:
            conn.settimeout(5)
            token, rank, stream = (_recv(conn, _HELLO_MAX) or b"").split(b" ")
            rank = int(rank)
            conn.settimeout(None)
        except (OSError, ValueError):
            return None
        if not hmac.compare_digest(token, self.token) or not 0 <= rank < self.world_size:
            return None
        return rank, stream.decode()

    def contribute(self, key: tuple, rank: int, obj) -> bytes:
        """Rank's object for exchange `key` = (stream, step, phase, attempt); returns
        the exchange's outcome once it has one, encoded: ["ok", key, objects in rank
        order] or ["fail", key, why]."""
        with self.cv:
            self._passed(key, rank)
            if key not in self.outcomes:
                got = self.pending.setdefault(key, {})
                got[rank] = obj
                self.since.setdefault(key, time.monotonic())
                if len(got) == self.world_size:
                    self._decide(key, ["ok", key, [got[r] for r in range(self.world_size)]])
            while key not in self.outcomes:
                left = self.since[key] + self.timeout_s - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.world_size)) - set(self.pending[key]))
                    self._decide(key, ["fail", key, f"exchange {key} timed out after {self.timeout_s:.0f}s "
                                                    f"waiting for ranks {missing[:8]}"])
                else:
                    self.cv.wait(left)
            return self.outcomes[key]

    def outcome(self, key: tuple) -> bytes:
        """Exchange `key`'s outcome if decided, else ["undecided", key, null]."""
        with self.cv:
            return self.outcomes.get(key) or json.dumps(["undecided", key, None]).encode()

    def _passed(self, key: tuple, rank: int) -> None:
        """Rank asks for an exchange of a later step on its stream: it will never join
        the earlier ones it has not joined (it failed them elsewhere: a hub restarted,
        a rank 0 whose folder could not be cleared), so they fail for all rather than
        wait for the timeout."""
        for k in [k for k, got in self.pending.items() if k[0] == key[0] and k[1] < key[1] and rank not in got]:
            self._decide(k, ["fail", k, f"rank {rank} went on to exchange {key} without taking part in {k}"])

    def left(self, rank: int, stream: str) -> None:
        """Rank's `stream` closed (its last connection): the exchanges it has not
        joined fail for all."""
        with self.cv:
            self.open[rank, stream] -= 1
            if self.open[rank, stream] > 0:
                return
            for key in [k for k, got in self.pending.items() if k[0] == stream and rank not in got]:
                self._decide(key, ["fail", key, f"rank {rank}'s {stream} stream left the hub before it "
                                                f"took part in exchange {key} (its rank or helper ended)"])

    def _decide(self, key: tuple, outcome: list) -> None:
        self.pending.pop(key, None)
        self.since.pop(key, None)
        self.outcomes[key] = json.dumps(outcome).encode()
        while len(self.outcomes) > KEPT:
            self.outcomes.popitem(last=False)
        self.cv.notify_all()

    def quiesce(self, timeout_s: float) -> None:
        """Wait until no reply is owed (the last exchange's go out before the hub ends)."""
        with self.idle:
            self.idle.wait_for(lambda: self.busy == 0, timeout=timeout_s)


def _closed(sock: socket.socket) -> bool:
    """Whether the other end closed an idle connection (a request sent on it would be
    lost; its exchange is asked of the hub that replaced it instead)."""
    try:
        if not select.select([sock], [], [], 0)[0]:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""  # readable: at once (a reset raises)
    except OSError:
        return True


class HubMember:
    """One stream of a rank's exchanges: in its byte helper, or in the training
    process once the helper is gone. Connects at its first exchange (or connect())."""

    def __init__(self, info: HubInfo, rank: int, stream: str) -> None:
        self.info, self.rank, self.stream = info, rank, stream
        self.sock: socket.socket | None = None
        self.reached = False  # it has reached the hub before: a refusal then is a hub being restarted

    def connect(self) -> None:
        if self.sock is not None and _closed(self.sock):  # a hub that ended, restarted since
            self.close()
        if self.sock is not None:
            return
        sock = None
        try:
            sock = self._dial()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.info.timeout_s + 60)  # the hub times an exchange out first
            _send(sock, f"{self.info.token} {self.rank} {self.stream}".encode())
        except OSError as e:
            if sock is not None:
                sock.close()
            raise HubError(f"could not reach the checkpoint hub at {self.info.connect_to()}: {e!r}") from e
        self.sock, self.reached = sock, True

    def _dial(self) -> socket.socket:
        """A connection to the hub. Refused where it was reached before: rank 0 restarts
        a hub that ended at its next save, which may come a moment after this rank's,
        so it is tried again for up to RESTART_S (else this rank fails an exchange the
        others then wait for on the new hub until some rank's next save passes it);
        once per outage: a hub not restarted by then fails the later exchanges at once."""
        give_up = time.monotonic() + (RESTART_S if self.reached else 0)
        while True:
            try:
                return socket.create_connection(self.info.connect_to(), timeout=30)
            except ConnectionRefusedError:
                if time.monotonic() >= give_up:
                    self.reached = False  # not restarted: the next exchanges fail at once, until one connects
                    raise
                time.sleep(0.1)

    def exchange(self, key: tuple, obj) -> list:
        """Every rank's object for `key`, in rank order (as JSON gives them back:
        tuples as lists); HubError if it failed. A connection lost on the way is made
        again and the exchange asked again: the hub kept its outcome, so this rank
        gets the answer the others got."""
        return self._ask([key, obj], key)

    def decided(self, key: tuple) -> list | None:
        """The outcome of exchange `key` if the hub has one (as exchange() gives it),
        else None, without taking part: whether a helper that ended mid-request had
        already made it."""
        return self._ask(["decided", key], key)

    def _ask(self, frame: list, key: tuple):
        for attempt in (0, 1):
            self.connect()
            try:
                _send(self.sock, json.dumps(frame).encode())
                data = _recv(self.sock)
                if data is None:
                    raise HubError("the checkpoint hub closed the connection")
                kind, got, value = json.loads(data)
                if tuple(got) != tuple(key):
                    raise HubError(f"the hub answered {got!r} for {key!r}")
                break
            except (OSError, ValueError) as e:
                self.close()
                if attempt:
                    raise e if isinstance(e, HubError) else HubError(f"the checkpoint hub: {e!r}") from e
        if kind == "undecided":
            return None
        if kind != "ok":
            raise HubError(value)
        return value

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class HubProcess:
    """Rank 0's side: the hub process, started at the engine's start-up, stopped by
    close() once its last replies are out. Raises OSError if it did not start. `port`
    and `token`: a restart's (restarted()), where the members reconnect."""

    def __init__(self, world_size: int, timeout_s: float, port: int = 0, token: str | None = None) -> None:
        token = token or secrets.token_hex(16)
        self.world_size = world_size
        # a session of its own, as the byte helper's: SIGTERM is its close(), and a
        # preemption notice to rank 0's process group must not end it before the last save
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(os.getpid()), str(world_size),
                                      str(timeout_s), str(port)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
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
        self.info = HubInfo(socket.gethostname(), advertised_address(), port, token, timeout_s)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def restarted(self) -> "HubProcess":
        """A hub in place of this one, which ended (killed, out of memory): the same
        port and token, so each member reconnects at its next exchange. The exchanges
        in flight failed with the old one; a rank that failed one and goes on to the
        next fails it for those still waiting (Hub._passed). OSError if it could not
        start (the port taken meanwhile)."""
        return HubProcess(self.world_size, self.info.timeout_s, self.info.port, self.info.token)

    def close(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the hub sends the replies it owes, then ends
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main(parent: int, world_size: int, timeout_s: float, port: int) -> None:
    libc = ctypes.CDLL(None)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: it dies with rank 0's process
    libc.prctl(15, b"ckpt-hub")  # PR_SET_NAME
    if os.getppid() != parent:  # rank 0 died before the line above
        return
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    token = sys.stdin.readline().strip()
    hub = Hub(world_size, token, timeout_s)
    listener = socket.create_server(("", port), backlog=max(128, 2 * world_size))  # SO_REUSEADDR
    threading.Thread(target=hub.serve, args=(listener,), daemon=True).start()
    print(listener.getsockname()[1], flush=True)
    while not stop.wait(0.5):
        pass
    hub.quiesce(10.0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
