"""What training notices of checkpointing (issue 15), in one run, on this machine:

  - step inflation: the step during a local save and the step during a PFS drain, each
    against an undisturbed step, next to the floor (memcpy + CRC-32C of the rank's bytes,
    measured alone in this run, as a share of an undisturbed step);
  - drain time against the node's bytes / the PFS folder's fsync'd write bandwidth;
  - extra host memory: peak RSS per rank with the tiers on minus the same job's with
    checkpointing off, against the rank's state bytes;
  - a launch-bound loop (many tiny ops, standing in for a GPU step's Python dispatch)
    slowed by a save + drain running in the same process, and, as a control, by the same
    save + drain in a helper process.

    .venv/bin/python scripts/bench_overhead.py [--update BENCHMARKS.md] [--models debugmodel,100M,...]

debugmodel and the 100M flavor, 2 CPU ranks, local every 3 steps, PFS every 6; debugmodel
with the staging copy on its thread (staging_copy = "thread": "auto", the default, copies
debugmodel's state in save() on a CPU, 100M's on the thread), and with the checkpointer's threads
in the normal class throughout (background_policy = "normal"); and debugmodel on one rank,
which leaves one of the 2 cores to the checkpointer's threads.
"""

import argparse
import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
from bench_save import machine_limits, pooled_limits  # noqa: E402
from benchmd import record_targets, update_section  # noqa: E402
import harness  # noqa: E402
from harness import ckpt_events, events, torchrun  # noqa: E402

from titan_ckpt_plus.adapters.torchtitan_v022 import SCHED_LOG_ENV  # noqa: E402
from titan_ckpt_plus import staging  # noqa: E402
from titan_ckpt_plus.cpu_fallback import fp32_args  # noqa: E402
from titan_ckpt_plus.tiers import files  # noqa: E402

MODELS = {
    # row: (torchtitan flavor, seq_len, local batch, steps, ranks, plugin keys)
    "debugmodel": ("debugmodel", 128, 2, 62, 2, ()),
    "100M": ("100M", 32, 1, 38, 2, ()),
    # the staging copy on its own thread, side by side with the default's copy in save()
    "debugmodel-copythread": ("debugmodel", 128, 2, 62, 2, ("--checkpoint.staging_copy=thread",)),
    # the threads in the normal class throughout, side by side with the default ("auto":
    # SCHED_IDLE while on time, where the kernel lets a late thread come back)
    "debugmodel-normal": ("debugmodel", 128, 2, 62, 2, ("--checkpoint.background_policy=normal",)),
    # one rank, so one of the machine's 2 cores is left to the copy and background
    # threads: what a save costs the steps when training does not keep every core busy
    "debugmodel-1rank": ("debugmodel", 128, 2, 62, 1, ()),
    # the bytes of each save and drain moved by a helper process per rank ([checkpoint]
    # helper_process), side by side with the default (threads of the training process)
    "debugmodel-helper": ("debugmodel", 128, 2, 62, 2, ("--checkpoint.helper_process",)),
    "100M-helper": ("100M", 32, 1, 38, 2, ("--checkpoint.helper_process",)),
    # the ranks agreeing through the job's hub ([checkpoint] agreements = "hub"), side by
    # side with the default (gloo collectives)
    "debugmodel-hub": ("debugmodel", 128, 2, 62, 2, ("--checkpoint.agreements=hub",)),
    # a drain started at its local commit ([checkpoint] drain_start = "commit"), side by
    # side with the default (at the step boundary after it): bench_ab.py's, not run by default
    "debugmodel-drainatcommit": ("debugmodel", 128, 2, 62, 2, ("--checkpoint.drain_start=commit",)),
    "100M-drainatcommit": ("100M", 32, 1, 38, 2, ("--checkpoint.drain_start=commit",)),
}
AB_ONLY = ("debugmodel-drainatcommit", "100M-drainatcommit")  # not in --models' default
DEFAULT_MODELS = ",".join(m for m in MODELS if m not in AB_ONLY)
LABELS = {"debugmodel-copythread": "debugmodel, staging_copy = \"thread\" (not the default)",
          "debugmodel-normal": "debugmodel, background_policy = \"normal\" (not the default)",
          "debugmodel-1rank": "debugmodel on 1 rank (a core to spare; not issue 15's 2-rank case)",
          "debugmodel-helper": "debugmodel, helper_process = true (not the default)",
          "100M-helper": "100M, helper_process = true (not the default)",
          "debugmodel-hub": "debugmodel, agreements = \"hub\" (not the default)",
          "debugmodel-drainatcommit": "debugmodel, drain_start = \"commit\" (not the default)",
          "100M-drainatcommit": "100M, drain_start = \"commit\" (not the default)"}
LOCAL_EVERY, PFS_EVERY = 3, 6
LAUNCH_BOUND_BYTES = 614_571_000  # 100M's state per rank (586.1 MiB), for --launch-bound-only
BARE = ("debugmodel", "100M")  # issue 15's models get the BareMover control with --bare
RUNS = 3  # jobs with the tiers on, and as many with checkpointing off
LAUNCH_REPS = 5  # rounds of the launch-bound ways: one pass can be 20 points off the next
SECTION = "## Overhead: what training notices of checkpointing"
READING = """How to read it. The drain is a copy: the local part is in DCP's per-rank form, so the
drain writes this rank's frames from the staging buffer while it holds the step (else from the
local file, checked), with O_DIRECT, verbatim when every item is this rank's; a layout's first
step is planned by DCP and the later ones reuse that plan and its Metadata; only the small
non-tensor items are serialized, each value once. The period column sums every step's
extra time over a PFS period (two local saves, one of them drained), so work moved from one
step to another shows there. A drain starts at the step boundary after its local commit
(drain_start = "auto", since session 45), so a PFS save's step holds its local save alone
(counted with the local saves) and the next step the drain: on debugmodel the worst step of
a period went from +0.108-0.122 to +0.068-0.071, the period's sum within its noise (section
"A drain at the next step boundary (session 45)"). The staging copy in save() against its own thread, on 2 ranks: debugmodel's period
cost less in save() each time it was compared (+0.35 / +0.44 in 7 interleaved A/B jobs each
way; +0.20 / +0.24 in session 39's rows), 100M's more (+0.40 / +0.26, 3 jobs each way), each
job's figures +-0.05 or more apart; in save() the copy also blocks training for all of its
length (100M: about 140 ms with its CRC). With a core to spare (1 rank) the copy thread cost
+0.11 against +0.20 in save() (3 each). So staging_copy = "auto", the default, copies in
save() where no accelerator is used and the node's ranks fill the cores, while the last copy
took under 20 ms of CPU (debugmodel's about 12 ms), and on the thread otherwise (100M's; the
"thread" row is debugmodel's copies on the thread).
The CPU column is each background thread's
own CPU time on rank 0 (kernel time included); the phase lines split it (median of the later
saves and drains; rank 1 writes no .metadata). The staging buffer is on transparent huge pages
(an O_DIRECT write pins each page: huge pages halve its kernel time), and a later step's
.metadata pickles only its changed fields. The "where a step's time goes" lines split the steps
by every rank's scheduler counters (/proc/<tid>/schedstat, read at each step): the training
thread on a CPU, waiting for a core, and asleep (a collective, the GIL); the gloo threads'
waits for a core; the checkpointer threads' CPU; how busy the cores were (every thread's
CPU, all ranks, over the cores and the step). They show why a save's CPU cost the steps more
than itself on 2 ranks: 100M's steps leave the cores a fifth idle (78% busy undisturbed), yet
its gloo threads wait about 260 ms a step for a core, so a runnable thread often queues behind
another on one core while the other core idles; with the copy's 9% of the cores added, those
waits grew by 90-120 ms a step although the copy runs in SCHED_IDLE. The kernel's wake-up
placement stops searching for an idle core when the cores' utilisation is high, and a
SCHED_IDLE thread counts toward it (our reading: this container may not switch the scheduler
feature off to prove it). With a core to spare (1 rank, 50% busy) a save costs the step less
than its own CPU. Measured apart (debugmodel, jobs interleaved) with the checkpointer's threads at nice
0 (the normal class): a drain step's +46 ms went to +8 ms more of the
training thread's own CPU, +14 ms waiting for a core and +24 ms asleep, while the gloo threads
waited +28 ms more for a core; nice 19 helped less, and not in every job (3 jobs). The default
rows run the threads in SCHED_IDLE while their work is on time (background_policy "auto", as
root here), which gives a core back the moment a training or gloo thread wakes; a save's write
or a drain still in flight when its step ends brings them back to the normal class (the
"normal" row: nice 0 throughout, side by side). SCHED_IDLE without that check starved a
pipeline-parallel job's commit past a kill; with it those jobs pass. The gloo threads of the
vote's process group (and until 735e2ca the drain's) move with them: 4 interleaved jobs each
way, local step +0.041 / +0.084 with those threads left normal, drain step +0.097 / +0.128. The
local writer stays in the normal class: in SCHED_IDLE its commits came 61 ms after their saves
against 51 (4 of 4 interleaved pairs), the steps the same within the noise (local +0.044 /
+0.050). So does the drain with its group's gloo threads since 735e2ca, but while it checksums
bytes (none here: every item is its rank's, copied from memory): it mostly waits for the disk's
flush and two small collectives, and in SCHED_IDLE each wake-up waited for a free core. 3 jobs
each way, one model after the other: debugmodel's drain 1.7x its bound in SCHED_IDLE against
1.3x, its step after a PFS save +0.127 / +0.124; 100M's drain 0.8x / 0.9x, that step +0.211 /
+0.262 and a local save's step (no drain in it) +0.163 / +0.173, the noise between runs. On
debugmodel, 4 interleaved jobs each way: local step +0.070 / +0.076 (normal), drain step
+0.146 / +0.200, a local commit 75 / 58 ms after its save. On 100M, 2 each way: local +0.19 /
+0.29, drain +0.15 / +0.13; its undisturbed step moves by a third within the hour. Local
retention retires a part's data file and the next save writes over it: the probe row times
both ways; on 100M, 2 interleaved jobs each way, a local commit came 506 ms after its save
against 715 ms with new files and deletes, and a drain took 0.64 s against 0.95 s (the deletes'
TRIMs, this disk is mounted with discard, no longer load it), the steps the same within the
noise. PFS retention does the same with a purged step's data files (PfsTier._spare): on 100M,
one job each way, a drain's fsync took 0.20 s against 0.30 s and rank 0's purge 1 ms against
0.32 s; debugmodel's drain 65-72 ms against 74-75 ms (2 jobs each way). A PFS save's drain
starts in the step after the save, which also holds that save's copy and local write, and
ends in the next one: the table keeps those two kinds of step apart ("local save + drain
start", "rest of the drain"). Until 48ee06b one drain column held both, and its median moved
between them from run to run (100M: +0.058, +0.105, +0.153 on one day's code); the period
column sums them (100M +0.43 with spares / +0.47 without, one job each way). What is left is moving the bytes, which costs the other core's math too (the neighbour
probe above; the floor counts CPU time alone), and about 5 ms of commit, vote, gather and
retention per save and drain. The PFS folder is on the same disk as
the local one, and the disk's speed changes from second to second. Peak RSS is a job's largest rank's, to the KiB. Each
tiers-on job is compared with the job with checkpointing off run just before it, and the pair
with the median difference is shown: a job's peak in a step wanders by up to 0.2 GiB on 100M
and 0.02 GiB on debugmodel from step to step and run to run (glibc's heap), the size of the
margin the target leaves. "Beside the staging buffer" is that difference less the buffer (in
2 MiB pages); "the median such step" compares the median of those steps' peaks instead of the
largest, which that wandering moves less (the target is judged on the largest). The
probe row times the three ways of making the PFS step in one idle process. The launch-bound
rows are the same loop beside the same save + drain with the background threads at training's
priority, 10 below it, and in SCHED_IDLE, and beside that SCHED_IDLE save + drain run by a
helper process (the control: what is left once the loop shares no GIL with it), each way
LAUNCH_REPS times round-robin, the loop's mean time alone (for as long as the last save +
drain took) against its mean during, after a first save + drain not timed (the layout's
first, and a helper process's start-up); the wait row counts the times the loop's thread slept
during a save + drain (a thread of tiny ops waits for nothing but the GIL) and its share of
that time asleep, in one process and beside a helper process. Peak RSS during saves and drains is each rank's peak per step (reset at every step),
over the steps the tiers-on job saved or drained in, against the same steps of the job with
checkpointing off; the whole job's peak also counts start-up and the last step (until
48ee06b it was the kernel's peak at exit, which the per-step reset had cut to the last step's,
so it read lower than the peak during saves)."""


