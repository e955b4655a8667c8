"""The fault matrix: the tiny CPU job through every fault the plugin promises to survive.

    .venv/bin/python scripts/chaos.py              # every scenario (about 6 min on 2 cores)
    .venv/bin/python scripts/chaos.py --ci         # the subset CI runs (tests/test_chaos.py)
    .venv/bin/python scripts/chaos.py sigterm disk-full    # chosen scenarios

Each scenario: run 1 with a fault, damage between the runs (wiped folders, flipped
bytes), run 2 clean. Checked: the tier and step run 2 recovers; its losses equal an
uninterrupted run's at the same DP degree, bit for bit; after a DP change, every
sequence is consumed exactly once; no needed checkpoint was deleted (the step the
restart must use still loads, and the newest step of every tier still verifies).
The tmpfs (disk full) and read-only PFS scenarios mount file systems and need root.
Prints a table: scenario, expected, observed, pass/fail, recovery seconds, bytes read
per tier.
"""

import argparse
import shlex
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import harness  # noqa: E402
from titan_ckpt_plus import inspect as ckpt_inspect  # noqa: E402

STEPS = 12  # tests/configs/tiny_tiered.toml: local every 2 steps, PFS every 4
GRACE_S = 25.0  # preemption_grace_s's default
SECTION = "## Fault injection"


@dataclass
class Scenario:
    name: str
    fault: str
    expect: tuple | Callable  # (tier, step), or work -> (tier, step) from run 1's records
    damage: Callable | None = None  # work -> None, between the runs
    nodes: int = 1
    nproc: tuple = (2, 2)  # ranks per node in run 1 and run 2
    overrides: tuple = ()
    mount: Callable | None = None  # work -> context manager around both runs
    prepare: Callable | None = None  # work -> None, before run 1 (inside the mount)
    seeds: tuple = ()  # two or more: that many jobs, one per seed, sharing one node folder
    checks: Callable | None = None  # (work, run1) -> [failure, ...], after run 1
    final_checks: Callable | None = None  # work -> [failure, ...], after run 2
    ci: bool = False
    from_pfs: Callable | tuple | None = None  # what run 2 recovers with --checkpoint.no-local-reshard


@dataclass
class Result:
    name: str
    expected: str = ""
    observed: str = ""
    failures: list = field(default_factory=list)
    recovery_s: float | None = None
    bytes_read: dict = field(default_factory=dict)
    skipped: str = ""
    wall_s: float = 0.0

    @property
    def status(self) -> str:
        return "skipped" if self.skipped else ("FAIL" if self.failures else "pass")


# ---- damage between runs ------------------------------------------------------

def wipe(*nodes: str):
    def damage(work: Path) -> None:
        for n in nodes or [p.name for p in (work / "local").iterdir()]:
            shutil.rmtree(work / "local" / n, ignore_errors=True)
    return damage


def flip(*rel: str):
    """Paths under the run's folder; `local/N/...` is inside node N's job folder."""
    def damage(work: Path) -> None:
        for r in rel:
            head = r.split("/")
            path = (harness.job_dir(work, head[1]).joinpath(*head[2:]) if head[0] == "local"
                    else work / r)
            harness.flip_byte(path)
    return damage


def new_dump_folder(work: Path) -> None:
    """The next run is a new job: its dump folder is new, the node's disk is not."""
    (work / "dump").rename(work / "dump-of-the-first-job")


def drop_pfs_folder(work: Path) -> None:
    shutil.rmtree(work / "dump" / "checkpoint")


def both(*damages):
    def damage(work: Path) -> None:
        for d in damages:
            d(work)
    return damage


# ---- file systems for the disk-full and read-only scenarios ----------------------

def can_mount() -> bool:
    if os.geteuid() != 0:
        return False
    with tempfile.TemporaryDirectory() as d:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", d],
                            capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", d], check=True)
    return ok


@contextlib.contextmanager
def _mounted(target: Path, *commands: list):
    target.mkdir(parents=True, exist_ok=True)
    for cmd in commands:
        subprocess.run(cmd, check=True, capture_output=True)
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def small_local_disk(work: Path):
    """Node 0's local folder on a 7 MiB tmpfs: room for another job's 1 MiB of leftovers
    and one committed step of the tiny job (two 2.3 MiB parts) but not two, so every
    later local save hits ENOSPC."""
    t = work / "local" / "0"
    return _mounted(t, ["mount", "-t", "tmpfs", "-o", "size=7m", "tmpfs", str(t)])


