"""The plugin's whole CPU cost per save, no training (issue 15's step targets): on a
machine whose cores training fills, a save's CPU in any thread or the kernel comes
out of the steps, so the step targets (floor + 0.03 of a step) hold only if a save
costs the machine little more than its floor (memcpy + CRC-32C of the rank's bytes).

Two ranks under torchrun hold the flavor's state, sharded as FSDP shards it (as
bench_overhead.plugin_memory), and one engine saves it with the default keys: a
local save at every 2nd step, a PFS save (a local save and its drain) at every 4th,
nothing at odd steps (at rest), a step every `GAP` seconds, long enough for a drain
to end in its own step. Each step is a window: the whole machine's busy time in it
(/proc/stat: user, system, irq, softirq, steal; every thread, every process, the
kernel's), less the mean of the windows at rest, is what a save or a PFS save cost
the machine; each rank's own threads by name (their scheduler counters) tell where, and a few of the
engine's functions (each thread's CPU inside them, per save or drain) where within them.
Before the engine starts, as many windows with no engine show what it costs at rest
(gloo's loop threads, one per process group, wake every 10 ms).

    .venv/bin/python scripts/bench_cpu.py [--update BENCHMARKS.md] [--models debugmodel,100M]
"""

import argparse
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

SECTION = "## Overhead controls: a save's whole CPU, no training"
GAP = {"debugmodel": 0.4, "100M": 3.0}  # seconds a step: a PFS save's drain ends in its step
STEPS = {"debugmodel": 120, "100M": 24}  # steps after the first PFS save (30 and 6 of each kind)
KINDS = ("none", "rest", "local", "pfs")


def group(name: str) -> str:
    """A thread's kind: the rank's own thread (save()), the checkpointer's, gloo's."""
    if name == "main":
        return "main"
    if name.startswith("ckpt-"):
        return name  # the kernel's name: its first 15 characters
    return "gloo" if "gloo" in name else "other"


def own_cpu_s() -> dict[str, float]:
    from titan_ckpt_plus.priority import thread_times

    out: dict[str, float] = {}
    for name, (on_cpu, _) in thread_times().items():
        out[group(name)] = out.get(group(name), 0.0) + on_cpu / 1e9
    return out


# Where the CPU of a save goes within its threads: a few of the engine's functions,
# each thread's CPU inside them (inclusive, to the nanosecond), per save or drain.
FUNCTIONS = {  # name: (what it is, counted per "save" or per "drain")
    "checkpointer:TieredCheckpointer.save": ("save() on the rank's thread", "save"),
    "staging:plan_layout": ("of which the layout's walk (plan_layout)", "save"),
    "checkpointer:TieredCheckpointer._copy": ("the staging copy", "save"),
    "staging:HostBuffer.copy_in": ("of which the copy and its CRC (copy_in)", "save"),
    "checkpointer:TieredCheckpointer._write": ("the writer", "save"),
    "tiers.local:LocalTier.write_part": ("of which the part's files (write_part)", "save"),
    "staging:StateLayout.to_bytes": ("and the layout's pickle (to_bytes)", "save"),
    "drain:PfsDrain._drain": ("a drain", "drain"),
    "tiers.pfs:PfsTier.save": ("of which PfsTier.save", "drain"),
}


class FunctionCpu:
    """Thread CPU spent inside FUNCTIONS while `on`, whichever thread runs them."""

    def __init__(self) -> None:
        self.on, self.ns, self._lock = False, dict.fromkeys(FUNCTIONS, 0), threading.Lock()
        for name in FUNCTIONS:
            self._wrap(name)

    def _wrap(self, name: str) -> None:
        module, qual = name.split(":")
        owner = importlib.import_module(f"titan_ckpt_plus.{module}")
        *path, attr = qual.split(".")
        for part in path:
            owner = getattr(owner, part)
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.on:
                    with self._lock:
                        self.ns[name] += time.thread_time_ns() - t0
        setattr(owner, attr, timed)


