"""The PFS drain as a copy (issue 15): a local part, already in DCP's per-rank form,
made a DCP step by PartCopyWriter; one rank, no torchrun."""

import contextlib
import io
import multiprocessing as mp
import os
import pickle
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from titan_ckpt_plus import drain, faults, inspect, staging
from titan_ckpt_plus.checkpointer import TieredCheckpointer, TierSettings
from titan_ckpt_plus.drain import PartSource, StagedBytes
from titan_ckpt_plus.tiers import files, pfs as pfs_mod
from titan_ckpt_plus.tiers.local import LocalTier
from titan_ckpt_plus.telemetry import EventLog
from titan_ckpt_plus.tiers.pfs import MANIFEST, PfsTier
from titan_ckpt_plus.votes import GlooVotes


@pytest.fixture
def pg():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


def _state(seed: int):
    g = torch.Generator().manual_seed(seed)
    mesh = init_device_mesh("cpu", (1,))
    return {
        "model": {"w": distribute_tensor(torch.randn(6, 4, generator=g), mesh, [Shard(0)]),
                  "bias": torch.randn(4, generator=g).to(torch.bfloat16)},
        "optimizer": {"state": {"w": {"exp_avg": torch.randn(4, 6, generator=g).t(),  # non-contiguous
                                      "step": torch.tensor(float(seed))}},
                      "param_groups": [{"lr": 1e-3 * seed, "params": ["w"]}]},
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 3),
        "big": torch.randn(5 << 20, generator=g),  # 20 MiB: the copy crosses read pieces
        "train_state": {"step": seed, "ntokens_seen": 1000 * seed},
        "dataloader": {"dp_rank_0": pickle.dumps({"samples": 17 * seed}), "world_size": 1},
    }


def _zeros_like(state):
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = _zeros_like(v)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        else:
            out[k] = v
    return out


def _stage_and_write(local: LocalTier, step: int, state):
    layout, tensors, specs = staging.plan_layout(state)
    buf = staging.HostBuffer(pin=False)
    buf.copy_in(layout, tensors)
    data = buf.data[: layout.total_bytes]
    local.write_part(step, data.numpy(), lambda: (layout.to_bytes(), {"layout_tag": {}}))
    return layout, specs, data


def _drain(pfs, local, step, layout, specs, pg, staged=None):
    """What PfsDrain does: from the staged bytes while lent, else the local file."""
    if staged is not None and not staged.reclaimable:
        source = PartSource(layout.total_bytes, staged)
    else:
        source = PartSource(layout.total_bytes, staged, *local.data_file(step))
    return pfs.save(step, layout, specs, source, GlooVotes(pg))


def _check_equal(back, want):
    assert torch.equal(back["model"]["w"].full_tensor(), want["model"]["w"].full_tensor())
    for a, b in ((back["model"]["bias"], want["model"]["bias"]), (back["mask"], want["mask"]),
                 (back["big"], want["big"]), (back["empty"], want["empty"]),
                 (back["optimizer"]["state"]["w"]["exp_avg"], want["optimizer"]["state"]["w"]["exp_avg"]),
                 (back["optimizer"]["state"]["w"]["step"], want["optimizer"]["state"]["w"]["step"])):
        assert torch.equal(a, b) and a.dtype == b.dtype