LEFTOVER_JOB = "20260101-000000-0ld0b0b0"


def leftovers_of_another_job(work: Path) -> None:
    """A finished job's step on the node's disk, which this job must neither use nor delete."""
    job = work / "local" / "0" / f"job-{LEFTOVER_JOB}"
    (job / "step-40").mkdir(parents=True)
    (job / "step-40" / "rank-00000.data").write_bytes(b"\0" * (1 << 20))
    (job / "JOB.json").write_text(f'{{"format": 1, "job_id": "{LEFTOVER_JOB}", '
                                  f'"dump_folder": "/pfs/gone", "created_at": 0}}')


def read_only_pfs(work: Path):
    t = work / "dump" / "checkpoint"
    return _mounted(t, ["mount", "--bind", str(t), str(t)],
                    ["mount", "-o", "remount,bind,ro", str(t)])


# ---- what run 1 left ------------------------------------------------------------

def committed(work: Path, event: str = "local_commit") -> list[int]:
    return [e["step"] for e in harness.ckpt_events(work, event)]


def newest_local(work: Path) -> tuple:
    return "local", max(committed(work))


def own_newest_commit(work: Path, local: Path | None = None) -> tuple:
    """The newest step the job committed on node 0's disk (its events file may lag
    behind a SIGKILL: it is written in the background); the node folder is shared."""
    job = (local or work.parent / "local") / "0" / f"job-{harness.job_id(work)}"
    return "local", max(int(p.parent.name[5:]) for p in job.glob("step-*/COMMIT.json"))


def newest_commit_on_node_0(work: Path) -> tuple:
    """Node 0's newest commit, with the other nodes' folders wiped: whether the commit
    of the step before the kill finished first is a race on a loaded machine."""
    return own_newest_commit(work, work / "local")


def newest_pfs(work: Path) -> tuple:
    """The newest complete PFS step (DCP's .metadata, written last): with one fast
    rank, whether a drain finished before the kill is a race."""
    folder = work / "dump" / "checkpoint"
    return "pfs", max(int(p.parent.name[5:]) for p in folder.glob("step-*/.metadata"))


def promoted(work: Path) -> tuple:
    ev = harness.ckpt_events(work, "preemption")
    return "pfs", ev[-1]["pfs_step"] if ev else -1


def check_disk_full(work: Path, run1) -> list[str]:
    bad = []
    failed = {e["step"] for e in harness.ckpt_events(work, "save_failed") if e["tier"] == "local"}
    if committed(work) != [2] or not {4, 6, 8, 10} <= failed:
        bad.append(f"local commits {committed(work)}, local failures {sorted(failed)}")
    if not {4, 8} <= set(committed(work, "pfs_commit")):
        bad.append(f"the PFS tier stopped with the local disk: PFS commits {committed(work, 'pfs_commit')}")
    out = "".join(p.stdout for p in run1)
    if f"other jobs' steps there take 1.0 MiB (job {LEFTOVER_JOB}" not in out:
        bad.append("the failed save's message does not name the other job's leftovers")
    return bad


def no_torn_steps_on_full_disk(work: Path) -> list[str]:
    """After run 2 (flushed at its last step), the full disk holds committed steps
    only: every failed step's parts were removed at once, not left to fill it; the
    other job's leftovers are still there."""
    d = harness.job_dir(work)
    torn = sorted(p.name for p in d.glob("step-*") if not (p / "COMMIT.json").exists())
    bad = [f"uncommitted steps left on the full disk: {torn}"] if torn else []
    if not (work / "local" / "0" / f"job-{LEFTOVER_JOB}" / "step-40" / "rank-00000.data").exists():
        bad.append("the other job's leftovers were deleted")
    return bad


