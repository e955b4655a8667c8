"""A local step of another parallel layout loaded through DCP (tiers/reshard.py): two
gloo ranks save FSDP-style shards into one node folder, a process of another world
size loads them resharded, with no PFS step."""

import multiprocessing as mp
import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_ckpt_plus import recovery, staging
from titan_ckpt_plus.inspect import verify_local_step
from titan_ckpt_plus.tiers import files, reshard
from titan_ckpt_plus.tiers.local import COMMIT, LocalTier

STEP = 6


def _full(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(6, 4, generator=g), "u": torch.randn(5, 3, generator=g),  # 5 rows: uneven
            "bias": torch.randn(4, generator=g).to(torch.bfloat16), "exp_avg": torch.randn(6, 4, generator=g)}


def _state(mesh, rank: int) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    f = _full()
    return {"model": {"w": distribute_tensor(f["w"], mesh, [Shard(0)]),
                      "u": distribute_tensor(f["u"], mesh, [Shard(0)]), "bias": f["bias"]},
            "optimizer": {"state": {"w": {"exp_avg": distribute_tensor(f["exp_avg"], mesh, [Shard(0)]),
                                          "step": torch.tensor(7.0)}},
                          "param_groups": [{"lr": 1e-3, "params": ["w"]}]},
            "train_state": {"step": STEP, "ntokens_seen": 4096},
            "dataloader": {f"dp_rank_{rank}": pickle.dumps({"rank": rank}), "world_size": 2}}


def _write_part(state: dict, root: str, rank: int, world: int) -> LocalTier:
    """The rank's part of STEP in the shared node folder, its chunks recorded as the copy
    thread records them."""
    layout, tensors, specs = staging.plan_layout(state)
    layout.chunks = staging.chunk_table(layout, specs)
    assert layout.chunks is not None
    buf = staging.HostBuffer(pin=False)
    buf.copy_in(layout, tensors)
    local = LocalTier(root, rank, world, rank == 0, 3, job_id="J")
    local.write_part(STEP, buf.data[: layout.total_bytes].numpy(), lambda: (layout.to_bytes(), {"layout_tag": {}}))
    return local


