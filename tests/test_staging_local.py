"""Staging, the local tier's files, and recovery ordering (no torchrun)."""

import fcntl
import io
import json
import os

import pytest
import torch

from titan_ckpt_plus import recovery, staging
from titan_ckpt_plus.device_copy import Copy
from titan_ckpt_plus.tiers import files
from titan_ckpt_plus.replication import Part, check_part
from titan_ckpt_plus.tiers.local import COMMIT, LocalTier


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 5, generator=g),
        "optimizer": {"state.w.exp_avg": torch.randn(3, 5, generator=g).t(),  # non-contiguous
                      "state.w.step": torch.tensor(7.0),
                      "param_groups.w.lr": 0.001, "betas": (0.9, 0.95)},
        "flags": torch.tensor([True, False]),
        "bf": torch.randn(4, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 3),
        "dataloader": {"dp_rank_0": b"\x00pickled", "world_size": 2, "io": io.BytesIO(b"x")},
        "train_state": {"step": 7, "ntokens_seen": 1234},
    }


def _stage(state):
    layout, tensors, specs = staging.plan_layout(state)
    buf = staging.HostBuffer(pin=False)
    buf.copy_in(layout, tensors)
    return layout, buf.data[: layout.total_bytes].clone()


def test_the_copy_clears_each_group_before_it_and_the_whole_buffer_before_new_frames():
    """A drain may still write a piece of the buffer when the next save's copy starts
    (StagedBytes.take_back): the copy asks `clear` before each group, up to that
    group's end, and before it writes a layout's frames (the whole buffer), once."""
    state = dict(_state(), a=torch.randn(3 << 20), b=torch.randn(3 << 20))  # 12 MiB each: groups
    layout, tensors, _ = staging.plan_layout(state)
    buf, asked, seen = staging.HostBuffer(pin=False), [], []

    def clear(upto):  # what the buffer holds when the copy asks
        asked.append(upto)
        seen.append(buf.data[: layout.total_bytes].clone())
    buf.copy_in(layout, tensors, clear=clear)
    assert len(asked) >= 3 and asked[0] == layout.total_bytes and asked[-1] == layout.total_bytes
    assert not torch.equal(seen[0], seen[1])  # the frames were written after the first ask
    first, before = list(asked), buf.data[: layout.total_bytes].clone()
    asked.clear()
    seen.clear()
    for t in tensors:  # the next save's values
        if t.dtype == torch.bool:
            t.logical_not_()
        else:
            t.add_(1)
    buf.copy_in(layout, tensors, clear=clear)  # the same layout: no frames written again
    assert asked == first[1:] and asked == sorted(asked)
    for lo, upto, held in zip([0, *asked], asked, seen):  # each group's bytes unwritten when asked
        assert torch.equal(held[lo:upto], before[lo:upto])
    assert not torch.equal(buf.data[: layout.total_bytes], before)


def test_roundtrip_is_bit_exact_and_layout_loads_without_classes():
    state = _state()
    layout, data = _stage(state)
    back = staging.rebuild(staging.StateLayout.from_bytes(layout.to_bytes()), data)
    for key in ("w", "flags", "bf", "empty"):
        assert torch.equal(back[key], state[key]) and back[key].dtype == state[key].dtype
    assert torch.equal(back["optimizer"]["state.w.exp_avg"], state["optimizer"]["state.w.exp_avg"])
    assert back["optimizer"]["betas"] == (0.9, 0.95)
    assert back["dataloader"]["io"] == b"x" and back["train_state"]["step"] == 7


def test_a_layout_adopts_the_last_ones_fingerprint_and_chunks_only_for_the_same_tensor_table(monkeypatch):
    state = _state()
    first, _, _ = staging.plan_layout(state)
    first.chunks = {0: ((6, 5), (3, 0))}
    expected = first.fingerprint()
    state["train_state"]["step"] = 8  # a later save: other values, the same tensors
    same, _, _ = staging.plan_layout(state)
    with monkeypatch.context() as m:  # adopted, not hashed again
        m.setattr(staging.json, "dumps", lambda *_a, **_k: pytest.fail("the fingerprint was made again"))
        assert same.adopt(first) and same.chunks == first.chunks and same.fingerprint() == expected
    assert staging.StateLayout(first.skeleton, first.entries, 0).fingerprint() == expected
    state["w"] = torch.zeros(4, 5)  # the layout changed: its own fingerprint, no chunks taken
    grown, _, _ = staging.plan_layout(state)
    assert not grown.adopt(first) and grown.chunks is None and grown.fingerprint() != first.fingerprint()
    assert not first.adopt(None)


def test_only_a_tensor_autograd_tracks_is_detached_for_the_copy():
    w = torch.nn.Parameter(torch.ones(3))
    _, tensors, _ = staging.plan_layout({"w": w, "m": torch.zeros(3)})
    assert not tensors[0].requires_grad and tensors[0].data_ptr() == w.data_ptr()
    m = torch.zeros(3)
    assert staging.plan_layout({"m": m})[1][0] is m  # no new object per tensor and save


def test_each_tensor_sits_in_the_torch_save_frame_dcp_would_write():
    """The staged buffer is the part's file image: every tensor's frame torch.loads
    as the tensor itself, and the frames do not depend on the data (CRC-32 off)."""
    state = _state()
    layout, data = _stage(state)
    raw = data.numpy().tobytes()
    for e, key in zip(layout.entries, ("w", "state.w.exp_avg", "state.w.step", "flags", "bf", "empty")):
        want = state[key] if key in state else state["optimizer"][key]
        start, end = e.frame
        assert start % staging.ALIGN == 0 and e.offset % staging.ALIGN == 0
        back = torch.load(io.BytesIO(raw[start:end]), weights_only=True)
        assert torch.equal(back, want) and back.dtype == want.dtype and back.is_contiguous()
    other = {k: (torch.randn_like(v) if k == "w" else v) for k, v in state.items()}
    _, data2 = _stage(other)
    e = layout.entries[0]
    assert data2.numpy().tobytes()[e.frame[0]:e.offset] == raw[e.frame[0]:e.offset]
    assert data2.numpy().tobytes()[e.offset + e.nbytes:e.frame[1]] == raw[e.offset + e.nbytes:e.frame[1]]
    assert staging.frame("float32", (3, 5)) == staging.frame("float32", (3, 5))
    meta = staging.rebuild(layout, None)
    assert meta["w"].is_meta and meta["w"].shape == (3, 5) and meta["bf"].dtype == torch.bfloat16
    assert meta["train_state"] == state["train_state"]


