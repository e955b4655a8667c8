"""Staging, the local tier's files, and recovery ordering (no torchrun)."""

import io
import os

import pytest
import torch

from titan_ckpt_plus import recovery, staging
from titan_ckpt_plus.tiers import files
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


def test_roundtrip_is_bit_exact_and_layout_loads_without_classes():
    state = _state()
    layout, data = _stage(state)
    back = staging.rebuild(staging.StateLayout.from_bytes(layout.to_bytes()), data)
    for key in ("w", "flags", "bf", "empty"):
        assert torch.equal(back[key], state[key]) and back[key].dtype == state[key].dtype
    assert torch.equal(back["optimizer"]["state.w.exp_avg"], state["optimizer"]["state.w.exp_avg"])
    assert back["optimizer"]["betas"] == (0.9, 0.95)
    assert back["dataloader"]["io"] == b"x" and back["train_state"]["step"] == 7


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


def _write(tier, step, state):
    layout, data = _stage(state)
    tier.write_part(step, layout.to_bytes(), data.numpy(), {"layout_tag": {"m": 1}})
    return layout


def test_local_tier_commit_verify_and_detect_flipped_byte(tmp_path):
    tier = LocalTier(str(tmp_path), rank=0, world_size=1, first_on_node=True, keep_latest_k=2)
    _write(tier, 5, _state())
    assert tier.candidates({"m": 1}) == []  # not committed yet
    tier.commit(5, {})
    assert tier.candidates({"m": 1}) == [5] and tier.candidates({"m": 2}) == []
    layout_bytes, data, n = tier.read_part(5)
    assert n == os.path.getsize(tier._part(5, "data")) + len(layout_bytes)
    path = tier._part(5, "data")
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 3] ^= 0x01
    open(path, "wb").write(raw)
    with pytest.raises(files.CorruptCheckpoint, match="crc32"):
        tier.read_part(5)


def test_resaving_a_step_drops_the_old_commit_first(tmp_path):
    tier = LocalTier(str(tmp_path), 0, 1, True, 2)
    _write(tier, 5, _state())
    tier.commit(5, {})
    _write(tier, 5, _state())
    assert not os.path.exists(os.path.join(tier.step_dir(5), COMMIT))


def test_purge_keeps_newest_k_protected_and_in_flight(tmp_path):
    tier = LocalTier(str(tmp_path), 0, 1, True, 2)
    for s in (1, 2, 3, 4):
        _write(tier, s, _state())
        tier.commit(s, {})
    _write(tier, 5, _state())  # being written: no commit yet
    gone = tier.purge(protected={1})
    assert gone == [2] and tier.steps() == [1, 3, 4, 5]


def test_recovery_order_newest_common_local_first():
    reports = [[5, 10, 15], [5, 10]]
    assert recovery.ordered_candidates(reports, [10, 20]) == [
        ("pfs", 20), ("local", 10), ("pfs", 10), ("local", 5)]
    assert recovery.incomplete_local_steps(reports) == {15: [1]}
