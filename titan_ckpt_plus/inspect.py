"""Read a run's checkpoint folders without torch: what `titan-ckpt ls`, `verify` and
`clean` show.

Layouts (see tiers/local.py and tiers/pfs.py, which write them):

    <local_root>/step-N/rank-R.{data,layout,json} [+ COMMIT.json]      one root per node
    <node_folder>/job-<id>/JOB.json, .lock, step-N/...   a local root is a job's subfolder
    <dump_folder>/<folder>/step-N/.metadata, __R_I.distcp [+ titan_ckpt_plus.json]
    <dump_folder>/titan_ckpt_plus/events.jsonl, local_roots.json

tiers/pfs.py imports torch, so its manifest name and format are restated here.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

from titan_ckpt_plus import identity
from titan_ckpt_plus.tiers import files
from titan_ckpt_plus.tiers.files import human_bytes
from titan_ckpt_plus.tiers.local import COMMIT, FETCHED, JOB_PREFIX, JOB_RECORD, LOCK, NodeJob, node_jobs, tree_size
from titan_ckpt_plus.tiers.pfs_folder import FULL_STATE, HF_INDEX, MANIFEST, SET_ASIDE

PFS_MANIFEST = MANIFEST  # {"step", "files": {name: {size, crc32c}}}
PFS_METADATA = ".metadata"
PLUGIN_DIR = identity.PLUGIN_DIR
EVENTS = "events.jsonl"
LOCAL_ROOTS = "local_roots.json"
_PART = re.compile(r"^rank-(\d+)\.(json|data|layout)$")


# ---- discovery --------------------------------------------------------------


def events_path(run_dir: str) -> str:
    """The events file of a run given its dump folder, its titan_ckpt_plus folder or the file."""
    if os.path.isfile(run_dir):
        return run_dir
    if os.path.basename(os.path.normpath(run_dir)) == PLUGIN_DIR:
        return os.path.join(run_dir, EVENTS)
    return os.path.join(run_dir, PLUGIN_DIR, EVENTS)


def read_events(run_dir: str) -> list[dict]:
    from titan_ckpt_plus.telemetry import read_events as _read

    return _read(events_path(run_dir))


def recorded_roots(dump_folder: str) -> list[str]:
    """The plugin's local_roots.json: every node's local root (one per node)."""
    try:
        recorded = files.read_json(os.path.join(dump_folder, PLUGIN_DIR, LOCAL_ROOTS))
        return [os.path.normpath(r) for r in recorded if isinstance(r, str)]
    except (OSError, ValueError, TypeError):
        return []


def local_roots(dump_folder: str, extra: list[str] | None = None) -> list[tuple[str, str]]:
    """(root, where it came from), deduplicated, in order: explicit roots, the plugin's
    local_roots.json, then any `local_root(s)` field of an event record."""
    found: list[tuple[str, str]] = [(os.path.abspath(r), "--local-root") for r in extra or []]
    found += [(r, LOCAL_ROOTS) for r in recorded_roots(dump_folder)]
    for e in read_events(dump_folder):
        for r in ([e["local_root"]] if isinstance(e.get("local_root"), str) else []) + list(
                e.get("local_roots") or []):
            found.append((r, EVENTS))
    seen, out = set(), []
    for root, src in found:
        key = os.path.normpath(root)
        if key not in seen:
            seen.add(key)
            out.append((key, src))
    return out


def _step_dirs(folder: str) -> list[tuple[int, str]]:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted((s, os.path.join(folder, n)) for n in names
                  if (s := files.step_of(n)) is not None and os.path.isdir(os.path.join(folder, n)))


def step_kind(step_dir: str) -> str:
    """"local", "pfs" or "" (nothing that tells) for a step-N folder."""
    try:
        names = os.listdir(step_dir)
    except OSError:
        return ""
    if COMMIT in names or any(_PART.match(n) for n in names):
        return "local"
    if PFS_MANIFEST in names or PFS_METADATA in names or any(n.endswith(".distcp") for n in names):
        return "pfs"
    return ""


def pfs_folders(dump_folder: str) -> list[str]:
    """Folders directly under the dump folder that hold PFS (DCP) steps, with their
    full_state/; torchtitan's `[checkpoint] folder` is configurable, so any child with
    such steps counts."""
    out, dump_folder = [], os.path.abspath(dump_folder)
    for name in sorted(os.listdir(dump_folder)) if os.path.isdir(dump_folder) else []:
        path = os.path.join(dump_folder, name)
        if name != PLUGIN_DIR and any(step_kind(d) == "pfs" for _, d in _step_dirs(path)):
            out += _and_full_state(path)
    return out


def _and_full_state(folder: str) -> list[str]:
    """A PFS folder and, if there, its full_state/ (the last steps' full state, beside
    their exports)."""
    full = os.path.join(folder, FULL_STATE)
    return [folder, full] if os.path.isdir(full) else [folder]


# ---- ls -------------------------------------------------------------------


@dataclass
class StepInfo:
    tier: str  # "local" | "pfs"
    folder: str  # the node's local root, or the PFS folder
    step: int
    path: str
    committed: bool
    state: str
    parts: int  # local: rank manifests in this folder; pfs: .distcp shards
    size: int  # bytes of every file in the step folder
    mtime: float  # commit time if known, else the newest file's mtime
    replicas: int | None = 0  # None: cannot tell (see _replicas)


def _replicas(commit: dict, manifests: list[dict], n_nodes: int | None) -> int | None:
    """Parts in a node folder held for ranks of other nodes (neighbor replication).

    A replica is stored under its source rank's names with the source's manifest, so
    the files alone do not say which ranks are the node's own. Used, in order: the
    node's ranks if COMMIT.json lists them (`node_ranks`); else, as torchrun starts the
    same number of ranks on every node, world_size / nodes (nodes = the roots in
    local_roots.json) own parts, the rest replicas; else None (cannot tell)."""
    ranks = [m.get("rank") for m in manifests]
    own = commit.get("node_ranks")
    if isinstance(own, list):
        return sum(1 for r in ranks if r not in own)
    world = {m.get("world_size") for m in manifests} | {commit.get("world_size")}
    world.discard(None)
    if not n_nodes or len(world) != 1 or not manifests:
        return None
    (w,) = world
    if not isinstance(w, int) or w % n_nodes:
        return None
    return max(0, len(manifests) - w // n_nodes)


def local_step(root: str, step: int, path: str, n_nodes: int | None = None) -> StepInfo:
    """One step of a node folder; `n_nodes`: how many nodes the run had, if known."""
    names = os.listdir(path)
    manifests = []
    for n in names:
        m = _PART.match(n)
        if m and m.group(2) == "json":
            try:
                manifests.append(files.read_json(os.path.join(path, n)))
            except (OSError, ValueError):
                manifests.append({})
    size, mtime = tree_size(path)
    committed, commit = COMMIT in names, {}
    if committed:
        try:
            commit = files.read_json(os.path.join(path, COMMIT))
            mtime = float(commit.get("committed_at", mtime))
        except (OSError, ValueError, AttributeError, TypeError):
            commit = {}
    state = "committed" if committed else "torn (no COMMIT.json)"
    return StepInfo("local", root, step, path, committed, state, len(manifests), size, mtime,
                    _replicas(commit if isinstance(commit, dict) else {}, manifests, n_nodes))


def _export_note(path: str) -> str:
    """"" or what the last-step export in `path` is, as its manifest says (tiers/pfs.py)."""
    try:
        m = files.read_json(os.path.join(path, PFS_MANIFEST))
    except FileNotFoundError:  # stock torchtitan's HF export has no manifest
        return "export (HF safetensors, stock)" if os.path.isfile(os.path.join(path, HF_INDEX)) else ""
    except (OSError, ValueError):
        return ""
    if not isinstance(m, dict) or m.get("kind") != "export":
        return ""
    return f"export ({m.get('format', '?')}, {str(m.get('dtype', '?')).replace('torch.', '')})"


def pfs_step(folder: str, step: int, path: str) -> StepInfo:
    names = os.listdir(path)
    export = _export_note(path)
    complete = PFS_METADATA in names or bool(export)
    if export:
        state = export + ", not resumable"
    elif not complete:
        state = "torn (no .metadata)"
    elif PFS_MANIFEST in names:
        state = "complete"
    else:
        state = "complete, stock (no manifest)"
    size, mtime = tree_size(path)
    shards = sum(1 for n in names if n.endswith(".distcp"))
    return StepInfo("pfs", folder, step, path, complete, state, shards, size, mtime, None)


def list_steps(dump_folder: str, extra_roots: list[str] | None = None) -> tuple[list[StepInfo], list[str]]:
    """Every step this host can see, and notes (where roots came from, missing ones)."""
    steps, notes = [], []
    roots, recorded = local_roots(dump_folder, extra_roots), recorded_roots(dump_folder)
    if not roots:
        notes.append(f"no local roots known: no {os.path.join(dump_folder, PLUGIN_DIR, LOCAL_ROOTS)}; "
                     "pass --local-root PATH")
    for root, src in roots:
        if not os.path.isdir(root):
            notes.append(f"local root {root} (from {src}): not visible from this host")
            continue
        notes.append(f"local root {root} (from {src})")
        n_nodes = len(recorded) if root in recorded else None
        steps += [local_step(root, s, d, n_nodes) for s, d in _step_dirs(root)]
    pfs = pfs_folders(dump_folder)
    if not pfs:
        notes.append(f"no PFS steps under {dump_folder}")
    for folder in pfs:
        notes.append(f"PFS folder {folder}{_spares(folder)}{_set_aside(folder)}")
        steps += [pfs_step(folder, s, d) for s, d in _step_dirs(folder)]
    return steps, notes


def _spares(folder: str) -> str:
    """What a PFS folder's .spare holds: purged steps' data files, which the job's
    next drains write over (tiers/pfs.py, PfsTier._spare), removed at its end."""
    size, _ = tree_size(os.path.join(folder, files.SPARE))
    return f"; {human_bytes(size)} of retired data files in {files.SPARE}, for the next drains" if size else ""


def _set_aside(folder: str) -> str:
    """What a PFS folder's set_aside/ holds: steps a restart left (PfsFolder.set_aside_after),
    never loaded nor deleted by the plugin."""
    where = os.path.join(folder, SET_ASIDE)
    size, _ = tree_size(where)
    if not size:
        return ""
    left = {n: [s for s, _ in _step_dirs(os.path.join(where, n))] for n in sorted(os.listdir(where))}
    said = ", ".join(f"{n}: steps {ss}" for n, ss in left.items())
    return (f"; {human_bytes(size)} of steps a restart left in {SET_ASIDE} ({said}), "
            "never loaded: delete them once of no more use")


def human_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.1f}{unit}"
    return f"{seconds:.0f}s"


def _replica_cell(s: StepInfo) -> str:
    if s.tier == "pfs":
        return "-"
    return "?" if s.replicas is None else str(s.replicas)


def ls_rows(steps: list[StepInfo], now: float | None = None) -> list[list[str]]:
    now = time.time() if now is None else now
    return [[s.tier, s.folder, str(s.step), "yes" if s.committed else "no", s.state, str(s.parts),
             human_bytes(s.size), human_age(now - s.mtime), _replica_cell(s)]
            for s in steps]


LS_HEADER = ["tier", "folder", "step", "committed", "state", "parts", "size", "age", "replicas"]
_LS_LEFT = {0, 1, 3, 4}


def _table(header: list[str], rows: list[list[str]], left: set[int]) -> list[str]:
    """Text columns (`left`) left-aligned, numbers right-aligned."""
    rows = [header] + rows
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return ["  ".join(c.ljust(w) if i in left else c.rjust(w)
                      for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]


def ls_table(steps: list[StepInfo], now: float | None = None) -> list[str]:
    """The `ls` table of a dump folder's steps."""
    return _table(LS_HEADER, ls_rows(steps, now), _LS_LEFT)