def test_layouts_written_before_frames_still_load():
    """A local part from before frames (5 fields per entry) is read at its offsets."""
    import pickle

    layout, data = _stage(_state())
    d = pickle.loads(layout.to_bytes())
    d["entries"] = [e[:5] for e in d["entries"]]
    old = staging.StateLayout.from_bytes(pickle.dumps(d, protocol=4))
    assert old.entries[0].pre == 0 and torch.equal(staging.rebuild(old, data)["w"], _state()["w"])


def test_layout_refuses_pickled_classes():
    import pickle

    evil = pickle.dumps({"skeleton": os.system, "entries": [], "total": 0})
    with pytest.raises(pickle.UnpicklingError):
        staging.StateLayout.from_bytes(evil)


def test_copy_into_updates_live_tensors_in_place_and_rejects_shape_change():
    live = {"w": torch.zeros(3, 5), "n": 1}
    saved = {"w": torch.ones(3, 5), "n": 2}
    out = staging.copy_into(live, saved)
    assert out["w"] is live["w"] and torch.equal(live["w"], saved["w"]) and out["n"] == 2
    with pytest.raises(ValueError, match="/w"):
        staging.copy_into({"w": torch.zeros(2)}, {"w": torch.ones(3)})


def _write(tier, step, state, tag=None):
    layout, data = _stage(state)
    tier.write_part(step, data.numpy(), lambda: (layout.to_bytes(), {"layout_tag": tag or {"m": 1}}))
    return layout


def test_local_tier_commit_verify_and_detect_flipped_byte(tmp_path):
    tier = LocalTier(str(tmp_path), rank=0, world_size=1, first_on_node=True, keep_latest_k=2,
                     job_id="J")
    _write(tier, 5, _state())
    assert tier.held_parts([{"m": 1}]) == {}  # not committed yet
    tier.commit(5, {"world_size": 1})
    assert tier.held_parts([{"m": 1}]) == {5: [0]} and tier.held_parts([{"m": 2}]) == {}
    assert tier.other_layout_steps(tier.held_parts([{"m": 1}]), [{"m": 1}]) == {}
    assert tier.other_layout_steps(tier.held_parts([{"m": 2}]), [{"m": 2}]) == {5: "saved with another parallel layout"}
    assert tier.other_layout_steps({}, []) == {}  # no layouts to tell by: no verdict
    wider = LocalTier(str(tmp_path), rank=0, world_size=2, first_on_node=True, keep_latest_k=2, job_id="J")
    assert wider.other_layout_steps(wider.held_parts([{"m": 1}] * 2), [{"m": 1}] * 2) == {
        5: "saved at world size 1, now 2"}
    layout_bytes, data, n = tier.read_part(5)
    assert n == os.path.getsize(tier._part(5, "data")) + len(layout_bytes)
    path = tier._part(5, "data")
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 3] ^= 0x01
    open(path, "wb").write(raw)
    with pytest.raises(files.CorruptCheckpoint, match="crc32c"):
        tier.read_part(5)


def test_resaving_a_step_drops_the_old_commit_first(tmp_path):
    tier = LocalTier(str(tmp_path), 0, 1, True, 2)
    _write(tier, 5, _state())
    tier.commit(5, {})
    _write(tier, 5, _state())
    assert not os.path.exists(os.path.join(tier.step_dir(5), COMMIT))


def _store_replica(holder: LocalTier, step: int, rank: int, manifest: bytes, layout: bytes, data) -> None:
    """What replication does with a received part: streamed through the holder's sink."""
    with holder.receive_replica(step, rank) as sink:
        sink.write(memoryview(data).cast("B"))
        sink.entry()
        sink.finish(manifest, layout)


def test_replica_is_stored_under_its_source_rank_and_purged_by_its_holder(tmp_path):
    src = LocalTier(str(tmp_path / "a"), rank=2, world_size=4, first_on_node=True, keep_latest_k=2,
                    job_id="J")
    layout, data = _stage(_state())
    manifest, _ = src.write_part(6, data.numpy(), lambda: (layout.to_bytes(), {"layout_tag": {"m": 1}}))
    holder = LocalTier(str(tmp_path / "b"), rank=0, world_size=4, first_on_node=True, keep_latest_k=2,
                       job_id="J")
    _store_replica(holder, 6, 2, *src.read_raw(6))
    assert holder.read_raw(6, 2)[0] == manifest
    holder.commit(6, {})
    assert holder.held_parts([{"m": 1}] * 4) == {6: [2]}
    assert holder.read_part(6, 2)[2] == src.read_part(6)[2]
    for s in (8, 10):
        _store_replica(holder, s, 2, *src.read_raw(6))
        holder.commit(s, {})
    holder.purge(protected=set(), held=[2])
    assert not (tmp_path / "b" / "step-6").exists()


def test_a_piece_ending_mid_page_sends_only_that_page_through_the_page_cache(tmp_path, monkeypatch):
    """Appender: a drain's piece from the buffer is whole pages but for the part's last
    one. Its whole pages go with O_DIRECT, the partial page (and all after it) buffered:
    a 64 MiB piece ending mid-page once went through the page cache whole (debugmodel's
    36 MiB part: its drain took 2.0x its bound and 9 ms of CPU against 2)."""
    direct, real = [], files.write_all
    monkeypatch.setattr(files, "write_all", lambda fd, chunk: (
        direct.append((len(chunk), bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT))), real(fd, chunk)))
    data = staging.huge_page_buffer(2 << 20).numpy()
    data[:] = 7
    path = str(tmp_path / "part")
    with files.Appender(path) as out:
        if not out.direct:
            pytest.skip("this file system takes no O_DIRECT")
        out.write(data[: 3 * files.PAGE + 100])
        out.write(b"tail")
    assert direct == [(3 * files.PAGE, True), (100, False), (4, False)]
    assert open(path, "rb").read() == bytes(data[: 3 * files.PAGE + 100]) + b"tail"
    assert out.crc == files.checksum(b"tail", files.checksum(data[: 3 * files.PAGE + 100]))