def _save_rank(rank: int, store: str, root: str, dcp_dir: str) -> None:
    """One old rank: its part of STEP in the shared node folder, and DCP's own save of
    the same state beside it."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        state = _state(init_device_mesh("cpu", (2,)), rank)
        local = _write_part(state, root, rank, 2)
        dcp.save(state, checkpoint_id=dcp_dir)
        dist.barrier()
        if rank == 0:
            local.commit(STEP, {"world_size": 2})
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_step(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshard")
    root, dcp_dir = str(tmp / "local" / "job-J"), str(tmp / "dcp")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_save_rank, args=(r, str(tmp / "store"), root, dcp_dir), daemon=True)
             for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    return root, dcp_dir


def _target(dp_rank: int = 0) -> dict:
    z = {k: torch.zeros_like(v) for k, v in _full().items()}
    return {"model": {"w": z["w"], "u": z["u"], "bias": z["bias"]},
            "optimizer": {"state": {"w": {"exp_avg": z["exp_avg"], "step": torch.tensor(0.0)}},
                          "param_groups": [{"lr": 0.0, "params": ["w"]}]},
            "train_state": {"step": 0, "ntokens_seen": 0},
            "dataloader": {f"dp_rank_{dp_rank}": b"", "world_size": 0}}


def test_the_parts_metadata_is_dcps_own_for_the_same_state(two_rank_step):
    root, dcp_dir = two_rank_step
    reader, _ = reshard.open_step(LocalTier(root, 0, 1, True, 3, job_id="J"), STEP, 2)
    ours, theirs = reader.metadata, FileSystemReader(dcp_dir).read_metadata()
    assert set(ours.state_dict_metadata) == set(theirs.state_dict_metadata)
    for fqn, md in theirs.state_dict_metadata.items():
        mine = ours.state_dict_metadata[fqn]
        assert type(mine) is type(md), fqn
        if isinstance(md, TensorStorageMetadata):
            assert (mine.size, mine.properties.dtype) == (md.size, md.properties.dtype), fqn
            assert sorted((c.offsets, c.sizes) for c in mine.chunks) == sorted(
                (c.offsets, c.sizes) for c in md.chunks), fqn


def test_a_world_size_1_job_loads_the_two_ranks_step_resharded(two_rank_step):
    root, _ = two_rank_step
    local = LocalTier(root, 0, 1, True, 3, job_id="J")
    other = local.other_layout_steps(local.held_parts([{"world_size": 1}]), [{"world_size": 1}])
    assert local.other_layout_parts(other) == {STEP: (2, [0, 1])}
    reader, checked = reshard.open_step(local, STEP, 2)
    sizes = [os.path.getsize(os.path.join(root, f"step-{STEP}", f"rank-0000{r}.{x}"))
             for r in (0, 1) for x in ("data", "layout")]
    assert checked == sum(sizes)  # every part read once to check it
    state = _target()
    nbytes = reader.load(state)
    f = _full()
    for got, want in ((state["model"]["w"], f["w"]), (state["model"]["u"], f["u"]),
                      (state["model"]["bias"], f["bias"]),
                      (state["optimizer"]["state"]["w"]["exp_avg"], f["exp_avg"])):
        assert torch.equal(got, want) and got.dtype == want.dtype
    assert state["optimizer"]["state"]["w"]["step"].item() == 7.0
    assert state["optimizer"]["param_groups"][0]["lr"] == 1e-3
    assert state["train_state"] == {"step": STEP, "ntokens_seen": 4096}
    assert pickle.loads(state["dataloader"]["dp_rank_0"]) == {"rank": 0}
    assert 0 < nbytes < sum(sizes)


def test_a_part_that_fails_its_checksum_or_lacks_its_offsets_is_never_loaded(two_rank_step, tmp_path):
    import shutil

    root = str(tmp_path / "job-J")
    shutil.copytree(two_rank_step[0], root)
    local = LocalTier(root, 0, 1, True, 3, job_id="J")
    data = os.path.join(root, f"step-{STEP}", "rank-00001.data")
    with open(data, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(files.CorruptCheckpoint, match="rank-00001.data"):
        reshard.open_step(local, STEP, 2)
    # two ranks sharing the node folder check its data files once between them
    with pytest.raises(files.CorruptCheckpoint, match="rank-00001.data"):
        reshard.open_step(local, STEP, 2, share=(1, 2))
    _, nbytes = reshard.open_step(local, STEP, 2, share=(0, 2))  # rank 0's data only: not this flip
    layouts = sum(os.path.getsize(os.path.join(root, f"step-{STEP}", f"rank-0000{r}.layout")) for r in (0, 1))
    assert nbytes == layouts + os.path.getsize(os.path.join(root, f"step-{STEP}", "rank-00000.data"))
    layout = staging.StateLayout.from_bytes(local.checked_part_files(STEP, 0)[0])
    layout.chunks = None  # a part written before the offsets were recorded
    with pytest.raises(files.CorruptCheckpoint, match="no shard offsets"):
        reshard.step_metadata({0: layout})


def _load_as_rank_1_of_2(root: str, out: str) -> None:
    """Rank 1 of a 2-rank job (a fake process group: its shards, no peer; DCP without
    collectives) loads the step, the folder holding both parts or lacking rank 0's
    data: what its reads ask the fetch for, and what they load."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        got = {}
        for lacking in ((), (0,)):
            target = _state(init_device_mesh("cpu", (2,)), 1)
            for v in (target["model"]["w"], target["model"]["u"], target["optimizer"]["state"]["w"]["exp_avg"]):
                v.to_local().zero_()
            target["model"]["bias"] = torch.zeros_like(target["model"]["bias"])
            reader, _ = reshard.open_step(LocalTier(root, 1, 2, False, 3, job_id="J"), STEP, 2, lacking=lacking)
            asked = []
            reader.fetch = lambda read: asked.append(sorted(read)) or ""
            reader.load(target, no_dist=True)
            full = _full()
            got[str(lacking)] = {"asked": asked, "w": torch.equal(target["model"]["w"].to_local(), full["w"][3:]),
                                 "u": torch.equal(target["model"]["u"].to_local(), full["u"][3:]),
                                 "bias": torch.equal(target["model"]["bias"], full["bias"])}
        reader, _ = reshard.open_step(LocalTier(root, 1, 2, False, 3, job_id="J"), STEP, 2, lacking=(0,))
        reader.fetch = lambda read: "rank 0 had no part to send"
        try:
            reader.load(_state(init_device_mesh("cpu", (2,)), 1), no_dist=True)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            got["failed"] = (type(e).__name__, reader.wrote, "no part to send" in str(e))
        with open(out, "wb") as f:
            pickle.dump(got, f)
    finally:
        dist.destroy_process_group()


