"""Which job a checkpoint belongs to (no torch).

A job is its dump folder. At its first start it gets an identity, kept with its
durable state on the PFS side:

    <dump_folder>/titan_ckpt_plus/job.json   {"format", "job_id", "dump_folder", "created_at"}

Every local part, replica, COMMIT marker and PFS manifest the job writes records the
id, and recovery takes only steps that carry it. The node-local folder is shared by
every job scheduled on the node (`/local_nvme/ckpt/{node_rank}`), so each job works
only in its own subfolder of it, `job-<id>/` (tiers/local.py).

An identity is valid only in the dump folder it names, or in that same folder renamed
or seen through another mount (same inode): a copied dump folder is a new job (it must
not write into the original's local subfolders), and a file whose content cannot be
trusted is never guessed at. Either is ignored with one warning and the start gets a
new identity; `[checkpoint] adopt_job` takes an existing one on purpose. A file that
exists but cannot be read right now (an I/O or permission error) is not replaced: the
start is refused, as a new identity would orphan the job's checkpoints.
"""

import json
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field, replace

from titan_ckpt_plus.tiers import files

FORMAT = 1
PLUGIN_DIR = "titan_ckpt_plus"
JOB_FILE = "job.json"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # it names a folder


class IdentityError(ValueError):
    """An identity file that cannot be used; the message says why."""


@dataclass(frozen=True)
class JobIdentity:
    job_id: str
    dump_folder: str  # real path
    created_at: float
    adopted_from: str = ""  # the id this dump folder had before adopt_job, if any
    dump_inode: int = 0  # the dump folder's inode: the same folder renamed keeps it

    def to_json(self) -> dict:
        return dict(asdict(self), format=FORMAT)


def job_file(dump_folder: str) -> str:
    return os.path.join(dump_folder, PLUGIN_DIR, JOB_FILE)


def new_job_id(now: float | None = None) -> str:
    """Sortable by creation time, unique without coordination."""
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}-{secrets.token_hex(4)}"


def valid_job_id(job_id: str) -> bool:
    return isinstance(job_id, str) and bool(_ID.match(job_id))


def parse(raw: bytes) -> JobIdentity:
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise IdentityError(f"not JSON ({e})") from None
    if not isinstance(d, dict):
        raise IdentityError("not a JSON object")
    fmt = d.get("format")
    if not isinstance(fmt, int) or fmt < 1:
        raise IdentityError(f"no valid format field ({fmt!r})")
    if fmt > FORMAT:
        raise IdentityError(f"format {fmt}, newer than this plugin's {FORMAT}")
    job_id, folder, created = d.get("job_id"), d.get("dump_folder"), d.get("created_at")
    if not valid_job_id(job_id):
        raise IdentityError(f"invalid job_id {job_id!r}")
    if not isinstance(folder, str) or not folder:
        raise IdentityError(f"invalid dump_folder {folder!r}")
    if not isinstance(created, (int, float)):
        raise IdentityError(f"invalid created_at {created!r}")
    adopted, inode = d.get("adopted_from", ""), d.get("dump_inode", 0)
    return JobIdentity(job_id, folder, float(created), adopted if isinstance(adopted, str) else "",
                       inode if isinstance(inode, int) else 0)


def read(path: str) -> JobIdentity:
    """IdentityError if its content cannot be used; OSError (FileNotFoundError if
    there is none) if it cannot be read."""
    with open(path, "rb") as f:
        raw = f.read(1 << 16)
    return parse(raw)


def _inode(path: str) -> int:
    try:
        return os.stat(path).st_ino
    except OSError:
        return 0


def _whose(found: JobIdentity, here: str) -> str:
    """"" if `found` is this dump folder's, "moved" if it is this folder under another
    name, else why it is another's."""
    if os.path.realpath(found.dump_folder) == here:
        return ""
    if found.dump_inode and found.dump_inode == _inode(here) and (
            not os.path.isdir(found.dump_folder) or os.path.samefile(found.dump_folder, here)):
        return "moved"
    if os.path.isdir(found.dump_folder):
        return "is another job's dump folder (a copy is a new job)"
    return "no longer exists, and this folder is not it renamed (a copy is a new job)"


@dataclass
class Established:
    """The identity one start runs under, decided on one rank; written by `commit()`
    only once the identity's own checks pass (the PFS folder holds no other job's
    steps), so a start refused for its identity changes nothing."""

    identity: JobIdentity
    write: bool = False  # new, adopted, or replacing an ignored file
    set_aside: str = ""  # the ignored file, moved aside (kept for the user) on commit
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Resolved:
    """Whose identity a dump folder holds now: the one a start there continues."""

    found: JobIdentity | None  # None: a start there gets a new identity
    bad: str = ""  # why the file there was not usable ("" if there is none, or it is)
    moved: str = ""  # the folder was renamed (or is seen through another mount)


def resolve(dump_folder: str) -> Resolved:
    """Raises OSError if the identity file exists but cannot be read. Used by the
    start (establish) and by `titan-ckpt ls`/`clean`, so both apply one rule."""
    path, here = job_file(dump_folder), os.path.realpath(dump_folder)
    try:
        found = read(path)
    except FileNotFoundError:
        return Resolved(None)
    except IdentityError as e:
        return Resolved(None, bad=f"{path}: {e}")
    whose = _whose(found, here)
    if whose == "moved":
        return Resolved(replace(found, dump_folder=here),
                        moved=f"{path} names {found.dump_folder}; this is that folder, now {here}: same job")
    if whose:
        return Resolved(None, bad=f"{path} is job {found.job_id}'s, whose dump folder "
                                  f"{found.dump_folder} {whose}")
    return Resolved(found)


def establish(dump_folder: str, adopt: str = "", now: float | None = None) -> Established:
    """Raises OSError if the identity file exists but cannot be read."""
    now = time.time() if now is None else now
    path, here = job_file(dump_folder), os.path.realpath(dump_folder)
    r = resolve(dump_folder)
    if r.found:
        # An identity written before inodes were recorded gets one now, so a later
        # rename of its dump folder keeps the job's identity too.
        est = Established(r.found, write=bool(r.moved) or not r.found.dump_inode,
                          notes=[r.moved] if r.moved else [])
    else:
        est = Established(JobIdentity(new_job_id(now), here, now), write=True,
                          set_aside=path if r.bad else "")
    if r.bad:
        est.warnings.append(f"ignored {r.bad}; this start has a new job identity, "
                            f"{est.identity.job_id}, and loads none of that job's checkpoints. "
                            "To continue that job here on purpose: [checkpoint] adopt_job = '<its id>'")
    if adopt and est.identity.job_id != adopt:
        before = r.found.job_id if r.found else ""
        est.identity = JobIdentity(adopt, here, now, adopted_from=before)
        est.write = True
        est.notes.append(f"adopt_job = {adopt!r}: this job ({here}) takes job {adopt}'s identity; "
                         "its local steps, replicas and PFS steps here are this job's from now on "
                         "(the job that made them must not be restarted)")
    elif adopt:
        est.notes.append(f"adopt_job = {adopt!r}: already this job's identity")
    return est


def commit(est: Established) -> None:
    """Write the identity (with the dump folder's inode, now that the folder exists)."""
    if not est.write:
        return
    path = job_file(est.identity.dump_folder)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if est.set_aside and os.path.exists(est.set_aside):
        os.replace(est.set_aside, f"{est.set_aside}.ignored-{int(time.time())}")
    est.identity = replace(est.identity, dump_inode=_inode(est.identity.dump_folder))
    files.atomic_write_json(path, est.identity.to_json())