# ---- a node's local folder: every job's steps (ls, clean) --------------------


def node_folder_problem(path: str) -> str:
    """Why `path` is not a node's local folder ("" if it is). Steps directly in it
    count as written before job identities, so a job's own subfolder or a PFS folder
    must never be taken for one: clean would remove their steps."""
    if not os.path.isdir(path):
        return f"{path}: no such folder"
    if os.path.isdir(os.path.join(path, PLUGIN_DIR)):
        return f"{path} is a dump folder (it has {PLUGIN_DIR}/), not a node's local folder"
    if (os.path.basename(os.path.normpath(path)).startswith(JOB_PREFIX)
            or any(os.path.exists(os.path.join(path, n)) for n in (JOB_RECORD, LOCK))):
        return (f"{path} is one job's folder, not a node's local folder: give the folder "
                f"above it, {os.path.dirname(os.path.normpath(path))}")
    if any(step_kind(d) == "pfs" for _, d in _step_dirs(path)):
        return f"{path} holds PFS steps, not a node's local folder"
    return ""


def is_node_folder(path: str) -> bool:
    """A node's local folder that holds something: job-<id> subfolders, or steps
    written before job identities."""
    if node_folder_problem(path):
        return False
    return (any(n.startswith(JOB_PREFIX) and os.path.isdir(os.path.join(path, n))
                for n in os.listdir(path))
            or any(step_kind(d) == "local" for _, d in _step_dirs(path)))


