"""[checkpoint] helper_process: the local data file written by a torch-free helper
process from the shared staging buffer (tiers/byte_helper.py)."""

import errno
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

from titan_ckpt_plus import faults, priority, staging
from titan_ckpt_plus.checkpointer import TieredCheckpointer, TierSettings
from titan_ckpt_plus.telemetry import EventLog
from titan_ckpt_plus.tiers import files
from titan_ckpt_plus.tiers.byte_helper import ByteHelper, by_helper
from titan_ckpt_plus.tiers.hub import HubProcess
from titan_ckpt_plus.tiers.local import LocalTier
from titan_ckpt_plus.tiers.pfs import PfsTier
from titan_ckpt_plus.tiers.pfs_folder import MANIFEST, NeedsTorch, PfsFolder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def helper():
    h = ByteHelper()
    yield h
    h.close()


def _tier(tmp_path, helper: ByteHelper, first_on_node: bool = True) -> LocalTier:
    """A rank's local tier, attached to the helper: the helper runs a copy of it."""
    tier = LocalTier(str(tmp_path / "local"), 0, 1, first_on_node, 2, "J")
    helper.attach(tier)
    return tier


def _shared(nbytes: int, helper: ByteHelper) -> torch.Tensor:
    buf = staging.HostBuffer(pin=False, shared=True)
    data = buf.ensure(nbytes)
    helper.share(buf.generation, buf.fd, buf.data.numel())
    helper._keep = buf  # the buffer lives as long as the test's helper
    return data


def _progress(helper: ByteHelper, step: int, data: torch.Tensor) -> staging.StagingProgress:
    p = staging.StagingProgress()
    p.listener = helper.progress(step, data.numel())
    p.checksum(data.numpy())  # as a copy thread without a helper would: what the helper's must equal
    return p


def _describe(step: int, before=None):
    """What the writer's _describe gives: the layout's bytes, the manifest's fields."""
    def describe():
        if before is not None:
            before()
        return f"layout of {step}".encode(), {"fingerprint": f"fp{step}"}
    return describe


def _wait_for_size(path: str, size: int, timeout_s: float = 10.0) -> bool:
    for _ in range(int(timeout_s / 0.01)):
        if os.path.exists(path) and os.path.getsize(path) >= size:
            return True
        threading.Event().wait(0.01)
    return False


def _rank_files(tier: LocalTier, step: int) -> list[str]:
    d = tier.step_dir(step)
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def test_the_helper_writes_the_part_as_it_is_staged_and_names_it_once_described(helper, tmp_path):
    """The write is asked for before any byte is staged (the writer thread starts with
    the copy): the helper writes piece by piece as progress comes, then the layout
    and manifest it is sent; the part holds exactly the staged bytes, checked against
    a manifest whose CRC-32C the helper took as it wrote (what a copy thread would
    have), its files named only once all are durable."""
    n = (21 << 20) + 123  # a ragged tail: its last partial page goes through the page cache
    tier = _tier(tmp_path, helper)
    data = _shared(n, helper)
    p = _progress(helper, 7, data)
    tmp = tier._part(7, "data") + f".tmp{helper.proc.pid}"  # files.temporary, in the helper
    box = {}

    def copy():
        for start in range(0, n, 3 << 20):
            end = min(n, start + (3 << 20))
            data[start:end] = torch.randint(0, 256, (end - start,), dtype=torch.uint8)
            p.advance(end)
            if start == 3 << 20:  # its first piece (4 MiB) is staged: it is on disk before the rest is
                box["ahead"] = _wait_for_size(tmp, files.FIRST_CHUNK)
                box["named_early"] = [f for f in _rank_files(tier, 7) if ".tmp" not in f]

    copier = threading.Thread(target=copy)
    copier.start()
    raw = helper.write_part(7, 1, n, _describe(7, before=copier.join))
    assert box["ahead"] and box["named_early"] == []
    manifest = json.loads(raw)
    assert manifest["files"]["data"] == {"size": n, files.SUM: p.crc} and manifest["fingerprint"] == "fp7"
    assert manifest == tier.manifest(7) and helper.served == {"part": 1}
    layout, back, _ = tier.read_part(7)  # checked against the manifest
    assert layout == b"layout of 7" and bytes(back) == data.numpy().tobytes()


