"""Control rows for issue 15's step-inflation target, in one run: how much a local
save's step grows when a job does only part of a save's work, at the same steps, on a
background thread in SCHED_IDLE (as the plugin's copy thread runs), with checkpointing
off:

  - "burn": the floor's CPU time (memcpy + CRC-32C of the rank's bytes, timed alone in
    this run) spent in small matrix products that stay in the cache: the scheduler's
    share of a save, with no memory traffic, no I/O and no GIL-holding Python;
  - "copy": the plugin's own staging copy and CRC-32C of the rank's state
    (staging.HostBuffer.copy_in, the floor's work), and nothing else: no write, no
    commit, no vote, no drain;
  - "write": that copy, and the local write following it as the plugin's writer
    does (files.DurableBatch, O_DIRECT, over a retired file, fsync'd; a thread in the
    normal class): no vote, commit marker or retention;
  - the tiers on, as bench_overhead.py runs them ("local-only": with no PFS save but
    the last, so the drains' after-effects are apart).

Beside the floor, the kernel's CPU time to write the rank's bytes as the local tier
does (bench_overhead.write_kernel_s: O_DIRECT submissions and their completions,
which run on whichever core they interrupt), measured alone in the same run.

Each job's steps are timed against its own undisturbed steps (bench_overhead's
classes). If the controls' steps grow as much as a save's, what is left above the
floor is what any in-process copy of the state costs these 2 busy cores, not the
plugin's other work.

    .venv/bin/python scripts/bench_controls.py [--update BENCHMARKS.md] [--models debugmodel,100M]
"""

import argparse
import json
import os
import queue
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

CONTROL_ENV = "TITAN_CKPT_BENCH_CONTROL"  # the worker's plan: {"work", "every", "cpu_s"}
SECTION = "## Overhead controls: part of a save's work alone"
RUNS = 3
KINDS = ("tiers", "burn", "copy", "write")  # the default run; the first tiers job gives the bytes
CONTROLS = (("burn", "the floor's CPU alone, SCHED_IDLE"), ("copy", "the staging copy + CRC alone"),
            ("write", "the copy + the local write"))
HEADERS = dict(CONTROLS, **{"local-only": "the tiers on, no PFS save but the last: a local save",
                            "tiers": "the tiers on: a local save"})
DIFFERENCES = (("write", "copy", "the write's share (write less copy)"),
               ("tiers", "write", "the rest of a save (tiers less write)"),
               ("tiers", "local-only", "the PFS saves' share (tiers less local-only)"))


# ---- the worker: a torchtitan job with checkpointing off, and the control's thread ----

def _local_state(trainer) -> dict:
    """The rank's model and optimizer tensors (their local shards), as a save stages them."""
    import torch

    def local(v):
        return v.to_local() if hasattr(v, "to_local") else v

    out = {}
    for i, part in enumerate(trainer.model_parts):
        out.update({f"model{i}.{k}": local(v) for k, v in part.state_dict().items()})
    for i, opt in enumerate(trainer.optimizers.optimizers):
        for j, st in enumerate(opt.state.values()):
            out.update({f"opt{i}.{j}.{k}": local(v) for k, v in st.items() if torch.is_tensor(v)})
    return out


def _burn(cpu_s: float) -> None:
    """`cpu_s` of this thread's CPU in products of small matrices (cache-resident,
    the GIL released in each, about 2 ms apiece)."""
    import torch

    a = torch.randn(320, 320)
    c = torch.empty_like(a)
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        torch.mm(a, a, out=c)


