"""GPU check: the plugin on one CUDA device against stock torchtitan, in one run, one table.

    python3 scripts/bench_gpu.py --update BENCHMARKS.md   # on the GPU (scripts/gpu_check.sh)
    .venv/bin/python scripts/bench_gpu.py --smoke         # the plumbing only, on CPU
    .venv/bin/python scripts/bench_gpu.py --apply FILE    # here: a GPU run's section into BENCHMARKS.md

1. bit-exact resume on CUDA, 1 rank, local tier: the tiny job SIGKILLed after step 7,
   restarted; its losses against an uninterrupted run's;
2. the 1B flavor (fp32 weights and AdamW state: torchtitan trains one GPU without FSDP,
   so without its bf16 mixed precision), per save: the time the training thread is
   blocked (save() plus the wait before optimizer.step()) and the step time lost (CUDA
   events at the step boundaries: the step that holds the save against the undisturbed
   median), the plugin against stock torchtitan `async` and `async_with_pinned_mem`;
3. the plugin's time to a durable local commit against the bytes over this machine's
   fsync'd write bandwidth;
4. step time while the background write runs against undisturbed steps;
5. the host memory the plugin pins for staging against the state's bytes (its log line:
   pinned in place at the state's size, or by torch's allocator at a power of two).

The training runs are torchrun'ed with this file as the trainer (`worker()`): torchtitan's
Trainer whose checkpointer is timed by `SaveClock`, which saves only once the previous
save's background work is done and two undisturbed steps followed, so no save waits for
the disk. The first save of each run is a warm-up (pinned allocation, torchtitan's writer
process) and is not counted.
"""

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_save import machine_limits, pooled_limits  # noqa: E402
from benchmd import update_section  # noqa: E402
from harness import ckpt_events, losses, torchrun  # noqa: E402

SECTION = "## GPU"
WORKER_ENV = "TITAN_CKPT_BENCH_GPU"  # the worker's plan, as JSON
PLUGIN = ["--checkpoint.local_interval=1", "--checkpoint.interval=1000000"]
MODES = {  # the plugin and its baselines first: the targets need them; the helper last
    "plugin": PLUGIN,
    "async_with_pinned_mem": ["--checkpoint.no-tier-local", "--checkpoint.async_mode=async_with_pinned_mem",
                              "--checkpoint.interval=1"],
    "async": ["--checkpoint.no-tier-local", "--checkpoint.async_mode=async", "--checkpoint.interval=1"],
    "helper": [*PLUGIN, "--checkpoint.helper_process"],
}
# flavor, seq_len, local batch; warm-up steps; saves per run (the first a warm-up)
GPU = {"flavor": "1B", "seq": 2048, "batch": 2, "warmup": 3, "saves": 3}
GPU_SAVE_BYTES = 12 * 982_000_000  # fp32 weights and two AdamW moments of the 1B flavor
SMOKE = {"flavor": "tiny", "seq": 32, "batch": 2, "warmup": 2, "saves": 2}
RESUME_FAULT, RESUME_STEPS = "kill_after_step@7:0", 12


# ---- the worker: torchtitan's Trainer, timed ----------------------------------------

