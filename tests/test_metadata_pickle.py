"""The .metadata of a kept plan's later steps: pickled piece by piece, read back as the
same Metadata by plain pickle (what DCP's FileSystemReader uses)."""

import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import StorageMeta

from titan_ckpt_plus.tiers import metadata_pickle
from titan_ckpt_plus.tiers.metadata_pickle import MetadataPickle


def _metadata(tmp_path):
    state = {"model": {f"layer{i}.w": torch.randn(3, 2) for i in range(20)},
             "optimizer": {"param_groups": [{"lr": 1e-3, "params": ["a", "b"]}]},
             "train_state": {"step": 4}}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    return FileSystemReader(str(tmp_path)).read_metadata()


def test_each_step_reads_back_as_its_metadata_and_only_what_changed_is_pickled_again(tmp_path, monkeypatch):
    md = _metadata(tmp_path / "ckpt")
    pickler, bodies = MetadataPickle(), []
    real_body = metadata_pickle._body
    monkeypatch.setattr(metadata_pickle, "_body", lambda obj: (bodies.append(type(obj).__name__), real_body(obj))[1])
    for step in (6, 12, 18):
        md.storage_meta = StorageMeta(checkpoint_id=str(tmp_path / f"step-{step}"), save_id=f"id-{step}")
        bodies.clear()
        data = pickler.dumps(md)
        back = pickle.loads(data)
        assert back == md and back.storage_meta.checkpoint_id.endswith(f"step-{step}")
        assert type(back) is type(md) and list(vars(back)) == list(vars(md))
        if step > 6:  # the field's name and its value, nothing else
            assert bodies == ["str", "StorageMeta"]
    # a small item moved in place: storage_data is pickled again once told
    index = next(i for i in md.storage_data if i.fqn == "train_state.step")
    info = md.storage_data[index]
    md.storage_data[index] = _StorageInfo(info.relative_path, info.offset + 64, info.length)
    pickler.changed("storage_data")
    bodies.clear()
    back = pickle.loads(pickler.dumps(md))
    assert back.storage_data[index].offset == info.offset + 64 and back == md
    assert bodies == ["str", "dict"]


class _Custom:
    def __init__(self, v):
        self.v = v

    def __reduce__(self):
        return (_Custom, (self.v,))

    def __eq__(self, other):
        return isinstance(other, _Custom) and other.v == self.v


def test_an_object_not_pickled_the_plain_way_is_pickled_whole():
    pickler = MetadataPickle()
    obj = _Custom([1, 2, 3])
    assert pickler.dumps(obj) == pickle.dumps(obj) and pickle.loads(pickler.dumps(obj)) == obj