class ControlThread:
    """Does the control's work once per kick, in SCHED_IDLE, never waited for."""

    def __init__(self, trainer, plan: dict) -> None:
        from titan_ckpt_plus import staging

        self.trainer, self.plan, self.kicked = trainer, plan, threading.Event()
        self.buffer = staging.HostBuffer(pin=False)
        self.staged = None  # (layout, tensors): the same tensors every step (updated in place)
        self.to_write: queue.Queue = queue.Queue()
        self.written = threading.Event()  # the buffer is free again, as the plugin's next save waits for
        self.written.set()
        threading.Thread(target=self._loop, name="ckpt-control", daemon=True).start()
        if plan["work"] == "write":
            threading.Thread(target=self._write_loop, name="ckpt-control-wr", daemon=True).start()

    def kick(self) -> None:
        """On the training thread, where the plugin's save() starts its copy. The first
        kick gathers the tensors here (a module's state_dict() is the training
        thread's to call), in a step the tables leave out (a layout's first save)."""
        from titan_ckpt_plus import staging

        if self.staged is None and self.plan["work"] in ("copy", "write"):
            layout, tensors, _ = staging.plan_layout(_local_state(self.trainer))
            self.staged = (layout, tensors)
        self.kicked.set()

    def _loop(self) -> None:
        from titan_ckpt_plus import priority, staging

        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        priority.name_this_thread("ckpt-control")  # its CPU shows in the step lines
        while True:
            self.kicked.wait()
            self.kicked.clear()
            if self.plan["work"] == "burn":
                _burn(self.plan["cpu_s"])
                continue
            progress = staging.StagingProgress()
            if self.plan["work"] == "write":
                self.written.wait()
                self.written.clear()
                self.buffer.ensure(self.staged[0].total_bytes)
                self.to_write.put(progress)  # the write follows the copy, as the plugin's
            self.buffer.copy_in(*self.staged, progress)

    def _write_loop(self) -> None:
        """The plugin writer's work on the staged bytes: one file, over the spare the
        previous write left (tiers/files.py)."""
        from titan_ckpt_plus import priority
        from titan_ckpt_plus.tiers import files

        priority.name_this_thread("ckpt-control-wr")
        path, spare = (os.path.join(self.plan["dir"], n) for n in ("data", "spare"))
        os.makedirs(self.plan["dir"], exist_ok=True)
        while True:
            progress = self.to_write.get()
            data = self.buffer.data[: self.staged[0].total_bytes].numpy()
            with files.DurableBatch() as batch:
                batch.write(path, data, before_chunk=progress.wait, known_crc=lambda: progress.crc, reuse=spare)
            files.retire(path, spare)
            self.written.set()


def worker() -> None:
    from torchtitan.train import Trainer, main

    from titan_ckpt_plus.adapters import torchtitan_v022

    torchtitan_v022.install()  # imported before torchtitan: its import hook did not run
    plan = json.loads(os.environ[CONTROL_ENV])

    class ControlTrainer(Trainer):
        def __init__(self, job_config) -> None:
            super().__init__(job_config)
            control, save = ControlThread(self, plan), self.checkpointer.save

            def save_and_kick(curr_step: int, last_step: bool = False) -> None:
                save(curr_step, last_step)  # checkpointing is off: returns at once
                if curr_step % plan["every"] == 0 and not last_step:
                    control.kick()

            self.checkpointer.save = save_and_kick

    main(ControlTrainer)


# ---- the driver ---------------------------------------------------------------------

def run(work: Path, flavor: str, kind: str, cpu_s: float) -> None:
    import bench_overhead as bo
    from harness import torchrun

    _, _, _, steps, nproc, _ = bo.MODELS[flavor]
    common = bo.job_args(flavor)
    if kind in ("tiers", "local-only"):
        pfs_every = bo.PFS_EVERY if kind == "tiers" else 10 * steps
        args, module, env = [f"--checkpoint.local_interval={bo.LOCAL_EVERY}",
                             f"--checkpoint.interval={pfs_every}"], "torchtitan.train", {}
    else:
        plan = {"work": kind, "every": bo.LOCAL_EVERY, "cpu_s": cpu_s, "dir": str(work / "local" / "control")}
        args, module, env = ["--checkpoint.no-enable"], "bench_controls", {CONTROL_ENV: json.dumps(plan)}
    proc = torchrun(work, *common, *args, module=module, timeout=1800, digests=False, nproc=nproc,
                    env={bo.SCHED_LOG_ENV: str(work / "sched"), **env})
    assert proc.returncode == 0, proc.stdout[-3000:]
    bo.drop_checkpoints(work)


def inflation(work: Path, steps: int) -> list[float]:
    """The job's local-save steps (tiers: local-only saves; controls: every kick) as
    shares of its own undisturbed step, less one."""
    import bench_overhead as bo

    classes = bo.classify_steps(work, steps)
    und = statistics.median(classes["undisturbed"])
    return [t / und - 1 for t in classes["local"]]


def _what_each_kind_does() -> list[str]:
    """The docstring's first paragraphs, as the section's closing text."""
    intro, kinds, more = __doc__.split("\n\n")[:3]
    items = ["- " + " ".join(item.split()) for item in kinds.split("  - ")[1:]]
    return [" ".join(intro.split()), *items, "", " ".join(more.split())]