class SaveClock:
    """Wraps one checkpointer's save() and maybe_wait_for_staging(), stock or plugin:
    at every step boundary (the loop calls save() once per step) a mark on the training
    stream (a CUDA event; the host clock on CPU) and whether the last save's background
    work still runs; a save only when that work is done and two undisturbed steps
    followed it; the training thread's blocked time per save."""

    def __init__(self, ckpt, plan: dict, stop) -> None:
        self.ckpt, self.plan, self.stop = ckpt, plan, stop
        self.cuda = torch.cuda.is_available()
        self.bounds: list[dict] = []
        self.blocked: dict[int, list] = {}  # save step -> [in save(), in the wait before the update]
        self.quiet = 0  # undisturbed steps since the last save's work ended
        self.waiting = None  # the save whose wait before optimizer.step() is still to come
        self.started = time.monotonic()
        if plan.get("kill_at"):  # the driver's timeout would kill torchrun, not this process
            watchdog = threading.Timer(max(0.0, plan["kill_at"] - time.time()), os._exit, (3,))
            watchdog.daemon = True
            watchdog.start()
        self._save, self._wait = ckpt.save, ckpt.maybe_wait_for_staging
        ckpt.save, ckpt.maybe_wait_for_staging = self.save, self.wait

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def busy(self) -> bool:
        tiered = getattr(self.ckpt, "tiered", None)
        if tiered is not None:
            return tiered._write_q.unfinished_tasks > 0
        fut = self.ckpt.save_future
        return fut is not None and not fut.done()

    def save(self, curr_step: int, last_step: bool = False) -> None:
        busy, prev = self.busy(), self.bounds[-1] if self.bounds else None
        self.quiet = 0 if busy or (prev and (prev["saved"] or prev["busy"])) else self.quiet + 1
        bound = {"step": curr_step, "mark": self._mark(), "busy": busy, "saved": False}
        self.bounds.append(bound)
        saves = sum(b["saved"] for b in self.bounds)
        over = time.monotonic() - self.started > self.plan["budget_s"]
        if curr_step > self.plan["warmup"] and self.quiet >= 2 and saves < self.plan["saves"] and not over:
            t0 = time.perf_counter()
            self._save(curr_step, last_step=False)
            self.blocked[curr_step] = [time.perf_counter() - t0, 0.0]
            self.waiting, bound["saved"] = curr_step, True
        elif (saves == self.plan["saves"] and self.quiet >= 2) or over or last_step:
            self.finish()

    def wait(self) -> None:
        t0 = time.perf_counter()
        self._wait()
        if self.waiting is not None:
            self.blocked[self.waiting][1] = time.perf_counter() - t0
            self.waiting = None

    def finish(self) -> None:
        """Write the boundaries as steps, then end training after this step (torchtitan
        closes the checkpointer, which finishes any background write)."""
        if self.cuda:
            torch.cuda.synchronize()  # the bench's own marks only: after the last step
        steps, saves = [], 0
        for a, b in zip(self.bounds, self.bounds[1:]):
            saves += a["saved"]
            kind = "save" if a["saved"] else "background" if a["busy"] or b["busy"] else "undisturbed"
            seconds = a["mark"].elapsed_time(b["mark"]) / 1e3 if self.cuda else b["mark"] - a["mark"]
            steps.append({"step": b["step"], "kind": kind, "save": saves - 1, "seconds": seconds})
        Path(self.plan["out"]).write_text(json.dumps({
            "steps": steps, "blocked": self.blocked, "warmup": self.plan["warmup"],
            "saves": [b["step"] for b in self.bounds if b["saved"]], "cuda": self.cuda}))
        self.stop()


def worker() -> None:
    from torchtitan.train import Trainer, main

    from titan_ckpt_plus.adapters import torchtitan_v022

    # The package was imported above, before torchtitan, so its import hook did not install.
    torchtitan_v022.install()
    _mend_stager()
    plan = json.loads(os.environ[WORKER_ENV])

    class TimedTrainer(Trainer):
        def __init__(self, job_config) -> None:
            super().__init__(job_config)
            SaveClock(self.checkpointer, plan, self._stop)

        def _stop(self) -> None:
            self.job_config.training.steps = self.step  # the loop ends after this step

    main(TimedTrainer)


def _mend_stager() -> None:
    """Stock `async_with_pinned_mem` fails at its second save (torch 2.11 to 2.13:
    KeyError: <class 'type'>; pytorch/torchtitan#3476): its stager's close() clears
    the deepcopy table after every save, to break a reference cycle, and the next
    save's copy of any dict looks `type` up in it unguarded. Keeping the table across
    close() lets the baseline run; the cycle only delays collecting a stager that the
    stock manager keeps for the whole job. Only stock modes use that stager."""
    from torch.distributed.checkpoint import _state_dict_stager as sds

    close = sds.StateDictStager.close

    def mended(self) -> None:
        table = dict(self._deepcopy_dispatch)
        close(self)
        self._deepcopy_dispatch.update(table)

    sds.StateDictStager.close = mended