def test_a_rank_fetches_only_the_parts_its_shards_overlap_and_a_replicated_item_from_a_held_one(
        two_rank_step, tmp_path):
    """What a reshard fetches is what DCP's own load plan reads: rank 1 of 2 reads its
    shards from part 1; the replicated bias (in both parts) from part 0 where the folder
    holds it, from part 1 where it lacks part 0's data; a failed fetch fails the load
    before anything is written into the state."""
    out = str(tmp_path / "read.pkl")
    p = mp.get_context("spawn").Process(target=_load_as_rank_1_of_2, args=(two_rank_step[0], out))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    with open(out, "rb") as f:
        got = pickle.load(f)
    loaded = {"w": True, "u": True, "bias": True}
    assert got["()"] == {"asked": [[0, 1]], **loaded} and got["(0,)"] == {"asked": [[1]], **loaded}
    assert got["failed"] == ("CheckpointException", False, True)


def test_a_step_is_a_reshard_candidate_where_every_part_is_held_on_some_node():
    """Ranks 0-1 on node 0, 2-3 on node 1 (first ranks 0 and 2); a folder lacking a part
    gets it from a node holding it; a part held nowhere, or two world sizes for one
    step, leave the step out."""
    nodes = [0, 0, 2, 2]
    whole = {6: (2, [0, 1])}
    assert recovery.reshard_plans([whole] * 4, nodes) == {6: (2, [])}
    halves = [{6: (4, [0, 1]), 4: (4, [0, 1, 2])}] * 2 + [{6: (4, [2, 3]), 4: (4, [0])}] * 2
    assert recovery.reshard_plans(halves, nodes) == {
        6: (4, [((2,), 0, 2), ((2,), 0, 3), ((0,), 2, 0), ((0,), 2, 1)])}
    fresh = [{6: (2, [0, 1])}] * 2 + [{}] * 2  # node 1's folder is new: it gets every part
    assert recovery.reshard_plans(fresh, nodes) == {6: (2, [((0,), 2, 0), ((0,), 2, 1)])}
    # node 1 holds step 6 in this layout (it saved it again): never overwritten by a fetch
    assert recovery.reshard_plans(fresh, nodes, skip={6}) == {}
    assert recovery.reshard_plans([{6: (2, [0, 1])}] * 2 + [{6: (4, [0])}] * 2, nodes) == {}
    # newest first; at one step a local part of this layout, then a reshard, then the PFS
    assert recovery.ordered_candidates([{4: [0]}], [6, 4], {6: 2, 4: 2}) == [
        ("reshard", 6), ("pfs", 6), ("local", 4), ("reshard", 4), ("pfs", 4)]


def test_fetches_are_spread_over_the_holders_and_paired_in_rounds():
    """A 4-node job (node k holds part k and a replica of part k - 1) back on 3 nodes:
    each node lacks 2 parts. Taking each from its first holder, node 0 would send 3 of
    the 6 one after another; spread, each node sends 2. Then the order every rank walks
    puts a transfer between free nodes beside the one before it: node 2 need not wait
    for node 0's send to node 1 before it gets part 7 from node 3."""
    have = [{6: (4, [0, 3])}, {6: (4, [1, 0])}, {6: (4, [2, 1])}]
    _, plan = recovery.reshard_plans(have, [0, 1, 2])[6]
    assert plan == [((1, 2), 0, 1), ((2,), 0, 2), ((2,), 1, 2), ((0,), 1, 3), ((0, 1), 2, 0), ((0,), 2, 3)]
    order = recovery.fetch_order(plan)
    assert sorted(order, key=lambda m: m[1:]) == [(1, 0, 1), (2, 0, 2), (2, 1, 2), (0, 1, 3), (1, 2, 0), (0, 2, 3)]
    assert sorted(h for h, _, _ in order) == [0, 0, 1, 1, 2, 2]  # node 0 sent 3 from the first holder
    assert recovery.fetch_order([((0,), 1, 5), ((0,), 2, 6), ((3,), 2, 7)]) == [(0, 1, 5), (3, 2, 7), (0, 2, 6)]
    assert recovery.fetch_order([]) == []


