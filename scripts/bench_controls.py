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
  - the tiers on, as bench_overhead.py runs them.

Each job's steps are timed against its own undisturbed steps (bench_overhead's
classes). If the controls' steps grow as much as a save's, what is left above the
floor is what any in-process copy of the state costs these 2 busy cores, not the
plugin's other work.

    .venv/bin/python scripts/bench_controls.py [--update BENCHMARKS.md] [--models debugmodel,100M]
"""

import argparse
import json
import os
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
KINDS = ("tiers", "burn", "copy")  # the first tiers job gives the bytes


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
        threading.Thread(target=self._loop, name="ckpt-control", daemon=True).start()

    def kick(self) -> None:
        """On the training thread, where the plugin's save() starts its copy. The first
        kick gathers the tensors here (a module's state_dict() is the training
        thread's to call), in a step the tables leave out (a layout's first save)."""
        from titan_ckpt_plus import staging

        if self.staged is None and self.plan["work"] == "copy":
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
            else:
                self.buffer.copy_in(*self.staged, staging.StagingProgress())


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

    model, seq, batch, steps, nproc, _ = bo.MODELS[flavor]
    common = [f"--model.flavor={model}", f"--training.seq_len={seq}", f"--training.local_batch_size={batch}",
              f"--training.steps={steps}", "--debug.no-deterministic", "--checkpoint.keep_latest_k=2",
              "--checkpoint.local_keep_latest_k=2", "--checkpoint.no-last-save-model-only"]
    if kind == "tiers":
        args, module, env = [f"--checkpoint.local_interval={bo.LOCAL_EVERY}",
                             f"--checkpoint.interval={bo.PFS_EVERY}"], "torchtitan.train", {}
    else:
        plan = {"work": kind, "every": bo.LOCAL_EVERY, "cpu_s": cpu_s}
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


def main() -> None:
    import bench_overhead as bo
    from benchmd import record_targets, update_section

    ap = argparse.ArgumentParser()
    ap.add_argument("--update", type=Path)
    ap.add_argument("--models", default="debugmodel,100M")
    args = ap.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "scripts"), os.environ.get("PYTHONPATH"))
                                               if p)
    base = Path(tempfile.mkdtemp(prefix="bench-controls-"))
    rows, targets, lines = [], [], []
    for flavor in args.models.split(","):
        steps = bo.MODELS[flavor][3]
        shares: dict[str, list[float]] = {k: [] for k in KINDS}
        unds, floor_cpu = [], None
        for i in range(RUNS):  # round-robin: the machine drifts within the hour
            for kind in KINDS:
                work = base / f"{flavor}-{kind}{i}"
                run(work, flavor, kind, floor_cpu or 0.0)
                if floor_cpu is None:  # the rank's bytes, from the first tiers job
                    nbytes = int(statistics.median(e["bytes"] for e in bo.ckpt_events(work, "local_commit")))
                    floor_cpu = bo.floor_s(nbytes)
                shares[kind].append(statistics.median(inflation(work, steps)))
                unds.append(statistics.median(bo.classify_steps(work, steps)["undisturbed"]))
        und = statistics.median(unds)
        for kind in KINDS:
            lines.append(f"{flavor}, {kind}, where a step's time goes, ms (mean of the ranks' steps): "
                         + bo.where_time_goes([base / f"{flavor}-{kind}{i}" for i in range(RUNS)], steps,
                                              bo.MODELS[flavor][4]))
        floor = floor_cpu / und
        med = {k: statistics.median(v) for k, v in shares.items()}
        rows.append(f"| {flavor} | {nbytes / 2**20:.1f} MiB | {und:.3f} s | {floor:.3f} | "
                    + " | ".join(f"{med[k]:+.3f} ({', '.join(f'{x:+.3f}' for x in shares[k])})"
                                 for k in ("burn", "copy", "tiers"))
                    + f" | {med['tiers'] - med['copy']:+.3f} |")
        for k, what in (("burn", "the floor's CPU alone, SCHED_IDLE"), ("copy", "the staging copy + CRC alone")):
            targets.append((f"{flavor}: step inflation of {what} (control)", f"{med[k]:+.3f} of a step",
                            f"<= floor {floor:.3f} + 0.03 (what the target would allow)",
                            None))
    body = "\n".join([
        f"Command: `.venv/bin/python scripts/bench_controls.py --update BENCHMARKS.md` ({time.strftime('%Y-%m-%d')}, "
        f"2 CPU ranks, at every {bo.LOCAL_EVERY}rd step; {RUNS} jobs of each kind, round-robin; each job's median "
        "step after a save (or a kick) against its own undisturbed step; the median of the jobs, and each job's "
        "in brackets).",
        "",
        "| model | state per rank | undisturbed step | floor (share of a step) | the floor's CPU alone: "
        "small products in SCHED_IDLE, no memory traffic | the staging copy + CRC alone (the plugin's, SCHED_IDLE) "
        "| the tiers on: a local save | the tiers on less the copy alone |",
        "|---|---|---|---|---|---|---|---|",
        *rows, "",
        "| what | measured | for comparison | met? |", "|---|---|---|---|",
        *[f"| {w} | {m} | {t} | reported |" for w, m, t, _ in targets],
        "", *[f"- {line}" for line in lines],
        "", __doc__.split("\n\n")[0].replace("\n", " ").strip(),
    ])
    print(body)
    shutil.rmtree(base, ignore_errors=True)
    record_targets("controls", targets)
    if args.update:
        update_section(args.update, SECTION, body)


if __name__ == "__main__":
    worker() if CONTROL_ENV in os.environ else main()