# ---- the driver ---------------------------------------------------------------------

def _tail(proc) -> str:
    return proc.stdout[-3000:]


def resume_check(base: Path, timeout: int) -> dict:
    """The tiny job, 1 rank: uninterrupted, then SIGKILLed after step 7 and restarted."""
    ref, run = base / "resume-ref", base / "resume-killed"
    proc = torchrun(ref, nproc=1, timeout=timeout)
    assert proc.returncode == 0, _tail(proc)
    proc = torchrun(run, nproc=1, fault=RESUME_FAULT, timeout=timeout)
    assert proc.returncode != 0 and "SIGKILL" in proc.stdout, _tail(proc)
    proc = torchrun(run, nproc=1, timeout=timeout)
    assert proc.returncode == 0, _tail(proc)
    rec = ckpt_events(run, "recovery")[-1]
    got, want = losses(run), losses(ref)
    same = [s for s, v in want.items() if got.get(s) == v]
    # Steps up to the resumed one are the killed incarnation's: a difference there is the
    # kernels' nondeterminism, not the resume.
    return {"tier": rec["tier"], "step": rec["step"], "steps": len(want),
            "before": sum(s <= rec["step"] for s in same), "after": sum(s > rec["step"] for s in same),
            "exact": got == want and len(want) == RESUME_STEPS}