def test_a_replica_sink_that_fails_keeps_receiving_and_leaves_no_file(tmp_path, monkeypatch):
    """A full disk mid-replica: write() swallows the error (the sender is still
    sending: raising would leave it waiting), entry() raises it once the exchange is
    over, and the aborted batch leaves no file, temporary or not."""
    import errno

    holder = LocalTier(str(tmp_path), rank=0, world_size=2, first_on_node=True, keep_latest_k=2, job_id="J")
    real, calls = files.Appender.write, []

    def write(self, data, crc=True):
        calls.append(len(data))
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data, crc)

    monkeypatch.setattr(files.Appender, "write", write)
    with pytest.raises(OSError, match="No space"):
        with holder.receive_replica(4, 1) as sink:
            for _ in range(3):
                sink.write(b"x" * 4096)  # never raises
            sink.entry()
    assert calls == [4096, 4096] and os.listdir(holder.step_dir(4)) == []


def test_a_held_part_is_checked_against_its_source_ranks_layout_and_this_job(tmp_path):
    """3 ranks, uneven shards: each rank's layout tag differs. A replica of rank 2 held
    by rank 0 is valid when it matches rank 2's tag (not rank 0's); a part or a marker
    of another job is never held, even inside this job's folder."""
    tags = [{"rows": 22}, {"rows": 21}, {"rows": 21, "r": 2}]
    src = LocalTier(str(tmp_path / "src"), rank=2, world_size=3, first_on_node=True, keep_latest_k=2,
                    job_id="J")
    _write(src, 6, _state(), tag=tags[2])
    other = LocalTier(str(tmp_path / "other"), rank=1, world_size=3, first_on_node=True,
                      keep_latest_k=2, job_id="K")
    _write(other, 6, _state(), tag=tags[1])
    holder = LocalTier(str(tmp_path / "holder"), rank=0, world_size=3, first_on_node=True,
                       keep_latest_k=2, job_id="J")
    _write(holder, 6, _state(), tag=tags[0])
    _store_replica(holder, 6, 2, *src.read_raw(6))
    _store_replica(holder, 6, 1, *other.read_raw(6))  # another job's part, same step number
    holder.commit(6, {})
    assert holder.held_parts(tags) == {6: [0, 2]}
    assert holder.held_parts([tags[0]] * 3) == {6: [0]}  # the holder's own tag: rank 2 rejected
    with open(os.path.join(holder.step_dir(6), COMMIT), "w") as f:
        json.dump({"job_id": "K", "step": 6}, f)
    assert holder.held_parts(tags) == {}  # the marker is another job's


def test_a_replica_of_another_job_or_layout_is_refused_on_receipt(tmp_path):
    src = LocalTier(str(tmp_path / "src"), rank=1, world_size=2, first_on_node=True, keep_latest_k=2,
                    job_id="J")
    _write(src, 4, _state(), tag={"rows": 3})
    part = Part(*src.read_raw(4))
    assert check_part(part, 1, 4, 2, "J", {"rows": 3})["rank"] == 1
    with pytest.raises(files.CorruptCheckpoint, match="'job_id': 'J'.*expected.*'job_id': 'K'"):
        check_part(part, 1, 4, 2, "K", {"rows": 3})
    with pytest.raises(files.CorruptCheckpoint, match="layout differs"):
        check_part(part, 1, 4, 2, "J", {"rows": 4})


def test_purge_keeps_newest_k_protected_and_in_flight(tmp_path):
    tier = LocalTier(str(tmp_path), 0, 1, True, 2)
    for s in (1, 2, 3, 4):
        _write(tier, s, _state())
        tier.commit(s, {})
    _write(tier, 5, _state())  # being written: no commit yet
    gone = tier.purge(protected={1})
    assert gone == [2] and tier.steps() == [1, 3, 4, 5]


def test_recovery_order_newest_covered_local_first():
    # two nodes of one rank each: node 0 has its own parts of 5, 10, 15; node 1 lost 15
    reports = [{5: [0], 10: [0], 15: [0]}, {5: [1], 10: [1]}]
    assert recovery.ordered_candidates(reports, [10, 20]) == [
        ("pfs", 20), ("local", 10), ("pfs", 10), ("local", 5)]
    assert recovery.missing_parts(reports) == {15: [1]}
    # step 0, a seed checkpoint: the model alone, from the PFS, as stock torchtitan loads it
    seeded = [{0: [0], 5: [0]}, {0: [1], 5: [1]}]
    assert recovery.ordered_candidates(seeded, [0], {0: 1}) == [("local", 5), ("pfs", 0)]


def test_pull_plan_uses_replicas_on_other_nodes():
    # 2 nodes x 2 ranks, factor 1: node 1 (ranks 2, 3) was wiped; node 0 holds copies
    node0 = {6: [0, 1, 2, 3]}
    reports = [node0, node0, {}, {}]
    assert recovery.pull_plan(reports, 6) == [(0, 2), (0, 3)]
    assert recovery.pull_plan([{6: [0, 1]}, {6: [0, 1]}, {}, {}], 6) is None
    assert recovery.ordered_candidates(reports, []) == [("local", 6)]


def test_placement_by_failure_domain():
    from titan_ckpt_plus.placement import PlacementError, ReplicaPlacement

    hosts = ("a", "a", "b", "b")
    p = ReplicaPlacement(4, 1, 2, hosts)
    assert [p.peers(r) for r in range(4)] == [[2], [3], [0], [1]]
    assert [p.sources(r) for r in range(4)] == [[2], [3], [0], [1]]
    with pytest.raises(PlacementError, match="replication_jump = 1"):
        ReplicaPlacement(4, 1, 1, hosts)  # rank 0's copy would stay on host a
    with pytest.raises(PlacementError, match="needs 2 failure domains"):
        ReplicaPlacement(2, 1, 1, ("a", "a"))
    with pytest.raises(PlacementError, match="needs 3 failure domains"):
        ReplicaPlacement(4, 2, 2, hosts)
    assert ReplicaPlacement(6, 2, 2, ("a", "a", "b", "b", "c", "c")).peers(5) == [1, 3]


