"""Save benchmark: stock torchtitan (async_mode disabled / async) against the plugin's
local tier, on the debug model and a ~100M-parameter model, 2 CPU ranks, in one run,
with this machine's limits (memcpy, fsync'd write bandwidth) measured in the same run.

    .venv/bin/python scripts/bench_save.py [--update BENCHMARKS.md]

delta: time the training loop is blocked by a save (stock: torchtitan's own
"Finished saving ... in X seconds", which includes waiting for the previous async
save; plugin: save() plus the wait before optimizer.step()). Step time "during
background work" is the step right after a save; "without" is every other step.
"""

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
from benchmd import record_targets, update_section  # noqa: E402
from harness import ckpt_events, events, torchrun  # noqa: E402

from titan_ckpt_plus.cpu_fallback import fp32_args  # noqa: E402
from titan_ckpt_plus.staging import HostBuffer  # noqa: E402
from titan_ckpt_plus.tiers import files  # noqa: E402

MODELS = {
    # flavor: (seq_len, local_batch, steps, save every)
    "debugmodel": (128, 2, 25, 3),
    "100M": (32, 1, 13, 3),
}
SECTION = "## Save: local tier vs stock torchtitan"
RANKS_PER_NODE = 2  # both ranks write to this machine's one disk


def machine_limits(nbytes: int, folder: Path, reps: int = 7, gap_s: float = 1.0,
                   ranks: int = RANKS_PER_NODE) -> dict:
    """memcpy of one rank's `nbytes` into a reused buffer, and fsync'd write
    bandwidth of the node's bytes (`ranks` ranks') as one stream to a new file. The
    writes are `gap_s` apart, as the saves are: this disk's speed changes within
    seconds, and one burst of writes samples a single moment of it."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copies = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t0)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bw.bin"
    node_bytes = ranks * nbytes // files.PAGE * files.PAGE
    aligned = HostBuffer(pin=False).ensure(node_bytes)
    aligned.fill_(7)
    data, seconds = memoryview(aligned.numpy())[:node_bytes], {"buffered": [], "direct": []}
    for _ in range(reps):
        time.sleep(gap_s)
        for name, flags in (("buffered", 0), ("direct", getattr(os, "O_DIRECT", 0))):
            t0 = time.perf_counter()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags)
            files.write_all(fd, data)
            os.fsync(fd)
            os.close(fd)
            seconds[name].append(time.perf_counter() - t0)
            path.unlink()
    return {"memcpy_s": copies, "buffered_s": seconds["buffered"], "direct_s": seconds["direct"],
            "node_bytes": node_bytes}


def pooled_limits(probes: list[dict]) -> dict:
    """Medians over every probe's samples. The disk bound is the better of the two
    ways to write; the file is removed outside the timing (the plugin writes new
    files too)."""
    med = {k: statistics.median(x for p in probes for x in p[k]) for k in ("memcpy_s", "buffered_s", "direct_s")}
    n = probes[0]["node_bytes"]
    bw = {"buffered_Bps": n / med["buffered_s"], "direct_Bps": n / med["direct_s"]}
    return {"memcpy_s": med["memcpy_s"], "write_Bps": max(bw.values()), **bw}


def step_times(work: Path, save_steps: set[int]) -> tuple[list[float], list[float]]:
    """Step times right after a save and otherwise (from the loss-log times)."""
    recs = {r["step"]: r["time"] for r in events(work / "losses.jsonl", "loss")}
    after, other = [], []
    for s in sorted(recs):
        if s - 1 in recs and s > 2:
            (after if s - 1 in save_steps else other).append(recs[s] - recs[s - 1])
    return after, other


def run_stock(work: Path, flavor: str, mode: str, common: list[str], every: int, steps: int) -> dict:
    proc = torchrun(work, *common, "--checkpoint.no-tier-local", f"--checkpoint.async_mode={mode}",
                    f"--checkpoint.interval={every}", timeout=1800, digests=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    deltas = [float(x) for x in re.findall(r"Finished saving the checkpoint.*?in ([0-9.]+) seconds", proc.stdout)]
    saves = {s for s in range(1, steps) if s % every == 0}
    after, other = step_times(work, saves)
    return {"delta": statistics.median(deltas), "after": statistics.median(after),
            "other": statistics.median(other)}


def run_plugin(work: Path, common: list[str], every: int, steps: int) -> dict[str, list]:
    """The run's samples, to be pooled with another run's."""
    proc = torchrun(work, *common, f"--checkpoint.local_interval={every}", "--checkpoint.interval=100000",
                    timeout=1800, digests=False)
    assert proc.returncode == 0, proc.stdout[-3000:]
    stages = [e for e in ckpt_events(work, "stage") if e["step"] < steps]
    all_commits = ckpt_events(work, "local_commit")
    commits = [e for e in all_commits if e["step"] < steps]
    (last,) = [e for e in all_commits if e["step"] == steps]
    saves = {e["step"] for e in stages}
    after, other = step_times(work, saves)
    return {"delta": [e["delta_s"] for e in stages], "commit": [e["time_to_commit_s"] for e in commits],
            "commit_last": [last["time_to_commit_s"]], "bytes": [e["bytes"] for e in commits],
            "after": after, "other": other}


ROUNDS = 3  # plugin runs, each followed by a probe of the disk, whose speed drifts


def bench(flavor: str, base: Path) -> dict:
    seq, batch, steps, every = MODELS[flavor]
    common = [f"--model.flavor={flavor}", f"--training.seq_len={seq}",
              f"--training.local_batch_size={batch}", f"--training.steps={steps}",
              "--checkpoint.keep_latest_k=2", "--checkpoint.local_keep_latest_k=2",
              *fp32_args()]
    out = {"flavor": flavor}
    for mode in ("disabled", "async"):
        out[mode] = run_stock(base / f"{flavor}-{mode}", flavor, mode, common, every, steps)
    runs, probes = [], []
    for i in range(ROUNDS):
        runs.append(run_plugin(base / f"{flavor}-plugin-{i}", common, every, steps))
        probes.append(machine_limits(int(statistics.median(runs[-1]["bytes"])), base / "limits"))
    out["plugin"] = {k: statistics.median(x for r in runs for x in r[k]) for k in runs[0]}
    out["limits"] = pooled_limits(probes)
    return out


def _verdict(ratio: float, limit: float, above: bool = False) -> str:
    ok = ratio >= limit if above else ratio <= limit
    return f"{ratio:.2f} {'met' if ok else 'NOT met'}"


def table(results: list[dict]) -> str:
    rows = ["| model | bytes/rank | stock disabled delta | stock async delta | plugin delta | "
            "plugin/async (target <= 0.5) | memcpy of the bytes | node bytes / fsync'd write bw | "
            "time to durable commit: during training / last step | ratio to the disk bound (target <= 1.5) | "
            "step during bg write (stock async / plugin) | step otherwise (plugin) |",
            "|" + "---|" * 12]
    for r in results:
        p, a, d, lim = r["plugin"], r["async"], r["disabled"], r["limits"]
        ideal = RANKS_PER_NODE * p["bytes"] / lim["write_Bps"]
        rows.append(
            f"| {r['flavor']} | {p['bytes'] / 2**20:.1f} MiB | {d['delta']:.3f} s | {a['delta']:.3f} s | "
            f"{p['delta']:.3f} s | {_verdict(p['delta'] / a['delta'], 0.5)} | {lim['memcpy_s']:.3f} s | "
            f"{ideal:.3f} s | {p['commit']:.3f} s / {p['commit_last']:.3f} s | "
            f"{_verdict(p['commit'] / ideal, 1.5)} / {_verdict(p['commit_last'] / ideal, 1.5)} | "
            f"{a['after']:.3f} / {p['after']:.3f} s | {p['other']:.3f} s |")
    notes = ("\n\nThe disk bound is the node's bytes (both ranks write to this machine's one disk) over "
             "the fsync'd write bandwidth of those bytes written as one stream to a new file on the idle "
             f"machine, median of {ROUNDS} x 7 writes (7 after each plugin run, 1 s apart as the saves are; the "
             "disk's speed changes within seconds), "
             "buffered or O_DIRECT, whichever is faster (the plugin writes O_DIRECT from its page-aligned "
             "staging buffer). "
             "\"During training\" saves share the 2 cores with the 2 training ranks (staging copy, checksum); "
             "the last step's save runs after training stopped. On GPU nodes training runs on the "
             "GPUs and the host cores are mostly idle, which is the last-step case.")
    return "\n".join(rows) + notes


def targets(results: list[dict]) -> list[tuple]:
    rows = []
    for r in results:
        p, a, lim, f = r["plugin"], r["async"], r["limits"], r["flavor"]
        ideal = RANKS_PER_NODE * p["bytes"] / lim["write_Bps"]
        rows += [
            (f"{f}: delta per save, plugin / stock async", f"{p['delta'] / a['delta']:.2f} "
             f"({p['delta']:.3f} s / {a['delta']:.3f} s)", "<= 0.5", p["delta"] / a["delta"] <= 0.5),
            (f"{f}: durable local commit during training / disk bound", f"{p['commit'] / ideal:.2f} "
             f"({p['commit']:.3f} s / {ideal:.3f} s)", "<= 1.5", p["commit"] / ideal <= 1.5),
            (f"{f}: durable local commit at the last step / disk bound", f"{p['commit_last'] / ideal:.2f}",
             "<= 1.5", p["commit_last"] / ideal <= 1.5),
            (f"{f}: step during background work, plugin vs stock async",
             f"{p['after']:.3f} s vs {a['after']:.3f} s (plugin otherwise {p['other']:.3f} s)",
             "<= stock async's", p["after"] <= a["after"]),
            (f"{f}: machine, memcpy of {p['bytes'] / 2**20:.0f} MiB; fsync'd write, buffered / O_DIRECT",
             f"{lim['memcpy_s']:.3f} s; {lim['buffered_Bps'] / 2**20:.0f} / {lim['direct_Bps'] / 2**20:.0f} MiB/s",
             "", None),
        ]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--update", type=Path, help="write the table into this markdown file")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench_save_", dir=ROOT / "outputs" if (ROOT / "outputs").exists() else None))
    try:
        results = [bench(m, base) for m in args.models.split(",")]
    finally:
        shutil.rmtree(base, ignore_errors=True)  # 20 GB of checkpoints per run: it filled this disk
    body = (f"Command: `.venv/bin/python scripts/bench_save.py --update BENCHMARKS.md` "
            f"({os.cpu_count()} cores, CPU, gloo, 2 ranks; medians over the saves of one run for stock, of "
            f"{ROUNDS} runs for the plugin; local and PFS folders on the same disk).\n\n" + table(results))
    print(body)
    record_targets("save", targets(results))
    if args.update:
        update_section(args.update, SECTION, body)


if __name__ == "__main__":
    main()
