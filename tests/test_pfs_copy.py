"""The PFS drain as a copy (issue 15): a local part, already in DCP's per-rank form,
made a DCP step by PartCopyWriter; one rank, no torchrun."""

import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from titan_ckpt_plus import staging
from titan_ckpt_plus.tiers import files
from titan_ckpt_plus.tiers.local import LocalTier
from titan_ckpt_plus.tiers.pfs import MANIFEST, PfsTier


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
        "big": torch.randn(3 << 20, generator=g),  # 12 MiB: the copy crosses read pieces
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


def _drain(pfs, local, step, layout, specs, pg, pieces=None):
    state = staging.rebuild(layout, None, specs)
    return pfs.save(step, state, layout, pieces or local.data_pieces(step), pg)


def _check_equal(back, want):
    assert torch.equal(back["model"]["w"].full_tensor(), want["model"]["w"].full_tensor())
    for a, b in ((back["model"]["bias"], want["model"]["bias"]), (back["mask"], want["mask"]),
                 (back["big"], want["big"]), (back["empty"], want["empty"]),
                 (back["optimizer"]["state"]["w"]["exp_avg"], want["optimizer"]["state"]["w"]["exp_avg"]),
                 (back["optimizer"]["state"]["w"]["step"], want["optimizer"]["state"]["w"]["step"])):
        assert torch.equal(a, b) and a.dtype == b.dtype


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


def test_the_staged_buffer_drains_to_the_same_files_and_the_plan_is_reused(pg, tmp_path):
    """The path taken when the local disk failed: the bytes come from memory. A second
    step of the same layout reuses DCP's cached plan and still loads its own values."""
    local = LocalTier(str(tmp_path / "local"), 0, 1, True, 2, job_id="J")
    pfs = PfsTier(str(tmp_path / "pfs"), 0, 1, 2, job_id="J")
    layout, specs, memory = _stage_and_write(local, 4, _state(4))
    _drain(pfs, local, 4, layout, specs, pg, pieces=files.buffer_chunks(memory.numpy()))
    from_memory = open(tmp_path / "pfs" / "step-4" / "__0_0.distcp", "rb").read()
    _drain(pfs, local, 4, layout, specs, pg)
    assert open(tmp_path / "pfs" / "step-4" / "__0_0.distcp", "rb").read() == from_memory
    state5 = _state(5)
    layout5, specs5, _ = _stage_and_write(local, 5, state5)
    _drain(pfs, local, 5, layout5, specs5, pg)
    back = _zeros_like(_state(9))
    dcp.load(back, checkpoint_id=str(tmp_path / "pfs" / "step-5"), process_group=pg)
    _check_equal(back, state5)
    assert back["train_state"]["step"] == 5


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
