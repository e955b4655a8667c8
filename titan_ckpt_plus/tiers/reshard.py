"""A local step saved under another parallel layout, loaded through DCP.

A job restarted at another world size (a node lost for good) cannot copy a local part
into its state byte for byte: its shards are cut differently. But each part is a DCP
per-rank data file as it stands (staging.py), so DCP can reshard from the parts as it
does from a PFS step, given the step's Metadata: each tensor's global shape, every old
rank's chunk of it, and where that chunk's torch.save frame sits in the old rank's part.
`step_metadata` makes it from the parts' layout files, which record each DTensor
shard's global shape and offset (staging.chunk_table), so no PFS byte is read.
`LocalPartsReader` serves DCP's reads from the node folder, and the small items
(train_state, the dataloader's, the lr scheduler's) from the layouts' skeletons,
serialized as the drain serializes them for the PFS.
"""

import dataclasses
import io
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType

from titan_ckpt_plus import staging
from titan_ckpt_plus.tiers.files import CorruptCheckpoint
from titan_ckpt_plus.tiers.local import part_file
from titan_ckpt_plus.tiers.pfs import SmallItems


def step_metadata(layouts: dict, lacking=()) -> tuple[Metadata, dict[str, bytes]]:
    """(DCP's Metadata for a step's parts, the small items' bytes by item name).
    `layouts`: old rank -> its part's StateLayout (its data file is part_file(rank,
    "data") in the step folder). A chunk held by several parts (a replicated tensor)
    is read from the lowest rank's whose data the folder does not lack (a node reads
    what it holds before it fetches anything); a small item every rank has, from the
    lowest rank's layout, on every node alike."""
    tensors: dict[str, TensorStorageMetadata] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    values: dict = {}
    for rank in sorted(layouts, key=lambda r: (r in lacking, r)):
        layout = layouts[rank]
        if layout.chunks is None:
            raise CorruptCheckpoint(f"rank {rank}'s part records no shard offsets (written by an "
                                    "older version, or a placement DCP cannot describe)")
        flat, paths = flatten_state_dict(staging.rebuild(layout, None))
        index = {e.path: i for i, e in enumerate(layout.entries)}
        for fqn, value in flat.items():
            if not isinstance(value, torch.Tensor):
                if fqn not in values or rank < values[fqn][0]:
                    values[fqn] = (rank, value)
                continue
            i = index[staging.entry_path(paths[fqn])]
            e = layout.entries[i]
            if not e.pre:
                raise CorruptCheckpoint(f"rank {rank}'s part is not in DCP's file form ({fqn} has no frame)")
            size, offset = layout.chunks.get(i, (e.shape, (0,) * len(e.shape)))
            md = tensors.setdefault(fqn, TensorStorageMetadata(
                TensorProperties(dtype=getattr(torch, e.dtype)), torch.Size(size), []))
            if tuple(md.size) != tuple(size) or md.properties.dtype != getattr(torch, e.dtype):
                raise CorruptCheckpoint(f"{fqn}: rank {rank}'s part disagrees on its global shape or dtype")
            key = MetadataIndex(fqn, torch.Size(offset))
            if key not in storage:
                md.chunks.append(ChunkStorageMetadata(torch.Size(offset), torch.Size(e.shape)))
                start, end = e.frame
                storage[key] = _StorageInfo(part_file(rank, "data"), start, end - start)
    small = SmallItems()
    blobs = {fqn: small.serialize(v) for fqn, (_, v) in values.items() if fqn not in tensors}
    state = dict(tensors, **{fqn: BytesStorageMetadata() for fqn in blobs})
    return Metadata(state, storage_data=storage), blobs


class LocalPartsReader(FileSystemReader):
    """DCP's reader over a local step folder of another layout (step_metadata): the
    tensor items from the parts' frames, the small items from memory. Counts the bytes
    it reads, and whether it began writing into the state (DCP loads in place: a
    failure after that leaves the state partly this step's)."""

    def __init__(self, step_dir: str, metadata: Metadata, blobs: dict[str, bytes]) -> None:
        super().__init__(step_dir)
        self.metadata, self.blobs = metadata, blobs
        self.bytes_read = 0
        self.wrote = False
        # Collective, set by the engine where the folder lacks parts: fetch(old ranks
        # this rank reads) brings those parts, returns "" or why not (every rank alike)
        self.fetch: Callable[[set[int]], str] | None = None

    def load(self, state: dict, **kwargs) -> int:
        """dcp.load into `state` in place, resharded to its layout; returns bytes read."""
        dcp.load(state, storage_reader=self, **kwargs)
        return self.bytes_read

    def read_metadata(self, *args, **kwargs) -> Metadata:
        return self.metadata

    def read_data(self, plan, planner):
        """The rank's reads, once the parts among them that the folder lacks are
        fetched: DCP calls this on every rank once every rank's plan is made, so the
        fetch (collective) runs everywhere or nowhere, from the plan DCP itself made."""
        if self.fetch is not None:
            paths = {self.storage_data[i.storage_index].relative_path
                     for i in plan.items if i.type != LoadItemType.BYTE_IO}
            why = self.fetch({int(p[5:-5]) for p in paths})  # part_file(rank, "data")
            self.fetch = None  # a second load reads the same files
            if why:  # DCP raises it on every rank, as any failed read
                raise CorruptCheckpoint(why)
        self.wrote = True  # planning and fetching wrote nothing; from here items land in the state
        tensors = []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(self.blobs[item.storage_index.fqn]))
            else:
                tensors.append(item)
                self.bytes_read += self.storage_data[item.storage_index].length
        return super().read_data(dataclasses.replace(plan, items=tensors), planner)


def open_step(local, step: int, world_size: int, share: tuple[int, int] = (0, 1),
              lacking=()) -> tuple[LocalPartsReader, int]:
    """DCP's reader over `step` of `local` (a LocalTier), saved by `world_size` ranks,
    once every part's layout, and its share of their data files, pass their checksums;
    and the bytes read to check them. `share` (i, n): the ranks sharing a node folder
    check its data files once between them, this rank those of old ranks r % n == i
    (the caller agrees on the outcome); `lacking`: old ranks whose layouts alone the
    folder holds (their data is fetched where read, and checked on arrival). Raises
    CorruptCheckpoint (or OSError) naming the file that failed."""
    layouts, nbytes = {}, 0
    for rank in range(world_size):
        data = rank % share[1] == share[0] and rank not in lacking
        raw, size = local.checked_part_files(step, rank, data=data)
        layouts[rank] = staging.StateLayout.from_bytes(raw)
        nbytes += len(raw) + size
    metadata, blobs = step_metadata(layouts, lacking)
    return LocalPartsReader(local.step_dir(step), metadata, blobs), nbytes