MEMORY_READING = """The jobs' extra peak RSS (the overhead section) is a training job's heap
with the tiers on less the same job's with checkpointing off, and with glibc's default heap
either job's peak wanders from step to step by more than the target's margin (100M with
checkpointing off: 1.6 to 2.2 GiB within one job; debugmodel: 0.02 GiB against 3.6 MiB).
That wandering is glibc's dynamic mmap threshold: it rises to the size of each large block
freed (up to 32 MiB), and later blocks below it come from the heap, which keeps what is freed.
The "heap held still" rows run the same two jobs with a fixed threshold
(MALLOC_MMAP_THRESHOLD_, both jobs alike), so that a rank's RSS is what it holds: in the
probe that found it (2026-12-05, 100M, two jobs each way) the job with checkpointing off
peaked at 1.43 GiB in every step from the second, to 5 MiB, in both runs, and with the tiers on at 2.03 GiB,
594 MiB more for 586 MiB of state, in both (its steps took 1.8x as long: that setting is for
measuring, not for training). The target is judged on those rows. The other rows take the training away: 2 ranks in their own processes hold the flavor's state,
sharded over them as FSDP shards it (model and AdamW moments as DTensors, the small items),
and the plugin saves it every 3 steps and drains every 6th, each step a sleep of the quiet
machine's undisturbed step. Each rank's RSS with the state allocated is the job's own; the
plugin's is the largest rank's peak over the steps less that, the peak reset at each step as
in the jobs. Read by hand (/proc/self/smaps and tracemalloc, debugmodel, 2026-12-03), what
stays beside the staging buffer is mostly a constant: the first save adds 1.6 MiB (libtorch's
code pages it touches, the threads' stacks and malloc arenas, the layout), the first drain 3.3 MiB
(DCP's plan of the layout, kept for the later drains, and the Python and malloc arenas its
planning grew), then the heap's fragments grow a few KiB a save and slow down (42.0 to 44.4 MiB
over 120 saves; Python's own objects the same within 0.13 MiB between the 20th and the 120th
save). malloc_trim after each drain gave back 0.7 MiB of it (not kept). The staging buffer
itself is whole 2 MiB pages (debugmodel: 0.7 MiB over its 35.3). So the plugin's share is
1.02x at 100M's 586 MiB a rank (+10 MiB beside the buffer: more items to plan) and 1.19x at
debugmodel's 35 MiB (+6 MiB): with that constant, 1.1x holds from about 100 MiB a rank. Until this run a drain reading a local file (its staging buffer
taken back by the next save) held a 16 MiB buffer whatever the part (debugmodel: 0.45x its
state more in the steps it happened) and a replica landed through 64 MiB (1.8x debugmodel's
state); both now use one buffer of a sixteenth of the part, 1 to 16 MiB (files.piece_size)."""


def job_args(flavor: str) -> list[str]:
    """The job's torchtitan options (the controls' jobs run the same)."""
    model, seq, batch, steps, _, _ = MODELS[flavor]
    return [f"--model.flavor={model}", f"--training.seq_len={seq}", f"--training.local_batch_size={batch}",
            f"--training.steps={steps}", "--debug.no-deterministic", "--checkpoint.keep_latest_k=2",
            "--checkpoint.local_keep_latest_k=2", "--checkpoint.no-last-save-model-only",
            *fp32_args()]


def run_job(work: Path, flavor: str, tiers: bool, bare_bytes: int = 0, env: dict | None = None) -> tuple:
    """One job, tiers on or checkpointing off; `bare_bytes`: checkpointing off, with a
    BareMover per rank moving that many bytes at the saves' steps (the control); `env`:
    more of the ranks' environment (HEAP_HELD_STILL)."""
    _, _, _, _, nproc, keys = MODELS[flavor]
    common = job_args(flavor)
    ckpt = ([f"--checkpoint.local_interval={LOCAL_EVERY}", f"--checkpoint.interval={PFS_EVERY}", *keys] if tiers
            else ["--checkpoint.no-enable"])
    launch = harness.LAUNCH
    harness.LAUNCH = [sys.executable, "-c", _PEAK_RSS, *launch]
    movers = [BareMover(rank, bare_bytes, work) for rank in range(nproc)] if bare_bytes else []
    try:
        proc = torchrun(work, *common, *ckpt, timeout=1800, digests=False, nproc=nproc,
                        env={SCHED_LOG_ENV: str(work / "sched"), **(env or {})})
    finally:
        harness.LAUNCH = launch
        for m in movers:
            m.stop()
    assert proc.returncode == 0, proc.stdout[-3000:]
    tail = int(re.findall(r"peak RSS of any rank: (\d+) KiB", proc.stdout)[-1]) * 1024
    return proc, max(tail, *step_peaks(work, nproc).values())


# torchrun under a parent that reports its descendants' peak RSS once they exit: the
# largest rank's, to the KiB (torchtitan's log prints it to 0.01 GiB, a quarter of
# debugmodel's state). Each step's sample resets a rank's peak (peak_rss_since_last),
# so this one holds only what came after the last logged step (the last save, the
# flush, the exit): run_job takes the larger of it and every step's.
_PEAK_RSS = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
             "print('peak RSS of any rank: %d KiB' % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
             "sys.exit(rc)")