def first_job_untouched(work: Path) -> list[str]:
    """The new job logged the first job's local steps and left them as they were."""
    old = [d for d in (work / "local" / "0").glob("job-*") if d.name != f"job-{harness.job_id(work)}"]
    bad = []
    if [e["step"] for e in harness.ckpt_events(work, "recovery")]:
        bad.append("the new job loaded a checkpoint")
    if len(old) != 1 or not (old[0] / "step-6" / "COMMIT.json").exists():
        bad.append(f"the first job's local step 6 is gone ({old})")
    found = harness.ckpt_events(work, "foreign_local_steps")
    if not found or found[0]["jobs"][0]["steps"] < 1:
        bad.append("the first job's local steps were not reported as ignored")
    return bad


def check_read_only_pfs(work: Path, run1) -> list[str]:
    failed = {e["step"] for e in harness.ckpt_events(work, "save_failed") if e["tier"] == "pfs"}
    bad = [] if {4, 8} <= failed else [f"PFS failures counted: {sorted(failed)}"]
    if not {2, 4, 6, 8, 10} <= set(committed(work)):
        bad.append(f"the local tier stopped with the PFS: local commits {committed(work)}")
    return bad


def check_preemption(work: Path, run1) -> list[str]:
    ev = harness.ckpt_events(work, "preemption")
    if not ev:
        return ["no preemption recorded"]
    ev, bad = ev[-1], []
    out = "".join(p.stdout for p in run1)
    exit_s = run1[0].ended - (ev["time"] - ev["seconds"])
    if exit_s > GRACE_S:
        bad.append(f"exited {exit_s:.1f}s after SIGTERM, grace {GRACE_S:g}s")
    if out.count("Process group destroyed") < 2 or "SIGKILL" in out:
        bad.append("the ranks did not exit cleanly")
    if ev["pfs_step"] != max(committed(work)):
        bad.append(f"newest local step {max(committed(work))} not promoted (PFS {ev['pfs_step']})")
    return bad


def check_torn_pfs_step(step: int):
    def check(work: Path, run1) -> list[str]:
        d = work / "dump" / "checkpoint" / f"step-{step}"
        return [] if not (d / ".metadata").exists() else [f"PFS step {step} was completed after all"]
    return check


def killed_by(fault: str) -> bool:
    """Whether a scenario's faults include a kill (each of them, in any order)."""
    return any(item.strip().startswith("kill") for item in fault.split(","))


MULTI = ("--checkpoint.replication_factor", "1")
# A kill after step 11 that expects PFS step 8: that drain starts in step 9 (held to the
# step boundary after its commit: in step 10, where the commit comes in step 9), so the
# save call of step 11 returns 1.5 s late first (slow_step), else on a loaded machine
# the drain is not done at the kill (dp-2-to-1 failed so in a bench_all run) and the
# restart rightly takes PFS step 4, which for flip-pfs hides the flip it tests.
SLOW_KILL_11 = "kill_after_step@11:1,slow_step@11"
SCENARIOS = [
    Scenario("kill-after-step", "kill_after_step@7:1", ("local", 6)),
    Scenario("kill-staging", "kill_during_staging@8:1", ("local", 6), ci=True),
    Scenario("kill-local-write", "kill_during_local_write@8:1", ("local", 6)),
    Scenario("kill-replication", "kill_during_replication@8:1", ("local", 6), nodes=2,
             overrides=MULTI, ci=True),
    Scenario("kill-pfs-write", "kill_during_pfs_write@8:1", ("pfs", 4), damage=wipe(),
             checks=check_torn_pfs_step(8), ci=True),
    Scenario("wipe-one-node", "kill_after_step@7:1", ("local", 6), damage=wipe("1"), nodes=2,
             overrides=MULTI),
    Scenario("wipe-two-of-three-uneven", "kill_after_step@7:1", newest_commit_on_node_0,
             damage=wipe("1", "2"), nodes=3, nproc=(1, 1),
             overrides=("--checkpoint.replication_factor", "2"), ci=True),
    Scenario("wipe-every-node", SLOW_KILL_11, ("pfs", 8), damage=wipe()),
    Scenario("pfs-folder-deleted", "kill_after_step@7:1", ("local", 6), damage=drop_pfs_folder,
             ci=True),
    Scenario("new-dump-folder", "kill_after_step@7:1", ("fresh", 0), damage=new_dump_folder,
             final_checks=first_job_untouched, ci=True),
    # One rank per job, two jobs on two cores: whether the step before the kill had
    # committed is a race, so each job must resume its own newest committed step.
    Scenario("two-jobs-one-node", "kill_after_step@7:0,kill_after_step@11:0",
             (own_newest_commit, own_newest_commit), nproc=(1, 1), seeds=(42, 7), ci=True),
    Scenario("flip-local", "kill_after_step@11:1", ("local", 8),
             damage=flip("local/0/step-10/rank-00001.data")),
    Scenario("flip-replica", "kill_after_step@7:1", ("local", 4), nodes=2, overrides=MULTI,
             damage=both(wipe("1"), flip("local/0/step-6/rank-00002.data"))),
    Scenario("flip-pfs", SLOW_KILL_11, ("pfs", 4),
             damage=both(wipe(), flip("dump/checkpoint/step-8/__1_0.distcp"))),
    Scenario("disk-full", SLOW_KILL_11, ("pfs", 8), mount=small_local_disk,
             prepare=leftovers_of_another_job, checks=check_disk_full,
             final_checks=no_torn_steps_on_full_disk, ci=True),
    Scenario("read-only-pfs", "kill_after_step@11:1", ("local", 10), mount=read_only_pfs,
             checks=check_read_only_pfs, ci=True),
    Scenario("sigterm", "sigterm_after_step@5:0", promoted, damage=wipe(),
             checks=check_preemption, ci=True),
    # a DP change: the newest local step, resharded (local_reshard); without it a PFS step
    Scenario("dp-2-to-1", SLOW_KILL_11, newest_commit_on_node_0, nproc=(2, 1), from_pfs=("pfs", 8)),
    Scenario("dp-1-to-2", "kill_after_step@11:0", newest_commit_on_node_0, nproc=(1, 2), ci=True,
             from_pfs=newest_pfs),
]
CI_SUBSET = [s.name for s in SCENARIOS if s.ci]
BY_NAME = {s.name: s for s in SCENARIOS}