def test_a_failed_copy_write_or_description_fails_the_request_leaves_no_file_and_the_helper_serves_on(
        helper, tmp_path):
    n = 9 << 20
    tier = _tier(tmp_path, helper)
    data = _shared(n, helper)
    p = _progress(helper, 3, data)
    p.advance(4 << 20)
    p.fail()
    with pytest.raises(OSError, match="staging failed"):
        helper.write_part(3, 1, n, _describe(3))
    assert _rank_files(tier, 3) == []

    def broken():
        raise RuntimeError("no layout")

    _progress(helper, 4, data).advance(n)
    with pytest.raises(RuntimeError, match="no layout"):  # the writer's own error, the helper in step
        helper.write_part(4, 1, n, broken)
    assert _rank_files(tier, 4) == [] and helper.alive
    _progress(helper, 6, data).fail()  # before its buffer was shared (save()'s ensure() failed)
    t0 = time.monotonic()
    with pytest.raises(OSError, match="staging failed"):
        helper.write_part(6, 99, n, _describe(6))
    assert time.monotonic() - t0 < 5 and _rank_files(tier, 6) == []
    p = _progress(helper, 5, data)
    p.advance(n)
    helper.write_part(5, 1, n, _describe(5))
    assert files.checksum_file(tier._part(5, "data")) == (n, p.crc)


def test_the_copy_tells_the_helper_only_where_its_pieces_end(helper, monkeypatch):
    """Progress goes at the ends of the helper's write pieces (files._chunks: 4 MiB, then
    16 MiB), each message a system call of the copy thread, and on a failure."""
    sent = []
    monkeypatch.setattr(helper, "_call", lambda channel, msg, fds=(): sent.append(msg))
    listener = helper.progress(3, 40 << 20)
    for upto in range(1 << 20, (40 << 20) + 1, 1 << 20):
        listener(upto)
    assert sent == [("progress", 3, e << 20) for e in (4, 20, 36, 40)]
    sent.clear()
    failing = helper.progress(4, 40 << 20)
    failing(1 << 20)
    failing(None)
    assert sent == [("progress", 4, None)]


def test_the_helper_commits_and_retains_the_local_steps(helper, tmp_path):
    """The commit marker and retention, run by the helper's copy of the tier, are what
    the training process's tier then reads; a call it does not serve is refused."""
    n = 2 << 20
    tier = _tier(tmp_path, helper)
    data = _shared(n, helper)
    for step in (1, 2, 3, 4):
        _progress(helper, step, data).advance(n)
        helper.write_part(step, 1, n, _describe(step))
        helper.tier(step, "commit", {"world_size": 1})
        helper.tier(step, "retain", {1}, [])  # step 1 is being drained: kept
    assert tier.committed_steps() == [1, 3, 4]  # the newest 2 and the protected one
    assert tier._commit_record(4)["world_size"] == 1
    assert os.path.exists(tier._spare(0))  # step 2's data file, retired for reuse
    with pytest.raises(OSError, match="not a request"):
        helper.tier(5, "purge", set())
    assert helper.alive


def _local_file(tmp_path, data: torch.Tensor) -> tuple[str, dict]:
    path = str(tmp_path / "local.data")
    return path, files.write_durable(path, data.numpy())


def test_the_drains_copy_reads_the_buffer_until_it_is_taken_back_then_the_local_file(tmp_path, monkeypatch):
    """The PFS copy of a part: from the shared buffer while the drain holds it; after a
    take-back (the next save's copy is about to overwrite the buffer) none of its bytes
    come from the buffer, the rest from the local file, checked; the small items follow.
    slow_pfs_copy holds step 3's copy 0.1 s a piece, so its take-back lands mid-copy."""
    monkeypatch.setenv(faults.ENV, "slow_pfs_copy@3")
    helper = ByteHelper()
    n = (64 << 20) + (5 << 12)
    data = _shared(n, helper)
    data.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    original = data.numpy().tobytes()
    file, entry = _local_file(tmp_path, data)
    # small items larger than a datagram (a per-rank dataloader's state can be)
    spans, tail = [(0, 4 << 20), (8 << 20, n)], bytes(range(256)) * 1200
    total, want = n - (4 << 20), original[: 4 << 20] + original[8 << 20 :] + tail

    def copy(step, gen, name, crc=None):
        entry_out, from_memory = helper.copy(step, gen, str(tmp_path / name), None, spans, tail, file, entry, crc)
        assert (tmp_path / name).read_bytes() == want, name
        assert entry_out == {"size": len(want), files.SUM: files.checksum(want)}
        return from_memory

    try:
        assert copy(1, 1, "whole") == total  # all from memory
        helper.take_back(2)
        assert copy(2, 1, "taken-before") == 0  # a take-back that came first: the file only
        box = {}
        racer = threading.Thread(target=lambda: box.update(out=copy(3, 1, "raced")))
        racer.start()
        assert _wait_for_size(str(tmp_path / "raced"), files.CHUNK)  # under way, from memory
        helper.take_back(3)  # after this the buffer may change
        data.fill_(0)
        racer.join()
        assert 0 < box["out"] < total  # both sources; the bytes are the original ones
    finally:
        helper.close()