def test_a_purged_steps_data_file_is_written_over_by_the_next_save(tmp_path):
    """Retention retires a data file instead of deleting it; the rank's next part is
    written into it (its blocks stay allocated: no extent allocation, no discard of
    freed blocks), cut to the new part's size, and reads back verified."""
    tier = LocalTier(str(tmp_path), 0, 1, True, 2, job_id="J")
    big = dict(_state(), extra=torch.randn(70_000))  # a longer part than the next ones
    for s, state in ((1, big), (2, _state()), (3, _state())):
        _write(tier, s, state)
        tier.commit(s, {})
    spare = tier._spare(0)
    inode = os.stat(tier._part(1, "data")).st_ino
    assert tier.purge(protected=set()) == [1] and tier.steps() == [2, 3]
    assert os.stat(spare).st_ino == inode and os.path.getsize(spare) > 280_000  # retired whole
    _write(tier, 4, _state())
    tier.commit(4, {})
    assert not os.path.exists(spare)
    part = tier._part(4, "data")
    assert os.stat(part).st_ino == inode  # the same file, written over
    layout_bytes, data, _ = tier.read_part(4)  # its size and CRC-32C are the new part's
    assert os.path.getsize(part) == len(data) < 280_000
    layout = staging.StateLayout.from_bytes(layout_bytes)
    back = staging.rebuild(layout, torch.frombuffer(data, dtype=torch.uint8))
    assert torch.equal(back["w"], _state()["w"])
    inode2 = os.stat(tier._part(2, "data")).st_ino
    tier.purge(protected=set())
    assert tier.steps() == [3, 4] and os.stat(spare).st_ino == inode2
    tier.discard(3, held=[])  # a second file to retire while a spare waits: deleted
    assert os.stat(spare).st_ino == inode2 and sorted(os.listdir(os.path.dirname(spare))) == ["rank-00000.data"]


def test_discarding_an_uncommitted_step_frees_its_files_and_keeps_the_rest(tmp_path):
    tier = LocalTier(str(tmp_path), 0, 1, True, 2)
    _write(tier, 2, _state())
    tier.commit(2, {})
    _write(tier, 4, _state())  # the ranks did not commit step 4
    tier.discard(4, held=[])
    assert tier.steps() == [2] and tier.committed_steps() == [2]
    tier.discard(6, held=[])  # nothing there: a no-op


def test_durable_write_of_a_page_aligned_buffer_with_a_ragged_tail(tmp_path):
    """The staging buffer's path: O_DIRECT for whole pages (where the file system
    takes it), then the tail; the file and its checksum are the bytes given."""
    from titan_ckpt_plus.staging import HostBuffer
    from titan_ckpt_plus.tiers import files

    n = (3 << 20) + 123
    buf = HostBuffer(pin=False).ensure(n)
    assert buf.data_ptr() % files.PAGE == 0
    buf.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    for data in (buf.numpy(), bytes(buf.numpy()[1:])):  # aligned; unaligned (buffered)
        entry = files.write_durable(str(tmp_path / "part.data"), data)
        assert (tmp_path / "part.data").read_bytes() == bytes(data)
        assert entry == files.entry(data)
        # written over a longer retired file: the same bytes, the file cut to them
        (tmp_path / "spare").write_bytes(b"\xff" * (n + 5 * files.PAGE))
        with files.DurableBatch() as batch:
            assert batch.write(str(tmp_path / "again.data"), data, reuse=str(tmp_path / "spare")) == entry
        assert (tmp_path / "again.data").read_bytes() == bytes(data) and not (tmp_path / "spare").exists()


def test_a_small_file_is_written_in_one_call(tmp_path, monkeypatch):
    """A manifest, a layout, a .metadata: one write each. Pieces matter only to O_DIRECT
    and to a write that follows the staging copy; a background thread takes the GIL
    back from training after every system call."""
    from titan_ckpt_plus.tiers import files

    writes, write = [], os.write
    monkeypatch.setattr(os, "write", lambda fd, b: writes.append(len(b)) or write(fd, b))
    data = os.urandom(300_000)  # under O_DIRECT's 1 MiB
    entry = files.write_durable(str(tmp_path / "small"), data)
    assert writes == [300_000]
    assert (tmp_path / "small").read_bytes() == data and entry == files.entry(data)


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "none"
    return text.split("[")[1].split("]")[0]


def _huge_kib(addr: int) -> int:
    """AnonHugePages of the mapping holding `addr`, from /proc/self/smaps."""
    inside, kib = False, 0
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            kib = int(line.split()[1])
    return kib


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off")
def test_the_unpinned_staging_buffer_is_backed_by_huge_pages():
    """The buffer starts on a 2 MiB boundary and, once touched, the kernel backs it
    with huge pages (the O_DIRECT write's page pinning costs a third as much), even
    right after the allocator freed memory it had touched with small pages."""
    from titan_ckpt_plus import staging

    reused = torch.empty(16 << 20, dtype=torch.uint8).fill_(1)  # small pages, then freed
    del reused
    hb = staging.HostBuffer(pin=False)
    buf = hb.ensure(16 << 20)
    assert buf.data_ptr() % staging.HUGE_PAGE == 0
    buf.fill_(1)
    assert _huge_kib(buf.data_ptr()) >= 8 << 10
    assert hb.ensure(1 << 20).data_ptr() == buf.data_ptr()  # kept while big enough