def _bare_mover(rank: int, nbytes: int, work: str, folder: str, ready, stop) -> None:
    """BareMover's process: at each step the loss log shows a save after, the bytes a
    rank's save moves, by the syscalls the plugin's threads make and nothing else: a
    memcpy of `nbytes` into a page-aligned buffer and its CRC-32C in SCHED_IDLE (as
    the staging copy runs), then that buffer written durably, O_DIRECT, over a retired
    file in `folder` (as the local writer does, in the normal class); at a PFS step,
    once more into a "PFS" file (as the drain does). No Python per tensor, no planning,
    no collectives: what a save costs on this machine whatever code makes it. Rank 0's
    mover logs each PFS write as the plugin's drain does (a pfs_commit line, which
    step_classes reads; EventLog would also want the plugin's metrics fields)."""
    import json

    from titan_ckpt_plus import priority

    torch.set_num_threads(1)
    buf = _page_aligned(nbytes)
    state = torch.empty(len(buf), dtype=torch.uint8).fill_(3)
    staged = torch.frombuffer(buf, dtype=torch.uint8)
    tid, out, losses = threading.get_native_id(), Path(folder), Path(work) / "losses.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    log = Path(work) / "dump" / "titan_ckpt_plus" / "events.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)

    def write(name: str) -> None:
        with files.DurableBatch() as batch:
            batch.write(str(out / name), buf, known_crc=lambda: crc, reuse=str(out / f"{name}.spare"))
        files.retire(str(out / name), str(out / f"{name}.spare"))

    ready.set()
    done, size = 0, 0
    while not stop.wait(0.005):  # a stat 200 times a second: about 0.2% of a core
        now = losses.stat().st_size if losses.exists() else 0
        if now == size:
            continue
        size = now
        step = max((r["step"] for r in events(losses, "loss")), default=0)
        if step <= done:
            continue
        done = step
        if done % LOCAL_EVERY:
            continue
        priority.set_class(tid, idle=True)
        staged.copy_(state)
        crc = files.checksum(buf)
        priority.set_class(tid, idle=False)
        write("local")
        if done % PFS_EVERY == 0:
            t0 = time.time()
            write("pfs")
            if rank == 0:
                end = time.time()
                with open(log, "a") as f:
                    f.write(json.dumps({"event": "pfs_commit", "time": end, "step": done, "bytes": nbytes,
                                        "background_write_s": end - t0}) + "\n")


def _start_ready(target, *args, what: str):
    """A spawned process running target(*args, ready, stop), returned once it set
    `ready` (its start-up and buffers off the clock), with its `stop` event; an error
    naming `what` if it dies first (else a loop would time an idle core as busy)."""
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    ready, stop = spawn.Event(), spawn.Event()
    proc = spawn.Process(target=target, args=(*args, ready, stop))
    proc.start()
    while not ready.wait(0.5):
        if not proc.is_alive():
            raise RuntimeError(f"{what} died, exit code {proc.exitcode}")
    return proc, stop


class BareMover:
    """The control beside the jobs: a process per rank that moves a save's bytes at
    the saves' steps of a job with checkpointing off (_bare_mover). Its steps' inflation
    is what moving the bytes costs training on this machine; the tiers' beyond it is
    the plugin's own."""

    def __init__(self, rank: int, nbytes: int, work: Path) -> None:
        self.folder = work / "bare" / str(rank)
        self.proc, self._stop = _start_ready(_bare_mover, rank, nbytes, str(work), str(self.folder),
                                             what=f"the bare mover of rank {rank}")

    def stop(self) -> None:
        self._stop.set()
        self.proc.join()
        shutil.rmtree(self.folder, ignore_errors=True)


def step_classes(work: Path, steps: int) -> dict[int, str]:
    """Each step's class: during a local-only save ("local": the step after it, which
    the copy and the write overlap), during a PFS save's local save and the start of
    its drain ("local_drain": the step after the save, which holds both; a drain held to
    the next step boundary leaves that step "local"), during the rest of a drain, or
    the whole of a held one ("drain": a later step overlapping its window), undisturbed
    (neither). A layout's first save and first drain are apart ("first_local",
    "first_drain"): they allocate the staging buffer (its pages are touched once) and
    let DCP plan the layout, once per job. Not the last step: it flushes."""
    t = {r["step"]: r["time"] for r in events(work / "losses.jsonl", "loss")}
    drains = [(e["time"] - e["background_write_s"], e["time"]) for e in ckpt_events(work, "pfs_commit")]
    out = {}
    for s in range(3, steps):
        if s not in t or s - 1 not in t:
            continue
        a, b = t[s - 1], t[s]
        overlaps = [i for i, (lo, hi) in enumerate(drains) if lo < b and a < hi]
        if overlaps:
            out[s] = ("first_drain" if overlaps == [0] else
                      "local_drain" if (s - 1) % LOCAL_EVERY == 0 else "drain")
        elif (s - 1) % LOCAL_EVERY == 0:
            out[s] = "first_local" if s - 1 == LOCAL_EVERY else "local"
        elif (s - 2) % LOCAL_EVERY != 0 and s > LOCAL_EVERY + 2:  # two steps clear of a save
            out[s] = "undisturbed"
    return out


def classify_steps(work: Path, steps: int) -> dict[str, list[float]]:
    """Step durations (loss-log times) by class (step_classes), and "all": every step
    once the first drain is over."""
    t = {r["step"]: r["time"] for r in events(work / "losses.jsonl", "loss")}
    drains = ckpt_events(work, "pfs_commit")
    out = {k: [] for k in ("local", "local_drain", "drain", "undisturbed", "first_local", "first_drain", "all")}
    for s, kind in step_classes(work, steps).items():
        out[kind].append(t[s] - t[s - 1])
    for s in range(3, steps):
        if s in t and s - 1 in t and drains and t[s - 1] >= drains[0]["time"]:
            out["all"].append(t[s] - t[s - 1])
    return out


def inflation(works: list[Path], steps: int) -> tuple[dict, float]:
    """Each kind of step's inflation over `works` (classify_steps; each step against its
    own job's median undisturbed step, the steps pooled, the median taken; "all": a PFS
    period's extra time in all, its steps' mean extra x its steps) and the median
    undisturbed step."""
    per_run = [classify_steps(w, steps) for w in works]
    unds = [statistics.median(r["undisturbed"]) for r in per_run]
    infl = {}
    for k in ("local", "local_drain", "drain", "first_local", "first_drain", "all"):
        shares = [t / u - 1 for r, u in zip(per_run, unds) for t in r[k]]
        if shares:
            infl[k] = statistics.mean(shares) * PFS_EVERY if k == "all" else statistics.median(shares)
    return infl, statistics.median(unds)


def step_peaks(work: Path, ranks: int) -> dict[int, int]:
    """The largest rank's peak RSS in each logged step (since the previous one; the
    first also holds start-up), from every rank's telemetry.peak_rss_since_last."""
    out: dict[int, int] = {}
    for rank in range(ranks):
        for r in events(work / f"sched.{rank}", "sched"):
            if r.get("peak_rss"):
                out[r["step"]] = max(out.get(r["step"], 0), r["peak_rss"])
    return out


def peak_during(on: Path, off: Path, steps: int, ranks: int, how=max) -> tuple[int, int]:
    """(checkpointing off, tiers on): the largest rank's peak RSS over the steps the
    tiers-on job saved or drained in (step_classes, first save and drain included);
    the job with checkpointing off over the same steps. What the issue asks, without
    start-up's and the last step's peaks, which move by up to a tenth between runs
    of the same job. `how=statistics.median`: the median of those steps' peaks, which
    the heap's wandering from step to step moves less."""
    busy = {s for s, kind in step_classes(on, steps).items() if kind != "undisturbed"}

    def peak(work: Path) -> int:
        return how([v for s, v in step_peaks(work, ranks).items() if s in busy])

    return peak(off), peak(on)


def drop_checkpoints(work: Path) -> None:
    """A finished job's steps, local and PFS (several GiB a 100M job): what the table
    reads is its logs, which stay. Kept, 3 jobs of each model filled this disk."""
    shutil.rmtree(work / "local", ignore_errors=True)
    shutil.rmtree(work / "dump" / "checkpoint", ignore_errors=True)


def shown(infl: dict, kind: str, fmt: str = "+.3f") -> str:
    """A kind of step's inflation, or why there is none: a drain that ended in the
    step after its save leaves no later step."""
    return format(infl[kind], fmt) if kind in infl else "no such step"