def test_a_part_that_differs_from_its_manifest_fails_the_helpers_copy(helper, tmp_path):
    n = 6 << 20
    data = _shared(n, helper)
    data.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    file, entry = _local_file(tmp_path, data)
    with open(file, "r+b") as f:
        f.seek(12345)
        f.write(bytes([data[12345].item() ^ 1]))
    with pytest.raises(files.CorruptCheckpoint, match="manifest says"):
        helper.copy(4, None, str(tmp_path / "out"), None, [(0, n)], b"", file, entry, None)
    assert helper.alive


def test_a_full_disk_in_the_helper_is_the_writers_enospc(tmp_path, monkeypatch):
    """The fault matrix's enospc_local_write fires in the helper (it inherits the
    environment) and reaches the writer as the OSError an in-process write raises."""
    monkeypatch.setenv(faults.ENV, "enospc_local_write@5")
    h = ByteHelper()
    try:
        tier = _tier(tmp_path, h)
        data = _shared(8 << 20, h)
        _progress(h, 5, data).advance(8 << 20)
        with pytest.raises(OSError) as e:
            h.write_part(5, 1, 8 << 20, _describe(5))
        assert e.value.errno == 28 and "injected" in str(e.value)
        assert _rank_files(tier, 5) == [] and h.alive
    finally:
        h.close()


def test_a_kill_in_the_helpers_write_kills_the_rank_and_the_helper_dies_with_it(tmp_path):
    """kill_during_local_write keeps its meaning: the rank dies (SIGKILL), as a node's
    failure would take it, and its helper does not outlive it."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {ROOT!r})
        from pathlib import Path
        from test_byte_helper import _describe, _progress, _shared, _tier
        from titan_ckpt_plus.tiers.byte_helper import ByteHelper, by_helper
        h = ByteHelper()
        print(h.proc.pid, flush=True)
        _tier(Path({str(tmp_path)!r}), h)
        data = _shared(16 << 20, h)
        _progress(h, 9, data).advance(16 << 20)
        h.write_part(9, 1, 16 << 20, _describe(9))
        print("survived", flush=True)
    """)
    env = dict(os.environ, **{faults.ENV: "kill_during_local_write@9", "PYTHONPATH": os.path.join(ROOT, "tests")})
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == -9, out.stderr
    assert "survived" not in out.stdout
    pid = int(out.stdout.split()[0])
    for _ in range(100):  # PR_SET_PDEATHSIG: the kernel kills it as its parent goes
        if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            break
        threading.Event().wait(0.05)
    else:
        pytest.fail(f"the helper {pid} outlived its rank")