def _short_problem(job: NodeJob) -> str:
    return job.problem.replace(os.path.join(job.path, JOB_RECORD), JOB_RECORD)


LEGACY_IDLE_S = 3600.0


def job_status(job: NodeJob) -> tuple[str, bool]:
    """What a job's steps in a node folder are now, and whether they are stale: no
    job will ever load them. Only the job whose identity its dump folder holds loads
    them (identity.establish gives a start in a missing, copied or garbled dump
    folder a new id), so a dump folder that is gone, or now names another job, makes
    them stale. A dump folder whose identity is missing or unusable leaves them
    "orphaned": adopt_job there would continue them, so they are kept. What cannot be
    read here (JOB.json, a dump folder this user cannot see into) is "unknown", and
    legacy steps written to within the hour may be an older plugin's running job:
    neither is stale."""
    if job.job_id is None:
        if time.time() - job.newest < LEGACY_IDLE_S:  # an older plugin may still write there
            return "legacy: no job identity, written to within the hour (kept)", False
        return "legacy: no job identity, never loaded", True
    if job.writing:
        return "running", False
    if job.problem:
        return f"unknown: {_short_problem(job)}", False
    dump = job.record["dump_folder"]
    try:
        os.stat(dump)
    except FileNotFoundError:  # gone, unless the whole file system is not mounted here
        if os.path.isdir(os.path.dirname(os.path.normpath(dump))):
            return "stale: dump folder missing", True
        return "unknown: dump folder's parent not visible from this host (PFS not mounted?)", False
    except OSError as e:
        return f"unknown: dump folder unreachable ({e.strerror or e})", False
    try:
        r = identity.resolve(dump)  # the identity a start there would continue
    except OSError as e:
        return f"unknown: dump folder identity unreadable ({e.strerror or e})", False
    if r.found is None:
        what = "'s identity is unusable" if r.bad else " has no job identity"
        return f"orphaned: its dump folder{what} (adopt_job = '{job.job_id}' there continues it)", False
    if r.found.job_id != job.job_id:
        return f"stale: dump folder is now job {r.found.job_id}", True
    return "resumable", False


