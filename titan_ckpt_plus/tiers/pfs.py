"""The persistent tier: torchtitan's own DCP layout on the parallel file system.

    <dump_folder>/<folder>/step-N/.metadata, __R_I.distcp   written by dcp.save
                               titan_ckpt_plus.json          the job's id, size and
                                                             CRC-32C per file

Stock torchtitan loads these steps as they are (it ignores the extra manifest) and
DCP reshards them to another parallel layout. A step without `.metadata` is torn and
never used; one without our manifest (written by stock torchtitan) is used unverified,
as is one whose manifest has no job id (written before job identities); one whose
manifest names another job is never used (`owners()`).
"""

import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from titan_ckpt_plus.tiers import files

MANIFEST = "titan_ckpt_plus.json"


class CountingReader(FileSystemReader):
    """A FileSystemReader that counts the bytes DCP asks it for."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.bytes_read = 0

    def read_data(self, plan, planner):
        for req in plan.items:
            self.bytes_read += self.storage_data[req.storage_index].length
        return super().read_data(plan, planner)


class HookedWriter(FileSystemWriter):
    """torchtitan's default writer (what `checkpoint_id=path` builds), with a hook run
    before this rank's data files are written: the fault injector's way in."""

    def __init__(self, path: str, before_write) -> None:
        super().__init__(path)
        self.before_write = before_write

    def write_data(self, plan, planner):
        self.before_write()
        return super().write_data(plan, planner)


def all_ranks(flags: list[bool], pg) -> list[bool]:
    """Collective: for each flag, whether it holds on every rank."""
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=pg)
    return [bool(v) for v in t.tolist()]


def agree(why: str, pg) -> str:
    """Collective: "" if every rank's check passed, else every failing rank's reason
    (so the log on rank 0 names the file that failed on rank 5)."""
    reasons: list = [None] * dist.get_world_size(pg)
    dist.all_gather_object(reasons, why, group=pg)
    return "; ".join(f"rank {r}: {w}" for r, w in enumerate(reasons) if w)


class PfsTier:
    def __init__(self, folder: str, rank: int, world_size: int, keep_latest_k: int,
                 job_id: str = "") -> None:
        self.folder = folder
        self.job_id = job_id
        self.rank = rank
        self.world_size = world_size
        self.keep_latest_k = keep_latest_k

    def step_dir(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def steps(self) -> list[int]:
        """Complete steps (with .metadata), oldest first."""
        if not os.path.isdir(self.folder):
            return []
        return sorted(
            s for n in os.listdir(self.folder)
            if (s := files.step_of(n)) is not None
            and os.path.isfile(os.path.join(self.folder, n, ".metadata"))
        )

    def save(self, step: int, state: dict, pg, before_write=None) -> int:
        """Collective over `pg`: dcp.save, then the manifest. Returns this rank's bytes."""
        path = self.step_dir(step)
        why = ""
        if self.rank == 0 and os.path.isdir(path):
            owner = self._owner(step)
            if owner not in (None, self.job_id):  # another job writes here: never touch its step
                why = f"{path} exists and belongs to job {owner}; not overwritten"
            else:
                # The same step saved again after a restart: never mix two incarnations'
                # files under one .metadata.
                shutil.rmtree(path)
        why = agree(why, pg)  # also the barrier: no rank writes before the old files are gone
        if why:
            raise files.CorruptCheckpoint(why)
        writer = HookedWriter(path, before_write) if before_write else None
        dcp.save(state, checkpoint_id=path, storage_writer=writer, process_group=pg)
        mine = {}
        for name in sorted(os.listdir(path)):
            if name.startswith(f"__{self.rank}_"):
                size, crc = files.checksum_file(os.path.join(path, name))
                mine[name] = {"size": size, files.SUM: crc}
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=pg)
        if self.rank == 0:
            allfiles = {k: v for part in gathered for k, v in part.items()}
            size, crc = files.checksum_file(os.path.join(path, ".metadata"))
            allfiles[".metadata"] = {"size": size, files.SUM: crc}
            files.atomic_write_json(os.path.join(path, MANIFEST),
                                    {"step": step, "job_id": self.job_id, "files": allfiles})
        return sum(v["size"] for v in mine.values())

    def verify(self, step: int, pg) -> tuple[bool, str]:
        """Collective: each rank checks every world_size-th file of the manifest."""
        path = self.step_dir(step)
        reason = ""
        try:
            manifest = files.read_json(os.path.join(path, MANIFEST))
            if manifest.get("job_id") not in (None, self.job_id):
                raise files.CorruptCheckpoint(f"{path} belongs to job {manifest['job_id']}")
            names = sorted(manifest["files"])
            for name in names[self.rank :: self.world_size]:
                files.check_file(os.path.join(path, name), manifest["files"][name])
        except FileNotFoundError:
            manifest = None  # written by stock torchtitan: nothing to verify against
        except (files.CorruptCheckpoint, OSError, ValueError, KeyError, AttributeError, TypeError) as e:
            reason = str(e)
        reason = agree(reason, pg)
        return not reason, reason

    def owners(self) -> dict[int, str | None]:
        """Complete step -> the job id its manifest records (see _owner)."""
        return {s: self._owner(s) for s in self.steps()}

    def other_jobs_steps(self) -> dict[int, str]:
        """Complete steps whose manifest names another job. An unreadable one ("?")
        is not counted: recovery's checks skip it, and retention keeps it."""
        return {s: o for s, o in self.owners().items() if o not in (None, "?", self.job_id)}

    def _owner(self, step: int) -> str | None:
        """The job id a step's manifest records; None: none (stock torchtitan's step,
        one written before job identities, or one whose manifest is not written yet);
        "?": an unreadable manifest, which verify() rejects."""
        try:
            return files.read_json(os.path.join(self.step_dir(step), MANIFEST)).get("job_id")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, AttributeError):
            return "?"

    def _foreign(self, step: int) -> bool:
        """Another job's step, or one that cannot be told: never overwritten or purged."""
        return self._owner(step) not in (None, self.job_id)

    def load(self, step: int, state: dict) -> int:
        """dcp.load into `state` in place (resharding as needed); returns bytes read."""
        reader = CountingReader(self.step_dir(step))
        dcp.load(state, storage_reader=reader)
        return reader.bytes_read

    def purge(self) -> list[int]:
        """Rank 0 keeps the newest `keep_latest_k` complete steps of this job (0 keeps
        all); another job's steps are never deleted."""
        if self.rank != 0 or self.keep_latest_k <= 0:
            return []
        mine = [s for s in self.steps() if not self._foreign(s)]
        old = mine[: -self.keep_latest_k]
        for s in old:
            shutil.rmtree(self.step_dir(s), ignore_errors=True)
        return old
