"""Simulation benchmark of checkpoint-interval policies at the Llama 3 failure rate.

Prints a markdown table; with ``--update BENCHMARKS.md`` it also replaces
(or appends) the "## Adaptive intervals (simulation)" section of that file,
leaving every other section alone.

    .venv/bin/python scripts/bench_policy.py --update BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from titan_ckpt_plus.policy.simulate import Job, PoissonTrace, simulate, standard_policies  # noqa: E402
from titan_ckpt_plus.policy.young import LLAMA3_MTBF_S  # noqa: E402

SECTION = "## Adaptive intervals (simulation)"
COMMAND = ".venv/bin/python scripts/bench_policy.py --update BENCHMARKS.md"


def run(seeds: int, warmup: int) -> tuple[str, list[list[str]]]:
    """Mean wasted fraction per policy over ``seeds`` Poisson traces."""
    job = Job(total_work_s=54 * 86400, step_time_s=5.0, delta_local_s=10.0, delta_pfs_s=120.0,
              restart_s=300.0, p_unrecoverable=0.1)
    m = LLAMA3_MTBF_S
    priors = [m / 10, m, m * 10]
    names, whole, warmed, failures, final = [], {}, {}, [], {}
    for seed in range(seeds):
        trace = PoissonTrace(m, seed)
        for window, out in ((0, whole), (warmup, warmed)):
            policies = standard_policies(job, m, priors, prior_weight=1.0, fixed_steps=[100, 500, 2000])
            for p in policies:
                r = simulate(job, p, trace, seed, warmup_failures=window)
                out.setdefault(p.name, []).append(r.wasted_fraction)
                final[p.name] = r.final_intervals
                if p.name == "oracle" and window == 0:
                    failures.append(r.failures)
            names = [p.name for p in policies]
    labels = {names[1]: "adaptive, prior 0.1x MTBF", names[2]: "adaptive, prior 1x MTBF",
              names[3]: "adaptive, prior 10x MTBF"}
    oracle_whole, oracle_warm = statistics.mean(whole["oracle"]), statistics.mean(warmed["oracle"])
    rows = []
    for n in names:
        w, a = statistics.mean(whole[n]), statistics.mean(warmed[n])
        rows.append([labels.get(n, n), f"{w * 100:.2f}%", f"{w / oracle_whole:.3f}",
                     f"{a / oracle_warm:.3f}", f"{final[n][0]} / {final[n][1]}"])
    setup = (
        f"Llama 3 failure rate: MTBF {m / 3600:.2f} h (419 interruptions in 54 days), Poisson, "
        f"{seeds} seeds ({statistics.mean(failures):.0f} failures per run on average). "
        f"Job: 54 days of compute, step time {job.step_time_s:g} s, local save blocks {job.delta_local_s:g} s, "
        f"PFS save blocks {job.delta_pfs_s:g} s, restart {job.restart_s:g} s, "
        f"{job.p_unrecoverable:.0%} of failures not recoverable from the local tier. "
        "Adaptive: IntervalController + GammaPoissonMTBF (prior weight 1 pseudo-failure), Young's rule. "
        "Fixed N: local save every N steps, PFS save every 10 N steps. "
        "Oracle: Young's interval per tier from the true MTBF and true costs. "
        "Wasted = (blocking + lost work + restart) / wall time, mean over seeds. "
        "Fixed 100 happens to sit at Young's interval for these costs; 500 and 2000 are untuned. "
        "Ratios below 1 are within noise: the oracle is Young's first-order optimum, not an exact one."
    )
    return setup, rows


sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmd import record_targets, update_section  # noqa: E402


def targets(rows: list[list[str]], warmup: int) -> list[tuple]:
    """Issue 4: a prior 10x off either way ends within 1.05x of the oracle after
    `warmup` failures, and beats every fixed interval not tuned to the true MTBF."""
    after = {r[0]: float(r[3]) for r in rows}
    untuned = [after["fixed 500"], after["fixed 2000"]]
    out = []
    for label in ("adaptive, prior 0.1x MTBF", "adaptive, prior 10x MTBF"):
        out.append((f"{label}: waste / oracle's after {warmup} failures", f"{after[label]:.3f}",
                    "<= 1.05", after[label] <= 1.05))
        out.append((f"{label}: beats untuned fixed 500 and 2000", f"{after[label]:.3f} vs "
                    f"{min(untuned):.3f}", "lower", after[label] < min(untuned)))
    return out


def markdown(setup: str, rows: list[list[str]], warmup: int) -> str:
    header = ["policy", "wasted", "vs oracle", f"vs oracle after {warmup} failures", "final interval local / PFS (steps, last seed)"]
    lines = [f"Command: `{COMMAND}`", "", setup, ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--warmup-failures", type=int, default=5)
    parser.add_argument("--update", type=Path, default=None, help="markdown file whose section to replace")
    args = parser.parse_args()
    t0 = time.perf_counter()
    setup, rows = run(args.seeds, args.warmup_failures)
    record_targets("policy", targets(rows, args.warmup_failures))
    section = markdown(setup, rows, args.warmup_failures)
    print(SECTION + "\n\n" + section)
    print(f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    if args.update:
        update_section(args.update, SECTION, section)


if __name__ == "__main__":
    main()