class Matrix:
    """Runs scenarios under `base`, with one uninterrupted run per job shape to compare
    losses with (made on first use)."""

    def __init__(self, base: Path, keys: tuple = (), reference: "Matrix | None" = None) -> None:
        self.base = Path(base)
        self.keys = keys  # plugin keys every run gets (--keys)
        # whose uninterrupted runs to compare losses with: another matrix's (without keys
        # that leave losses as they are, helper_process), which these runs then match too
        self.reference = reference or self
        self._baselines: dict = {}

    def launch(self, work: Path, nodes: int, nproc: int, *overrides: str, fault: str = "",
               tag: str = "run", local: Path | None = None) -> list:
        env = {"TITAN_CKPT_SAMPLE_LOG": str(work / f"{tag}.samples.jsonl")}
        args = ("--training.global_batch_size", str(2 * nproc * nodes if nodes > 1 else 4),
                *self.keys, *overrides)  # one global batch for DP 1 and 2, so DP can change
        if nodes == 1:
            procs = [harness.torchrun(work, *args, nproc=nproc, fault=fault, loss_log=f"{tag}.jsonl",
                                      env=env, local=local)]
        else:
            procs = harness.torchrun_nodes(work, *args, nnodes=nodes, nproc=nproc, fault=fault,
                                           loss_log=f"{tag}.jsonl", env=env)
        for p in procs:
            p.ended = time.time()
        return procs

    def baseline(self, nodes: int, nproc: int, overrides: tuple) -> dict:
        key = (nodes, nproc, overrides)
        if key not in self._baselines:
            work = self.base / f"baseline-{len(self._baselines)}"
            shutil.rmtree(work, ignore_errors=True)
            procs = self.launch(work, nodes, nproc, *overrides)
            if any(p.returncode for p in procs):
                raise RuntimeError("the uninterrupted run failed:\n" + procs[0].stdout[-3000:])
            self._baselines[key] = harness.losses(work, "run.jsonl")
        return self._baselines[key]

    def run(self, name: str) -> Result:
        sc, res, t0 = BY_NAME[name], Result(name), time.monotonic()
        if sc.mount and not can_mount():
            res.skipped = "needs root to mount a tmpfs / read-only bind"
            return res
        work = self.base / name
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        with sc.mount(work) if sc.mount else contextlib.nullcontext():
            if sc.prepare:
                sc.prepare(work)
            if sc.seeds:
                self._run_jobs_sharing_a_node(sc, work, res)
            else:
                self._run(sc, work, res)
        res.wall_s = time.monotonic() - t0
        return res

    def _run(self, sc: Scenario, work: Path, res: Result) -> None:
        run1 = self.launch(work, sc.nodes, sc.nproc[0], *sc.overrides, fault=sc.fault, tag="run1")
        if killed_by(sc.fault) and all(p.returncode == 0 for p in run1):
            res.failures.append("run 1 was not killed")
        expect = sc.from_pfs if sc.from_pfs and "--checkpoint.no-local-reshard" in self.keys else sc.expect
        tier, step = expect(work) if callable(expect) else expect
        res.failures += sc.checks(work, run1) if sc.checks else []
        if sc.damage:
            sc.damage(work)
        run2 = self.launch(work, sc.nodes, sc.nproc[1], *sc.overrides, tag="run2")
        if any(p.returncode for p in run2):
            res.failures.append("run 2 failed: " + run2[0].stdout[-1500:])
            return
        self._check_restart(sc, work, res, tier, step, sc.overrides)
        res.failures += sc.final_checks(work) if sc.final_checks else []

    def _run_jobs_sharing_a_node(self, sc: Scenario, work: Path, res: Result) -> None:
        """One job per seed, each with its own dump folder and the same node folder: run
        at once with their own faults, then restarted one after the other. Each must
        resume its own newest step and match its own uninterrupted run."""
        import concurrent.futures as cf

        jobs = [(work / f"job{i}", ("--debug.seed", str(seed)), fault, expect)
                for i, (seed, fault, expect) in enumerate(zip(sc.seeds, sc.fault.split(","), sc.expect))]
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            run1 = list(pool.map(lambda j: self.launch(j[0], 1, sc.nproc[0], *j[1], fault=j[2],
                                                       tag="run1", local=work / "local"), jobs))
        if any(p.returncode == 0 for procs in run1 for p in procs):
            res.failures.append("a job's run 1 was not killed")
        for w, overrides, _, expect in jobs:
            tier, step = expect(w) if callable(expect) else expect
            run2 = self.launch(w, 1, sc.nproc[1], *overrides, tag="run2", local=work / "local")
            if any(p.returncode for p in run2):
                res.failures.append(f"{w.name}: run 2 failed: " + run2[0].stdout[-1500:])
                return
            self._check_restart(sc, w, res, tier, step, overrides)

    def _check_restart(self, sc: Scenario, work: Path, res: Result, tier: str, step: int,
                       overrides: tuple) -> None:
        """What run 2 recovered, its losses, and that the newest steps still verify;
        `res` gathers every job's findings."""
        recs = harness.ckpt_events(work, "recovery")
        rec = recs[-1] if recs else {"tier": "fresh", "step": 0, "seconds": 0.0, "bytes_local": 0,
                                     "bytes_peer": 0, "bytes_pfs": 0}
        res.expected = " / ".join(filter(None, [res.expected, f"{tier} {step}"]))
        res.observed = " / ".join(filter(None, [res.observed, f"{rec['tier']} {rec['step']}"]))
        res.recovery_s = (res.recovery_s or 0.0) + rec["seconds"]
        for k in ("local", "peer", "pfs"):
            res.bytes_read[k] = res.bytes_read.get(k, 0) + rec[f"bytes_{k}"]
        if (rec["tier"], rec["step"]) != (tier, step):
            res.failures.append(f"recovered {rec['tier']} {rec['step']}, expected {tier} {step}")
        if rec["tier"] == "local" and rec["bytes_pfs"]:
            res.failures.append(f"a local recovery read {rec['bytes_pfs']} bytes from the PFS")
        if sc.nproc[0] == sc.nproc[1]:
            res.failures += self._same_losses(sc, work, rec["step"], overrides)
        else:
            res.failures += self._every_sequence_once(work, rec["step"])
        res.failures += self._newest_steps_verify(work)

    def _same_losses(self, sc: Scenario, work: Path, step: int, overrides: tuple) -> list[str]:
        ref = self.reference.baseline(sc.nodes, sc.nproc[1], overrides)
        got = harness.losses(work, "run2.jsonl")
        steps = range(step + 1, STEPS + 1)
        if [got.get(s) for s in steps] != [ref[s] for s in steps]:
            return [f"{work.name}: losses after step {step} differ from the uninterrupted run's"]
        return []

    @staticmethod
    def _every_sequence_once(work: Path, step: int) -> list[str]:
        """Run 1's sequences up to the checkpoint, then run 2's: each exactly once."""
        first = [r for r in harness.sample_records(work / "run1.samples.jsonl") if r["step"] <= step]
        seen = sorted(i for r in first + harness.sample_records(work / "run2.samples.jsonl")
                      for i in r["seq_ids"])
        if seen != list(range(STEPS * 4)):
            dup = len(seen) - len(set(seen))
            return [f"sequences not seen exactly once ({len(seen)} ids, {dup} repeated)"]
        return []

    @staticmethod
    def _newest_steps_verify(work: Path) -> list[str]:
        """The newest committed step of every tier and node folder still verifies."""
        steps, _ = ckpt_inspect.list_steps(str(work / "dump"))  # its local_roots.json: its job folders
        newest: dict = {}
        for s in steps:
            if s.committed and s.step > newest.get((s.tier, s.folder), (-1, ""))[0]:
                newest[(s.tier, s.folder)] = (s.step, s.path)
        bad = [c for _, path in newest.values() for c in ckpt_inspect.verify_step(path) if c.failed]
        return [f"newest step does not verify: {c.line()}" for c in bad]