def test_a_sigterm_to_the_ranks_process_group_leaves_its_helper_and_hub_running(tmp_path):
    """torchrun tells a rank of a preemption by SIGTERM to the rank's process group,
    and the rank's last save needs its helper and the job's hub: they are in sessions
    of their own, so the notice reaches the rank alone (each still ends with its rank,
    or when closed). Before, both ended with the notice and the preemption save failed."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {ROOT!r})
        from titan_ckpt_plus.tiers.byte_helper import ByteHelper
        from titan_ckpt_plus.tiers.hub import HubMember, HubProcess
        os.setpgrp()  # a rank leads its process group, as torchrun starts it
        signal.signal(signal.SIGTERM, lambda *_: print("notice", flush=True))
        h, hub = ByteHelper(), HubProcess(1, 30.0)
        os.killpg(0, signal.SIGTERM)  # the handler runs before the next line
        h.join_hub(hub.info, 0)
        print(h.alive, hub.alive, h.exchange("drain", ("drain", 1, "start", 1), [True]), flush=True)
        print(HubMember(hub.info, 0, "write").exchange(("write", 1, "vote", 1), [True]), flush=True)
        h.close()
        hub.close()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["notice", "True True [[True]]", "[[True]]"], out.stdout


def _pfs_step(pfs, step: int, manifest: bool = True) -> None:
    d = pfs / f"step-{step}"
    d.mkdir(parents=True)
    (d / f"__0_0{DEFAULT_SUFFIX}").write_bytes(b"part")
    if manifest:
        (d / MANIFEST).write_text(json.dumps({"step": step, "job_id": "J", "kind": "full"}))
    (d / ".metadata").write_bytes(b"metadata")


def test_the_helper_runs_pfs_retention_and_leaves_a_step_only_torch_can_tell_to_the_process(helper, tmp_path):
    """Rank 0's PFS retention by the helper: the oldest step goes, its data file kept
    as the rank's spare. A step without our manifest (stock torchtitan's) is an
    export or not by its .metadata, which needs torch: the helper refuses with
    NeedsTorch, deleting nothing, and the process's PfsTier decides."""
    pfs = tmp_path / "pfs"
    for step in (2, 4, 6):
        _pfs_step(pfs, step)
    helper.attach(LocalTier(str(tmp_path / "local"), 0, 1, True, 2, "J"), PfsFolder(str(pfs), 0, 1, 2, "J"))
    assert helper.purge_pfs(6) == [2]
    assert sorted(os.listdir(pfs)) == [".spare", "step-4", "step-6"]
    assert (pfs / ".spare" / "J" / f"rank-00000{DEFAULT_SUFFIX}").read_bytes() == b"part"
    _pfs_step(pfs, 8, manifest=False)
    with pytest.raises(NeedsTorch, match="step-8 has no manifest"):
        helper.purge_pfs(8)
    assert sorted(os.listdir(pfs)) == [".spare", "step-4", "step-6", "step-8"] and helper.alive
    # the drain's way (by_helper): the process decides; its .metadata is no DCP's: not an export
    assert by_helper(helper, lambda h: h.purge_pfs(8), PfsTier(str(pfs), 0, 1, 2, "J").purge) == [4]


def test_the_helper_imports_no_torch():
    """Its memory is the reason it exists: a process that imports torch holds 0.27 GB."""
    code = "import sys, titan_ckpt_plus.tiers.byte_helper; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {f"w{i}": torch.randn(300_000 + i, generator=g) for i in range(6)},
            "train_state": {"step": step}}


def _engine(tmp_path, state: dict, pfs_interval: int) -> TieredCheckpointer:
    """One rank saving every step, its bytes moved by a byte helper."""
    s = TierSettings(local_root=str(tmp_path / "local"), pfs_folder=str(tmp_path / "pfs"),
                     local_interval=1, pfs_interval=pfs_interval, local_keep=5, pfs_keep=3, rank=0,
                     world_size=1, first_on_node=True, job_id="J", helper_process=True)
    return TieredCheckpointer(s, lambda: state, EventLog(None))


def _saved(ckpt: TieredCheckpointer, step: int) -> dict:
    layout, data, _ = ckpt.local.read_part(step)  # checked against the manifest's CRC-32C
    return staging.rebuild(staging.StateLayout.from_bytes(layout), torch.frombuffer(data, dtype=torch.uint8))


def _assert_pfs_step_loads(ckpt: TieredCheckpointer, step: int, state: dict) -> None:
    """The PFS step, loaded by dcp.load as stock torchtitan would, equals `state`'s model bit for bit."""
    loaded = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    dcp.load(loaded, checkpoint_id=ckpt.pfs.step_dir(step), no_dist=True)
    for k, v in state["model"].items():
        assert torch.equal(loaded["model"][k], v), (step, k)


def _save_and_flush(ckpt: TieredCheckpointer, state: dict, steps, make=_state) -> None:
    """Each step's state (`make(step)`) saved and flushed to its tiers."""
    for step in steps:
        state.update(make(step))
        ckpt.save(step)
        ckpt.flush()


def _on_cpu_ns(pid: int, tid: int) -> int:
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])


