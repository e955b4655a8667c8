"""The PFS folder's steps as files, no torch: which are complete and whose, where the
spares go, and retention; and the order of a kept plan's drain (copy_once_agreed),
which the byte helper runs whole. PfsTier (pfs.py) adds DCP's side; the byte helper process
runs retention with this alone (issue 15), so a drain's listing, manifest reads and
deletes leave the training process.

    <folder>/step-N/.metadata, __R_0.distcp, titan_ckpt_plus.json   a step (MANIFEST)
    <folder>/full_state/step-N/                                     the last step's full
                                                                    state beside an export
    <folder>/.spare/<job id>/rank-R.distcp                          a purged step's data file
    <folder>/set_aside/after_step_N/step-M/                         a step M > N the job
                                                                    left when it resumed at N
"""

import contextlib
import os
import shutil
from typing import Any

from titan_ckpt_plus.tiers import files

MANIFEST = "titan_ckpt_plus.json"
FULL_STATE = "full_state"
SET_ASIDE = "set_aside"  # no "step-" in the name: neither we nor stock torchtitan list it
HF_INDEX = "model.safetensors.index.json"
DCP_SUFFIX = ".distcp"  # torch.distributed.checkpoint.filesystem.DEFAULT_SUFFIX (a test holds them equal)
_UNREAD = object()  # PfsFolder.is_export: the manifest is not read yet


class NeedsTorch(Exception):
    """A step without our manifest, whose kind only its .metadata (torch's classes) tells."""