def test_the_drain_yields_to_training_only_while_it_checksums(pg, tmp_path, monkeypatch):
    """The drain thread stays in its own (normal) class while it only waits for the
    disk: a verbatim copy from memory. Its pieces are taken in `yielding()` (SCHED_IDLE
    in the engine) while their bytes are checksummed: read back from the file, or not
    the whole part, and from the moment the next save takes the buffer back."""
    monkeypatch.setattr(drain, "MEMORY_PIECE", files.CHUNK)  # a part of several pieces, as 100M's
    local = LocalTier(str(tmp_path / "local"), 0, 1, True, 2, job_id="J")
    layout, _, data = _stage_and_write(local, 3, _state(3))
    whole, total = open(local._part(3, "data"), "rb").read(), layout.total_bytes
    flag = {"on": False}

    @contextlib.contextmanager
    def yielding():
        flag["on"] = True
        try:
            yield
        finally:
            flag["on"] = False

    def take(source, spans, take_back_after=None):
        got, inside, taker = b"", [], None
        for i, (_, piece) in enumerate(source.pieces(spans)):
            got += bytes(piece)
            inside.append(flag["on"])
            if i == take_back_after:  # the next save's copy thread, while this piece is written
                taker = threading.Thread(target=source.staged.take_back)
                taker.start()
                while not source.staged.taken_back:  # it has asked, and waits for the piece
                    taker.join(0.001)
        assert not flag["on"]  # left once the pieces are taken
        if taker:
            taker.join()
        return got, inside

    def source(staged=True):
        lent = StagedBytes(data.numpy(), reclaimable=True) if staged else None
        return PartSource(total, lent, *local.data_file(3), yielding=yielding)

    everything, half = [(0, total)], [(0, total // 2 // files.PAGE * files.PAGE)]
    got, inside = take(source(), everything)
    assert got == whole and len(inside) >= 2 and not any(inside)  # verbatim from memory
    got, inside = take(source(), half)
    assert got == whole[: half[0][1]] and all(inside)  # part of it: checksummed as written
    got, inside = take(source(staged=False), everything)
    assert got == whole and all(inside)  # from the file: checked as read
    got, inside = take(source(), everything, take_back_after=0)
    assert got == whole and inside[0] is False and all(inside[1:])  # the buffer taken back


def test_the_next_copy_waits_for_the_drains_piece_only_where_it_reaches_it():
    """A save taking the buffer back from a drain mid-piece returns at once; its copy
    overwrites the bytes below the piece without waiting, and waits for the piece
    only before it overwrites the piece's bytes. The drain begins no other piece from
    memory, and a drain with no piece begun never holds the copy up."""
    loan = StagedBytes(bytearray(100 << 20), reclaimable=True)
    pieces = files.memory_pieces(loan.data, [(0, len(loan.data))], loan.lock, loan.claim, 32 << 20)
    assert next(pieces)[0] == 0 and next(pieces)[0] == 32 << 20  # writing the second piece
    clear = loan.take_back()
    clear(32 << 20)  # below the piece: at once
    late = threading.Thread(target=clear, args=(40 << 20,))
    late.start()
    late.join(0.2)
    assert late.is_alive(), "overwrote the piece being written"
    with pytest.raises(StopIteration) as stop:
        next(pieces)  # that piece written: the rest comes from the file, from the next one
    assert stop.value.value == 64 << 20
    late.join(5)
    assert not late.is_alive()
    idle = StagedBytes(bytearray(8), reclaimable=True)
    idle.lock.acquire()  # held, but by no piece from the buffer
    idle.take_back()(8)
    assert idle.claim(0)  # taken back: a drain starting now reads the file


def test_a_local_part_becomes_a_dcp_step_without_serializing_its_tensors(pg, tmp_path):
    local = LocalTier(str(tmp_path / "local"), 0, 1, True, 2, job_id="J")
    pfs = PfsTier(str(tmp_path / "pfs"), 0, 1, 2, job_id="J")
    state = _state(3)
    layout, specs, _ = _stage_and_write(local, 3, state)
    calls = []
    real_save = torch.save
    try:  # the tensors' bytes are copied: only the non-tensor items go through torch.save
        torch.save = lambda obj, f, *a, **k: (calls.append(type(obj).__name__), real_save(obj, f, *a, **k))[1]
        nbytes = _drain(pfs, local, 3, layout, specs, pg)
    finally:
        torch.save = real_save
    # the dataloader's two, lr, params, train_state's two
    assert sorted(calls) == ["bytes", "float", "int", "int", "int", "list"]
    step_dir = tmp_path / "pfs" / "step-3"
    # the same step metadata as DCP's own save of the same state, resharding info and all
    dcp.save(state, checkpoint_id=str(tmp_path / "stock"), process_group=pg)
    ours = FileSystemReader(str(step_dir)).read_metadata()
    stock = FileSystemReader(str(tmp_path / "stock")).read_metadata()
    assert ours.state_dict_metadata == stock.state_dict_metadata
    assert ours.planner_data == stock.planner_data
    # each tensor item is the local part's frame, byte for byte
    part = open(local._part(3, "data"), "rb").read()
    data = open(step_dir / "__0_0.distcp", "rb").read()
    assert nbytes == len(data)
    e = next(e for e in layout.entries if e.path == "/big")
    info = ours.storage_data[next(i for i in ours.storage_data if i.fqn == "big")]
    assert data[info.offset:info.offset + info.length] == part[e.frame[0]:e.frame[1]]
    # checksummed on the way: the manifest matches the files, and verify() passes
    manifest = files.read_json(step_dir / MANIFEST)
    assert manifest["files"]["__0_0.distcp"] == files.entry(data)
    assert pfs.verify(3, pg) == (True, "")
    back = _zeros_like(_state(9))
    dcp.load(back, checkpoint_id=str(step_dir), process_group=pg)
    _check_equal(back, state)
    assert back["train_state"] == {"step": 3, "ntokens_seen": 3000}
    assert back["optimizer"]["param_groups"] == [{"lr": 3e-3, "params": ["w"]}]
    assert pickle.loads(back["dataloader"]["dp_rank_0"]) == {"samples": 51}


def test_staged_bytes_taken_back_mid_copy_and_unlent_ones_drain_to_the_same_file(pg, tmp_path, monkeypatch):
    """From memory (nothing read back), from memory until the next save takes the
    buffer back (the rest from the file), and from memory alone (the local write
    failed: no file, the CRC computed on the way): the same file every time. Only the
    first drain of the layout goes through dcp.save; the later ones, another step
    with other values included, reuse its plan and .metadata and load their own values."""
    monkeypatch.setattr(drain, "MEMORY_PIECE", files.CHUNK)  # a part of several pieces, as 100M's
    planned = []
    real_save = dcp.save
    monkeypatch.setattr(dcp, "save", lambda *a, **k: (planned.append(1), real_save(*a, **k))[1])
    local = LocalTier(str(tmp_path / "local"), 0, 1, True, 2, job_id="J")
    pfs = PfsTier(str(tmp_path / "pfs"), 0, 1, 2, job_id="J")
    layout, specs, memory = _stage_and_write(local, 4, _state(4))
    step_file = tmp_path / "pfs" / "step-4" / "__0_0.distcp"
    _drain(pfs, local, 4, layout, specs, pg)
    from_file = step_file.read_bytes()
    reads = []
    real = files.read_spans
    files.read_spans = lambda *a, **k: (reads.append(k.get("resume", 0)), real(*a, **k))[1]
    try:
        _drain(pfs, local, 4, layout, specs, pg, StagedBytes(memory.numpy(), reclaimable=True))
        assert step_file.read_bytes() == from_file and reads == []
        staged = StagedBytes(memory.numpy(), reclaimable=True)
        real_write = files.Appender.write
        taker: list = []

        def write_then_take_back(self, data, crc=True):
            if not taker:  # during the first piece, the next save's copy thread asks for the
                # buffer and would overwrite all of it
                taker.append(threading.Thread(target=lambda: staged.take_back()(len(memory.numpy()))))
                taker[0].start()
                taker[0].join(0.2)
                assert taker[0].is_alive(), "overwrote the buffer while its piece was being written"
            real_write(self, data, crc)

        monkeypatch.setattr(files.Appender, "write", write_then_take_back)
        _drain(pfs, local, 4, layout, specs, pg, staged)
        monkeypatch.setattr(files.Appender, "write", real_write)
        taker[0].join(5)
        assert staged.taken_back and not taker[0].is_alive()
        # the rest came from the file, from the piece after the one being written
        assert step_file.read_bytes() == from_file and reads == [files.CHUNK]
        os.remove(local._part(4, "data"))
        _drain(pfs, local, 4, layout, specs, pg, StagedBytes(memory.numpy(), reclaimable=False))
        assert step_file.read_bytes() == from_file and len(reads) == 1
    finally:
        files.read_spans = real
    assert pfs.verify(4, pg) == (True, "")
    state5 = _state(5)
    layout5, specs5, _ = _stage_and_write(local, 5, state5)
    _drain(pfs, local, 5, layout5, specs5, pg)
    back = _zeros_like(_state(9))
    dcp.load(back, checkpoint_id=str(tmp_path / "pfs" / "step-5"), process_group=pg)
    _check_equal(back, state5)
    assert back["train_state"]["step"] == 5 and len(planned) == 1


def test_an_item_of_another_rank_is_skipped_and_the_rest_lands_where_the_metadata_says(
        pg, tmp_path, monkeypatch):
    """DCP writes a replicated tensor once, so a rank's plan may lack some of its
    frames. Here the 20 MiB one is dropped from the plan: two spans written back to
    back, every other frame where .metadata points, the CRC computed on the way."""
    from torch.distributed.checkpoint.planner import SavePlan

    class WithoutBig(pfs_mod.DefaultSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            return SavePlan([i for i in plan.items if i.index.fqn != "big"], planner_data=plan.planner_data)

    monkeypatch.setattr(pfs_mod, "DefaultSavePlanner", WithoutBig)
    local = LocalTier(str(tmp_path / "local"), 0, 1, True, 2, job_id="J")
    pfs = PfsTier(str(tmp_path / "pfs"), 0, 1, 2, job_id="J")
    state = _state(7)
    layout, specs, _ = _stage_and_write(local, 7, state)
    nbytes = _drain(pfs, local, 7, layout, specs, pg)
    big = next(e for e in layout.entries if e.path == "/big")
    assert nbytes < layout.total_bytes - big.nbytes + (2 << 20)
    assert pfs.verify(7, pg) == (True, "")
    back = _zeros_like(_state(9))
    del back["big"]
    dcp.load(back, checkpoint_id=str(tmp_path / "pfs" / "step-7"), process_group=pg)
    back["big"] = state["big"]
    _check_equal(back, state)


def test_spans_merge_short_gaps_and_keep_page_alignment():
    P = files.PAGE
    assert pfs_mod.spans_of([(0, 100), (200, 300)], 10 * P, P) == [(0, P)]
    assert pfs_mod.spans_of([(0, 100), (5 * P + 64, 5 * P + 80)], 10 * P, P) == [(0, P), (5 * P, 6 * P)]
    assert pfs_mod.spans_of([(0, 100), (2 * P + 64, 2 * P + 80)], 10 * P, 4 * P) == [(0, 3 * P)]
    assert pfs_mod.spans_of([(9 * P + 8, 9 * P + 50)], 9 * P + 60, P) == [(9 * P, 9 * P + 60)]
    spans = [(0, P), (5 * P, 6 * P)]
    assert pfs_mod._moved(5 * P + 64, spans) == P + 64 and pfs_mod._moved(100, spans) == 100


def test_a_corrupt_local_part_never_becomes_a_pfs_step(pg, tmp_path):
    local = LocalTier(str(tmp_path / "local"), 0, 1, True, 2, job_id="J")
    pfs = PfsTier(str(tmp_path / "pfs"), 0, 1, 2, job_id="J")
    layout, specs, _ = _stage_and_write(local, 6, _state(6))
    path = local._part(6, "data")
    raw = bytearray(open(path, "rb").read())
    raw[os.path.getsize(path) - 100] ^= 0x01  # past every frame's start: found only at the end
    open(path, "wb").write(raw)
    with pytest.raises(BaseException, match="crc32c"):
        _drain(pfs, local, 6, layout, specs, pg)
    assert not (tmp_path / "pfs" / "step-6" / ".metadata").exists() and pfs.steps() == []


def test_a_later_step_keeps_the_plan_and_writes_its_own_small_items(pg, tmp_path, monkeypatch):
    """A later step of the layout is not planned again, nor are its items placed in the
    file again, and its small items may differ in value and in size (a longer
    dataloader state here): the .metadata records where this step's landed, and each
    value is serialized once however many items hold it."""
    planned, placed, calls = [], [], []
    real_dcp_save, real_save, real_place = dcp.save, torch.save, pfs_mod.PartCopyWriter._place
    monkeypatch.setattr(dcp, "save", lambda *a, **k: (planned.append(1), real_dcp_save(*a, **k))[1])
    monkeypatch.setattr(pfs_mod.PartCopyWriter, "_place", lambda *a: (placed.append(1), real_place(*a))[1])
    local = LocalTier(str(tmp_path / "local"), 0, 1, True, 2, job_id="J")
    pfs = PfsTier(str(tmp_path / "pfs"), 0, 1, 2, job_id="J")
    layout, specs, _ = _stage_and_write(local, 4, _state(4))
    _drain(pfs, local, 4, layout, specs, pg)
    later = _state(5)
    later["dataloader"]["dp_rank_0"] = pickle.dumps({"samples": 85, "seen": list(range(300))})
    layout5, specs5, _ = _stage_and_write(local, 5, later)
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: (calls.append(type(obj).__name__),
                                                                 real_save(obj, f, *a, **k))[1])
    _drain(pfs, local, 5, layout5, specs5, pg)
    monkeypatch.setattr(torch, "save", real_save)
    assert len(planned) == 1 and len(placed) == 1
    # lr, the dataloader's bytes and train_state's two are new; world_size and params are not
    assert sorted(calls) == ["bytes", "float", "int", "int"]
    assert pfs.verify(5, pg) == (True, "")
    back = _zeros_like(_state(9))
    dcp.load(back, checkpoint_id=str(tmp_path / "pfs" / "step-5"), process_group=pg)
    _check_equal(back, later)
    assert pickle.loads(back["dataloader"]["dp_rank_0"]) == {"samples": 85, "seen": list(range(300))}
    assert back["train_state"] == {"step": 5, "ntokens_seen": 5000}
    assert back["optimizer"]["param_groups"] == [{"lr": 5e-3, "params": ["w"]}]


def test_the_manifest_is_in_place_before_the_metadata_that_completes_a_step(pg, tmp_path, monkeypatch):
    """A step is complete, for DCP and for recovery, once it has a .metadata; the
    manifest with its checksums is renamed into place first, both on the layout's
    first step and on the later ones, so a complete step always has its checksums."""
    renamed = []
    real_replace = os.replace
    monkeypatch.setattr(files.os, "replace", lambda a, b: (renamed.append(os.path.basename(b)), real_replace(a, b))[1])
    local = LocalTier(str(tmp_path / "local"), 0, 1, True, 2, job_id="J")
    pfs = PfsTier(str(tmp_path / "pfs"), 0, 1, 2, job_id="J")
    for step in (4, 5):
        layout, specs, _ = _stage_and_write(local, step, _state(step))
        renamed.clear()
        _drain(pfs, local, step, layout, specs, pg)
        assert renamed == [MANIFEST, ".metadata"], renamed


def test_small_items_are_serialized_once_per_value_and_type():
    small = pfs_mod.SmallItems()
    assert small.serialize(1) is small.serialize(1)
    outs = [small.serialize(v) for v in (1, 1.0, True, (0.9, 0.95), [0.9, 0.95])]
    assert len({id(o) for o in outs}) == 5
    for v, out in zip((1, 1.0, True, (0.9, 0.95), [0.9, 0.95]), outs):
        back = torch.load(io.BytesIO(out), weights_only=False)
        assert back == v and type(back) is type(v)


def test_a_kept_plans_drain_copies_only_once_every_flag_holds_and_every_rank_reaches_the_gather():
    """pfs_folder.copy_once_agreed, the order the byte helper runs whole: no copy unless
    every rank agreed to start; a copy that raises, or a rank that could not prepare
    one, still gathers, with its reason."""
    from titan_ckpt_plus.tiers.pfs_folder import copy_once_agreed

    calls = []

    def copy():
        calls.append("copy")
        return {"__0_0.distcp": {"size": 1}}

    def gathered(obj):
        calls.append("gather")
        return [obj, ("", {}, [2])]

    assert copy_once_agreed(lambda f: [True, False, True], [True] * 3, copy, gathered) == ([True, False, True], None)
    assert calls == []
    agreed, got = copy_once_agreed(lambda f: f, [True] * 3, copy, gathered, extra=[1])
    assert got[0] == ("", {"__0_0.distcp": {"size": 1}}, [1]) and calls == ["copy", "gather"]

    def fails():
        raise OSError(5, "EIO")
    _, got = copy_once_agreed(lambda f: f, [True] * 3, fails, gathered)
    assert "EIO" in got[0][0] and got[0][1] == {}
    calls.clear()
    _, got = copy_once_agreed(lambda f: f, [True] * 3, copy, gathered, why="no layout")
    assert got[0][0] == "no layout" and calls == ["gather"]


def test_a_drain_times_its_phases(pg, tmp_path):
    """Each phase's wall and CPU time go into the drain's event (what in a drain costs
    the cores training runs on): rank 0 clearing the folder; DCP's planning on the
    layout's first step; the start, copy and gather as one phase and rank 0's .metadata
    on the later ones."""
    from titan_ckpt_plus.telemetry import PhaseClock

    local = LocalTier(str(tmp_path / "local"), 0, 1, True, 2, job_id="J")
    pfs = PfsTier(str(tmp_path / "pfs"), 0, 1, 2, job_id="J")
    seen = []
    for step in (4, 5):
        layout, specs, _ = _stage_and_write(local, step, _state(step))
        clock = PhaseClock()
        pfs.save(step, layout, specs, PartSource(layout.total_bytes, None, *local.data_file(step)), GlooVotes(pg), clock=clock)
        assert all(w >= 0 and c >= 0 for w, c in clock.phases.values())
        seen.append(set(clock.phases))
    assert seen[0] == {"clear", "items", "copy", "dcp_save"}
    assert seen[1] == {"clear", "items", "copy", "metadata"}


def test_a_purged_steps_data_file_is_written_over_by_the_next_drain(pg, tmp_path):
    """PFS retention retires a step's data file to the job's spare instead of deleting
    it; the rank's next drain writes into it (no new file's extents to allocate), cut to
    the new step's size: the step verifies and loads. The spares go at the job's end."""
    local = LocalTier(str(tmp_path / "local"), 0, 1, True, 2, job_id="J")
    pfs = PfsTier(str(tmp_path / "pfs"), 0, 1, 1, job_id="J")
    big = dict(_state(4), extra=torch.randn(1 << 20))  # a longer part than the next ones
    layout, specs, _ = _stage_and_write(local, 4, big)
    _drain(pfs, local, 4, layout, specs, pg)
    first = os.stat(tmp_path / "pfs" / "step-4" / "__0_0.distcp")
    inode = first.st_ino
    for step in (5, 6):
        layout, specs, _ = _stage_and_write(local, step, _state(step))
        _drain(pfs, local, step, layout, specs, pg)
        assert pfs.purge() == [step - 1] and pfs.steps() == [step]
        if step == 5:
            spare = pfs._spare(0)
            assert os.stat(spare).st_ino == inode and os.path.getsize(spare) == first.st_size  # whole
            inode = os.stat(tmp_path / "pfs" / "step-5" / "__0_0.distcp").st_ino
    data = tmp_path / "pfs" / "step-6" / "__0_0.distcp"
    assert os.stat(data).st_ino == first.st_ino  # 6 wrote over 4's file; 5's is the spare now
    assert os.stat(pfs._spare(0)).st_ino == inode
    assert os.path.getsize(data) < first.st_size - (4 << 20) and pfs.verify(6, pg) == (True, "")
    back = _zeros_like(_state(9))
    dcp.load(back, checkpoint_id=str(tmp_path / "pfs" / "step-6"), process_group=pg)
    _check_equal(back, _state(6))
    assert sorted(os.listdir(tmp_path / "pfs")) == [".spare", "step-6"]  # stock torchtitan sees step-6
    _, notes = inspect.list_steps(str(tmp_path))  # titan-ckpt ls names the bytes held there
    spare_mib = os.path.getsize(pfs._spare(0)) / 2**20
    assert f"PFS folder {tmp_path / 'pfs'}; {spare_mib:.1f} MiB of retired data files in .spare, " \
           "for the next drains" in notes
    pfs.release_spares()
    assert sorted(os.listdir(tmp_path / "pfs")) == ["step-6"]


def test_with_pfs_reuse_files_off_a_purged_step_is_deleted_whole(pg, tmp_path):
    """[checkpoint] pfs_reuse_files = false (a tight PFS quota): no spare is kept, the
    next drain makes a new file, and nothing is left beside the kept steps."""
    local = LocalTier(str(tmp_path / "local"), 0, 1, True, 2, job_id="J")
    pfs = PfsTier(str(tmp_path / "pfs"), 0, 1, 1, job_id="J", reuse_files=False)
    for step in (4, 5, 6):
        layout, specs, _ = _stage_and_write(local, step, _state(step))
        _drain(pfs, local, step, layout, specs, pg)
        pfs.purge()
    assert pfs.steps() == [6] and sorted(os.listdir(tmp_path / "pfs")) == ["step-6"]
    assert pfs.verify(6, pg) == (True, "")


def test_the_spares_stay_for_a_restart_and_go_once_the_last_step_is_saved(pg, tmp_path):
    """The engine's close() before the last step (a preemption, an exception) keeps the
    job's PFS spares: the restart's first drain writes over them. After the last step
    they go."""
    state = {"model": {"w": torch.arange(4096, dtype=torch.float32)}, "train_state": {"step": 0}}

    def engine():
        s = TierSettings(local_root=str(tmp_path / "local"), pfs_folder=str(tmp_path / "pfs"),
                         local_interval=1, pfs_interval=1, local_keep=2, pfs_keep=2, rank=0, world_size=1,
                         first_on_node=True, job_id="J")
        return TieredCheckpointer(s, lambda: state, EventLog(None))

    ckpt = engine()
    for step in (1, 2, 3):
        ckpt.save(step)
        ckpt.flush()
    ckpt.close()
    spare = tmp_path / "pfs" / ".spare" / "J" / "rank-00000.distcp"
    assert ckpt.pfs.steps() == [2, 3] and spare.is_file()
    inode = spare.stat().st_ino
    ckpt = engine()
    ckpt.save(4)
    ckpt.flush()
    assert (tmp_path / "pfs" / "step-4" / "__0_0.distcp").stat().st_ino == inode
    ckpt.save(5, last_step=True)
    ckpt.close()
    assert ckpt.pfs.steps() == [4, 5] and not (tmp_path / "pfs" / ".spare").exists()


def test_drain_start_next_step_holds_a_drain_until_the_next_step_boundary(pg, tmp_path):
    """drain_start = "next_step": a PFS step's local part commits as before, but its
    drain waits for the next step boundary (save()'s first act), local retention keeping
    the step meanwhile; a flush starts a held drain at once. The PFS steps load back
    equal to what was saved."""
    state = {"model": {"w": torch.zeros(4096)}, "train_state": {"step": 0}}
    s = TierSettings(local_root=str(tmp_path / "local"), pfs_folder=str(tmp_path / "pfs"), local_interval=1,
                     pfs_interval=2, local_keep=2, pfs_keep=3, rank=0, world_size=1, first_on_node=True,
                     job_id="J", drain_start="next_step")
    ckpt = TieredCheckpointer(s, lambda: state, EventLog(None))
    ckpt.drain._overdue_s = lambda: 60.0  # no late start by the drain thread here
    try:
        for step in (1, 2):
            state["model"]["w"].fill_(step)
            ckpt.save(step)
        ckpt.wait_for_staging()
        ckpt._write_q.join()  # step 2 is committed; its drain is held
        assert ckpt.local.committed_steps() == [1, 2] and ckpt.drain.steps == {2}
        assert [job.step for job, _ in ckpt.drain._held] == [2] and ckpt.drain._q.empty()
        assert (ckpt.stats.drains, ckpt.pfs.steps()) == (0, [])
        state["model"]["w"].fill_(3)
        ckpt.save(3)  # the boundary hands step 2 over before step 3 is staged
        assert not ckpt.drain._held
        ckpt.drain.join()
        assert (ckpt.stats.drains, ckpt.pfs.steps()) == (1, [2])
        state["model"]["w"].fill_(4)
        ckpt.save(4)
        ckpt.flush()  # no boundary after the last save: the flush starts its drain
        assert (ckpt.stats.drains, ckpt.pfs.steps(), ckpt.drain.steps) == (2, [2, 4], set())
        for step in (2, 4):  # stock DCP reads each
            back = {"model": {"w": torch.empty(4096)}}
            dcp.load(back, checkpoint_id=str(tmp_path / "pfs" / f"step-{step}"), process_group=pg)
            assert torch.equal(back["model"]["w"], torch.full((4096,), float(step)))
        ckpt.s.drain_start = "auto"  # the default holds too, but not where the next step saves
        held = []
        for local, pfs, step in ((3, 6, 6), (3, 4, 8), (1, 2, 6)):
            ckpt.schedule.local_interval, ckpt.schedule.pfs_interval = local, pfs
            held.append(ckpt._hold_drain(step))
        assert held == [True, False, False]
    finally:
        ckpt.close()


def test_a_held_drain_whose_boundary_never_comes_is_started_by_the_drain_thread(pg, tmp_path):
    """A rank's training stops on an exception after a PFS save while its peers wait in
    a collective: no step boundary comes on them, and the failing rank's close() would
    wait for their held drains. Once overdue the drain thread starts a held drain
    itself. And a step some rank could not write (not committed, drainable) is never
    held, on any rank: a rank whose write failed waits for that drain in its next save."""
    state = {"model": {"w": torch.full((4096,), 2.0)}, "train_state": {"step": 0}}
    s = TierSettings(local_root=str(tmp_path / "local"), pfs_folder=str(tmp_path / "pfs"), local_interval=1,
                     pfs_interval=2, local_keep=2, pfs_keep=3, rank=0, world_size=1, first_on_node=True,
                     job_id="J", drain_start="next_step")
    ckpt = TieredCheckpointer(s, lambda: state, EventLog(None))
    ckpt.drain._overdue_s = lambda: 0.2
    vote = ckpt.votes.vote

    def another_rank_failed(flags, step, *rest):
        (committed, drainable), done = vote(flags, step, *rest)
        return (committed and step != 4, drainable), done
    ckpt.votes.vote = another_rank_failed
    try:
        ckpt.save(2)  # and no save after it
        deadline = time.monotonic() + 20
        while ckpt.stats.drains < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ckpt.pfs.steps() == [2], "a held drain waited for a boundary that never came"
        ckpt.drain._overdue_s = lambda: 60.0
        state["model"]["w"].fill_(4)
        ckpt.save(4)
        ckpt._write_q.join()  # step 4 is not committed (as voted) but drainable: started at once
        assert not ckpt.drain._held and 4 not in ckpt.local.committed_steps()
        ckpt.drain._q.join()
        assert ckpt.pfs.steps() == [2, 4]
    finally:
        ckpt.close()


def test_a_pfs_step_whose_local_write_failed_drains_at_once_so_the_next_save_does_not_hang(
        pg, tmp_path, monkeypatch):
    """drain_start = "next_step", and PFS step 2's local write fails (a full disk): its
    staged bytes are its only copy, so step 3's save waits for its drain. Step 2's vote
    ends only once step 3's save has passed its boundary: a drain held to a boundary
    would then never start, and that save would wait forever. It drains at once, from
    the staged bytes."""
    monkeypatch.setenv(faults.ENV, "enospc_local_write@2")
    state = {"model": {"w": torch.zeros(4096)}, "train_state": {"step": 0}}
    s = TierSettings(local_root=str(tmp_path / "local"), pfs_folder=str(tmp_path / "pfs"), local_interval=1,
                     pfs_interval=2, local_keep=2, pfs_keep=3, rank=0, world_size=1, first_on_node=True,
                     job_id="J", drain_start="next_step")
    ckpt = TieredCheckpointer(s, lambda: state, EventLog(None))
    passed = threading.Event()
    boundary, vote = ckpt._step_boundary, ckpt.votes.vote

    def boundary_then(step):
        boundary(step)
        if step == 3:
            passed.set()

    waited = []

    def late_vote(flags, step, *rest):
        if step == 2:
            waited.append(passed.wait(10))
        return vote(flags, step, *rest)
    ckpt._step_boundary, ckpt.votes.vote = boundary_then, late_vote
    ckpt.drain._overdue_s = lambda: 60.0  # no late start by the drain thread here
    for step in (1, 2):
        state["model"]["w"].fill_(step)
        ckpt.save(step)
    third = threading.Thread(target=ckpt.save, args=(3,), daemon=True)
    third.start()
    third.join(20)
    if third.is_alive():
        pytest.fail("step 3's save waited forever for a drain held to a boundary it had passed")
    ckpt.close()
    assert waited == [True], "step 2's vote did not wait for step 3's boundary: the hang was not tested"
    assert ckpt.stats.failed_saves == 1 and ckpt.pfs.steps() == [2]
    back = {"model": {"w": torch.empty(4096)}}
    dcp.load(back, checkpoint_id=str(tmp_path / "pfs" / "step-2"), process_group=pg)
    assert torch.equal(back["model"]["w"], torch.full((4096,), 2.0))


def test_load_step_loads_that_step_from_the_tier_holding_it_and_the_steps_after_it_go(pg, tmp_path):
    """torchtitan's load_step with the tiers on: step 5 from the local tier (stock torchtitan
    would find no step-5 on the PFS), step 2 from the PFS, a step no tier holds refused with
    the steps there are. After resuming at 4, the local steps after it are removed and the
    PFS ones set aside: the new run's steps are kept by retention and loaded next."""
    from titan_ckpt_plus.adapters.torchtitan_v022 import refuse_a_missing_load_step

    state = {"model": {"w": torch.zeros(4096)}, "train_state": {"step": 0}}

    def engine():
        s = TierSettings(local_root=str(tmp_path / "local"), pfs_folder=str(tmp_path / "pfs"),
                         local_interval=1, pfs_interval=2, local_keep=3, pfs_keep=3, rank=0, world_size=1,
                         first_on_node=True, job_id="J", layout_tags=[{"world_size": 1}])
        return TieredCheckpointer(s, lambda: state, EventLog(None))

    def run(ckpt, steps, tag):
        for step in steps:
            state["model"]["w"].fill_(step + tag)
            state["train_state"]["step"] = step
            ckpt.save(step)
            ckpt.flush()

    ckpt = engine()
    run(ckpt, range(1, 7), 0)
    ckpt.close()
    ckpt = engine()
    try:
        assert (ckpt.local.committed_steps(), ckpt.pfs.steps()) == ([4, 5, 6], [2, 4, 6])
        rec = ckpt.recover(only_step=5)
        assert (rec.tier, rec.step, rec.state["model"]["w"][0].item()) == ("local", 5, 5.0)
        assert (ckpt.recover(only_step=2).tier, ckpt.recover(only_step=-1).step) == ("pfs", 6)
        rec = ckpt.recover(only_step=3)
        assert (rec.tier, rec.skipped, rec.steps_found) == (None, [], [2, 4, 5, 6])
        with pytest.raises(FileNotFoundError, match=r"load_step = 3: step 3 is held by neither .*\[2, 4, 5, 6\]"):
            refuse_a_missing_load_step(3, rec)
        def read_only(step):
            raise PermissionError(13, "Read-only file system")
        ckpt.pfs.set_aside_after = read_only  # a later restart would load what it could not move: refused
        with pytest.raises(RuntimeError, match=r"could not set aside the PFS steps newer than step 4: .*Fix: make"):
            ckpt.resumed_at(4)
        del ckpt.pfs.set_aside_after
        ckpt.resumed_at(4)
        assert (ckpt.local.steps(), ckpt.pfs.steps()) == ([4], [2, 4])
        assert os.listdir(tmp_path / "pfs" / "set_aside" / "after_step_4") == ["step-6"]
        run(ckpt, (5, 6, 7), 100)  # the new run, past the steps it left
        assert (ckpt.local.committed_steps(), ckpt.pfs.steps()) == ([5, 6, 7], [2, 4, 6])
    finally:
        ckpt.close()
    ckpt = engine()
    try:
        rec = ckpt.recover()
        assert (rec.tier, rec.step, rec.state["model"]["w"][0].item()) == ("local", 7, 107.0)
        assert ckpt.recover(only_step=6).state["model"]["w"][0].item() == 106.0
    finally:
        ckpt.close()


def _gather_rank(rank: int, store_path: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        small = {"rank": rank, "written": {f"__{rank}_0.distcp": {"size": 10 + rank, "crc32c": rank}}}
        large = "x" * (pfs_mod.FRAME * rank)  # rank 1's does not fit its frame
        got = [pfs_mod.gather(small, None), pfs_mod.gather(large, None), pfs_mod.agree("" if rank else "bad", None),
               pfs_mod._frames.get(None), pfs_mod.gather(large, None)]  # the frame grew: it fits now
    finally:
        dist.destroy_process_group()
    with open(f"{out}.{rank}", "wb") as f:
        pickle.dump(got, f)


def test_gather_is_all_gather_object_in_one_collective_and_falls_back_for_a_large_object(tmp_path):
    """The drain's gather of each rank's files (pfs.gather): every rank gets every
    rank's object in rank order; where one rank's does not fit its frame, every rank
    falls back to all_gather_object together (else the group would hang), and the
    group's frame grows alike on every rank, so the next such gather fits."""
    ctx = mp.get_context("spawn")
    out = str(tmp_path / "out")
    procs = [ctx.Process(target=_gather_rank, args=(r, str(tmp_path / "store"), out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    for r in (0, 1):
        with open(f"{out}.{r}", "rb") as f:
            small, large, agreed, frame, again = pickle.load(f)
        assert [o["written"] for o in small] == [{"__0_0.distcp": {"size": 10, "crc32c": 0}},
                                                 {"__1_0.distcp": {"size": 11, "crc32c": 1}}]
        assert large == again == ["", "x" * pfs_mod.FRAME] and agreed == "rank 0: bad"
        assert frame == 2 * pfs_mod.FRAME  # the same on both ranks, large enough for rank 1's