def median_pair(pairs: list[tuple[int, int]]) -> tuple[int, int]:
    """The (off, on) pair whose difference is the median (RUNS is odd)."""
    return sorted(pairs, key=lambda p: p[1] - p[0])[len(pairs) // 2]


INFLATION = {"local": "a local save",
             "local_drain": "a PFS save's local save and the start of its drain (the step after it holds both)",
             "drain": "a PFS drain after its save's step (the whole drain, held to the next step boundary)"}


def _group(thread: str) -> str:
    return "main" if thread == "main" else "ckpt" if thread.startswith("ckpt") else (
        "gloo" if "gloo" in thread else "other")


def _split(a: dict, b: dict) -> dict:
    """One step's time between two scheduler samples (seconds): wall, each thread
    group's (on a CPU, waiting for a core), and the training thread asleep."""
    d = {"wall": b["time"] - a["time"]}
    for name, (on_cpu, waiting) in b["threads"].items():
        was = a["threads"].get(name, [0, 0])
        for i, now in ((0, on_cpu), (1, waiting)):
            d[(_group(name), i)] = d.get((_group(name), i), 0.0) + (now - was[i]) / 1e9
    d["asleep"] = d["wall"] - d.get(("main", 0), 0.0) - d.get(("main", 1), 0.0)
    d["cpu"] = sum(v for k, v in d.items() if isinstance(k, tuple) and k[1] == 0)
    return d


def where_time_goes(works: list[Path], steps: int, ranks: int) -> str:
    """A step's time by where it goes (ms, mean over ranks and steps): the training
    thread on a CPU, waiting for one, and asleep (a collective, the GIL, the loader);
    the gloo threads' waits for a core, and the checkpointer threads' CPU. From every
    rank's scheduler counters at each step (priority.thread_times)."""
    by_kind: dict[str, list[dict]] = {}
    for w in works:
        kinds = step_classes(w, steps)
        for rank in range(ranks):
            recs = {r["step"]: r for r in events(w / f"sched.{rank}", "sched")}
            for s, kind in kinds.items():
                if s in recs and s - 1 in recs:
                    by_kind.setdefault(kind, []).append(_split(recs[s - 1], recs[s]))
    parts = []
    for kind in ("undisturbed", "local", "local_drain", "drain"):
        ds = by_kind.get(kind)
        if not ds:
            continue

        def ms(k):
            return statistics.mean(d.get(k, 0.0) for d in ds) * 1e3

        busy = ranks * ms("cpu") / ((os.cpu_count() or 1) * ms("wall"))
        parts.append(f"{kind} {ms('wall'):.0f} (the cores {busy:.0%} busy) = "
                     f"{ms(('main', 0)):.0f} training thread on a CPU + "
                     f"{ms(('main', 1)):.0f} waiting for a core + {ms('asleep'):.0f} asleep; "
                     f"gloo threads {ms(('gloo', 0)):.0f} on a CPU + {ms(('gloo', 1)):.0f} waiting for a core, "
                     f"{ms(('ckpt', 0)):.0f} checkpointer threads on a CPU")
    return "; ".join(parts)


def copy_threads(works: list[Path]) -> str:
    """Which thread ran each save's staging copy (rank 0's stage events), with counts:
    the row's staging_copy took effect (the last step's copy always runs in save())."""
    counts = Counter(e.get("copy_thread", "?") for w in works for e in ckpt_events(w, "stage"))
    return ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))


def later(works: list[Path], kind: str) -> list[dict]:
    """Each run's events of `kind` but its first (a layout's first save or drain)."""
    return [e for w in works for e in ckpt_events(w, kind)[1:]]


def phases(evs: list[dict]) -> str:
    """Median CPU (wall) ms of each phase over events that record them."""
    names = list(dict.fromkeys(k for e in evs for k in e.get("phases", {})))
    return ", ".join(f"{k} {statistics.median(e['phases'][k][1] for e in evs if k in e['phases']) * 1e3:.1f} "
                     f"({statistics.median(e['phases'][k][0] for e in evs if k in e['phases']) * 1e3:.0f})"
                     for k in names)


def floor_s(nbytes: int) -> float:
    """memcpy + CRC-32C of `nbytes`, alone: the least a save can cost a core."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(3)
    dst = torch.empty_like(src)
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        files.checksum(memoryview(dst.numpy()))
        best.append(time.perf_counter() - t0)
    return statistics.median(best)


# /proc/stat's first line, every core: the fields of time spent in the kernel (system,
# irq, softirq) and busy at all (those, user, nice and steal)
KERNEL_FIELDS, BUSY_FIELDS = (2, 5, 6), (0, 1, 2, 5, 6, 7)


def machine_cpu_s(fields: tuple = BUSY_FIELDS) -> float:
    """The whole machine's CPU time so far in `fields` of /proc/stat, in seconds (to
    the clock tick): a write's I/O completions run in whatever thread they interrupt,
    not in the writer's."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return sum(ticks[i] for i in fields) / os.sysconf("SC_CLK_TCK")


