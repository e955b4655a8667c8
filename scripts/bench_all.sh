#!/usr/bin/env bash
# Regenerates BENCHMARKS.md in one run on this machine: every benchmark script (each
# rewrites its own section, measuring the machine's limits in the same run), the fault
# matrix, then the table of every target and whether it is met. 40-65 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export OMP_NUM_THREADS=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline \
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
PY=.venv/bin/python
OUT=BENCHMARKS.md
rm -rf outputs/bench-targets
$PY scripts/bench_save.py --update "$OUT"
$PY scripts/bench_replication.py --update "$OUT"
$PY scripts/bench_data.py --update "$OUT"
$PY scripts/bench_policy.py --update "$OUT"
$PY scripts/bench_overhead.py --bare --update "$OUT"
$PY scripts/bench_controls.py --update "$OUT"
$PY scripts/bench_cpu.py --update "$OUT"
$PY scripts/chaos.py --update "$OUT" || true  # a failed scenario shows in the targets table
$PY scripts/benchmd.py "$OUT" save replication data policy overhead controls cpu chaos