def wants_clean(job: NodeJob, stale: bool, ids: list[str], older_than_s: float | None,
                now: float) -> bool:
    """Whether `clean` removes a job's steps: stale ones, the jobs named, and with
    --older-than the idle ones untouched that long; never a job that is writing."""
    if job.writing:
        return False
    old = older_than_s is not None and now - job.newest > older_than_s
    return stale or job.job_id in ids or old


def _steps_cell(steps: list[int], show: int = 6) -> str:
    if len(steps) <= show:
        return ",".join(map(str, steps)) or "-"
    return f"{steps[0]},...,{','.join(map(str, steps[-3:]))} ({len(steps)} steps)"


def job_rows(jobs: list[NodeJob], statuses: list[str], now: float | None = None) -> list[list[str]]:
    """`statuses`: job_status(j)[0] of each job (it reads each one's dump folder)."""
    now = time.time() if now is None else now
    rows = []
    for j, status in zip(jobs, statuses):
        dump = "-" if j.job_id is None else j.record.get("dump_folder") or (
            f"({_short_problem(j).split(' (')[0]})")  # the detail is in the status
        rows.append([j.job_id or "(no identity)", dump, _steps_cell(j.steps), human_bytes(j.size),
                     human_age(now - j.newest) if j.newest else "-",
                     f"yes ({j.writing})" if j.writing else "no", status])
    return rows


JOBS_HEADER = ["job", "dump_folder", "steps", "size", "age", "writing", "status"]


def jobs_table(jobs: list[NodeJob], statuses: list[str], now: float | None = None) -> list[str]:
    """The `ls` table of a node folder: one row per job."""
    return _table(JOBS_HEADER, job_rows(jobs, statuses, now), {0, 1, 2, 5, 6})


# ---- verify ---------------------------------------------------------------


@dataclass
class Check:
    status: str  # "ok" | "FAILED" | "unverified" | "torn"
    tier: str
    path: str  # the part/step checked, or the failing file
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "FAILED"

    def line(self) -> str:
        return f"{self.status:<10}  {self.tier:<5}  {self.path}" + (f"  {self.detail}" if self.detail else "")