def test_a_missing_part_or_another_jobs_is_not_counted_as_held(two_rank_step, tmp_path):
    import shutil

    root = str(tmp_path / "job-J")
    shutil.copytree(two_rank_step[0], root)
    local = LocalTier(root, 0, 1, True, 3, job_id="J")
    assert local.other_layout_parts([STEP]) == {STEP: (2, [0, 1])}
    assert LocalTier(root, 0, 1, True, 3, job_id="K").other_layout_parts([STEP]) == {STEP: (2, [])}
    os.remove(os.path.join(root, f"step-{STEP}", "rank-00001.json"))
    assert local.other_layout_parts([STEP]) == {STEP: (2, [0])}
    assert os.path.isfile(os.path.join(root, f"step-{STEP}", COMMIT))


@pytest.fixture
def one_rank_pg():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_recovery_loads_it_and_skips_it_where_dcp_cannot_read_it(two_rank_step, one_rank_pg, tmp_path):
    """The engine's recover() at world size 1 over the two ranks' step: loaded by the
    caller's dcp.load; a DCP failure skips the step, logged, instead of ending the job;
    any other error of the job's own state is raised as it is."""
    import shutil

    from torch.distributed.checkpoint.api import CheckpointException

    from titan_ckpt_plus.checkpointer import TieredCheckpointer, TierSettings
    from titan_ckpt_plus.telemetry import EventLog

    root = str(tmp_path / "job-J")
    shutil.copytree(two_rank_step[0], root)
    s = TierSettings(local_root=root, pfs_folder=str(tmp_path / "pfs"), local_interval=1, pfs_interval=1,
                     local_keep=3, pfs_keep=2, rank=0, world_size=1, first_on_node=True, job_id="J")
    ckpt = TieredCheckpointer(s, lambda: {}, EventLog(None))
    try:
        state = _target()
        rec = ckpt.recover(lambda reader: reader.load(state))
        assert (rec.tier, rec.step, rec.resharded_from, rec.skipped) == ("local", STEP, 2, [])
        assert torch.equal(state["model"]["u"], _full()["u"]) and rec.bytes_total["local"] > 0

        def unreadable(reader):
            raise CheckpointException("read", {0: (OSError("short read"), None)})
        rec = ckpt.recover(unreadable)
        assert rec.tier is None and [(t, st) for t, st, _ in rec.skipped] == [("local", STEP)]
        assert "loading it resharded failed" in rec.skipped[0][2] and "world size 2" in rec.skipped[0][2]
        assert rec.partly_loaded == -1  # it failed before writing into the state

        def refused(reader):
            raise ValueError("the dataloader refuses DP 2")
        with pytest.raises(ValueError, match="refuses"):
            ckpt.recover(refused)

        def torn_midway(reader):  # a data file cut short after its check: DCP fails midway
            os.truncate(os.path.join(root, f"step-{STEP}", "rank-00001.data"), 64)
            return reader.load(state)
        state = _target()
        rec = ckpt.recover(torn_midway)
        assert rec.tier is None and rec.partly_loaded == STEP
        assert "after writing some of the state" in rec.skipped[0][2]
        assert state["train_state"]["step"] == STEP  # some of it is indeed that step's
        ckpt.s.local_reshard = False  # [checkpoint] local_reshard = false: reported, never tried
        rec = ckpt.recover(unreadable)
        assert rec.tier is None and "only a PFS step reshards" in rec.skipped[0][2]
    finally:
        ckpt.close()


def _old_world_steps(root: str, steps, world: int = 4) -> None:
    """Committed steps of the job's run at `world` ranks: every rank's part files (one
    node folder holding them all: own parts and replicas)."""
    old = LocalTier(root, 0, world, True, 3, job_id="J")
    for s in steps:
        os.makedirs(old.step_dir(s), exist_ok=True)
        for r in range(world):
            for suffix in ("json", "layout", "data"):
                with open(old._part(s, suffix, r), "w") as f:
                    f.write("{}")
        old.commit(s, {"world_size": world})


def test_retention_never_counts_steps_of_another_world_size_and_removes_them_whole(tmp_path):
    """Back at 2 ranks from a PFS step older than the 4-rank run's local steps 950 and
    1000: the job's own new commits are kept (the old steps do not take the keep slots)
    and, once it has one, the old steps go whole, their other ranks' replicas too."""
    root = str(tmp_path / "job-J")
    _old_world_steps(root, (900, 950, 1000))
    local = LocalTier(root, 0, 2, True, 2, job_id="J")
    assert local.old_run_steps() == [900, 950, 1000]
    for step in (550, 600):
        os.makedirs(local.step_dir(step), exist_ok=True)
        local.commit(step, {"world_size": 2})
        local.purge(set(), committed_now=step)
    assert local.steps() == [550, 600]


