"""The job's hub (tiers/hub.py): the writer's vote and the drain's agreements between
the ranks' byte helpers, without torch."""

import json
import os
import pickle
import socket
import subprocess
import sys
import threading
import time

import pytest

from titan_ckpt_plus.tiers import hub as hub_mod
from titan_ckpt_plus.tiers.hub import Hub, HubError, HubInfo, HubMember, HubProcess

TOKEN = "t" * 32


@pytest.fixture
def served():
    """A hub for 3 ranks on a thread of this process; yields a member factory."""
    listener = socket.create_server(("127.0.0.1", 0))
    hub = Hub(3, TOKEN, timeout_s=30)
    threading.Thread(target=hub.serve, args=(listener,), daemon=True).start()
    info = HubInfo(socket.gethostname(), "127.0.0.1", listener.getsockname()[1], TOKEN, 30)
    members = []

    def member(rank: int, stream: str = "write", token: str = TOKEN) -> HubMember:
        m = HubMember(HubInfo(info.host, info.address, info.port, token, info.timeout_s), rank, stream)
        members.append(m)
        return m
    member.hub = hub
    yield member
    for m in members:
        m.close()
    listener.close()


def _all(calls: list) -> list:
    """Run each call on a thread of its own; their results (or what they raised)."""
    out = [None] * len(calls)

    def run(i, call):
        try:
            out[i] = call()
        except Exception as e:
            out[i] = e
    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


def test_every_rank_gets_every_ranks_object_in_rank_order_on_each_stream(served):
    writers = [served(r, "write") for r in range(3)]
    drains = [served(r, "drain") for r in range(3)]
    for n in (1, 2):
        got = _all([lambda m=m, r=r: m.exchange(("write", n, 7), [r, n]) for r, m in enumerate(writers)]
                   + [lambda m=m, r=r: m.exchange(("drain", n, 6), {"rank": r}) for r, m in enumerate(drains)])
        assert got[:3] == [[[0, n], [1, n], [2, n]]] * 3
        assert got[3:] == [[{"rank": 0}, {"rank": 1}, {"rank": 2}]] * 3


def test_a_rank_that_leaves_before_taking_part_fails_the_exchange_for_all_and_its_retry_too(served):
    """Rank 2's connection closes (its rank or helper ended) while ranks 0 and 1 wait:
    they fail at once, as a gloo collective would, and rank 2 asking again from
    another connection gets the same failure, not a new exchange nobody joins."""
    key = ("drain", 1, 4)
    gone = served(2, "drain")
    gone.connect()
    waiting = [served(r, "drain") for r in (0, 1)]
    t0 = time.monotonic()
    closer = threading.Timer(0.3, gone.close)
    closer.start()
    got = _all([lambda m=m: m.exchange(key, "x") for m in waiting])
    assert time.monotonic() - t0 < 5
    assert all(isinstance(e, HubError) and "rank 2's drain stream left" in str(e) for e in got), got
    with pytest.raises(HubError, match="rank 2's drain stream left"):
        served(2, "drain").exchange(key, "x")
    # the other stream, and the next exchange of this one, go on
    assert _all([lambda r=r: served(r, "drain").exchange(("drain", 2, 5), r) for r in range(3)]) == [[0, 1, 2]] * 3


def test_a_stream_is_gone_only_once_its_last_connection_closes(served):
    """Rank 2's helper could not join the hub in full (its write stream connected, the
    rank exchanges from its own process): the helper's connection closing later is not
    the rank leaving."""
    spare = served(2, "write")
    spare.connect()
    mine = served(2, "write")
    mine.connect()
    threading.Timer(0.3, spare.close).start()
    key = ("write", 1, 8)
    got = _all([lambda: served(0).exchange(key, 0), lambda: served(1).exchange(key, 1),
                lambda: (time.sleep(0.8), mine.exchange(key, 2))[1]])
    assert got == [[0, 1, 2]] * 3


def test_a_rank_that_went_on_to_a_later_exchange_fails_the_one_it_skipped(served):
    """Rank 1 failed exchange 1 elsewhere (it never reached the hub) and asks for
    exchange 2: exchange 1 fails for the ranks waiting on it at once, not after the
    timeout, and exchange 2 goes on."""
    zero, one, two = (served(r, "drain") for r in range(3))
    waiting = _all([lambda: (time.sleep(0.3), one.exchange(("drain", 2, 9), 1))[1],
                    lambda: zero.exchange(("drain", 1, 8), 0),
                    lambda: (time.sleep(0.6), served(0, "drain").exchange(("drain", 2, 9), 0))[1],
                    lambda: two.exchange(("drain", 1, 8), 2),
                    lambda: (time.sleep(0.6), served(2, "drain").exchange(("drain", 2, 9), 2))[1]])
    assert waiting[0] == waiting[2] == waiting[4] == [0, 1, 2]
    assert all(isinstance(e, HubError) and "without taking part" in str(e) for e in (waiting[1], waiting[3]))


def test_a_rank_asking_again_gets_the_outcome_the_others_got(served):
    """Rank 1's helper gave its object and died before the reply: its process asks
    again with the same key and gets the list the others got."""
    key = ("write", 1, 3)
    raw = socket.create_connection(("127.0.0.1", served(0).info.port))
    hub_mod._send(raw, f"{TOKEN} 1 write".encode())
    hub_mod._send(raw, json.dumps([key, "one"]).encode())
    time.sleep(0.2)
    raw.close()  # after it took part: the exchange stands
    got = _all([lambda: served(0).exchange(key, "zero"), lambda: served(2).exchange(key, "two")])
    assert got == [["zero", "one", "two"]] * 2
    assert served(1).exchange(key, "one again") == ["zero", "one", "two"]


