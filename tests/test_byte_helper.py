"""[checkpoint] helper_process: the local data file written by a torch-free helper
process from the shared staging buffer (tiers/byte_helper.py)."""

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from titan_ckpt_plus import faults, staging
from titan_ckpt_plus.checkpointer import TieredCheckpointer, TierSettings
from titan_ckpt_plus.telemetry import EventLog
from titan_ckpt_plus.tiers import files
from titan_ckpt_plus.tiers.byte_helper import ByteHelper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def helper():
    h = ByteHelper()
    yield h
    h.close()


def _shared(nbytes: int, helper: ByteHelper) -> torch.Tensor:
    buf = staging.HostBuffer(pin=False, shared=True)
    data = buf.ensure(nbytes)
    helper.share(buf.generation, buf.fd, buf.data.numel())
    helper._keep = buf  # the buffer lives as long as the test's helper
    return data


def _progress(helper: ByteHelper, step: int, data: torch.Tensor) -> staging.StagingProgress:
    p = staging.StagingProgress()
    p.listener = lambda upto: helper.progress(step, upto)
    p.checksum(data.numpy())
    return p


def _wait_for_size(path: str, size: int, timeout_s: float = 10.0) -> bool:
    for _ in range(int(timeout_s / 0.01)):
        if os.path.exists(path) and os.path.getsize(path) >= size:
            return True
        threading.Event().wait(0.01)
    return False


def test_the_helper_writes_what_is_staged_as_it_is_staged_and_the_batch_names_it(helper, tmp_path):
    """The write is asked for before any byte is staged (the writer thread starts with
    the copy): the helper writes piece by piece as progress comes, and the file holds
    exactly the staged bytes, fsync'd, under the batch's name only once it is done."""
    n = (21 << 20) + 123  # a ragged tail: its last partial page goes through the page cache
    data = _shared(n, helper)
    p = _progress(helper, 7, data)
    box = {}

    def copy():
        for start in range(0, n, 3 << 20):
            end = min(n, start + (3 << 20))
            data[start:end] = torch.randint(0, 256, (end - start,), dtype=torch.uint8)
            p.advance(end)
            if start == 3 << 20:  # its first piece (4 MiB) is staged: it is on disk before the rest is
                box["ahead"] = _wait_for_size(box["tmp"], files.FIRST_CHUNK)

    with files.DurableBatch() as batch:
        box["tmp"] = tmp = batch.adopt(str(tmp_path / "p.data"))
        copier = threading.Thread(target=copy)
        copier.start()
        helper.write(7, 1, tmp, None, n)
        copier.join()
        assert box["ahead"] and not os.path.exists(tmp_path / "p.data")
    size, crc = files.checksum_file(str(tmp_path / "p.data"))
    assert size == n and crc == p.crc == files.checksum(data.numpy())
    assert (tmp_path / "p.data").read_bytes() == data.numpy().tobytes()


def test_a_failed_copy_or_write_fails_the_request_leaves_no_file_and_the_helper_serves_on(
        helper, tmp_path, monkeypatch):
    n = 9 << 20
    data = _shared(n, helper)
    p = _progress(helper, 3, data)
    p.advance(4 << 20)
    p.fail()
    with pytest.raises(OSError, match="staging failed"):
        with files.DurableBatch() as batch:
            helper.write(3, 1, batch.adopt(str(tmp_path / "a.data")), None, n)
    assert os.listdir(tmp_path) == []
    p = _progress(helper, 4, data)
    p.advance(n)
    with files.DurableBatch() as batch:
        helper.write(4, 1, batch.adopt(str(tmp_path / "b.data")), None, n)
    assert files.checksum_file(str(tmp_path / "b.data")) == (n, p.crc)


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
        data = _shared(8 << 20, h)
        _progress(h, 5, data).advance(8 << 20)
        with pytest.raises(OSError) as e:
            with files.DurableBatch() as batch:
                h.write(5, 1, batch.adopt(str(tmp_path / "c.data")), None, 8 << 20)
        assert e.value.errno == 28 and "injected" in str(e.value)
        assert os.listdir(tmp_path) == [] and h.alive
    finally:
        h.close()


def test_a_kill_in_the_helpers_write_kills_the_rank_and_the_helper_dies_with_it(tmp_path):
    """kill_during_local_write keeps its meaning: the rank dies (SIGKILL), as a node's
    failure would take it, and its helper does not outlive it."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {ROOT!r})
        from test_byte_helper import _shared, _progress
        from titan_ckpt_plus.tiers.byte_helper import ByteHelper
        h = ByteHelper()
        print(h.proc.pid, flush=True)
        data = _shared(16 << 20, h)
        _progress(h, 9, data).advance(16 << 20)
        h.write(9, 1, {str(tmp_path / 'd.data')!r}, None, 16 << 20)
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


def test_the_engine_saves_and_drains_through_the_helper_and_goes_on_without_it_once_it_is_gone(
        one_rank, tmp_path):
    """Every save's part and every PFS step, their bytes moved by the helper, load back
    bit for bit (the PFS step by dcp.load); the state grows (a new buffer is shared); a
    helper killed between saves leaves the next save and drain to the training
    process, committed all the same."""
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
                assert helper.files == 4  # three local files and step 2's PFS file
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
                loaded = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
                dcp.load(loaded, checkpoint_id=ckpt.pfs.step_dir(step))
                for k, v in state["model"].items():
                    assert torch.equal(loaded["model"][k], v), (step, k)
        assert ckpt.stats.saves == 4 and ckpt.stats.drains == 2
        assert ckpt.stats.failed_saves == ckpt.stats.failed_drains == 0
        assert ckpt.helper is None  # the fourth save went on in this process
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
        assert helper.files == 1 and not helper.alive
    finally:
        ckpt.close()
