"""The checkpointer's background threads' system calls per save and per drain
(issue 15), counted by strace: a background thread gives the GIL up for each call and
takes it back after, and each take-back may wait for the training thread.

    .venv/bin/python scripts/bench_syscalls.py [--flavor debugmodel] [--saves 8] [--helper-process]

One process, world size 1, a rank's share of the flavor's state as 2 FSDP ranks hold
it (model and AdamW moments, the small items), a local save every step and a PFS drain
every second one, after 4 saves of warm-up (the layout's first save and drain plan it).
With --helper-process ([checkpoint] helper_process) the byte helper's own threads are
rows of their own (its copy channel's, its local tier's per save, its PFS copy's per drain). Needs strace.
"""

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = "bench-syscalls-start"  # strace shows a write's first 32 bytes
THREADS = {"ckpt-local-writ": "local writer (a save)", "ckpt-pfs-draine": "PFS drain (a drain)",
           "ckpt-staging-co": "staging copy (a save)",
           "ckpt-byte-helpe": "byte helper process: the copy's channel (a save)",
           "ckpt-helper-wri": "byte helper process: the local tier (a save)",
           "ckpt-helper-dra": "byte helper process: the PFS copy (a drain)"}


def worker(flavor: str, saves: int, folder: Path, helper_process: bool) -> None:
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "scripts"), str(ROOT)]
    import torch
    import torch.distributed as dist

    from bench_overhead import flavor_state
    from harness import free_port
    from titan_ckpt_plus.checkpointer import TieredCheckpointer, TierSettings
    from titan_ckpt_plus.telemetry import EventLog

    torch.set_num_threads(1)
    state = flavor_state(flavor, lambda shape: torch.randn(-(-shape[0] // 2), *shape[1:]), 0, 2)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    s = TierSettings(str(folder / "local"), str(folder / "pfs"), 1, 2, 2, 2, 0, 1, True, job_id="bench",
                     helper_process=helper_process)
    ck = TieredCheckpointer(s, lambda: state, EventLog(None))
    for step in range(1, 5 + saves):
        if step == 5:
            os.write(2, f"{MARK}\n".encode())  # a write strace shows: where counting starts
        ck.save(step)
        ck.wait_for_staging()
        ck.flush(False)
    ck.close()
    dist.destroy_process_group()


def count(trace: str, saves: int) -> dict:
    """thread name -> Counter of system calls after the mark, per save or drain."""
    lines = Path(trace).read_text().splitlines()
    names = {}
    for line in lines:
        if m := re.match(r'(\d+)\s+prctl\(PR_SET_NAME, "([^"]+)"', line):
            names[m.group(1)] = m.group(2)
    start = next(i for i, line in enumerate(lines) if MARK in line)
    per: dict = collections.defaultdict(collections.Counter)
    for line in lines[start + 1:]:
        if m := re.match(r"(\d+)\s+(\w+)\(", line):
            per[names.get(m.group(1), m.group(1))][m.group(2)] += 1
    drains = saves // 2
    return {what: {k: v / (drains if "drain" in what else saves) for k, v in per[name].items()}
            for name, what in THREADS.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="debugmodel")
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--helper-process", action="store_true", help="[checkpoint] helper_process = true")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.flavor, args.saves, args.worker, args.helper_process)
        return
    if not shutil.which("strace"):
        sys.exit("bench_syscalls.py needs strace (apt-get install strace)")
    base = Path(tempfile.mkdtemp(prefix="bench-syscalls-"))
    trace = base / "trace"
    try:
        proc = subprocess.run(["strace", "-f", "-qq", "-o", str(trace), sys.executable, __file__,
                               "--flavor", args.flavor, "--saves", str(args.saves), "--worker", str(base / "run"),
                               *(["--helper-process"] if args.helper_process else [])],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode:
            sys.exit(f"the traced run failed:\n{proc.stderr[-3000:]}")
        counts = count(str(trace), args.saves)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"{args.flavor} (a rank's share of 2), {args.saves} saves, {args.saves // 2} drains"
          + (", helper_process = true" if args.helper_process else "") + "\n")
    print("| thread | system calls | of them futex (GIL and lock hand-overs) | the most frequent others |")
    print("|---|---|---|---|")
    for what, c in counts.items():
        if not c:
            continue
        others = sorted(((v, k) for k, v in c.items() if k != "futex"), reverse=True)[:6]
        print(f"| {what} | {sum(c.values()):.0f} | {c.get('futex', 0):.0f} | "
              + ", ".join(f"{k} {v:.0f}" for v, k in others) + " |")


if __name__ == "__main__":
    main()