def _tagged_step(root: str, step: int, tag: dict) -> LocalTier:
    """A committed step of a 2-rank run whose parts record layout `tag`."""
    local = LocalTier(root, 0, 2, True, 2, job_id="J")
    os.makedirs(local.step_dir(step), exist_ok=True)
    for r in (0, 1):
        _write_part({"x": torch.ones(4)}, root, r, 2)
        for suffix in ("json", "layout", "data"):
            os.replace(local._part(STEP, suffix, r), local._part(step, suffix, r))
        m = files.read_json(local._part(step, "json", r))
        files.atomic_write_json(local._part(step, "json", r), dict(m, step=step, layout_tag=tag))
    local.commit(step, {"world_size": 2})
    return local


def test_steps_of_another_layout_at_the_same_world_size_are_marked_the_old_runs_at_recovery(tmp_path):
    """The 2-rank job back at 2 ranks under another sharding: its old steps 400 and 950
    are found to be another layout's (their manifests' layout differs), marked, and take
    none of retention's slots; a step whose parts fit but whose data is short is not
    another layout's (it is this run's, with a bad part); back under the first layout
    before any commit, the marks go."""
    root = str(tmp_path / "job-J")
    for s, tag in ((400, {"m": 1}), (950, {"m": 1}), (300, {"m": 2})):
        old = _tagged_step(root, s, tag)
    for r in (0, 1):
        os.truncate(old._part(300, "data", r), 8)
    tags = [{"m": 2}, {"m": 2}]
    held = old.held_parts(tags)
    assert held == {}  # step 300's data is short: not held, nor another layout's
    other = old.other_layout_steps(held, tags)
    assert other == {400: "saved with another parallel layout", 950: "saved with another parallel layout"}
    old.mark_old_layout(other, held)
    assert old.old_run_steps() == [400, 950]
    assert old.drop_after(500) == [950]
    for step in (550, 600):
        os.makedirs(old.step_dir(step), exist_ok=True)
        old.commit(step, {"world_size": 2})
        old.purge(set(), committed_now=step)
    LocalTier(root, 1, 2, False, 2, job_id="J").purge(set(), committed_now=600)  # rank 1's part of 300
    assert old.steps() == [550, 600]  # the old layout's step 400 took no slot and went whole
    again = _tagged_step(str(tmp_path / "back" / "job-J"), 700, {"m": 1})
    held = again.held_parts(tags)
    again.mark_old_layout(again.other_layout_steps(held, tags), held)
    assert again.old_run_steps() == [700]
    first = [{"m": 1}] * 2  # the first layout again
    held = again.held_parts(first)
    again.mark_old_layout(again.other_layout_steps(held, first), held)
    assert again.old_run_steps() == []


def test_a_restart_removes_the_steps_newer_than_the_step_it_resumed_from(tmp_path):
    """The old run's steps after it, and this layout's too (load_step went back, or they
    failed their checks): the new run saves those numbers again."""
    root = str(tmp_path / "job-J")
    _old_world_steps(root, (400, 950, 1000))
    _old_world_steps(root, (300, 600), world=2)
    assert LocalTier(root, 1, 2, False, 2, job_id="J").drop_after(500) == []  # the first rank's
    local = LocalTier(root, 0, 2, True, 2, job_id="J")
    assert local.drop_after(500) == [600, 950, 1000]
    assert local.steps() == [300, 400]  # older: 400 a fallback until this job commits its own


def test_a_partly_loaded_state_is_loaded_over_whole_or_refused():
    """After a resharded load failed midway, PFS step 0 (the model alone) would leave
    the optimizer partly that step's: refused with the fix; a whole state is not."""
    from titan_ckpt_plus.adapters.torchtitan_v022 import refuse_a_partial_state
    from titan_ckpt_plus.restore import Recovery

    with pytest.raises(RuntimeError, match=r"local step 6 .*local_reshard = false"):
        refuse_a_partial_state(Recovery("pfs", step=0, partly_loaded=6))
    for rec in (Recovery("pfs", step=4, partly_loaded=6), Recovery("local", step=4, partly_loaded=6),
                Recovery("pfs", step=0)):
        refuse_a_partial_state(rec)