def pcie_Bps(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Device to pinned host copy bandwidth, timed with CUDA events."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return nbytes / statistics.median(times[1:])


def timed_run(base: Path, mode: str, model: dict, budget_s: float, timeout: int) -> dict:
    work = base / mode
    plan = dict(model, out=str(work / "clock.json"), budget_s=budget_s, kill_at=time.time() + timeout - 15)
    work.mkdir(parents=True)
    try:
        proc = torchrun(work, f"--model.flavor={model['flavor']}", f"--training.seq_len={model['seq']}",
                        f"--training.local_batch_size={model['batch']}", "--training.steps=100000",
                        "--debug.no-deterministic", "--checkpoint.keep_latest_k=2",
                        "--checkpoint.local_keep_latest_k=2", *MODES[mode], nproc=1, module="bench_gpu", digests=False,
                        env={WORKER_ENV: json.dumps(plan)}, timeout=timeout)
        assert proc.returncode == 0, _tail(proc)
        out = summarize(json.loads((work / "clock.json").read_text()), ckpt_events(work, "local_commit"),
                        ckpt_events(work, "stage"))
        return dict(out, staging=_staging(proc.stdout))
    finally:  # the disk holds only a few 1B checkpoints
        shutil.rmtree(work / "dump", ignore_errors=True)
        shutil.rmtree(work / "local", ignore_errors=True)


def _staging(log: str) -> dict | None:
    """The plugin's staging buffer as it logged it (HostBuffer.ensure): the state's
    bytes, the bytes pinned for it, how, and whether torch sees it pinned (its
    device-to-host copies are then one DMA each)."""
    found = re.findall(r"staging buffer: (\d+) bytes of state, (\d+) bytes pinned "
                       r"\((in place|by torch); is_pinned=(True|False)\)", log)
    if not found:
        return None
    state, pinned, how, seen = found[-1]
    return {"state": int(state), "pinned": int(pinned), "how": how, "is_pinned": seen == "True"}


def _staging_cell(st: dict | None) -> str:
    if st is None:
        return "-"
    return (f"{st['pinned'] / 2**20:.1f} MiB pinned for {st['state'] / 2**20:.1f} MiB = "
            f"{st['pinned'] / st['state']:.3f}x ({st['how']}; torch sees it pinned: {st['is_pinned']})")


def _staging_ok(st: dict | None) -> bool | None:
    """Met: pinned (as torch sees it) at no more than 1.1x the state."""
    return None if st is None else st["is_pinned"] and st["pinned"] <= 1.1 * st["state"]


def _median(xs: list) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(clock: dict, commits: list, stages: list) -> dict:
    """Per mode: medians over the saves after the warm-up save."""
    steps = [s for s in clock["steps"] if s["step"] > clock["warmup"]]
    counted = [s for s in steps if s["kind"] == "undisturbed" or s["save"] >= 1]
    base = _median([s["seconds"] for s in counted if s["kind"] == "undisturbed"])
    saves = clock["saves"][1:]
    held = [s["seconds"] for s in counted if s["kind"] == "save"]
    return {
        "saves": len(saves),
        "blocked": _median([sum(clock["blocked"][str(s)]) for s in saves]),
        "in_save": _median([clock["blocked"][str(s)][0] for s in saves]),
        "delta": _median([e["delta_s"] for e in stages if e["step"] in saves]),  # the plugin's own
        "lost": _median([x - base for x in held]) if base is not None else None,
        "undisturbed": base,
        "background": _median([s["seconds"] for s in counted if s["kind"] == "background"]),
        "commit": _median([e["time_to_commit_s"] for e in commits if e["step"] in saves]),
        "staged": _median([e["staging_s"] for e in commits if e["step"] in saves]),
        "by_helper": sum(bool(e.get("by_helper")) for e in commits if e["step"] in saves),
        "bytes": commits[-1]["bytes"] if commits else None,
        "clock": "CUDA events" if clock["cuda"] else "host clock",
    }


def _s(x) -> str:
    return "-" if x is None else f"{x:.3f} s"


def _blocked(m: dict) -> str:
    return f"{_s(m.get('blocked'))} ({_s(m.get('in_save'))})"


def _met(ok) -> str:
    return "not measured" if ok is None else "met" if ok else "**NOT met**"


def _got(r: dict, key: str) -> dict:
    """A phase's results; {} where it failed or did not run."""
    return r[key] if isinstance(r.get(key), dict) else {}


def _ours(r: dict, fn) -> str:
    """fn(results) for the plugin and, where it ran, the plugin with helper_process."""
    out, h = fn(_got(r, "plugin")), _got(r, "helper")
    return out + (f"; with the helper: {fn(h)}" if h else "")


def _met_all(oks: list) -> str:
    run = [ok for ok in oks if ok is not None]
    return "not measured" if not run else _met(all(run))


def _copy_cell(m: dict) -> str:
    """The staging buffer, and how fast a save was staged into it (save() to the last
    byte landed): where a helper process takes the CRC-32C, the device-to-host DMA
    alone, at the PCIe figure only if the buffer is pinned; else the copy thread's
    DMA and CRC-32C of every byte."""
    if not (m.get("staged") and m.get("bytes")):
        return _staging_cell(m.get("staging"))
    what = "the DMA; the helper takes the CRC" if m.get("by_helper") else "the DMA and the copy thread's CRC-32C"
    return (f"{_staging_cell(m.get('staging'))}; staged in {m['staged']:.3f} s = "
            f"{m['bytes'] / m['staged'] / 1e9:.1f} GB/s ({what})")


def table(r: dict) -> str:
    p, h, a, pin = (_got(r, k) for k in ("plugin", "helper", "async", "async_with_pinned_mem"))
    lim, res = _got(r, "limits"), r.get("resume")
    nbytes = p.get("bytes") or h.get("bytes")
    pcie = nbytes / lim["pcie_Bps"] if nbytes and lim.get("pcie_Bps") else None
    disk = nbytes / lim["write_Bps"] if nbytes and lim.get("write_Bps") else None
    half = 0.5 * pin["blocked"] if pin.get("blocked") is not None else None
    ours = [m for m in (p, h) if m]
    blocked_ok = [None if half is None or m.get("blocked") is None else m["blocked"] <= half for m in ours]
    lost_ok = [None if pcie is None or m.get("lost") is None else m["lost"] <= pcie for m in ours]
    ratio = lambda m: f"{m['commit'] / disk:.2f}x" if disk and m.get("commit") else "-"  # noqa: E731
    steps = lambda m: f"{_s(m.get('background'))} / {_s(m.get('undisturbed'))}"  # noqa: E731
    own = lambda m: f"{_blocked(m)}, own delta {_s(m.get('delta'))}"  # noqa: E731
    rows = ["| measured | plugin (; with helper_process) | stock async | stock async_with_pinned_mem | target | met? |",
            "|---|---|---|---|---|---|"]
    if isinstance(res, dict):
        rows.append(f"| 1. resume, tiny job, 1 rank, local tier: SIGKILL after step 7, restart | from "
                    f"{res['tier']} step {res['step']}; losses equal bit for bit: {res['before']} of "
                    f"{res['step']} before, {res['after']} of {res['steps'] - res['step']} after | | | "
                    f"bit-exact | {_met(res['exact'])} |")
    else:
        rows.append(f"| 1. resume | {res or 'not run'} | | | bit-exact | not measured |")
    rows += [
        f"| 2. training thread blocked per save (of it in save()) | "
        f"{_ours(r, own)} | "
        f"{_blocked(a)} | {_blocked(pin)} | plugin <= 0.5 x async_with_pinned_mem's ({_s(half)}) | "
        f"{_met_all(blocked_ok)} |",
        f"| 2. step time lost per save ({(p or h).get('clock', 'CUDA events')}) | "
        f"{_ours(r, lambda m: _s(m.get('lost')))} | {_s(a.get('lost'))} | {_s(pin.get('lost'))} | "
        f"plugin <= PCIe time of the bytes ({_s(pcie)}) | {_met_all(lost_ok)} |",
        f"| 3. time to a durable local commit | {_ours(r, lambda m: _s(m.get('commit')))} | | | "
        f"bytes / fsync'd write bw ({_s(disk)}) | reported ({_ours(r, ratio)}) |",
        f"| 4. step during the background write / undisturbed | {_ours(r, steps)} | {steps(a)} | "
        f"{steps(pin)} | | reported |",
        f"| 5. host memory pinned for staging / state bytes | {_ours(r, _copy_cell)} | | | "
        f"pinned, <= 1.1x | {_met_all([_staging_ok(m.get('staging')) for m in ours])} |",
    ]
    rows += [f"| {k} | {r[k]} | | | | |" for k in ("limits", *MODES) if isinstance(r.get(k), str)]
    return "\n".join(rows)


def notes(r: dict, model: dict) -> str:
    lim, p = _got(r, "limits"), _got(r, "plugin")
    saves = ", ".join(f"{m} {r[m]['saves']}" for m in MODES if isinstance(r.get(m), dict))
    h = _got(r, "helper")
    helper = (f" With helper_process (\"helper\"), {h['by_helper']} of its {h['saves']} counted saves "
              "were written by the helper process." if h else "")
    gb = lambda x: "-" if not x else f"{x / 1e9:.2f} GB/s"  # noqa: E731
    return (f"Machine: {r['machine']}; {r['date']}. Model: llama3 {model['flavor']}, seq_len {model['seq']}, "
            f"local batch {model['batch']}, 1 rank; {(p.get('bytes') or 0) / 1e9:.2f} GB per save. "
            f"PCIe device to pinned host {gb(lim.get('pcie_Bps'))}; fsync'd write {gb(lim.get('write_Bps'))} "
            f"(buffered {gb(lim.get('buffered_Bps'))}, O_DIRECT {gb(lim.get('direct_Bps'))}). Saves counted "
            f"per mode, after one warm-up save: {saves or '-'}. Blocked: save() plus the wait before "
            "optimizer.step(), host clock. Step time lost: the step holding the save minus the median "
            f"undisturbed step, from events on the training stream at each step boundary.{helper}")


def _phase(results: dict, key: str, fn, *args) -> None:
    """One measurement; a failure is a row of the table, not the end of the run."""
    t0 = time.monotonic()
    try:
        results[key] = fn(*args)
    except Exception as e:  # one device call: report what failed and go on
        print(f"[bench_gpu] {key} failed: {e}", flush=True)
        results[key] = f"{type(e).__name__}: {' '.join(str(e).split())[-200:]}"
    print(f"[bench_gpu] {key}: {time.monotonic() - t0:.0f}s", flush=True)


def limits(base: Path, sample: int, cuda: bool) -> dict:
    out = pooled_limits([machine_limits(sample, base / "limits", reps=3, gap_s=0.5, ranks=1)])
    shutil.rmtree(base / "limits", ignore_errors=True)
    if cuda:
        out["pcie_Bps"] = pcie_Bps(min(sample, 1 << 30))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny flavor: the plumbing, never GPU figures")
    ap.add_argument("--update", type=Path, help="write the GPU section into this markdown file (GPU only)")
    ap.add_argument("--apply", type=Path, help="write a GPU run's section file into BENCHMARKS.md")
    ap.add_argument("--budget-s", type=float, default=420, help="wall time for all measurements")
    ap.add_argument("--modes", default=",".join(MODES), help=f"which of {', '.join(MODES)} to run")
    ap.add_argument("--no-resume", action="store_true", help="skip the bit-exact resume check")
    args = ap.parse_args()
    wanted = args.modes.split(",")
    unknown = set(wanted) - set(MODES)
    if unknown:  # before any device time is spent
        sys.exit(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    if args.apply:
        body = args.apply.read_text()
        if not body.startswith("Machine: "):
            sys.exit(f"{args.apply} is not a GPU run's section")
        update_section(ROOT / "BENCHMARKS.md", SECTION, body, measured_on="the device machine named above")
        return
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        sys.exit("no CUDA device: run with --smoke to check the plumbing on CPU")
    if args.smoke and args.update:
        sys.exit("--smoke never writes BENCHMARKS.md")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "scripts"), os.environ.get("PYTHONPATH")) if p)
    model = GPU if cuda else SMOKE
    outputs = ROOT / "outputs"
    outputs.mkdir(exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="bench_gpu_", dir=outputs))
    deadline = time.monotonic() + args.budget_s
    results = {"machine": torch.cuda.get_device_name() if cuda else f"CPU smoke run ({os.cpu_count()} cores)",
               "date": datetime.date.today().isoformat()}
    results["machine"] += f", torch {torch.__version__}"
    free = shutil.disk_usage(base).free
    if cuda and free < 4 * GPU_SAVE_BYTES:  # a run holds up to saves + 1 checkpoints
        model = dict(model, saves=2)
    print(f"[bench_gpu] {results['machine']}; disk free {free / 2**30:.0f} GiB; {model['saves']} saves per run",
          flush=True)
    if args.no_resume:
        results["resume"] = "not run in this call (--no-resume)"
    else:
        _phase(results, "resume", resume_check, base, 120)
    _phase(results, "limits", limits, base, (1 << 30) if cuda else (64 << 20), cuda)
    modes = [m for m in MODES if m in wanted and (cuda or m != "async_with_pinned_mem")]
    if not cuda and "async_with_pinned_mem" in wanted:
        results["async_with_pinned_mem"] = "not run on CPU (its staging pins memory through CUDA)"
    for i, mode in enumerate(modes):
        left = deadline - time.monotonic()
        if left < 60:
            results[mode] = f"skipped: {left:.0f}s of the budget left"
            continue
        share = min(left / (len(modes) - i), 150)
        _phase(results, mode, timed_run, base, mode, model, share - 45, int(share + 60))
    body = notes(results, model) + "\n\n" + table(results)
    if not cuda:
        body = "SMOKE RUN on CPU (tiny flavor, gloo, host clock): the plumbing only, not GPU figures.\n\n" + body
    print(body, flush=True)
    if cuda:
        if os.environ.get("OUT"):
            (Path(os.environ["OUT"]) / "gpu_section.md").write_text(body + "\n")
        if args.update:
            update_section(args.update, SECTION, body)
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    worker() if WORKER_ENV in os.environ else main()