@pytest.mark.skipif(not priority.can_leave_idle(), reason="this process may not leave SCHED_IDLE")
def test_the_helpers_checksum_thread_yields_with_the_ranks_copy_thread(one_rank, tmp_path):
    """The helper takes a part's CRC-32C on a thread of its own, which the rank puts
    among its threads in SCHED_IDLE while the work is on time and brings back with
    them while it is late (its copy thread took that checksum without a helper). The
    part it checksummed reads back against its manifest. A helper that ended is
    forgotten: its thread id may be reused."""
    state = _state(1)
    s = TierSettings(local_root=str(tmp_path / "local"), pfs_folder=str(tmp_path / "pfs"),
                     local_interval=1, pfs_interval=100, local_keep=5, pfs_keep=3, rank=0, world_size=1,
                     first_on_node=True, job_id="J", helper_process=True, background_idle=True)
    ckpt = TieredCheckpointer(s, lambda: state, EventLog(None))
    helper = ckpt.helper
    try:
        [tid] = helper.idle_tids
        with open(f"/proc/{helper.proc.pid}/task/{tid}/comm") as f:
            assert f.read().strip() == "ckpt-helper-sum"
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
        on_cpu = _on_cpu_ns(helper.proc.pid, tid)
        ckpt.save(1)
        ckpt.wait_for_staging()
        ckpt.flush()  # the loop waits for the work: nothing to yield to
        assert _on_cpu_ns(helper.proc.pid, tid) > on_cpu  # the checksum ran there
        assert helper.served["part"] == 1 and os.sched_getscheduler(tid) == os.SCHED_OTHER
        back = _saved(ckpt, 1)  # read against the manifest's CRC-32C, the sum thread's
        assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())
        assert ckpt.background.boundary() == [] and os.sched_getscheduler(tid) == os.SCHED_IDLE
        helper.proc.kill()
        helper.proc.wait()
        assert not ckpt._helper_alive() and tid not in ckpt.background._tids
    finally:
        ckpt.close()


def test_the_engine_saves_and_drains_through_the_helper_and_goes_on_without_it_once_it_is_gone(
        one_rank, tmp_path):
    """Every save's part and every PFS step, their bytes moved by the helper, load back
    bit for bit (the PFS step by dcp.load); the state grows (a new buffer is shared); the
    votes and the drain's agreements go through the hub, by the helper; a helper killed
    between saves leaves the next save, drain and exchanges to the training process,
    committed all the same."""
    state = {}
    ckpt = _engine(tmp_path, state, pfs_interval=2)
    helper = ckpt.helper
    assert helper is not None and ckpt.buffer.shared
    try:
        for step in (1, 2, 3, 4):
            state.update(_state(step))
            if step == 2:
                state["model"]["grown"] = torch.ones(1 << 20)
            if step == 4:
                # three parts, each voted through the hub it joined, committed and retained in
                # the vote's request; step 2's PFS file, its manifest and .metadata, PFS
                # retention after it, and the drain's start and gather through the hub
                assert helper.served == {"part": 3, "vote": 3, "copy": 1, "files": 1, "purge": 1,
                                         "exchange": 2, "hub": 1}
                assert ckpt.votes.member.sock is None and ckpt.drain.votes.member.sock is None
                helper.proc.kill()
                helper.proc.wait()
            ckpt.save(step)
            ckpt.wait_for_staging()
            ckpt.flush()
            back = _saved(ckpt, step)
            assert back["model"].keys() == state["model"].keys()
            for k, v in state["model"].items():
                assert torch.equal(back["model"][k], v), (step, k)
            if step % 2 == 0:
                _assert_pfs_step_loads(ckpt, step, state)
        assert ckpt.stats.saves == 4 and ckpt.stats.drains == 2
        assert ckpt.stats.failed_saves == ckpt.stats.failed_drains == 0
        assert ckpt.helper is None  # the fourth save went on in this process
        assert ckpt.votes.member.sock is not None and ckpt.drain.votes.member.sock is not None
    finally:
        ckpt.close()


def test_a_commit_marker_or_pfs_file_the_helper_did_not_finish_is_written_here(one_rank, tmp_path):
    """The helper ends during the vote's request (which writes the commit marker) or a
    PFS step's files: the training process votes again (the hub keeps the outcome) and
    writes them, so a voted step keeps its marker."""
    state = _state(1)
    ckpt = _engine(tmp_path, state, pfs_interval=1000)
    helper = ckpt.helper

    def dies(*_a, **_k):
        helper.proc.kill()
        helper.proc.wait()
        raise OSError(errno.EPIPE, "the byte helper process has ended")

    helper.vote = helper.write_batch = dies
    try:
        ckpt.save(1)
        ckpt.flush()
        assert ckpt.local.committed_steps() == [1] and ckpt.stats.failed_saves == 0
        assert helper.served == {"part": 1, "hub": 1} and not helper.alive
        folder = tmp_path / "pfs" / "step-1"
        folder.mkdir(parents=True)
        ckpt._pfs_batch(str(folder), [(str(folder / "m"), b"manifest")])
        assert (folder / "m").read_bytes() == b"manifest"
    finally:
        ckpt.close()


