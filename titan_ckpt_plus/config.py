"""The plugin's `[checkpoint]` keys and their validation.

torchtitan 0.2.2 merges `JobConfig` from `[job] custom_config_module` into its own
config field by field, so these keys live in the existing `[checkpoint]` table and
parse from TOML and the CLI like torchtitan's own (`--checkpoint.local_interval 5`).

This module imports no torch: the CLI and the tests read it without a training stack.
"""

import importlib.util
import os
import socket
from dataclasses import dataclass, field

from titan_ckpt_plus.identity import valid_job_id


@dataclass
class Checkpoint:
    tier_local: bool = False
    """Save frequently to a node-local folder and drain to `folder` (the PFS) in the
    background. False keeps torchtitan's own checkpointing, byte for byte."""

    local_folder: str = ""
    """Node-local folder (NVMe). Placeholders: {node_rank} (torchrun's node rank),
    {hostname}. Relative paths are taken from the working directory."""

    local_interval: int = 50
    """Steps between local saves. `interval` stays the PFS interval."""

    local_keep_latest_k: int = 3
    """Committed local steps kept per node; at least 2, as the newest may be in use.
    The node disk also holds one retired data file per rank, which the rank's next
    save writes over instead of making a new file (files.retire)."""

    pfs_reuse_files: bool = True
    """PFS retention (keep_latest_k) retires a purged step's data files, one per rank,
    to `{folder}/.spare/<job id>/` for the rank's next drain to write over instead of
    deleting them: no new file's extents to allocate, no delete's TRIMs while training
    writes (BENCHMARKS.md, overhead). The PFS then holds one more part per rank while
    the job runs; rank 0 removes them once the last step is saved (a preempted or crashed
    job keeps them for its restart). false deletes them at once (a tight
    PFS quota)."""

    replication_factor: int = 0
    """How many other nodes hold a copy of each rank's local part (0 = off). A local
    step commits only when its copies are durable too."""

    replication_jump: int = 0
    """Rank distance to the first copy; 0 = the ranks per node (LOCAL_WORLD_SIZE), so
    copies land on other nodes."""

    replication_backend: str = "gloo"
    """Process-group backend of the replication transfers: "gloo" or "nccl" (GPUs)."""

    adaptive_interval: bool = False
    """Set both tiers' intervals from Young's formula tau = sqrt(2 delta M), with delta
    measured and M estimated from the failures this job observes (its ledger).
    `local_interval` and `interval` are then only the intervals before the first
    measurement."""

    mtbf_prior_hours: float = 3.0
    """What the user believes the MTBF (any failure) is before a failure is seen."""

    mtbf_prior_weight: float = 2.0
    """How many failures' worth of belief the priors carry."""

    pfs_mtbf_prior_hours: float = 30.0
    """Prior MTBF of failures the local tier and its replicas cannot recover (a node
    lost with its copies, every local folder gone); sets the PFS interval."""

    min_interval: int = 10
    """Adaptive intervals never go below this many steps."""

    max_interval: int = 2000
    """... nor above this many (unless a background write takes longer)."""

    interval_formula: str = "young"
    """"young": sqrt(2 delta M); "daly": sqrt(2 delta (M + R)) - delta, R the measured restart time."""

    preemption_grace_s: float = 25.0
    """On SIGTERM (a preemption notice) the job finishes the save in flight, copies its
    newest local step to the PFS if that fits, and stops within this many seconds.
    Keep it below the launcher's kill timeout (torchrun's --shutdown_timeout, 30 s by
    default). 0 leaves SIGTERM to the default handler (the job dies at once)."""

    adopt_job: str = ""
    """Take an existing job identity on purpose: its id, as the log, job.json and
    `titan-ckpt ls` show it. That job's local steps, replicas and PFS steps in this
    job's folders become this job's (for a dump folder that was moved, or whose
    titan_ckpt_plus/job.json was lost); the job that made them must not be restarted.
    To start from another job's weights instead, use initial_load_path."""

    background_nice: int = -1
    """How far below the training thread the checkpointer's background threads run
    (the local writer with its replication and retention, the PFS drain): their CPU
    nice value is raised by this much and their I/O goes to the lowest best-effort
    level, per thread (Linux). 0 runs them at training's priority. -1 (auto): 10 with
    an accelerator, where training's threads mostly wait for the device; 0 on a
    CPU-only machine, where training keeps every core busy and a lowered writer would
    commit each step several steps late."""

    background_policy: str = "auto"
    """How the checkpointer's CPU-heavy background work (the staging copy, the drain's
    checksums, and the gloo threads of the vote's and replication's process groups)
    yields the CPU to training's. "idle": Linux's SCHED_IDLE while the work is on time,
    so it runs only on a core training's threads leave free and gives it back the
    moment one wakes (BENCHMARKS.md, overhead: the "normal" row beside the default
    ones); a save or a drain still in flight when the step it began in ends brings it
    back to the normal class until nothing is in flight, so where training leaves no
    core idle (pipeline parallel on CPU) a commit comes at most about a step later than
    at normal priority. The local writer and the drain stay in the normal class (the
    drain but while it checksums bytes): they mostly wait for the disk, and their few
    ms of CPU decide when a step is durable. Coming back needs CAP_SYS_NICE (root on a
    bare node; a container only with --cap-add SYS_NICE) or RLIMIT_NICE >= 20; without
    it "idle" is refused with a warning and the threads stay normal. "normal": the
    scheduler's normal class, the writer and the drain at background_nice. "auto" (the
    default): "idle" where the threads may come back, else "normal"."""

    staging_copy: str = "auto"
    """Where a save's copy of the state into the staging buffer runs: "thread" (the copy
    thread, on the copy stream with a GPU: it overlaps forward and backward), "save"
    (inside save(), on the training thread, which then waits for it), or "auto" (the
    default): the thread with a GPU or a core training leaves spare; on a CPU-only
    machine whose cores the node's ranks fill, save() while the last copy took under
    20 ms of CPU, else the thread (the first copy runs on the thread and measures
    itself). There a thread's copy takes its CPU time from training anyway, and its
    hand-overs cost more than a short copy in save() (BENCHMARKS.md, "The staging
    copy's place chosen by its cost": debugmodel's 36 MiB a rank commit sooner, and its
    PFS periods cost less, in save(); 100M's 586 MiB cost the steps less on the
    thread). A copy in save() while a drain still reads the buffer goes to the thread."""

    agreements: str = "auto"
    """How the ranks agree on each save (the writer's commit vote) and each drain (its
    start, and the gather of what every rank wrote). "gloo": collectives on the
    background threads' own gloo groups. "hub": through the job's hub, a small
    torch-free process rank 0 starts (tiers/hub.py): one socket round trip from the
    thread that asks, one process more on the node. "auto" (the default): "hub" with
    helper_process = true (its helper makes the exchanges), else "gloo": neither way
    cost debugmodel's steps less on both hosts measured, and the hub cost more on the
    faster one (BENCHMARKS.md, "The agreements: gloo again by default"). If the hub
    does not start, or a rank cannot reach it, the job agrees by gloo, with a warning."""

    drain_start: str = "auto"
    """When a PFS step's drain starts. "commit": as soon as every rank's local part is
    committed, in the step after the save, where it shares that step with the local
    write. "next_step": at the next step boundary after the commit, so the write and the
    drain's copy land in two steps, each costing training less (BENCHMARKS.md, "A drain
    at the next step boundary (session 45)"); the PFS step is durable about a step
    later (a flush, at the last step or a preemption, starts it at once). "auto" (the
    default): "next_step", but at the commit when the step after the save saves too
    (local_interval = 1, or a local save right after a PFS one), whose copy would take
    the staged bytes back at that boundary, so the drain would read them back from the
    local disk. A step some rank could not write (not committed) drains at once, on
    every rank (that rank's staged bytes are held until then)."""

    helper_process: bool = False
    """Write each rank's local data file from a helper process (one per rank, without
    torch: about 17 MiB of memory) instead of a thread of the training process; the
    staging buffer is then shared memory. On hosts where a background thread's system
    calls cost the training thread more than their own CPU (its GIL hand-overs), this
    keeps them out of the training process (BENCHMARKS.md, overhead: the launch-bound
    rows). Linux only. The helper dies with its rank; if it ends on its own, the writes
    go on in the training process. The drain, the vote and replication stay in the
    training process for now (docs/helper_process.md)."""

    local_reshard: bool = True
    """A job restarted at another world size (a node lost for good) loads the newest
    local step whose parts (own and replicas) are all in each rank's node folder,
    resharded by DCP from the parts as they are, instead of a PFS step: no PFS bytes
    (tiers/reshard.py). If DCP cannot read it, the next candidate is loaded; a step
    whose parts lack the shard offsets (written before they were recorded) reshards
    only from the PFS. false: such restarts load the PFS, as stock torchtitan would."""

    dataloader_resume: str = "global_samples"
    """How the data position is saved: "global_samples" (one global sequence count,
    the same on every rank: resumable at any DP degree) or "per_rank" (torchtitan's
    per-rank dataloader state). See docs/data_resumption.md."""


