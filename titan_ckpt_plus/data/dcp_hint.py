"""Let the dataloader see which dataloader keys a DCP checkpoint holds before DCP reads it.

DCP plans a load from the keys of the live state dict and fails on any key the
checkpoint lacks. Our loader writes one key ("global_samples"); stock torchtitan
writes "dp_rank_<r>" and "world_size". `install()` wraps
`torch.distributed.checkpoint.load` (called as `dcp.load` by torchtitan's
CheckpointManager and by the plugin's PFS tier): when the state dict being loaded
holds a loader with `expect_checkpoint_keys`, the checkpoint's metadata is read first
and the loader told its keys, so its `state_dict()` takes the checkpoint's shape for
this one load (or raises a clear error before anything is read). Any other load is
passed through untouched.
"""

from __future__ import annotations

import functools
import logging
import os

log = logging.getLogger("titan_ckpt_plus.data")

_MARK = "_titan_ckpt_plus_dataloader_hint"


def _metadata_keys(checkpoint_id, storage_reader) -> set[str] | None:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        if storage_reader is not None:
            path = getattr(storage_reader, "path", None)
            if isinstance(storage_reader, FileSystemReader) and path is not None:
                reader = FileSystemReader(path)
            else:
                reader = storage_reader
        elif checkpoint_id is not None and os.path.isdir(str(checkpoint_id)):
            reader = FileSystemReader(checkpoint_id)
        else:
            return None
        return set(reader.read_metadata().state_dict_metadata)
    except Exception as e:  # no hint: DCP reports whatever is wrong itself
        log.debug(f"[titan_ckpt_plus] could not read checkpoint metadata for the dataloader: {e!r}")
        return None


def hint_loaders(state_dict: dict, checkpoint_id=None, storage_reader=None) -> list:
    """Tell every hint-aware loader in `state_dict` its keys in the checkpoint;
    returns the loaders told (to clear their hint afterwards)."""
    loaders = [(k, v) for k, v in state_dict.items() if hasattr(v, "expect_checkpoint_keys")]
    if not loaders:
        return []
    keys = _metadata_keys(checkpoint_id, storage_reader)
    told = []
    for name, loader in loaders:
        prefix = f"{name}."
        loader.expect_checkpoint_keys(
            None if keys is None else {k[len(prefix):] for k in keys if k.startswith(prefix)})
        told.append(loader)
    return told


def install() -> None:
    """Idempotent."""
    import torch.distributed.checkpoint as dcp

    if getattr(dcp.load, _MARK, False):
        return
    original = dcp.load

    @functools.wraps(original)
    def load(state_dict, *args, checkpoint_id=None, storage_reader=None, **kwargs):
        told = hint_loaders(state_dict, checkpoint_id, storage_reader) if isinstance(state_dict, dict) else []
        try:
            return original(state_dict, *args, checkpoint_id=checkpoint_id,
                            storage_reader=storage_reader, **kwargs)
        finally:
            for loader in told:
                loader.clear_load_hint()

    setattr(load, _MARK, True)
    dcp.load = load