def _page_aligned(nbytes: int, shared: bool = False) -> memoryview:
    """`nbytes` (whole pages) in the plugin's own staging buffer, filled: what the
    local writer hands O_DIRECT (`shared`: the byte helper's, shared memory)."""
    from titan_ckpt_plus.staging import HostBuffer

    buf = HostBuffer(pin=False, shared=shared).ensure(nbytes // files.PAGE * files.PAGE)
    return memoryview(buf.fill_(3).numpy())


def write_kernel_s(nbytes: int, folder: Path, total: int = 2 << 30, shared: bool = False) -> tuple[float, float]:
    """The kernel's CPU time (any core, any thread) to write `nbytes` durably the
    way the local tier does (files.DurableBatch: O_DIRECT from the staging buffer,
    fsync'd), and the write's wall time, measured over about `total` bytes so the
    clock tick (10 ms) does not round it away, machine otherwise idle. What no
    in-process write of the bytes can avoid on this machine's disk: the share of a
    save's cost that the floor (memcpy + CRC) leaves out. `shared`: from the byte
    helper's shared buffer (_page_aligned)."""
    buf = _page_aligned(nbytes, shared)
    path, spare = str(folder / "write-floor"), str(folder / "write-floor.spare")
    rounds, spent, walls = max(1, total // nbytes), [], []
    for _ in range(3):  # the median: other kernel work (reclaim, the VM's timers) comes and goes
        k0, t0 = machine_cpu_s(KERNEL_FIELDS), time.perf_counter()
        for _ in range(rounds):
            with files.DurableBatch() as batch:
                batch.write(path, buf, known_crc=lambda: 0, reuse=spare)  # the CRC is the floor's
            files.retire(path, spare)
        spent.append((machine_cpu_s(KERNEL_FIELDS) - k0) / rounds)
        walls.append((time.perf_counter() - t0) / rounds)
    for p in (path, spare):
        if os.path.exists(p):
            os.remove(p)
    return statistics.median(spent), statistics.median(walls)


def page_rows(nbytes: int, folder: Path) -> list[tuple]:
    """The local write of `nbytes` from the threads' buffer (anonymous memory, huge
    pages where Linux gives them) against the byte helper's (shared memory: huge
    pages only where /sys/kernel/mm/transparent_hugepage/shmem_enabled allows), in
    turn: O_DIRECT pins every page it writes from, and the kernel's time for it is
    taken from the training ranks' cores."""
    got = {False: [], True: []}
    for _ in range(2):
        for shared in (False, True):
            got[shared].append(write_kernel_s(nbytes, folder, shared=shared))
    (k_anon, w_anon), (k_shm, w_shm) = (tuple(map(statistics.median, zip(*got[s]))) for s in (False, True))
    mode = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    shmem = mode.read_text().split("[")[1].split("]")[0] if mode.exists() else "unknown"
    return [(f"local write of {nbytes / 2**20:.1f} MiB from the threads' buffer (anonymous, huge pages): "
             "kernel CPU / wall", f"{k_anon * 1e3:.0f} ms / {w_anon * 1e3:.0f} ms", "", None),
            (f"the same from the byte helper's shared buffer (shmem_enabled = {shmem}): kernel CPU / wall",
             f"{k_shm * 1e3:.0f} ms / {w_shm * 1e3:.0f} ms ({k_shm - k_anon:+.3f} s / {w_shm - w_anon:+.3f} s)",
             "", None)]


def _bench_checkpointer(nbytes: int, folder: Path, nice: int, idle: bool, byte_helper: bool = False):
    """The launch-bound rows' checkpointer: world size 1 (gloo), `nbytes` of state in 16
    tensors, local and PFS every step, its threads `nice` below (and in SCHED_IDLE with
    `idle`), its local data files written by a byte helper with `byte_helper`
    ([checkpoint] helper_process). Returns it and what to call at the end."""
    import torch.distributed as dist

    from titan_ckpt_plus.checkpointer import TieredCheckpointer, TierSettings
    from titan_ckpt_plus.telemetry import EventLog

    from harness import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    n = nbytes // 4 // 16
    state = {"model": {f"w{i}": torch.randn(n) for i in range(16)}, "train_state": {"step": 0}}
    s = TierSettings(str(folder / "local"), str(folder / "pfs"), 1, 1, 2, 2, 0, 1, True, job_id="bench",
                     background_nice=nice, background_idle=idle, helper_process=byte_helper)
    ck = TieredCheckpointer(s, lambda: state, EventLog(None))

    def close() -> None:
        ck.close()
        dist.destroy_process_group()
    return ck, close


class _SaveHere:
    """A save + drain in this process: staged in start(), written and drained by a
    thread while the loop runs (the loop is one long step)."""

    def __init__(self, *args) -> None:
        self.ck, self.close = _bench_checkpointer(*args)

    def start(self, step: int) -> None:
        self.ck.save(step)
        self.ck.wait_for_staging()
        self.busy = threading.Thread(target=self.ck.flush, args=(False,))
        self.busy.start()

    def done(self) -> bool:
        return not self.busy.is_alive()

    def finish(self) -> None:
        self.busy.join()


def _helper(conn, *args) -> None:
    """The helper process of _SaveInHelper: its own state, checkpointer and GIL."""
    torch.set_num_threads(1)
    ck, close = _bench_checkpointer(*args)
    while (step := conn.recv()) is not None:
        ck.save(step)
        ck.wait_for_staging()
        conn.send("staged")
        ck.flush(False)
        conn.send("done")
    close()


class _SaveInHelper:
    """The same save + drain in a helper process (what torchtitan's async_with_pinned_mem
    does with its writes): the loop shares no GIL with it, only the machine."""

    def __init__(self, *args) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_helper, args=(theirs, *args))
        self.proc.start()

    def start(self, step: int) -> None:
        self.conn.send(step)
        self.conn.recv()

    def done(self) -> bool:
        return self.conn.poll()

    def finish(self) -> None:
        self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join()


def _loop_thread() -> tuple[int, float, float]:
    """This thread's (voluntary context switches, seconds on a CPU, seconds waiting for
    one) so far, from /proc: a thread of tiny ops sleeps only to wait for the GIL."""
    tid = threading.get_native_id()
    with open(f"/proc/self/task/{tid}/status") as f:
        switches = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        run, wait, _ = (int(x) for x in f.read().split())
    return switches, run / 1e9, wait / 1e9


def launch_bound(nbytes: int, folder: Path, nice: int, idle: bool, rounds: int = 5,
                 helper: bool = False, byte_helper: bool = False) -> dict:
    """A loop of tiny ops, timed alone and while a save + drain of `nbytes` of state
    (each after the first, which is not timed) run in this process (in a helper
    process with `helper`), their threads `nice` below the loop's (and in SCHED_IDLE
    with `idle`). Also how often the loop's thread
    went to sleep during them (each a wait for the GIL) and its share of time asleep,
    and its share of time off a CPU (asleep or waiting for a core) during them, less
    alone: what the save + drain took from the loop's thread outright, apart from how
    fast it ran while on a CPU (which moves with the machine from minute to minute)."""

    def loop(k: int = 40) -> float:
        """k x 100 tiny ops."""
        x = torch.ones(4)
        start = time.perf_counter()
        for _ in range(k):
            for _ in range(100):
                x = x + 1
        return time.perf_counter() - start

    saver = (_SaveInHelper if helper else _SaveHere)(nbytes, folder, nice, idle, byte_helper)
    # alone and during interleaved, round by round, alone for as long as the last
    # round's save + drain: the machine's speed drifts over seconds (a previous job's
    # writeback, the host; one VM's loop ran 16 ms or 26-32 ms a sample, switching
    # every few hundred ms), and 3 samples alone a round against a second of samples
    # during moved the median by up to 40 points from run to run
    alone, during, sleeps, asleep = [], [], 0, 0.0
    off = {"alone": [0.0, 0.0], "during": [0.0, 0.0]}  # seconds off a CPU (asleep or waiting), of seconds
    # a first save + drain untimed: the layout's first (DCP plans it; once a job, the jobs'
    # table has its own column), and in a helper process the wait for its start-up, whose
    # imports on the other core had slowed the first round's loop alone by 5-10%
    saver.start(1)
    saver.finish()
    last = 0.5
    for step in range(2, rounds + 2):
        (_, run0, _), t0 = _loop_thread(), time.perf_counter()
        while time.perf_counter() - t0 < last:
            alone.append(loop())
        _off(off["alone"], t0, run0)
        saver.start(step)
        (n0, run0, wait0), t0 = _loop_thread(), time.perf_counter()
        while not saver.done():
            during.append(loop())
        (n1, run1, wait1), last = _loop_thread(), time.perf_counter() - t0
        _off(off["during"], t0, run0)
        saver.finish()
        sleeps += n1 - n0
        asleep += last - (run1 - run0) - (wait1 - wait0)
    saver.close()
    # means: the loop's speed is bimodal on some hosts, and a median jumps between modes
    return {"alone_s": statistics.fmean(alone), "during_s": statistics.fmean(during), "samples": len(during),
            "sleeps": sleeps / rounds, "asleep": asleep / sum(during),
            "off": off["during"][0] / off["during"][1] - off["alone"][0] / off["alone"][1]}


def _off(acc: list, t0: float, run0: float) -> None:
    """Adds the loop thread's time off a CPU (asleep or waiting for one) since (t0,
    run0), and the time, to `acc`."""
    _, run, _ = _loop_thread()
    wall = time.perf_counter() - t0
    acc[0] += wall - (run - run0)
    acc[1] += wall


def _neighbour(kind: str, nbytes: int, path: str, ready, stop) -> None:
    """The other core's work for neighbour_cost, in its own process on CPU 1."""
    os.sched_setaffinity(0, {1})
    torch.set_num_threads(1)
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(3)
    dst = torch.empty_like(src)
    aligned = _page_aligned(nbytes)
    ready.set()
    while not stop.is_set():
        if kind == "memcpy":
            dst.copy_(src)
        elif kind == "CRC-32C":
            files.checksum(memoryview(src.numpy()))
        elif kind == "O_DIRECT write":  # the local writer's own write, its CRC left out
            with files.DurableBatch() as batch:
                batch.write(path, aligned, known_crc=lambda: 0)
        else:
            time.sleep(0.01)


def neighbour_cost(nbytes: int, folder: Path, rounds: int = 4) -> dict:
    """How much a compute loop on CPU 0 (matmuls, standing in for a step's math) slows
    while CPU 1 copies, checksums or O_DIRECT-writes `nbytes` over and over, against
    CPU 1 idle: what moving the rank's bytes costs a training core that it never runs
    on (shared caches, memory bandwidth, the host's I/O work). Rounds interleaved."""
    if len(os.sched_getaffinity(0)) < 2:
        return {}
    folder.mkdir(parents=True, exist_ok=True)
    was = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a, w = torch.randn(256, 1024), torch.randn(1024, 1024)

    def loop() -> float:
        t0 = time.perf_counter()
        for _ in range(20):
            (a @ w).relu_()
        return time.perf_counter() - t0

    kinds = ("idle", "memcpy", "CRC-32C", "O_DIRECT write")
    times: dict = {k: [] for k in kinds}
    try:
        for _ in range(rounds):
            for kind in kinds:
                p, stop = _start_ready(_neighbour, kind, nbytes, str(folder / "n.bin"),
                                       what=f"the neighbour process ({kind})")
                time.sleep(0.2)
                times[kind] += [loop() for _ in range(8)]
                stop.set()
                p.join()
    finally:
        os.sched_setaffinity(0, was)
        torch.set_num_threads(threads)
    alone = statistics.median(times["idle"])
    return {k: statistics.median(v) / alone - 1 for k, v in times.items() if k != "idle"}


def drain_paths(nbytes: int, folder: Path) -> dict:
    """One rank's state made a PFS step three ways, in one idle process (world size 1):
    `dcp.save` of it (what the drain did before the local part was framed); the drain
    as it is, PartCopyWriter (the framed local part read once with its CRC-32C checked,
    the items written with theirs); and a kernel copy of the same file
    (`copy_file_range`, nothing checked) as the least a copy can cost. Each fsync'd,
    the best of three. The copied step must load back equal to the state."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from harness import free_port
    from titan_ckpt_plus import staging
    from titan_ckpt_plus.drain import PartSource
    from titan_ckpt_plus.tiers.local import LocalTier
    from titan_ckpt_plus.tiers.pfs import PfsTier
    from titan_ckpt_plus.votes import GlooVotes

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    pg = dist.new_group(backend="gloo")
    n = nbytes // 4 // 16
    state = {"model": {f"w{i}": torch.randn(n) for i in range(16)}, "train_state": {"step": 3}}
    layout, tensors, specs = staging.plan_layout(state)
    buf = staging.HostBuffer(pin=False)
    buf.copy_in(layout, tensors)
    local = LocalTier(str(folder / "local"), 0, 1, True, 2, job_id="bench")
    local.write_part(3, buf.data[: layout.total_bytes].numpy(), lambda: (layout.to_bytes(), {}))
    pfs = PfsTier(str(folder / "pfs"), 0, 1, 0, job_id="bench")
    src = local.data_file(3)[0]
    out = {"dcp_save_s": [], "copy_s": [], "kernel_s": []}
    for i in range(3):
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=str(folder / f"dcp{i}"), process_group=pg)
        out["dcp_save_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        source = PartSource(layout.total_bytes, None, *local.data_file(3))  # the file: the slower way
        pfs.save(3 + i, layout, specs, source, GlooVotes(pg))
        out["copy_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with open(src, "rb") as f, open(folder / f"kernel{i}", "wb") as g:
            left = os.fstat(f.fileno()).st_size
            while left:
                left -= os.copy_file_range(f.fileno(), g.fileno(), left)
            os.fsync(g.fileno())
        out["kernel_s"].append(time.perf_counter() - t0)
    back = {"model": {k: torch.zeros_like(t) for k, t in state["model"].items()}, "train_state": {"step": 0}}
    dcp.load(back, checkpoint_id=pfs.step_dir(5), process_group=pg)
    out = {k: min(v) for k, v in out.items()}
    out["loads_equal"] = (all(torch.equal(back["model"][k], t) for k, t in state["model"].items())
                          and back["train_state"]["step"] == 3)
    dist.destroy_process_group()
    return out


def write_paths(nbytes: int, folder: Path, reps: int = 7) -> dict:
    """A rank's part written durably the local tier's two ways, alternating, 0.4 s
    apart (this disk's speed moves within seconds), in one idle process: into a new
    file, the previous one deleted after (as retention did), and over a retired file
    (files.retire: what a save does now). Medians; both through the local
    writer's own DurableBatch, O_DIRECT from the page-aligned staging buffer."""
    from titan_ckpt_plus.staging import HostBuffer

    data = memoryview(HostBuffer(pin=False).ensure(nbytes).fill_(5).numpy())
    folder.mkdir(parents=True, exist_ok=True)
    out: dict = {"new_s": [], "delete_s": [], "over_s": []}
    spare = folder / "spare"
    with files.DurableBatch() as batch:
        batch.write(str(spare), data)
    for i in range(reps):
        time.sleep(0.4)
        t0 = time.perf_counter()
        with files.DurableBatch() as batch:
            batch.write(str(folder / f"new{i}"), data)
        out["new_s"].append(time.perf_counter() - t0)
        if i:
            t0 = time.perf_counter()
            os.unlink(folder / f"new{i - 1}")
            out["delete_s"].append(time.perf_counter() - t0)
        time.sleep(0.4)
        t0 = time.perf_counter()
        with files.DurableBatch() as batch:
            batch.write(str(folder / "over"), data, reuse=str(spare))
        out["over_s"].append(time.perf_counter() - t0)
        os.rename(folder / "over", spare)
    shutil.rmtree(folder, ignore_errors=True)
    return {k: statistics.median(v) for k, v in out.items()}


def flavor_state(model_flavor: str, shard, rank: int, world: int) -> dict:
    """A rank's state of a llama3 flavor as torchtitan's state_dict() gives it: the
    model and AdamW moments, each made by `shard(full shape)`, and the small items."""
    from titan_ckpt_plus import flavors
    from torchtitan.models.llama3 import Transformer, llama3_args

    flavors.register()
    with torch.device("meta"):
        shapes = {k: p.shape for k, p in Transformer(llama3_args[model_flavor]).named_parameters()}
    return {"model": {k: shard(v) for k, v in shapes.items()},
            "optimizer": {"state": {k: {"exp_avg": shard(v), "exp_avg_sq": shard(v), "step": torch.tensor(1.0)}
                                    for k, v in shapes.items()},
                          "param_groups": [{"lr": 8e-4, "betas": (0.9, 0.95), "params": list(shapes)}]},
            "lr_scheduler": {"last_epoch": 1, "_step_count": 2},
            "dataloader": {f"dp_rank_{rank}": os.urandom(512), "world_size": world},
            "train_state": {"step": 1, "ntokens_seen": 0}}


def sharded_flavor_state(flavor: str) -> tuple[dict, int, int, int]:
    """Under torchrun, gloo's group joined: this rank's state of `flavor` (a MODELS row),
    sharded as FSDP shards it over the ranks, no training; with the rank, the world
    size and the rank's tensor bytes (the model and its two AdamW moments)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    def shard(shape) -> DTensor:
        rows = -(-shape[0] // world)
        local = torch.randn(max(0, min(rows, shape[0] - rank * rows)), *shape[1:])
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())

    state = flavor_state(MODELS[flavor][0], shard, rank, world)
    return state, rank, world, sum(t.to_local().nbytes for t in state["model"].values()) * 3


def plugin_memory_worker(flavor: str, step_s: float, out: Path) -> None:
    """One rank of plugin_memory (under torchrun): the flavor's state, sharded as FSDP
    shards it over 2 ranks (model, AdamW moments, small items), no training. Its RSS
    is taken with the state allocated; then the engine saves it every LOCAL_EVERY
    steps and drains every PFS_EVERY, `step_s` apart, and each step's peak RSS is
    taken (telemetry.peak_rss_since_last, reset each step, as the jobs' are)."""
    import gc
    import json

    import torch.distributed as dist

    from titan_ckpt_plus.checkpointer import TieredCheckpointer, TierSettings
    from titan_ckpt_plus.priority import can_leave_idle
    from titan_ckpt_plus.telemetry import EventLog, peak_rss_since_last

    state, rank, world, nbytes = sharded_flavor_state(flavor)
    root = out.parent / "memory-run"
    s = TierSettings(local_root=str(root / "local" / "job"), pfs_folder=str(root / "pfs"),
                     local_interval=LOCAL_EVERY, pfs_interval=PFS_EVERY, local_keep=2, pfs_keep=2,
                     rank=rank, world_size=world, first_on_node=rank == 0, node_ranks=list(range(world)),
                     job_id="memory", background_idle=can_leave_idle())
    dist.barrier()
    gc.collect()
    peak_rss_since_last()
    before = peak_rss_since_last()  # the job's own: the state, torch, gloo
    ckpt = TieredCheckpointer(s, lambda: state, EventLog(None))
    peaks = []
    for step in range(1, 3 * PFS_EVERY + 1):
        ckpt.save(step, last_step=step == 3 * PFS_EVERY)
        ckpt.wait_for_staging()
        time.sleep(step_s)
        peaks.append(peak_rss_since_last())
    ckpt.close()
    out.with_suffix(f".{rank}").write_text(json.dumps({"before": before, "peaks": peaks, "bytes": nbytes}))
    dist.barrier()
    dist.destroy_process_group()


def plugin_memory(flavor: str, step_s: float, base: Path) -> dict:
    """The plugin's own host memory, apart from a training job's heap (plugin_memory_worker
    on 2 ranks): the largest rank's peak RSS over the saves and drains, less its RSS
    with the state allocated, and the same less the staging buffer."""
    import json
    import subprocess

    base.mkdir(parents=True, exist_ok=True)
    out = base / "memory"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([*harness.LAUNCH, "--standalone", "--nproc_per_node", "2", __file__,
                           "--memory-worker", flavor, "--step-s", str(step_s), "--out", str(out)],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:]
    ranks = [json.loads(out.with_suffix(f".{r}").read_text()) for r in range(2)]
    extra = max(max(r["peaks"]) - r["before"] for r in ranks)
    nbytes = max(r["bytes"] for r in ranks)
    buffer = staging_buffer_bytes(nbytes)
    shutil.rmtree(base, ignore_errors=True)
    return {"extra": extra, "bytes": nbytes, "beside": extra - buffer}


# the quiet machine's undisturbed steps (BENCHMARKS.md, overhead): a save lands about as
# often against a drain as in the jobs
MEMORY_STEP_S = {"debugmodel": 0.15, "100M": 0.7}
MEMORY_SECTION = "## Overhead controls: the plugin's own host memory"


# glibc's heap held still, in both jobs of a memory pair: a fixed mmap threshold turns off
# its dynamic one, which rises to each large block freed (up to 32 MiB) and then keeps
# freed blocks below it in the heap. With it the same 100M job with checkpointing off
# peaked at 1.43 GiB from its second step on in two runs, against 1.6-2.2 GiB wandering
# from step to step with the default; its steps took 1.8x as long (a page fault per page
# of every large tensor), so only the memory rows run with it.
HEAP_HELD_STILL = {"MALLOC_MMAP_THRESHOLD_": str(256 << 10)}


def staging_buffer_bytes(nbytes: float) -> int:
    """What a rank's staging buffer of `nbytes` holds: whole 2 MiB pages."""
    return staging.HUGE_PAGE * -(-int(nbytes) // staging.HUGE_PAGE)


def held_still_memory(flavor: str, base: Path) -> dict:
    """The job with checkpointing off, then with the tiers on, both with HEAP_HELD_STILL:
    the largest rank's peak RSS over the steps that saved or drained (peak_during), and
    the median of those steps' peaks, off and on, and the state bytes of a rank."""
    off, on = base / f"{flavor}-still-off", base / f"{flavor}-still-tiers"
    run_job(off, flavor, tiers=False, env=HEAP_HELD_STILL)
    run_job(on, flavor, tiers=True, env=HEAP_HELD_STILL)
    drop_checkpoints(on)
    pair = (on, off, MODELS[flavor][3], MODELS[flavor][4])
    nbytes = statistics.median(e["bytes"] for e in ckpt_events(on, "local_commit"))
    return {"busy": peak_during(*pair), "typical": peak_during(*pair, how=statistics.median), "bytes": nbytes}


def held_still_row(flavor: str, base: Path) -> tuple:
    """The issue's memory target, judged on held_still_memory's jobs."""
    m = held_still_memory(flavor, base)
    (off, on), (t_off, t_on), nbytes = m["busy"], m["typical"], m["bytes"]
    buffer = staging_buffer_bytes(nbytes)
    return (f"{flavor}: extra peak RSS during saves and drains / state bytes, glibc's heap held still in both "
            f"jobs ({' '.join(f'{k}={v}' for k, v in HEAP_HELD_STILL.items())})",
            f"{(on - off) / nbytes:.2f}x, {(on - off - buffer) / 2**20:+.1f} MiB beside the staging buffer "
            f"({off / 2**30:.3f} / {on / 2**30:.3f} GiB); the median such step "
            f"{(t_on - t_off) / nbytes:.2f}x, {(t_on - t_off - buffer) / 2**20:+.1f} MiB",
            "<= 1.1x", (on - off) / nbytes <= 1.1)


def plugin_memory_rows(base: Path) -> list[tuple]:
    """plugin_memory of debugmodel and 100M (reported), and the jobs' memory target judged
    with the heap held still (held_still_row): with glibc's default heap either job's
    peak wanders by more than the target's margin."""
    rows = []
    for flavor, step_s in MEMORY_STEP_S.items():
        m = plugin_memory(flavor, step_s, base / f"memory-{flavor}")
        rows.append((f"{flavor}: the plugin's own peak host memory, no training (2 ranks, the flavor's state "
                     f"shapes, saves every {LOCAL_EVERY} steps of {step_s} s, drains every {PFS_EVERY}) / state bytes",
                     f"{m['extra'] / m['bytes']:.2f}x, {m['beside'] / 2**20:+.1f} MiB beside the staging buffer",
                     "<= 1.1x (the jobs' target)", None))
        rows.append(held_still_row(flavor, base / f"still-{flavor}"))
    return rows


# the launch-bound ways: (nice, SCHED_IDLE, the whole save + drain in another process, helper_process)
LAUNCH_WAYS = {"nice0": (0, False, False, False), "nice10": (10, False, False, False),
               "idle": (0, True, False, False), "helper": (0, True, False, True), "control": (0, True, True, False),
               "control-helper": (0, True, True, True)}


def launch_bound_rows(nbytes: int, base: Path, names: tuple[str, ...] = tuple(LAUNCH_WAYS),
                      reps: int = LAUNCH_REPS) -> list[tuple]:
    """The launch-bound target at nice 0, nice 10, in SCHED_IDLE, and in SCHED_IDLE with
    helper_process (the bytes moved by the rank's byte helper), and the SCHED_IDLE save +
    drain whole in a helper process as a control (`names` of LAUNCH_WAYS): the ways
    round-robin, `reps` times, the median of each and its quartiles: one pass can be 20
    points off the next (the machine's speed moves within seconds)."""
    ways = [LAUNCH_WAYS[n] for n in names]
    slows: dict = {w: [] for w in ways}
    sleeps: dict = {w: [] for w in ways if w[1]}  # the SCHED_IDLE ways'
    offs: dict = {w: [] for w in ways if w[1]}
    for rep in range(reps):
        for way in ways:
            nice, idle, helper, byte_helper = way
            folder = base / f"launch-{nice}-{idle}-{helper}-{byte_helper}-{rep}"
            lb = launch_bound(nbytes, folder, nice, idle, helper=helper, byte_helper=byte_helper)
            shutil.rmtree(folder, ignore_errors=True)
            slows[way].append(lb["during_s"] / lb["alone_s"] - 1)
            if idle:
                sleeps[way].append((lb["sleeps"], lb["asleep"]))
                offs[way].append(lb["off"])
    idle_ways = {LAUNCH_WAYS["idle"]: "in this process", LAUNCH_WAYS["helper"]: "with helper_process",
                 LAUNCH_WAYS["control"]: "in a helper process",
                 LAUNCH_WAYS["control-helper"]: "in a helper process with helper_process"}
    rows = [("launch-bound loop: its thread's waits for the GIL (the times it slept) per save + drain, and "
             "its share of time asleep, the SCHED_IDLE save + drain " + " / ".join(idle_ways[w] for w in sleeps),
             " / ".join(f"{statistics.median(n for n, _ in got):.0f} waits, "
                        f"{statistics.median(a for _, a in got):.1%} asleep" for got in sleeps.values()),
             "", None),
            ("launch-bound loop: its share of time off a CPU (asleep or waiting for a core) during the save + "
             "drain, less alone (what they took from its thread outright), the SCHED_IDLE save + drain "
             + " / ".join(idle_ways[w] for w in offs),
             " / ".join(f"{statistics.median(got):+.1%}" for got in offs.values()), "", None)]
    for (nice, idle, helper, byte_helper), got in slows.items():
        slow = statistics.median(got)
        how = "SCHED_IDLE, as \"auto\" within a step" if idle else f"background_nice {nice}"
        if byte_helper:
            how += "; helper_process = true: its bytes moved by the rank's byte helper"
        what = ("the same save + drain in a helper process (a control: what a helper process leaves; "
                if helper else "a concurrent save + drain (")
        if helper and byte_helper:
            how += " (the control's own byte helper)"
        q1, _, q3 = statistics.quantiles(got, n=4) if len(got) > 1 else (slow, slow, slow)
        rows.append((f"launch-bound loop slowed by {what}100M state, {how})",
                     f"{slow:+.1%} (median of {', '.join(f'{g:+.1%}' for g in got)}; quartiles {q1:+.1%} "
                     f"to {q3:+.1%})",
                     *(("", None) if helper else ("<= 5%", slow <= 0.05))))
    for a, b, what in (("helper", "control", "helper_process's slowdown minus the control's"),
                       ("control-helper", "control", "the control with helper_process minus the control without"),
                       ("helper", "control-helper", "helper_process's slowdown minus the control's with it")):
        if slows.get(LAUNCH_WAYS[a]) and slows.get(LAUNCH_WAYS[b]):  # the same minute's machine
            diffs = sorted(x - y for x, y in zip(slows[LAUNCH_WAYS[a]], slows[LAUNCH_WAYS[b]]))
            q1, med, q3 = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else diffs * 3
            rows.append((f"launch-bound loop: {what}, paired round by round",
                         f"{med:+.1%} (quartiles {q1:+.1%} to {q3:+.1%}; the first slower in "
                         f"{sum(d > 0 for d in diffs)} of {len(diffs)} rounds)", "", None))
    return rows


def memory_only(update: Path | None) -> None:
    """--memory-only: the plugin_memory rows in their own section."""
    base = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    rows = plugin_memory_rows(base)
    shutil.rmtree(base, ignore_errors=True)
    body = "\n".join([
        "Command: `.venv/bin/python scripts/bench_overhead.py --memory-only --update BENCHMARKS.md` "
        f"({time.strftime('%Y-%m-%d')}; the full overhead run reports the same rows).", "",
        "| what | measured | for comparison | met? |", "|---|---|---|---|",
        *[f"| {w} | {m} | {t} | {_verdict(ok)} |" for w, m, t, ok in rows], "",
        MEMORY_READING])
    print(body)
    if update:
        update_section(update, MEMORY_SECTION, body)


def _verdict(ok: bool | None) -> str:
    return "reported" if ok is None else "met" if ok else "**NOT met**"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--update", type=Path)
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--launch-bound-only", action="store_true",
                    help="only the launch-bound rows, with 100M's state per rank, printed")
    ap.add_argument("--launch-ways", default=",".join(LAUNCH_WAYS),
                    help=f"with --launch-bound-only: which ways, of {','.join(LAUNCH_WAYS)}")
    ap.add_argument("--launch-reps", type=int, default=LAUNCH_REPS,
                    help="with --launch-bound-only: rounds of the ways")
    ap.add_argument("--pages-only", action="store_true",
                    help="only the local write from the threads' buffer against the byte helper's, printed")
    ap.add_argument("--section", default=SECTION, help="the BENCHMARKS.md section --update writes")
    ap.add_argument("--memory-only", action="store_true",
                    help="only the plugin's own host memory, no training (plugin_memory), in its own section")
    ap.add_argument("--memory-worker", help=argparse.SUPPRESS)  # plugin_memory's ranks
    ap.add_argument("--step-s", type=float, default=0.2, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--bare", action="store_true",
                    help="a third job per run of debugmodel and 100M: checkpointing off, a BareMover per "
                         "rank moving the same bytes at the same steps (the control), in its own table")
    ap.add_argument("--jobs-only", action="store_true",
                    help="the jobs' rows only, without 100M's probes and launch-bound rows (A/B runs)")
    args = ap.parse_args()
    if args.memory_worker:
        plugin_memory_worker(args.memory_worker, args.step_s, args.out)
        return
    if args.memory_only:
        memory_only(args.update)
        return
    if args.pages_only or args.launch_bound_only:  # a few rows, printed
        base = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
        if args.pages_only:
            rows = page_rows(LAUNCH_BOUND_BYTES, base)
        else:
            rows = launch_bound_rows(LAUNCH_BOUND_BYTES, base, tuple(args.launch_ways.split(",")), args.launch_reps)
        for what, got, want, ok in rows:
            print(f"| {what} | {got} | {want} | {_verdict(ok)} |")
        shutil.rmtree(base, ignore_errors=True)
        return
    base = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    rows, targets, probe, phase_lines, bare_rows = [], [], "", [], []
    for flavor in args.models.split(","):
        # RUNS jobs each way, interleaved: a job's own peak RSS moves by up to a tenth from
        # run to run, so each tiers-on job is compared with the job run just before it and
        # the median pair is taken; the steps' samples are pooled, each against its own
        # run's undisturbed step
        ons, whole, busy, typical, bares = [], [], [], [], []
        for i in range(RUNS):
            off = run_job(base / f"{flavor}-off{i}", flavor, tiers=False)[1]
            ons.append(base / f"{flavor}-tiers{i}")
            whole.append((off, run_job(ons[-1], flavor, tiers=True)[1]))
            drop_checkpoints(ons[-1])
            if args.bare and flavor in BARE:
                part = statistics.median(e["bytes"] for e in ckpt_events(ons[0], "local_commit"))  # a rank's
                bares.append(base / f"{flavor}-bare{i}")
                run_job(bares[-1], flavor, tiers=False, bare_bytes=int(part))
            pair = (ons[-1], base / f"{flavor}-off{i}", MODELS[flavor][3], MODELS[flavor][4])
            busy.append(peak_during(*pair))
            typical.append(peak_during(*pair, how=statistics.median))
        (rss_off, rss_on), (busy_off, busy_on) = median_pair(whole), median_pair(busy)
        typical_off, typical_on = median_pair(typical)
        typical_extra = typical_on - typical_off
        commits = [e for w in ons for e in ckpt_events(w, "local_commit")]
        drains = [e for w in ons for e in ckpt_events(w, "pfs_commit")]
        rank_bytes = statistics.median(e["bytes"] for e in commits)
        ranks, name = MODELS[flavor][4], LABELS.get(flavor, flavor)
        infl, und = inflation(ons, MODELS[flavor][3])
        floor = floor_s(int(rank_bytes)) / und
        if bares:
            bare = inflation(bares, MODELS[flavor][3])[0]
            bare_rows.append(f"| {name} | {shown(infl, 'local')} / {shown(bare, 'local')} | "
                             f"{shown(infl, 'local_drain')} / {shown(bare, 'local_drain')} | "
                             f"{shown(infl, 'drain')} / {shown(bare, 'drain')} | "
                             f"{shown(infl, 'all', '+.2f')} / {shown(bare, 'all', '+.2f')} |")
            for k in ("local", "local_drain"):
                if k in bare:
                    targets.append((f"{name}: step inflation during {INFLATION[k]}, the same bytes moved by a "
                                    "bare process instead (control: what moving them costs on this machine)",
                                    f"{bare[k]:+.3f} of a step", "", None))
        limits = pooled_limits([machine_limits(int(rank_bytes), w / "dump" / "checkpoint" / "bw", ranks=ranks)
                                for w in ons])
        drain_s = statistics.median(e["background_write_s"] for e in drains)
        # rank 0's background CPU per save and per drain (thread CPU time), against the floor's
        save_cpu = statistics.median(e["cpu_s"] + e["staging_cpu_s"] for e in commits)
        drain_cpu = statistics.median(e["cpu_s"] for e in drains)
        bound_s = ranks * rank_bytes / limits["write_Bps"]
        phase_lines.append(f"{name}, rank 0, CPU ms by phase (wall ms): "
                           f"a save's write: {phases(later(ons, 'local_commit'))}; "
                           f"a drain: {phases(later(ons, 'pfs_commit'))}; "
                           f"the staging copies ran on: {copy_threads(ons)}")
        phase_lines.append(f"{name}, where a step's time goes, ms (mean of the ranks' steps): "
                           f"{where_time_goes(ons, MODELS[flavor][3], ranks)}")
        extra, busy_extra = rss_on - rss_off, busy_on - busy_off
        rows.append(f"| {name} | {rank_bytes / 2**20:.1f} MiB | {und:.3f} s | {floor:.3f} | "
                    f"{shown(infl, 'local')} | {shown(infl, 'local_drain')} | {shown(infl, 'drain')} | "
                    f"{shown(infl, 'all', '+.2f')} | "
                    f"{shown(infl, 'first_local')} / {shown(infl, 'first_drain')} | "
                    f"{drain_s:.3f} s / {bound_s:.3f} s = {drain_s / bound_s:.1f}x | "
                    f"{rss_off / 2**30:.3f} / {rss_on / 2**30:.3f} GiB: {extra / rank_bytes:.2f}x | "
                    f"{busy_off / 2**30:.3f} / {busy_on / 2**30:.3f} GiB: {busy_extra / rank_bytes:.2f}x | "
                    f"{floor * und * 1e3:.0f} / {save_cpu * 1e3:.0f} / {drain_cpu * 1e3:.0f} ms |")
        for k in ("local", "local_drain", "drain"):
            if k in infl:
                targets.append((f"{name}: step inflation during {INFLATION[k]}", f"{infl[k]:+.3f} of a step",
                                f"<= floor {floor:.3f} + 0.03", infl[k] <= floor + 0.03))
        targets.append((f"{name}: drain time / (node bytes / PFS bw)", f"{drain_s / bound_s:.1f}x", "<= 1.5x",
                        drain_s / bound_s <= 1.5))
        buffer = staging_buffer_bytes(rank_bytes)
        # reported: the target is judged with the heap held still (plugin_memory_rows)
        targets.append((f"{name}: extra peak RSS during saves and drains / state bytes, glibc's default heap",
                        f"{busy_extra / rank_bytes:.2f}x, {(busy_extra - buffer) / 2**20:+.0f} MiB beside the "
                        f"staging buffer; the median such step {typical_extra / rank_bytes:.2f}x, "
                        f"{(typical_extra - buffer) / 2**20:+.0f} MiB (whole job: {extra / rank_bytes:.2f}x)",
                        "<= 1.1x, judged with the heap held still", None))
        if flavor == "100M" and not args.jobs_only:
            fc = drain_paths(int(rank_bytes), base / "paths")
            probe = (f"A rank's {rank_bytes / 2**20:.0f} MiB (100M) made a PFS step, one idle process, fsync'd, "
                     f"best of 3: `dcp.save` {fc['dcp_save_s']:.2f} s; the drain's copy of the framed local part "
                     f"(read once, CRC-32C checked, written with its own) {fc['copy_s']:.2f} s; `copy_file_range` "
                     f"of the same file, nothing checked {fc['kernel_s']:.2f} s; the copied step loads back "
                     f"equal: {'yes' if fc['loads_equal'] else '**no**'}.")
            wp = write_paths(int(rank_bytes), base / "writes")
            probe += (f" The rank's part written durably, idle, median of 7 alternating: into a new file "
                      f"{wp['new_s'] * 1e3:.0f} ms, and deleting the old one after {wp['delete_s'] * 1e3:.0f} ms; "
                      f"over a retired file (what a local save does) {wp['over_s'] * 1e3:.0f} ms.")
            cost = neighbour_cost(int(rank_bytes), base / "neighbour")
            if cost:
                probe += (" A compute loop on one core, slowed while the other core moves this rank's bytes "
                          "over and over (against that core idle; " + ", ".join(
                              f"{k} {v:+.1%}" for k, v in cost.items()) + "): the cost a core pays for bytes "
                          "moved on the other one, which the floor does not count.")
            targets += launch_bound_rows(int(rank_bytes), base)
    if not args.jobs_only:
        targets += plugin_memory_rows(base)
    body = "\n".join([
        "Command: `" + " ".join([".venv/bin/python scripts/bench_overhead.py --update BENCHMARKS.md",
                                 *([f"--models {args.models}"] if args.models != DEFAULT_MODELS else []),
                                 *(["--bare"] if args.bare else []), *(["--jobs-only"] if args.jobs_only else []),
                                 *([f"--section {shlex.quote(args.section)}"] if args.section != SECTION else [])])
        + f"` ({time.strftime('%Y-%m-%d')}, 2 CPU ranks but where the row says 1, local every {LOCAL_EVERY} steps, PFS every {PFS_EVERY}; "
        f"{RUNS} jobs with the tiers on and {RUNS} with checkpointing off per model, interleaved).",
        "",
        "| model | state per rank | undisturbed step | floor (copy + CRC, share of a step) | "
        "inflation, local save | inflation, a PFS save's local save + drain start | inflation, rest of the drain | "
        f"a PFS period's extra time in all (its {PFS_EVERY} steps, in steps) | "
        "the layout's first save / first drain (once a job) | "
        "drain / bound | peak RSS off / on, whole job: extra per state byte | "
        "the same during saves and drains | "
        "CPU: floor / a save's copy + write / a drain (rank 0) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows, "",
        "| target | measured | wanted | met? |", "|---|---|---|---|",
        *[f"| {w} | {m} | {t} | {_verdict(ok)} |" for w, m, t, ok in targets],
        *(["", "The same jobs' steps against a control run in turn with them: checkpointing off, and a "
            "process per rank moving the rank's bytes at the saves' steps by the plugin's own syscalls "
            "(memcpy + CRC-32C in SCHED_IDLE, an O_DIRECT fsync'd write over a retired file, once more "
            "at a PFS step; BareMover). What the bare process costs is what moving the bytes costs "
            "training on this machine; the tiers' excess over it is the plugin's own (its Python, "
            "planning, collectives, and the GIL it shares with training).", "",
            "| model | inflation, local save: tiers / bare | a PFS save's local save + drain start: tiers / bare | "
            "rest of the drain: tiers / bare | a PFS period's extra time in all, in steps: tiers / bare |",
            "|---|---|---|---|---|", *bare_rows] if bare_rows else []),
        "", *[f"- {line}" for line in phase_lines],
        "", "The drain's ways, side by side: " + probe if probe else "",
        "", READING,
    ])
    print(body)
    shutil.rmtree(base, ignore_errors=True)  # several GiB of checkpoints per run
    record_targets("overhead", targets)
    if args.update:
        update_section(args.update, args.section, body)


if __name__ == "__main__":
    main()
