"""``titan-ckpt`` command line.

Each subcommand is a pair of small functions: ``_<name>_args(parser)`` adds
its options and ``cmd_<name>(args) -> int`` runs it. They are registered in
``COMMANDS`` and nowhere else. This module must stay importable without
torch: subcommands that need heavy libraries import them inside ``cmd_*``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from .policy.young import LLAMA3_MTBF_S, young_table

LLAMA3_MTBF_HOURS = round(LLAMA3_MTBF_S / 3600, 2)  # 3.09


def _floats(text: str) -> list[float]:
    """Parse "600,120,2" into floats (argparse type)."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _ints(text: str) -> list[int]:
    values = _floats(text)
    if any(v != int(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected whole numbers, got {text!r}")
    return [int(v) for v in values]


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    """Right-aligned plain-text table (first column left-aligned)."""
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    for r in [header] + rows:
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        print("  ".join(cells).rstrip())


# -- plan -------------------------------------------------------------------


def _plan_args(p: argparse.ArgumentParser) -> None:
    from .policy.cluster import FIELD_HELP, PRESETS

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = """\
Without --cluster: Young's interval for each --delta. With --cluster: per tier
(local NVMe + replicas, PFS drain) bytes per rank, delta, background write,
replication and drain times, tau and expected waste, against a synchronous PFS
save; formulas in titan_ckpt_plus/policy/cluster.py.

examples:
  titan-ckpt plan --delta 600,120,60,10,2 --mtbf-hours 3.09
  titan-ckpt plan --cluster llama3-405b-16384gpu
  titan-ckpt plan --cluster llama3-405b-16384gpu --pfs-gbps 1000 --bytes-per-param 12
  titan-ckpt plan --cluster my_cluster.toml     # Cluster fields; base = "<preset>" optional"""
    p.add_argument("--delta", type=_floats, default=None,
                   help="seconds a checkpoint blocks training, comma-separated (default: 600,120,60,10,2)")
    p.add_argument("--mtbf-hours", type=float, default=None,
                   help=f"job mean time between failures in hours (default: {LLAMA3_MTBF_HOURS}, Llama 3; "
                        "with --cluster: overrides the per-GPU MTBF)")
    g = p.add_argument_group("cluster plan")
    g.add_argument("--cluster", default=None, metavar="NAME|FILE",
                   help=f"a preset ({', '.join(PRESETS)}) or a JSON/TOML file of cluster fields")
    g.add_argument("--markdown", action="store_true", help="print the table as markdown")
    for name, text in FIELD_HELP.items():
        if name in ("job_mtbf_hours",):  # --mtbf-hours
            continue
        g.add_argument("--" + name.replace("_", "-"), dest="cluster_" + name, default=None, metavar=name.upper(),
                       type=_cluster_field_type(name), help=text)


def _cluster_field_type(name: str) -> Callable:
    if name in ("gpus", "gpus_per_node", "replication_factor"):
        return int
    if name == "name":
        return str
    if name == "params":
        from .policy.cluster import parse_count

        def count(text: str) -> float:
            try:
                return parse_count(text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
        return count
    return float


def _plan_cluster(args: argparse.Namespace) -> int:
    """The per-tier plan of a preset or file cluster, with command-line overrides."""
    from .policy import cluster as cl

    overrides = {k[len("cluster_"):]: v for k, v in vars(args).items()
                 if k.startswith("cluster_") and v is not None}
    if args.mtbf_hours is not None:
        if "mtbf_gpu_hours" in overrides:
            raise SystemExit("error: give --mtbf-hours (job) or --mtbf-gpu-hours (per GPU), not both")
        overrides["job_mtbf_hours"] = args.mtbf_hours
    try:
        c = cl.with_overrides(cl.get_cluster(args.cluster), **overrides)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    rows = cl.plan(c)
    cells = cl.plan_cells(rows)
    if args.markdown:
        print("\n".join(f"    {line}" for line in cl.describe(c)) + "\n")
        print("| " + " | ".join(cl.PLAN_HEADER) + " |")
        print("|" + "|".join("---" if i == 0 else "--:" for i in range(len(cl.PLAN_HEADER))) + "|")
        for r in cells:
            print("| " + " | ".join(r) + " |")
        print("\n" + "\n".join(cl.summary(c, rows)))
    else:
        print("\n".join(cl.describe(c)))
        _print_table(cl.PLAN_HEADER, cells)
        print("\n".join(cl.summary(c, rows)))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Young's interval for each checkpoint cost, or the tiers of a cluster (--cluster)."""
    if args.cluster is not None:
        if args.delta is not None:
            raise SystemExit("error: --delta and --cluster are exclusive (the cluster determines delta)")
        return _plan_cluster(args)
    given = sorted("--" + k[len("cluster_"):].replace("_", "-") for k, v in vars(args).items()
                   if k.startswith("cluster_") and v is not None)
    if given or args.markdown:
        raise SystemExit(f"error: {', '.join(given) or '--markdown'} need(s) --cluster")
    mtbf_hours = LLAMA3_MTBF_HOURS if args.mtbf_hours is None else args.mtbf_hours
    deltas = [600, 120, 60, 10, 2] if args.delta is None else args.delta
    if not mtbf_hours > 0:
        raise SystemExit("--mtbf-hours must be > 0")
    print(f"Young interval tau = sqrt(2 delta M), M = {mtbf_hours:g} h; lost work per failure = tau/2")
    rows = [
        [f"{r.delta_s:g}", f"{r.tau_s / 60:.1f}", f"{r.overhead * 100:.1f}",
         f"{r.lost_work_s / 60:.1f}", f"{r.checkpoints_per_day:.0f}"]
        for r in young_table(deltas, mtbf_hours * 3600)
    ]
    _print_table(["delta_s", "tau_min", "overhead_%", "lost_per_failure_min", "ckpts_per_day"], rows)
    return 0


# -- simulate ---------------------------------------------------------------


def _simulate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mtbf-hours", type=float, default=LLAMA3_MTBF_HOURS, help="true MTBF of the Poisson trace")
    p.add_argument("--prior-hours", type=_floats, default=None,
                   help="adaptive priors, comma-separated (default: 0.1x,1x,10x the true MTBF)")
    p.add_argument("--prior-weight", type=float, default=1.0, help="prior worth in pseudo-failures")
    p.add_argument("--delta-local", type=float, default=10.0, help="seconds a local save blocks")
    p.add_argument("--delta-pfs", type=float, default=120.0, help="seconds a PFS save blocks")
    p.add_argument("--step-time", type=float, default=5.0, help="seconds per training step")
    p.add_argument("--hours", type=float, default=54 * 24.0, help="compute the job needs, hours (default: 54 days)")
    p.add_argument("--restart", type=float, default=300.0, help="seconds from failure to training again")
    p.add_argument("--p-unrecoverable", type=float, default=0.1,
                   help="fraction of failures the local tier cannot recover")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", default=None,
                   help="file of failure times in seconds, one per line (# comments); replaces the Poisson trace")
    p.add_argument("--fixed", type=_ints, default=[100, 500, 2000], help="fixed local intervals in steps")
    p.add_argument("--fixed-pfs-ratio", type=int, default=10, help="fixed policies save to PFS every N local intervals")
    p.add_argument("--warmup-failures", type=int, default=0, help="measure waste only after this many failures")


def _read_trace(path: str) -> list[float]:
    """Failure times in seconds, one per line; blank lines and # comments skipped."""
    with open(path, encoding="utf-8") as f:
        times = [float(line.split("#")[0]) for line in f if line.split("#")[0].strip()]
    if times != sorted(times) or any(t < 0 for t in times):
        raise SystemExit(f"{path}: failure times must be >= 0 and increasing")
    return times


def cmd_simulate(args: argparse.Namespace) -> int:
    """Wasted fraction of adaptive, fixed and oracle policies on one trace."""
    from .policy.simulate import Job, PoissonTrace, simulate, standard_policies

    mtbf_s = args.mtbf_hours * 3600
    try:
        job = Job(args.hours * 3600, args.step_time, args.delta_local, args.delta_pfs,
                  args.restart, args.p_unrecoverable)
        trace = _read_trace(args.trace) if args.trace else PoissonTrace(mtbf_s, args.seed)
        priors = [h * 3600 for h in args.prior_hours] if args.prior_hours else [mtbf_s / 10, mtbf_s, mtbf_s * 10]
        policies = standard_policies(job, mtbf_s, priors, args.prior_weight, args.fixed, args.fixed_pfs_ratio)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    results = [simulate(job, p, trace, args.seed, args.warmup_failures) for p in policies]
    oracle = results[0].wasted_fraction
    source = f"trace {args.trace}" if args.trace else f"Poisson trace, MTBF {args.mtbf_hours:g} h, seed {args.seed}"
    print(f"{source}; {results[0].failures} failures; step {args.step_time:g}s, "
          f"delta local/pfs {args.delta_local:g}/{args.delta_pfs:g}s, restart {args.restart:g}s, "
          f"p_unrecoverable {args.p_unrecoverable:g}")
    rows = [
        [r.policy, f"{r.wasted_fraction * 100:.2f}%",
         f"{r.wasted_fraction / oracle:.3f}" if oracle > 0 else "-",
         f"{r.final_intervals[0]}/{r.final_intervals[1]}"]
        for r in results
    ]
    _print_table(["policy", "wasted", "vs_oracle", "interval_local/pfs"], rows)
    return 0


# -- summary ----------------------------------------------------------------


def _summary_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dump_folder", help="the job's [job] dump_folder")


def cmd_summary(args: argparse.Namespace) -> int:
    """What the plugin did in a run (all incarnations): saves, recoveries, delta."""
    import statistics

    from .telemetry import read_events

    path = os.path.join(args.dump_folder, "titan_ckpt_plus", "events.jsonl")
    ev = read_events(path)
    if not ev:
        print(f"no titan_ckpt_plus events in {path}")
        return 1
    by = lambda kind: [e for e in ev if e["event"] == kind]  # noqa: E731
    stages, local, pfs = by("stage"), by("local_commit"), by("pfs_commit")
    print(f"events: {path}")
    print(f"local steps committed: {[e['step'] for e in local]}")
    print(f"PFS steps written:     {[e['step'] for e in pfs]}")
    print(f"failed saves:          {len(by('save_failed'))}")
    for r in by("recovery"):
        print(f"recovered step {r['step']} from the {r['tier']} tier in {r['seconds']:.2f}s "
              f"(bytes read: local {r['bytes_local']}, pfs {r['bytes_pfs']}); "
              f"skipped {[(t, s) for t, s, _ in r['skipped']] or 'nothing'}")
    rows = []
    med = lambda xs, f=".4f": format(statistics.median(xs), f) if xs else "-"  # noqa: E731
    rows.append(["local", med([e["delta_s"] for e in stages]),
                 med([e["background_write_s"] for e in local]), med([e["bytes"] for e in local], ".0f")])
    rows.append(["pfs", "0 (drained from local)",
                 med([e["background_write_s"] for e in pfs]), med([e["bytes"] for e in pfs], ".0f")])
    _print_table(["tier", "median delta_s", "median background_write_s", "median bytes/rank"], rows)
    return 0


# -- ls / verify / report (reading logic in inspect.py, plots in report.py) ---


def _ls_args(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = """\
List every checkpoint step this host can see, per tier and node folder:
committed or not, state, parts (rank parts in the folder; PFS: .distcp shards),
size, age, and replicas: parts held for ranks of other nodes (from COMMIT.json's
node_ranks if present, else parts - world_size / nodes, nodes = the roots in
local_roots.json; "?" when neither is known, e.g. a root given only by
--local-root).

Local roots come from DUMP_FOLDER/titan_ckpt_plus/local_roots.json (written by
the plugin), any local_root(s) field in events.jsonl, and --local-root. PFS
folders are the dump folder's children that hold step-N folders. A local step
without COMMIT.json, or a PFS step without .metadata, is listed as torn.

Given a node's local folder instead (the [checkpoint] local_folder every job
on the node shares), list one row per job there: its dump folder (from its
JOB.json), steps, size, age of its newest file, whether a process holds its
lock (still writing) and its status: running; resumable (its dump folder still
holds its identity); stale: no job will load its steps again (dump folder
missing, or now another job's); orphaned: its dump folder has no usable
identity, so only adopt_job there would continue it; legacy: steps written
before job identities, which no job loads; unknown: JOB.json or the dump
folder cannot be read from here. `titan-ckpt clean` removes stale steps on
request."""
    p.epilog = """\
examples:
  titan-ckpt ls outputs/run1
  titan-ckpt ls outputs/run1 --local-root /local_nvme/ckpt/0 --local-root /mnt/n1/ckpt/1
  titan-ckpt ls /local_nvme/ckpt/0              # every job's steps on this node"""
    p.add_argument("path", metavar="PATH", help="the job's [job] dump_folder, or a node's local folder")
    p.add_argument("--local-root", action="append", default=[], metavar="PATH",
                   help="with a dump folder: a node-local checkpoint folder to list too (repeatable)")


def cmd_ls(args: argparse.Namespace) -> int:
    """Steps per tier and node folder, committed or not; or every job of a node folder."""
    from .inspect import is_node_folder, list_steps, ls_table

    if is_node_folder(args.path):
        return _ls_node(args)
    steps, notes = list_steps(args.path, args.local_root)
    print("\n".join([f"# {n}" for n in notes] + (ls_table(steps) if steps else ["no steps found"])))
    return 0 if steps else 1


def _ls_node(args: argparse.Namespace) -> int:
    """One row per job of a node's local folder, and the hint to clean stale ones."""
    from .inspect import job_status, jobs_table
    from .tiers.local import node_jobs

    if args.local_root:
        print(f"error: --local-root goes with a dump folder; {args.path} is a node's local folder")
        return 2
    jobs = node_jobs(os.path.abspath(args.path))
    print(f"# node folder {os.path.abspath(args.path)}: {len(jobs)} jobs")
    statuses = [job_status(j) for j in jobs]
    print("\n".join(jobs_table(jobs, [status for status, _ in statuses])))
    if any(stale for _, stale in statuses):
        print(f"# stale steps are never deleted by a job: titan-ckpt clean {args.path} --dry-run")
    return 0 if jobs else 1


def _clean_args(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = """\
Remove other jobs' leftover steps from a node's local folder. A job never
deletes another job's steps (nor its own after it ends), so they stay until
this command removes them; it only runs when asked.

Removed by default: each job whose status in `titan-ckpt ls LOCAL_FOLDER` is
stale (its dump folder is missing, or now holds another job's identity, so no
job will load its steps again), and the legacy steps directly in the folder
(written before job identities, never loaded) once nothing has written there
for an hour. Orphaned jobs (a dump folder without a usable identity: adopt_job
could still continue them) are kept. --job also removes the jobs named,
--older-than every idle job whose newest file is that old.

A job whose lock is held (still writing) is never removed. Each job folder is
moved away while this command holds its lock, then deleted, so no job writes
into it meanwhile (one starting at that moment waits, then makes a new one). Status is judged from this host: a dump folder counts as missing
only when the folder above it is visible (on a PFS not mounted here it is
"unknown" and kept), so run it where the jobs' dump folders are visible, and
--dry-run first.

exit status: 0 done (also when nothing was to be removed), 1 a selected job
could not be removed (each one is named), 2 LOCAL_FOLDER missing or not a
node's local folder, or a --job not in it."""
    p.epilog = """\
examples:
  titan-ckpt clean /local_nvme/ckpt/0 --dry-run
  titan-ckpt clean /local_nvme/ckpt/0
  titan-ckpt clean /local_nvme/ckpt/0 --job 20250101-120000-ab12cd34
  titan-ckpt clean /local_nvme/ckpt/0 --older-than 72 --dry-run"""
    p.add_argument("local_folder", help="a node's local folder ([checkpoint] local_folder, {node_rank} filled in)")
    p.add_argument("--dry-run", action="store_true", help="print what would be removed, change nothing")
    p.add_argument("--job", action="append", default=[], metavar="ID",
                   help="also remove this job's steps, whatever its status unless running (repeatable)")
    p.add_argument("--older-than", type=float, default=None, metavar="HOURS",
                   help="also remove every idle job whose newest file is older than this")


def _remove(job) -> str:
    """Delete a job's folder (or the legacy steps); "" once done, else why not.
    The folder's lock is taken first: a job holding it is writing there."""
    import shutil

    from .tiers import files
    from .tiers.local import JobLock

    if job.job_id is None:
        try:
            for name in os.listdir(job.path):
                path = os.path.join(job.path, name)
                if files.step_of(name) is not None:
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        except OSError as e:
            return f"not all removed ({e})"
        return ""
    lock, gone = JobLock(job.path), None
    try:
        who = lock.acquire()
        if who:
            return f"still writing ({who})"
        # Moved away while locked: a job starting now finds its folder gone and makes
        # a new one, never writing into this one as it is deleted.
        gone = os.path.join(os.path.dirname(job.path),
                            f".removing-{os.path.basename(job.path)}-{os.getpid()}")
        os.rename(job.path, gone)
    except OSError as e:
        return f"not removed ({e})"
    finally:
        lock.release()
    try:
        shutil.rmtree(gone)
    except OSError as e:
        return f"not all removed ({e})"
    return ""


def cmd_clean(args: argparse.Namespace) -> int:
    """Remove stale, named or old jobs' steps from a node's local folder."""
    import time

    from .inspect import human_bytes, job_status, node_folder_problem, wants_clean
    from .tiers.local import node_jobs

    folder = os.path.abspath(args.local_folder)
    problem = node_folder_problem(folder)
    if problem:
        print(f"error: {problem}")
        return 2
    jobs, now = node_jobs(folder), time.time()
    missing = sorted(set(args.job) - {j.job_id for j in jobs})
    if missing:
        print(f"error: no job {', '.join(missing)} in {folder}")
        return 2
    older = None if args.older_than is None else args.older_than * 3600
    verb = "would remove" if args.dry_run else "removed"
    gone, failed = [], 0
    for j in jobs:
        status, stale = job_status(j)
        name = j.job_id or "(no identity)"
        if j.writing:
            print(f"kept {name}: still writing ({j.writing})")
        elif not wants_clean(j, stale, args.job, older, now):
            print(f"kept {name}: {status}")
        elif why := ("" if args.dry_run else _remove(j)):
            print(f"kept {name}: {why}")
            failed += 1
        else:
            n = len(j.steps)
            what = f"{n} step{'s' * (n != 1)}, {human_bytes(j.size)}"
            where = (f"directly in {j.path}" if j.job_id is None
                     else f"dump folder {j.record.get('dump_folder', '?')}")
            print(f"{verb} {'legacy steps' if j.job_id is None else 'job ' + j.job_id} "
                  f"({what}), {where}: {status}")
            gone.append(j)
    print(f"total: {verb} {sum(len(j.steps) for j in gone)} steps, "
          f"{human_bytes(sum(j.size for j in gone))}; kept {len(jobs) - len(gone)} of {len(jobs)} jobs")
    return 1 if failed else 0


def _verify_args(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = """\
Check every checksum under PATH, which may be a local step folder, a local
root, a PFS step folder, a PFS folder, or a dump folder (its PFS folders and
the local roots in titan_ckpt_plus/local_roots.json, plus --local-root).

Local parts are checked against their rank-N.json manifests (size, CRC-32C of
.data and .layout); PFS steps against titan_ckpt_plus.json. A PFS step without
it (written by stock torchtitan) is "unverified", a part of a step without
COMMIT.json that never got its manifest is "torn"; neither is a failure.
Prints one line per part (local) or step (PFS) checked, one per bad file.

exit status: 0 all checked files pass, 1 a file failed (each one is named),
2 PATH missing or nothing to check."""
    p.epilog = """\
examples:
  titan-ckpt verify outputs/run1
  titan-ckpt verify /local_nvme/ckpt/0/step-1200
  titan-ckpt verify outputs/run1/checkpoint/step-1200 || echo corrupt"""
    p.add_argument("path", help="step folder, local root, PFS folder or dump folder")
    p.add_argument("--local-root", action="append", default=[], metavar="PATH",
                   help="with a dump folder: a node-local folder to check too (repeatable)")


def cmd_verify(args: argparse.Namespace) -> int:
    """Checksums of every part and PFS step under a path."""
    from .inspect import verify_path

    try:
        checks, notes = verify_path(args.path, args.local_root)
    except FileNotFoundError as e:
        print(f"error: {e}")
        return 2
    for line in [f"# {n}" for n in notes] + [c.line() for c in checks]:
        print(line)
    failed = sum(c.failed for c in checks)
    counts = {s: sum(c.status == s for c in checks) for s in ("ok", "FAILED", "unverified", "torn")}
    print(f"{len(checks)} checked: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return 1 if failed else (0 if checks else 2)


def _report_args(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = """\
Render PNG plots from RUN_DIR/titan_ckpt_plus/events.jsonl (no wandb needed):
  delta.png             training blocked per save (s), per tier, over steps
  background_write.png  background write time (s) per tier, over steps
  interval.png          interval per tier (steps, tau in s) and MTBF per failure
                        class (h) over wall time; skipped, with a note, when the
                        run logged no "interval" records
Recoveries are dashed vertical lines, failed saves crosses."""
    p.epilog = """\
examples:
  titan-ckpt report outputs/run1                 # -> outputs/run1/titan_ckpt_plus/report/
  titan-ckpt report outputs/run1 --out /tmp/ckpt-report"""
    p.add_argument("run_dir", help="the job's dump_folder (or its events.jsonl)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where to write the PNGs (default: RUN_DIR/titan_ckpt_plus/report)")


def cmd_report(args: argparse.Namespace) -> int:
    """PNG plots of delta, write time, interval and MTBF."""
    from .report import render

    rep = render(args.run_dir, args.out)
    for n in rep.notes:
        print(f"note: {n}")
    for f in rep.files:
        print(f"wrote {f}")
    return 0 if rep.files else 1


def _wandb_workspace_args(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = """\
Save a wandb workspace (a saved view of PROJECT) with the plugin's panels: delta per
tier, staging and background write time and bandwidth per tier, time to a durable
commit, replication time and bytes, drain lag, interval vs Young's tau per tier,
expected waste, MTBF estimates and failures, recovery time and bytes per source.
Runs log these keys under ckpt/ through torchtitan's wandb logger
([metrics] enable_wandb = true). Needs wandb credentials (`wandb login` or
WANDB_API_KEY) and the network, unless --dry-run.

exit status: 0 saved (or written), 1 no credentials or wandb not reachable, 2 bad
ENTITY/PROJECT."""
    p.epilog = """\
examples:
  titan-ckpt wandb-workspace my-team/llama3-8b
  titan-ckpt wandb-workspace my-team/llama3-8b --dry-run --out ckpt-workspace.json"""
    p.add_argument("target", metavar="ENTITY/PROJECT", help="the wandb entity and project the runs log to")
    p.add_argument("--name", default="titan_ckpt_plus checkpoints", help="the workspace's name")
    p.add_argument("--dry-run", action="store_true", help="save nothing; with --out, write the spec as JSON")
    p.add_argument("--out", default=None, metavar="FILE", help="where --dry-run writes the workspace spec")


def cmd_wandb_workspace(args: argparse.Namespace) -> int:
    """A wandb workspace of the ckpt/ panels, saved or written as JSON."""
    import json

    from . import wandb_workspace

    entity, _, project = args.target.partition("/")
    if not entity or not project or "/" in project:
        print(f"error: {args.target!r} is not ENTITY/PROJECT (e.g. my-team/llama3-8b)")
        return 2
    workspace = wandb_workspace.build(entity, project, args.name)
    if args.dry_run:
        panels = wandb_workspace.PANELS
        if args.out:
            with open(args.out, "w") as f:
                json.dump(wandb_workspace.spec(workspace), f, indent=1)
            print(f"wrote the workspace spec ({len(panels)} panels) to {args.out}; nothing was saved to wandb")
        else:
            for p in panels:
                print(f"{p.section}: {p.title}: {', '.join(p.keys)}")
        return 0
    try:
        url = wandb_workspace.save(workspace)
    except RuntimeError as e:
        print(f"error: {e}")
        return 1
    print(f"saved workspace {args.name!r}: {url}")
    return 0


# -- registry ---------------------------------------------------------------

# name -> (help, add_arguments, run). Add new subcommands here.
COMMANDS: dict[str, tuple[str, Callable, Callable]] = {
    "plan": ("Young checkpoint-interval table for given checkpoint costs or a cluster's tiers",
             _plan_args, cmd_plan),
    "simulate": ("replay a failure trace through checkpoint policies", _simulate_args, cmd_simulate),
    "summary": ("what the plugin did in a run: saves, recoveries, delta per tier", _summary_args, cmd_summary),
    "ls": ("list checkpoint steps per tier and node folder: committed, size, age; or a node "
           "folder's jobs", _ls_args, cmd_ls),
    "clean": ("remove other jobs' stale steps from a node's local folder (--dry-run first)",
              _clean_args, cmd_clean),
    "verify": ("check every checksum under a step, tier or dump folder; non-zero on failure", _verify_args, cmd_verify),
    "wandb-workspace": ("save a wandb workspace with the ckpt/ panels (--dry-run --out FILE: as JSON)",
                        _wandb_workspace_args, cmd_wandb_workspace),
    "report": ("PNG plots of delta, write time, interval and MTBF from the events file", _report_args, cmd_report),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="titan-ckpt", description="titan_ckpt_plus tools")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_args, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