@dataclass
class JobConfig:
    checkpoint: Checkpoint = field(default_factory=Checkpoint)


class ConfigError(ValueError):
    """A configuration value the plugin cannot run with; the message names the key
    and the fix, and is raised before any training step."""


def node_rank() -> int:
    """torchrun exports the node's rank as GROUP_RANK; other launchers as NODE_RANK."""
    for name in ("GROUP_RANK", "NODE_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def resolve_local_folder(template: str) -> str:
    """Expand {node_rank} and {hostname}; any other placeholder is a config error."""
    try:
        path = template.format(node_rank=node_rank(), hostname=socket.gethostname())
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(
            f"[checkpoint] local_folder = {template!r} has an unknown placeholder ({e}). "
            "Fix: use only {node_rank} and {hostname}."
        ) from None
    return os.path.abspath(path)


def _is_inside(path: str, parent: str) -> bool:
    path, parent = os.path.realpath(path), os.path.realpath(parent)
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


def _validate_adaptive(ckpt) -> None:
    for key in ("mtbf_prior_hours", "mtbf_prior_weight", "pfs_mtbf_prior_hours"):
        if not getattr(ckpt, key) > 0:
            raise ConfigError(f"[checkpoint] {key} = {getattr(ckpt, key)} is invalid. "
                              f"Fix: a positive number (e.g. {key} = 3.0).")
    if not 1 <= ckpt.min_interval <= ckpt.max_interval:
        raise ConfigError(
            f"[checkpoint] min_interval = {ckpt.min_interval}, max_interval = {ckpt.max_interval}: "
            "need 1 <= min_interval <= max_interval. Fix: e.g. min_interval = 10, max_interval = 2000.")
    if ckpt.interval_formula not in ("young", "daly"):
        raise ConfigError(f"[checkpoint] interval_formula = {ckpt.interval_formula!r} is unknown. "
                          'Fix: "young" or "daly".')


STAGING_COPY = ("auto", "thread", "save")


BACKGROUND_POLICY = ("auto", "idle", "normal")
AGREEMENTS = ("auto", "gloo", "hub")
DRAIN_START = ("auto", "commit", "next_step")


def background_idle(ckpt, can_leave_idle: bool) -> bool:
    """Whether the checkpointer's threads run in SCHED_IDLE while on time
    (background_policy): only where they may leave it again when late."""
    return getattr(ckpt, "background_policy", "auto") != "normal" and can_leave_idle


def background_nice(ckpt, accelerator: bool) -> int:
    """The nice increment of the background threads, `auto` (-1) resolved."""
    return ckpt.background_nice if ckpt.background_nice >= 0 else (10 if accelerator else 0)


def staging_copy(ckpt, accelerator: bool, fills_cores: bool) -> str:
    """staging_copy for the checkpointer: "auto" stays (a copy in save() while short,
    TieredCheckpointer._copy_in_save) only on a CPU machine whose cores training fills;
    else the thread: a GPU's copy is a DMA beside the training stream, and a spare
    core takes a thread's copy off training's."""
    if ckpt.staging_copy != "auto" or (fills_cores and not accelerator):
        return ckpt.staging_copy
    return "thread"


def async_mode_note(ckpt) -> str | None:
    """What becomes of torchtitan's `async_mode` with the tiers on, for the start-up
    log: the tiers stage every save into host memory and write it in the background
    themselves, so torchtitan's async save (and its stager) is not used."""
    mode = str(getattr(ckpt, "async_mode", "disabled"))
    if not ckpt.tier_local or mode == "disabled":
        return None
    return (f'[checkpoint] async_mode = "{mode}" is not used with tier_local = true: every save is '
            "staged into host memory (pinned on GPUs) and written in the background by the plugin (what "
            f'"{mode}" asks for); the last step\'s export stays synchronous, as in stock torchtitan. '
            'To silence this: async_mode = "disabled".')


def validate(ckpt, dump_folder: str) -> None:
    """Check the plugin's keys (and the torchtitan keys they interact with).

    `ckpt` is the merged `[checkpoint]` config object.
    """
    if not ckpt.enable:
        return
    if ckpt.interval <= 0:
        raise ConfigError(
            f"[checkpoint] interval = {ckpt.interval} is invalid: it is the PFS interval "
            "in steps and must be positive. Fix: set interval >= 1 (e.g. 500)."
        )
    if not ckpt.tier_local:
        return
    if getattr(ckpt, "last_save_in_hf", False) and not getattr(ckpt, "last_save_model_only", True):
        raise ConfigError(
            "[checkpoint] last_save_in_hf = true needs last_save_model_only = true: torchtitan "
            "writes only the model in HF safetensors (stock torchtitan would stop with an "
            "assertion at the last step). Fix: set last_save_model_only = true, or "
            "last_save_in_hf = false.")
    hf = [k for k in ("last_save_in_hf", "initial_load_in_hf") if getattr(ckpt, k, False)]
    if hf and importlib.util.find_spec("safetensors") is None:
        raise ConfigError(
            f"[checkpoint] {' and '.join(hf)} = true needs the safetensors package, which is "
            "not installed (torchtitan would fail at that save or load). Fix: pip install "
            "'titan_ckpt_plus[hf]' (or safetensors), or set it to false.")
    if ckpt.local_interval <= 0:
        raise ConfigError(
            f"[checkpoint] local_interval = {ckpt.local_interval} is invalid: it must be a "
            "positive number of steps. Fix: set local_interval >= 1 (e.g. 50)."
        )
    if not ckpt.local_folder:
        raise ConfigError(
            "[checkpoint] tier_local = true needs a node-local folder. Fix: set "
            'local_folder = "/local_nvme/ckpt/{node_rank}" (or set tier_local = false).'
        )
    if ckpt.local_keep_latest_k < 2:
        raise ConfigError(
            f"[checkpoint] local_keep_latest_k = {ckpt.local_keep_latest_k} is invalid: the "
            "newest local step may still be in use, so at least 2 are kept. "
            "Fix: set local_keep_latest_k >= 2."
        )
    if ckpt.keep_latest_k == 1:
        raise ConfigError(
            "[checkpoint] keep_latest_k = 1 is invalid: the newest PFS step may still be "
            "written. Fix: set keep_latest_k >= 2, or 0 to keep all."
        )
    if ckpt.replication_factor < 0:
        raise ConfigError(
            f"[checkpoint] replication_factor = {ckpt.replication_factor} is invalid. "
            "Fix: 0 (off) or the number of other nodes holding a copy (e.g. 1).")
    if ckpt.replication_jump < 0:
        raise ConfigError(
            f"[checkpoint] replication_jump = {ckpt.replication_jump} is invalid. "
            "Fix: 0 (the ranks per node) or a positive rank distance.")
    if ckpt.replication_backend not in ("gloo", "nccl"):
        raise ConfigError(
            f"[checkpoint] replication_backend = {ckpt.replication_backend!r} is unknown. "
            'Fix: "gloo", or "nccl" on GPUs.')
    if not ckpt.preemption_grace_s >= 0:
        raise ConfigError(
            f"[checkpoint] preemption_grace_s = {ckpt.preemption_grace_s} is invalid. "
            "Fix: the seconds a preempted job may take to stop (e.g. 25), or 0 to die at once.")
    if not -1 <= getattr(ckpt, "background_nice", -1) <= 19:
        raise ConfigError(
            f"[checkpoint] background_nice = {ckpt.background_nice} is invalid. Fix: 0 (background "
            "threads at training's priority) to 19 (lowest), or -1 (auto, the default).")
    if getattr(ckpt, "helper_process", False) and not hasattr(os, "memfd_create"):
        raise ConfigError(
            "[checkpoint] helper_process = true needs Linux (memfd_create, for the staging buffer the helper "
            "shares). Fix: set helper_process = false on this platform.")
    agreements = getattr(ckpt, "agreements", "auto")
    if agreements not in AGREEMENTS:
        raise ConfigError(
            f"[checkpoint] agreements = {agreements!r} is unknown. Fix: \"auto\" (the default: the hub "
            'with helper_process, else gloo), "gloo" (collectives on the background threads\' gloo groups) '
            'or "hub" (through the job\'s hub process).')
    if agreements == "gloo" and getattr(ckpt, "helper_process", False):
        raise ConfigError(
            '[checkpoint] agreements = "gloo" cannot be honoured with helper_process = true: the byte '
            'helpers make the exchanges through the job\'s hub. Fix: agreements = "auto" (the default) or '
            '"hub", or helper_process = false.')
    if getattr(ckpt, "background_policy", "auto") not in BACKGROUND_POLICY:
        raise ConfigError(
            f"[checkpoint] background_policy = {ckpt.background_policy!r} is unknown. Fix: \"auto\" "
            "(the default), \"idle\" (SCHED_IDLE while on time) or \"normal\" (nice background_nice).")
    if getattr(ckpt, "drain_start", "auto") not in DRAIN_START:
        raise ConfigError(
            f"[checkpoint] drain_start = {ckpt.drain_start!r} is unknown. Fix: \"auto\" (the default), "
            '"commit" (a drain starts once its local step is committed) or "next_step" (at the step '
            'boundary after).')
    if getattr(ckpt, "staging_copy", "auto") not in STAGING_COPY:
        raise ConfigError(
            f"[checkpoint] staging_copy = {ckpt.staging_copy!r} is unknown. Fix: \"auto\" (the "
            'default), "thread" (the copy overlaps forward and backward) or "save" (the copy runs in save()).')
    _validate_adaptive(ckpt)
    local = resolve_local_folder(ckpt.local_folder)
    pfs = os.path.abspath(os.path.join(dump_folder, ckpt.folder))
    if _is_inside(local, pfs) or _is_inside(pfs, local):
        raise ConfigError(
            f"[checkpoint] local_folder = {ckpt.local_folder!r} resolves to {local}, which "
            f"overlaps the PFS folder {pfs} ([job] dump_folder + [checkpoint] folder); "
            "their retention would delete each other's steps. Fix: point local_folder "
            "at node-local storage outside the PFS folder."
        )
    if ckpt.adopt_job and not valid_job_id(ckpt.adopt_job):
        raise ConfigError(
            f"[checkpoint] adopt_job = {ckpt.adopt_job!r} is not a job id. Fix: the id of the job "
            "to continue, as its log, titan_ckpt_plus/job.json or `titan-ckpt ls` shows it "
            "(e.g. adopt_job = '20261201-072754-3fa9c2d1'), or \"\" for this job's own.")
    if getattr(ckpt, "dataloader_resume", "global_samples") not in ("global_samples", "per_rank"):
        raise ConfigError(
            f"[checkpoint] dataloader_resume = {ckpt.dataloader_resume!r} is unknown. "
            'Fix: "global_samples" (any DP degree) or "per_rank" (torchtitan\'s way).')