def test_a_helper_that_dies_mid_write_fails_that_save_alone(one_rank, tmp_path, monkeypatch):
    """Killed while it waits for step 2's bytes (slow_staging holds the copy back): that
    save fails, logged and counted, and is not committed; the next save is written by
    the training process, and the older step stays."""
    monkeypatch.setenv(faults.ENV, "slow_staging@2")
    state = _state(1)
    ckpt = _engine(tmp_path, state, pfs_interval=1000)
    helper = ckpt.helper
    try:
        ckpt.save(1)
        ckpt.flush()
        ckpt.save(2)
        threading.Event().wait(0.5)  # the writer's request is in; the copy waits 1.5 s
        helper.proc.kill()
        ckpt.wait_for_staging()
        ckpt.flush()
        assert ckpt.stats.failed_saves == 1 and ckpt.local.committed_steps() == [1]
        state.update(_state(3))
        ckpt.save(3)
        ckpt.flush()
        assert ckpt.helper is None and ckpt.local.committed_steps() == [1, 3]
        back = _saved(ckpt, 3)
        assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())
        assert helper.served["part"] == 1 and not helper.alive
    finally:
        ckpt.close()


def test_with_the_helper_the_training_process_runs_no_collective_during_a_save_or_a_drain(
        one_rank, tmp_path, monkeypatch):
    """Once a layout's first drain is planned (DCP's own collectives), a save's vote and
    a drain's start and gather go through the hub, made by the helper (a later drain's
    start, copy and gather in one request): every torch collective fails from then on,
    and the saves and drains commit all the same."""
    state = _state(1)
    ckpt = _engine(tmp_path, state, pfs_interval=2)
    try:
        for step in (1, 2):
            ckpt.save(step)
            ckpt.flush()

        def no_collective(*_a, **_k):
            raise AssertionError("a collective in the training process")
        for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list",
                     "gather_object", "scatter_object_list", "barrier"):
            monkeypatch.setattr(dist, name, no_collective)
        _save_and_flush(ckpt, state, (3, 4, 5, 6))
        assert ckpt.stats.saves == 6 and ckpt.stats.drains == 3
        assert ckpt.stats.failed_saves == ckpt.stats.failed_drains == 0
        # the layout's first drain: its start, copy and gather; each later one: one request
        served = ckpt.helper.served
        assert served["vote"] == 6 and (served["exchange"], served["copy"], served["planned"]) == (2, 1, 2)
        _assert_pfs_step_loads(ckpt, 6, state)
    finally:
        monkeypatch.undo()
        ckpt.close()
    assert ckpt.local.committed_steps() == [2, 3, 4, 5, 6]  # retained by the helper after each vote


def _noted(step: int, note: int) -> dict:
    """_state(step) with a small item `note` characters long in its train_state."""
    out = _state(step)
    out["train_state"]["note"] = "x" * note
    return out


def test_rank_0s_seal_and_pfs_retention_are_in_a_kept_drains_one_request(one_rank, tmp_path):
    """After a layout's first drain, rank 0's helper writes each later PFS step's
    manifest and .metadata (pickled before the copy) and runs PFS retention in the
    drain's one request: the oldest step goes, and the step passes its checks and
    loads bit for bit. Where a small item's length moved (the .metadata says where each
    sits) the helper leaves the seal to the process, which pickles it anew; where a
    stock step (no manifest) needs torch to be told apart, retention is the process's."""
    state = _noted(1, 10)
    ckpt = _engine(tmp_path, state, pfs_interval=2)  # pfs_keep 3
    pg = dist.group.WORLD
    try:
        _save_and_flush(ckpt, state, range(1, 9), lambda step: _noted(step, 10))
        served = ckpt.helper.served
        # only the layout's first drain (step 2, DCP's plan) sealed and purged in requests of their own
        assert (served["planned"], served["files"], served["purge"]) == (3, 1, 1)
        assert ckpt.pfs.steps() == [4, 6, 8] and ckpt.pfs.retained == {}
        assert ckpt.pfs.verify(8, pg) == (True, "")
        _assert_pfs_step_loads(ckpt, 8, state)

        # the note's item grows: its length and the .metadata move
        _save_and_flush(ckpt, state, [10], lambda step: _noted(step, 5000))
        assert (served["planned"], served["files"], served["purge"]) == (4, 2, 2)
        assert ckpt.pfs.steps() == [6, 8, 10] and ckpt.pfs.verify(10, pg) == (True, "")
        loaded = {"train_state": {"step": 0, "note": ""}}
        dcp.load(loaded, checkpoint_id=ckpt.pfs.step_dir(10), no_dist=True)
        assert loaded["train_state"] == {"step": 10, "note": "x" * 5000}

        _pfs_step(tmp_path / "pfs", 3, manifest=False)  # stock torchtitan's: only its .metadata tells
        _save_and_flush(ckpt, state, [12], lambda step: _noted(step, 5000))
        assert (served["planned"], served["files"], served["purge"]) == (5, 2, 2)
        assert ckpt.pfs.steps() == [8, 10, 12] and ckpt.pfs.verify(12, pg) == (True, "")
        assert ckpt.stats.drains == 6 and ckpt.stats.failed_drains == 0
        _assert_pfs_step_loads(ckpt, 12, state)
    finally:
        ckpt.close()