def _save_2d_rank(rank: int, store: str, root: str, dcp_dir: str) -> None:
    """One rank of a 2 x 2 FSDP + TP job (torchtitan's 2-D layout): a column-wise TP
    weight under FSDP is a _StridedShard on the DP dim. Its part, DCP's own save, and
    (rank 0) the full tensors to compare with."""
    from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        state = {"model": model.state_dict(), "train_state": {"step": STEP}}
        local = _write_part(state, root, rank, 4)
        dcp.save(state, checkpoint_id=dcp_dir)
        full = {k: v.full_tensor() for k, v in state["model"].items()}
        placements = {k: repr(v.placements) for k, v in state["model"].items()}
        dist.barrier()
        if rank == 0:
            local.commit(STEP, {"world_size": 4})
            torch.save({"full": full, "placements": placements}, os.path.join(dcp_dir, "full.pt"))
    finally:
        dist.destroy_process_group()


def test_a_2d_fsdp_tp_step_with_strided_shards_loads_resharded_at_world_size_1(tmp_path):
    root, dcp_dir = str(tmp_path / "local" / "job-J"), str(tmp_path / "dcp")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_save_2d_rank, args=(r, str(tmp_path / "store"), root, dcp_dir), daemon=True)
             for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        assert p.exitcode == 0
    saved = torch.load(os.path.join(dcp_dir, "full.pt"))
    assert "_StridedShard" in saved["placements"]["0.weight"]  # the case this test is for
    local = LocalTier(root, 0, 1, True, 3, job_id="J")
    reader, _ = reshard.open_step(local, STEP, 4)
    theirs = FileSystemReader(dcp_dir).read_metadata()
    for fqn, md in theirs.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            mine = reader.metadata.state_dict_metadata[fqn]
            assert sorted((c.offsets, c.sizes) for c in mine.chunks) == sorted(
                (c.offsets, c.sizes) for c in md.chunks), fqn
    state = {"model": {k: torch.zeros_like(v) for k, v in saved["full"].items()}, "train_state": {"step": 0}}
    reader.load(state)
    for k, want in saved["full"].items():
        assert torch.equal(state["model"][k], want), k
    assert state["train_state"]["step"] == STEP


def test_a_step_fetched_into_is_removed_whole_as_another_layouts(two_rank_step, tmp_path):
    """adopt_step, before parts are fetched into a folder: a new node's folder gets a
    commit record of the old world size; any folder a marker, so retention removes the
    step whole even at the old world size (a layout change) or after a failed fetch; an
    existing commit record is left as it is."""
    import shutil

    root = str(tmp_path / "job-J")
    local = LocalTier(root, 0, 1, True, 2, job_id="J")
    local.adopt_step(STEP, 2)
    shutil.copy(os.path.join(two_rank_step[0], f"step-{STEP}", "rank-00001.data"), local.step_dir(STEP))  # midway
    assert local.old_run_steps() == [STEP]
    assert local.other_layout_parts([STEP]) == {STEP: (2, [])}
    for suffix in ("json", "layout"):  # rank 0's layout alone (a reshard's first fetch): held by no one
        shutil.copy(os.path.join(two_rank_step[0], f"step-{STEP}", f"rank-00000.{suffix}"), local.step_dir(STEP))
    assert local.other_layout_parts([STEP]) == {STEP: (2, [])}
    checks = {os.path.basename(c.path): c.status for c in verify_local_step(local.step_dir(STEP))}
    assert checks == {"rank-00000": "unverified", "rank-00001.json": "FAILED"}  # the data alone is torn
    os.makedirs(local.step_dir(8))
    local.commit(8, {"world_size": 1})
    assert local.purge(set(), committed_now=8) == [STEP] and local.steps() == [8]
    same = str(tmp_path / "same" / "job-J")  # the old world size, another layout: the node's own commit kept
    shutil.copytree(two_rank_step[0], same)
    before = open(os.path.join(same, f"step-{STEP}", COMMIT)).read()
    at2 = LocalTier(same, 0, 2, True, 2, job_id="J")
    assert at2.old_run_steps() == []
    at2.adopt_step(STEP, 2)
    assert at2.old_run_steps() == [STEP]
    assert open(os.path.join(same, f"step-{STEP}", COMMIT)).read() == before