class PfsFolder:
    def __init__(self, folder: str, rank: int, world_size: int, keep_latest_k: int,
                 job_id: str = "", reuse_files: bool = True, write_batch=files.write_batch) -> None:
        self.folder = folder
        self.job_id = job_id
        self.rank = rank
        self.world_size = world_size
        self.keep_latest_k = keep_latest_k
        self.reuse_files = reuse_files  # [checkpoint] pfs_reuse_files: see _spare
        self.write_batch = write_batch  # files.write_batch's, or the byte helper's (the drain's channel)

    def _dir(self, step: int, beside_export: bool = False) -> str:
        return os.path.join(self.folder, FULL_STATE if beside_export else "", f"step-{step}")

    def step_dir(self, step: int) -> str:
        """Where step N's full state is: full_state/step-N if written there, else step-N."""
        full = self._dir(step, beside_export=True)
        return full if os.path.isfile(os.path.join(full, ".metadata")) else self._dir(step)

    def export_dir(self, step: int) -> str:
        return self._dir(step)

    def steps(self) -> list[int]:
        """Complete resumable steps (with .metadata, not an export), oldest first."""
        return sorted(self.owners())

    def exports(self) -> list[int]:
        """Steps whose step-N holds a last-step export (DCP or HF), oldest first."""
        if not os.path.isdir(self.folder):
            return []
        return sorted(s for n in os.listdir(self.folder)
                      if (s := files.step_of(n)) is not None and self.is_export(s))

    def is_export(self, step: int, manifest: Any = _UNREAD) -> bool:
        """Whether step-N is a model-only export: our manifest says so; without one (stock
        torchtitan wrote it), an HF export, or a DCP step that has no train_state.
        `manifest`: step-N's as _read_manifest gave it, if read already."""
        path = self._dir(step)
        if manifest is _UNREAD:
            manifest = _read_manifest(path)
        if manifest is not None:
            return isinstance(manifest, dict) and manifest.get("kind") == "export"  # "?": verify() rejects it
        if os.path.isfile(os.path.join(path, HF_INDEX)):
            return True
        keys = self.dcp_keys(path)
        return keys is not None and not any(k == "train_state" or k.startswith("train_state.") for k in keys)

    def dcp_keys(self, path: str) -> list[str] | None:
        """The state's keys in a DCP step's .metadata, None if it cannot be read. Its
        classes are torch's: PfsTier reads it; here, without torch, nothing is decided."""
        raise NeedsTorch(f"{path} has no manifest: whether it is an export needs its .metadata read")

    def owners(self) -> dict[int, str | None]:
        """Complete resumable step -> the job id its manifest records (see _owner_in),
        each manifest read once (retention lists them after every drain)."""
        out = {}
        for s in _complete(self.folder):
            manifest = _read_manifest(self._dir(s))
            if not self.is_export(s, manifest):
                out[s] = _owner_in(manifest)
        full = os.path.join(self.folder, FULL_STATE)
        out.update({s: read_owner(os.path.join(full, f"step-{s}")) for s in _complete(full)})
        return out

    def other_jobs_steps(self) -> dict[int, str]:
        """Complete steps and exports whose manifest names another job. An unreadable
        one ("?") is not counted: recovery's checks skip it, and retention keeps it."""
        owners = self.owners() | {s: read_owner(self._dir(s)) for s in self.exports()}
        return {s: o for s, o in owners.items() if o not in (None, "?", self.job_id)}

    def seal(self, step: int, path: str, data_files: dict, metadata: bytes) -> None:
        """Rank 0: the step's manifest, then its .metadata (`metadata`, the pickled
        Metadata) that makes the step complete (DCP's own rule), both fsync'd before
        either is renamed into place."""
        manifest = {"step": step, "job_id": self.job_id, "kind": "full",
                    "files": {**data_files, ".metadata": files.entry(metadata)}}
        self.write_batch(str(path), [(os.path.join(path, MANIFEST), files.json_bytes(manifest)),
                                     (os.path.join(path, ".metadata"), metadata)])

    def seal_kept(self, gathered: list, step: int, path: str, metadata: bytes, lengths: dict) -> bool:
        """Rank 0 seals a kept plan's step with `metadata`, pickled before the copy, if
        every rank wrote its part (`gathered`: copy_once_agreed's) and each file's small
        items are as long as `lengths` (file -> lengths) says, which is where that
        Metadata puts them. False: not sealed; PfsTier then fails the step or pickles
        where the small items moved."""
        if any(why or any(lengths.get(name, []) != list(got) for name in written)
               for why, written, got in gathered):
            return False
        self.seal(step, path, {k: v for _, written, _ in gathered for k, v in written.items()}, metadata)
        return True

    def purge_outcome(self) -> tuple[str, object]:
        """purge() as an outcome to send back: ("purged", [steps]),
        ("torch", why: a step only torch can tell; the process purges), or ("failed",
        why: warned about; the next drain's retention catches up)."""
        try:
            return "purged", self.purge()
        except NeedsTorch as e:
            return "torch", str(e)
        except OSError as e:
            return "failed", repr(e)

    def purge(self) -> list[int]:
        """Rank 0 keeps the newest `keep_latest_k` complete steps of this job (0 keeps
        all); another job's steps are never deleted."""
        if self.rank != 0 or self.keep_latest_k <= 0:
            return []
        # another job's step, or one whose owner cannot be told: never purged
        mine = sorted(s for s, owner in self.owners().items() if owner in (None, self.job_id))
        old = mine[: -self.keep_latest_k]
        for s in old:
            self._remove(self.step_dir(s))
        return old

    def set_aside_after(self, step: int) -> tuple[list[int], str, int]:
        """Rank 0, after a restart at `step`: this job's steps newer than it (stock
        torchtitan's, without a manifest, too, as retention counts them), the timeline
        the job left, move to set_aside/after_step_N/ (one rename each): a resumable one
        as step-K, an export as export-step-K (a tool taking the newest export would take
        the old timeline's model, and a save of step K would delete it). So no later
        restart loads them in place of the new run's steps and retention keeps the new
        run's, yet nothing is deleted. Returns the steps moved, where, and how many
        times steps were set aside after this step before."""
        if self.rank != 0:
            return [], "", 0
        mine = (None, self.job_id)
        moves = [(self.step_dir(s), f"step-{s}", s) for s, owner in self.owners().items()
                 if s > step and owner in mine]
        moves += [(self._dir(s), f"export-step-{s}", s) for s in self.exports()
                  if s > step and read_owner(self._dir(s)) in mine]
        if not moves:
            return [], "", 0
        aside = os.path.join(self.folder, SET_ASIDE)
        dest, before = os.path.join(aside, f"after_step_{step}"), 0
        while os.path.exists(dest):  # set aside after the same step before
            before += 1
            dest = os.path.join(aside, f"after_step_{step}.{before}")
        os.makedirs(dest)
        made = {dest, aside, self.folder}
        for src, name, _ in moves:
            os.rename(src, os.path.join(dest, name))
            made.add(os.path.dirname(src))
        for d in made:  # the renames and new folders made durable: a crash must not lose a step
            files.fsync_dir(d)
        return sorted({s for _, _, s in moves}), dest, before

    def _remove(self, path: str) -> None:
        """A purged step: its .metadata first (the step is no longer complete, so never
        a candidate, whatever goes wrong next), then its parts (retired as spares), the
        manifest and the folder, by name: a tree walk costs a dozen more system calls,
        after each of which the drain takes the GIL back from training."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(path, ".metadata"))
        if self.reuse_files:
            self._retire_parts(path)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(path, MANIFEST))
        try:
            os.rmdir(path)
        except OSError:  # files of another writer (stock torchtitan's extra files)
            shutil.rmtree(path, ignore_errors=True)

    def _retire_parts(self, path: str) -> None:
        """Each rank's data file of a purged step becomes that rank's spare."""
        for r in range(self.world_size):
            with contextlib.suppress(OSError):  # a rank whose part is missing
                files.retire(os.path.join(path, f"__{r}_0{DCP_SUFFIX}"), self._spare(r))

    def _spare(self, rank: int) -> str | None:
        """Where purge() retires rank R's data file, for R's next drain to write over
        (files.retire): into a new file, 100M's drain spent 0.30 s in the fsync against
        0.20 s, and rank 0's purge 0.32 s deleting against 1 ms (BENCHMARKS.md, overhead).
        The PFS holds one more part per rank at rest, none once the last step is saved
        (release_spares). None with pfs_reuse_files = false."""
        return os.path.join(self._spare_dir, f"rank-{rank:05d}{DCP_SUFFIX}") if self.reuse_files else None

    @property
    def _spare_dir(self) -> str:
        return os.path.join(self.folder, files.SPARE, self.job_id or "_")

    def release_spares(self) -> None:
        """Rank 0, once the job has run its last step: its spares go (a later job makes
        new files). Not after a crash or a preemption: the restart writes over them."""
        if self.rank == 0:
            shutil.rmtree(self._spare_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(self.folder, files.SPARE))


def copy_once_agreed(agree, flags: list[bool], copy, gather, why: str = "", extra=None) -> tuple[list, list | None]:
    """A kept plan's drain of a step, in the order every rank follows (PfsTier.save),
    torch-free so that the byte helper runs it whole, in one request: `agree(flags)`,
    the start agreement (each flag: whether it holds on every rank); then, only if all
    hold, this rank's `copy()` (its files' manifest entries; not tried if `why` says
    why it cannot be) and `gather((why, entries, extra))`, every rank's, which each rank
    reaches even if its copy failed. Returns the agreed flags and the gathered list
    (None: nothing copied)."""
    agreed = agree(flags)
    if not all(agreed):
        return agreed, None
    written = {}
    if not why:
        try:
            written = copy()
        except Exception as e:  # every rank reaches the gather
            why = repr(e)
    return agreed, gather((why, written, extra))


def _complete(folder: str) -> list[int]:
    """Steps of `folder` with a .metadata (DCP wrote it last)."""
    if not os.path.isdir(folder):
        return []
    return [s for n in os.listdir(folder)
            if (s := files.step_of(n)) is not None and os.path.isfile(os.path.join(folder, n, ".metadata"))]


def _read_manifest(path: str) -> dict | str | None:
    """A step folder's manifest; None if it has none, "?" if it is unreadable or not
    a JSON object."""
    try:
        manifest = files.read_json(os.path.join(path, MANIFEST))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return "?"
    return manifest if isinstance(manifest, dict) else "?"


def _owner_in(manifest: dict | str | None) -> str | None:
    """The job id a manifest records; None: none (stock torchtitan's step, one written
    before job identities, or one whose manifest is not written yet); "?": an
    unreadable manifest, which verify() rejects."""
    return manifest.get("job_id") if isinstance(manifest, dict) else manifest


def read_owner(path: str) -> str | None:
    """The job id of a step folder's manifest (_owner_in)."""
    return _owner_in(_read_manifest(path))