def test_retentions_outcome_tells_the_drain_what_is_left_to_it(tmp_path, monkeypatch):
    """PfsFolder.purge_outcome, as the helper sends it back: the steps purged; a step
    only torch can tell (the process purges); a failure (warned about)."""
    pfs = tmp_path / "pfs"
    for step in (2, 4):
        _pfs_step(pfs, step)
    folder = PfsFolder(str(pfs), 0, 1, 1, "J")
    assert folder.purge_outcome() == ("purged", [2])
    _pfs_step(pfs, 6, manifest=False)
    assert folder.purge_outcome()[0] == "torch" and sorted(os.listdir(pfs)) == [".spare", "step-4", "step-6"]
    monkeypatch.setattr(PfsFolder, "purge", lambda self: (_ for _ in ()).throw(OSError(errno.EIO, "gone")))
    assert folder.purge_outcome()[0] == "failed"


def test_a_helper_that_ends_inside_a_drains_one_request_leaves_the_rest_to_the_process(one_rank, tmp_path):
    """The helper ends after its start exchange, inside a kept plan's drain: the
    training process asks the hub again under the same names (it gets the kept
    outcome), copies the part itself and gathers; the PFS step loads bit for bit."""
    state = _state(1)
    ckpt = _engine(tmp_path, state, pfs_interval=2)
    asked = []
    member = ckpt.drain.votes.member
    real_exchange = member.exchange
    member.exchange = lambda key, obj: (asked.append(tuple(key)), real_exchange(key, obj))[1]
    helper = ckpt.helper

    def ends_after_start(keys, flags, why, request, lengths, seal):
        asked.append(("helper",) + tuple(keys[0]))
        helper.exchange("drain", keys[0], flags)
        helper.proc.kill()
        helper.proc.wait()
        raise OSError(errno.EPIPE, "the byte helper process has ended")

    helper.copy_planned = ends_after_start
    try:
        _save_and_flush(ckpt, state, (1, 2, 3, 4))
        assert ckpt.stats.drains == 2 and ckpt.stats.failed_drains == 0
        start = ("drain", 4, "start", 1)
        assert asked == [("helper",) + start, start, ("drain", 4, "copied", 1)]
        _assert_pfs_step_loads(ckpt, 4, state)
    finally:
        ckpt.close()


def test_a_helper_that_ends_after_its_drains_gather_leaves_its_copy_as_it_is(one_rank, tmp_path, monkeypatch):
    """The helper made the whole kept-plan drain (start, copy, gather) and ended before
    its reply: the gather was decided with its file's entry (rank 0 may be sealing the
    step with it), so the training process does not copy the part again, and the step
    loads bit for bit."""
    from titan_ckpt_plus import drain as drain_mod

    state = _state(1)
    ckpt = _engine(tmp_path, state, pfs_interval=2)
    helper = ckpt.helper
    real = helper.copy_planned

    def ends_before_its_reply(*args):
        real(*args)
        helper.proc.kill()
        helper.proc.wait()
        raise OSError(errno.EPIPE, "the byte helper process has ended")

    helper.copy_planned = ends_before_its_reply
    copied_here = []
    real_copy = drain_mod.files.copy_spans
    monkeypatch.setattr(drain_mod.files, "copy_spans", lambda *a, **k: (copied_here.append(a[0]), real_copy(*a, **k))[1])
    try:
        _save_and_flush(ckpt, state, (1, 2, 3, 4))
        assert ckpt.stats.drains == 2 and ckpt.stats.failed_drains == 0
        assert copied_here == [] and helper.served["planned"] == 1 and not helper.alive
        _assert_pfs_step_loads(ckpt, 4, state)
    finally:
        ckpt.close()