def worker(flavor: str, out: Path) -> None:
    """One rank: windows with no engine, then the engine's steps (see the docstring);
    writes each window's kind, machine busy time and own threads' CPU."""
    import torch.distributed as dist

    import bench_overhead as bo
    from titan_ckpt_plus.checkpointer import TieredCheckpointer, TierSettings
    from titan_ckpt_plus.priority import can_leave_idle
    from titan_ckpt_plus.telemetry import EventLog

    state, rank, world, nbytes = bo.sharded_flavor_state(flavor)
    dist.barrier()
    floor = bo.floor_s(nbytes) if rank == 0 else 0.0  # the other rank waits in the barrier
    dist.barrier()
    gap, windows = GAP[flavor], []

    def window(kind: str, work) -> None:
        dist.barrier()  # the ranks' windows together: the machine's time is both ranks'
        m0, t0, c0 = bo.machine_cpu_s(), time.monotonic(), own_cpu_s()
        work()
        time.sleep(max(0.0, gap - (time.monotonic() - t0)))
        c1 = own_cpu_s()
        windows.append({"kind": kind, "machine": bo.machine_cpu_s() - m0,
                        "own": {k: c1.get(k, 0.0) - c0.get(k, 0.0) for k in c1}})

    steps = STEPS[flavor]
    for _ in range(steps // 4):
        window("none", lambda: None)
    root = out.parent / "run"
    s = TierSettings(local_root=str(root / "local" / "job"), pfs_folder=str(root / "pfs"),
                     local_interval=2, pfs_interval=4, local_keep=2, pfs_keep=2,
                     rank=rank, world_size=world, first_on_node=rank == 0, node_ranks=list(range(world)),
                     job_id="cpu", background_idle=can_leave_idle(),
                     # the drain begins in its save's window, as the rows read it (the default
                     # holds it to the next save() call: the same CPU, a window later)
                     drain_start="commit")
    functions = FunctionCpu()
    ckpt = TieredCheckpointer(s, lambda: state, EventLog(None))

    def save(step: int):
        def run() -> None:
            ckpt.save(step)
            ckpt.wait_for_staging()
        return run

    for step in range(1, steps + 9):  # the first 8: a layout's first save and drain, warm-up
        kind = "rest" if step % 2 else "pfs" if step % 4 == 0 else "local"
        functions.on = step > 8
        window(kind if step > 8 else "warm", save(step))
    ckpt.close()  # the last drain ends in its window: counted
    drains = ckpt.stats.drains
    out.with_suffix(f".{rank}").write_text(json.dumps({"windows": windows, "bytes": nbytes, "floor": floor,
                                                       "drains": drains, "functions": functions.ns}))
    dist.barrier()
    dist.destroy_process_group()


def measure(flavor: str, base: Path) -> dict:
    """Both ranks' windows of one run (worker), pooled: per kind, the machine's busy
    time per window and each rank's threads' CPU per window (means)."""
    import harness

    out = base / f"{flavor}-cpu"
    base.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "scripts"),
                                                                           str(ROOT / "tests")]))
    proc = subprocess.run([*harness.LAUNCH, "--standalone", "--nproc_per_node", "2", __file__,
                           "--worker", flavor, "--out", str(out)], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:]
    ranks = [json.loads(out.with_suffix(f".{r}").read_text()) for r in range(2)]
    res = {"bytes": max(r["bytes"] for r in ranks), "floor": ranks[0]["floor"], "drains": ranks[0]["drains"],
           "functions": {k: statistics.mean(r["functions"][k] for r in ranks) / 1e9 for k in FUNCTIONS}}
    for kind in KINDS:
        ws = [r["windows"] for r in ranks]
        res[kind] = {"machine": statistics.mean(w["machine"] for w in ws[0] if w["kind"] == kind),
                     "own": {g: statistics.mean(w["own"].get(g, 0.0) for r in ws for w in r if w["kind"] == kind)
                             for g in {g for r in ws for w in r for g in w["own"]}}}
    return res