def table(results: list[Result]) -> list[str]:
    rows = ["| scenario | fault | expected | observed | result | recovery | bytes read: local / peer / PFS |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        sc = BY_NAME[r.name]
        b = r.bytes_read
        nbytes = " / ".join(ckpt_inspect.human_bytes(b[k]) for k in ("local", "peer", "pfs")) if b else ""
        rec = f"{r.recovery_s:.2f} s" if r.recovery_s is not None else ""
        status = r.status if not r.skipped else f"skipped ({r.skipped})"
        rows.append(f"| {r.name} | `{sc.fault}` | {r.expected} | {r.observed} | {status} | {rec} | {nbytes} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"scenarios (default: all): {', '.join(BY_NAME)}")
    ap.add_argument("--ci", action="store_true", help="only the CI subset")
    ap.add_argument("--work", default="", help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--update", metavar="BENCHMARKS.md", help="write the table into this file")
    ap.add_argument("--keys", default="", help="options every run gets, e.g. --keys=--checkpoint.helper_process "
                    "(printed only: the recorded matrix is the defaults')")
    args = ap.parse_args(argv)
    if args.keys and args.update:
        ap.error("--keys runs are printed, not recorded: drop --update")
    names = args.names or (CI_SUBSET if args.ci else list(BY_NAME))
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; known: {', '.join(BY_NAME)}")
    base = Path(args.work or tempfile.mkdtemp(prefix="titan-chaos-"))
    matrix, results = Matrix(base, tuple(shlex.split(args.keys))), []
    for n in names:
        r = matrix.run(n)
        results.append(r)
        print(f"{r.name}: {r.status} ({r.wall_s:.0f}s) {'; '.join(r.failures)[:600]}", flush=True)
    lines = table(results)
    print("\n".join(lines))
    from benchmd import record_targets

    passed = sum(r.status == "pass" for r in results)
    if args.keys:
        print(f"with {args.keys}: {passed} of {len(results)} passed")
    else:
        record_targets("chaos", [("fault scenarios recovered as expected", f"{passed} of {len(results)}"
                                  f" ({sum(bool(r.skipped) for r in results)} skipped)", "all",
                                  passed == len(results))])
    if args.update:
        from benchmd import update_section

        update_section(Path(args.update), SECTION, "\n".join([
            f"Command: `.venv/bin/python scripts/chaos.py --update {args.update}` (tiny llama3, 2 CPU "
            "ranks per node, gloo; two simulated nodes with replication_factor 1 where the scenario "
            "needs neighbors). Expected/observed: the tier and step the restart loaded; pass also "
            "needs the losses after resume equal to an uninterrupted run's bit for bit (every "
            "sequence exactly once when the DP degree changes) and the newest step of every tier "
            "still verifying.", "", *lines]))
    if not args.work:
        shutil.rmtree(base, ignore_errors=True)
    return 1 if any(r.failures for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