def test_ranks_that_disagree_on_the_kept_plan_name_dcps_gather_alike():
    """Two ranks hold a kept plan and one does not (its layout changed): the start says
    not planned, every rank goes on to DCP's path, and its gather is the same exchange
    on every rank (a kept plan's gather has a name of its own), so none waits for the
    others until the hub's timeout."""
    from types import SimpleNamespace

    from titan_ckpt_plus.votes import HubVotes

    hub = HubProcess(3, timeout_s=20)
    votes = [HubVotes("drain", hub.info, r, lambda: None) for r in range(3)]
    writer = SimpleNamespace(small_lengths=[], copy=lambda: pytest.fail("copied without a plan"))
    got: dict = {}

    def rank(r: int) -> None:
        for step in (6, 8):  # twice: the names stay alike from drain to drain
            if r < 2:
                agreed, gathered, sealed = votes[r].copy_planned([True, True, True], step, writer, "")
                assert gathered is sealed is None
            else:
                agreed = votes[r].all_ranks([True, True, False], step)
            got[r, step] = agreed, votes[r].gather({f"__{r}_0.distcp": {"size": r}}, step)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=15)
        assert len(got) == 6, got
        files_of = [{f"__{r}_0.distcp": {"size": r}} for r in range(3)]
        assert all(v == ([True, True, False], files_of) for v in got.values()), got
    finally:
        for v in votes:
            v.close()
        hub.close(timeout_s=5)


def test_a_hub_that_ended_is_restarted_and_one_that_cannot_be_fails_the_saves_alone(
        one_rank, tmp_path, caplog, monkeypatch):
    """The hub ended (killed): rank 0 starts it again on its port at the next save,
    where the helper reconnects, and that save commits. Where it cannot start again
    (the port taken meanwhile), the next save's vote cannot be decided: that save
    fails, logged with the reason and counted, training goes on, the older steps stay."""
    state = _state(1)
    ckpt = _engine(tmp_path, state, pfs_interval=1000)
    try:
        ckpt.save(1)
        ckpt.flush()
        port, first = ckpt.hub.info.port, ckpt.hub.proc.pid
        ckpt.hub.proc.kill()
        ckpt.hub.proc.wait()
        state.update(_state(2))
        ckpt.save(2)
        ckpt.flush()
        assert ckpt.hub.proc.pid != first and ckpt.hub.info.port == port and "restarted on port" in caplog.text
        assert ckpt.stats.saves == 2 and ckpt.stats.failed_saves == 0
        ckpt.hub.proc.kill()
        ckpt.hub.proc.wait()
        def taken(_self):
            raise OSError(errno.EADDRINUSE, "the checkpoint hub process did not start")
        monkeypatch.setattr(HubProcess, "restarted", taken)
        state.update(_state(3))
        ckpt.save(3)
        ckpt.flush()
        assert ckpt.hub is None and "could not be restarted" in caplog.text
        assert ckpt.stats.saves == 2 and ckpt.stats.failed_saves == 1
        assert ckpt.local.committed_steps() == [1, 2]
        assert "the commit vote" in caplog.text and "hub" in caplog.text
    finally:
        ckpt.close()


def test_a_commit_marker_the_helper_could_not_write_fails_that_save(one_rank, tmp_path, caplog, monkeypatch):
    """The helper writes the marker in the vote's request; where it cannot (an I/O
    error, injected in the helper), that save fails, logged and counted, as it does in
    the training process, and the older step stays."""
    monkeypatch.setenv(faults.ENV, "eio_commit_marker@2")
    state = _state(1)
    ckpt = _engine(tmp_path, state, pfs_interval=1000)
    try:
        ckpt.save(1)
        ckpt.flush()
        state.update(_state(2))
        ckpt.save(2)
        ckpt.flush()
        assert ckpt.helper.served["vote"] == 2 and "commit" not in ckpt.helper.served
        assert ckpt.stats.saves == 1 and ckpt.stats.failed_saves == 1
        assert ckpt.local.committed_steps() == [1]
        assert "commit marker" in caplog.text
    finally:
        ckpt.close()