def test_whether_an_exchange_is_decided_is_asked_without_taking_part(served):
    """decided(): None while ranks are missing (asking it is not joining), the outcome
    once every rank gave its object, the failure as HubError."""
    a, b, c = served(0), served(1), served(2)
    key = ("write", 4, "vote", 1)
    assert a.decided(key) is None
    got = _all([lambda: a.exchange(key, 1), lambda: b.exchange(key, 2),
                lambda: (time.sleep(0.3), c.decided(key))[1], lambda: (time.sleep(0.5), c.exchange(key, 3))[1]])
    assert got == [[1, 2, 3], [1, 2, 3], None, [1, 2, 3]]
    assert served(1).decided(key) == [1, 2, 3]
    failed = ("write", 5, "vote", 1)  # rank 2's stream leaves before taking part: it fails for all
    got = _all([lambda: a.exchange(failed, 1), lambda: (time.sleep(0.3), c.close())[1]])
    assert isinstance(got[0], HubError)
    with pytest.raises(HubError, match="left the hub"):
        b.decided(failed)


def test_an_exchange_a_rank_never_joins_times_out_for_all(served):
    served.hub.timeout_s = 0.5
    got = _all([lambda r=r: served(r).exchange(("write", 1, 2), r) for r in (0, 2)])
    assert all(isinstance(e, HubError) and "timed out" in str(e) and "ranks [1]" in str(e) for e in got), got


def test_a_connection_without_the_jobs_token_is_closed_unread(served, tmp_path):
    """A member with another token is refused; so is a pickle sent as the hello (the
    frames are JSON: nothing a connection sends is ever run)."""
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))
    with pytest.raises(HubError):
        served(0, token="x" * 32).exchange(("write", 1, "vote", 1), True)
    raw = socket.create_connection(("127.0.0.1", served(0).info.port))
    hub_mod._send(raw, pickle.dumps(Payload()))  # a pickle as the hello
    assert raw.recv(1) == b""  # closed, unread
    raw.close()
    silent = socket.create_connection(("127.0.0.1", served(0).info.port))
    assert served.hub.open == {}  # no member until a hello names one
    silent.close()
    assert not marker.exists()


def test_the_hub_process_needs_no_torch_serves_and_ends_once_its_replies_are_out():
    code = "import sys, titan_ckpt_plus.tiers.hub; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    hub = HubProcess(2, timeout_s=60)
    try:
        with open(f"/proc/{hub.proc.pid}/comm") as f:
            assert f.read().strip() == "ckpt-hub"
        a, b = HubMember(hub.info, 0, "write"), HubMember(hub.info, 1, "write")
        assert _all([lambda: a.exchange(("write", 1, 1), True),
                     lambda: b.exchange(("write", 1, 1), False)]) == [[True, False]] * 2
        a.close()
        b.close()
    finally:
        hub.close(timeout_s=5)
    assert hub.proc.returncode == 0 and not hub.alive
    with pytest.raises(HubError, match="could not reach"):
        HubMember(hub.info, 0, "write").exchange(("write", 2, 2), True)


def test_a_member_that_reached_the_hub_waits_for_it_to_be_restarted(monkeypatch):
    """The hub ended; rank 0 starts another on its port at its next save, which may come
    a moment after another rank's vote: that rank's member waits for it (RESTART_S)
    instead of failing an exchange the others then wait for. One that never reached
    the hub is refused at once (start-up's reachability check), and so is one that
    waited once for a hub not restarted."""
    monkeypatch.setattr(hub_mod, "RESTART_S", 1.0)
    hub = HubProcess(1, timeout_s=60)
    member = HubMember(hub.info, 0, "write")
    try:
        assert member.exchange(("write", 1, "vote", 1), [True]) == [[True]]
        hub.proc.kill()
        hub.proc.wait()
        got: list = []
        asks = threading.Thread(target=lambda: got.append(member.exchange(("write", 2, "vote", 1), [False])))
        asks.start()
        time.sleep(0.5)  # started on this thread, as rank 0's training thread does: PR_SET_PDEATHSIG
        again = hub.restarted()
        asks.join(timeout=10)
        assert got == [[[False]]]
        again.close(timeout_s=5)  # and not restarted: one wait, then each exchange fails at once
        for waited in (True, False):
            t0 = time.monotonic()
            with pytest.raises(HubError, match="could not reach"):
                member.exchange(("write", 3, "vote", 1), [True])
            assert (time.monotonic() - t0 > 0.4) == waited
        with pytest.raises(HubError, match="could not reach"):
            HubMember(hub.info, 0, "drain").exchange(("drain", 2, "start", 1), [True])
    finally:
        member.close()
        hub.close(timeout_s=5)


def test_the_hub_process_dies_with_rank_0():
    """PR_SET_PDEATHSIG: a rank 0 killed takes its hub with it."""
    code = ("import time; from titan_ckpt_plus.tiers.hub import HubProcess; "
            "h = HubProcess(2, 60); print(h.proc.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(")")[1].split()[0] == "Z":
                return  # ended, not reaped by its dead parent yet
        time.sleep(0.05)
    pytest.fail("the hub outlived rank 0")