_FORK_CHECK = r"""
import json, os, sys
from titan_ckpt_plus import staging
n = int(sys.argv[1])
bufs = {"pinned": staging.HostBuffer(pin=True, register=lambda buf: lambda: None).ensure(n),
        "plain": staging.HostBuffer(pin=False).ensure(n)}  # held: a freed one is unmapped
pid = os.fork()
if pid == 0:  # the child reads its own maps and answers in its exit code
    with open("/proc/self/maps") as f:
        spans = [[int(x, 16) for x in line.split()[0].split("-")] for line in f]
    seen = [any(lo <= b.data_ptr() < hi for lo, hi in spans) for b in bufs.values()]
    os._exit(10 + 2 * seen[0] + seen[1])
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps({"child exit": code} if not 10 <= code < 14 else
                 {"pinned": bool((code - 10) & 2), "plain": bool((code - 10) & 1)}))
"""


def _mapped_in_a_forked_child(nbytes: int) -> dict:
    """Which of a pinned and an unpinned staging buffer a forked child has mapped.
    Forked from a fresh interpreter: a fork of pytest's own process, with the
    threads and at-fork handlers of every earlier test, once died in the child."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _FORK_CHECK, str(nbytes)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_pinned_staging_buffer_is_registered_at_its_own_size_and_unpinned_when_replaced(monkeypatch):
    """On a GPU the buffer is our own memory pinned in place (cudaHostRegister, here a
    stand-in that records the calls): exactly the state's bytes, not torch's pinned
    allocator's next power of two. A larger state pins a new buffer before unpinning
    the old; a forked child (a dataloader worker) does not inherit it, where Linux
    would copy its pinned pages; release() unpins; a failed registration falls back
    to the allocator."""
    from titan_ckpt_plus import staging

    calls = []

    def register(buf):
        calls.append(("pin", buf.data_ptr(), buf.numel()))
        return lambda: calls.append(("unpin", buf.data_ptr()))

    n = (3 << 20) + 12345  # 3.01 MiB: torch's pinned allocator would pin 4 MiB
    hb = staging.HostBuffer(pin=True, register=register)
    first = hb.ensure(n)
    assert calls == [("pin", first.data_ptr(), n)] and first.numel() == n
    assert first.data_ptr() % staging.HUGE_PAGE == 0
    # torch's is_pinned() asks CUDA about the storage's first byte: the registered one
    shared = staging.HostBuffer(pin=True, register=register, shared=True)
    for buf in (first, shared.ensure(n)):
        assert (buf.untyped_storage().data_ptr(), buf.untyped_storage().nbytes()) == (buf.data_ptr(), n)
    shared.release()
    del calls[1:]
    assert hb.ensure(n - 1).data_ptr() == first.data_ptr() and len(calls) == 1  # kept while big enough
    second = hb.ensure(2 * n)
    assert calls[1:] == [("pin", second.data_ptr(), 2 * n), ("unpin", first.data_ptr())]
    # pinned pages are not copied at a fork; unpinned ones are
    assert _mapped_in_a_forked_child(n) == {"pinned": False, "plain": True}
    hb.release()
    hb.release()  # once only
    assert calls[3:] == [("unpin", second.data_ptr())]

    def refuse(buf):
        raise RuntimeError("cudaHostRegister returned cudaErrorNotSupported")

    monkeypatch.setattr(staging, "allocator_pinned", lambda nbytes: torch.zeros(nbytes, dtype=torch.uint8))
    fallback = staging.HostBuffer(pin=True, register=refuse)
    assert fallback.ensure(n).numel() == n
    fallback.release()  # nothing of ours to unpin


def test_a_part_is_synced_whole_before_any_file_is_named_and_the_marker_syncs_the_names(tmp_path, monkeypatch):
    """A part's three files are fsync'd before the first is renamed into place, the
    manifest is renamed last, and nothing is named after a failed write. The part's
    names become durable with the marker's directory fsync, which therefore comes
    after every rename (and the root's, for the step folder's own name)."""
    calls = []
    real_fsync, real_replace, real_fsync_dir = os.fsync, os.replace, files.fsync_dir
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(("fsync", fd)), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append(("name", os.path.basename(b))),
                                                     real_replace(a, b))[1])
    monkeypatch.setattr(files, "fsync_dir", lambda d: (calls.append(("dir", d)), real_fsync_dir(d))[1])
    tier = LocalTier(str(tmp_path), 0, 1, True, 2)
    _write(tier, 5, _state())
    kinds = [k for k, _ in calls]
    assert kinds == ["fsync"] * 3 + ["name"] * 3
    assert [n for k, n in calls if k == "name"] == ["rank-00000.data", "rank-00000.layout", "rank-00000.json"]
    calls.clear()
    tier.commit(5, {})
    named = [c for c in calls if c[0] != "fsync"]
    assert named == [("name", COMMIT), ("dir", tier.step_dir(5)), ("dir", tier.root)]

    calls.clear()
    with pytest.raises(OSError, match="disk full"), files.DurableBatch() as batch:
        batch.write(str(tmp_path / "a.data"), b"x" * 10)
        raise OSError("disk full")
    assert calls == [] and not (tmp_path / "a.data").exists()


@pytest.mark.parametrize("n", [0, 100, 4096, 5000, (3 << 20) + 123, 37055908, (40 << 20) + 4096])
def test_write_pieces_cover_the_file_in_whole_pages_but_a_lone_tail(n):
    """A small first piece (the disk starts before the staging copy is far along),
    then CHUNK-sized ones; only a last partial page may be ragged, so it alone goes
    through the page cache."""
    pieces = list(files._chunks(n))
    ends = [b for _, b in pieces]
    assert [a for a, _ in pieces] == [0, *ends[:-1]][: len(pieces)] and (ends[-1] if ends else 0) == n
    sizes = [b - a for a, b in pieces]
    ragged = [s for s in sizes if s % files.PAGE]
    assert ragged == ([n % files.PAGE] if n % files.PAGE else []) and (not ragged or sizes[-1] == ragged[0])
    assert all(s <= files.CHUNK for s in sizes)
    if n >= 2 * files.FIRST_CHUNK:
        assert sizes[0] == files.FIRST_CHUNK and sizes[1] > files.FIRST_CHUNK


def test_a_write_behind_the_staging_copy_takes_all_that_is_staged_in_one_call(tmp_path, monkeypatch):
    """Each write call is a time the writer thread takes the GIL back from training:
    a piece runs on over every whole page the copy has staged, so a copy that is
    ahead is written in fewer calls (not one CHUNK at a time), and never past what is
    staged. The bytes and the checksum are the same either way."""
    n = (100 << 20) + 123
    data = os.urandom(n)
    sizes = []
    real = files.write_all
    monkeypatch.setattr(files, "write_all", lambda fd, chunk: (sizes.append(len(chunk)), real(fd, chunk)))

    def staged_by(plan):  # the copy's progress as the writer finds it at each wait
        seen = []

        def ready(end):
            seen.append(end)
            return max(end, plan.pop(0) if plan else n)
        return ready, seen

    ready, seen = staged_by([files.FIRST_CHUNK, (60 << 20) + 5, n])
    entry = files.write_durable(str(tmp_path / "a.data"), data, before_chunk=ready)
    assert entry == {"size": n, files.SUM: files.checksum(data)}
    assert (tmp_path / "a.data").read_bytes() == data
    # 4 MiB, then up to the last whole page staged (60 MiB), then the rest but the tail
    assert sizes[:3] == [files.FIRST_CHUNK, (60 << 20) - files.FIRST_CHUNK, (n - (60 << 20)) // files.PAGE * files.PAGE]
    assert sizes[3:] == [n % files.PAGE] and seen[-1] == n

    sizes.clear()  # a copy only just ahead: the planned pieces, none larger than CHUNK
    files.write_durable(str(tmp_path / "b.data"), data, before_chunk=lambda end: end)
    assert sizes == [b - a for a, b in files._chunks(n)] and max(sizes) <= files.CHUNK


@pytest.mark.parametrize("mib", [1, 36, 586, 12 << 10])
def test_a_drain_reading_a_local_file_holds_a_sixteenth_of_it_at_most(mib, tmp_path, monkeypatch):
    """Pieces read back from a local part (a drain whose staging buffer was taken
    back) land in one reused buffer of piece_size(): a sixteenth of the file in whole
    pages, 1 MiB at least, CHUNK at most, so a small model's drain no longer holds a
    buffer half its state beside the staging buffer. Every byte still arrives checked."""
    size = files.piece_size(mib << 20)
    assert size % files.PAGE == 0 and (1 << 20) <= size <= files.CHUNK
    assert size == min(files.CHUNK, max(1 << 20, (mib << 20) // 16))
    if mib > 64:  # the read itself, on files this test can afford
        return
    data = os.urandom(mib << 20) + b"tail"
    path = tmp_path / "rank-0.data"
    path.write_bytes(data)
    buffers = []
    real_mmap = files.mmap.mmap
    monkeypatch.setattr(files.mmap, "mmap", lambda *a, **k: buffers.append(a[1]) or real_mmap(*a, **k))
    got = bytearray()
    for offset, piece in files.read_spans(str(path), files.entry(data), [(0, len(data))]):
        assert offset == len(got) and len(piece) <= files.piece_size(len(data))
        got += piece
    assert bytes(got) == data and buffers == [files.piece_size(len(data))]


def test_staging_progress_never_runs_ahead_of_the_copied_bytes():
    """The local write follows StagingProgress, so each advance must come only once
    every byte below it is in the buffer; the first group is about the write's first
    piece, the next ones about a group (on CPU, a core's L2 cache: the group's CRC
    reads it there)."""
    g = torch.Generator().manual_seed(1)
    state = {f"t{i}": torch.randn(int(n), generator=g)
             for i, n in enumerate(torch.randint(1, 400_000, (60,), generator=g))}  # ~45 MiB
    layout, tensors, _ = staging.plan_layout(state)
    buf = staging.HostBuffer(pin=False)
    buf.ensure(layout.total_bytes).fill_(255)  # stale bytes from an earlier save
    want = buf.data[: layout.total_bytes].clone()
    staging.write_frames(want, layout)
    for e, t in zip(layout.entries, tensors):
        staging.tensor_view(want, e).copy_(t)
    seen = []

    class Checked(staging.StagingProgress):
        def advance(self, upto: int) -> None:
            assert torch.equal(buf.data[:upto], want[:upto]), f"advanced to {upto} before copying it"
            seen.append(upto)
            super().advance(upto)

    buf.copy_in(layout, tensors, Checked())
    assert seen == sorted(seen) and seen[-1] == layout.total_bytes and len(seen) >= 5
    biggest = max(e.frame[1] - e.frame[0] for e in layout.entries) + staging.ALIGN
    group = Copy.group_bytes
    assert min(files.FIRST_CHUNK, group) <= seen[0] < min(files.FIRST_CHUNK, group) + biggest
    assert group <= seen[1] - seen[0] < group + biggest


def test_staging_progress_wakes_each_waiter_once_its_bytes_are_staged():
    """The writer waits for a whole write piece while the copy advances group by
    group: it is woken when the bytes it waits for are staged (or the copy failed),
    not at every group, and two waiters with different ends both get theirs."""
    import threading
    import time

    class Counted(threading.Condition):
        wakes = 0

        def notify_all(self):
            Counted.wakes += 1
            super().notify_all()

    progress = staging.StagingProgress()
    progress._cv = Counted()
    got = {}

    def waiter(upto):
        got[upto] = progress.wait(upto)

    threads = [threading.Thread(target=waiter, args=(upto,)) for upto in (40, 100)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while progress._wanted != 40 and time.monotonic() < deadline:  # both asleep, the nearer end registered
        time.sleep(0.001)
    for upto in range(10, 110, 10):  # ten groups
        progress.advance(upto)
        time.sleep(0.005)  # a woken waiter registers its end again before the next group
    for t in threads:
        t.join(5)
    # 2: at 40, both woken, and at 100 (1 if the second had not gone back to sleep by then)
    assert got == {40: 40, 100: 100} and Counted.wakes <= 2
    failing = staging.StagingProgress()
    box = []
    t = threading.Thread(target=lambda: box.append(pytest.raises(RuntimeError, failing.wait, 50)))
    t.start()
    deadline = time.monotonic() + 5
    while failing._wanted != 50 and time.monotonic() < deadline:
        time.sleep(0.001)
    failing.advance(10)
    failing.fail()
    t.join(5)
    assert not t.is_alive() and box


def test_cuda_registration_runs_on_its_own_thread_on_the_ranks_device(monkeypatch):
    """cudaHostRegister (a stand-in cudart here) is called with the buffer's own
    address and size, portable, on a thread that first selects the calling thread's
    device, so a failure's last-error stays off the training thread; a failure raises
    (HostBuffer then falls back); the returned callable unregisters the same address."""
    import threading

    from titan_ckpt_plus import staging

    calls, main = [], threading.get_ident()

    class Cudart:
        result = 0

        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size, flags, threading.get_ident() != main, device[threading.get_ident()]))
            return self.result

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr, threading.get_ident() != main, device[threading.get_ident()]))
            return 0

    device = {main: 3}
    cudart = Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device[threading.get_ident()])
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: device.__setitem__(threading.get_ident(), d))
    buf = staging.huge_page_buffer(1 << 20)
    unpin = staging.register_with_cuda(buf)
    assert calls == [("register", buf.data_ptr(), 1 << 20, 1, True, 3)]
    unpin()
    assert calls[1:] == [("unregister", buf.data_ptr(), True, 3)]
    cudart.result = 801  # cudaErrorNotSupported
    with pytest.raises(RuntimeError, match="cudaHostRegister of 1048576 bytes returned CUDA error 801"):
        staging.register_with_cuda(buf)
    assert device[main] == 3


def _one_rank_engine(tmp_path, state):
    """An engine of one rank on its own gloo group (the test destroys it): a local save
    at every step, no PFS save before step 1000."""
    import torch.distributed as dist

    from titan_ckpt_plus.checkpointer import TieredCheckpointer, TierSettings
    from titan_ckpt_plus.telemetry import EventLog

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    s = TierSettings(local_root=str(tmp_path / "local"), pfs_folder=str(tmp_path / "pfs"), local_interval=1,
                     pfs_interval=1000, local_keep=3, pfs_keep=3, rank=0, world_size=1, first_on_node=True,
                     job_id="J")
    return TieredCheckpointer(s, lambda: state, EventLog(None))


def test_a_replica_exchange_that_fails_fails_that_save_and_not_the_writer(tmp_path):
    """The exchange itself fails (a peer gone, the group's timeout): the save is counted
    failed (a replica and the save it leaves uncommitted) and not committed, the writer
    thread lives on, and the next save commits."""
    from types import SimpleNamespace

    def inject(ckpt):
        def broken(*_a, **_k):
            ckpt.placement = None  # step 2 replicates nothing
            raise RuntimeError("[gloo] Connection closed by peer")
        ckpt.placement = SimpleNamespace(peers=lambda r: [0], sources=lambda r: [0])
        ckpt.wire = SimpleNamespace(exchange=broken, pg=None)
    ended, stats, committed = _after_one_failure(tmp_path, inject)
    assert ended and (stats.failed_replicas, stats.failed_saves, stats.saves, committed) == (1, 1, 1, [2])


def test_a_failed_staging_copy_fails_its_save_alone_and_each_part_names_its_own_layout(tmp_path, monkeypatch):
    """Step 1's copy fails once its bytes are staged: that save is counted failed once
    and leaves no part (the writer's describe() refuses it). Steps 2 and 3 commit, and
    each manifest carries its own layout's fingerprint: step 3's state grew, so it
    adopted nothing of step 2's."""
    import torch.distributed as dist

    state = {"model": {"w": torch.randn(1000)}, "train_state": {"step": 1}}
    ckpt = _one_rank_engine(tmp_path, state)
    copy_in, saving = ckpt.buffer.copy_in, [0]

    def failing_once(*args, **kwargs):  # after every byte is staged: the writer may write them all
        copy_in(*args, **kwargs)
        if saving[0] == 1:
            raise OSError("the copy failed")
    monkeypatch.setattr(ckpt.buffer, "copy_in", failing_once)
    try:
        for step in (1, 2, 3):
            saving[0] = step
            if step == 3:
                state["model"]["b"] = torch.randn(10)
            ckpt.save(step)
            ckpt.flush()
        assert ckpt.stats.failed_saves == 1 and ckpt.local.committed_steps() == [2, 3]
        assert not os.path.exists(ckpt.local._part(1, "json"))
        prints = []
        for step in (2, 3):
            layout = staging.StateLayout.from_bytes(ckpt.local.read_part(step)[0])
            assert ckpt.local.manifest(step)["fingerprint"] == layout.fingerprint()
            prints.append(layout.fingerprint())
        assert prints[0] != prints[1]
    finally:
        ckpt.close()
        dist.destroy_process_group()



def _after_one_failure(tmp_path, inject) -> tuple:
    """Steps 1 and 2 saved and flushed, each on a thread, after `inject(ckpt)` made
    something of step 1's save fail: (whether both ended within 30 s, else the writer
    thread is gone or waits for ever and close() would too; the engine's counts; the
    committed steps)."""
    import threading

    import torch.distributed as dist

    ckpt = _one_rank_engine(tmp_path, {"model": {"w": torch.randn(1000)}, "train_state": {"step": 1}})
    inject(ckpt)
    ended = True
    try:
        for step in (1, 2):
            done = threading.Thread(target=lambda: (ckpt.save(step), ckpt.flush()), daemon=True)
            done.start()
            done.join(timeout=30)
            ended = ended and not done.is_alive()
        return ended, ckpt.stats, ckpt.local.committed_steps()
    finally:
        if ended:
            ckpt.close()
        dist.destroy_process_group()


def _first_call():
    """A predicate true on its first call only."""
    seen = []
    return lambda *_a, **_k: not seen and not seen.append(1)


def _once(real, fail, exc: Exception):
    """`real`, raising `exc` instead where `fail(*args, **kwargs)`."""
    def call(*args, **kwargs):
        if fail(*args, **kwargs):
            raise exc
        return real(*args, **kwargs)
    return call


def test_a_device_error_at_the_save_point_fails_that_save_and_not_the_writer(tmp_path):
    """The save point (a CUDA event on GPUs) raises, a device error: that save is counted
    failed before its job reaches the writer, which would otherwise wait for ever for a
    copy that never comes (and close() with it); the next save commits."""
    def inject(ckpt):
        ckpt.device.save_point = _once(ckpt.device.save_point, _first_call(),
                                       RuntimeError("CUDA error: an illegal memory access was encountered"))
    ended, stats, committed = _after_one_failure(tmp_path, inject)
    assert ended and (stats.failed_saves, committed) == (1, [2])


def test_a_commit_marker_that_fails_with_any_error_fails_that_save_and_not_the_writer(tmp_path, caplog):
    """The marker's write raises something other than an OSError (the byte helper's
    reply, a CorruptCheckpoint): that save is counted failed, the writer thread lives
    on, and the next save commits."""
    from titan_ckpt_plus.tiers.files import CorruptCheckpoint

    def inject(ckpt):
        ckpt.local.commit = _once(ckpt.local.commit, lambda step, info: step == 1,
                                  CorruptCheckpoint("the helper's reply: bad frame"))
    ended, stats, committed = _after_one_failure(tmp_path, inject)
    assert ended and (stats.failed_saves, committed) == (1, [2])
    assert "save of step 1 failed (commit marker: CorruptCheckpoint" in caplog.text  # not the writer's catch-all


def test_an_unexpected_error_before_the_vote_is_counted_and_the_save_still_votes(tmp_path):
    """Any exception out of a save's write before its commit vote (here its replication):
    a failed save, logged and counted, whose vote is still cast (as not written), so the
    next save's vote pairs with its peers' next one; the writer thread goes on, and the
    next save commits."""
    from types import SimpleNamespace

    voted = []

    def inject(ckpt):
        vote = ckpt.votes.vote
        ckpt.votes.vote = lambda flags, step, *rest: voted.append((step, list(flags))) or vote(flags, step, *rest)
        ckpt.placement = SimpleNamespace(peers=lambda r: [], sources=lambda r: [])
        ckpt._replicate = _once(lambda job, own: True, lambda job, own: job.step == 1,
                                RuntimeError("an error no handler expected"))
    ended, stats, committed = _after_one_failure(tmp_path, inject)
    assert ended and (stats.failed_saves, committed) == (1, [2])
    assert voted == [(1, [False, False]), (2, [True, True])]


def test_a_save_that_fails_twice_over_is_counted_once(tmp_path, caplog):
    """Its write fails, then an unexpected error follows in the same save (its
    replication): one failed save, not two, and both causes are in the log."""
    from types import SimpleNamespace

    def inject(ckpt):
        ckpt.local.write_part = _once(ckpt.local.write_part, lambda step, *_a, **_k: step == 1,
                                      OSError(5, "Input/output error"))
        ckpt.placement = SimpleNamespace(peers=lambda r: [], sources=lambda r: [])
        ckpt._replicate = _once(lambda job, own: True, lambda job, own: job.step == 1,
                                RuntimeError("an error no handler expected"))
    ended, stats, committed = _after_one_failure(tmp_path, inject)
    assert ended and (stats.failed_saves, committed) == (1, [2])
    assert "Input/output error" in caplog.text and "step 1 also failed: the writer: RuntimeError" in caplog.text


def test_a_save_that_failed_at_staging_never_frees_the_buffer_a_later_save_holds(tmp_path):
    """Save 1 fails at staging (it never takes the buffer); save 2 takes it; the writer
    gets to save 1 only then. Freeing the buffer for save 1 would let save 3 copy over
    save 2's bytes before they are written: it stays held until save 2's write."""
    import threading

    import torch.distributed as dist

    ckpt = _one_rank_engine(tmp_path, {"model": {"w": torch.randn(1000)}, "train_state": {"step": 1}})
    ckpt.device.save_point = _once(ckpt.device.save_point, _first_call(),
                                   RuntimeError("CUDA error: an illegal memory access was encountered"))
    gates, reached_2 = {1: threading.Event(), 2: threading.Event()}, threading.Event()
    write = ckpt._write

    def gated(job):
        if job.step == 2:
            reached_2.set()
        gates[job.step].wait(30)
        write(job)
    ckpt._write = gated
    try:
        ckpt.save(1)  # its job waits at the writer's gate
        ckpt.save(2)
        ckpt.wait_for_staging()
        assert not ckpt._buffer_free.is_set()  # save 2 holds it
        gates[1].set()
        assert reached_2.wait(30)  # the writer is done with save 1
        assert not ckpt._buffer_free.is_set(), "save 1's failed job freed the buffer save 2 holds"
        gates[2].set()
        ckpt.flush()
        assert ckpt._buffer_free.is_set() and ckpt.local.committed_steps() == [2]
        assert ckpt.stats.failed_saves == 1
    finally:
        for gate in gates.values():
            gate.set()
        ckpt.close()
        dist.destroy_process_group()


def test_close_joins_every_thread_it_started_gloo_groups_included(tmp_path):
    """A gloo thread left alive frees a finished collective's tensors whenever it next
    runs; in SCHED_IDLE that could be as the process exits, and the rank then aborted
    (SIGABRT, "terminate called without an active exception") after a clean run.
    close() leaves no thread of its groups behind, and no group usable after it."""
    import time

    import torch.distributed as dist

    from titan_ckpt_plus.tiers.pfs import gather

    def threads() -> set:
        return {int(t) for t in os.listdir("/proc/self/task")}

    ckpt = _one_rank_engine(tmp_path, {"model": {"w": torch.randn(1000)}, "train_state": {"step": 1}})
    try:
        ckpt.save(1)
        ckpt.flush()
        ckpt.preemption_agreed(False)  # an all-reduce left in flight, as in training
        gather("x" * 10000, ckpt.drain.votes.pg)  # its frame grows: gather() keeps one a group
        ours = set(ckpt._group_tids)
        assert len(ours) >= 9 and ours <= threads()  # three groups' (a TCP loop and two workers each)
        ckpt.close()
        deadline = time.monotonic() + 5
        while ours & threads() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not ours & threads(), f"gloo threads left after close(): {sorted(ours & threads())}"
        with pytest.raises(AttributeError):
            ckpt.promote_newest(time.monotonic() + 60)  # not on the default group instead
    finally:
        dist.destroy_process_group()
