"""A/B on the overhead jobs (issue 15): the same jobs as bench_overhead.py's (tiers on,
local every 3 steps, PFS every 6), run from a git worktree of `--other` and from this
work tree in turn, or from this work tree as `--model` and as `--variant` (a row of
bench_overhead.MODELS: the same job with other plugin keys), interleaved (the machine's
speed drifts over minutes), pooled per side and printed side by side: step inflation by
kind of step, where the steps' time goes, and the background threads' CPU by phase.

    .venv/bin/python scripts/bench_ab.py --other HEAD~1 [--runs 4] [--model debugmodel]
    .venv/bin/python scripts/bench_ab.py --variant debugmodel-helper [--runs 4] [--model debugmodel]
    .venv/bin/python scripts/bench_ab.py --other HEAD --variant debugmodel-gloo  # three sides

A change to the plugin's background work moves debugmodel's step figures by less than
they move between two such runs (BENCHMARKS.md, overhead against the bytes' own cost):
judge a change by several runs, not one.
"""

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))
import bench_overhead as bo  # noqa: E402

# One job, from the checkout given as argv[1] (its harness puts that checkout first on
# the ranks' PYTHONPATH), into the folder argv[2].
_JOB = ("import sys; from pathlib import Path; root = Path(sys.argv[1]); "
        "sys.path[:0] = [str(root / 'scripts'), str(root / 'tests'), str(root)]; "
        "import bench_overhead as bo; bo.run_job(Path(sys.argv[2]), sys.argv[3], tiers=True)")


def worktree(rev: str, where: Path) -> Path:
    """A checkout of `rev` beside this one, with this one's generated demo assets."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(where), rev], check=True)
    if (ROOT / "assets").is_dir():
        shutil.copytree(ROOT / "assets", where / "assets", dirs_exist_ok=True)
    return where


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--other", help="the revision to compare this work tree with")
    ap.add_argument("--variant", choices=sorted(bo.MODELS), help="the job to compare --model's with")
    ap.add_argument("--runs", type=int, default=4, help="jobs each way")
    ap.add_argument("--model", default="debugmodel", choices=sorted(bo.MODELS))
    args = ap.parse_args()
    if not (args.other or args.variant):
        ap.error("--other, --variant or both (three sides)")
    base = Path(tempfile.mkdtemp(prefix="bench-ab-"))
    other = worktree(args.other, base / "other") if args.other else None
    # side name -> (checkout, job)
    sides = {args.other: (other, args.model)} if other else {}
    sides["work tree" if other else args.model] = (ROOT, args.model)
    if args.variant:
        sides[args.variant] = (ROOT, args.variant)
    works: dict = {name: [] for name in sides}
    try:
        for i in range(args.runs):
            for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
                checkout, job = sides[name]
                work = base / f"{name.replace(' ', '-')}-{i}"
                proc = subprocess.run([sys.executable, "-c", _JOB, str(checkout), str(work), job],
                                      capture_output=True, text=True)
                if proc.returncode:
                    sys.exit(f"a job of {name} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
                works[name].append(work)
                print(f"{name}: job {i + 1} of {args.runs}", flush=True)
        steps, ranks = bo.MODELS[args.model][3], bo.MODELS[args.model][4]
        print(f"\n{args.model}, {args.runs} jobs each way, interleaved\n")
        print("| side | undisturbed step | local save | a PFS save's local save + drain start | "
              "rest of the drain | a PFS period in all, in steps |")
        print("|---|---|---|---|---|---|")
        for name, ws in works.items():
            infl, und = bo.inflation(ws, steps)
            print(f"| {name} | {und:.3f} s | {bo.shown(infl, 'local')} | {bo.shown(infl, 'local_drain')} | "
                  f"{bo.shown(infl, 'drain')} | {bo.shown(infl, 'all', '+.2f')} |")
        for name, ws in works.items():
            print(f"\n- {name}, where a step's time goes, ms: {bo.where_time_goes(ws, steps, ranks)}")
            print(f"- {name}, rank 0, CPU ms by phase (wall ms): a save's write: "
                  f"{bo.phases(bo.later(ws, 'local_commit'))}; a drain: {bo.phases(bo.later(ws, 'pfs_commit'))}")
    finally:
        if other is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], check=False)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