def row(flavor: str, r: dict) -> tuple[str, list[str], list[tuple]]:
    """The table's row, the lines on where each save's CPU went (per rank) and the
    targets table's rows (reported)."""
    gap, floor = GAP[flavor], r["floor"]
    rest = r["rest"]["machine"]
    per_rank = {k: (r[k]["machine"] - rest) / 2 for k in ("local", "pfs")}
    at_rest = (rest - r["none"]["machine"]) / gap / 2
    ms = lambda x: f"{x * 1e3:.1f}"  # noqa: E731
    # each thread kind's CPU beyond a window at rest, to the nanosecond (the machine's
    # figure counts clock ticks), and all of the rank's threads
    own = {k: {g: v - r["rest"]["own"].get(g, 0.0) for g, v in r[k]["own"].items()} for k in per_rank}
    threads = {k: sum(own[k].values()) for k in per_rank}
    cells = [flavor, f"{r['bytes'] / 2**20:.1f} MiB", ms(floor), ms(at_rest) + " ms/s",
             *(f"{ms(per_rank[k])} ({per_rank[k] / floor:.1f}x); threads {ms(threads[k])} "
               f"({threads[k] / floor:.1f}x)" for k in ("local", "pfs")),
             ms(threads["pfs"] - threads["local"])]
    lines = []
    for k, t in own.items():
        ckpt = sorted((g for g in t if g.startswith("ckpt-")), key=lambda g: -t[g])
        lines.append(f"{flavor}, a {'local' if k == 'local' else 'PFS'} save, CPU ms per rank: machine "
                     f"{ms(per_rank[k])} = the rank's thread (save()) {ms(t.get('main', 0.0))} + "
                     + "".join(f"{g} {ms(t[g])} + " for g in ckpt)
                     + f"gloo threads {ms(t.get('gloo', 0.0))} + its other threads {ms(t.get('other', 0.0))} "
                     f"+ the rest (the kernel's own threads and interrupts, other processes) "
                     f"{ms(per_rank[k] - threads[k])}")
    saves, drains = STEPS[flavor] // 2, STEPS[flavor] // 4
    parts = [f"{what} {ms(r['functions'][k] / (drains if per == 'drain' else saves))}"
             for k, (what, per) in FUNCTIONS.items()]
    lines.append(f"{flavor}, thread CPU ms per save and rank inside the engine's functions (a drain's per "
                 f"drain): " + ", ".join(parts))
    targets = [(f"{flavor}: the whole CPU of {what}, per rank, no training (any thread, the kernel's) / floor",
                f"{ms(per_rank[k])} ms / {ms(floor)} ms = {per_rank[k] / floor:.1f}x (the rank's own threads "
                f"{ms(threads[k])} ms, {threads[k] / floor:.1f}x)", "", None)
               for k, what in (("local", "a local save"), ("pfs", "a PFS save (its local save and drain)"))]
    return "| " + " | ".join(cells) + " |", lines, targets


def main() -> None:
    from benchmd import record_targets, update_section

    ap = argparse.ArgumentParser()
    ap.add_argument("--update", type=Path)
    ap.add_argument("--models", default="debugmodel,100M")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.out)
    base = Path(tempfile.mkdtemp(prefix="bench-cpu-"))
    rows, lines, targets = [], [], []
    try:
        for flavor in args.models.split(","):
            r = measure(flavor, base)
            assert r["drains"] >= STEPS[flavor] // 4, f"{flavor}: {r['drains']} drains"  # every PFS save drained
            table_row, more, rows_of_targets = row(flavor, r)
            rows.append(table_row)
            lines += more
            targets += rows_of_targets
    finally:
        shutil.rmtree(base, ignore_errors=True)
    models = "" if args.models == ap.get_default("models") else f" --models {args.models}"
    body = "\n".join([
        f"Command: `.venv/bin/python scripts/bench_cpu.py --update BENCHMARKS.md{models}` "
        f"({time.strftime('%Y-%m-%d')}, 2 CPU ranks, no training; "
        + ", ".join(f"{f}: a step every {GAP[f]} s, {STEPS[f] // 4} saves of each kind" for f in GAP) + ").",
        "",
        "| model | state per rank | floor: memcpy + CRC-32C alone, ms | the engine at rest, per rank "
        "(CPU ms a second) | a local save, per rank: machine CPU ms (/ floor); the rank's own threads | "
        "a PFS save (the local save and its drain), per rank | the drain's share (its threads), ms |",
        "|---|---|---|---|---|---|---|",
        *rows, "",
        *[f"- {line}" for line in lines], "",
        " ".join(__doc__.split("\n\n")[0].split()),
        " ".join(__doc__.split("\n\n")[1].split()),
    ])
    print(body)
    record_targets("cpu", targets)
    if args.update:
        update_section(args.update, SECTION, body)


if __name__ == "__main__":
    main()