def verify_local_step(path: str) -> list[Check]:
    """Each rank part's files against its manifest; one Check per part (or per bad file)."""
    names = sorted(os.listdir(path))
    committed = COMMIT in names
    fetched_into = FETCHED in names
    out: list[Check] = []
    if committed:
        try:
            files.read_json(os.path.join(path, COMMIT))
        except (OSError, ValueError) as e:
            out.append(Check("FAILED", "local", os.path.join(path, COMMIT), f"unreadable: {e}"))
    ranks = sorted({int(m.group(1)) for n in names if (m := _PART.match(n))})
    where = "committed" if committed else "not committed"
    for r in ranks:
        base = os.path.join(path, f"rank-{r:05d}")
        try:
            manifest = files.read_json(base + ".json")
        except FileNotFoundError:
            # A part still being written (or killed mid-write) has no manifest yet: harmless
            # in a step without COMMIT.json, impossible in a committed one.
            status = "FAILED" if committed else "torn"
            out.append(Check(status, "local", base + ".json", f"missing: this rank's part has no manifest ({where} step)"))
            continue
        except (OSError, ValueError) as e:
            out.append(Check("FAILED", "local", base + ".json", f"unreadable manifest: {e}"))
            continue
        if fetched_into and not os.path.exists(base + ".data"):
            out.append(Check("unverified", "local", base, "layout only: fetched for a reshard, its data "
                             "read by no rank here (the step goes whole at the next commit)"))
            continue
        bad = []
        for kind in ("data", "layout"):
            try:
                files.check_file(f"{base}.{kind}", manifest["files"][kind])
            except files.CorruptCheckpoint as e:
                bad.append(Check("FAILED", "local", f"{base}.{kind}", str(e).split(": ", 1)[-1]))
            except (KeyError, TypeError):
                bad.append(Check("FAILED", "local", base + ".json", f"manifest lacks files.{kind}"))
        if manifest.get("step") not in (None, files.step_of(os.path.basename(path))):
            bad.append(Check("FAILED", "local", base + ".json",
                             f"manifest is for step {manifest.get('step')}"))
        if not bad:
            nbytes = sum(v["size"] for v in manifest["files"].values())
            out.append(Check("ok", "local", base, f"{where}; data+layout {nbytes} B"))
        out += bad
    if not ranks:
        out.append(Check("FAILED" if committed else "torn", "local", path, f"no rank parts ({where})"))
    return out


def verify_pfs_step(path: str) -> list[Check]:
    names = set(os.listdir(path))
    try:
        manifest = files.read_json(os.path.join(path, PFS_MANIFEST))
        listed = manifest["files"]
    except FileNotFoundError:
        if PFS_METADATA not in names:
            return [Check("torn", "pfs", path, "no .metadata and no manifest: never used")]
        return [Check("unverified", "pfs", path, f"stock step: no {PFS_MANIFEST}, nothing to check against")]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [Check("FAILED", "pfs", os.path.join(path, PFS_MANIFEST), f"unreadable manifest: {e!r}")]
    out = []
    for name in sorted(listed):
        try:
            files.check_file(os.path.join(path, name), listed[name])
        except files.CorruptCheckpoint as e:
            out.append(Check("FAILED", "pfs", os.path.join(path, name), str(e).split(": ", 1)[-1]))
    for name in sorted(n for n in names if n.endswith(".distcp") and n not in listed):
        out.append(Check("FAILED", "pfs", os.path.join(path, name), "not covered by the manifest"))
    hf_export = manifest.get("kind") == "export" and PFS_METADATA not in listed
    if PFS_METADATA not in names and PFS_METADATA not in listed and not hf_export:
        out.append(Check("FAILED", "pfs", os.path.join(path, PFS_METADATA), "missing"))
    if not out:
        out.append(Check("ok", "pfs", path, f"{len(listed)} files, {sum(v['size'] for v in listed.values())} B"))
    return out


def verify_step(path: str) -> list[Check]:
    kind = step_kind(path)
    if kind == "local":
        return verify_local_step(path)
    if kind == "pfs":
        return verify_pfs_step(path)
    return [Check("torn", "?", path, "empty step folder")]


def verify_path(path: str, extra_roots: list[str] | None = None) -> tuple[list[Check], list[str]]:
    """Checks for a step folder, a folder of steps (a job's local folder or a PFS
    folder), a node's local folder (every job's folder in it) or a dump folder (its PFS
    folders and every local root it records); and notes."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such folder")
    if files.step_of(os.path.basename(path)) is not None and step_kind(path):
        return verify_step(path), []
    notes, folders = [], []
    if _step_dirs(path):
        folders += _and_full_state(path)
    if is_node_folder(path):
        folders += [j.path for j in node_jobs(path) if j.job_id is not None]
    elif not folders:  # a dump folder
        for root, src in local_roots(path, extra_roots):
            if os.path.isdir(root):
                folders.append(root)
                notes.append(f"local root {root} (from {src})")
            else:
                notes.append(f"local root {root} (from {src}): not visible from this host, not checked")
        folders += pfs_folders(path)
    for root in extra_roots or []:
        if os.path.abspath(root) not in folders and os.path.isdir(root):
            folders.append(os.path.abspath(root))
    checks = [c for f in folders for _, d in _step_dirs(f) for c in verify_step(d)]
    return checks, notes