def main() -> None:
    import bench_overhead as bo
    from benchmd import record_targets, update_section

    ap = argparse.ArgumentParser()
    ap.add_argument("--update", type=Path)
    ap.add_argument("--models", default="debugmodel,100M")
    ap.add_argument("--kinds", default=",".join(KINDS), help="tiers first: its job gives the bytes")
    ap.add_argument("--section", default=SECTION, help="the BENCHMARKS.md section --update writes")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(HEADERS) - {"tiers"})
    if unknown or kinds[0] != "tiers":
        ap.error(f"--kinds: tiers first (its job gives the rank's bytes), then any of {sorted(HEADERS)}")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "scripts"), os.environ.get("PYTHONPATH"))
                                               if p)
    base = Path(tempfile.mkdtemp(prefix="bench-controls-"))
    columns = [k for k in HEADERS if k in kinds]
    differences = [d for d in DIFFERENCES if d[0] in kinds and d[1] in kinds]
    rows, targets, lines = [], [], []
    for flavor in args.models.split(","):
        steps = bo.MODELS[flavor][3]
        shares: dict[str, list[float]] = {k: [] for k in kinds}
        unds, floor_cpu = [], None
        for i in range(RUNS):  # round-robin: the machine drifts within the hour
            for kind in kinds:
                work = base / f"{flavor}-{kind}{i}"
                run(work, flavor, kind, floor_cpu or 0.0)
                if floor_cpu is None:  # the rank's bytes, from the first tiers job
                    nbytes = int(statistics.median(e["bytes"] for e in bo.ckpt_events(work, "local_commit")))
                    floor_cpu, kernel_s = bo.floor_s(nbytes), bo.write_kernel_s(nbytes, base)[0]
                shares[kind].append(statistics.median(inflation(work, steps)))
                unds.append(statistics.median(bo.classify_steps(work, steps)["undisturbed"]))
        und = statistics.median(unds)
        for kind in kinds:
            lines.append(f"{flavor}, {kind}, where a step's time goes, ms (mean of the ranks' steps): "
                         + bo.where_time_goes([base / f"{flavor}-{kind}{i}" for i in range(RUNS)], steps,
                                              bo.MODELS[flavor][4]))
        floor = floor_cpu / und
        med = {k: statistics.median(v) for k, v in shares.items()}
        cells = [f"{med[k]:+.3f} ({', '.join(f'{x:+.3f}' for x in shares[k])})" for k in columns]
        cells += [f"{med[a] - med[b]:+.3f}" for a, b, _ in differences]
        rows.append(f"| {flavor} | {nbytes / 2**20:.1f} MiB | {und:.3f} s | {floor:.3f} | {kernel_s / und:.3f} | "
                    + " | ".join(cells) + " |")
        for k, what in CONTROLS:
            if k in med:
                targets.append((f"{flavor}: step inflation of {what} (control)", f"{med[k]:+.3f} of a step",
                                f"<= floor {floor:.3f} + 0.03 (what the target would allow)", None))
    command = " ".join(["`.venv/bin/python scripts/bench_controls.py --update BENCHMARKS.md",
                        *([f"--models {args.models}"] if args.models != ap.get_default("models") else []),
                        *([f"--kinds {args.kinds}"] if args.kinds != ap.get_default("kinds") else []),
                        *([f"--section {shlex.quote(args.section)}"] if args.section != SECTION else [])]) + "`"
    body = "\n".join([
        f"Command: {command} ({time.strftime('%Y-%m-%d')}, "
        f"2 CPU ranks, at every {bo.LOCAL_EVERY}rd step; {RUNS} jobs of each kind, round-robin; each job's median "
        "step after a save (or a kick) against its own undisturbed step; the median of the jobs, and each job's "
        "in brackets).",
        "",
        "| model | state per rank | undisturbed step | floor (share of a step) | the write's kernel CPU alone "
        "(any core; share of a step) | " + " | ".join(HEADERS[k] for k in columns)
        + "".join(f" | {what}" for _, _, what in differences) + " |",
        "|---|---|---|---|---|" + "---|" * (len(columns) + len(differences)),
        *rows, "",
        "| what | measured | for comparison | met? |", "|---|---|---|---|",
        *[f"| {w} | {m} | {t} | reported |" for w, m, t, _ in targets],
        "", *[f"- {line}" for line in lines],
        "", *_what_each_kind_does(),
    ])
    print(body)
    shutil.rmtree(base, ignore_errors=True)
    record_targets("controls", targets)
    if args.update:
        update_section(args.update, args.section, body)


if __name__ == "__main__":
    worker() if CONTROL_ENV in os.environ else main()
